"""Packed byte formats of KV entries (SPEC §2.2), as plain-torch pack/unpack references.

V4 main entry ("fp8", 584 B at head_dim 512 / rope 64), bytes in order:
    [nope e4m3: D−R][rope bf16: 2R][ue8m0 scale per 64 nope dims: (D−R)/64][zero pad to a multiple of 8]
V4 indexer key ("fp4", 68 B at 128):
    [E2M1 pairs, low nibble = even element: d/2][ue8m0 scale per 32: d/32]

Packing is exact for values the model already round-tripped with power-of-two scales (the nope
dims through FP8 in blocks of 64, the indexer keys through FP4 in blocks of 32): the scale of each
block is re-derived from the block's largest value and every value is representable. The rope dims
are stored in bf16, as the reference keeps them.
"""

from __future__ import annotations

import torch

from hybridkv.ops.quant import FP8_AMAX_FLOOR, FP4_AMAX_FLOOR, pack_fp4, pow2_scale, unpack_fp4

FP8_TILE = 64
FP4_TILE = 32


def main_entry_bytes(head_dim: int, rope_dim: int) -> int:
    nope = head_dim - rope_dim
    raw = nope + 2 * rope_dim + nope // FP8_TILE
    return -(-raw // 8) * 8


def index_entry_bytes(dim: int) -> int:
    return dim // 2 + dim // FP4_TILE


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.float8_e8m0fnu).view(torch.uint8)


def _from_e8m0(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e8m0fnu).float()


def pack_main_fp8(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """[N, D] entries (nope dims already on the FP8 power-of-two grid) -> uint8 [N, bytes]."""
    n, d = x.shape
    nope = d - rope_dim
    blocks = x[:, :nope].float().reshape(n, nope // FP8_TILE, FP8_TILE)
    scale = pow2_scale(blocks.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR), 448.0)
    q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(n, nope).view(torch.uint8)
    rope = x[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out = torch.zeros(n, main_entry_bytes(d, rope_dim), dtype=torch.uint8, device=x.device)
    out[:, :nope] = q
    out[:, nope:nope + 2 * rope_dim] = rope
    out[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nope // FP8_TILE] = _e8m0_bytes(scale)
    return out


def unpack_main_fp8(buf: torch.Tensor, head_dim: int, rope_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = buf.shape[0]
    nope = head_dim - rope_dim
    q = buf[:, :nope].contiguous().view(torch.float8_e4m3fn).float().reshape(n, nope // FP8_TILE, FP8_TILE)
    scale = _from_e8m0(buf[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nope // FP8_TILE])
    rope = buf[:, nope:nope + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    return torch.cat([(q * scale.unsqueeze(-1)).reshape(n, nope), rope], dim=1).to(dtype)


def pack_index_fp4(x: torch.Tensor) -> torch.Tensor:
    """[N, d] indexer keys (already on the FP4 power-of-two grid) -> uint8 [N, d/2 + d/32]."""
    n, d = x.shape
    blocks = x.float().reshape(n, d // FP4_TILE, FP4_TILE)
    scale = pow2_scale(blocks.abs().amax(-1).clamp(min=FP4_AMAX_FLOOR), 6.0)
    codes = pack_fp4((blocks / scale.unsqueeze(-1)).reshape(n, d)).view(torch.uint8)
    return torch.cat([codes, _e8m0_bytes(scale)], dim=1)


def unpack_index_fp4(buf: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = buf.shape[0]
    vals = unpack_fp4(buf[:, : dim // 2].contiguous()).reshape(n, dim // FP4_TILE, FP4_TILE)
    scale = _from_e8m0(buf[:, dim // 2:])
    return (vals * scale.unsqueeze(-1)).reshape(n, dim).to(dtype)
