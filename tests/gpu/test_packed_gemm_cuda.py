"""The packed-weight GEMMs on the GPU at V4-Flash shapes against dequantise-then-GEMM, the grouped
MoE against the per-expert loop, a decode step in a CUDA graph against eager, and no dense copy of a
quantised weight after a request (parameters and CUDA memory)."""

from pathlib import Path

import pytest
import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.model import ContiguousKV, ForwardBatch
from hybridkv.model.attention import Attention
from hybridkv.model.linear import Linear
from hybridkv.model.moe import MoE
from hybridkv.ops import grouped_moe
from hybridkv.ops.qgemm import reference
from hybridkv.ops.qgemm import triton as kernels
from hybridkv.ops.quant import quant_fp8_weight
from hybridkv.presets import get_preset
from hybridkv.tools.random_checkpoint import shaped_config, write_random_checkpoint

DEV = "cuda"
# bf16 MMA over exact bf16 operands with fp32 accumulation against a bf16 GEMM of the same
# operands: both round only their sums and the bf16 output; bounds to be set from the measurement
BF16_TOL = 1e-2
# the grouped MoE against its definition at the same bf16 rounding points: 0 to 6.6e-5 measured
# (H200, 2026-12-02); a wrong expert, tile or scale moves it by 1e-2 or more
GROUPED_TOL = 1e-3


def rel_rms(ref, out):
    ref, out = ref.double(), out.double()
    assert torch.isfinite(out).all()
    return float((ref - out).square().mean().sqrt() / ref.square().mean().sqrt())


# V4-Flash's FP8 linears: wq_a, wq_b, wkv, wo_b, the shared expert's w1/w2
@pytest.mark.parametrize("n,k", [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096), (4096, 2048)])
@pytest.mark.parametrize("rows", [1, 8, 64, 4096])
def test_fp8_linear_at_v4_flash_shapes(n, k, rows):
    w = torch.randn(n, k, device=DEV) * 0.02
    q, s = quant_fp8_weight(w)
    x = torch.randn(rows, k, device=DEV).bfloat16()
    want = reference.fp8_linear(x.float(), q, s, (128, 128), torch.float32)
    got = kernels.fp8_linear(x, q, s, torch.bfloat16)
    err = rel_rms(want, got)
    print(f"fp8 {rows}x{k} @ {n}: rel rms {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("n,k", [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (8192, 1024)])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_fp8_mma_linear_at_decode_rows(n, k, rows, x_dtype, out_dtype):
    """The CUDA kernel on the FP8 tensor cores (`fp8_mma`, what `packed_fp8_linear` runs for at
    most 8 rows) against the reference and, with float32 output, against the Triton kernel (the
    same activation codes and scales: only the order of the float32 sums differs); every tile
    configuration; repeated launches bit-equal. Inputs spread over four decades so that the
    per-128 activation scales differ."""
    from hybridkv.ops.qgemm import fp8_mma, packed_fp8_linear
    g = torch.Generator(device=DEV).manual_seed(n + k + rows)
    q, s = quant_fp8_weight(torch.randn(n, k, device=DEV, generator=g) * 0.02)
    x = (torch.randn(rows, k, device=DEV, generator=g)
         * torch.logspace(-2, 2, k // 128, device=DEV).repeat_interleave(128)).to(x_dtype)
    assert fp8_mma.usable(x, q, out_dtype)
    want = reference.fp8_linear(x.float(), q, s, (128, 128), torch.float32)
    triton_out = kernels.fp8_linear(x, q, s, torch.float32)
    for cfg in ({}, {"MT": 1, "WK": 1}, {"MT": 2, "WK": 4}, {"MT": 4, "WK": 16}):
        got = fp8_mma.fp8_linear(x, q, s, out_dtype, cfg)
        err = rel_rms(want, got)
        print(f"fp8 mma {rows}x{k} @ {n} {x_dtype}->{out_dtype} {cfg}: rel rms {err:.2e} against the reference")
        assert got.shape == (rows, n) and err < (BF16_TOL if out_dtype == torch.bfloat16 else 1e-4)
        if out_dtype == torch.float32:
            assert rel_rms(triton_out, got) < 1e-4
        assert torch.equal(got, fp8_mma.fp8_linear(x, q, s, out_dtype, cfg))
    assert torch.equal(packed_fp8_linear(x, q, s, out_dtype), fp8_mma.fp8_linear(x, q, s, out_dtype))


# V4.1-Flash's FP8 linears (32×32 scale tiles): wq_a, wq_b, wkv, wo_b, the shared expert's w1/w3 and w2
@pytest.mark.parametrize("n,k", [(1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (4608, 5120), (5120, 2304)])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_fp8_mma_linear_with_v41_scale_tiles(n, k, rows, x_dtype, out_dtype, monkeypatch):
    """The same kernel with 32×32 scale tiles (each MMA one scale block): against the reference and,
    in float32, the Triton kernel; inputs spread over four decades per 32 values so that every
    block's activation scale differs; every tile configuration; repeated launches bit-equal; what
    `packed_fp8_linear` runs once enabled."""
    from hybridkv.ops.qgemm import fp8_mma, packed_fp8_linear
    monkeypatch.delenv("HYBRIDKV_FP8_MMA", raising=False)       # on by default
    g = torch.Generator(device=DEV).manual_seed(n + k + rows)
    q, s = quant_fp8_weight(torch.randn(n, k, device=DEV, generator=g) * 0.02
                            * torch.logspace(-1, 1, n // 32, device=DEV).repeat_interleave(32)[:, None], (32, 32))
    x = (torch.randn(rows, k, device=DEV, generator=g)
         * torch.logspace(-2, 2, k // 32, device=DEV)[torch.randperm(k // 32, device=DEV, generator=g)]
         .repeat_interleave(32)).to(x_dtype)
    assert fp8_mma.usable(x, q, out_dtype, 32)
    want = reference.fp8_linear(x.float(), q, s, (32, 32), torch.float32)
    triton_out = kernels.fp8_linear(x, q, s, torch.float32, block=32)
    for cfg in ({}, {"MT": 1, "WK": 1}, {"MT": 2, "WK": 4}, {"MT": 4, "WK": 16}):
        if n % (16 * cfg.get("MT", 1)):
            continue
        got = fp8_mma.fp8_linear(x, q, s, out_dtype, cfg, block=32)
        err = rel_rms(want, got)
        print(f"fp8 mma 32x32 {rows}x{k} @ {n} {x_dtype}->{out_dtype} {cfg}: rel rms {err:.2e} against the reference")
        assert got.shape == (rows, n) and err < (BF16_TOL if out_dtype == torch.bfloat16 else 1e-4)
        if out_dtype == torch.float32:
            assert rel_rms(triton_out, got) < 1e-4
        assert torch.equal(got, fp8_mma.fp8_linear(x, q, s, out_dtype, cfg, block=32))
    assert torch.equal(packed_fp8_linear(x, q, s, out_dtype, block=32), fp8_mma.fp8_linear(x, q, s, out_dtype, block=32))


def test_fp8_mma_linear_reads_an_unaligned_input_view():
    from hybridkv.ops.qgemm import fp8_mma
    q, s = quant_fp8_weight(torch.randn(512, 1024, device=DEV) * 0.02)
    buf = torch.randn(2 * 1024 + 3, device=DEV).bfloat16()
    x = buf[3:].view(2, 1024)                 # 6 bytes past an aligned address
    got = fp8_mma.fp8_linear(x, q, s, torch.float32)
    want = reference.fp8_linear(x.float(), q, s, (128, 128), torch.float32)
    assert rel_rms(want, got) < 1e-4


@pytest.mark.parametrize("n,k", [(1024, 4096), (32768, 1024), (4096, 8192)])
@pytest.mark.parametrize("rows", [65, 4096])
def test_prefill_rows_through_torchs_block_scaled_matmul(n, k, rows):
    """More than DECODE_ROWS rows go through torch's scaled matmul where this torch has the blockwise
    recipes (the GPU image's does); its first call checks the scale layout against the reference."""
    from hybridkv.ops.qgemm import packed_fp8_linear, scaled
    lay, why = scaled.layout(torch.device(DEV))
    print(f"scaled_mm layout: {why}")
    if scaled._recipes() is not None:
        assert lay is not None, why
    q, s = quant_fp8_weight(torch.randn(n, k, device=DEV) * 0.02)
    x = torch.randn(rows, k, device=DEV).bfloat16() * torch.logspace(-2, 1, k // 128, device=DEV).repeat_interleave(128)
    x = x.bfloat16()
    want = reference.fp8_linear(x.float(), q, s, (128, 128), torch.float32)
    got = packed_fp8_linear(x, q, s, torch.bfloat16)
    err = rel_rms(want, got)
    print(f"scaled fp8 {rows}x{k} @ {n}: rel rms {err:.2e}")
    assert got.shape == (rows, n) and err < BF16_TOL


def test_head_logits_in_one_bf16_gemm_with_float32_output():
    from hybridkv.model.transformer import head_logits
    w = (torch.randn(129280, 4096, device=DEV) * 0.02).bfloat16()
    x = torch.randn(3, 4096, device=DEV).bfloat16()
    got = head_logits(x, w)
    want = torch.nn.functional.linear(x.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (3, 129280)
    assert rel_rms(want, got) < 1e-5


def _flash_moe(experts=256, layer_id=5):
    cfg = get_preset("v4-flash", n_routed_experts=experts)
    with torch.device(DEV):
        moe = MoE(cfg, layer_id, "fp8", "fp4", torch.bfloat16)
    with torch.no_grad():
        for e in moe.experts:
            for lin in (e.w1, e.w2, e.w3):
                lin.weight.copy_(torch.randint(-128, 128, lin.weight.shape, device=DEV, dtype=torch.int8))
                lin.scale.copy_(torch.full(lin.scale.shape, 2.0 ** -7, device=DEV))
        for lin in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
            q, s = quant_fp8_weight(torch.randn(lin.weight.shape, device=DEV) * 0.02)
            lin.weight.copy_(q)
            lin.scale.copy_(s)
        moe.gate.weight.normal_(0, 0.02)
        moe.gate.bias.zero_()
    return moe


@pytest.mark.parametrize("tokens,widen", [(1, "1"), (8, "1"), (64, "1"), (2048, "0"), (2048, "1")])
def test_grouped_moe_matches_the_per_expert_loop_at_v4_flash_width(tokens, widen, monkeypatch):
    """Decode sizes through the tensor-core FP4 kernel; 2048 tokens through the 64-row tiles
    (`HYBRIDKV_FP4_WIDEN=0`) and through the experts widened for torch's grouped GEMM."""
    monkeypatch.setenv("HYBRIDKV_GROUPED_FP4", "1")
    monkeypatch.setenv("HYBRIDKV_FP4_WIDEN", widen)
    monkeypatch.setattr(grouped_moe, "WIDEN_MIN_ROWS_PER_EXPERT", 32)     # 2048 tokens: 48 rows an expert
    moe = _flash_moe()
    x = torch.randn(tokens, 4096, device=DEV).bfloat16()
    with torch.no_grad():
        weights, ids = moe.gate(x, torch.zeros(tokens, dtype=torch.long, device=DEV))
        assert grouped_moe.widen_ok(x, ids.numel(), moe.expert_tables(x), torch.bfloat16) == (
            tokens == 2048 and widen == "1")
        want = grouped_moe.reference.routed_experts(
            x.float(), weights, ids, moe.n_experts,
            lambda e, r, w: _dense_expert(moe.experts[e], r, w))
        got = grouped_moe.routed_experts_fp4(x, weights, ids, moe.expert_tables(x), moe.experts[0].limit,
                                             torch.bfloat16)
    err = rel_rms(want, got)
    print(f"grouped MoE, {tokens} tokens: rel rms {err:.2e}; {kernels.fp4_dot_report(x.device)}")
    assert err < GROUPED_TOL


def _dense_expert(ex, rows, route):
    """The expert from dequantised weights in float32, rounded to bfloat16 where the model in
    bfloat16 rounds (each projection's output, the SwiGLU product that the down projection
    quantises): the definition at the compute dtype. Against a float32 reference without those
    roundings the grouped kernels differ by 1.7-1.9e-2 (H200, 2026-12-02), nearly all of it from
    the bf16 product landing on an e4m3 midpoint before its FP8 round trip."""
    def lin(m, x):
        return reference.fp4_linear(x, m.weight, m.scale, m.act_block, torch.float32).bfloat16().float()
    gate, up = lin(ex.w1, rows), lin(ex.w3, rows)
    up, gate = up.clamp(-ex.limit, ex.limit), gate.clamp(max=ex.limit)
    return lin(ex.w2, (route * (torch.nn.functional.silu(gate) * up)).bfloat16().float())


def test_grouped_moe_is_captured_in_a_cuda_graph(monkeypatch):
    """Sorting, tiling, both launches and the sum back replay from a graph with new routing."""
    monkeypatch.setenv("HYBRIDKV_GROUPED_FP4", "1")
    moe = _flash_moe(experts=64)
    x = torch.randn(8, 4096, device=DEV).bfloat16()
    ids_in = torch.zeros(8, dtype=torch.long, device=DEV)
    with torch.no_grad():
        moe(x, ids_in)                                   # warm-up: compiles, builds the tables
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x, ids_in, static=True)
        x.copy_(torch.randn(8, 4096, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        eager = moe(x, ids_in)
    assert rel_rms(eager.float(), out.float()) < 1e-6


def test_no_dense_weight_copy_after_a_request(tmp_path, monkeypatch):
    """A served request leaves every quantised weight packed: no Linear holds a dense cache, and
    the allocated CUDA memory after the request is the weights plus the KV pool, not a bf16 copy
    (with the grouped FP4 kernels on: without them CUDA experts use dense copies)."""
    monkeypatch.setenv("HYBRIDKV_GROUPED_FP4", "1")
    cfg = shaped_config("v4-flash", layers=2, vocab=1024, experts=32, moe_inter=2048)
    write_random_checkpoint(cfg, tmp_path / "m")
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = LLM(tmp_path / "m", device="cuda", dtype=torch.bfloat16, kv_format="fp8", num_blocks=64, max_num_seqs=2)
    loaded = torch.cuda.memory_allocated() - before
    out = llm.generate([list(range(2, 500))], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.error is None and len(out.output_ids) == 8
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.fmt != "float"]
    assert linears and all(m._dense is None for m in linears)
    # the release's FP8 wo_a, which its conversion widens to bf16 (as the random checkpoint writes it),
    # is FP8 again on the GPU
    wo_a = [m.wo_a for m in llm.engine.model.modules() if isinstance(m, Attention)]
    assert wo_a and all(w.fmt == "fp8_exact" and w.weight.dtype == torch.float8_e4m3fn for w in wo_a)
    packed = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    grown = torch.cuda.memory_allocated() - before - loaded
    print(f"packed weights {packed / 2**20:.0f} MiB, loaded {loaded / 2**20:.0f} MiB, "
          f"grown after a request {grown / 2**20:.0f} MiB")
    # a dense bf16 copy of the quantised weights would be 2-4x their packed bytes
    assert grown < 0.5 * packed


@pytest.mark.parametrize("rows", [1, 8, 64, 256, 300])
def test_grouped_fp8_output_projection_at_v4_flash_shape(rows):
    """wo_a at V4-Flash's shape (8 groups of 1024 outputs over 4096 inputs) read as e4m3: the dense
    einsum over the widened weight, to bf16 round-off (300 rows: the widened weight for the call)."""
    from hybridkv.ops.qgemm import fp8_exact
    from hybridkv.ops.quant import dequant_fp8_weight
    q, s = quant_fp8_weight(torch.randn(8192, 4096, device=DEV) * 0.02)
    w = dequant_fp8_weight(q, s, (128, 128), torch.bfloat16)
    q2, s2 = fp8_exact.exact_fp8(w)
    assert torch.equal(dequant_fp8_weight(q2, s2, (128, 128), torch.bfloat16), w)   # the same values
    x = torch.randn(rows, 8, 4096, device=DEV).bfloat16()
    got = fp8_exact.grouped_rows(x, q2, s2)
    want = torch.einsum("tgd,grd->tgr", x, w.view(8, 1024, 4096))
    assert got.dtype == torch.bfloat16 and rel_rms(want, got) < BF16_TOL


def test_a_model_with_fp8_exact_wo_a_computes_the_dense_models_logits():
    """The fp8 fixture with its wo_a put on the FP8 grid (as the release's are): loaded on CUDA each
    one packs back to e4m3, and prefill and decode logits equal those of the same model with the bf16
    wo_a to bf16 round-off."""
    from hybridkv.ops.quant import dequant_fp8_weight
    from hybridkv.weights import compact_exact_fp8_weights, load_model
    fixture = Path(__file__).parents[1] / "fixtures" / "v4-tiny-fp8"
    models = [load_model(fixture, device=DEV, dtype=torch.bfloat16)[0] for _ in range(2)]
    assert models[0].compacted_fp8 == 0           # the reference's random wo_a is not FP8
    for model in models:
        for m in model.modules():
            if isinstance(m, Attention):
                with torch.no_grad():
                    m.wo_a.weight.copy_(dequant_fp8_weight(*quant_fp8_weight(m.wo_a.weight), (128, 128),
                                                           torch.bfloat16))
    n = compact_exact_fp8_weights(models[1])
    assert n == sum(isinstance(m, Attention) for m in models[1].modules()) > 0
    ids = torch.arange(3, 43, device=DEV)
    logits = []
    for model in models:
        kv = ContiguousKV(model.config, torch.bfloat16, DEV)
        with torch.no_grad():
            h = model(ids, ForwardBatch.build([(kv, 0, len(ids))], DEV))
            step = model(ids[:1], ForwardBatch.build([(kv, len(ids), 1)], DEV))
            logits.append((model.logits(h), model.logits(step)))
    assert rel_rms(logits[0][0], logits[1][0]) < BF16_TOL
    assert rel_rms(logits[0][1], logits[1][1]) < BF16_TOL


def test_dense_flag_brings_back_the_cached_copies(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_DENSE_WEIGHTS", "1")
    lin = Linear(4096, 1024, "fp8", torch.bfloat16).to(DEV)
    q, s = quant_fp8_weight(torch.randn(1024, 4096, device=DEV) * 0.02)
    with torch.no_grad():
        lin.weight.copy_(q)
        lin.scale.copy_(s)
        lin(torch.randn(2, 4096, device=DEV).bfloat16())
    assert lin._dense is not None
