"""The packed-weight GEMM kernels alone at V4-Flash shapes: time, weight bandwidth and TFLOP/s.

For each FP8 linear of a V4-Flash block and each row count, the Triton kernel
(`hybridkv.ops.qgemm.triton.fp8_linear`) against a bf16 GEMM of the dequantised weight (what the
dense-copy path runs) and the prefill path through torch's block-scaled matmul
(`hybridkv.ops.qgemm.scaled`, its activation quantisation included); then the routed experts (256 × 2048, top-6) as the two
grouped FP4 launches for 1 to 4096 tokens, against the bytes of the experts those tokens selected;
then the widened decode linears (`--float-rows`: the bf16 compressor stacks and the MoE gate, float32
out, `hybridkv.ops.qgemm.float_rows`) against torch's GEMM. `--fp8-exact` times `wo_a` (the grouped
output projection packed back to FP8, `hybridkv.ops.qgemm.fp8_exact.grouped_rows`) against the
widened weight's einsum, `--sweep` with it its tiles. `--block 32` times the FP8 linears at
V4.1-Flash's shapes with its 32×32 scale tiles (the Triton GEMM against the FP8 tensor-core kernel,
which decode runs unless `HYBRIDKV_FP8_MMA=0`).
`--sweep` also times a grid of tile configurations at the `--sweep-rows` row counts and prints the
fastest (`--experts-used N` routes the tokens among N experts, several rows each) (to copy into `fp8_config` / `grouped_config`). On CUDA every time is the median device
time of CUDA-graph replays (the decode step runs as a graph). A launch replayed back to back finds
a weight of up to tens of MiB still in the GPU's L2 (50 MB on an H200), which a decode step never
does: `--cold` times each FP8 linear over copies of its weight that together exceed L2 several
times, one launch a copy, so that every launch reads its weight from DRAM as in the engine.

    python benchmarks/qgemm_kernels.py [--rows 1,8,64,4096] [--sweep] [--cold] [--block 32] [--float-rows]
        [--fp8-exact] [--no-fp8] [--no-moe]
    python benchmarks/qgemm_kernels.py --smoke     # small shapes in Triton's interpreter (CPU)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.ops import grouped_moe  # noqa: E402
from hybridkv.ops.qgemm import fp4_mma, fp8_mma  # noqa: E402
from hybridkv.ops.qgemm import reference  # noqa: E402
from hybridkv.ops.qgemm import scaled  # noqa: E402
from hybridkv.ops.qgemm import triton as kernels  # noqa: E402
from hybridkv.ops.quant import dequant_fp8_weight, quant_fp8_weight  # noqa: E402
from hybridkv.ops.quant.triton import fp8_round_trip  # noqa: E402

# (name, N, K) of V4-Flash's FP8 linears
FLASH = [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("wo_b", 4096, 8192),
         ("shared w1/w3", 2048, 4096), ("shared w2", 4096, 2048), ("indexer wq_b", 8192, 1024)]
# V4.1-Flash's (hidden 5120, q_lora 1280, shared expert 2304)
FLASH_V41 = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_b", 5120, 8192),
             ("shared w1/w3", 4608, 5120), ("shared w2", 5120, 2304)]
SMOKE = [("small", 256, 512)]
# (name, N, K, weight dtype as the release stores it) of the widened decode linears: a V4-Flash CSA
# layer's compressors' stacked projections, an HCA layer's, the MoE gates of V4-Flash and V4.1-Flash
FLOAT_ROWS = [("CSA projections", 2560, 4096, torch.bfloat16), ("HCA projections", 1024, 4096, torch.bfloat16),
              ("gate", 256, 4096, torch.float32), ("V4.1 gate", 384, 5120, torch.float32)]


def bench(fn, cuda: bool, reps: int = 20) -> float:
    """Median device ms of fn(), replayed from a CUDA graph as the engine's decode step runs it (no
    launch gaps of the host)."""
    if cuda:
        from triton.testing import do_bench_cudagraph
        fn()
        torch.cuda.synchronize()
        return float(do_bench_cudagraph(fn, rep=30, return_mode="median"))
    fn()
    t = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - t) / 2 * 1e3


COLD_BYTES = 256 << 20      # --cold: the weight copies a timing cycles through, at least this many bytes


def copies(first: tuple, cold: bool) -> list[tuple]:
    """`first` (a tuple of tensors) and, with `cold`, as many clones as make COLD_BYTES."""
    if not cold:
        return [first]
    n = -(-COLD_BYTES // sum(t.nbytes for t in first))
    return [first] + [tuple(t.clone() for t in first) for _ in range(n - 1)]


def bench_each(fn, items: list, cuda: bool) -> float:
    """Device ms of fn(item), averaged over one launch per item in turn (one item: `bench`)."""
    if len(items) == 1:
        return bench(lambda: fn(items[0]), cuda)
    return bench(lambda: [fn(it) for it in items], cuda) / len(items)


def fp8_rows(a, cuda: bool, dev: str) -> None:
    b = a.block
    print(f"\n| linear ({b}×{b} scale tiles) | N × K | rows | triton ms | GB/s (weight) | TFLOP/s | dense bf16 ms | "
          "scaled_mm ms | rel rms | fp8_mma ms | GB/s (fp8_mma) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    notes = set()
    for name, n, k in (SMOKE if a.smoke else FLASH if b == 128 else FLASH_V41):
        q, s = quant_fp8_weight(torch.randn(n, k, device=dev) * 0.02, (b, b))
        dense = dequant_fp8_weight(q, s, (b, b), torch.bfloat16 if cuda else torch.float32)
        packed_copies, dense_copies = copies((q, s), a.cold and cuda), copies((dense,), a.cold and cuda)
        for m in a.rows:
            x = torch.randn(m, k, device=dev).to(dense.dtype)
            out_dtype = dense.dtype
            t_k = bench_each(lambda w: kernels.fp8_linear(x, w[0], w[1], out_dtype, block=b), packed_copies, cuda)
            t_d = bench_each(lambda w: torch.nn.functional.linear(x, w[0]), dense_copies, cuda)
            fn, why = (lambda: scaled.fp8_linear(x, q, s, out_dtype), None) if cuda and b == 128 else (None, "CPU")
            if cuda and scaled.layout(x.device)[0] is None:
                fn, why = None, scaled.layout(x.device)[1]
            t_s = bench(fn, cuda) if fn else None
            if why:
                notes.add(why)
            want = reference.fp8_linear(x.float(), q, s, (b, b), torch.float32)
            err = float((want - kernels.fp8_linear(x, q, s, out_dtype, block=b).float()).pow(2).mean().sqrt()
                        / want.pow(2).mean().sqrt())
            mma = cuda and fp8_mma.usable(x, q, out_dtype, b)
            t_m = (bench_each(lambda w: fp8_mma.fp8_linear(x, w[0], w[1], out_dtype, block=b), packed_copies, cuda)
                   if mma else None)
            print(f"| {name} | {n} × {k} | {m} | {t_k:.4f} | {n * k / t_k / 1e6:.0f} | {2 * m * n * k / t_k / 1e9:.1f} | "
                  f"{t_d:.4f} | {'—' if t_s is None else f'{t_s:.4f}'} | {err:.1e} | "
                  f"{'—' if t_m is None else f'{t_m:.4f}'} | {'—' if t_m is None else f'{n * k / t_m / 1e6:.0f}'} |",
                  flush=True)
            if a.sweep and m in a.sweep_rows:
                if "fp8-triton" in a.families.split(","):
                    sweep_fp8(x, q, s, out_dtype, cuda, b)
                if mma and "fp8-mma" in a.families.split(","):
                    sweep_fp8_mma(x, packed_copies, out_dtype, b)
    for why in notes:
        print(f"scaled_mm: {why}")
    if cuda:
        print(f"scaled_mm layout: {scaled.layout(torch.device(dev))[1]}")


def sweep_fp8(x, q, s, out_dtype, cuda: bool, block: int = 128) -> None:
    m, (n, k) = x.shape[0], q.shape
    best = []
    bms = [16 if m <= 16 else (32 if m <= 32 else 64)]
    grid = ([32, 64, 128], [1, 4, 8, 16], [2, 4], [3]) if block == 128 else ([64, 128, 256], [4, 8, 16], [4, 8], [4])
    for bm, bn, split, warps, stages in itertools.product(bms, *grid):
        if split > 1 and m > 64 or split > (k // block) // 2 and split > 1:
            continue
        cfg = dict(BM=bm, BN=bn, SPLIT_K=split, GROUP_M=8 if m > 64 else 1, num_warps=warps, num_stages=stages)
        try:
            t = bench(lambda: kernels.fp8_linear(x, q, s, out_dtype, config=cfg, block=block), cuda)
        except Exception as e:  # out of shared memory and the like: not a candidate
            print(f"    {cfg}: {type(e).__name__}")
            continue
        best.append((t, cfg))
    best.sort(key=lambda tc: tc[0])
    for t, cfg in best[:3]:
        print(f"    sweep {m}×{n}×{k}: {t:.4f} ms {cfg}")


def sweep_fp8_mma(x, weights: list[tuple], out_dtype, block: int = 128) -> None:
    m, (n, k) = x.shape[0], weights[0][0].shape
    best = []
    for mt, wk in itertools.product([1, 2, 4], [1, 2, 4, 8, 16]):
        if n % (16 * mt) or wk > k // 128:
            continue
        cfg = dict(MT=mt, WK=wk)
        best.append((bench_each(lambda w: fp8_mma.fp8_linear(x, w[0], w[1], out_dtype, cfg, block), weights, True),
                     cfg))
    best.sort(key=lambda tc: tc[0])
    for t, cfg in best[:3]:
        print(f"    sweep fp8_mma {m}×{n}×{k}: {t:.4f} ms {cfg} (default {fp8_mma.config(n, k, block)})")


# V4-Flash's wo_a: 8 groups of 1024 output rows, each over its 4096 inputs (8 heads × 512)
WO_A = (8, 1024, 4096)


def fp8_exact_rows(a, cuda: bool, dev: str) -> None:
    """wo_a through `grouped_rows` (its default tiles, and with --sweep a grid) against the einsum of
    the widened bf16 weight, each over weight copies beyond L2 (--cold) or one weight."""
    from hybridkv.ops.qgemm import fp8_exact
    g, r, k = (2, 128, 256) if a.smoke else WO_A
    dt = torch.bfloat16 if cuda else torch.float32
    q, s = quant_fp8_weight(torch.randn(g * r, k, device=dev) * 0.02, (128, 128))
    dense = dequant_fp8_weight(q, s, (128, 128), dt).view(g, r, k)
    packed_copies, dense_copies = copies((q, s), a.cold and cuda), copies((dense,), a.cold and cuda)
    print("\n| wo_a (grouped, FP8 packed back) | G × R × K | rows | grouped_rows ms | GB/s (weight) | "
          "default tiles | best ms | GB/s | best tiles | bf16 einsum ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in a.rows:
        x = torch.randn(m, g, k, device=dev).to(dt)
        default = fp8_exact.rows_config(m, g * r, k)

        def run(w, cfg=None):
            return fp8_exact.grouped_rows(x, w[0], w[1], config=cfg, force_kernel=True)
        t = bench_each(run, packed_copies, cuda)
        t_d = bench_each(lambda w: torch.einsum("tgd,grd->tgr", x, w[0]), dense_copies, cuda)
        best = (t, default)
        if a.sweep and m in a.sweep_rows:
            bm = default["BM"]
            for bn, split, warps, stages in itertools.product([32, 64, 128], [1, 2, 4, 8, 16], [4, 8], [3, 4]):
                if split > (k // 128) // 2:
                    continue
                cfg = dict(BM=bm, BN=bn, BK=128, SPLIT_K=split, num_warps=warps, num_stages=stages)
                try:
                    tc = bench_each(lambda w: run(w, cfg), packed_copies, cuda)
                except Exception as e:  # out of shared memory and the like: not a candidate
                    print(f"    {cfg}: {type(e).__name__}")
                    continue
                if tc < best[0]:
                    best = (tc, cfg)
        short = {key: v for key, v in default.items() if key in ("BN", "SPLIT_K", "num_warps", "num_stages")}
        bshort = {key: v for key, v in best[1].items() if key in ("BN", "SPLIT_K", "num_warps", "num_stages")}
        print(f"| wo_a | {g} × {r} × {k} | {m} | {t:.4f} | {q.nbytes / t / 1e6:.0f} | {short} | {best[0]:.4f} | "
              f"{q.nbytes / best[0] / 1e6:.0f} | {bshort} | {t_d:.4f} |", flush=True)


def moe_rows(a, cuda: bool, dev: str) -> None:
    e_n, dim, inter, topk = (8, 256, 128, 2) if a.smoke else (256, 4096, 2048, 6)
    # the experts stacked one buffer per projection, as `MoE` makes them (--separate-experts:
    # separate tensors read through address tables, which do not pipeline on Triton 3.6)
    w = []
    for n_out, n_in in ((inter, dim), (inter, dim), (dim, inter)):
        codes = torch.randint(-128, 128, (e_n, n_out, n_in // 2), dtype=torch.int8, device=dev)
        scales = torch.full((e_n, n_out, n_in // 32), 2.0 ** -7, device=dev).to(torch.float8_e8m0fnu)
        w.append([(codes[e].clone(), scales[e].clone()) if a.separate_experts else (codes[e], scales[e])
                  for e in range(e_n)])
    tables = grouped_moe.expert_tables(*w)
    print(f"\nexperts: {'stacked, read by offset' if tables.stacked else 'separate, read through address tables'}")
    per_expert = 3 * (inter * dim // 2 + inter * dim // 32)
    if cuda:
        print(f"\ngrouped FP4 multiplies with: {kernels.fp4_dot_report(torch.device(dev))}")
    modes = "".join(f" up / down ms, {kernels.FP4_DOT_NAMES[m]} |" for m in a.fp4_dots)
    print(f"\n| tokens | experts selected | ms | GB/s (selected experts) | TFLOP/s | up ms | down ms |{modes}")
    print("|---|---|---|---|---|---|---|" + "---|" * len(a.fp4_dots))
    g = torch.Generator(device=dev).manual_seed(0)
    for t in a.tokens:
        x = torch.randn(t, dim, device=dev, generator=g).to(torch.bfloat16 if cuda else torch.float32)
        # each token's top-k among the first `--experts-used` experts (all: uniform routing; fewer:
        # the shared experts of a random checkpoint's correlated routing, several rows each)
        used = min(a.experts_used or e_n, e_n)
        ids = torch.rand(t, used, device=dev, generator=g).argsort(-1)[:, :topk]
        weights = torch.rand(t, topk, device=dev, generator=g)
        ms = bench(lambda: grouped_moe.routed_experts_fp4(x, weights, ids, tables, 10.0, x.dtype), cuda)
        sel = int(ids.unique().numel())
        sort = grouped_moe.sort_by_expert(ids, e_n)
        p = sort.order.shape[0]
        route = weights.reshape(-1)[sort.order].float().contiguous()
        tok = sort.token.int()
        xq = fp8_round_trip(x, 128)

        mma = fp4_mma.usable(x, (inter, dim), (dim, inter))
        tiles_by_bm: dict = {}      # the tile tables made once: the launches alone are timed

        def tiles(bm):
            if bm not in tiles_by_bm:
                tiles_by_bm[bm] = grouped_moe.expert_tiles(sort, bm)
            return tiles_by_bm[bm]

        def up(cfg=None, mode=None):
            cfg = cfg or kernels.grouped_config(p, inter, e_n, gated=True, mma=mma)
            return kernels.grouped_fp4(xq, tok, tiles(cfg["BM"]), (tables.w1, tables.s1), inter,
                                       x.dtype, w3=(tables.w3, tables.s3), route=route, limit=10.0, config=cfg,
                                       fp4_dot=mode)
        h = up()

        def down(cfg=None, mode=None):
            cfg = cfg or kernels.grouped_config(p, dim, e_n, mma=mma)
            return kernels.grouped_fp4(h, None, tiles(cfg["BM"]), (tables.w2, tables.s2), dim,
                                       x.dtype, config=cfg, fp4_dot=mode)
        t_up, t_down = bench(up, cuda), bench(down, cuda)
        if mma:        # the same launches without the tensor-core decode kernel, in this run
            before = (bench(lambda: up(kernels.grouped_config(p, inter, e_n, gated=True)), cuda),
                      bench(lambda: down(kernels.grouped_config(p, dim, e_n)), cuda))
        by_mode = "".join(f" {bench(lambda m=m: up(mode=m), cuda):.4f} / {bench(lambda m=m: down(mode=m), cuda):.4f} |"
                          for m in a.fp4_dots)
        print(f"| {t} | {sel} | {ms:.4f} | {sel * per_expert / ms / 1e6:.0f} | "
              f"{t * topk * 3 * 2 * dim * inter / ms / 1e9:.1f} | {t_up:.4f} | {t_down:.4f} |{by_mode}"
              + (f" without the MMA kernel: {before[0]:.4f} / {before[1]:.4f}" if mma else ""), flush=True)
        if a.sweep and t in a.sweep_rows:
            # tl.dot_scaled over address tables (or where the device check found pipelining
            # wrong) runs unpipelined whatever num_stages asks (`grouped_fp4`)
            unpiped = (kernels.fp4_dot_mode(x.device, not tables.stacked) > 0
                       and not (tables.stacked and kernels.fp4_pipelined(x.device)))
            tile_bm = 16 if p <= 512 else 64
            families = {
                "one-row": [dict(BM=1, BN=bn, BK=bk, num_warps=warps)
                            for bn, bk, warps in itertools.product([16, 32, 64], [128, 256, 512], [2, 4])],
                "mma": [dict(BM=8, MMA=True, MT=mt, WK=wk, STAGES=st, CK=ck)
                        for mt, wk, st, ck in itertools.product([1, 2], [1, 2, 4, 8], [2, 3, 4], [1, 2, 4])
                        if fp4_mma.shared_bytes(mt, wk, st, ck) <= fp4_mma.SHARED_MAX]
                if mma else [],
                "tiles": [dict(BM=tile_bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
                          for bn, bk, warps, stages in itertools.product([64, 128], [128, 256], [4],
                                                                         [1] if unpiped else [3])],
            }
            for name, fn in (("up", up), ("down", down)):
                for family, configs in families.items():
                    if family not in a.families.split(","):
                        continue
                    best = []
                    for cfg in configs:
                        try:
                            best.append((bench(lambda c=cfg: fn(c), cuda), cfg))
                        except Exception as e:  # out of resources: not a candidate
                            print(f"    {cfg}: {type(e).__name__}")
                    best.sort(key=lambda tc: tc[0])
                    for tm, cfg in best[:6]:
                        print(f"    sweep {name} {t} tokens, {family}: {tm:.4f} ms {cfg}", flush=True)


def float_rows_bench(a, cuda: bool, dev: str) -> None:
    """The widened decode linears: `rows_linear` (its own tiles and, with --sweep, a grid) against
    torch's GEMM with a float32 output, over weight copies beyond L2 with --cold."""
    from hybridkv.ops.qgemm import float_rows
    print("\n| widened linear | N × K | rows | rows_linear ms | GB/s | config | best swept ms | best config | "
          "torch.mm ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, k, wdtype in ([(*SMOKE[0], torch.float32)] if a.smoke else FLOAT_ROWS):
        w = torch.randn(n, k, device=dev).to(wdtype if cuda else torch.float32) * 0.02
        ws = copies((w,), a.cold and cuda)
        for m in a.rows:
            if m > float_rows.MAX_ROWS:
                continue
            x = torch.randn(m, k, device=dev).to(w.dtype)
            gemv = w.dtype == torch.float32 and m <= float_rows.GEMV_ROWS
            cfg = float_rows.rows_config(m, n, k, w.element_size(), gemv=gemv)
            t = bench_each(lambda c: float_rows.rows_linear(x, c[0]), ws, cuda)
            best = (None, None)
            if gemv:     # whole weight rows a program (gemv_kernel)
                grid = [dict(GEMV=True, BN=bn, BK=bk, num_warps=warps)
                        for bn, bk, warps in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8))]
            else:
                grid = [dict(BM=16, BN=bn, BK=bk, SPLIT_K=split, num_warps=warps, num_stages=3)
                        for bn, bk, split, warps in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8, 16, 32),
                                                                      (4, 8)) if split * bk <= k]
            if a.sweep and cuda and m in a.sweep_rows:
                for c2 in grid:
                    try:
                        t2 = bench_each(lambda c: float_rows.rows_linear(x, c[0], c2), ws, cuda)
                    except Exception as e:  # noqa: BLE001 - a config the compiler refuses is skipped
                        print(f"  skipped {c2}: {type(e).__name__}")
                        continue
                    if best[0] is None or t2 < best[0]:
                        best = (t2, c2)
            t_mm = bench_each(lambda c: torch.mm(x, c[0].t(), out_dtype=torch.float32), ws, cuda) if cuda else None
            short = {k2: v for k2, v in cfg.items() if k2 in ("BN", "BK", "SPLIT_K", "GEMV", "num_warps")}
            bshort = best[1] and {k2: v for k2, v in best[1].items() if k2 in ("BN", "BK", "SPLIT_K", "num_warps")}
            print(f"| {name} | {n} × {k} | {m} | {t:.4f} | {w.nbytes / t / 1e6:.0f} | {short} | "
                  f"{'—' if best[0] is None else f'{best[0]:.4f}'} | {bshort or '—'} | "
                  f"{'—' if t_mm is None else f'{t_mm:.4f}'} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,4096", help="FP8 linears' row counts ('' for none)")
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cold", action="store_true",
                    help="time the FP8 linears over weight copies that exceed L2 (DRAM reads, as in a decode step)")
    ap.add_argument("--sweep-rows", default="1,8", help="row / token counts the sweep runs at")
    ap.add_argument("--experts-used", type=int, default=0,
                    help="grouped FP4: route among this many experts only (0: all 256)")
    ap.add_argument("--families", default="one-row,tiles,mma,fp8-triton,fp8-mma",
                    help="the sweep's kernel families (grouped FP4: one-row, tiles, mma; FP8 linears: fp8-triton, "
                    "fp8-mma)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--separate-experts", action="store_true",
                    help="grouped FP4: each expert its own tensors (address tables) instead of stacked buffers")
    ap.add_argument("--fp4-dots", default="", help="also time the grouped launches with each of these "
                    "FP4_DOT modes (e.g. 0,1), beside the one the device check chose")
    ap.add_argument("--block", type=int, default=128, choices=(32, 64, 128),
                    help="the FP8 linears' scale tiles (32: V4.1-Flash's shapes and tiles)")
    ap.add_argument("--float-rows", action="store_true", help="also the widened decode linears (float_rows)")
    ap.add_argument("--no-moe", action="store_true", help="skip the grouped FP4 experts")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 linears")
    ap.add_argument("--fp8-exact", action="store_true", help="also wo_a packed back to FP8 (grouped_rows)")
    a = ap.parse_args()
    a.fp4_dots = [int(m) for m in a.fp4_dots.split(",") if m]
    a.rows = [int(r) for r in a.rows.split(",") if r]
    a.tokens = [int(r) for r in a.tokens.split(",") if r]
    a.sweep_rows = [int(r) for r in a.sweep_rows.split(",")]
    if a.smoke:
        a.rows, a.tokens = [1, 70], [1, 20]
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        ap.error("needs CUDA (or --smoke for the interpreter)")
    dev = "cuda" if cuda else "cpu"
    print(f"# {torch.cuda.get_device_name() if cuda else 'CPU interpreter (smoke: not a result)'}, "
          f"torch {torch.__version__}; command: python benchmarks/qgemm_kernels.py {' '.join(sys.argv[1:])}")
    if not a.no_fp8:
        fp8_rows(a, cuda, dev)
    if a.fp8_exact:
        fp8_exact_rows(a, cuda, dev)
    if not a.no_moe:
        moe_rows(a, cuda, dev)
    if a.float_rows:
        float_rows_bench(a, cuda, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
