"""The tensor-core FP4 expert kernel (`qgemm.fp4_mma`) on the GPU against the dequantised
definition in float64: tiles of 1 to 8 rows, gathered and in-place activations, stacked experts
and address tables, bf16 and float32 activations and outputs, scales above 2 (the scale shift),
its SwiGLU epilogue, and bit-equal results when repeated."""

import pytest
import torch

from hybridkv.ops import grouped_moe
from hybridkv.ops.qgemm import fp4_mma
from hybridkv.ops.qgemm import triton as kernels
from hybridkv.ops.quant.reference import unpack_fp4
from hybridkv.ops.quant.triton import fp8_round_trip

DEV = "cuda"
# float32 accumulation of exact products against float64: 2e-7..1e-6 measured on random codes
MMA_TOL = 1e-5


def _experts(e, n, k, g, scale_lo=118, scale_hi=128):
    w = torch.randint(-128, 128, (e, n, k // 2), device=DEV, generator=g, dtype=torch.int8)
    s = torch.randint(scale_lo, scale_hi, (e, n, k // 32), device=DEV, generator=g).to(torch.uint8)
    return w, s


def _dense(w, s):
    """[E, N, K] float64 of packed codes and e8m0 bytes."""
    vals = unpack_fp4(w.reshape(-1, w.shape[-1])).double().view(*w.shape[:2], -1)
    return vals * torch.ldexp(torch.ones_like(s, dtype=torch.float64), s.long() - 127).repeat_interleave(32, -1)


def _rel(ref, out):
    ref, out = ref.double(), out.double()
    assert torch.isfinite(out).all()
    return float((ref - out).square().mean().sqrt() / ref.square().mean().sqrt())


def _problem(tokens, topk, n_experts, g, x_dtype):
    ids = torch.rand(tokens, n_experts, device=DEV, generator=g).argsort(-1)[:, :topk]
    sort = grouped_moe.sort_by_expert(ids, n_experts)
    x = fp8_round_trip(torch.randn(tokens, 512, device=DEV, generator=g).to(x_dtype), 128)
    return ids, sort, x


@pytest.mark.parametrize("tokens,topk,n_experts", [(1, 6, 16), (3, 4, 4), (64, 6, 16), (20, 2, 2)])
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("table", [False, True])
def test_projection_against_the_dequantised_weights(tokens, topk, n_experts, x_dtype, out_dtype, table):
    g = torch.Generator(device=DEV).manual_seed(tokens * 7 + topk)
    n, k = 256, 512
    w, s = _experts(n_experts, n, k, g)
    ids, sort, x = _problem(tokens, topk, n_experts, g, x_dtype)
    tiles = grouped_moe.expert_tiles(sort, fp4_mma.TILE_ROWS)
    rows = sort.token.int()
    weights = (w.view(torch.uint8), s)
    if table:
        weights = tuple(torch.tensor([t[e].data_ptr() for e in range(n_experts)], dtype=torch.int64, device=DEV)
                        for t in (w, s))
    for cfg in ({"MT": 1, "WK": 1, "STAGES": 2}, {"MT": 2, "WK": 2, "STAGES": 3}, {"MT": 1, "WK": 8, "STAGES": 2},
                {"MT": 1, "WK": 4, "STAGES": 4}, {"MT": 1, "WK": 2, "STAGES": 2, "CK": 4},
                {"MT": 2, "WK": 1, "STAGES": 3, "CK": 2}, {"MT": 2, "WK": 4, "STAGES": 3}):
        got = kernels.grouped_fp4(x, rows, tiles, weights, n, out_dtype, config=dict(BM=8, MMA=True, **cfg))
        dense = _dense(w, s)
        want = torch.einsum("pk,pnk->pn", x.double()[sort.token], dense[sort.expert])
        if out_dtype == torch.bfloat16:
            want = want.to(torch.bfloat16)
        err = _rel(want, got)
        print(f"{tokens}x{topk}/{n_experts} {x_dtype}->{out_dtype} table={table} {cfg}: rel {err:.2e}")
        assert err < (MMA_TOL if out_dtype == torch.float32 else 5e-3)
        again = kernels.grouped_fp4(x, rows, tiles, weights, n, out_dtype, config=dict(BM=8, MMA=True, **cfg))
        assert torch.equal(got, again)


def test_scales_above_two_take_the_shift():
    g = torch.Generator(device=DEV).manual_seed(3)
    n, k, e = 64, 512, 2
    w, s = _experts(e, n, k, g, scale_lo=120, scale_hi=200)        # up to 2^72
    ids, sort, x = _problem(5, 1, e, g, torch.bfloat16)
    tiles = grouped_moe.expert_tiles(sort, fp4_mma.TILE_ROWS)
    shift = fp4_mma.scale_shift(int(s.max()))
    assert shift > 0
    got = kernels.grouped_fp4(x, sort.token.int(), tiles, (w.view(torch.uint8), s), n, torch.float32,
                              config=dict(BM=8, MMA=True), shift=shift)
    want = torch.einsum("pk,pnk->pn", x.double()[sort.token], _dense(w, s)[sort.expert])
    assert _rel(want, got) < MMA_TOL


def test_swiglu_epilogue_matches_the_one_row_kernel():
    """w1 and w3 with the SwiGLU, limit and routing weight, against the CUDA-core kernel (the same
    contract, float32 sums in another order)."""
    g = torch.Generator(device=DEV).manual_seed(4)
    n, k, e = 256, 512, 8
    (w1, s1), (w3, s3) = _experts(e, n, k, g), _experts(e, n, k, g)
    ids, sort, x = _problem(12, 3, e, g, torch.bfloat16)
    route = torch.rand(sort.order.shape[0], device=DEV, generator=g)
    args = dict(w3=(w3.view(torch.uint8), s3), route=route, limit=7.0)
    rows = sort.token.int()
    got = kernels.grouped_fp4(x, rows, grouped_moe.expert_tiles(sort, 8), (w1.view(torch.uint8), s1), n,
                              torch.float32, config=dict(BM=8, MMA=True), **args)
    ref = kernels.grouped_fp4(x, rows, grouped_moe.expert_tiles(sort, 1), (w1.view(torch.uint8), s1), n,
                              torch.float32, config=dict(BM=1, BN=32, num_warps=4), **args)
    err = _rel(ref, got)
    print(f"swiglu: rel {err:.2e}")
    assert err < MMA_TOL


def test_decode_sizes_take_the_mma_kernel():
    x = torch.zeros(1, 4096, device=DEV, dtype=torch.bfloat16)
    assert fp4_mma.usable(x, (2048, 4096), (4096, 2048))
    assert kernels.grouped_config(6, 2048, 256, gated=True, mma=True)["MMA"]
    assert kernels.grouped_config(768, 2048, 256, gated=True, mma=True)["MMA"]      # 128 tokens, top-6
    assert "MMA" not in kernels.grouped_config(16 * 256 + 1, 2048, 256, gated=True, mma=True)


def test_routed_experts_past_the_one_launch_routing_take_the_mma_tiles(monkeypatch):
    """128 tokens × top-6 among 64 experts (768 pairs, past the fused routing launch's 512: sorted by
    torch, tiled by 8) through `routed_experts_fp4`: the MMA tiles against the Triton tiles."""
    g = torch.Generator(device=DEV).manual_seed(5)
    e, dim, inter = 64, 512, 256
    w = [[(c, sc.view(torch.float8_e8m0fnu)) for c, sc in zip(*_experts(e, n_out, n_in, g))]
         for n_out, n_in in ((inter, dim), (inter, dim), (dim, inter))]
    tables = grouped_moe.expert_tables(*w)
    x = torch.randn(128, dim, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.rand(128, e, device=DEV, generator=g).argsort(-1)[:, :6]
    weights = torch.rand(128, 6, device=DEV, generator=g)
    assert kernels.grouped_config(ids.numel(), inter, e, gated=True, mma=True)["MMA"]
    got = grouped_moe.routed_experts_fp4(x, weights, ids, tables, 7.0, torch.float32)
    monkeypatch.setenv("HYBRIDKV_FP4_MMA", "0")
    ref = grouped_moe.routed_experts_fp4(x, weights, ids, tables, 7.0, torch.float32)
    err = _rel(ref, got)
    print(f"768 pairs: rel {err:.2e}")
    assert err < 1e-4
