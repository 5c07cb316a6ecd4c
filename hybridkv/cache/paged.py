"""Paged device storage of every request's KV, and the per-request view the model reads it through.

Growing part (paged, shared through the prefix cache): per compressing layer a pool of
`[num_blocks, block_tokens // ratio, E]` main entries, and per CSA layer a pool of
`[num_blocks, block_tokens // 4, Ei]` indexer keys. Compressed entry j of a ratio-r layer lives in
block `block_table[j // (block_tokens // r)]`, row `j % (block_tokens // r)`.

Fixed part (per request slot): every layer's window ring `[W, E]` indexed by `pos % W`, and every
compressor's float32 partial-block state.

Entry formats: "native" keeps entries in the model's compute dtype (exact); "bf16" in bf16; "fp8"
packs them as deployed (584-byte main/window entries, 68-byte FP4 indexer keys; see hybridkv.ops.kv_formats).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.cache.block_pool import BlockPool, OutOfBlocks
from hybridkv.cache.page_pool import PagePool
from hybridkv.config import ModelConfig
from hybridkv.errors import ConfigError
from hybridkv.model.state import CompressorState, layer_storage
from hybridkv.ops.backend import use_triton
from hybridkv.ops.kv_formats import (index_block_rows, index_block_views, index_blocks_to_rows, index_entry_bytes,
                                     main_entry_bytes, pack_index_fp4, pack_into_pool, pack_main_fp8, pack_v41_global,
                                     pack_v41_window, unpack_index_fp4, unpack_main_fp8, unpack_v41_global,
                                     unpack_v41_window, v41_global_bytes, v41_window_bytes)
from hybridkv.ops.paged import PagedBatch
from hybridkv.ops.ranges import arange
from hybridkv.ops.row_gather import gather_rows_
from hybridkv.ops.window import window_listing

KV_FORMATS = ("native", "bf16", "fp8", "v41")


class _Codec:
    """How entries of one kind are stored: a dtype, or packed bytes. Kinds: "kv" (V4 main / V4.1
    global KV), "index" (indexer keys), "window" (window ring rows)."""

    def __init__(self, fmt: str, kind: str, config: ModelConfig, dtype: torch.dtype):
        self.fmt, self.kind, self.dtype = fmt, kind, dtype
        self.dim = config.index_head_dim if kind == "index" else config.head_dim
        self.rope = config.qk_rope_head_dim
        self.packed = fmt in ("fp8", "v41")
        if fmt == "fp8":
            self.width = index_entry_bytes(self.dim) if kind == "index" else main_entry_bytes(self.dim, self.rope)
        elif fmt == "v41":
            widths = {"index": index_entry_bytes, "kv": v41_global_bytes, "window": v41_window_bytes}
            self.width = widths[kind](self.dim)
        else:
            self.width = self.dim
        self.storage_dtype = torch.uint8 if self.packed else (torch.bfloat16 if fmt == "bf16" else dtype)
        self.block_layout = self.packed and kind == "index"   # packed keys: codes first in a block (ops/kv_formats.py)

    def encode(self, rows: torch.Tensor, check: bool = True) -> torch.Tensor:
        """[..., dim] entries -> [..., width] stored form. `check` False: no validation that reads
        the device's answer on the host (V4.1's global entries; for a captured decode step)."""
        if not self.packed:
            return rows.to(self.storage_dtype)
        flat = rows.reshape(-1, self.dim)
        if self.kind == "index":
            packed = pack_index_fp4(flat)
        elif self.fmt == "fp8":
            packed = pack_main_fp8(flat, self.rope)
        else:
            packed = pack_v41_global(flat, check) if self.kind == "kv" else pack_v41_window(flat)
        return packed.reshape(*rows.shape[:-1], self.width)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """[..., width] stored form -> [..., dim] entries in the compute dtype."""
        if not self.packed:
            return stored.to(self.dtype)
        flat = stored.reshape(-1, self.width)
        if self.kind == "index":
            out = unpack_index_fp4(flat, self.dim, self.dtype)
        elif self.fmt == "fp8":
            out = unpack_main_fp8(flat, self.dim, self.rope, self.dtype)
        elif self.kind == "kv":
            out = unpack_v41_global(flat, self.dim, self.dtype)
        else:
            out = unpack_v41_window(flat, self.dim, self.dtype)
        return out.reshape(*stored.shape[:-1], self.dim)

    def store_entries(self, pool: torch.Tensor, tables: torch.Tensor, which: torch.Tensor, ids: torch.Tensor,
                      rows: torch.Tensor) -> bool:
        """Packed FP4 keys and V4.1 global entries where the kernels run: rows [N, dim] encoded straight
        into the pool as entry ids[n] of request which[n] (none where −1) through its block table
        (`kv_formats.pack_into_pool`; unchecked, as in a captured step). False: not done here."""
        if not self.packed or not (self.kind == "index" or (self.fmt == "v41" and self.kind == "kv")):
            return False
        return pack_into_pool(rows.reshape(-1, self.dim), "index" if self.kind == "index" else "v41_global", pool,
                              tables, which, ids, self.block_layout)

    def read(self, pool: torch.Tensor, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Stored rows at (blocks, offs) of a pool [num_blocks, E, width]."""
        return index_block_rows(pool, blocks, offs, self.dim) if self.block_layout else pool[blocks, offs]

    def write(self, pool: torch.Tensor, blocks: torch.Tensor, offs: torch.Tensor, stored: torch.Tensor) -> None:
        if not self.block_layout:
            pool[blocks, offs] = stored
            return
        codes, scales = index_block_views(pool, self.dim)
        codes[blocks, offs] = stored[..., : codes.shape[-1]]
        scales[blocks, offs] = stored[..., codes.shape[-1]:]

    def block_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Whole stored blocks [..., E, width] as their rows (same shape)."""
        return index_blocks_to_rows(blocks, self.dim) if self.block_layout else blocks

    def row_bytes(self) -> int:
        return self.width * torch.empty(0, dtype=self.storage_dtype).element_size()


@dataclass
class Recall:
    """A residency change in flight (offload mode): pages being filled from host memory on the copy
    stream for the blocks in `loads`; when they have arrived the blocks named in `keep` (of the
    first `blocks` blocks; later ones were added since and stay) become the resident set."""
    keep: set[int]
    blocks: int
    loads: dict[int, int]                   # block index -> the page being filled
    arrived: "torch.cuda.Event | None"      # None: the copies are complete (CPU, or nothing to load)
    evicted: int = 0                        # pages evicted before the copies (too few free pages)


@dataclass
class SeqCache:
    """A request's place in the store: its slot, its block table, and what it may not overwrite."""

    slot: int
    block_table: list[int] = field(default_factory=list)
    window_start: int = 0      # earliest position whose window row is valid (bounded replay starts later)
    frozen_until: int = 0      # entries complete before this position come from the prefix cache
    pages: list[int] = field(default_factory=list)  # offload mode: device page of each block's CSA main entries, -1 = host only
    recall: Recall | None = None                     # offload mode: a residency change whose pages are still in flight
    pages_version: int = 0                           # offload mode: bumped whenever `pages` changes (graph inputs)


@dataclass
class StateGroup:
    """The compressor states of one shape: `members` (layer, kind) in layer order, their kv and score
    [len(members), slots, rows, width] (float32)."""
    members: list[tuple[int, str]]
    kv: torch.Tensor
    score: torch.Tensor


class PagedKVStore:
    def __init__(self, config: ModelConfig, num_blocks: int, max_slots: int, kv_format: str = "native",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 resident_pages: int | None = None):
        """resident_pages: when given, CSA main entries live in host memory (the full history) and
        only the blocks a memory policy keeps resident are copied to a device pool of this many
        pages (one page = one block's CSA main entries in every CSA layer)."""
        if kv_format not in KV_FORMATS:
            raise ConfigError(f"unknown KV format {kv_format!r}; choose one of {', '.join(KV_FORMATS)}")
        v41 = config.family == "v4.1"
        if (kv_format == "v41") != v41 and kv_format in ("fp8", "v41"):
            want = "v41" if v41 else "fp8"
            raise ConfigError(f"kv_format {kv_format!r} is the packed layout of "
                              f"{'DeepSeek-V4.1' if kv_format == 'v41' else 'DeepSeek-V4'}; this checkpoint's is {want!r}")
        if kv_format == "fp8" and not config.kv_pow2_scales:
            raise ConfigError("the fp8 KV format stores ue8m0 (power-of-two) scales, but this checkpoint's KV round "
                              "trips use plain scales (no quantization_config with scale_fmt ue8m0); use 'native' or 'bf16'")
        self.config, self.fmt, self.dtype, self.device = config, kv_format, dtype, torch.device(device)
        self.block_tokens = config.block_tokens
        self.num_layers = config.num_hidden_layers
        self.pool = BlockPool(num_blocks)
        self.max_slots = max_slots
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.codec = {k: _Codec(kv_format, k, config, dtype) for k in ("kv", "index", "window")}
        W = config.sliding_window
        win = self.codec["window"]
        # every layer's window ring in one tensor [layers, slots, W, width] (`ring[i]` is layer i's view):
        # speculative decoding saves and puts back a request's ring rows of all layers in one gather
        self.rings = torch.zeros(self.num_layers, max_slots, W, win.width, dtype=win.storage_dtype, device=self.device)
        self.ring = list(self.rings.unbind(0))
        self.offload = resident_pages is not None
        self.host = torch.device("cpu")
        self.page_pool = PagePool(resident_pages) if self.offload else None
        self.pages: dict[int, torch.Tensor] = {}    # CSA layer -> device pages [pages, entries/block, E]
        self._copy_stream = None
        csa = [i for i in range(self.num_layers) if config.layer_kind(i) == "csa"] if self.offload else []
        if csa:
            # one block's CSA main entries of every CSA layer lie together, in host memory and in a
            # device page, so that a recall moves a page as one row (`gather_rows_`)
            kv, per = self.codec["kv"], self.block_tokens // config.layer_ratio(csa[0])
            self._host_csa = torch.zeros(num_blocks, len(csa), per, kv.width, dtype=kv.storage_dtype,
                                         pin_memory=self.device.type == "cuda")
            self._page_csa = torch.zeros(resident_pages, len(csa), per, kv.width, dtype=kv.storage_dtype,
                                         device=self.device)
            csa_slot = {layer: i for i, layer in enumerate(csa)}
        # the paged kernels read and write one CSA layer's page rows through a table of rows of this
        # view: page p of CSA layer i is its row block p·len(csa) + i (`page_tables`)
        self.page_rows = self._page_csa.view(-1, *self._page_csa.shape[2:]) if csa else None
        self._csa_slot = csa_slot if csa else {}
        self._written_back = None        # CUDA: the event of the last page write-back
        self.entries: list[dict[str, torch.Tensor]] = []
        self.overlap: list[bool] = []
        self.states: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        shapes: dict[tuple[int, int], list[tuple[int, str]]] = {}     # (rows, width) -> (layer, kind)
        order: list[tuple[int, str]] = []
        for layer_id in range(self.num_layers):
            ratio = config.layer_ratio(layer_id)
            widths, state_widths, overlap = layer_storage(config, layer_id)   # what this layer owns
            self.overlap.append(overlap)
            ents = {}
            for kind in widths:
                c = self.codec[kind]
                offloaded = self.offload and config.layer_kind(layer_id) == "csa" and kind == "kv"
                if offloaded:
                    ents[kind] = self._host_csa[:, csa_slot[layer_id]]
                    self.pages[layer_id] = self._page_csa[:, csa_slot[layer_id]]
                    continue
                ents[kind] = torch.zeros(num_blocks, self.block_tokens // ratio, c.width, dtype=c.storage_dtype,
                                         device=self.device)
            for kind, width in state_widths.items():
                rows = width // self.codec[kind].dim * ratio      # overlapping compressors: 2 blocks
                shapes.setdefault((rows, width), []).append((layer_id, kind))
                order.append((layer_id, kind))
            self.entries.append(ents)
            self.states.append({})
        # the compressor states of one shape, every layer's, in one tensor [members, slots, rows, width]
        # (`states[layer][kind]` is a member's view): the speculative rollback restores a request's
        # states of all layers a group at a time, and a slot is reset in two launches a group
        self.state_groups: list[StateGroup] = []
        views = {}
        for (rows, width), members in shapes.items():
            kv = torch.zeros(len(members), max_slots, rows, width, dtype=torch.float32, device=self.device)
            score = torch.full_like(kv, float("-inf"))
            self.state_groups.append(StateGroup(members, kv, score))
            views.update({member: (kv[m], score[m]) for m, member in enumerate(members)})
        for layer_id, kind in order:            # each layer's kinds in their order (snapshots list them so)
            self.states[layer_id][kind] = views[(layer_id, kind)]
        self.kernel_formats = self._kernel_formats()

    def _kernel_formats(self) -> tuple[str, str] | None:
        """(main, index) entry formats in which the paged Triton kernels read this store, or None when
        attention runs the reference path over gathered rows: off CUDA (unless forced, see
        `hybridkv.ops.backend`) and for packed shapes the kernels do not take (fp8: 64 rope dims,
        head_dim 2^k; v41: head_dim and index_head_dim 2^k). V4.1 stores in their packed layout ("v41") run decode
        attention and its indexer scoring on the kernels; V4.1 prefill and V4.1 stores in other
        layouts take the reference path. In offload mode the kernels read CSA main entries from the device
        pages (`KernelArgs.pool`), and completed blocks are written back to host memory (`write_back`)."""
        c = self.config
        probe = torch.empty(0, device=self.device)
        if not use_triton(probe):
            return None
        if c.family == "v4.1":   # decode attention only (`Attention._attend_kernels_v41`)
            pow2 = not c.head_dim & (c.head_dim - 1) and not c.index_head_dim & (c.index_head_dim - 1)
            return ("v41", "fp4") if self.fmt == "v41" and c.head_dim >= 32 and pow2 else None
        if c.index_head_dim & (c.index_head_dim - 1):
            return None
        if self.fmt == "fp8":
            if c.qk_rope_head_dim != 64 or c.head_dim < 128 or c.head_dim & (c.head_dim - 1):
                return None
            return "fp8", "fp4"
        return "bf16", "bf16"     # float elements, read in their own dtype

    # ----- slots -----
    def new_seq(self) -> SeqCache:
        if not self._free_slots:
            raise RuntimeError("no free request slot")
        slot = self._free_slots.pop()
        self.reset_slot(slot)
        return SeqCache(slot)

    def reset_slot(self, slot: int) -> None:
        for group in self.state_groups:
            group.kv[:, slot].zero_()
            group.score[:, slot].fill_(float("-inf"))

    def free_seq(self, seq: SeqCache) -> None:
        # last block first: cached blocks are evicted oldest-freed first, so a prefix loses its
        # tail before its head (the head is what most later requests share)
        for b in reversed(seq.block_table):
            self.pool.release(b)
        if seq.recall is not None:
            self._arrive(seq.recall)          # its pages may be reused at once
            for p in seq.recall.loads.values():
                self.page_pool.release(p)
            seq.recall = None
        if self.offload:
            self.page_pool.release_many([p for p in seq.pages if p >= 0])
        seq.block_table, seq.pages = [], []
        self._free_slots.append(seq.slot)

    def copy_seq(self, src: SeqCache) -> SeqCache:
        """A new request's place holding a copy of `src`'s cache: a slot with its window ring and
        compressor state, blocks of its own with every layer's entries, and (offload mode) the host
        rows of its CSA main entries and a device page for each block resident in `src`. Nothing is
        shared with `src`, so both may go on writing. `src`'s recall must be settled. Raises
        OutOfBlocks, taking nothing, when the pools cannot hold the copy."""
        if src.recall is not None:
            raise RuntimeError("a recall is still in flight for this request: settle it first")
        n, resident = len(src.block_table), [b for b, p in enumerate(src.pages) if p >= 0]
        if not self._free_slots:
            raise RuntimeError("no free request slot")
        if self.pool.num_free < n or (self.offload and self.page_pool.num_free < len(resident)):
            raise OutOfBlocks()
        self.sync_host()           # the host rows of blocks written back on the copy stream
        dst = self.new_seq()
        dst.block_table = [self.pool.allocate() for _ in range(n)]
        dst.window_start, dst.frozen_until = src.window_start, src.frozen_until
        if n:
            to, frm = (torch.tensor(t, device=self.device) for t in (dst.block_table, src.block_table))
            for layer_id, ents in enumerate(self.entries):
                for kind, t in ents.items():
                    if not (layer_id in self.pages and kind == "kv"):     # host rows: below, all layers at once
                        t[to] = t[frm]
            if self.pages:
                self._host_csa[to.cpu()] = self._host_csa[frm.cpu()]
        if self.offload:
            dst.pages = [-1] * len(src.pages)
            for b in resident:
                dst.pages[b] = self.page_pool.allocate()
            if self.pages and resident:
                rows = torch.tensor([[src.pages[b] for b in resident], [dst.pages[b] for b in resident]],
                                    device=self.device)
                gather_rows_(self._page_csa, rows[1], self._page_csa, rows[0])
        for layer_id in range(self.num_layers):
            self.restore_state(dst.slot, layer_id, self.capture_state(src.slot, layer_id))
        return dst

    # ----- residency of CSA main entries (offload mode) -----
    def attach_pages(self, seq: SeqCache) -> None:
        """Give every block without a page entry one: new blocks start resident. A block a prefix hit
        provides (before `frozen_until`) already holds its entries in host memory: its page is loaded
        from there (the hit restored the host pool; the memory policy then decides what stays)."""
        if not self.offload:
            return
        if self._written_back is not None and len(seq.pages) < len(seq.block_table):
            # a new page's writes come after any write-back still reading it from an earlier owner
            torch.cuda.current_stream(self.device).wait_event(self._written_back)
        loads: dict[int, int] = {}
        while len(seq.pages) < len(seq.block_table):
            b = len(seq.pages)
            page = self.page_pool.allocate()  # raises OutOfBlocks when the page pool is full
            if self.pages and b * self.block_tokens < seq.frozen_until:
                loads[b] = page
            seq.pages.append(page)
            seq.pages_version += 1
        self._load_pages([(seq, loads)])

    def _load_pages(self, loads: list[tuple[SeqCache, dict[int, int]]]) -> None:
        """Fill device pages from their blocks' host rows ({block index: page} of each request), on the
        current stream: one gather that the device runs over the pinned host pool on CUDA, whatever
        the count."""
        host, dev = [], []
        for seq, page_loads in loads:
            host.extend(seq.block_table[b] for b in page_loads)
            dev.extend(page_loads.values())
        if not host or not self.pages:
            return
        rows = torch.from_numpy(np.array([host, dev], dtype=np.int64))
        if self.device.type == "cuda":
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        gather_rows_(self._page_csa, rows[1], self._host_csa, rows[0])

    def page_tables(self, layer_id: int, pages: torch.Tensor) -> torch.Tensor:
        """Requests' page tables [R, blocks] (−1: host only) as tables of `page_rows` for one CSA layer."""
        n = self._page_csa.shape[1]
        return torch.where(pages >= 0, pages * n + self._csa_slot[layer_id], -1).to(torch.int32)

    def write_back(self, seq: SeqCache, start_pos: int, end_pos: int) -> int:
        """After a forward over positions [start_pos, end_pos) whose CSA main entries went only to the
        device pages (the paged kernels in offload mode): copy the pages of the blocks it completed to
        their host blocks, where recalls and prefix hits read them (a block is resident, so has a page,
        while it fills). On CUDA on the copy stream after the forward, without waiting: loads queue
        behind it there, reuse of a page waits for it (`attach_pages`), host readers call `sync_host`.
        Returns the blocks written back."""
        if not self.pages or self.kernel_formats is None:
            return 0
        bt = self.block_tokens
        blocks = [b for b in range(start_pos // bt, end_pos // bt) if (b + 1) * bt > max(start_pos, seq.frozen_until)
                  and seq.pages[b] >= 0]
        if not blocks:
            return 0
        if self.device.type != "cuda":
            for b in blocks:
                self._host_csa[seq.block_table[b]].copy_(self._page_csa[seq.pages[b]])
            return len(blocks)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            for b in blocks:
                self._host_csa[seq.block_table[b]].copy_(self._page_csa[seq.pages[b]], non_blocking=True)
            self._written_back = torch.cuda.Event()
            self._written_back.record(self._copy_stream)
        return len(blocks)

    def sync_host(self) -> None:
        """Wait until the written-back pages are in host memory (before reading it on the host)."""
        if self._written_back is not None:
            self._written_back.synchronize()
            self._written_back = None

    def set_resident(self, seq: SeqCache, keep: set[int]) -> tuple[int, int]:
        """Make exactly the blocks in `keep` resident now (the recall below, waited for; one still in
        flight is settled first). Returns (pages loaded, pages evicted) of this recall."""
        self.settle_recall(seq, wait=True)
        self.start_recall(seq, keep)
        return self.settle_recall(seq, wait=True)

    def start_recall(self, seq: SeqCache, keep: set[int]) -> int:
        """Begin making the blocks in `keep` the resident set: pages for those that have none are
        filled from host memory on a copy stream of their own (on CUDA; at once elsewhere), ordered
        after the work queued so far, so the copies overlap the decode steps queued after them. Until
        `settle_recall` finds them arrived, the resident blocks stay as they are and the new ones are
        not read. The request's previous recall must be settled. Returns the pages started. When
        holding both sets at once would leave fewer free pages than one for each request (the block
        each may open before its recall arrives), the old set is evicted before the copies: requests
        that recall in the same step cannot take the pages the others' next blocks need."""
        return self.start_recalls([(seq, keep)])

    def start_recalls(self, recalls: list[tuple[SeqCache, set[int]]]) -> int:
        """`start_recall` for several requests at once (those whose recall falls in the same step):
        their pages are planned in order, as by one call each, and filled by one gather over the
        host pool on CUDA, whose arrival each of them waits for. Returns the pages started."""
        planned = []
        requests = self.max_slots - len(self._free_slots)
        for seq, keep in recalls:
            if seq.recall is not None:
                raise RuntimeError("a recall is still in flight for this request: settle it first")
            pages = np.array(seq.pages, dtype=np.int64)
            kept = _block_mask(keep, pages.size)
            want = np.flatnonzero(kept & (pages < 0))
            evicted = 0
            if want.size > self.page_pool.num_free - requests:
                gone = np.flatnonzero((pages >= 0) & ~kept)
                self.page_pool.release_many(pages[gone])
                pages[gone] = -1
                seq.pages[:] = pages.tolist()
                seq.pages_version += 1
                evicted = gone.size
            planned.append((seq, keep, dict(zip(want.tolist(), self.page_pool.allocate_many(want.size))), evicted))
        arrived = self._copy_pages([(seq, loads) for seq, _, loads, _ in planned])
        for seq, keep, loads, evicted in planned:
            seq.recall = Recall(set(keep), len(seq.pages), loads, arrived if loads else None, evicted)
        return sum(len(loads) for _, _, loads, _ in planned)

    def _copy_pages(self, loads: list[tuple[SeqCache, dict[int, int]]]) -> "torch.cuda.Event | None":
        if not any(page_loads for _, page_loads in loads) or not self.pages:
            return None
        if self.device.type != "cuda":
            self._load_pages(loads)
            return None
        compute = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        # after everything queued so far: a page freed by an earlier eviction may still be read there
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            self._load_pages(loads)
            arrived = torch.cuda.Event()
            arrived.record(self._copy_stream)
        return arrived

    def _arrive(self, recall: Recall) -> None:
        """Order the compute stream's later work after the recall's copies."""
        if recall.arrived is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(recall.arrived)

    def settle_recall(self, seq: SeqCache, wait: bool = False) -> tuple[int, int] | None:
        """Finish the request's recall if its pages have arrived (or, with `wait`, once they have):
        the loaded pages become readable and the blocks outside its resident set are evicted.
        Returns (pages loaded, pages evicted), or None while the copies are still in flight (or no
        recall is pending)."""
        r = seq.recall
        if r is None or (r.arrived is not None and not wait and not r.arrived.query()):
            return None
        self._arrive(r)
        seq.pages_version += 1
        for b, page in r.loads.items():
            seq.pages[b] = page
        pages = np.array(seq.pages[:r.blocks], dtype=np.int64)
        gone = np.flatnonzero((pages >= 0) & ~_block_mask(r.keep, r.blocks))
        if gone.size:
            self.page_pool.release_many(pages[gone])
            pages[gone] = -1
            seq.pages[:r.blocks] = pages.tolist()
        seq.recall = None
        return len(r.loads), int(gone.size) + r.evicted

    def resident_blocks(self, seq: SeqCache) -> list[int]:
        if not self.offload:
            return list(range(len(seq.block_table)))
        return [b for b, p in enumerate(seq.pages) if p >= 0]

    def device_bytes(self, seq: SeqCache) -> dict[str, int]:
        """Device bytes this request holds, by kind (blocks it references, resident pages, its slot)."""
        per_block = self.block_bytes()
        out = {k: v * len(seq.block_table) for k, v in per_block.items()}
        if self.offload:
            out["CSA main"] = sum(1 for p in seq.pages if p >= 0) * self.page_bytes()
        out.update(self.slot_bytes())
        return out

    def slot_bytes(self) -> dict[str, int]:
        """Device bytes one request slot holds whatever its length: window rings, compressor state."""
        return {"window": sum(r[0].nbytes for r in self.ring),
                "compressor state": sum(a[0].nbytes + b[0].nbytes for st in self.states for a, b in st.values())}

    def page_bytes(self) -> int:
        return sum(p[0].nbytes for p in self.pages.values())

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def view(self, seq: SeqCache, on_layer_done=None) -> "PagedSeqKV":
        """The model-facing view of one request; `on_layer_done(layer_id, end_pos[, state])` is called
        when a layer has processed the request up to end_pos (with the layer's state there for the
        points of `PagedSeqKV.snapshot_at` inside a segment)."""
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
    def entry_kinds(self) -> list[str]:
        """The accounting names of the compressed entries this model stores (kv-calc's names)."""
        if self.config.family == "v4.1":
            return ["global KV", "indexer keys"]
        return ["CSA main", "CSA indexer", "HCA"]

    def _label(self, layer_id: int, kind: str) -> str:
        layer = self.config.layer_kind(layer_id)
        if layer == "full":
            return "indexer keys" if kind == "index" else "global KV"
        return "CSA indexer" if kind == "index" else ("CSA main" if layer == "csa" else "HCA")

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes allocated on the device, by kind (whole pools, whatever is in use)."""
        out = {"window": sum(r.nbytes for r in self.ring), "compressor state": 0}
        out.update(dict.fromkeys(self.entry_kinds(), 0))
        for layer_id, ents in enumerate(self.entries):
            for k, t in ents.items():
                if layer_id in self.pages and k == "kv":
                    out["CSA main"] += self.pages[layer_id].nbytes   # the host mirror is not device memory
                    continue
                out[self._label(layer_id, k)] += t.nbytes
            out["compressor state"] += sum(a.nbytes + b.nbytes for a, b in self.states[layer_id].values())
        return out

    def block_bytes(self) -> dict[str, int]:
        """Bytes one block (block_tokens positions) holds in every layer, by kind (in offload mode the
        CSA main entries are counted where they are stored: host memory, plus a device page when
        resident)."""
        out = dict.fromkeys(self.entry_kinds(), 0)
        for layer_id, ents in enumerate(self.entries):
            for k, t in ents.items():
                out[self._label(layer_id, k)] += t[0].nbytes
        return out

    def host_bytes(self) -> int:
        """Bytes of the host pool that holds every block's CSA main entries (offload mode; else 0)."""
        return self._host_csa.nbytes if self.pages else 0

    def bytes_per_token(self) -> float:
        return sum(self.block_bytes().values()) / self.block_tokens

    def used_bytes(self) -> int:
        """Device bytes held by blocks in use, resident pages, and the state of slots in use."""
        per_block = self.block_bytes()
        if self.offload:
            per_block["CSA main"] = 0
        per_slot = sum(self.slot_bytes().values())
        pages = self.page_pool.num_used * self.page_bytes() if self.offload else 0
        return (self.pool.num_used * sum(per_block.values()) + pages
                + (self.max_slots - len(self._free_slots)) * per_slot)


class _PagedCompressorState(CompressorState):
    """Views of one slot's rows in the store (the compressor updates them in place)."""

    def __init__(self, kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool):  # noqa: D107
        self.ratio, self.overlap, self.kv, self.score = ratio, overlap, kv, score


class PagedLayerKV:
    """One layer of one request's view. `on_done(layer_id, end_pos[, state])` is told when the layer
    has processed the request up to end_pos; for the positions in `snapshot_points` that fall inside
    a segment (block boundaries a chunk runs through whole) it also gets the window ring and
    compressor states as they stand there, in `PagedKVStore.capture_state`'s form, rebuilt from the
    segment's rows before they overwrite the ring and advance the states: what the layer would hold
    had the chunk been cut at that point."""

    def __init__(self, store: PagedKVStore, seq: SeqCache, layer_id: int, on_done=None):
        self.store, self.seq, self.layer_id, self.on_done = store, seq, layer_id, on_done
        self.ratio = store.config.layer_ratio(layer_id)
        self.window = store.config.sliding_window
        self.snapshot_points: tuple[int, ...] = ()
        self._inner: dict[int, dict] = {}     # point -> {"window": ring, kind: (kv, score)}

    def _points_in(self, start_pos: int, n: int) -> list[int]:
        if self.on_done is None:
            return []
        return [b for b in self.snapshot_points if start_pos < b < start_pos + n]

    def _keep_inner_rings(self, start_pos: int, stored: torch.Tensor, points: list[int]) -> None:
        """The ring at each point: slot s holds the last position p < point with p % window == s,
        from these rows where p is one of them, else what the ring holds now."""
        ring = self.store.ring[self.layer_id][self.seq.slot]
        dev = ring.device
        at = torch.tensor(points, device=dev).unsqueeze(1)
        last = at - 1 - (at - 1 - torch.arange(self.window, device=dev)) % self.window      # [m, window]
        rings = torch.where((last >= start_pos).unsqueeze(-1), stored[(last - start_pos).clamp(min=0)], ring)
        for b, r in zip(points, rings.unbind(0)):
            self._inner.setdefault(b, {})["window"] = r.clone()

    def note_compressor_rows(self, kind: str, start_pos: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Before a compressor takes the rows of positions [start_pos, start_pos + len(kv)): keep its
        state at each snapshot point among them (what `Compressor.update` leaves after the rows before
        the point: the pending rows of the point's block and, overlapping, the last completed block)."""
        points = self._points_in(start_pos, kv.shape[0])
        if not points:
            return
        st = self.compressor_state(kind)
        r = self.ratio
        cur = r if st.overlap else 0
        q0 = start_pos // r * r
        # the rows of positions [q0 - cur, end): the state's overlap and pending rows, then these;
        # state row i at point b holds position q - cur + i (q: b's block start) while i < cur + b - q
        stream_kv = torch.cat([st.kv[:cur + start_pos - q0], kv.float()])
        stream_score = torch.cat([st.score[:cur + start_pos - q0], score.float()])
        dev = stream_kv.device
        at = torch.tensor(points, device=dev).unsqueeze(1)
        q = torch.div(at, r, rounding_mode="floor") * r
        i = torch.arange(cur + r, device=dev)
        row = q - q0 + i                                       # [m, cur + r] rows of the stream
        held = (i < cur + at - q).unsqueeze(-1)
        row = row.clamp(max=stream_kv.shape[0] - 1)
        s_kv = torch.where(held, stream_kv[row], 0.0)
        s_score = torch.where(held, stream_score[row], float("-inf"))
        for b, a, c in zip(points, s_kv.unbind(0), s_score.unbind(0)):
            self._inner.setdefault(b, {})[kind] = (a.clone(), c.clone())

    def _inner_state(self, point: int) -> list[torch.Tensor]:
        parts = self._inner.pop(point)
        out = [parts["window"]]
        for kind in self.store.states[self.layer_id]:
            if kind not in parts:
                raise RuntimeError(f"layer {self.layer_id}'s {kind!r} compressor ran through the snapshot point "
                                   f"{point} without noting its rows")
            out += list(parts[kind])
        return out

    def window_rows(self, start_pos: int) -> torch.Tensor:
        first = max(self.seq.window_start, start_pos - self.window, 0)
        slots = torch.arange(first, start_pos, device=self.store.device) % self.window
        return self.store.codec["window"].decode(self.store.ring[self.layer_id][self.seq.slot][slots])

    def write_window(self, start_pos: int, rows: torch.Tensor, stored: bool = False) -> None:
        """The last `window` of these rows (positions from start_pos on) into the ring; `stored`: the
        rows are already in stored form."""
        n = rows.shape[0]
        points = self._points_in(start_pos, n)
        if points:
            rows = rows if stored else self.store.codec["window"].encode(rows)
            stored = True
            self._keep_inner_rings(start_pos, rows, points)
        keep = min(n, self.window)
        pos = torch.arange(start_pos + n - keep, start_pos + n, device=self.store.device)
        tail = rows[n - keep:]
        self.store.ring[self.layer_id][self.seq.slot][pos % self.window] = (
            tail if stored else self.store.codec["window"].encode(tail))

    def compressor_state(self, kind: str) -> CompressorState:
        kv, score = self.store.states[self.layer_id][kind]
        return _PagedCompressorState(kv[self.seq.slot], score[self.seq.slot], self.ratio,
                                     self.store.overlap[self.layer_id])

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
        codec = self.store.codec[kind]
        encoded = codec.encode(rows)
        pool = self.store.entries[self.layer_id][kind]
        codec.write(pool, blocks.to(pool.device), offs.to(pool.device), encoded.to(pool.device))
        if self._paged(kind):
            pages = self._pages(blocks, first, rows.shape[0])
            self.store.pages[self.layer_id][pages, offs] = encoded

    def _paged(self, kind: str) -> bool:
        return kind == "kv" and self.layer_id in self.store.pages

    def _pages(self, blocks: torch.Tensor, first: int, n: int) -> torch.Tensor:
        per_block = self.store.block_tokens // self.ratio
        idx = torch.arange(first, first + n) // per_block
        pages = torch.tensor(self.seq.pages, dtype=torch.long)[idx]
        if bool((pages < 0).any()):
            raise RuntimeError("CSA entries of a block that is not resident were needed on the device")
        return pages.to(self.store.device)

    def entries(self, kind: str, count: int) -> torch.Tensor:
        if count == 0:
            return torch.zeros(0, self.store.codec[kind].dim, dtype=self.store.dtype, device=self.store.device)
        per_block = self.store.block_tokens // self.ratio
        nb = -(-count // per_block)
        ids = self.seq.pages[:nb] if self._paged(kind) else self.seq.block_table[:nb]
        if min(ids) < 0:
            raise RuntimeError("CSA entries of a block that is not resident were needed on the device")
        pool = self.store.pages[self.layer_id] if self._paged(kind) else self.store.entries[self.layer_id][kind]
        table = torch.tensor(ids, dtype=torch.long, device=self.store.device)
        codec = self.store.codec[kind]
        rows = codec.block_rows(pool.index_select(0, table)).reshape(nb * per_block, pool.shape[-1])[:count]
        return codec.decode(rows)

    def done(self, end_pos: int) -> None:
        """The layer has processed this request up to end_pos (a snapshot point, maybe): the snapshot
        points it ran through first, in order, each with its state."""
        if self.on_done is None:
            return
        for b in sorted(p for p in self._inner if p < end_pos):
            self.on_done(self.layer_id, b, self._inner_state(b))
        self.on_done(self.layer_id, end_pos)


class PagedSeqKV:
    """The model-facing view (`SequenceKV`) of one request in a PagedKVStore."""

    def __init__(self, store: PagedKVStore, seq: SeqCache, on_layer_done=None):
        self.store, self.seq = store, seq
        self.capture = None   # an AttentionCapture when the engine wants attention mass recorded
        self.snapshot_points: tuple[int, ...] = ()
        self._layers = [PagedLayerKV(store, seq, i, on_layer_done) for i in range(store.num_layers)]
        self._kernel_args: dict[tuple[int, int], KernelArgs] = {}

    def kernel_args(self, start_pos: int, length: int) -> KernelArgs | None:
        """The layout of this request's tokens [start_pos, start_pos + length) for the paged kernels
        (built once per segment and step, shared by the layers), or None when attention takes the
        reference path."""
        if self.store.kernel_formats is None or not _window_complete(self.seq, start_pos,
                                                                     self.store.config.sliding_window):
            return None
        key = (start_pos, length)
        if key not in self._kernel_args:
            batch = PagedBatch.build([(self.seq.slot, start_pos, length, self.seq.block_table)],
                                     self.store.block_tokens, self.store.device)
            pages = None
            if self.store.pages:
                pages = torch.full(batch.block_tables.shape, -1, dtype=torch.int32)
                pages[0, :len(self.seq.pages)] = torch.tensor(self.seq.pages, dtype=torch.int32)
                pages = pages.to(self.store.device)
            self._kernel_args[key] = KernelArgs(self.store, batch, start_pos + length - 1, pages)
        return self._kernel_args[key]

    def layer(self, layer_id: int) -> PagedLayerKV:
        return self._layers[layer_id]

    def snapshot_at(self, points) -> None:
        """Positions inside this forward's segments at which `on_layer_done` wants each layer's state
        (block boundaries that a chunk runs through whole)."""
        self.snapshot_points = tuple(points)
        for layer in self._layers:
            layer.snapshot_points = self.snapshot_points


@dataclass
class KernelArgs:
    """What the paged attention and indexer kernels read for one group of query tokens: where its
    rows live (`batch`), the store's pools and their formats, and the group's largest position
    (known on the host, so that no launch waits for the device)."""

    store: PagedKVStore
    batch: PagedBatch
    max_pos: int
    pages: torch.Tensor | None = None     # offload mode: [R, blocks] int32 device pages (−1: host only)

    def _paged(self, layer_id: int, kind: str) -> bool:
        return self.pages is not None and kind == "kv" and layer_id in self.store.pages

    def resident(self, layer_id: int) -> torch.Tensor | None:
        """Which blocks' entries this layer may select ([R, blocks] pages, −1 = host only), or None."""
        return self.pages if self._paged(layer_id, "kv") else None

    def tables(self, layer_id: int, kind: str) -> torch.Tensor:
        """Where `pool(layer_id, kind)` holds each block's entries: [R, blocks] int32."""
        if not self._paged(layer_id, kind):
            return self.batch.block_tables
        cache = self.__dict__.setdefault("_page_tables", {})
        if layer_id not in cache:
            cache[layer_id] = self.store.page_tables(layer_id, self.pages)
        return cache[layer_id]

    @property
    def main_format(self) -> str:
        return self.store.kernel_formats[0]

    @property
    def index_format(self) -> str:
        return self.store.kernel_formats[1]

    def ring(self, layer_id: int) -> torch.Tensor:
        return self.store.ring[layer_id]

    def pool(self, layer_id: int, kind: str) -> torch.Tensor:
        """The entries the kernels read and write: the store's pool, or in offload mode a CSA layer's
        device pages (`PagedKVStore.page_rows`, through `tables`)."""
        return self.store.page_rows if self._paged(layer_id, kind) else self.store.entries[layer_id][kind]

    def encode_window(self, rows: torch.Tensor) -> torch.Tensor:
        """Window rows in their stored form (the kernels read a token's own row as it will be stored)."""
        return self.store.codec["window"].encode(rows)


@dataclass
class WaveRows:
    """Several decode groups of the same requests at consecutive positions (speculative verify waves:
    group j holds the j-th row of every request that has one) laid out for the paged kernels as one
    batch of multi-token segments: `args` (its `batch` lists the rows in group order, a request's
    segment starting at its row of the first group), `own_rows` [T] long: where each row's stored
    window row goes in the segments' own rows (request after request, the `new_kv` the kernels read),
    and `ring_slots`, `ring_rows` (long, one shape): where the rows, in group order, go in the window
    ring."""

    args: KernelArgs
    own_rows: torch.Tensor
    ring_slots: torch.Tensor
    ring_rows: torch.Tensor


def wave_rows(views: list["PagedDecodeKV"]) -> WaveRows | None:
    """`WaveRows` of decode groups whose request b in group j sits at position p_b + j (p_b its
    position in group 0, which holds every request; a later group holds a subset, in the same
    order), or None where a group takes the reference path or reports each layer's end to a hook
    (the window-state snapshots of the eager path, which a group's rows must reach in order).
    Views over the caller's device tensors (`PagedDecodeKV.fixed`, a CUDA graph's) must all hold
    every request; their layout is built without reading the device, from constants and the groups'
    own kernel inputs. Computed once per forward and shared by its layers."""
    first = views[0]
    cached = first.__dict__.get("_wave_rows", False)
    if cached is not False and cached[0] == len(views):
        return cached[1]
    out = None
    args = [v.kernel_args() for v in views]
    if all(a is not None for a in args) and all(v.on_layer_done is None for v in views):
        out = _wave_rows(views, args)
    first._wave_rows = (len(views), out)
    return out


@functools.lru_cache(maxsize=32)
def _wave_constants(b: int, waves: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token requests [waves·b] int32, segment rows [b] int32, own rows [waves·b] long) of `waves`
    full groups of b requests: made once, outside any CUDA graph capture (its warm-up run makes them)."""
    req = np.tile(np.arange(b), waves)
    row0 = np.arange(b) * waves
    own = row0[req] + np.repeat(np.arange(waves), b)
    return (torch.from_numpy(req.astype(np.int32)).to(device), torch.from_numpy(row0.astype(np.int32)).to(device),
            torch.from_numpy(own).to(device))


def _wave_rows(views: list["PagedDecodeKV"], args: list[KernelArgs]) -> WaveRows | None:
    first, dev = views[0], views[0].positions.device
    b, waves = first.positions.shape[0], len(views)
    positions = torch.cat([a.batch.positions for a in args])            # int32, group after group
    if first.seqs is None:                  # fixed views: every group holds every request
        if any(v.positions.shape[0] != b for v in views):
            return None
        req, row0, own = _wave_constants(b, waves, dev)
        ring_slots = first.slots.unsqueeze(0).expand(waves, b)
        ring_rows = (positions % first.store.config.sliding_window).long().view(waves, b)
    else:                                   # built on the host: groups may hold fewer requests
        index = {id(s): i for i, s in enumerate(first.seqs)}
        try:
            req_host = np.array([index[id(s)] for v in views for s in v.seqs], dtype=np.int64)
        except KeyError:
            return None
        lengths = np.bincount(req_host, minlength=b)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        wave_host = np.repeat(np.arange(waves), [len(v.seqs) for v in views])
        req = torch.from_numpy(req_host.astype(np.int32)).to(dev)
        row0 = torch.from_numpy(starts.astype(np.int32)).to(dev)
        own = torch.from_numpy(starts[req_host] + wave_host).to(dev)
        ring_slots = first.slots[req.long()]
        ring_rows = (positions % first.store.config.sliding_window).long()
    batch = PagedBatch(req, positions, args[0].batch.slots, args[0].batch.block_tables, args[0].batch.positions, row0,
                       first.store.block_tokens)
    return WaveRows(KernelArgs(first.store, batch, max(a.max_pos for a in args), args[0].pages), own, ring_slots,
                    ring_rows)


def _block_mask(blocks: set[int], n: int) -> np.ndarray:
    """bool [n]: True at the block indices in `blocks` (those ≥ n ignored)."""
    mask = np.zeros(n, dtype=bool)
    idx = np.fromiter(blocks, dtype=np.int64, count=len(blocks))
    mask[idx[idx < n]] = True
    return mask


def _window_complete(seq: SeqCache, first_pos: int, window: int) -> bool:
    """Whether every window row a token at first_pos (or later) reads is valid: the kernels take the
    ring rows of all positions ≥ 0; a bounded replay or state-less prefix hit starts them later."""
    return seq.window_start <= max(0, first_pos - window + 1)


class PagedDecodeKV:
    """The batched (`DecodeKV`) view of a group of requests that each decode one token."""

    def __init__(self, store: PagedKVStore, seqs: list[SeqCache], positions: torch.Tensor, on_layer_done=None):
        self.store, self.seqs, self.on_layer_done = store, seqs, on_layer_done
        dev = store.device
        self.host_positions = positions.cpu().tolist()
        self.positions = positions.to(dev)
        self._kernel_args: KernelArgs | None | bool = False     # False: not decided yet
        self.slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        width = max(len(s.block_table) for s in seqs)
        self.tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                   dtype=torch.long, device=dev)
        self.page_tables = None
        if store.offload:
            self.page_tables = torch.tensor([s.pages + [-1] * (width - len(s.pages)) for s in seqs],
                                            dtype=torch.long, device=dev)
        self.window_start = torch.tensor([s.window_start for s in seqs], dtype=torch.long, device=dev)
        self.frozen = torch.tensor([s.frozen_until for s in seqs], dtype=torch.long, device=dev)
        self._b = torch.arange(len(seqs), device=dev)
        self._max_pos = max(self.host_positions)

    @classmethod
    def fixed(cls, store: PagedKVStore, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
              max_pos: int, pages: torch.Tensor | None = None, like: "PagedDecodeKV | None" = None) -> "PagedDecodeKV":
        """A view over device tensors the caller owns and refills (a CUDA graph's inputs): positions,
        slots [B] long, block tables [B, width] long and in offload mode the device pages [B, width]
        long (−1: host only); `max_pos` bounds every position (the kernels' grids are sized from it).
        Paged kernel path only: the caller has checked that each request's window is complete
        (`_window_complete`). `like`: a view over the same slots, tables and pages whose kernel
        inputs this one shares (speculative verify waves: only the positions differ)."""
        if store.offload and pages is None:
            raise ValueError("a store that offloads CSA main entries needs the requests' device pages")
        self = cls.__new__(cls)
        self.store, self.seqs, self.on_layer_done = store, None, None
        self.host_positions, self.positions, self.slots, self.tables = None, positions, slots, tables
        self.page_tables, self.window_start, self.frozen = pages, None, None
        self._b = arange(positions.shape[0], device=positions.device)
        self._max_pos = max_pos
        self._kernel_args, self._like = False, like
        return self

    def window(self, layer_id: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        W = self.store.config.sliding_window
        ring = self.store.ring[layer_id]
        codec = self.store.codec["window"]
        ring[self.slots, self.positions % W] = codec.encode(rows)
        at, valid = window_listing(self.positions, W, self.window_start)
        return codec.decode(ring[self.slots.unsqueeze(1), at]), valid

    def kernel_args(self) -> KernelArgs | None:
        """The group's layout for the paged kernels, or None when attention takes the reference path."""
        if self._kernel_args is False:
            W = self.store.config.sliding_window
            ok = self.store.kernel_formats is not None and (self.seqs is None or all(
                _window_complete(s, p, W) for s, p in zip(self.seqs, self.host_positions)))
            self._kernel_args = None
            like = self.__dict__.get("_like")
            if ok and like is not None and like.kernel_args() is not None:
                pos, base = self.positions.to(torch.int32), like.kernel_args()
                batch = PagedBatch(base.batch.token_req, pos, base.batch.slots, base.batch.block_tables, pos,
                                   base.batch.seg_row0, self.store.block_tokens)
                self._kernel_args = KernelArgs(self.store, batch, self._max_pos, base.pages)
            elif ok:
                rows = arange(self.positions.shape[0], dtype=torch.int32, device=self.positions.device)
                pos = self.positions.to(torch.int32)
                batch = PagedBatch(rows, pos, self.slots.to(torch.int32), self.tables.to(torch.int32), pos, rows,
                                   self.store.block_tokens)
                pages = None
                if self.page_tables is not None and self.store.pages:
                    pages = self.page_tables.to(torch.int32)
                self._kernel_args = KernelArgs(self.store, batch, self._max_pos, pages)
        return self._kernel_args

    def wave_rows(self, views: list["PagedDecodeKV"]) -> "WaveRows | None":
        """This group and the groups after it (`views`, this one first) as one kernel batch:
        `wave_rows`."""
        return wave_rows(views)

    def write_window(self, layer_id: int, stored_rows: torch.Tensor) -> None:
        """Each request's new row (already in stored form) into its ring."""
        W = self.store.config.sliding_window
        self.store.ring[layer_id][self.slots, self.positions % W] = stored_rows

    def compressor_state(self, layer_id: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        kv, score = self.store.states[layer_id][kind]
        return kv[self.slots], score[self.slots]

    def state_tensors(self, layer_id: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The store's compressor state of every slot ([slots, rows, width] kv and score), for kernels
        that update the group's rows (at `slots`) in place."""
        return self.store.states[layer_id][kind]

    def block_start_rope(self, ratio: int, inv_freq: torch.Tensor, key: object) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, rope/2] (contiguous float32) at the first position of the block each token
        would end (pos + 1 − ratio, clamped at 0), computed once per group for layers of one ratio
        and table (`key`)."""
        cache = self.__dict__.setdefault("_block_rope", {})
        if (ratio, key) not in cache:
            from hybridkv.ops.rope import rope_cos_sin
            cache[(ratio, key)] = rope_cos_sin(self.positions, inv_freq, 1 - ratio, 0)
        return cache[(ratio, key)]

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
        codec = self.store.codec[kind]
        encoded = codec.encode(rows)
        pool = self.store.entries[layer_id][kind]
        codec.write(pool, blocks.to(pool.device), (entry_ids % per).to(pool.device), encoded.to(pool.device))
        if kind == "kv" and layer_id in self.store.pages:
            pages = self.page_tables[which, entry_ids // per]
            self.store.pages[layer_id][pages, entry_ids % per] = encoded

    def write_entries(self, layer_id: int, kind: str, which: torch.Tensor, entry_ids: torch.Tensor,
                      rows: torch.Tensor) -> None:
        """append_entries with fixed shapes: entry entry_ids[i] of request which[i] is stored where the
        id is not −1 (those rows leave the pool as it was). The paged kernels' path only."""
        kargs = self.kernel_args()     # offload mode: a CSA layer's device page (`write_back` copies it out)
        pool, tables = kargs.pool(layer_id, kind), kargs.tables(layer_id, kind)
        codec = self.store.codec[kind]
        if codec.store_entries(pool, tables, which, entry_ids, rows):
            return
        per = self._per_block(layer_id)
        keep = (entry_ids >= 0).unsqueeze(-1)
        e = entry_ids.clamp(min=0)
        blocks, slots = tables[which, e // per].long(), e % per
        codec.write(pool, blocks, slots, torch.where(keep, codec.encode(rows, check=False),
                                                     codec.read(pool, blocks, slots)))

    def entries(self, layer_id: int, kind: str, counts: torch.Tensor) -> torch.Tensor:
        per = self._per_block(layer_id)
        nb = max(1, -(-int(counts.max()) // per))
        pool = self.store.entries[layer_id][kind]
        codec = self.store.codec[kind]
        rows = codec.block_rows(pool[self.tables[:, :nb]])                 # [B, nb, per, E]
        rows = rows.reshape(rows.shape[0], nb * per, rows.shape[-1])
        return codec.decode(rows)

    def gather_entries(self, layer_id: int, kind: str, idx: torch.Tensor) -> torch.Tensor:
        per = self._per_block(layer_id)
        if kind == "kv" and layer_id in self.store.pages:
            pages = self.page_tables[self._b.unsqueeze(1), idx // per].clamp(min=0)  # callers mask non-resident
            return self.store.codec[kind].decode(self.store.pages[layer_id][pages, idx % per])
        blocks = self.tables[self._b.unsqueeze(1), idx // per]
        codec = self.store.codec[kind]
        return codec.decode(codec.read(self.store.entries[layer_id][kind], blocks, idx % per))

    def resident(self, layer_id: int, n: int) -> torch.Tensor | None:
        """[B, n] whether each request's entry j of this layer is on the device (None: all are)."""
        if self.page_tables is None or layer_id not in self.store.pages:
            return None
        per = self._per_block(layer_id)
        j = torch.arange(n, device=self.page_tables.device) // per
        cols = j.clamp(max=self.page_tables.shape[1] - 1)
        return (self.page_tables[:, cols] >= 0) & (j < self.page_tables.shape[1])

    def done(self, layer_id: int) -> None:
        if self.on_layer_done is not None and self.seqs is not None:
            for seq, pos in zip(self.seqs, self.positions.tolist()):
                self.on_layer_done(seq, layer_id, pos + 1)
