"""The packed-weight GEMM kernels alone at V4-Flash shapes: time, weight bandwidth and TFLOP/s.

For each FP8 linear of a V4-Flash block and each row count, the Triton kernel
(`hybridkv.ops.qgemm.triton.fp8_linear`) against a bf16 GEMM of the dequantised weight (what the
dense-copy path runs) and, where this torch has it, `torch.nn.functional.scaled_mm` with 1×128
activation and 128×128 weight block scales; then the routed experts (256 × 2048, top-6) as the two
grouped FP4 launches for 1 to 4096 tokens, against the bytes of the experts those tokens selected.
`--sweep` also times a grid of tile configurations per shape and prints the fastest (to copy into
`fp8_config` / `grouped_config`).

    python benchmarks/qgemm_kernels.py [--rows 1,8,64,4096] [--sweep] [--bandwidth 4.13e12]
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
from hybridkv.ops.qgemm import reference  # noqa: E402
from hybridkv.ops.qgemm import triton as kernels  # noqa: E402
from hybridkv.ops.quant import dequant_fp8_weight, quant_fp8_weight  # noqa: E402

# (name, N, K) of V4-Flash's FP8 linears
FLASH = [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("wo_b", 4096, 8192),
         ("shared w1/w3", 2048, 4096), ("shared w2", 4096, 2048), ("indexer wq_b", 8192, 1024)]
SMOKE = [("small", 256, 512)]


def bench(fn, cuda: bool, reps: int = 20) -> float:
    """Median ms of fn()."""
    if cuda:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=10, rep=50))
    fn()
    t = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - t) / 2 * 1e3


def scaled_mm_fn(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor):
    """torch's blockwise-scaled FP8 GEMM for this problem, or the reason it cannot run."""
    F = torch.nn.functional
    if not hasattr(F, "scaled_mm"):
        return None, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    st = getattr(F, "ScalingType", None)
    names = [n for n in ("Blockwise_1x128", "BlockWise1x128") if st is not None and hasattr(st, n)]
    if not names:
        return None, "no 1x128 blockwise ScalingType in this torch"
    r1 = getattr(st, names[0])
    r2 = getattr(st, names[0].replace("1x128", "128x128"))
    m, k = x.shape
    pad = -m % 4                                      # cuBLASLt wants the scale rows padded to 4
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, pad))
    xb = xp.view(m + pad, k // 128, 128)
    a_s = kernels_pow2(xb.abs().amax(-1).clamp(min=1e-4) / 448.0)
    a_q = (xb / a_s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m + pad, k)
    errors = []
    # scale layouts to try: 1x128 scales outer-dim-major with the weight's [K/128, N/128] view
    # (what SM90's cuBLASLt path documents), then both row-major
    for a_scale, w_scale in ((a_s.t().contiguous().t(), s.float().t()), (a_s, s.float())):
        def fn(a_scale=a_scale, w_scale=w_scale):
            return F.scaled_mm(a_q, q.t(), a_scale, r1, w_scale, r2, output_dtype=torch.bfloat16)[:m]
        try:
            fn()
            return fn, None
        except Exception as e:  # what torch refuses is the finding
            errors.append(str(e).splitlines()[0][:160])
    return None, "; ".join(errors)


def kernels_pow2(t: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(t)
    return torch.ldexp(torch.ones_like(t), torch.where(mant == 0.5, exp - 1, exp))


def fp8_rows(a, cuda: bool, dev: str) -> None:
    print("\n| linear | N × K | rows | triton ms | GB/s (weight) | TFLOP/s | dense bf16 ms | scaled_mm ms | "
          "rel rms |")
    print("|---|---|---|---|---|---|---|---|---|")
    notes = set()
    for name, n, k in (SMOKE if a.smoke else FLASH):
        q, s = quant_fp8_weight(torch.randn(n, k, device=dev) * 0.02)
        dense = dequant_fp8_weight(q, s, (128, 128), torch.bfloat16 if cuda else torch.float32)
        for m in a.rows:
            x = torch.randn(m, k, device=dev).to(dense.dtype)
            out_dtype = dense.dtype
            t_k = bench(lambda: kernels.fp8_linear(x, q, s, out_dtype), cuda)
            t_d = bench(lambda: torch.nn.functional.linear(x, dense), cuda)
            fn, why = scaled_mm_fn(x, q, s) if cuda else (None, "CPU")
            t_s = bench(fn, cuda) if fn else None
            if why:
                notes.add(why)
            err = float((reference.fp8_linear(x.float(), q, s, (128, 128), torch.float32)
                         - kernels.fp8_linear(x, q, s, out_dtype).float()).pow(2).mean().sqrt()
                        / reference.fp8_linear(x.float(), q, s, (128, 128), torch.float32).pow(2).mean().sqrt())
            print(f"| {name} | {n} × {k} | {m} | {t_k:.4f} | {n * k / t_k / 1e6:.0f} | {2 * m * n * k / t_k / 1e9:.1f} | "
                  f"{t_d:.4f} | {'—' if t_s is None else f'{t_s:.4f}'} | {err:.1e} |", flush=True)
            if a.sweep:
                sweep_fp8(x, q, s, out_dtype, cuda)
    for why in notes:
        print(f"scaled_mm: {why}")


def sweep_fp8(x, q, s, out_dtype, cuda: bool) -> None:
    m, (n, k) = x.shape[0], q.shape
    best = []
    bms = [16, 32, 64] if m <= 64 else [64, 128]
    for bm, bn, split, warps, stages in itertools.product(bms, [32, 64, 128], [1, 2, 4, 8], [4, 8], [3, 4]):
        if split > 1 and m > 64 or split > (k // 128) // 2 and split > 1:
            continue
        cfg = dict(BM=bm, BN=bn, SPLIT_K=split, GROUP_M=8 if m > 64 else 1, num_warps=warps, num_stages=stages)
        try:
            t = bench(lambda: kernels.fp8_linear(x, q, s, out_dtype, config=cfg), cuda)
        except Exception as e:  # out of shared memory and the like: not a candidate
            print(f"    {cfg}: {type(e).__name__}")
            continue
        best.append((t, cfg))
    best.sort(key=lambda tc: tc[0])
    for t, cfg in best[:3]:
        print(f"    sweep {m}×{n}×{k}: {t:.4f} ms {cfg}")


def moe_rows(a, cuda: bool, dev: str) -> None:
    e_n, dim, inter, topk = (8, 256, 128, 2) if a.smoke else (256, 4096, 2048, 6)
    w = [[(torch.randint(-128, 128, (n_out, n_in // 2), dtype=torch.int8, device=dev),
           torch.full((n_out, n_in // 32), 2.0 ** -7, device=dev).to(torch.float8_e8m0fnu)) for _ in range(e_n)]
         for n_out, n_in in ((inter, dim), (inter, dim), (dim, inter))]
    tables = grouped_moe.expert_tables(*w)
    per_expert = 3 * (inter * dim // 2 + inter * dim // 32)
    print("\n| tokens | experts selected | ms | GB/s (selected experts) | TFLOP/s |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device=dev).manual_seed(0)
    for t in a.tokens:
        x = torch.randn(t, dim, device=dev, generator=g).to(torch.bfloat16 if cuda else torch.float32)
        ids = torch.rand(t, e_n, device=dev, generator=g).argsort(-1)[:, :topk]
        weights = torch.rand(t, topk, device=dev, generator=g)
        ms = bench(lambda: grouped_moe.routed_experts_fp4(x, weights, ids, tables, 10.0, x.dtype), cuda)
        sel = int(ids.unique().numel())
        print(f"| {t} | {sel} | {ms:.4f} | {sel * per_expert / ms / 1e6:.0f} | "
              f"{t * topk * 3 * 2 * dim * inter / ms / 1e9:.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,4096")
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    a.rows = [int(r) for r in a.rows.split(",")]
    a.tokens = [int(r) for r in a.tokens.split(",")]
    if a.smoke:
        a.rows, a.tokens = [1, 70], [1, 20]
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        ap.error("needs CUDA (or --smoke for the interpreter)")
    dev = "cuda" if cuda else "cpu"
    print(f"# {torch.cuda.get_device_name() if cuda else 'CPU interpreter (smoke: not a result)'}, "
          f"torch {torch.__version__}; command: python benchmarks/qgemm_kernels.py {' '.join(sys.argv[1:])}")
    fp8_rows(a, cuda, dev)
    moe_rows(a, cuda, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
