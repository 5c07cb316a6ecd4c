"""The DeepSeek-V4 model as nn.Modules. Modules hold weights only; every piece of per-request
state (window ring, compressor partial blocks, compressed KV, indexer keys) is handed in from
outside through `ForwardBatch` (see `state.py`)."""

from hybridkv.model.state import ContiguousKV, ForwardBatch, Segment  # noqa: F401
from hybridkv.model.transformer import Transformer  # noqa: F401
