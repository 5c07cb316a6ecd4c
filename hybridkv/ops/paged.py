"""Where a batch's KV rows live, in the form the paged kernels read it (one owner: the ops layer).

A flat batch of T query tokens belongs to R requests. Per request r:
- `slots[r]`: its row in every window ring pool `[num_slots, window, E]` (ring row = pos % window),
- `block_tables[r]`: int32 ids of its logical blocks in every compressed pool
  `[num_blocks, entries_per_block, E]`; compressed entry j of a ratio-`ratio` layer lives in block
  `block_tables[r, j // (block_tokens // ratio)]`, slot `j % (block_tokens // ratio)`,
- `seg_start[r]`: position of the chunk's first token; positions before it are read from the ring,
  positions from it on from the chunk's own rows (`new_kv`),
- `seg_row0[r]`: the flat row of that first token.
Per token t: `token_req[t]` (its request) and `positions[t]` (absolute position).

`E` is the entry format: "bf16" (or any float dtype: elements) or "fp8" (uint8 bytes, the 584-B
packed layout of `hybridkv.ops.kv_formats`); indexer pools are "bf16" or "fp4" (68-B packed keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.ops.transfer import to_device


@dataclass
class PagedBatch:
    token_req: torch.Tensor      # [T] int32
    positions: torch.Tensor      # [T] int32
    slots: torch.Tensor          # [R] int32
    block_tables: torch.Tensor   # [R, max_blocks] int32
    seg_start: torch.Tensor      # [R] int32
    seg_row0: torch.Tensor       # [R] int32
    block_tokens: int = 128
    # token_req as built on the host (`build`): what the indexer's prefill tiles are made from
    # without reading the device
    host_token_req: np.ndarray | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, segments: list[tuple[int, int, int, list[int] | torch.Tensor]], block_tokens: int = 128,
              device=None) -> "PagedBatch":
        """segments: (slot, start_pos, length, block ids) per request, in row order."""
        if not segments:
            raise ValueError("a batch needs at least one segment")
        slots, starts, lengths, tables = zip(*segments)
        lengths = np.array(lengths, dtype=np.int64)
        if (lengths <= 0).any():
            raise ValueError("a segment needs at least one token")
        # numpy: a decode batch of a hundred requests holds a hundred block tables of a thousand ids
        tables = [t.cpu().numpy().reshape(-1) if isinstance(t, torch.Tensor) else t for t in tables]
        width = max(1, max(len(t) for t in tables))
        bt = np.full((len(tables), width), -1, dtype=np.int32)
        for r, t in enumerate(tables):
            bt[r, :len(t)] = t
        rows0 = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        token_req = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        positions = (np.arange(lengths.sum()) - np.repeat(rows0, lengths) + np.repeat(starts, lengths)).astype(np.int32)

        def i32(a) -> torch.Tensor:
            return to_device(np.ascontiguousarray(a, dtype=np.int32), device)
        return cls(i32(token_req), i32(positions), i32(slots), i32(bt), i32(starts), i32(rows0), block_tokens,
                   host_token_req=token_req)

    @property
    def num_tokens(self) -> int:
        return int(self.token_req.shape[0])

    def to(self, device) -> "PagedBatch":
        return PagedBatch(*(getattr(self, f).to(device) for f in
                            ("token_req", "positions", "slots", "block_tables", "seg_start", "seg_row0")),
                          block_tokens=self.block_tokens, host_token_req=self.host_token_req)


def entry_rows(batch: PagedBatch, req: torch.Tensor, entries: torch.Tensor, per_block: int) -> torch.Tensor:
    """Flat pool rows (block * per_block + slot) of compressed entries `entries` of requests `req`;
    −1 where the entry is −1."""
    e = entries.long().clamp(min=0)
    blk = batch.block_tables.long()[req.long(), e // per_block]
    return torch.where(entries >= 0, blk * per_block + e % per_block, -1)
