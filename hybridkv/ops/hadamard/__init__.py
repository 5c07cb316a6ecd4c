from hybridkv.ops.hadamard.reference import hadamard_matrix, hadamard_transform  # noqa: F401
