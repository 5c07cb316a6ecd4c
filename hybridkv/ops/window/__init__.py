"""A decode token's window row into the ring, in one launch: the FP8 round trip of the nope dims
(blocks of 64, power-of-two scales), packing into the 584-B main entry layout of
`hybridkv.ops.kv_formats` and the store at ring row pos % W of the request's slot. Returns the
packed rows too (the attention kernels read a token's own row from them). The reference is the
composition the model runs elsewhere: `fp8_round_trip`, `pack_main_fp8`, an indexed store.
`write_window_float` does the same for a float store's rows (the round trip with power-of-two or
plain scales, then the ring's dtype), `write_window_v41` for V4.1's window rows (FP8 in blocks of
32, `pack_v41_window`).

`round_trip_window_rows`: the rows a ring keeps, stored nowhere (the attention's own rows elsewhere).
`window_listing`: the ring rows a decode token's window reads, in one launch where the kernels run."""

from __future__ import annotations

import torch

from hybridkv.config import KV_FP8_BLOCK, V41_WINDOW_FP8_BLOCK
from hybridkv.ops.backend import use_triton
from hybridkv.ops.kv_formats import main_entry_bytes, pack_main_fp8, pack_v41_window, v41_window_bytes
from hybridkv.ops.quant import fp8_round_trip
from hybridkv.ops.ranges import arange


def write_window_fp8(kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     rope_dim: int) -> torch.Tensor:
    """kv [B, D] (normalised and rotated, nope dims not yet or already round-tripped: the trip is
    idempotent), ring [slots, W, bytes] uint8, slots/positions [B] -> packed rows [B, bytes]."""
    b, d = kv.shape
    if ring.shape[-1] != main_entry_bytes(d, rope_dim):
        raise ValueError(f"window ring rows of {ring.shape[-1]} B are not {d}-dim main entries")
    if use_triton(kv) and rope_dim == KV_FP8_BLOCK and not d & (d - 1):
        from hybridkv.ops.window import triton as kernels
        return kernels.write_window_fp8(kv, ring, slots, positions, rope_dim)
    stored = pack_main_fp8(_round_trip(kv, rope_dim, True), rope_dim)
    ring[slots, positions % ring.shape[1]] = stored
    return stored


def write_window_float(kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       rope_dim: int, pow2: bool) -> torch.Tensor:
    """kv [B, D] (normalised and rotated, nope dims not yet round-tripped), ring [slots, W, D] of a
    float dtype, slots/positions [B] -> the stored rows [B, D] in the ring's dtype: the nope dims
    through FP8 and back in blocks of 64 (power-of-two scales where `pow2`, else plain amax/448),
    the rope dims as they are."""
    b, d = kv.shape
    if ring.shape[-1] != d or not ring.dtype.is_floating_point:
        raise ValueError(f"window ring rows of {ring.shape[-1]} {ring.dtype} are not {d}-dim float rows")
    if _float_kernel_ok(kv, rope_dim) and ring.dtype in FLOAT_ROWS:
        from hybridkv.ops.window import triton as kernels
        return kernels.write_window_float(kv, ring, slots, positions, rope_dim, pow2)
    stored = _round_trip(kv, rope_dim, pow2).to(ring.dtype)
    ring[slots, positions % ring.shape[1]] = stored
    return stored


def round_trip_window_rows(kv: torch.Tensor, rope_dim: int, pow2: bool) -> torch.Tensor:
    """kv [..., D] -> the rows a window ring keeps of them, in kv's dtype: the nope dims through FP8
    and back in blocks of 64 (power-of-two scales where `pow2`, else plain amax/448), the rope dims as
    they are; one launch where the kernels run (no gradient)."""
    if (_float_kernel_ok(kv, rope_dim) and kv.numel() and kv.stride(-1) == 1
            and not (torch.is_grad_enabled() and kv.requires_grad)):
        from hybridkv.ops.window import triton as kernels
        return kernels.round_trip_rows(kv.reshape(-1, kv.shape[-1]), rope_dim, pow2).view(kv.shape)
    return _round_trip(kv, rope_dim, pow2)


FLOAT_ROWS = (torch.float32, torch.bfloat16)      # the dtypes the float-row kernel reads and writes


def _float_kernel_ok(kv: torch.Tensor, rope_dim: int) -> bool:
    """Whether the float-row window kernel takes these rows: the kernels run, 64 rope dims (the last
    FP8 block), a power-of-two head dim past them, float32 or bf16 rows."""
    d = kv.shape[-1]
    return use_triton(kv) and rope_dim == KV_FP8_BLOCK and not d & (d - 1) and d > rope_dim and kv.dtype in FLOAT_ROWS


def _round_trip(kv: torch.Tensor, rope_dim: int, pow2: bool) -> torch.Tensor:
    """The reference composition: the nope dims through FP8 and back in blocks of 64, the rope dims
    as they are, in kv's dtype."""
    return torch.cat([fp8_round_trip(kv[..., :-rope_dim], KV_FP8_BLOCK, pow2), kv[..., -rope_dim:]], -1)


def write_window_v41(kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """kv [B, D] (normalised and rotated, round-tripped or not), ring [slots, W, bytes] uint8 of V4.1
    window rows, slots/positions [B] -> packed rows [B, bytes]."""
    b, d = kv.shape
    if ring.shape[-1] != v41_window_bytes(d):
        raise ValueError(f"window ring rows of {ring.shape[-1]} B are not {d}-dim V4.1 window rows")
    if use_triton(kv) and not d & (d - 1) and d >= V41_WINDOW_FP8_BLOCK:
        from hybridkv.ops.window import triton as kernels
        return kernels.write_window_v41(kv, ring, slots, positions, V41_WINDOW_FP8_BLOCK)
    stored = pack_v41_window(fp8_round_trip(kv, V41_WINDOW_FP8_BLOCK))
    ring[slots, positions % ring.shape[1]] = stored
    return stored


def window_listing(positions: torch.Tensor, window: int, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The window a token at positions[b] reads, listed as a one-token segment lists it: positions
    from max(0, pos − window + 1) on, oldest first, so the reductions run in the same order; (their
    ring rows [B, window] int64, their validity [B, window] bool: from start[b] up to the token
    itself, positions past it invalid at the end while the window fills)."""
    if use_triton(positions) and positions.dim() == 1 and start.shape == positions.shape:
        from hybridkv.ops.window import triton as kernels
        return kernels.window_listing(positions, window, start)
    pos = positions.unsqueeze(1)
    window_pos = (pos - window + 1).clamp(min=0) + arange(window, device=positions.device)
    return window_pos % window, (window_pos >= start.clamp(min=0).unsqueeze(1)) & (window_pos <= pos)
