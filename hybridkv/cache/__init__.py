"""Where KV lives: byte layouts, and (with the engine) the block pool, prefix index and tiers."""
