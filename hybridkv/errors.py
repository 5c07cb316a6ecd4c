"""Exceptions a user can cause, and how a command line reports them. Each names the thing that is
wrong and, where possible, the fix."""

import functools
import sys


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on purpose."""


class ConfigError(HybridKVError, ValueError):
    """A model config (config.json, preset or override) is invalid."""


class CheckpointError(HybridKVError):
    """A checkpoint directory is missing, incomplete, or does not match its config."""


class RequestError(HybridKVError, ValueError):
    """A generation request is invalid (prompt too long, bad sampling parameter, ...)."""


class TrainingError(HybridKVError, ValueError):
    """A training command cannot run as asked: an unknown recipe, a bad override, a missing or
    mismatched --init-from model, a run directory with nothing to resume or export."""


class CacheEntryError(HybridKVError):
    """A stored KV cache entry (disk file, Redis value) is corrupt, truncated, or was written for
    another model or entry layout. It is never loaded; the tier removes it."""


def reports_errors(main):
    """Wrap a command's `main(argv) -> int` so that a user's mistake (a HybridKVError) prints one
    line, `error: ...`, on stderr and exits 2, with no traceback; any other exception is a bug and
    keeps its traceback."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except HybridKVError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run
