"""Tiered, lifetime-aware storage of the prefix cache below the device pool (SPEC §2.5).

    device pool (block_pool + snapshots)  ->  host DRAM (TTL per kind)  ->  disk directory
    (size limit, LRU, lifetime 72 h)  ->  optionally a Redis server shared by several engines

What is stored follows its lifetime: compressed KV and indexer keys of each complete block
("block" records, long-lived) and, under the `full` and `checkpoint(N)` window policies, the window
and compressor state at block boundaries ("state" records, short-lived). Records are addressed by
the prefix chain hash (model identity + cache salt) and carry the model/layout identity and a
checksum. Modules: `record` (the item and its byte format), `convert` (device store <-> records),
`dram`, `disk`, `redis_tier` (the tiers), `store` (the chain, promotion, the background writer),
`config` (TierConfig and the --kv-* options).
"""

from hybridkv.cache.tiers.config import TierConfig, add_tier_arguments, tier_config_from_args  # noqa: F401
from hybridkv.cache.tiers.record import Record  # noqa: F401
from hybridkv.cache.tiers.store import TieredStore  # noqa: F401
