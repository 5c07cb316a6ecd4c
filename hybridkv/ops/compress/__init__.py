from hybridkv.ops.compress.reference import pool_blocks, softmax_pool  # noqa: F401
