"""Row gathers between memories: `dst[dst_rows] = src[src_rows]` over the first dimension, as one
operation however many rows move. On CUDA one Triton launch, which reads `src` where it lies: a
source in pinned host memory is read by the device itself over PCIe (the host does not walk the
rows, and the copy queues on the current stream like any kernel). A FlashMemory recall moves
hundreds of pages a request this way, where a copy call per page would cost the host tens of
microseconds each. Elsewhere the plain-torch index copy."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton


def _words(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, words] of the widest integer type its row's bytes divide into."""
    row = t[0].numel() * t.element_size() if t.shape[0] else 0
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row % size == 0:
            return flat.view(dtype)
    return flat


def gather_rows_(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i. dst and src: contiguous, the same dtype and row
    shape; dst_rows and src_rows: int64 on dst's device (distinct destination rows). On CUDA, `src`
    may be a pinned host tensor (read over PCIe by the kernel) or a device tensor."""
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"gather_rows_: rows of {tuple(src.shape[1:])} {src.dtype} into rows of "
                         f"{tuple(dst.shape[1:])} {dst.dtype}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("gather_rows_: dst and src must be contiguous")
    if dst_rows.numel() != src_rows.numel():
        raise ValueError(f"gather_rows_: {src_rows.numel()} source rows for {dst_rows.numel()} destination rows")
    if not dst_rows.numel():
        return
    if use_triton(dst):
        if src.device.type == "cpu" and dst.is_cuda and not src.is_pinned():
            raise ValueError("gather_rows_: a host source must be pinned for the device to read it")
        from hybridkv.ops.row_gather import triton as kernels
        kernels.gather_rows(_words(dst), dst_rows, _words(src), src_rows)
        return
    dst.index_copy_(0, dst_rows.to(dst.device), src.index_select(0, src_rows.to(src.device)).to(dst.device))
