"""Memory policies: which compressed KV stays on the device during decoding (the rest waits in
host memory), from simple baselines (recency, random, oracle) to FlashMemory's lookahead recall."""

from hybridkv.memory.policies import MemoryPolicy, PolicyContext, parse_policy  # noqa: F401
