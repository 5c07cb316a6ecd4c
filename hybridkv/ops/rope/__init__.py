from hybridkv.ops.rope.reference import apply_rope, rope_freqs, yarn_inv_freq  # noqa: F401
