"""Exceptions a user can cause. Each names the thing that is wrong and, where possible, the fix."""


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on purpose."""


class ConfigError(HybridKVError, ValueError):
    """A model config (config.json, preset or override) is invalid."""


class CheckpointError(HybridKVError):
    """A checkpoint directory is missing, incomplete, or does not match its config."""


class RequestError(HybridKVError, ValueError):
    """A generation request is invalid (prompt too long, bad sampling parameter, ...)."""


class CacheEntryError(HybridKVError):
    """A stored KV cache entry (disk file, Redis value) is corrupt, truncated, or was written for
    another model or entry layout. It is never loaded; the tier removes it."""
