"""Attention-path benchmark on one GPU at V4-Flash dims (64 heads × 512, rope 64; indexer 64 × 128,
top-512; window 128; 584-B fp8 main entries, 68-B FP4 indexer keys).

Per context (8K / 128K / 1M) and batch (1 / 8), decode: the CSA step (indexer scoring + top-k +
sparse attention) through the Triton kernels, eager and as a CUDA graph replay; its two halves;
the HCA step; the plain-torch reference CSA step; a dense single-KV-head MQA decode over the
uncompressed bf16 context (two bf16 matmuls). Prefill: sparse attention over a 2048-token chunk
(TFLOP/s on the attention FLOPs performed) and the indexer for the same chunk.
Bytes are the least the design must read (each needed byte once); % HBM is against 4.13 TB/s, the
copy bandwidth measured on the H200 here. Writes attention.json / attention.md to $OUT if set.

    python benchmarks/attention.py [--contexts 8192,131072,1048576] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

import torch
import triton

from hybridkv.ops.indexer_topk import reference as idx_ref
from hybridkv.ops.indexer_topk import triton as idx_k
from hybridkv.ops.paged import PagedBatch
from hybridkv.ops.sparse_attn import reference as attn_ref
from hybridkv.ops.sparse_attn import triton as attn_k

H, D, ROPE, HI, DI, TOPK, W = 64, 512, 64, 64, 128, 512, 128
MAIN_B, IDX_B = 584, 68
HBM = 4.13e12
DEV = "cuda"


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median") * 1e3


def graph_us(fn) -> float | None:
    """Median µs of a CUDA graph replay of fn (None if capture fails)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return bench_us(g.replay)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  graph capture failed: {type(e).__name__}: {e}")
        return None


def main_pool(n: int) -> torch.Tensor:
    """n random 584-B entries (finite e4m3 codes, sane ue8m0 scales, bf16 rope)."""
    x = torch.empty(n, MAIN_B, dtype=torch.uint8, device=DEV)
    x[:, :448] = torch.randint(0, 0x7E, (n, 448), dtype=torch.uint8, device=DEV) | (
        torch.randint(0, 2, (n, 448), dtype=torch.uint8, device=DEV) << 7)
    x[:, 448:576] = torch.randn(n, ROPE, device=DEV).bfloat16().view(torch.uint8)
    x[:, 576:583] = torch.randint(118, 124, (n, 7), dtype=torch.uint8, device=DEV)
    x[:, 583] = 0
    return x


def index_pool(n: int) -> torch.Tensor:
    x = torch.randint(0, 256, (n, IDX_B), dtype=torch.uint8, device=DEV)
    x[:, 64:] = torch.randint(122, 130, (n, 4), dtype=torch.uint8, device=DEV)
    return x


def decode_rows(ctx: int, b: int, rows: list) -> None:
    blocks = ctx // 128 + 1
    perm = torch.randperm(b * blocks).view(b, blocks)
    batch = PagedBatch.build([(r, ctx - 1, 1, perm[r]) for r in range(b)], 128, DEV)
    vis = ctx // 4
    q = torch.randn(b, H, D, device=DEV).bfloat16()
    qi = torch.randn(b, HI, DI, device=DEV).bfloat16()
    wi = torch.randn(b, HI, device=DEV) * HI ** -0.5
    sink = torch.randn(H, device=DEV)
    new, ring = main_pool(b), main_pool(b * W).view(b, W, MAIN_B)
    mpool = main_pool(b * blocks * 32).view(b * blocks, 32, MAIN_B)
    ipool = index_pool(b * blocks * 32).view(b * blocks, 32, IDX_B)
    hpool = main_pool(b * blocks).view(b * blocks, 1, MAIN_B)
    scale = D ** -0.5
    sel = {}

    def indexer():
        sel["idx"] = idx_k.indexer_topk_paged(qi, wi, batch, ipool, TOPK, 4, "fp4", DI, max_visible=vis)

    def attend():
        return attn_k.sparse_attn_paged(q, sink, scale, batch, new, ring, mpool, sel["idx"], 4, "fp8", D, ROPE, W)

    def csa_step():
        indexer()
        attend()

    def hca_step():
        attn_k.sparse_attn_paged(q, sink, scale, batch, new, ring, hpool, None, 128, "fp8", D, ROPE, W,
                                 max_pos=ctx - 1)

    indexer()
    csa_bytes = b * (vis * IDX_B + (W + TOPK) * MAIN_B)
    hca_bytes = b * ((W + ctx // 128) * MAIN_B)
    add = lambda name, us, nbytes: rows.append(dict(  # noqa: E731
        phase="decode", ctx=ctx, batch=b, what=name, us=us, bytes=nbytes,
        gbs=None if us is None else nbytes / us / 1e3, hbm_pct=None if us is None else 100 * nbytes / (us * 1e-6) / HBM))
    add("CSA step, kernels (eager)", bench_us(csa_step), csa_bytes)
    add("CSA step, kernels (CUDA graph)", graph_us(csa_step), csa_bytes)
    add("  indexer + top-k (eager)", bench_us(indexer), b * vis * IDX_B)
    add("  sparse attention (eager)", bench_us(attend), b * (W + TOPK) * MAIN_B)
    add("HCA step, kernel (eager)", bench_us(hca_step), hca_bytes)
    add("HCA step, kernel (CUDA graph)", graph_us(hca_step), hca_bytes)
    del mpool, ipool, hpool
    # plain-torch reference step on contiguous bf16 rows (the reference ops as the model calls them)
    keys = torch.randn(b, vis, DI, device=DEV).bfloat16()
    comp = torch.randn(b, vis, D, device=DEV).bfloat16()
    win = torch.randn(b, W, D, device=DEV).bfloat16()
    vis_t = torch.tensor([vis], device=DEV)

    def ref_step():
        for r in range(b):
            top = idx_ref.causal_topk(idx_ref.index_scores(qi[r:r + 1], wi[r:r + 1], keys[r]), vis_t, TOPK)
            kv = torch.cat([win[r], comp[r][top[0]]])
            attn_ref.sparse_attn(q[r:r + 1], kv, torch.arange(kv.shape[0], device=DEV)[None], sink, scale)

    add("CSA step, plain torch (bf16 rows)", bench_us(ref_step), b * (vis * DI * 2 + (W + TOPK) * D * 2))
    del keys, comp, win
    torch.cuda.empty_cache()
    # dense MQA decode over the uncompressed context: two bf16 matmuls
    kv = torch.randn(b, ctx, D, device=DEV).bfloat16()

    def dense():
        s = torch.bmm(q, kv.transpose(1, 2)) * scale
        return torch.bmm(s.float().softmax(-1).bfloat16(), kv)

    add("dense MQA decode (bf16, 2 matmuls)", bench_us(dense), b * ctx * D * 2)
    del kv
    torch.cuda.empty_cache()


def prefill_rows(ctx: int, t: int, rows: list) -> None:
    blocks = ctx // 128 + 1
    batch = PagedBatch.build([(0, ctx - t, t, torch.randperm(blocks))], 128, DEV)
    q = torch.randn(t, H, D, device=DEV).bfloat16()
    sink = torch.randn(H, device=DEV)
    vis = (batch.positions.long() + 1) // 4
    idx = (torch.rand(t, TOPK, device=DEV) * vis.unsqueeze(1)).long().to(torch.int32)
    for fmt in ("bf16", "fp8"):
        ent = (lambda n: main_pool(n)) if fmt == "fp8" else (lambda n: torch.randn(n, D, device=DEV).bfloat16())
        new, ring, mpool = ent(t), ent(W).view(1, W, -1), ent(blocks * 32).view(blocks, 32, -1)
        hpool = ent(blocks).view(blocks, 1, -1)
        us = bench_us(lambda: attn_k.sparse_attn_paged(q, sink, D ** -0.5, batch, new, ring, mpool, idx, 4, fmt, D,
                                                        ROPE, W))
        flops = 4 * t * H * (W + TOPK) * D
        rows.append(dict(phase="prefill", ctx=ctx, batch=1, what=f"CSA sparse attention {fmt}, {t} tokens", us=us,
                         tflops=flops / us / 1e6))
        n_hca = sum(W + (p + 1) // 128 for p in range(ctx - t, ctx))
        us = bench_us(lambda: attn_k.sparse_attn_paged(q, sink, D ** -0.5, batch, new, ring, hpool, None, 128, fmt,
                                                        D, ROPE, W, max_pos=ctx - 1))
        rows.append(dict(phase="prefill", ctx=ctx, batch=1, what=f"HCA sparse attention {fmt}, {t} tokens", us=us,
                         tflops=4 * H * D * n_hca / us / 1e6))
    qi = torch.randn(t, HI, DI, device=DEV).bfloat16()
    wi = torch.randn(t, HI, device=DEV)
    ipool = index_pool(blocks * 32).view(blocks, 32, IDX_B)
    us = bench_us(lambda: idx_k.indexer_topk_paged(qi, wi, batch, ipool, TOPK, 4, "fp4", DI, max_visible=ctx // 4))
    flops = 2 * HI * DI * float(vis.sum())
    rows.append(dict(phase="prefill", ctx=ctx, batch=1, what=f"indexer + top-k fp4, {t} tokens", us=us,
                     tflops=flops / us / 1e6))


def table(rows: list) -> str:
    out = ["| phase | context | batch | what | µs | bytes (design) | GB/s | % HBM | TFLOP/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
    for r in rows:
        out.append(f"| {r['phase']} | {r['ctx'] // 1024}K | {r['batch']} | {r['what']} | {f(r['us'], '.1f')} | "
                   f"{f(r.get('bytes'), ',')} | {f(r.get('gbs'), '.0f')} | {f(r.get('hbm_pct'), '.1f')} | "
                   f"{f(r.get('tflops'), '.0f')} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,131072,1048576")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefill-context", type=int, default=131072)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: list = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            print(f"decode ctx={ctx} batch={b}", flush=True)
            decode_rows(ctx, b, rows)
    print("prefill", flush=True)
    prefill_rows(args.prefill_context, args.prefill_tokens, rows)
    head = (f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
            f"{datetime.date.today().isoformat()} · python benchmarks/attention.py")
    md = head + "\n\n" + table(rows)
    print(md)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention.json"), "w") as fh:
            json.dump(dict(machine=head, host=platform.node(), rows=rows), fh, indent=1)
        with open(os.path.join(os.environ["OUT"], "attention.md"), "w") as fh:
            fh.write(md + "\n")


if __name__ == "__main__":
    main()
