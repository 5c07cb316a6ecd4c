"""Offline long-context tasks: word lists, a byte-level BPE tokenizer trained on task text, and
token-exact generators of needle, passkey, variable-tracking, associative-recall and copy samples,
and real English prose from the Python standard library (`prose`) for real-text haystacks.

The package owns the material both training (`training_example`) and evaluation
(`hybridkv.eval.tasks`) draw from, so a model is trained and scored on the same token layouts.
"""
