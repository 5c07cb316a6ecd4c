"""The bytes a request costs, by kind of entry and KV format.

Formats (SPEC §2.2; their bytes in `hybridkv.ops.kv_formats`), per entry:
- "fp8" (V4 deployment): main KV = nope dims e4m3 + rope dims bf16 + one ue8m0 scale per 64 nope
  dims, padded to 8 bytes (584 B at head_dim 512); indexer key = E2M1 pairs + one ue8m0 scale per
  32 (68 B at 128); window rows use the main layout.
- "bf16" (the reference's storage): 2 bytes per dim.
- "v41" (V4.1 deployment): global KV = E2M1 pairs + one e4m3 scale per 16 (288 B); window KV =
  e4m3 + one ue8m0 scale per 32 (528 B); indexer key as fp8.
The growing part of a request is its compressed entries (one per `ratio` tokens per layer that
stores them); the fixed part is every layer's window ring plus the compressors' float32
partial-block state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.config import ModelConfig
from hybridkv.ops.kv_formats import index_entry_bytes, main_entry_bytes
from hybridkv.errors import ConfigError

FORMATS = ("fp8", "bf16", "v41")


@dataclass(frozen=True)
class EntryBytes:
    main: int      # one compressed (global) KV entry
    index: int     # one indexer key
    window: int    # one window (SWA) row


def entry_bytes(config: ModelConfig, fmt: str) -> EntryBytes:
    if fmt not in FORMATS:
        raise ConfigError(f"unknown KV format {fmt!r}; choose one of {', '.join(FORMATS)}")
    d, rd, di = config.head_dim, config.qk_rope_head_dim, config.index_head_dim
    if config.family == "v3.2":
        latent = config.kv_lora_rank
        if fmt == "bf16":
            return EntryBytes((latent + rd) * 2, di * 2, 0)
        # FlashMLA V3.2 fp8: e4m3 latent + 4 float32 scales + bf16 rope; indexer e4m3 + float32 scale
        return EntryBytes(latent + 4 * 4 + rd * 2, di + 4, 0)
    if fmt == "bf16":
        return EntryBytes(d * 2, di * 2, d * 2)
    if fmt == "fp8":
        main = main_entry_bytes(d, rd)
        return EntryBytes(main, index_entry_bytes(di), main)
    return EntryBytes(d // 2 + d // 16, index_entry_bytes(di), d + d // 32)


@dataclass
class KVLayout:
    """What one request costs in a given format."""

    config: ModelConfig
    fmt: str
    entries: EntryBytes
    per_token: dict[str, float] = field(default_factory=dict)   # growing part, by kind
    fixed: dict[str, int] = field(default_factory=dict)         # per request, by kind

    @property
    def bytes_per_token(self) -> float:
        return sum(self.per_token.values())

    @property
    def fixed_bytes(self) -> int:
        return sum(self.fixed.values())

    def total(self, context: int) -> float:
        """Bytes of one request holding `context` tokens (growing part counted per token, as the
        papers do; whole compressed entries are count // ratio)."""
        return self.bytes_per_token * context + self.fixed_bytes


def kv_layout(config: ModelConfig, fmt: str | None = None) -> KVLayout:
    fmt = fmt or default_format(config)
    eb = entry_bytes(config, fmt)
    lay = KVLayout(config, fmt, eb)
    if config.family == "v3.2":
        n = config.num_hidden_layers
        lay.per_token = {"MLA latent": n * eb.main, "DSA indexer": n * eb.index}
        return lay
    ratios = config.compress_ratios
    n_all = len(ratios)
    if config.family == "v4.1":
        sources = config.kv_source_layer_ids or ()
        lay.per_token = {
            "global KV": sum(eb.main / ratios[i] for i in sources),
            "indexer keys": sum(eb.index / ratios[i] for i in sources),
        }
        lay.fixed = {"window": n_all * config.sliding_window * eb.window,
                     "compressor state": sum(_compressor_state_bytes(config, i) for i in sources)}
        return lay
    csa = [i for i in range(n_all) if config.layer_kind(i) == "csa"]
    hca = [i for i in range(n_all) if config.layer_kind(i) == "hca"]
    lay.per_token = {
        "CSA main": sum(eb.main / ratios[i] for i in csa),
        "CSA indexer": sum(eb.index / ratios[i] for i in csa),
        "HCA": sum(eb.main / ratios[i] for i in hca),
    }
    lay.fixed = {
        "window": n_all * config.sliding_window * eb.window,
        "compressor state": sum(_compressor_state_bytes(config, i) for i in csa + hca),
    }
    return lay


def _compressor_state_bytes(config: ModelConfig, layer_id: int) -> int:
    """float32 kv + score rows of the pending block(s): a CSA layer's overlapping compressor keeps
    2·ratio rows × 2d (and its indexer's 2·ratio rows × 2·d_index), others `ratio` rows × d; V4.1's
    ratio-1 compressor keeps nothing."""
    ratio = config.layer_ratio(layer_id)
    if ratio <= 1:
        return 0
    if config.layer_kind(layer_id) == "csa":
        return 2 * 4 * (2 * ratio * 2 * config.head_dim + 2 * ratio * 2 * config.index_head_dim)
    return 2 * 4 * ratio * config.head_dim


def default_format(config: ModelConfig) -> str:
    return "v41" if config.family == "v4.1" else "fp8"
