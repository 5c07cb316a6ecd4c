from hybridkv.ops.sinkhorn.reference import hc_split_sinkhorn  # noqa: F401
