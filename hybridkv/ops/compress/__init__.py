from hybridkv.ops.compress.reference import pool_blocks, pool_each, softmax_pool  # noqa: F401
