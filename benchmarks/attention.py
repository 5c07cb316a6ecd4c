"""Attention-path benchmark on one GPU at V4-Flash dims (64 heads × 512, rope 64; indexer 64 × 128,
top-512; window 128; 584-B fp8 main entries, 68-B FP4 indexer keys).

Per context (8K / 128K / 1M) and batch (1 / 8), decode: the CSA step (indexer scoring + top-k +
sparse attention) through the Triton kernels as a CUDA graph replay (what the targets are stated
in) and eager; its two halves as graphs; the HCA step; the plain-torch reference CSA step; a dense
single-KV-head MQA decode over the uncompressed bf16 context (two bf16 matmuls). Every decode
configuration is first checked at its own scale: the top-k against the reference scores of the
keys, attention against the reference on the gathered rows of the first and last token. Prefill:
sparse attention over a 2048-token chunk (TFLOP/s on the attention FLOPs performed) and the indexer
for the same chunk. With --sweep, launch shapes of each kernel are timed against each other until
the time budget is spent (sweep.json / sweep.md). Bytes are the least the design must read (each
needed byte once); % HBM is against 4.13 TB/s, the copy bandwidth measured on the H200 here.
Timings use triton's do_bench (median, L2 flushed before every run). Writes attention.json /
attention.md (and sweep.*) to $OUT if set.

    python benchmarks/attention.py [--contexts 8192,131072,1048576] [--batches 1,8] [--sweep] [--budget 420]
    ncu --clock-control none -k regex:'score|select|sparse_attn|combine' --launch-skip 8 -c 6 \
        python benchmarks/attention.py --profile-step 1048576,8      # the kernels of one step, profiled
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch
import triton

from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.indexer_topk import reference as idx_ref
from hybridkv.ops.indexer_topk import triton as idx_k
from hybridkv.ops.kv_formats import index_block_rows, unpack_index_fp4, unpack_main_fp8
from hybridkv.ops.paged import PagedBatch
from hybridkv.ops.quant import fp4_round_trip
from hybridkv.ops.sparse_attn import reference as attn_ref
from hybridkv.ops.sparse_attn import triton as attn_k

H, D, ROPE, HI, DI, TOPK, W = 64, 512, 64, 64, 128, 512, 128
MAIN_B, IDX_B = 584, 68
HBM = 4.13e12
DEV = "cuda"
T0 = time.time()


def bench_us(fn, rep=80) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=rep, return_mode="median") * 1e3


def graph_us(fn, rep=80) -> float | None:
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
        return bench_us(g.replay, rep)
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


def index_pool(blocks: int) -> torch.Tensor:
    """Blocks of 32 random FP4 keys in the pool's block layout (codes, then scales), with the scales of
    Hadamard-rotated keys: each key's four 32-blocks within a binade of each other."""
    x = torch.randint(0, 256, (blocks, 32 * IDX_B), dtype=torch.uint8, device=DEV)
    base = torch.randint(122, 129, (blocks, 32, 1), dtype=torch.uint8, device=DEV)
    x[:, 32 * 64:] = (base + torch.randint(0, 2, (blocks, 32, 4), dtype=torch.uint8, device=DEV)).view(blocks, -1)
    return x.view(blocks, 32, IDX_B)


def index_queries(t: int) -> torch.Tensor:
    """t indexer queries as the model makes them: Hadamard-rotated, through their FP4 round trip, bf16."""
    return fp4_round_trip(hadamard_transform(torch.randn(t, HI, DI, device=DEV)), 32).bfloat16()


class Decode:
    """The inputs of one decode step of b requests at context ctx, with the kernels' calls."""

    def __init__(self, ctx: int, b: int):
        self.ctx, self.b = ctx, b
        blocks = ctx // 128 + 1
        perm = torch.randperm(b * blocks).view(b, blocks)
        self.batch = PagedBatch.build([(r, ctx - 1, 1, perm[r]) for r in range(b)], 128, DEV)
        self.vis = ctx // 4
        self.q = torch.randn(b, H, D, device=DEV).bfloat16()
        self.qi = index_queries(b)
        self.wi = torch.randn(b, HI, device=DEV) * HI ** -0.5
        self.sink = torch.randn(H, device=DEV)
        self.new, self.ring = main_pool(b), main_pool(b * W).view(b, W, MAIN_B)
        self.mpool = main_pool(b * blocks * 32).view(b * blocks, 32, MAIN_B)
        self.ipool = index_pool(b * blocks)
        self.hpool = main_pool(b * blocks).view(b * blocks, 1, MAIN_B)
        self.sel = None
        self.indexer()

    def indexer(self):
        self.sel = idx_k.indexer_topk_paged(self.qi, self.wi, self.batch, self.ipool, TOPK, 4, "fp4", DI,
                                            max_visible=self.vis, fp4_queries=True)
        return self.sel

    def csa(self, cfg=None):
        return attn_k.sparse_attn_paged(self.q, self.sink, D ** -0.5, self.batch, self.new, self.ring, self.mpool,
                                        self.sel, 4, "fp8", D, ROPE, W, cfg=cfg)

    def hca(self, cfg=None):
        return attn_k.sparse_attn_paged(self.q, self.sink, D ** -0.5, self.batch, self.new, self.ring, self.hpool,
                                        None, 128, "fp8", D, ROPE, W, max_pos=self.ctx - 1, cfg=cfg)

    def csa_step(self):
        self.indexer()
        return self.csa()

    def check(self) -> dict:
        """Errors at this scale: the top-k's worst relative score gap to the reference top-k, and the
        attention outputs' relative RMS error against the reference (first and last token)."""
        out = dict(topk_gap=0.0, csa_rel_rms=0.0, hca_rel_rms=0.0)
        sel = self.indexer().long()
        csa, hca = self.csa(), self.hca()
        bt = self.batch.block_tables.long()
        for r in sorted({0, self.b - 1}):
            j = torch.arange(self.vis, device=DEV)
            keys = unpack_index_fp4(index_block_rows(self.ipool, bt[r, j // 32], j % 32, DI), DI)
            s = idx_ref.index_scores(self.qi[r:r + 1].float(), self.wi[r:r + 1], keys)[0]
            got = s[sel[r]].sort(descending=True).values
            want = s.topk(TOPK).values
            if sel[r].unique().numel() != TOPK or not bool((sel[r] >= 0).all()):
                out["topk_invalid"] = True
            out["topk_gap"] = max(out["topk_gap"], float(((got - want).abs() / want.abs().max()).max()))
            for name, comp, pool in (("csa", sel[r], self.mpool), ("hca", torch.arange(self.ctx // 128, device=DEV),
                                                                 self.hpool)):
                epb = pool.shape[1]
                p = torch.arange(self.ctx - W, self.ctx - 1, device=DEV)
                rows = torch.cat([self.ring[r, p % W], self.new[r:r + 1], pool[bt[r, comp // epb], comp % epb]])
                kv = unpack_main_fp8(rows, D, ROPE)
                ref = attn_ref.sparse_attn(self.q[r:r + 1].float(), kv, torch.arange(kv.shape[0], device=DEV)[None],
                                           self.sink, D ** -0.5)[0]
                got = (csa if name == "csa" else hca)[r]
                err = float((got - ref).square().mean().sqrt() / ref.square().mean().sqrt())
                out[f"{name}_rel_rms"] = max(out[f"{name}_rel_rms"], err)
        return out


def decode_rows(ctx: int, b: int, rows: list) -> None:
    x = Decode(ctx, b)
    chk = x.check()
    print(f"  check: {chk}", flush=True)
    csa_bytes = b * (x.vis * IDX_B + (W + TOPK) * MAIN_B)
    hca_bytes = b * ((W + ctx // 128) * MAIN_B)

    def add(name, us, nbytes, **extra):
        rows.append(dict(phase="decode", ctx=ctx, batch=b, what=name, us=us, bytes=nbytes,
                         gbs=None if us is None else nbytes / us / 1e3,
                         hbm_pct=None if us is None else 100 * nbytes / (us * 1e-6) / HBM, **extra))

    add("CSA step, kernels (CUDA graph)", graph_us(x.csa_step), csa_bytes, check=chk)
    add("CSA step, kernels (eager)", bench_us(x.csa_step), csa_bytes)
    add("  indexer + top-k (CUDA graph)", graph_us(x.indexer), b * x.vis * IDX_B)
    add("  sparse attention (CUDA graph)", graph_us(x.csa), b * (W + TOPK) * MAIN_B)
    add("HCA step, kernel (CUDA graph)", graph_us(x.hca), hca_bytes)
    add("HCA step, kernel (eager)", bench_us(x.hca), hca_bytes)
    del x
    torch.cuda.empty_cache()
    # plain-torch reference step on contiguous bf16 rows (the reference ops as the model calls them)
    qi = torch.randn(b, HI, DI, device=DEV).bfloat16()
    wi = torch.randn(b, HI, device=DEV) * HI ** -0.5
    q = torch.randn(b, H, D, device=DEV).bfloat16()
    sink = torch.randn(H, device=DEV)
    vis = ctx // 4
    keys = torch.randn(b, vis, DI, device=DEV).bfloat16()
    comp = torch.randn(b, vis, D, device=DEV).bfloat16()
    win = torch.randn(b, W, D, device=DEV).bfloat16()
    vis_t = torch.tensor([vis], device=DEV)

    def ref_step():
        for r in range(b):
            top = idx_ref.causal_topk(idx_ref.index_scores(qi[r:r + 1], wi[r:r + 1], keys[r]), vis_t, TOPK)
            kv = torch.cat([win[r], comp[r][top[0]]])
            attn_ref.sparse_attn(q[r:r + 1], kv, torch.arange(kv.shape[0], device=DEV)[None], sink, D ** -0.5)

    add("CSA step, plain torch (bf16 rows)", bench_us(ref_step), b * (vis * DI * 2 + (W + TOPK) * D * 2))
    del keys, comp, win
    torch.cuda.empty_cache()
    # dense MQA decode over the uncompressed context: two bf16 matmuls
    kv = torch.randn(b, ctx, D, device=DEV).bfloat16()

    def dense():
        s = torch.bmm(q, kv.transpose(1, 2)) * D ** -0.5
        return torch.bmm(s.float().softmax(-1).bfloat16(), kv)

    add("dense MQA decode (bf16, 2 matmuls)", bench_us(dense), b * ctx * D * 2)
    del kv
    torch.cuda.empty_cache()


class Prefill:
    """A t-token chunk of one request at the end of a ctx-token context."""

    def __init__(self, ctx: int, t: int):
        self.ctx, self.t = ctx, t
        blocks = ctx // 128 + 1
        self.batch = PagedBatch.build([(0, ctx - t, t, torch.randperm(blocks))], 128, DEV)
        self.q = torch.randn(t, H, D, device=DEV).bfloat16()
        self.sink = torch.randn(H, device=DEV)
        vis = (self.batch.positions.long() + 1) // 4
        self.vis = vis
        self.idx = (torch.rand(t, TOPK, device=DEV) * vis.unsqueeze(1)).long().to(torch.int32)
        self.pools = {}
        for fmt in ("bf16", "fp8"):
            ent = main_pool if fmt == "fp8" else (lambda n: torch.randn(n, D, device=DEV).bfloat16())
            self.pools[fmt] = (ent(t), ent(W).view(1, W, -1), ent(blocks * 32).view(blocks, 32, -1),
                               ent(blocks).view(blocks, 1, -1))
        self.csa_flops = 4 * t * H * (W + TOPK) * D
        self.hca_flops = 4 * H * D * sum(W + (p + 1) // 128 for p in range(ctx - t, ctx))
        self.qi = index_queries(t)
        self.wi = torch.randn(t, HI, device=DEV)
        self.ipool = index_pool(blocks)

    def csa(self, fmt, cfg=None):
        new, ring, mpool, _ = self.pools[fmt]
        return attn_k.sparse_attn_paged(self.q, self.sink, D ** -0.5, self.batch, new, ring, mpool, self.idx, 4, fmt,
                                        D, ROPE, W, cfg=cfg)

    def hca(self, fmt, cfg=None):
        new, ring, _, hpool = self.pools[fmt]
        return attn_k.sparse_attn_paged(self.q, self.sink, D ** -0.5, self.batch, new, ring, hpool, None, 128, fmt,
                                        D, ROPE, W, max_pos=self.ctx - 1, cfg=cfg)

    def indexer(self):
        return idx_k.indexer_topk_paged(self.qi, self.wi, self.batch, self.ipool, TOPK, 4, "fp4", DI,
                                        max_visible=self.ctx // 4, fp4_queries=True)


def prefill_rows(ctx: int, t: int, rows: list) -> None:
    x = Prefill(ctx, t)
    for fmt in ("bf16", "fp8"):
        us = bench_us(lambda: x.csa(fmt))
        rows.append(dict(phase="prefill", ctx=ctx, batch=1, what=f"CSA sparse attention {fmt}, {t} tokens", us=us,
                         tflops=x.csa_flops / us / 1e6))
        us = bench_us(lambda: x.hca(fmt))
        rows.append(dict(phase="prefill", ctx=ctx, batch=1, what=f"HCA sparse attention {fmt}, {t} tokens", us=us,
                         tflops=x.hca_flops / us / 1e6))
    us = bench_us(x.indexer)
    flops = 2 * HI * DI * float(x.vis.sum())
    rows.append(dict(phase="prefill", ctx=ctx, batch=1, what=f"indexer + top-k fp4, {t} tokens", us=us,
                     tflops=flops / us / 1e6))


def sweep(budget_s: float, ctx: int, prefill_ctx: int, prefill_t: int) -> list:
    """Time launch shapes against each other (until the budget is spent): decode attention pieces and
    head blocks, indexer scoring and selection shapes, prefill tiles and pipeline depth."""
    out: list = []

    def timed(group, label, fn, graph=True, **extra):
        if time.time() - T0 > budget_s:
            return
        try:
            fn()
            us = graph_us(fn, rep=40) if graph else bench_us(fn, rep=40)
        except Exception as e:  # noqa: BLE001 - a shape that does not compile or fit is a result too
            us = None
            print(f"  {group} {label}: {type(e).__name__}: {str(e)[:200]}")
        out.append(dict(group=group, config=label, us=us, **extra))
        print(f"  {group:34s} {label:46s} {'—' if us is None else f'{us:9.1f}'} µs", flush=True)

    # first (a short budget reaches them): the prefill indexer's scoring tiles (query rows per program,
    # keys per MMA tile and per program, warps, pipeline stages)
    x = Prefill(prefill_ctx, prefill_t)
    group = f"prefill indexer {prefill_t} tok"
    saved = dict(idx_k.TILE_CFG)
    timed(group, "default", x.indexer, graph=False)
    for upd in [dict(num_warps=8), dict(num_warps=8, num_stages=2), dict(num_warps=8, ROWS=512), dict(ROWS=128),
                dict(num_stages=2), dict(BN=128), dict(CHUNK=4096), dict(CHUNK=1024)]:
        idx_k.TILE_CFG.update(upd)
        timed(group, str(upd), x.indexer, graph=False)
        idx_k.TILE_CFG.clear()
        idx_k.TILE_CFG.update(saved)
    del x
    torch.cuda.empty_cache()
    # decode attention's merge shapes, one-tile pieces and the pipelining of whole-head programs, at a
    # short and the longest context
    for c, b in ((8192, 1), (ctx, 1), (ctx, 8)):
        x = Decode(c, b)
        for kind in ("csa", "hca"):
            fn = x.csa if kind == "csa" else x.hca
            group = f"decode {kind} attn {c // 1024}K B={b}"
            saved = (attn_k.COMBINE_CFG, attn_k.MIN_SPLIT, attn_k.WIDE_CFG)
            timed(group, "default", fn)
            for cc in [dict(BLOCK_H=2, BLOCK_D=64, BLOCK_S=32, num_warps=1),
                       dict(BLOCK_H=1, BLOCK_D=64, BLOCK_S=16, num_warps=1),
                       dict(BLOCK_H=1, BLOCK_D=128, BLOCK_S=32, num_warps=2),
                       dict(BLOCK_H=1, BLOCK_D=32, BLOCK_S=32, num_warps=1),
                       dict(BLOCK_H=4, BLOCK_D=64, BLOCK_S=16, num_warps=4)]:
                attn_k.COMBINE_CFG = cc
                timed(group, "merge " + ",".join(str(v) for v in cc.values()), fn)
            attn_k.COMBINE_CFG = saved[0]
            attn_k.MIN_SPLIT = 64
            timed(group, "pieces of >= 64 rows", fn)
            attn_k.MIN_SPLIT = saved[1]
            for wide in [(64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 2)]:
                attn_k.WIDE_CFG = {**saved[2], True: wide}     # decode rows here are packed fp8
                timed(group, f"wide {wide}", fn)
            attn_k.WIDE_CFG = saved[2]
        del x
        torch.cuda.empty_cache()
    # the selection in one program per token against candidates gathered by several, and the maxima
    # tile size
    for b in (1, 8):
        x = Decode(ctx, b)
        group = f"decode indexer {ctx // 1024}K B={b}"
        split_saved = (idx_k.SPLIT_MIN_TILES, idx_k.SELECT_GROUPS, idx_k.SPLIT_CFG, idx_k.TILES_PER_TOPK)
        timed(group, "default", x.indexer)
        for label, attr, value in [
                ("select in one program", "SPLIT_MIN_TILES", 1 << 30),
                ("select groups=8", "SELECT_GROUPS", 8), ("select groups=32", "SELECT_GROUPS", 32),
                ("gather BLOCK=1024 warps=4", "SPLIT_CFG", dict(split_saved[2], gather=dict(BLOCK=1024, num_warps=4))),
                ("final CB=64 warps=8", "SPLIT_CFG", dict(split_saved[2], final=dict(CB=64, num_warps=8))),
                ("maxima tile 32", "TILES_PER_TOPK", 16), ("maxima tile 16", "TILES_PER_TOPK", 32)]:
            setattr(idx_k, attr, value)
            timed(group, label, x.indexer)
            (idx_k.SPLIT_MIN_TILES, idx_k.SELECT_GROUPS, idx_k.SPLIT_CFG, idx_k.TILES_PER_TOPK) = split_saved
        del x
        torch.cuda.empty_cache()
    for b in (1, 8):
        x = Decode(ctx, b)
        for kind in ("csa", "hca"):
            fn = x.csa if kind == "csa" else x.hca
            group = f"decode {kind} attn {ctx // 1024}K B={b}"
            timed(group, "default", fn)
            for cfg in [(16, 32, s, 8, 2) for s in (32, 64, 128, 256)] + \
                       [(16, 32, 32, 8, 1), (16, 32, 32, 4, 2), (16, 16, 32, 4, 2), (16, 16, 16, 4, 2)] + \
                       [(64, 32, s, 8, 1) for s in (32, 64, 128, 256, 512, 1024)] + \
                       [(64, 16, 512, 8, 1), (64, 64, 512, 8, 1)]:
                timed(group, str(cfg), lambda cfg=cfg: fn(cfg))
        group = f"decode indexer {ctx // 1024}K B={b}"
        saved = (dict(idx_k.DECODE_CFG), dict(idx_k.SELECT_CFG), idx_k.PROGRAMS_PER_SM)
        for bn, nw, ns in [(64, 4, 1), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3)]:
            idx_k.DECODE_CFG.update(BN=bn, num_warps=nw, num_stages=ns)
            timed(group, f"score BN={bn} warps={nw} stages={ns}", x.indexer)
        idx_k.DECODE_CFG.update(saved[0])
        for pps in (2, 8, 16):
            idx_k.PROGRAMS_PER_SM = pps
            timed(group, f"score programs/SM={pps}", x.indexer)
        idx_k.PROGRAMS_PER_SM = saved[2]
        for upd in [dict(TAU_LEVELS=2), dict(TAU_LEVELS=4), dict(TB=32), dict(num_warps=8, TB=32),
                    dict(BLOCK=2048, TB=32, num_warps=8), dict(num_warps=32, TB=128)]:
            idx_k.SELECT_CFG.update(upd)
            timed(group, f"select {upd}", x.indexer)
            idx_k.SELECT_CFG.update(saved[1])
        del x
        torch.cuda.empty_cache()
    x = Prefill(prefill_ctx, prefill_t)
    for fmt in ("bf16", "fp8"):
        for kind in ("csa", "hca"):
            fn = x.csa if kind == "csa" else x.hca
            flops = x.csa_flops if kind == "csa" else x.hca_flops
            rows = W + (TOPK if kind == "csa" else prefill_ctx // 128)
            for bn, nw, ns in [(32, 8, 2), (32, 8, 1), (32, 8, 3), (16, 8, 2), (64, 8, 2), (64, 8, 1), (32, 4, 2)]:
                cfg = (64, bn, triton.cdiv(rows, bn) * bn, nw, ns)
                timed(f"prefill {kind} {fmt} {prefill_t} tok", str(cfg), lambda cfg=cfg, fn=fn: fn(fmt, cfg),
                      graph=False, flops=flops)
    for r in out:
        if r.get("flops") and r["us"]:
            r["tflops"] = r["flops"] / r["us"] / 1e6
    return out


def table(rows: list) -> str:
    out = ["| phase | context | batch | what | µs | bytes (design) | GB/s | % HBM | TFLOP/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
    for r in rows:
        out.append(f"| {r['phase']} | {r['ctx'] // 1024}K | {r['batch']} | {r['what']} | {f(r['us'], '.1f')} | "
                   f"{f(r.get('bytes'), ',')} | {f(r.get('gbs'), '.0f')} | {f(r.get('hbm_pct'), '.1f')} | "
                   f"{f(r.get('tflops'), '.0f')} |")
    return "\n".join(out)


def sweep_table(rows: list) -> str:
    out = ["| group | launch shape | µs | TFLOP/s |", "|---|---|---|---|"]
    for r in rows:
        us = "—" if r["us"] is None else f"{r['us']:.1f}"
        tf = f"{r['tflops']:.0f}" if r.get("tflops") else "—"
        out.append(f"| {r['group']} | {r['config']} | {us} | {tf} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,131072,1048576")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefill-context", type=int, default=131072)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--sweep", action="store_true", help="time launch shapes against each other afterwards")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which the sweep stops")
    ap.add_argument("--profile-step", default=None, metavar="CTX,B",
                    help="only run the CSA and HCA decode steps at this context and batch (3 times each, eager), "
                         "for a kernel profiler such as ncu; times nothing")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.profile_step:
        ctx, b = (int(v) for v in args.profile_step.split(","))
        x = Decode(ctx, b)
        for _ in range(3):
            x.csa_step()
            x.hca()
        torch.cuda.synchronize()
        return
    out_dir = os.environ.get("OUT")
    head = (f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
            f"{datetime.date.today().isoformat()} · python benchmarks/attention.py")
    rows: list = []

    def save():
        """Results so far (written after every section, so a run cut short keeps what it measured)."""
        if out_dir:
            with open(os.path.join(out_dir, "attention.json"), "w") as fh:
                json.dump(dict(machine=head, host=platform.node(), rows=rows), fh, indent=1)
            with open(os.path.join(out_dir, "attention.md"), "w") as fh:
                fh.write(head + "\n\n" + table(rows) + "\n")

    for ctx in [int(c) for c in args.contexts.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            print(f"decode ctx={ctx} batch={b} ({time.time() - T0:.0f} s)", flush=True)
            n = len(rows)
            decode_rows(ctx, b, rows)
            print("\n".join(table(rows[n:]).split("\n")[2:]), flush=True)
            save()
    print(f"prefill ({time.time() - T0:.0f} s)", flush=True)
    prefill_rows(args.prefill_context, args.prefill_tokens, rows)
    save()
    if args.sweep:
        print(f"sweep ({time.time() - T0:.0f} s, budget {args.budget:.0f} s)", flush=True)
        sw = sweep(args.budget, max(int(c) for c in args.contexts.split(",")), args.prefill_context,
                   args.prefill_tokens)
        if out_dir:
            with open(os.path.join(out_dir, "sweep.json"), "w") as fh:
                json.dump(dict(machine=head, rows=sw), fh, indent=1)
            with open(os.path.join(out_dir, "sweep.md"), "w") as fh:
                fh.write(head + " --sweep\n\n" + sweep_table(sw) + "\n")
    print(head + "\n\n" + table(rows))
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
