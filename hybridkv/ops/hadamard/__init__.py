from hybridkv.ops.hadamard.reference import hadamard_transform  # noqa: F401
