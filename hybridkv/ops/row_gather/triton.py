"""Triton row gather: a fixed grid of programs walks the (row, piece) tiles, each copying one piece of
BLOCK words of a row. A few hundred programs keep enough loads in flight to fill PCIe when the
source is pinned host memory, without taking every SM from the decode steps running beside it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048          # words a tile
MAX_PROGRAMS = 264    # two a streaming multiprocessor of an H100 / H200


@triton.jit
def gather_rows_kernel(DST, DST_ROWS, SRC, SRC_ROWS, n_tiles, words, pieces, BLOCK: tl.constexpr):
    c = tl.arange(0, BLOCK)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        i = t // pieces
        w = (t % pieces) * BLOCK + c
        ok = w < words
        s = tl.load(SRC_ROWS + i).to(tl.int64)
        d = tl.load(DST_ROWS + i).to(tl.int64)
        tl.store(DST + d * words + w, tl.load(SRC + s * words + w, mask=ok), mask=ok)


def gather_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
    """dst, src: [rows, words] contiguous integer views; the row indices int64 on dst's device."""
    words = dst.shape[1]
    pieces = triton.cdiv(words, BLOCK)
    n_tiles = dst_rows.numel() * pieces
    grid = (min(n_tiles, MAX_PROGRAMS),)
    gather_rows_kernel[grid](dst, dst_rows, src, src_rows, n_tiles, words, pieces, BLOCK=BLOCK, num_warps=4)
