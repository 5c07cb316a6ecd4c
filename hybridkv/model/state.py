"""The interface between the model and per-request KV state, and its simplest implementation.

The model never owns request state. For each forward it receives a `ForwardBatch`: a flat run of
tokens made of `Segment`s, one per request, each carrying that request's `SequenceKV` and the
absolute position of its first token. A batch may mix requests at any positions and lengths
(prefill chunks and decode steps together).

`SequenceKV` gives the model, per layer, a `LayerKV` with four things:
- the sliding-window ring (the last `window` tokens' KV rows),
- each compressor's fixed-size partial-block state (float32),
- the compressed entries appended so far, by kind ("kv": the main latent, "index": indexer keys).
`ContiguousKV` keeps all of it in per-request tensors. A paged store implements the same methods
over block tables without any change to the model. `layer_storage` says what each layer owns.

In DeepSeek-V4.1 only the Full (kv source) layers own compressed entries ("kv" and "index") and a
compressor state; every layer owns its window. Reindex and Reuse layers read their source's
entries through `kv.layer(config.kv_source(layer_id))`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridkv.config import ModelConfig
from hybridkv.ops.transfer import to_device


class CompressorState:
    """Token rows of the pending block(s): [coff·ratio, coff·d] kv and score (score includes ape).
    Overlapping compressors keep the previous complete block in rows [0, ratio) and the current
    partial block in [ratio, 2·ratio); others keep the current block in [0, ratio)."""

    def __init__(self, ratio: int, width: int, overlap: bool, device: torch.device | str | None = None):
        rows = ratio * (2 if overlap else 1)
        self.ratio, self.overlap = ratio, overlap
        self.kv = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.score = torch.full((rows, width), float("-inf"), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.score.nbytes

    def copy_(self, other: "CompressorState") -> None:
        self.kv.copy_(other.kv)
        self.score.copy_(other.score)


class LayerKV(Protocol):
    def window_rows(self, start_pos: int) -> torch.Tensor:
        """KV rows of positions [max(0, start_pos - window), start_pos), oldest first."""

    def write_window(self, start_pos: int, rows: torch.Tensor) -> None:
        """Record the rows of positions [start_pos, start_pos + len(rows))."""

    def compressor_state(self, kind: str) -> CompressorState: ...

    def append_entries(self, kind: str, first: int, rows: torch.Tensor) -> None:
        """Store compressed entries first, first+1, ... (entries arrive in order)."""

    def entries(self, kind: str, count: int) -> torch.Tensor:
        """The first `count` compressed entries [count, d]."""

    def done(self, end_pos: int) -> None:
        """Called when the layer has processed the request up to end_pos (a store may snapshot)."""

    # Optional: `record_compressor_rows(kind, start_pos, kv, score)` is called with the compressor's
    # per-token input rows before a segment's update (speculative decoding replays the accepted ones
    # after rolling the state back; engine/speculative.py).


def layer_storage(config: ModelConfig, layer_id: int) -> tuple[dict[str, int], dict[str, int], bool]:
    """What a layer owns besides its window: (width of each kind of compressed entry, width of each
    compressor state, whether the compressor overlaps blocks)."""
    ratio = config.layer_ratio(layer_id)
    if ratio == 0:
        return {}, {}, False
    if config.family == "v4.1":
        if config.layer_kind(layer_id) != "full":
            return {}, {}, False
        states = {"kv": config.head_dim} if ratio > 1 else {}
        return {"kv": config.head_dim, "index": config.index_head_dim}, states, False
    csa = config.layer_kind(layer_id) == "csa"   # overlapping compressors and the indexer's keys
    coff = 2 if csa else 1
    entry_widths = {"kv": config.head_dim}
    comp_widths = {"kv": coff * config.head_dim}
    if csa:
        entry_widths["index"] = config.index_head_dim
        comp_widths["index"] = coff * config.index_head_dim
    return entry_widths, comp_widths, csa


class ContiguousLayerKV:
    def __init__(self, window: int, width: int, ratio: int, entry_widths: dict[str, int],
                 compressor_widths: dict[str, int], overlap: bool, dtype: torch.dtype, device=None):
        self.window, self.ratio = window, ratio
        self.ring = torch.zeros(window, width, dtype=dtype, device=device)
        self.states = {k: CompressorState(ratio, w, overlap, device) for k, w in compressor_widths.items()}
        self._entries = {k: torch.zeros(0, w, dtype=dtype, device=device) for k, w in entry_widths.items()}
        self._counts = {k: 0 for k in entry_widths}

    def window_rows(self, start_pos: int) -> torch.Tensor:
        first = max(0, start_pos - self.window)
        slots = torch.arange(first, start_pos, device=self.ring.device) % self.window
        return self.ring[slots]

    def write_window(self, start_pos: int, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        keep = min(n, self.window)
        pos = torch.arange(start_pos + n - keep, start_pos + n, device=self.ring.device)
        self.ring[pos % self.window] = rows[n - keep:].to(self.ring.dtype)

    def compressor_state(self, kind: str) -> CompressorState:
        return self.states[kind]

    def append_entries(self, kind: str, first: int, rows: torch.Tensor) -> None:
        if first != self._counts[kind]:
            raise RuntimeError(f"compressed '{kind}' entries out of order: have {self._counts[kind]}, got {first}")
        buf = self._entries[kind]
        need = first + rows.shape[0]
        if need > buf.shape[0]:
            grown = torch.zeros(max(need, 2 * buf.shape[0], 16), buf.shape[1], dtype=buf.dtype, device=buf.device)
            grown[: buf.shape[0]] = buf
            self._entries[kind] = buf = grown
        buf[first:need] = rows.to(buf.dtype)
        self._counts[kind] = need

    def entries(self, kind: str, count: int) -> torch.Tensor:
        return self._entries[kind][:count]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of compressed entries this layer owns ("kv", "index"); empty if none."""
        return tuple(self._entries)

    def num_entries(self, kind: str) -> int:
        return self._counts[kind]

    def done(self, end_pos: int) -> None:
        pass

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: the window ring, compressor state, and compressed entries in use."""
        out = {"window": self.ring.nbytes, "compressor state": sum(s.nbytes for s in self.states.values())}
        for kind, buf in self._entries.items():
            out[kind] = self._counts[kind] * buf.shape[1] * buf.element_size()
        return out


class AttentionCapture:
    """Asks the attention of CSA layers to record, for a request's last `last_n` query rows of this
    forward, how much attention mass each compressed entry receives (summed over heads and rows),
    per layer. Used by oracle memory policies and analysis."""

    def __init__(self, last_n: int, end_pos: int):
        self.last_n, self.end_pos = last_n, end_pos   # only the segment ending at end_pos records
        self.mass: dict[int, torch.Tensor] = {}   # CSA layer id -> [entries] float32

    def add(self, layer_id: int, entry_ids: torch.Tensor, weights: torch.Tensor, n_entries: int) -> None:
        acc = self.mass.get(layer_id)
        if acc is None or acc.numel() < n_entries:
            grown = torch.zeros(n_entries, dtype=torch.float32, device=weights.device)
            if acc is not None:
                grown[: acc.numel()] = acc
            acc = self.mass[layer_id] = grown
        acc.index_add_(0, entry_ids, weights.float())


class SequenceKV(Protocol):
    capture: AttentionCapture | None   # optional: None when nothing is recorded

    def layer(self, layer_id: int) -> LayerKV: ...


class DecodeKV(Protocol):
    """Batched access, layer by layer, to the KV of a group of requests that each feed exactly one
    token (decode steps). Lets a layer run its decode rows as a handful of batched operations
    instead of one pass per request. Row b of every tensor belongs to the group's b-th request."""

    positions: torch.Tensor  # [B] long: the position each row's token sits at

    def window(self, layer_id: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the new rows [B, D]; return the window keys [B, W, D] of positions max(0, p − W + 1)
        onwards (oldest first, as `Attention._attend_segment` lists them) and their validity [B, W]."""

    def compressor_state(self, layer_id: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows' compressor states (kv, score) [B, rows, width]."""

    def store_compressor_state(self, layer_id: int, kind: str, kv: torch.Tensor, score: torch.Tensor) -> None: ...

    def append_entries(self, layer_id: int, kind: str, which: torch.Tensor, entry_ids: torch.Tensor,
                       rows: torch.Tensor) -> None:
        """Store entry entry_ids[i] of request which[i] (row indices into the group)."""

    def entries(self, layer_id: int, kind: str, counts: torch.Tensor) -> torch.Tensor:
        """Every request's first counts[b] entries, padded: [B, N >= max(counts), d]."""

    def gather_entries(self, layer_id: int, kind: str, idx: torch.Tensor) -> torch.Tensor:
        """Entries idx[b, k] of request b: [B, K, d] (rows for idx < 0 are unspecified)."""

    def resident(self, layer_id: int, n: int) -> torch.Tensor | None:
        """[B, n]: whether entry j of each request is on the device and may be selected (None when
        every entry is). Entries not resident are never attended to."""

    def done(self, layer_id: int) -> None: ...

    # Optional: `record_compressor_rows(layer_id, kind, kv, score)` is called with the rows' compressor
    # inputs [B, width] before their update (a verify wave's; engine/speculative.py).


class ContiguousKV:
    """All KV state of one request in plain per-layer tensors (no paging, no sharing)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None):
        self.config = config
        self.capture: AttentionCapture | None = None
        self.layers: list[ContiguousLayerKV] = []
        for layer_id in range(config.num_layers_with_mtp):
            entry_widths, comp_widths, overlap = layer_storage(config, layer_id)
            self.layers.append(ContiguousLayerKV(config.sliding_window, config.head_dim, config.layer_ratio(layer_id),
                                                 entry_widths, comp_widths, overlap, dtype, device))

    def layer(self, layer_id: int) -> ContiguousLayerKV:
        return self.layers[layer_id]

    def nbytes(self) -> dict[str, int]:
        """Bytes held by this request, by kind ("window", "compressor state", "kv", "index")."""
        total: dict[str, int] = {}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                total[k] = total.get(k, 0) + v
        return total


@dataclass
class Segment:
    """One request's tokens inside a flat batch: rows [start, start + length) at positions
    [start_pos, start_pos + length)."""

    kv: SequenceKV
    start: int
    length: int
    start_pos: int
    # V4.1 CED (`ced.py`): whether a later step reads the state at end_pos (the next chunk, a
    # snapshot); and the first position whose window rows exist, where earlier ones were skipped
    state_read: bool = True
    window_from: int | None = None

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.length


@dataclass
class DecodeGroup:
    """Rows of the flat batch that are single-token steps, served together through `kv`."""

    rows: torch.Tensor   # [B] row indices into the flat batch
    kv: DecodeKV
    whole: bool = False  # the rows are the whole batch in order (rows == arange(T)): no gather needed
    span: tuple[int, int] | None = None   # the rows are [span[0], span[1]) in order: read as views

    def index(self) -> torch.Tensor | slice:
        """What selects the group's rows of a [T, ...] tensor: a slice (a view) where they are one span."""
        return slice(*self.span) if self.span is not None else self.rows


@dataclass
class ForwardBatch:
    segments: list[Segment]
    positions: torch.Tensor = field(default=None)  # [T] absolute position of every row
    decode: DecodeGroup | None = None               # rows outside `segments` run batched
    # fixed shapes and no host synchronisation anywhere in the forward (it is captured into a CUDA graph)
    static: bool = False
    # rows whose outputs the caller reads (None: all); lets V4.1 skip decoder rows (`ced.py`)
    outputs: list[int] | None = None
    ced: object = None                              # the CedPlan of a V4.1 decoder sub-batch
    # speculative verify rows (engine/speculative.py): requests feeding several consecutive tokens
    # run them as decode groups, one wave after another in every layer (wave j: each request's j-th
    # row), so that each row computes what one plain decode step computes
    waves: list[DecodeGroup] = field(default_factory=list)
    _rope: dict = field(default_factory=dict, repr=False)

    def rope(self, inv_freq: torch.Tensor, key: object) -> torch.Tensor:
        """Rotations of every row for one inverse-frequency table (layers with equal tables pass the
        same key), computed once per forward."""
        if key not in self._rope:
            from hybridkv.ops.rope import rope_freqs
            self._rope[key] = rope_freqs(self.positions, inv_freq)
        return self._rope[key]

    @classmethod
    def build(cls, items: list[tuple], device=None, decode: tuple[DecodeKV, torch.Tensor] | None = None,
              decode_rows: list[int] | None = None,
              waves: list[tuple[DecodeKV, torch.Tensor, list[int]]] = ()) -> "ForwardBatch":
        """items: (kv, start_pos, length[, state_read]) per request, in row order. `decode`: a
        DecodeKV and the positions of its rows, which sit at `decode_rows` of the flat batch (default:
        after the items' rows; the items fill the other rows in order, each contiguously). `waves`:
        (DecodeKV, positions, rows) of each verify wave, in wave order (rows given explicitly)."""
        n_dec = 0 if decode is None else int(decode[1].numel())
        wave_rows = [r for _, _, rows in waves for r in rows]
        total = sum(it[2] for it in items) + n_dec + len(wave_rows)
        if decode_rows is None:
            decode_rows = list(range(total - n_dec, total))
        if len(decode_rows) != n_dec or sorted(set(decode_rows)) != sorted(decode_rows) \
                or any(not 0 <= r < total for r in decode_rows):
            raise ValueError(f"decode_rows {decode_rows} must be {n_dec} distinct rows of the {total}-row batch")
        for dkv, wpos, rows in waves:
            if len(rows) != int(wpos.numel()):
                raise ValueError(f"a verify wave has {len(rows)} rows for {int(wpos.numel())} positions")
        taken = set(decode_rows) | set(wave_rows)
        if len(taken) != n_dec + len(wave_rows) or any(not 0 <= r < total for r in wave_rows):
            raise ValueError(f"verify wave rows {wave_rows} must be distinct rows of the {total}-row batch, "
                             f"apart from the decode rows")
        segments, pos, row = [], [None] * total, 0
        for kv, start_pos, length, *rest in items:
            if length <= 0:
                raise ValueError("a segment needs at least one token")
            while row in taken:
                row += 1
            if taken and any(r in taken for r in range(row, row + length)):
                raise ValueError(f"decode row inside the segment at rows [{row}, {row + length})")
            segments.append(Segment(kv, row, length, start_pos, *rest))
            pos[row:row + length] = range(start_pos, start_pos + length)
            row += length
        group = None
        if decode is not None:
            dkv, dpos = decode
            for r, p in zip(decode_rows, dpos.tolist()):
                pos[r] = p
            group = DecodeGroup(to_device(decode_rows, device, torch.long), dkv,
                                whole=decode_rows == list(range(total)))
        groups = []
        for dkv, wpos, rows in waves:
            for r, p in zip(rows, wpos.tolist()):
                pos[r] = p
            groups.append(DecodeGroup(to_device(rows, device, torch.long), dkv))
        return cls(segments, to_device(pos, device, torch.long), group, waves=groups)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def last_rows(self) -> torch.Tensor:
        """Row index of every segment's last token, then every decode row."""
        rows = torch.tensor([s.start + s.length - 1 for s in self.segments], dtype=torch.long,
                            device=self.positions.device)
        return rows if self.decode is None else torch.cat([rows, self.decode.rows])
