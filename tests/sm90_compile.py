"""Run as a script (by tests/test_kernel_compile.py): compiles the decode step's Triton kernels
for sm_90 without a GPU (the compile-only driver of benchmarks/kernel_resources.py) in every
variant the engine can launch, and prints one line per variant: `ok` or the compiler's error.
The interpreter runs a kernel's Python; only a compile shows what the GPU's Triton refuses."""

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import kernel_resources as kr  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

driver.set_active(kr._H200())
JITFunction.run = kr._compile_only

from hybridkv.ops.grouped_moe import triton as moe_kernels  # noqa: E402
from hybridkv.ops.qgemm import triton as qk  # noqa: E402
from hybridkv.ops.rmsnorm import triton as norm_kernels  # noqa: E402
from hybridkv.ops.rope import reference as rope_ref  # noqa: E402
from hybridkv.ops.rope import triton as rope_kernels  # noqa: E402


def attempt(name, fn):
    try:
        fn()
        print(f"{name}: ok", flush=True)
    except Exception as e:  # the compiler's error is the finding
        print(f"{name}: {type(e).__name__}: {' | '.join(str(e).strip().splitlines()[-3:])}", flush=True)


p, k, n = 20, 512, 256
x = torch.zeros(p, k).bfloat16()
stacked = (torch.zeros(2, n, k // 2, dtype=torch.uint8), torch.zeros(2, n, k // 32, dtype=torch.uint8))
table = (torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
tiles = (torch.zeros(2, dtype=torch.int32),) * 3
rows, route = torch.zeros(p, dtype=torch.int32), torch.zeros(p)
for layout, w in (("stacked", stacked), ("table", table)):
    for mode in (0, 1, 2):
        for stages in (1, 3):
            for swiglu in (False, True):
                extra = dict(w3=w, route=route, limit=10.0) if swiglu else {}
                attempt(f"grouped_fp4 {layout} mode={mode} stages={stages} swiglu={swiglu}",
                        lambda: qk.grouped_fp4(x, rows if swiglu else None, tiles, w, n, torch.bfloat16,
                                               config=dict(BM=16, BN=64, num_warps=4, num_stages=stages),
                                               fp4_dot=mode, pipelined=True, **extra))
    for swiglu in (False, True):           # the one-row decode kernel
        extra = dict(w3=w, route=route, limit=10.0) if swiglu else {}
        attempt(f"grouped_fp4 rows {layout} swiglu={swiglu}",
                lambda: qk.grouped_fp4(x, rows if swiglu else None, tiles, w, n, torch.bfloat16,
                                       config=dict(BM=1, BN=32, num_warps=4), **extra))
for pairs in (6, 48, 384):
    for bm in (1, 16):
        attempt(f"route pairs={pairs} bm={bm}", lambda: moe_kernels.route(torch.zeros(pairs // 6, 6, dtype=torch.long),
                                                                          torch.zeros(pairs // 6, 6), 256, bm))
attempt("moe_combine", lambda: moe_kernels.combine(torch.zeros(12, 4096).bfloat16(), torch.zeros(12, dtype=torch.int32),
                                                   torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 4096).bfloat16(),
                                                   torch.bfloat16))
for d in (128, 512, 1024, 4096):
    attempt(f"rms_norm d={d}", lambda: norm_kernels.rms_norm(torch.zeros(3, d).bfloat16(), torch.zeros(d), 1e-6))
freqs = rope_ref.rope_freqs(torch.arange(3), rope_ref.yarn_inv_freq(64, 1e4))
for shape in ((3, 64, 512), (3, 512), (3, 64, 128)):
    for inverse in (False, True):
        attempt(f"rope {shape} inverse={inverse}",
                lambda: rope_kernels.apply_rope(torch.zeros(*shape).bfloat16(), freqs, inverse))
for shape, weighted in (((3, 64, 512), False), ((3, 512), True)):     # a V4 decode's query heads, its KV row
    attempt(f"rms_norm_rope {shape}", lambda: norm_kernels.rms_norm_rope(
        torch.zeros(*shape).bfloat16(), torch.zeros(shape[-1]) if weighted else None, 1e-6, freqs))

from hybridkv.ops.compress import triton as compress_kernels  # noqa: E402
from hybridkv.ops.hadamard import triton as hadamard_kernels  # noqa: E402
from hybridkv.ops.window import triton as window_kernels  # noqa: E402

b = 3
slots, positions = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
tables = torch.zeros(b, 8, dtype=torch.int32)
for kind, ratio, overlap, d in (("main", 4, True, 512), ("index", 4, True, 128), ("main", 128, False, 512)):
    width = 2 * d if overlap else d
    rows_ = 2 * ratio if overlap else ratio
    # with save: a speculative verify wave's launch, which copies the states before the update
    for ape, save in ((None, None), (torch.zeros(ratio, width), None),
                      (torch.zeros(ratio, width), (torch.zeros(b, rows_, width), torch.zeros(b, rows_, width)))):
        attempt(f"compress_decode {kind} ratio={ratio} " + ("save" if save else f"ape={ape is not None}"),
                lambda: compress_kernels.compress_decode(
                    torch.zeros(4, rows_, width), torch.zeros(4, rows_, width), slots, positions,
                    torch.zeros(b, width), torch.zeros(b, width), ratio, overlap, torch.zeros(d), 1e-6,
                    torch.zeros(b, 32), torch.zeros(b, 32), kind,
                    torch.zeros(64, 584 if kind == "main" else 68, dtype=torch.uint8), tables, 64 // ratio or 1,
                    out_bf16=True, block_layout=kind == "index", ape=ape, save=save))
attempt("window_fp8 d=512", lambda: window_kernels.write_window_fp8(
    torch.zeros(b, 512).bfloat16(), torch.zeros(4, 128, 584, dtype=torch.uint8), slots, positions, 64))
for heads in (64, 5):
    attempt(f"rope_hadamard_fp4 heads={heads}", lambda: hadamard_kernels.rope_hadamard_fp4(
        torch.zeros(b, heads, 128).bfloat16(), freqs))
# V4.1: the indexer's queries (32 heads) and keys (blocks of 32, power-of-two scales), the global KV
# (512 dims, blocks of 16, e4m3 scales)
for heads, d, block, e4m3 in ((32, 128, 32, False), (1, 128, 32, False), (1, 512, 16, True)):
    attempt(f"rope_fp4 heads={heads} d={d} block={block}", lambda: hadamard_kernels.rope_fp4(
        torch.zeros(b, heads, d).bfloat16(), freqs, False, block, e4m3))
for hashed in (False, True):
    attempt(f"gate_select hash={hashed}", lambda: moe_kernels.gate_select(
        torch.zeros(b, 256), None if hashed else torch.zeros(256), 6, 1.5, True,
        torch.zeros(16, 6, dtype=torch.int32) if hashed else None, torch.zeros(b, dtype=torch.long) if hashed else None))
for limit in (0.0, 10.0):
    attempt(f"swiglu limit={limit}", lambda: moe_kernels.swiglu(torch.zeros(b, 2048).bfloat16(), torch.zeros(b, 2048).bfloat16(),
                                                              limit, None, torch.bfloat16))
fp8_w = (torch.zeros(512, 1024, dtype=torch.float8_e4m3fn), torch.zeros(4, 8, dtype=torch.float8_e8m0fnu))
for rows in (1, 40, 200):      # split K (in-kernel quantisation and partial sums), one-pass decode, prefill
    attempt(f"fp8_linear rows={rows}", lambda: qk.fp8_linear(torch.zeros(rows, 1024).bfloat16(), *fp8_w, torch.bfloat16))
from hybridkv.ops.mhc import triton as mhc_kernels  # noqa: E402
from hybridkv.ops.qgemm import float_rows  # noqa: E402
from hybridkv.ops.sampling import triton as sampling_kernels  # noqa: E402

from hybridkv.ops.qgemm import fp8_exact  # noqa: E402

for rows in (1, 64, 256):      # wo_a read as e4m3 at V4-Flash's shape: split K, one m-tile, several
    attempt(f"grouped_rows fp8_exact rows={rows}", lambda: fp8_exact.grouped_rows(
        torch.zeros(rows, 8, 4096).bfloat16(), torch.zeros(8192, 4096, dtype=torch.float8_e4m3fn),
        torch.zeros(64, 32, dtype=torch.float8_e8m0fnu), force_kernel=True))
for wdtype in (torch.bfloat16, torch.float32):   # stacked projections (tensor cores), float32 weights (IEEE)
    attempt(f"rows_linear weight={wdtype}", lambda: float_rows.rows_linear(torch.zeros(2, 4096).bfloat16(),
                                                                         torch.zeros(200, 4096, dtype=wdtype)))
hc_x = torch.zeros(2, 4, 4096).bfloat16()
attempt("mhc_pre_fn", lambda: mhc_kernels.mhc_pre_fn(hc_x, torch.zeros(24, 4 * 4096), torch.ones(3), torch.zeros(24),
                                                   20, 1e-6, 1e-6))
attempt("mix_partials tokens=40", lambda: mhc_kernels.mix_partials(torch.zeros(40, 4 * 4096).bfloat16(),
                                                                   torch.zeros(4, 4 * 4096)))
attempt("greedy_rows", lambda: sampling_kernels.greedy_rows(torch.zeros(2, 129280)))

# prefill's kernels added since: the experts widened for the grouped GEMM, the mixes in one pass
# (a bf16 stream on fn's three bf16 pieces, a float32 one on tf32x3) read by the pre kernel as
# partial sums, the batched batch-invariant GEMM
from hybridkv.ops import batch_invariant  # noqa: E402
from hybridkv.ops.qgemm import fp4_widen  # noqa: E402

codes, scales = torch.zeros(4, 256, 256, dtype=torch.uint8), torch.zeros(4, 256, 16, dtype=torch.uint8)
for two in (False, True):
    attempt(f"widen_experts paired={two}", lambda: fp4_widen.widen_experts(
        codes, scales, torch.zeros(2, dtype=torch.long), second=(codes, scales) if two else None))
attempt("mhc_pre_fn tokens=100", lambda: mhc_kernels.mhc_pre_fn(torch.zeros(100, 4, 4096).bfloat16(),
                                                                torch.zeros(24, 4 * 4096), torch.ones(3),
                                                                torch.zeros(24), 20, 1e-6, 1e-6))
attempt("mhc_head tokens=1", lambda: mhc_kernels.mhc_head(torch.zeros(1, 4, 4096).bfloat16(), torch.zeros(4, 4 * 4096),
                                                          torch.ones(1), torch.zeros(4), 1e-6, 1e-6))
attempt("mix_partials tokens=100 float32", lambda: mhc_kernels.mix_partials(torch.zeros(100, 4 * 4096),
                                                                            torch.zeros(24, 4 * 4096)))
for rows in (1, 8):      # the MoE gate's scores at decode: a float32 weight of 256 experts
    attempt(f"gate rows_linear rows={rows}", lambda: float_rows.rows_linear(torch.zeros(rows, 4096).bfloat16(),
                                                                           torch.zeros(256, 4096)))
attempt("batch_invariant bmm", lambda: batch_invariant.mm(torch.zeros(3, 70, 64).bfloat16(),
                                                          torch.zeros(3, 64, 96).bfloat16()))
for split in (False, True):      # a decode step's rotations (libdevice's cos and sin)
    attempt(f"rope_freqs split={split}", lambda: rope_kernels.rope_freqs(
        torch.zeros(3, dtype=torch.int64), rope_ref.yarn_inv_freq(64, 1e4), 1 - 128, 0, split=split))
attempt("rope (3, 64, 512) in place", lambda: rope_kernels.apply_rope(torch.zeros(3, 64, 512).bfloat16(), freqs,
                                                                      in_place=True))

# V4.1's decode step: the FP4 round trip (indexer queries and keys, global KV) and its packings
from hybridkv.ops.kv_formats import triton as pack_kernels  # noqa: E402
from hybridkv.ops.quant import triton as quant_kernels  # noqa: E402

for block, fmt in ((32, "ue8m0"), (16, "e4m3")):
    attempt(f"fp4_round_trip block={block} {fmt}", lambda: quant_kernels.fp4_round_trip(
        torch.zeros(b, 512).bfloat16(), block, fmt))
attempt("fp8_round_trip block=32", lambda: quant_kernels.fp8_round_trip(torch.zeros(b, 512).bfloat16(), 32))
attempt("pack_index_fp4 d=128", lambda: pack_kernels.pack_index_fp4(torch.zeros(b, 128).bfloat16(), 32))
attempt("pack_v41_window d=512", lambda: pack_kernels.pack_v41_window(torch.zeros(b, 512).bfloat16(), 32))
attempt("pack_v41_global d=512", lambda: pack_kernels.pack_v41_global(torch.zeros(b, 512).bfloat16(), 16))
# the same packings stored into a paged pool (a decode step's entry writes)
dest_args = (torch.zeros(b, 2, dtype=torch.int32), torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int64))
attempt("pack_index_fp4 d=128 into a pool", lambda: pack_kernels.pack_index_fp4(
    torch.zeros(b, 128).bfloat16(), 32, pack_kernels.PagedDest(torch.zeros(4, 8, 68, dtype=torch.uint8), *dest_args,
                                                               True)))
attempt("pack_v41_global d=512 into a pool", lambda: pack_kernels.pack_v41_global(
    torch.zeros(b, 512).bfloat16(), 16, pack_kernels.PagedDest(torch.zeros(4, 4, 288, dtype=torch.uint8), *dest_args,
                                                               False)))
attempt("window_v41 d=512", lambda: window_kernels.write_window_v41(
    torch.zeros(b, 512).bfloat16(), torch.zeros(4, 128, 528, dtype=torch.uint8), slots, positions, 32))
attempt("gate_select v41 experts=384 temp", lambda: moe_kernels.gate_select(
    torch.zeros(b, 384), torch.zeros(384), 6, 1.5, True, temp=1.7, norm_eps=1e-20))
