"""The DeepSeek-V4 and V4.1 models as nn.Modules (one model; the config's family selects the V4.1
parts: CSA2 layer sharing in `csa2.py`, single-pass mHC, the V4.1 compressor, gate and storage
round trips). Modules hold weights only; every piece of per-request state (window ring,
compressor partial blocks, compressed KV, indexer keys) is handed in from outside through
`ForwardBatch` (see `state.py`)."""

from hybridkv.model.state import ContiguousKV, ForwardBatch, Segment  # noqa: F401
from hybridkv.model.transformer import Transformer  # noqa: F401
