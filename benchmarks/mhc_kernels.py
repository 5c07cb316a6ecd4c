"""The mHC kernels alone at V4-Flash's width (4 streams × 4096): time against the bytes they move.

For each token count: the mixes (the float32 copy of the stream and the fp32 GEMM, against
`mix_partials`' one pass: per-token partial sums up to 64 tokens, `mixes_kernel` beyond), the
engine's two launches for the sub-block input (`mhc_pre_fn`: the mixes, then `pre_kernel` with
Sinkhorn and the collapse) at each `--warps` count of `pre_kernel`, and `post_kernel`. Every time
is the median of CUDA-graph replays; `bytes ms` is the stream's bytes read once at `--bandwidth`.

    python3 benchmarks/mhc_kernels.py [--tokens 1,8,64,8192] [--warps 1,2,4] [--dtype bfloat16]
    python3 benchmarks/mhc_kernels.py --smoke     # small shapes in Triton's interpreter (CPU)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridkv.ops.mhc import triton as kernels  # noqa: E402

HC, DIM, ITERS = 4, 4096, 20


def timed(fn, cuda: bool) -> float | None:
    if not cuda:
        fn()
        return None
    from triton.testing import do_bench_cudagraph
    return float(do_bench_cudagraph(fn, rep=30, return_mode="median"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,8192")
    ap.add_argument("--warps", default="1,2,4", help="pre_kernel warps to time")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the stream's dtype")
    ap.add_argument("--bandwidth", type=float, default=4.13e12)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    cuda = not a.smoke and torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dim = 256 if a.smoke else DIM
    dtype = getattr(torch, a.dtype)
    tokens = [int(t) for t in a.tokens.split(",")] if not a.smoke else [1, 70]
    m = (2 + HC) * HC
    print(f"# mHC kernels, {HC} streams x {dim}, {a.dtype}, {torch.cuda.get_device_name() if cuda else 'interpreter'}")
    print("| tokens | bytes ms | copy + GEMM mixes ms | mix_partials ms | "
          + " | ".join(f"mixes + pre, {w} warps ms" for w in a.warps.split(",")) + " | post ms |")
    print("|---" * (5 + len(a.warps.split(","))) + "|")
    g = torch.Generator(device=dev).manual_seed(0)
    scale, base = torch.ones(3, device=dev), torch.zeros(m, device=dev)
    fn = torch.randn(m, HC * dim, device=dev, generator=g) * 0.01
    for t in tokens:
        x = torch.randn(t, HC, dim, device=dev, generator=g).to(dtype)
        f = torch.randn(t, dim, device=dev, generator=g).to(dtype)
        flat = x.flatten(1)
        row = [f"{t:,}", f"{x.numel() * x.element_size() / a.bandwidth * 1e3:.4f}"]
        row.append(timed(lambda: F.linear(flat.float(), fn), cuda))
        row.append(timed(lambda: kernels.mix_partials(flat, fn), cuda))
        saved = kernels.PRE_WARPS
        try:
            for w in a.warps.split(","):
                kernels.PRE_WARPS = int(w)
                row.append(timed(lambda: kernels.mhc_pre_fn(x, fn, scale, base, ITERS, 1e-6, 1e-6), cuda))
        finally:
            kernels.PRE_WARPS = saved
        _, post, comb = kernels.mhc_pre_fn(x, fn, scale, base, ITERS, 1e-6, 1e-6)
        row.append(timed(lambda: kernels.mhc_post(f, x, post, comb), cuda))
        print("| " + " | ".join(v if isinstance(v, str) else ("—" if v is None else f"{v:.4f}") for v in row) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
