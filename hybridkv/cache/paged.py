"""Paged device storage of every request's KV, and the per-request view the model reads it through.

Growing part (paged, shared through the prefix cache): per compressing layer a pool of
`[num_blocks, block_tokens // ratio, E]` main entries, and per CSA layer a pool of
`[num_blocks, block_tokens // 4, Ei]` indexer keys. Compressed entry j of a ratio-r layer lives in
block `block_table[j // (block_tokens // r)]`, row `j % (block_tokens // r)`.

Fixed part (per request slot): every layer's window ring `[W, E]` indexed by `pos % W`, and every
compressor's float32 partial-block state.

Entry formats: "native" keeps entries in the model's compute dtype (exact); "bf16" in bf16; "fp8"
packs them as deployed (584-byte main/window entries, 68-byte FP4 indexer keys; see formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.cache.block_pool import BlockPool
from hybridkv.cache.formats import (index_entry_bytes, main_entry_bytes, pack_index_fp4, pack_main_fp8,
                                    unpack_index_fp4, unpack_main_fp8)
from hybridkv.config import ModelConfig
from hybridkv.errors import ConfigError
from hybridkv.model.state import CompressorState

KV_FORMATS = ("native", "bf16", "fp8")


class _Codec:
    """How entries of one width are stored: a dtype, or packed bytes."""

    def __init__(self, fmt: str, kind: str, config: ModelConfig, dtype: torch.dtype):
        self.fmt, self.kind, self.dtype = fmt, kind, dtype
        self.dim = config.index_head_dim if kind == "index" else config.head_dim
        self.rope = config.qk_rope_head_dim
        if fmt == "fp8":
            self.width = index_entry_bytes(self.dim) if kind == "index" else main_entry_bytes(self.dim, self.rope)
            self.storage_dtype = torch.uint8
        else:
            self.width = self.dim
            self.storage_dtype = torch.bfloat16 if fmt == "bf16" else dtype

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., dim] entries -> [..., width] stored form."""
        if self.fmt != "fp8":
            return rows.to(self.storage_dtype)
        flat = rows.reshape(-1, self.dim)
        packed = pack_index_fp4(flat) if self.kind == "index" else pack_main_fp8(flat, self.rope)
        return packed.reshape(*rows.shape[:-1], self.width)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """[..., width] stored form -> [..., dim] entries in the compute dtype."""
        if self.fmt != "fp8":
            return stored.to(self.dtype)
        flat = stored.reshape(-1, self.width)
        if self.kind == "index":
            out = unpack_index_fp4(flat, self.dim, self.dtype)
        else:
            out = unpack_main_fp8(flat, self.dim, self.rope, self.dtype)
        return out.reshape(*stored.shape[:-1], self.dim)

    def row_bytes(self) -> int:
        return self.width * torch.empty(0, dtype=self.storage_dtype).element_size()


@dataclass
class SeqCache:
    """A request's place in the store: its slot, its block table, and what it may not overwrite."""

    slot: int
    block_table: list[int] = field(default_factory=list)
    window_start: int = 0      # earliest position whose window row is valid (bounded replay starts later)
    frozen_until: int = 0      # entries complete before this position come from the prefix cache


class PagedKVStore:
    def __init__(self, config: ModelConfig, num_blocks: int, max_slots: int, kv_format: str = "native",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if kv_format not in KV_FORMATS:
            raise ConfigError(f"unknown KV format {kv_format!r}; choose one of {', '.join(KV_FORMATS)}")
        if kv_format == "fp8" and not config.kv_pow2_scales:
            raise ConfigError("the fp8 KV format stores ue8m0 (power-of-two) scales, but this checkpoint's KV round "
                              "trips use plain scales (no quantization_config with scale_fmt ue8m0); use 'native' or 'bf16'")
        self.config, self.fmt, self.dtype, self.device = config, kv_format, dtype, torch.device(device)
        self.block_tokens = config.block_tokens
        self.num_layers = config.num_hidden_layers
        self.pool = BlockPool(num_blocks)
        self.max_slots = max_slots
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.codec = {k: _Codec(kv_format, k, config, dtype) for k in ("kv", "index")}
        W = config.sliding_window
        main = self.codec["kv"]
        self.ring = [torch.zeros(max_slots, W, main.width, dtype=main.storage_dtype, device=self.device)
                     for _ in range(self.num_layers)]
        self.entries: list[dict[str, torch.Tensor]] = []
        self.states: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for layer_id in range(self.num_layers):
            ratio = config.layer_ratio(layer_id)
            ents, sts = {}, {}
            if ratio:
                kinds = ("kv", "index") if ratio == 4 else ("kv",)
                coff = 2 if ratio == 4 else 1
                for kind in kinds:
                    c = self.codec[kind]
                    ents[kind] = torch.zeros(num_blocks, self.block_tokens // ratio, c.width, dtype=c.storage_dtype,
                                             device=self.device)
                    rows, width = coff * ratio, coff * c.dim
                    sts[kind] = (torch.zeros(max_slots, rows, width, dtype=torch.float32, device=self.device),
                                 torch.full((max_slots, rows, width), float("-inf"), dtype=torch.float32,
                                            device=self.device))
            self.entries.append(ents)
            self.states.append(sts)

    # ----- slots -----
    def new_seq(self) -> SeqCache:
        if not self._free_slots:
            raise RuntimeError("no free request slot")
        slot = self._free_slots.pop()
        self.reset_slot(slot)
        return SeqCache(slot)

    def reset_slot(self, slot: int) -> None:
        for sts in self.states:
            for kv, score in sts.values():
                kv[slot].zero_()
                score[slot].fill_(float("-inf"))

    def free_seq(self, seq: SeqCache) -> None:
        # last block first: cached blocks are evicted oldest-freed first, so a prefix loses its
        # tail before its head (the head is what most later requests share)
        for b in reversed(seq.block_table):
            self.pool.release(b)
        seq.block_table = []
        self._free_slots.append(seq.slot)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def view(self, seq: SeqCache, on_layer_done=None) -> "PagedSeqKV":
        """The model-facing view of one request; `on_layer_done(layer_id, end_pos)` is called when a
        layer has processed the request up to end_pos."""
        return PagedSeqKV(self, seq, on_layer_done)

    # ----- window/compressor state snapshots (for prefix hits at block boundaries) -----
    def capture_state(self, slot: int, layer_id: int) -> list[torch.Tensor]:
        out = [self.ring[layer_id][slot].clone()]
        for kv, score in self.states[layer_id].values():
            out += [kv[slot].clone(), score[slot].clone()]
        return out

    def restore_state(self, slot: int, layer_id: int, tensors: list[torch.Tensor]) -> None:
        self.ring[layer_id][slot].copy_(tensors[0])
        for i, (kv, score) in enumerate(self.states[layer_id].values()):
            kv[slot].copy_(tensors[1 + 2 * i])
            score[slot].copy_(tensors[2 + 2 * i])

    # ----- accounting -----
    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes allocated on the device, by kind (whole pools, whatever is in use)."""
        out = {"window": sum(r.nbytes for r in self.ring), "compressor state": 0, "CSA main": 0, "CSA indexer": 0,
               "HCA": 0}
        for layer_id, ents in enumerate(self.entries):
            kind = self.config.layer_kind(layer_id)
            for k, t in ents.items():
                out["CSA indexer" if k == "index" else ("CSA main" if kind == "csa" else "HCA")] += t.nbytes
            out["compressor state"] += sum(a.nbytes + b.nbytes for a, b in self.states[layer_id].values())
        return out

    def block_bytes(self) -> dict[str, int]:
        """Bytes one block (block_tokens positions) holds in every layer, by kind."""
        out = {"CSA main": 0, "CSA indexer": 0, "HCA": 0}
        for layer_id, ents in enumerate(self.entries):
            kind = self.config.layer_kind(layer_id)
            for k, t in ents.items():
                out["CSA indexer" if k == "index" else ("CSA main" if kind == "csa" else "HCA")] += t[0].nbytes
        return out

    def bytes_per_token(self) -> float:
        return sum(self.block_bytes().values()) / self.block_tokens

    def used_bytes(self) -> int:
        """Device bytes held by blocks in use plus the state of slots in use."""
        per_block = sum(self.block_bytes().values())
        per_slot = (sum(r[0].nbytes for r in self.ring)
                    + sum(a[0].nbytes + b[0].nbytes for s in self.states for a, b in s.values()))
        return self.pool.num_used * per_block + (self.max_slots - len(self._free_slots)) * per_slot


class _PagedCompressorState(CompressorState):
    """Views of one slot's rows in the store (the compressor updates them in place)."""

    def __init__(self, kv: torch.Tensor, score: torch.Tensor, ratio: int):  # noqa: D107 - no allocation
        self.ratio, self.overlap, self.kv, self.score = ratio, ratio == 4, kv, score


class PagedLayerKV:
    def __init__(self, store: PagedKVStore, seq: SeqCache, layer_id: int, on_done=None):
        self.store, self.seq, self.layer_id, self.on_done = store, seq, layer_id, on_done
        self.ratio = store.config.layer_ratio(layer_id)
        self.window = store.config.sliding_window

    def window_rows(self, start_pos: int) -> torch.Tensor:
        first = max(self.seq.window_start, start_pos - self.window, 0)
        slots = torch.arange(first, start_pos, device=self.store.device) % self.window
        return self.store.codec["kv"].decode(self.store.ring[self.layer_id][self.seq.slot][slots])

    def write_window(self, start_pos: int, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        keep = min(n, self.window)
        pos = torch.arange(start_pos + n - keep, start_pos + n, device=self.store.device)
        self.store.ring[self.layer_id][self.seq.slot][pos % self.window] = self.store.codec["kv"].encode(rows[n - keep:])

    def compressor_state(self, kind: str) -> CompressorState:
        kv, score = self.store.states[self.layer_id][kind]
        return _PagedCompressorState(kv[self.seq.slot], score[self.seq.slot], self.ratio)

    def _locate(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_block = self.store.block_tokens // self.ratio
        j = torch.arange(first, first + n)
        table = torch.tensor(self.seq.block_table, dtype=torch.long)
        return table[j // per_block].to(self.store.device), (j % per_block).to(self.store.device)

    def append_entries(self, kind: str, first: int, rows: torch.Tensor) -> None:
        frozen = self.seq.frozen_until // self.ratio  # entries a prefix hit already provides
        if first + rows.shape[0] <= frozen:
            return
        if first < frozen:
            rows, first = rows[frozen - first:], frozen
        blocks, offs = self._locate(first, rows.shape[0])
        self.store.entries[self.layer_id][kind][blocks, offs] = self.store.codec[kind].encode(rows)

    def entries(self, kind: str, count: int) -> torch.Tensor:
        if count == 0:
            return torch.zeros(0, self.store.codec[kind].dim, dtype=self.store.dtype, device=self.store.device)
        per_block = self.store.block_tokens // self.ratio
        nb = -(-count // per_block)
        table = torch.tensor(self.seq.block_table[:nb], dtype=torch.long, device=self.store.device)
        pool = self.store.entries[self.layer_id][kind]
        rows = pool.index_select(0, table).reshape(nb * per_block, pool.shape[-1])[:count]
        return self.store.codec[kind].decode(rows)

    def done(self, end_pos: int) -> None:
        """The layer has processed this request up to end_pos (a snapshot point, maybe)."""
        if self.on_done is not None:
            self.on_done(self.layer_id, end_pos)


class PagedSeqKV:
    """The model-facing view (`SequenceKV`) of one request in a PagedKVStore."""

    def __init__(self, store: PagedKVStore, seq: SeqCache, on_layer_done=None):
        self.store, self.seq = store, seq
        self._layers = [PagedLayerKV(store, seq, i, on_layer_done) for i in range(store.num_layers)]

    def layer(self, layer_id: int) -> PagedLayerKV:
        return self._layers[layer_id]


class PagedDecodeKV:
    """The batched (`DecodeKV`) view of a group of requests that each decode one token."""

    def __init__(self, store: PagedKVStore, seqs: list[SeqCache], positions: torch.Tensor, on_layer_done=None):
        self.store, self.seqs, self.on_layer_done = store, seqs, on_layer_done
        dev = store.device
        self.positions = positions.to(dev)
        self.slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        width = max(len(s.block_table) for s in seqs)
        self.tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                   dtype=torch.long, device=dev)
        self.window_start = torch.tensor([s.window_start for s in seqs], dtype=torch.long, device=dev)
        self.frozen = torch.tensor([s.frozen_until for s in seqs], dtype=torch.long, device=dev)
        self._b = torch.arange(len(seqs), device=dev)

    def window(self, layer_id: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        W = self.store.config.sliding_window
        ring = self.store.ring[layer_id]
        codec = self.store.codec["kv"]
        ring[self.slots, self.positions % W] = codec.encode(rows)
        window_pos = self.positions.unsqueeze(1) - W + 1 + torch.arange(W, device=rows.device)
        keys = codec.decode(ring[self.slots.unsqueeze(1), window_pos % W])
        return keys, window_pos >= self.window_start.clamp(min=0).unsqueeze(1)

    def compressor_state(self, layer_id: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        kv, score = self.store.states[layer_id][kind]
        return kv[self.slots], score[self.slots]

    def store_compressor_state(self, layer_id: int, kind: str, kv: torch.Tensor, score: torch.Tensor) -> None:
        st_kv, st_score = self.store.states[layer_id][kind]
        st_kv[self.slots] = kv
        st_score[self.slots] = score

    def _per_block(self, layer_id: int) -> int:
        return self.store.block_tokens // self.store.config.layer_ratio(layer_id)

    def append_entries(self, layer_id: int, kind: str, which: torch.Tensor, entry_ids: torch.Tensor,
                       rows: torch.Tensor) -> None:
        ratio = self.store.config.layer_ratio(layer_id)
        keep = entry_ids >= self.frozen[which] // ratio     # entries a prefix hit provides stay as they are
        which, entry_ids, rows = which[keep], entry_ids[keep], rows[keep]
        per = self._per_block(layer_id)
        blocks = self.tables[which, entry_ids // per]
        self.store.entries[layer_id][kind][blocks, entry_ids % per] = self.store.codec[kind].encode(rows)

    def entries(self, layer_id: int, kind: str, counts: torch.Tensor) -> torch.Tensor:
        per = self._per_block(layer_id)
        nb = max(1, -(-int(counts.max()) // per))
        pool = self.store.entries[layer_id][kind]
        rows = pool[self.tables[:, :nb]]                                   # [B, nb, per, E]
        rows = rows.reshape(rows.shape[0], nb * per, rows.shape[-1])
        return self.store.codec[kind].decode(rows)

    def gather_entries(self, layer_id: int, kind: str, idx: torch.Tensor) -> torch.Tensor:
        per = self._per_block(layer_id)
        blocks = self.tables[self._b.unsqueeze(1), idx // per]
        return self.store.codec[kind].decode(self.store.entries[layer_id][kind][blocks, idx % per])

    def done(self, layer_id: int) -> None:
        if self.on_layer_done is not None:
            for seq, pos in zip(self.seqs, self.positions.tolist()):
                self.on_layer_done(seq, layer_id, pos + 1)
