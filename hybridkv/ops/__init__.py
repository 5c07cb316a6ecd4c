"""Numerical operators of the V4 family. Each op lives in its own folder: `reference.py` is the
plain-torch definition that reads like the math; a folder may add faster implementations behind
the same public function (re-exported from its `__init__`)."""
