"""The packed-weight GEMMs against dequantise-then-GEMM (relative RMS): FP8 linears in their
decode (split-K) and prefill configurations, and the grouped
FP4 experts over tokens sorted by expert against the per-expert loop."""

import itertools
import shutil
import subprocess

import pytest
import torch

from helpers import interpreter_only, rel_rms
from hybridkv.model.linear import Linear
from hybridkv.model.moe import MoE
from hybridkv.ops import grouped_moe
from hybridkv.ops.qgemm import reference
from hybridkv.ops.qgemm import triton as kernels
from hybridkv.ops.quant import quant_fp8_weight
from hybridkv.presets import PRESETS, get_preset

# fp32 in the interpreter: what differs is the order of the fp32 additions (~1e-7); the activation
# round trip is bit-identical, so a wrong scale or block index shows as errors of 1e-2 and more
TOL = 1e-5


def _fp8_weight(n, k, g):
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n // 128).repeat_interleave(128)[:, None]
    return quant_fp8_weight(w)


@pytest.mark.parametrize("rows", [1, 2, 5, 70])
@pytest.mark.parametrize("n,k", [(256, 256), (128, 1024)])
def test_fp8_linear_matches_dequantised_gemm(device, rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    q, s = _fp8_weight(n, k, g)
    x = torch.randn(rows, k, generator=g) * 3
    x[0, :128] *= 1e-3                                   # blocks of very different scale
    q, s, x = q.to(device), s.to(device), x.to(device)
    cfg = kernels.fp8_config(rows, n, k)
    assert (cfg["SPLIT_K"] > 1) == (rows <= 64 and k >= 512)  # the decode shape splits K
    want = reference.fp8_linear(x, q, s, (128, 128), torch.float32)
    got = kernels.fp8_linear(x, q, s, torch.float32)
    assert got.shape == (rows, n)
    # on Hopper the prefill tiles' FP8 warpgroup MMAs accumulate with about 14 bits within each
    # 128-deep block (the limit DeepSeek-V3 reports; the scales promote every block): measured
    # 1.3e-4 at 70 rows on the H200, where a wrong scale or block shows as 1e-2 and more
    assert rel_rms(want, got) < (1e-3 if device == "cuda" and rows > 64 else TOL)


@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_fp8_linear_with_v41_scale_tiles_matches_dequantised_gemm(device, block, rows):
    """V4.1's release scales its FP8 weights per 32×32 tile and quantises the input per 32 values:
    the GEMM steps K by the tile, and a 64-column output tile spans two rows of scales (N = 160
    ends inside one)."""
    g = torch.Generator().manual_seed(block + rows)
    n, k = 160, 256
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n // 32).repeat_interleave(32)[:, None]
    q, s = quant_fp8_weight(w, (block, block))
    x = torch.randn(rows, k, generator=g) * 3
    x[0, :block] *= 1e-3                                 # input blocks of very different scale
    q, s, x = q.to(device), s.to(device), x.to(device)
    want = reference.fp8_linear(x, q, s, (block, block), torch.float32)
    got = kernels.fp8_linear(x, q, s, torch.float32, block=block)
    assert rel_rms(want, got) < (1e-3 if device == "cuda" and rows > 64 else TOL)
    with pytest.raises(ValueError, match="scale tiles of 48"):
        kernels.fp8_linear(x, q, s, torch.float32, block=48)


def test_fp8_linear_keeps_leading_dims_and_ragged_n(device):
    g = torch.Generator().manual_seed(7)
    q, s = _fp8_weight(384, 256, g)
    x = torch.randn(2, 3, 256, generator=g).to(device)
    cfg = dict(BM=16, BN=128, SPLIT_K=1, GROUP_M=2, num_warps=4, num_stages=2)
    got = kernels.fp8_linear(x, q.to(device), s.to(device), torch.float32, config=cfg)
    assert rel_rms(reference.fp8_linear(x, q.to(device), s.to(device), (128, 128), torch.float32), got) < TOL


def _fp4_moe(seed, experts=6, topk=2, device="cpu", block=128):
    quant = {**PRESETS["v4-tiny-fp8"]["quantization_config"], "weight_block_size": [block, block]}
    cfg = get_preset("v4-tiny-fp8", n_routed_experts=experts, num_experts_per_tok=topk, quantization_config=quant)
    with torch.device(device):          # made where it runs: the experts' stacked buffers with it
        moe = MoE(cfg, 2, "fp8", "fp4", torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for e in moe.experts:
            for lin in (e.w1, e.w2, e.w3):
                lin.weight.copy_(torch.randint(-128, 128, lin.weight.shape, generator=g, dtype=torch.int8))
                lin.scale.copy_(2.0 ** torch.randint(-9, -4, lin.scale.shape, generator=g).float())
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=g))
    return moe


@pytest.mark.parametrize("layout", ["stacked", "separate"])
@pytest.mark.parametrize("tokens", [1, 3, 5, 40])
def test_grouped_fp4_experts_match_the_per_expert_loop(device, tokens, layout):
    """The MoE's experts as it builds them (one buffer per projection, read by offset) and as
    separate tensors (read through address tables)."""
    moe = _fp4_moe(tokens, device=device)
    g = torch.Generator().manual_seed(50 + tokens)
    x = torch.randn(tokens, moe.gate.weight.shape[1], generator=g).to(device)
    with torch.no_grad():
        weights, ids = moe.gate(x, torch.zeros(tokens, dtype=torch.long, device=device))
        want = grouped_moe.reference.routed_experts(x, weights, ids, moe.n_experts,
                                                    lambda e, rows, route: moe.experts[e](rows, route))
        projections = [[(getattr(e, w).weight, getattr(e, w).scale) for e in moe.experts] for w in ("w1", "w3", "w2")]
        if layout == "separate":
            projections = [[(w.clone(), s.clone()) for w, s in proj] for proj in projections]
        tables = grouped_moe.expert_tables(*projections)
        got = grouped_moe.routed_experts_fp4(x, weights, ids, tables, moe.experts[0].limit, torch.float32)
    assert tables.dim == 256 and tables.inter == 128
    assert tables.stacked == (layout == "stacked")
    if layout == "stacked":
        assert tables.w1.shape == (6, 128, 128) and tables.w1.data_ptr() == moe.experts[0].w1.weight.data_ptr()
    assert rel_rms(want, got) < TOL


def test_grouped_fp4_prefill_tiles_and_clamping(device):
    """Enough pairs for the 64-row tiles; large activations so the SwiGLU clamps bite."""
    moe = _fp4_moe(9, experts=4, topk=2, device=device)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(300, 256, generator=g) * 30).to(device)
    assert kernels.grouped_config(600, 128)["BM"] == 64
    with torch.no_grad():
        weights, ids = moe.gate(x / 30, torch.zeros(300, dtype=torch.long, device=device))   # routing of ordinary inputs
        want = grouped_moe.reference.routed_experts(x, weights, ids, 4, lambda e, r, w: moe.experts[e](r, w))
        gate = moe.experts[0].w1(x).float()
        assert (gate > moe.experts[0].limit).any()
        projections = [[(getattr(e, w).weight, getattr(e, w).scale) for e in moe.experts] for w in ("w1", "w3", "w2")]
        got = grouped_moe.routed_experts_fp4(x, weights, ids, grouped_moe.expert_tables(*projections),
                                             moe.experts[0].limit, torch.float32)
    assert rel_rms(want, got) < TOL


@pytest.mark.parametrize("bk", [256, 512])
def test_grouped_fp4_deeper_k_steps_give_the_same_product(device, bk):
    """A config's BK (inputs per loop iteration) changes how the K loop is cut, not the result:
    one expert's 20 rows (two row tiles) × a packed [128 × 512] weight against torch, and a BK
    that does not divide K is refused."""
    from hybridkv.ops.quant import dequant_fp4_weight
    g = torch.Generator().manual_seed(bk)
    n, k, p = 128, 512, 20
    w = torch.randint(-128, 128, (n, k // 2), generator=g, dtype=torch.int8)
    s = torch.randint(118, 128, (n, k // 32), generator=g).to(torch.uint8)
    x = reference.act_quant_sim(torch.randn(p, k, generator=g), 128)
    w, s, x = w.to(device), s.to(device), x.to(device)
    tables = (torch.tensor([w.data_ptr()], device=device), torch.tensor([s.data_ptr()], device=device))
    tiles = tuple(torch.tensor(t, dtype=torch.int32, device=device) for t in ([0, 0], [0, 16], [16, p]))
    got = kernels.grouped_fp4(x, None, tiles, tables, n, torch.float32,
                              config=dict(BM=16, BN=64, BK=bk, num_warps=4, num_stages=1))
    want = x.double() @ dequant_fp4_weight(w, s.view(torch.float8_e8m0fnu), 32, torch.float64).t()
    assert rel_rms(want, got) < TOL
    with pytest.raises(ValueError, match="BK 384"):
        kernels.grouped_fp4(x, None, tiles, tables, n, torch.float32, config=dict(BM=16, BN=64, BK=384))


@pytest.mark.parametrize("bn,bk,layout,x_scale", [(16, 128, "stacked", 4.0), (32, 256, "table", 4.0),
                                                  (64, 512, "stacked", 4.0), (32, 256, "stacked", 1e-6)])
def test_one_row_decode_kernel_matches_torch(device, bn, bk, layout, x_scale):
    """The decode kernel (one sorted row per program, codes widened by bit placement) against
    torch in float64: every E2M1 code (the subnormal 0.5 too) and both signs, rows gathered from
    their tokens, three experts with one, two and three rows, a column count no tile divides; with
    w3 the clamped SwiGLU times the routing weight. Tiny activations too: placed codes times 2^-126
    times an activation of 1e-6 were subnormal float32 products before the activations were scaled."""
    from hybridkv.ops.quant import dequant_fp4_weight
    g = torch.Generator().manual_seed(bn + bk)
    e_n, n, k = 3, 80, 512
    w = torch.randint(0, 256, (2, e_n, n, k // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(118, 128, (2, e_n, n, k // 32), generator=g).to(torch.uint8)
    x = reference.act_quant_sim(torch.randn(4, k, generator=g) * x_scale, 128)
    ids = torch.tensor([[0, 2], [1, 2], [2, 1], [0, 0]])
    sort = grouped_moe.sort_by_expert(ids, e_n)
    tiles = grouped_moe.expert_tiles(sort, 1)
    route = torch.rand(ids.numel(), generator=g)
    w, s, x, route = w.to(device), s.to(device), x.to(device), route.to(device)
    tiles = tuple(t.to(device) for t in tiles)
    token = sort.token.int().to(device)
    if layout == "table":
        proj = [(torch.tensor([w[j, e].data_ptr() for e in range(e_n)], device=device),
                 torch.tensor([s[j, e].data_ptr() for e in range(e_n)], device=device)) for j in range(2)]
    else:
        proj = [(w[j], s[j]) for j in range(2)]
    cfg = dict(BM=1, BN=bn, BK=bk, num_warps=4)
    got = kernels.grouped_fp4(x, token, tiles, proj[0], n, torch.float32, config=cfg)
    dense = [[dequant_fp4_weight(w[j, e].view(torch.int8), s[j, e].view(torch.float8_e8m0fnu), 32, torch.float64)
              for e in range(e_n)] for j in range(2)]
    xs = x[token.long()].double()
    want = torch.stack([xs[i] @ dense[0][int(sort.expert[i])].t() for i in range(len(xs))])
    assert rel_rms(want, got) < TOL
    limit = 20.0 * x_scale / 4
    got = kernels.grouped_fp4(x, token, tiles, proj[0], n, torch.float32, w3=proj[1], route=route,
                              limit=limit, config=cfg)
    up = torch.stack([xs[i] @ dense[1][int(sort.expert[i])].t() for i in range(len(xs))])
    assert (want.abs() > limit).any() and (up.abs() > limit).any()       # the clamps bite
    gate, up = want.clamp(max=limit), up.clamp(-limit, limit)
    want = route.double()[:, None] * gate * torch.sigmoid(gate) * up
    assert rel_rms(want, got) < TOL


@interpreter_only
@pytest.mark.parametrize("block", [128, 32])
def test_moe_and_linear_dispatch_to_the_kernels(monkeypatch, block):
    """With the kernels switched on (HYBRIDKV_KERNELS=triton, the interpreter standing in for CUDA)
    the MoE takes the grouped path and FP8 linears the packed GEMM, and no dense copy of a weight is
    made, with V4's 128-value blocks and V4.1's 32; HYBRIDKV_DENSE_WEIGHTS=1 brings the dense path
    back."""
    moe = _fp4_moe(4, block=block)
    assert moe.experts[0].w1.act_block == block
    with torch.no_grad():
        for lin in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
            q, s = quant_fp8_weight(torch.randn(lin.weight.shape) * 0.05, (block, block))
            lin.weight.copy_(q)
            lin.scale.copy_(s)
    x = torch.randn(4, 256)
    ids_in = torch.zeros(4, dtype=torch.long)
    with torch.no_grad():
        want = moe(x, ids_in)
        monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
        for m in moe.modules():
            if isinstance(m, Linear):
                m._dense = None
        got = moe(x, ids_in)
        assert moe._tables is not None
        assert all(m._dense is None for m in moe.modules() if isinstance(m, Linear))
        monkeypatch.setenv("HYBRIDKV_DENSE_WEIGHTS", "1")
        dense = moe(x, ids_in)
        assert moe.shared_experts.w1._dense is not None
    assert rel_rms(want, got) < TOL
    assert torch.equal(dense, want)


@pytest.mark.parametrize("tokens,k,d", [(1, 6, 256), (7, 2, 1000), (40, 6, 2048)])
def test_combine_kernel_adds_in_expert_order_to_the_bit(device, tokens, k, d):
    """The combine launch against `reference.combine` (+ the shared expert's output, then the cast):
    the same float32 additions in the same order, so equal to the bit."""
    from hybridkv.ops.grouped_moe import triton as moe_kernels
    g = torch.Generator().manual_seed(tokens * k)
    ids = torch.rand(tokens, 16, generator=g).argsort(-1)[:, :k].to(device)
    sort = grouped_moe.sort_by_expert(ids, 16)
    out = (torch.randn(tokens * k, d, generator=g) * 10).bfloat16().to(device)
    shared = torch.randn(tokens, d, generator=g).bfloat16().to(device)
    want = grouped_moe.combine(out, sort, ids)
    assert torch.equal(moe_kernels.combine(out, sort.inverse, ids, None, torch.float32), want)
    got = moe_kernels.combine(out, sort.inverse, ids, shared, torch.bfloat16)
    want = (want + shared.float()).bfloat16()
    if device == "cuda":
        assert torch.equal(got, want)
    else:   # the interpreter casts float32 to bf16 by truncation: one bf16 step at most
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()


@pytest.mark.parametrize("tokens,k,experts,bm", [(1, 6, 256, 16), (8, 6, 256, 16), (64, 6, 256, 16),
                                                 (5, 2, 6, 16), (85, 6, 16, 16), (3, 3, 300, 64)])
def test_fused_routing_matches_the_sort_and_tiles(device, tokens, k, experts, bm):
    """The decode routing launch against `reference.sort_by_expert` and `expert_tiles`: the same
    sorted rows' tokens and weights, the same sorted row of every pair, the same tile table; with
    experts chosen by several tokens (ties sorted by pair) and a non-power-of-two expert count."""
    from hybridkv.ops.grouped_moe import triton as moe_kernels
    g = torch.Generator().manual_seed(tokens * experts + k)
    ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :k]
    if tokens > 4:
        ids[: tokens // 2] = ids[0]                     # many rows of the same experts
    weights = torch.rand(tokens, k, generator=g)
    ids, weights = ids.to(device), weights.to(device)
    sort = grouped_moe.sort_by_expert(ids, experts)
    token, route, inverse, tiles = moe_kernels.route(ids, weights, experts, bm)
    assert torch.equal(token, sort.token.int())
    assert torch.equal(route, weights.reshape(-1)[sort.order].float())
    assert torch.equal(inverse.long(), sort.inverse)
    for got, want in zip(tiles, grouped_moe.expert_tiles(sort, bm)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="pairs"):
        moe_kernels.route(torch.zeros(100, 6, dtype=torch.long, device=device), torch.zeros(100, 6, device=device),
                          experts, bm)


@interpreter_only
def test_the_device_check_decides_each_weight_layout_apart(monkeypatch):
    """A scaled-dot variant that fails for address tables (as one failed to compile on Triton 3.6)
    leaves stacked experts on the scaled dot, and a pipelined launch that disagrees turns only the
    pipelining off. Stand-ins: the register decoding plays the scaled dot (the interpreter has none)."""
    real = kernels.grouped_fp4

    def stand_in(x, rows, tiles, w, *a, fp4_dot=None, config=None, **kw):
        if fp4_dot and w[0].dtype == torch.int64:
            raise RuntimeError("does not compile")
        y = real(x, rows, tiles, w, *a, fp4_dot=0, config=config, **kw)
        return y * 2 if fp4_dot and config["num_stages"] > 1 else y   # pipelined: wrong

    monkeypatch.setattr(kernels, "grouped_fp4", stand_in)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    found = kernels._check_fp4_dot(torch.device("cpu"))
    assert (found.stacked, found.table, found.pipelined) == (1, 0, False)
    assert "disagrees, so unpipelined" in found.report and "RuntimeError" in found.report


@pytest.mark.parametrize("quantise_in", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode_adds_the_splits_in_order_in_the_gemm(device, dtype, quantise_in):
    """The decode shape splits K over four programs per tile (each quantising its own input rows,
    or reading `act_codes`' codes); the last to arrive adds the four partial sums in split order
    and casts: equal, to the bit, to four GEMMs over the K slices added in that order. Twice: the
    arrival counters are back at zero after a launch."""
    g = torch.Generator().manual_seed(5)
    q, s = _fp8_weight(256, 1024, g)
    x = torch.randn(3, 1024, generator=g) * 3
    q, s, x = q.to(device), s.to(device), x.to(device)
    cfg = dict(BM=16, BN=64, SPLIT_K=4, GROUP_M=1, num_warps=4, num_stages=2)
    one = dict(cfg, SPLIT_K=1)
    parts = [kernels.fp8_linear(x[:, 256 * j:256 * (j + 1)], q[:, 256 * j:256 * (j + 1)].contiguous(),
                                s[:, 2 * j:2 * (j + 1)].contiguous(),
                                torch.float32, config=one) for j in range(4)]
    want = (((parts[0] + parts[1]) + parts[2]) + parts[3]).to(dtype)
    for _ in range(2):
        got = kernels.fp8_linear(x, q, s, dtype, config=cfg, quantise_in=quantise_in)
        assert got.dtype == dtype and torch.equal(got, want)
    assert not kernels._arrivals(x.device, 1).any()


@pytest.mark.parametrize("rows,n,k,wdtype", [(1, 200, 640, torch.bfloat16), (5, 64, 1000, torch.bfloat16),
                                             (40, 96, 512, torch.bfloat16), (2, 24, 1536, torch.float32),
                                             (1, 37, 2500, torch.float32), (3, 50, 1100, torch.float32),
                                             (4, 24, 2048, torch.float32), (7, 100, 2100, torch.float32),
                                             (12, 40, 1024, torch.float32)])
def test_float_rows_gemm_matches_the_widened_product(device, rows, n, k, wdtype):
    """Few rows times a bf16 (or float32) weight with a float32 result, K split over programs and
    added by the last one (one or two rows of a float32 weight: whole rows of the weight a program,
    `gemv_kernel`, up to four rows): equal to float32 products of the widened operands (ragged N and
    K); under the GEMV each row equal to the bit to that row launched alone."""
    from hybridkv.ops.qgemm import float_rows
    g = torch.Generator().manual_seed(rows + n + k)
    x = (torch.randn(rows, k, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(wdtype)
    gemv = wdtype == torch.float32 and rows <= float_rows.GEMV_ROWS   # products on the CUDA cores
    cfg = float_rows.rows_config(rows, n, k, w.element_size(), gemv=gemv)
    assert cfg.get("GEMV", False) == gemv and (gemv or cfg["SPLIT_K"] > 1)
    got = float_rows.rows_linear(x.to(device), w.to(device)).cpu()
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    again = float_rows.rows_linear(x.to(device), w.to(device)).cpu()
    assert torch.equal(got, again)                 # split order fixed: run to run identical
    if gemv:      # a verify row computes what the same row decoded alone computes
        for r in range(rows):
            assert torch.equal(float_rows.rows_linear(x[r:r + 1].to(device), w.to(device)).cpu(), got[r:r + 1])


def test_stacked_projections_equal_each_linear_alone(device, monkeypatch):
    """Float linears of one input stacked in one buffer (`stack_storage`): one float32-product GEMM
    over all of them gives each linear's own output, in its compute dtype, to float32 round-off."""
    from hybridkv.model.linear import stack_storage, stacked_forward, stacked_weight
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    g = torch.Generator().manual_seed(3)
    with torch.device(device):
        lins = [Linear(640, 96, "float", torch.float32), Linear(640, 96, "float", torch.float32),
                Linear(640, 16, "float", torch.bfloat16)]
    for lin in lins:                       # the release's bf16 storage, as loading narrows it
        lin.weight = torch.nn.Parameter(lin.weight.detach().to(torch.bfloat16), requires_grad=False)
    assert stack_storage(lins)
    with torch.no_grad():
        for lin in lins:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.05)
    assert stacked_weight(lins) is not None
    x = torch.randn(3, 640, generator=g).to(torch.bfloat16).to(device)
    with torch.no_grad():
        got = stacked_forward(lins, x)
        monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
        want = [lin(x) for lin in lins]
    for a, b, lin in zip(got, want, lins):
        assert a.dtype == b.dtype == lin.compute_dtype and a.shape == b.shape
        assert rel_rms(b.float(), a.float()) < (1e-5 if a.dtype == torch.float32 else 4e-3)


def test_fp8_mma_reads_v4_and_v41_scale_tiles_unless_switched_off(monkeypatch):
    """128×128 (V4) and 32×32 (V4.1) scale tiles take the FP8 tensor-core kernel by default, neither
    with HYBRIDKV_FP8_MMA=0; no other tile; its tiles divide every V4.1-Flash FP8 linear."""
    from hybridkv.ops.qgemm import fp8_mma
    monkeypatch.delenv("HYBRIDKV_FP8_MMA", raising=False)
    assert fp8_mma.enabled(128) and fp8_mma.enabled(32) and not fp8_mma.enabled(64)
    monkeypatch.setenv("HYBRIDKV_FP8_MMA", "0")
    assert not fp8_mma.enabled(128) and not fp8_mma.enabled(32)
    with pytest.raises(ValueError, match="scale tiles of 64"):
        fp8_mma.fp8_linear(torch.zeros(1, 1024), torch.zeros(512, 1024, dtype=torch.float8_e4m3fn),
                           torch.zeros(8, 16), torch.float32, block=64)
    for n, k in ((1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (4608, 5120), (5120, 2304), (4096, 1280)):
        cfg = fp8_mma.config(n, k, 32)
        assert k % 128 == 0 and n % (16 * cfg["MT"]) == 0 and 1 <= cfg["WK"] <= min(16, k // 128), (n, k, cfg)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler on this machine")
@pytest.mark.parametrize("block", [128, 32])
def test_fp8_mma_source_compiles_for_hopper_without_spills(block, tmp_path):
    """Every input dtype of the kernel with `block` scale tiles compiles for sm_90 (what NVRTC builds
    at first use on the H200) without register spills at the widest tiles `config` chooses (4 row
    tiles, 8 warps) and the most warps (16; with 4 row tiles they would spill)."""
    from hybridkv.ops.qgemm import fp8_mma
    for x_dtype, (mt, wk) in itertools.product((torch.bfloat16, torch.float32), ((4, 8), (1, 16))):
        src = tmp_path / f"fp8_mma_{block}_{str(x_dtype)[6:]}_{mt}_{wk}.cu"
        src.write_text(fp8_mma.source(x_dtype, torch.bfloat16, mt, wk, block))
        out = subprocess.run(["nvcc", "-arch=sm_90", "-c", "--resource-usage", str(src), "-o",
                              str(src.with_suffix(".o"))], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "0 bytes spill stores" in out.stderr and "spill stores, 0 bytes spill loads" in out.stderr, out.stderr


def test_fp8_mma_takes_cuda_decode_rows_only_and_tiles_every_v4_flash_linear():
    """`fp8_mma.usable` never takes a CPU tensor (the reference and the interpreter keep their
    paths); its tiles divide every V4-Flash FP8 linear (paired ones too) and odd widths fall back to
    smaller tiles; one token's FP4 launches take the few-pairs tiles; the kernel's quantisation
    constants are the reference's."""
    from hybridkv.ops.qgemm import fp4_mma, fp8_mma
    from hybridkv.ops.quant.reference import FP8_AMAX_FLOOR, FP8_MAX
    q = torch.zeros(1024, 4096, dtype=torch.float8_e4m3fn)
    assert not fp8_mma.usable(torch.zeros(1, 4096), q, torch.float32)
    for n, k in ((1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (4096, 4096), (4096, 2048), (8192, 1024),
                 (1536, 4096), (4112, 4096), (16400, 1024)):
        cfg = fp8_mma.config(n, k)
        assert n % (16 * cfg["MT"]) == 0 and 1 <= cfg["WK"] <= min(16 // cfg["MT"], k // 128), (n, k, cfg)
    assert fp8_mma.config(32768, 1024)["MT"] == 4 and fp8_mma.config(4112, 4096)["MT"] == 1
    src = fp8_mma.source(torch.bfloat16, torch.bfloat16, 1, 8)
    assert f"#define FLOOR {FP8_AMAX_FLOOR!r}f" in src and f"#define QMAX {FP8_MAX!r}f" in src
    few = kernels.grouped_config(fp4_mma.FEW_PAIRS, 2048, 256, gated=True, mma=True)
    more = kernels.grouped_config(fp4_mma.FEW_PAIRS + 1, 2048, 256, gated=True, mma=True)
    many = kernels.grouped_config(fp4_mma.MANY_PAIRS + 1, 2048, 256, gated=True, mma=True)
    down = kernels.grouped_config(fp4_mma.FEW_PAIRS + 1, 4096, 256, mma=True)
    assert (few["MT"], few["WK"]) == (1, 4) and (more["MT"], more["WK"]) == (1, 4) and few["BM"] == more["BM"]
    assert (many["MT"], many["WK"]) == (2, 4) and (down["MT"], down["WK"]) == (2, 2)
    for cfg in (few, more, many, down):       # every default fits a block's shared memory and divides K
        assert fp4_mma.shared_bytes(cfg["MT"], cfg["WK"], cfg["STAGES"], cfg["CK"]) <= fp4_mma.SHARED_MAX
        assert 2048 % (128 * cfg["CK"]) == 0 and 2048 % (16 * cfg["MT"]) == 0


def test_decode_sizes_choose_the_tensor_core_kernel_only_where_it_runs():
    """`grouped_config` takes the MMA tiles (8 rows) only when asked (the caller checked
    `fp4_mma.usable`: CUDA, sm_80+), up to 512 pairs or 16 an expert (128 rows of V4-Flash's top-6 among
    256 experts are 768 pairs, a few an expert: not the 64-row tiles); CPU tensors never ask; the scale
    shift keeps 2^(s-1-S) a finite bf16; the tables know their largest scale byte."""
    from hybridkv.ops.qgemm import fp4_mma
    assert not fp4_mma.usable(torch.zeros(1, 256), (256,), (256,))
    cfg = kernels.grouped_config(6, 2048, 256, gated=True, mma=True)
    assert cfg["BM"] == fp4_mma.TILE_ROWS and cfg["MMA"]
    assert kernels.grouped_config(6, 2048, 256, gated=True)["BM"] == 1
    assert "MMA" not in kernels.grouped_config(kernels.MMA_MAX_PAIRS + 1, 2048, mma=True)
    assert kernels.grouped_config(768, 2048, 256, mma=True)["MMA"]
    assert kernels.grouped_config(16 * 256, 4096, 256, mma=True)["MMA"]
    assert "MMA" not in kernels.grouped_config(16 * 256 + 1, 4096, 256, mma=True)
    assert "MMA" not in kernels.grouped_config(513, 2048, 8, mma=True)
    assert fp4_mma.scale_shift(127) == 0 and fp4_mma.scale_shift(128) == 0 and fp4_mma.scale_shift(200) == 72
    g = torch.Generator().manual_seed(0)
    proj = [[(torch.randint(-128, 128, (64, 128), generator=g, dtype=torch.int8),
              torch.full((64, 8), 2.0 ** (e - 3)).to(torch.float8_e8m0fnu)) for e in range(3)] for _ in range(3)]
    assert grouped_moe.expert_tables(*proj).scale_max == 126     # the largest scale, 2^-1


def test_widened_experts_equal_the_dequantised_weights(device):
    """`fp4_widen.widen_experts` writes the chosen experts' weights in bf16 bit for bit as the
    reference dequantises them (exact: E2M1 times a power of two), w3's rows below w1's when paired,
    from stacked experts with a gap between them, odd widths included."""
    from hybridkv.ops.qgemm.fp4_widen import widen_experts
    from hybridkv.ops.quant import dequant_fp4_weight
    g = torch.Generator().manual_seed(5)
    e, n, k = 5, 48, 320
    store = torch.randint(0, 256, (e, n * k // 2 + 64), generator=g, dtype=torch.uint8)
    codes = store[:, : n * k // 2].view(e, n, k // 2)                    # 64 spare bytes between experts
    scales = torch.randint(110, 135, (e, n, k // 32), generator=g, dtype=torch.uint8)
    store3 = torch.randint(0, 256, (e, n * k // 2 + 64), generator=g, dtype=torch.uint8)
    codes3 = store3[:, : n * k // 2].view(e, n, k // 2)
    scales3 = torch.randint(110, 135, (e, n, k // 32), generator=g, dtype=torch.uint8)
    chosen = torch.tensor([4, 0, 2])

    def dense(c, s, i):
        return dequant_fp4_weight(c[i].view(torch.int8), s[i].view(torch.float8_e8m0fnu), 32, torch.bfloat16)

    args = [t.to(device) for t in (codes, scales, chosen)]
    got = widen_experts(*args).cpu()
    assert got.shape == (3, n, k) and got.dtype == torch.bfloat16
    for j, i in enumerate(chosen.tolist()):
        assert torch.equal(got[j], dense(codes, scales, i))
    buf = torch.full((4 * 2 * n * k,), float("nan"), dtype=torch.bfloat16, device=device)
    both = widen_experts(*args, out=buf, second=(codes3.to(device), scales3.to(device))).cpu()
    assert both.shape == (3, 2 * n, k)
    for j, i in enumerate(chosen.tolist()):
        assert torch.equal(both[j, :n], dense(codes, scales, i))
        assert torch.equal(both[j, n:], dense(codes3, scales3, i))
    with pytest.raises(ValueError, match="at least"):
        widen_experts(*args, out=buf[:10])


@pytest.mark.parametrize("scratch_experts", [1, 2, 6])
def test_widened_prefill_matches_the_per_expert_loop(device, scratch_experts):
    """The prefill path (experts widened a group at a time, torch's grouped GEMM, the SwiGLU and
    the FP8 round trip between) against the per-expert loop in bf16, with one expert nobody chose
    and groups of 1, 2 and all experts; the shared expert's output added in the sum back (given, or
    a callable giving it)."""
    moe = _fp4_moe(11, experts=6, topk=2, device=device)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(90, 256, generator=g) * 4).bfloat16().to(device)
    with torch.no_grad():
        weights, ids = moe.gate(x.float(), torch.zeros(90, dtype=torch.long, device=device))
        ids = torch.where(ids == 3, torch.full_like(ids, 1), ids)         # expert 3 gets no tokens
        ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 2) % 6, ids[:, 1])
        ids = torch.where(ids == 3, torch.full_like(ids, 5), ids)
        assert not (ids == 3).any() and (ids[:, 0] != ids[:, 1]).all()
        projections = [[(getattr(e, w).weight, getattr(e, w).scale) for e in moe.experts] for w in ("w1", "w3", "w2")]
        tables = grouped_moe.expert_tables(*projections)
        plus = torch.randn(90, 256, generator=g).bfloat16().to(device)
        limit = moe.experts[0].limit
        per_expert = 3 * tables.inter * tables.dim * 2
        got = grouped_moe.routed_experts_widened(x, weights, ids, tables, limit,
                                                 plus=(lambda: plus) if scratch_experts == 1 else plus,
                                                 scratch_bytes=scratch_experts * per_expert)
        want = grouped_moe.reference.routed_experts(x.float(), weights, ids, moe.n_experts,
                                                    lambda e, r, w: _bf16_expert(moe.experts[e], r, w, limit))
    assert got.dtype == torch.float32 and got.shape == (90, 256)
    err = rel_rms(want + plus.float(), got)
    assert err < 2e-3


def _bf16_expert(ex, rows, route, limit):
    """An expert's definition with the bf16 model's rounding points (each projection's output,
    the SwiGLU product before its FP8 round trip)."""
    def lin(m, v):
        return reference.fp4_linear(v, m.weight, m.scale, m.act_block, torch.float32).bfloat16().float()
    gate, up = lin(ex.w1, rows), lin(ex.w3, rows)
    up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    return lin(ex.w2, (route * (torch.nn.functional.silu(gate) * up)).bfloat16().float())
