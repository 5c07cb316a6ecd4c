"""The grouped FP4 expert kernel's pieces one by one on the GPU, each against torch: the weight
address table, the E2M1 and e8m0 decoding, and one 128-deep block's product in each way the kernel
can multiply (`FP4_DOT` 0, 1, 2): if the whole kernel ever disagrees with the per-expert definition
on a GPU while the interpreter's agrees, these say which piece the GPU build gets wrong."""

import pytest
import torch
import triton
import triton.language as tl

from hybridkv.ops.qgemm.layout import _e8m0, _expert_base
from hybridkv.ops.qgemm.triton import FP4_DOT_NAMES, _e2m1, _fp4_block_dot
from hybridkv.ops.quant import dequant_fp4_weight
from hybridkv.ops.quant.reference import unpack_fp4

DEV = "cuda"


@triton.jit
def _table_bytes_kernel(TABLE, OUT, E, NBYTES: tl.constexpr):
    w = _expert_base(TABLE, E, 0, True)
    r = tl.arange(0, NBYTES)
    tl.store(OUT + r, tl.load(w + r))


@triton.jit
def _decode_kernel(W, S, OUT_LO, OUT_HI, OUT_S, N: tl.constexpr, NB: tl.constexpr, NS: tl.constexpr):
    rn = tl.arange(0, N)
    b = tl.load(W + rn[:, None] * NB + tl.arange(0, NB)[None, :]).to(tl.int32)
    tl.store(OUT_LO + rn[:, None] * NB + tl.arange(0, NB)[None, :], _e2m1(b & 15))
    tl.store(OUT_HI + rn[:, None] * NB + tl.arange(0, NB)[None, :], _e2m1(b >> 4))
    s = tl.load(S + rn[:, None] * NS + tl.arange(0, NS)[None, :])
    tl.store(OUT_S + rn[:, None] * NS + tl.arange(0, NS)[None, :], _e8m0(s))


@triton.jit
def _block_dot_kernel(X, TABLE, STABLE, Y, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      FP4_DOT: tl.constexpr):
    w, sc = _expert_base(TABLE, 0, 0, True), _expert_base(STABLE, 0, 0, True)
    r = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rb = tl.arange(0, BK // 2)
    x = tl.load(X + r[:, None] * BK + tl.arange(0, BK)[None, :])
    xe = tl.load(X + r[:, None] * BK + (2 * rb)[None, :]).to(tl.float32)
    xo = tl.load(X + r[:, None] * BK + (2 * rb + 1)[None, :]).to(tl.float32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _fp4_block_dot(acc, x, xe, xo, w, sc, rn, rn < BN, BK // 2, BK // 32, 0, rb, BK, BN, FP4_DOT)
    tl.store(Y + r[:, None] * BN + rn[None, :], acc)


def _packed(n, k, g):
    w = torch.randint(-128, 128, (n, k // 2), device=DEV, generator=g, dtype=torch.int8)
    s = torch.randint(118, 128, (n, k // 32), device=DEV, generator=g).to(torch.uint8)
    return w, s


def test_weight_address_table_reads_the_experts_bytes():
    g = torch.Generator(device=DEV).manual_seed(0)
    experts = [torch.randint(0, 256, (4096,), device=DEV, generator=g, dtype=torch.uint8) for _ in range(3)]
    table = torch.tensor([e.data_ptr() for e in experts], dtype=torch.int64, device=DEV)
    for e in range(3):
        out = torch.empty(512, dtype=torch.uint8, device=DEV)
        _table_bytes_kernel[(1,)](table, out, e, NBYTES=512)
        assert torch.equal(out, experts[e][:512]), f"expert {e}"


def test_e2m1_and_e8m0_decoding():
    g = torch.Generator(device=DEV).manual_seed(1)
    w, s = _packed(64, 128, g)
    lo = torch.empty(64, 64, device=DEV)
    hi = torch.empty(64, 64, device=DEV)
    so = torch.empty(64, 4, device=DEV)
    _decode_kernel[(1,)](w, s, lo, hi, so, N=64, NB=64, NS=4)
    want = unpack_fp4(w)
    assert torch.equal(lo, want[:, 0::2]) and torch.equal(hi, want[:, 1::2])
    assert torch.equal(so, torch.ldexp(torch.ones_like(so), s.int() - 127))


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_one_block_product(mode):
    """x [16, 128] (bf16 values exact in e4m3 × 2^k) × one expert's packed block [64 × 128]ᵀ."""
    g = torch.Generator(device=DEV).manual_seed(2)
    w, s = _packed(64, 128, g)
    x = torch.randint(-8, 9, (16, 128), device=DEV, generator=g).float().mul(0.25).bfloat16()
    table = torch.tensor([w.data_ptr()], dtype=torch.int64, device=DEV)
    stable = torch.tensor([s.data_ptr()], dtype=torch.int64, device=DEV)
    y = torch.full((16, 64), float("nan"), device=DEV)
    _block_dot_kernel[(1,)](x, table, stable, y, BM=16, BN=64, BK=128, FP4_DOT=mode)
    dense = dequant_fp4_weight(w, s.view(torch.float8_e8m0fnu), 32, torch.float64)
    want = x.double() @ dense.t()
    if mode == 2:        # the nibble-swapped reading computes with each byte's codes exchanged
        pytest.skip(f"{FP4_DOT_NAMES[2]}: a diagnostic, not a definition; got rel err "
                    f"{float((y.double() - want).norm() / want.norm()):.2e}")
    err = float((y.double() - want).norm() / want.norm())
    print(f"{FP4_DOT_NAMES[mode]}: rel err {err:.2e}")
    assert err < 1e-6, FP4_DOT_NAMES[mode]


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("k", [512, 4096])
def test_one_expert_launch_against_torch(mode, k):
    """The whole launch (`grouped_fp4`, no gather, no SwiGLU) for one expert's 20 rows in two row
    tiles: what the kernel's first-use check compares, here against torch."""
    from hybridkv.ops.qgemm.triton import grouped_fp4
    from hybridkv.ops.quant.triton import fp8_round_trip
    g = torch.Generator(device=DEV).manual_seed(3)
    n, p = 256, 20
    w, s = _packed(n, k, g)
    x = fp8_round_trip(torch.randn(p, k, device=DEV, generator=g).bfloat16(), 128)
    table = torch.tensor([w.data_ptr()], dtype=torch.int64, device=DEV)
    stable = torch.tensor([s.data_ptr()], dtype=torch.int64, device=DEV)
    tiles = (torch.zeros(2, dtype=torch.int32, device=DEV), torch.tensor([0, 16], dtype=torch.int32, device=DEV),
             torch.tensor([16, p], dtype=torch.int32, device=DEV))
    got = grouped_fp4(x, None, tiles, (table, stable), n, torch.float32,
                      config=dict(BM=16, BN=64, num_warps=4, num_stages=2), fp4_dot=mode)
    want = x.double() @ dequant_fp4_weight(w, s.view(torch.float8_e8m0fnu), 32, torch.float64).t()
    err = float((got.double() - want).norm() / want.norm())
    print(f"{FP4_DOT_NAMES[mode]}, K={k}: rel err {err:.2e}")
    assert err < 1e-5, FP4_DOT_NAMES[mode]
