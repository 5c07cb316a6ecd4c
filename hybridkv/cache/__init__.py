"""Where KV lives: bytes per request (layout), and (with the engine) the block pool, prefix index and tiers."""
