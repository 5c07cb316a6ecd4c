from hybridkv.ops.indexer_topk.reference import causal_topk, index_scores  # noqa: F401
