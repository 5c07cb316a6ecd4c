from hybridkv.ops.indexer_topk.reference import (  # noqa: F401
    candidate_blocks,
    causal_topk,
    index_scores,
    mask_invisible,
)
