from hybridkv.ops.sparse_attn.reference import sparse_attn  # noqa: F401
