"""Every kernel against its reference on the GPU at V4-Flash shapes: 64 heads × 512 (rope 64),
indexer 64 × 128, top-512, window 128, 584-B fp8 and 68-B FP4 entries; bf16 inputs."""

import pytest
import torch

from hybridkv.ops.compress import triton as compress_k
from hybridkv.ops.compress.reference import finish_entries, softmax_pool
from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.indexer_topk import reference as idx_ref
from hybridkv.ops.indexer_topk import triton as idx_k
from hybridkv.ops.kv_formats import (index_rows_to_blocks, pack_index_fp4, pack_main_fp8, unpack_index_fp4,
                                     unpack_main_fp8)
from hybridkv.ops.mhc import reference as mhc_ref
from hybridkv.ops.mhc import triton as mhc_k
from hybridkv.ops.paged import PagedBatch, entry_rows
from hybridkv.ops.quant import fp4_round_trip, fp8_round_trip
from hybridkv.ops.rope import rope_freqs, yarn_inv_freq
from hybridkv.ops.sparse_attn import reference as attn_ref
from hybridkv.ops.sparse_attn import triton as attn_k
from hybridkv.ops.sparse_attn.reference import gather_paged

DEV = "cuda"
H, D, ROPE, HI, DI, TOPK, W = 64, 512, 64, 64, 128, 512, 128


def rel_rms(ref, out):
    ref, out = ref.double(), out.double()
    assert torch.isfinite(out).all()
    return float((ref - out).square().mean().sqrt() / ref.square().mean().sqrt())


def main_entries(n, fmt):
    x = torch.randn(n, D, device=DEV)
    x = torch.cat([fp8_round_trip(x[:, :-ROPE], 64), x[:, -ROPE:]], 1).bfloat16()
    return pack_main_fp8(x.float(), ROPE) if fmt == "fp8" else x


def batch_for(segments, block_tokens=128):
    """segments: (start_pos, length); blocks handed out in a shuffled order."""
    need = [(s + n + block_tokens - 1) // block_tokens for s, n in segments]
    perm = torch.randperm(sum(need)).tolist()
    items, a = [], 0
    for r, ((s, n), k) in enumerate(zip(segments, need)):
        items.append((r, s, n, perm[a:a + k]))
        a += k
    return PagedBatch.build(items, block_tokens, DEV), sum(need)


SPARSE_CASES = {
    "csa-decode": [(65535 - 7 * i, 1) for i in range(8)],
    "hca-decode": [(4 * 65536 - 1, 1), (65536 + 5, 1)],
    "hca-decode-1m": [(2**20 - 1, 1), (300000, 1), (5000, 1)],               # 16-head programs, many pieces
    "hca-decode-1m-b8": [(2**20 - 1 - 999 * i, 1) for i in range(8)],        # whole-head programs
    "csa-prefill": [(65536, 512)],
    "hca-prefill": [(65536 + 7, 300)],
}


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_attn(fmt, case):
    segs = SPARSE_CASES[case]
    ratio = 128 if case.startswith("hca") else 4
    batch, nblk = batch_for(segs)
    t = batch.num_tokens
    q = torch.randn(t, H, D, device=DEV).bfloat16()
    new_kv, ring = main_entries(t, fmt), main_entries(len(segs) * W, fmt).view(len(segs), W, -1)
    pool = main_entries(nblk * 128 // ratio, fmt).view(nblk, 128 // ratio, -1)
    idx = None
    if ratio == 4:
        vis = (batch.positions.long() + 1) // 4
        idx = (torch.rand(t, TOPK, device=DEV) * vis.unsqueeze(1)).long()
        idx[:, -3:] = -1
    sink = torch.randn(H, device=DEV)
    kw = dict(fmt=fmt, head_dim=D, rope_dim=ROPE, window=W)
    out = attn_k.sparse_attn_paged(q, sink, D ** -0.5, batch, new_kv, ring, pool, idx, ratio if idx is None else 4,
                                   **kw)
    rows, index = gather_paged(batch, new_kv, ring, pool, idx, ratio if idx is None else 4, **kw)
    ref = attn_ref.sparse_attn(q.float(), rows, index, sink, D ** -0.5)
    assert rel_rms(ref, out) <= 1e-2


@pytest.mark.parametrize("case", ["csa-decode", "hca-decode"])
def test_bf16_partials_merge_like_float32_ones(case, monkeypatch):
    """bf16 queries: a split decode stores its partial outputs in bf16; the merged output stays within
    a bf16 step (relative RMS) of the one merged from float32 partials."""
    segs = SPARSE_CASES[case]
    batch, nblk = batch_for(segs)
    t = batch.num_tokens
    q = torch.randn(t, H, D, device=DEV).bfloat16()
    new_kv, ring = main_entries(t, "fp8"), main_entries(len(segs) * W, "fp8").view(len(segs), W, -1)
    ratio = 128 if case.startswith("hca") else 4
    pool = main_entries(nblk * 128 // ratio, "fp8").view(nblk, 128 // ratio, -1)
    idx = None
    if ratio == 4:
        idx = (torch.rand(t, TOPK, device=DEV) * ((batch.positions.long() + 1) // 4).unsqueeze(1)).long()
    sink = torch.randn(H, device=DEV)
    kw = dict(fmt="fp8", head_dim=D, rope_dim=ROPE, window=W, cfg=(64, 64, 128, 8, 1))
    run = lambda: attn_k.sparse_attn_paged(q, sink, D ** -0.5, batch, new_kv, ring, pool, idx,  # noqa: E731
                                           ratio, **kw)
    monkeypatch.setattr(attn_k, "PARTIALS_IN_BF16", False)
    f32 = run()
    monkeypatch.setattr(attn_k, "PARTIALS_IN_BF16", True)
    b16 = run()
    assert not torch.equal(b16, f32)
    assert rel_rms(f32, b16) <= 2.0**-8


INDEXER_CASES = {
    "decode": [(65535 - 1000 * i, 1) for i in range(4)],
    "decode-long": [(2**20 - 1, 1), (524287 + 13, 1), (140000, 1)],           # ≥ topk tiles: the τ₀ bound
    "prefill": [(32768, 256)],
    "prefill-long": [(262144, 96)],
}


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
@pytest.mark.parametrize("case", list(INDEXER_CASES))
def test_indexer_topk(fmt, case):
    segs = INDEXER_CASES[case]
    batch, nblk = batch_for(segs)
    t = batch.num_tokens
    q = fp4_round_trip(hadamard_transform(torch.randn(t, HI, DI, device=DEV)), 32).bfloat16()
    w = torch.randn(t, HI, device=DEV) * HI ** -0.5
    keys = fp4_round_trip(hadamard_transform(torch.randn(nblk * 32, DI, device=DEV)), 32)
    pool = index_rows_to_blocks(pack_index_fp4(keys).view(nblk, 32, -1), DI) if fmt == "fp4" else \
        keys.bfloat16().view(nblk, 32, -1)
    idx = idx_k.indexer_topk_paged(q, w, batch, pool, TOPK, 4, fmt, DI, fp4_queries=True).long()
    vis = (batch.positions.long() + 1) // 4
    n = int(vis.max())
    for tok in range(0, t, max(1, t // 16)):
        cols = torch.arange(n, device=DEV)
        rows = entry_rows(batch, torch.full_like(cols, int(batch.token_req[tok])), cols, 32)
        s = idx_ref.index_scores(q[tok:tok + 1].float(), w[tok:tok + 1], keys[rows])[0, : int(vis[tok])]
        sel = idx[tok][idx[tok] >= 0]
        assert sel.numel() == min(TOPK, int(vis[tok])) and sel.unique().numel() == sel.numel()
        got = s[sel].sort(descending=True).values
        want = s.topk(sel.numel()).values
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
        assert torch.equal(sel, sel.sort().values)                                   # ascending entry order


def _fp4_index_pool(nblk, spread=False):
    """FP4 indexer keys (float32 values and their packed pool); `spread`: each key's 32-blocks scaled
    by 2^-k, k from 0 to 20 across the keys (the scoring kernel's scale tables and their rounding)."""
    x = hadamard_transform(torch.randn(nblk * 32, DI, device=DEV))
    if spread:
        k = torch.arange(x.shape[0], device=DEV) % 21
        blk = torch.arange(DI, device=DEV) // 32
        x = x * torch.exp2(-(k[:, None] * (blk[None, :] == (torch.arange(x.shape[0], device=DEV) % 4)[:, None])))
    keys = fp4_round_trip(x, 32)
    return keys, index_rows_to_blocks(pack_index_fp4(keys).view(nblk, 32, -1), DI)


@pytest.mark.parametrize("heads,qdtype,wdtype,spread,qspread", [(64, torch.bfloat16, torch.float32, False, False),
                                                                 (64, torch.bfloat16, torch.float32, True, False),
                                                                 (64, torch.bfloat16, torch.float32, False, True),
                                                                 (32, torch.float32, torch.bfloat16, True, False),
                                                                 (12, torch.bfloat16, torch.float32, False, False)])
def test_indexer_mma_scoring(heads, qdtype, wdtype, spread, qspread, monkeypatch):
    """The decode scoring of FP4 keys and queries on the integer tensor cores (`score_mma`) against
    float64 scores of the same queries and keys and against the Triton kernel; each tile maximum is
    its keys' largest, and nothing past a row's visible entries is written. `spread`: key blocks up to
    20 binades below their key's largest (the block-by-block path); `qspread`: one query head's block
    8 binades below the others (every subtile block by block)."""
    from hybridkv.ops.indexer_topk import score_mma
    monkeypatch.setenv("HYBRIDKV_INDEXER_MMA", "1")
    segs = [(2**20 - 1, 1), (70000 + 3, 1), (5000, 1), (100, 1), (7, 1)]
    batch, nblk = batch_for(segs)
    t = batch.num_tokens
    x = hadamard_transform(torch.randn(t, heads, DI, device=DEV))
    if qspread:
        x[:, heads // 2, 64:96] *= 2.0 ** -8
    q = fp4_round_trip(x, 32).to(qdtype)
    w = (torch.randn(t, heads, device=DEV) * heads ** -0.5).to(wdtype)
    keys, pool = _fp4_index_pool(nblk, spread)
    flat, fp4, words, epb, n_max = idx_k._paged_pool(q, batch, pool, 4, "fp4", DI, None)
    assert fp4 and words and score_mma.usable(q, w, DI, words, epb, batch.block_tables, batch.token_req,
                                              batch.positions)
    vis = (batch.positions.long() + 1) // 4
    common = (flat, flat.stride(0), batch.block_tables, batch.block_tables.stride(0), batch.token_req,
              batch.positions)
    for per_max in (64, 32, 16):
        sentinel = 0x5A5A5A5A
        out = torch.full((t, n_max), sentinel, dtype=torch.int32, device=DEV)
        tmax = torch.full((t, -(-n_max // per_max)), sentinel, dtype=torch.int32, device=DEV)
        idx_k._score_decode(q, w, common, out, tmax, n_max, per_max, DI, True, True, True, epb, 4, True)
        u = out.long() & 0xFFFFFFFF
        for tok in range(t):
            v = int(vis[tok])
            assert (out[tok, v:] == sentinel).all()
            tiles = -(-v // per_max)
            assert (tmax[tok, tiles:] == sentinel).all()
            pad = torch.nn.functional.pad(u[tok, :v], (0, tiles * per_max - v))
            assert torch.equal(tmax[tok, :tiles].long() & 0xFFFFFFFF, pad.view(tiles, per_max).amax(1))
    got = idx_k.paged_scores(q, w, batch, pool, 4, "fp4", DI, fp4_queries=True)
    monkeypatch.setenv("HYBRIDKV_INDEXER_MMA", "0")
    tri = idx_k.paged_scores(q, w, batch, pool, 4, "fp4", DI, fp4_queries=True)
    worst = {"mma": 0.0, "triton": 0.0}
    for tok in range(t):
        v = int(vis[tok])
        cols = torch.arange(v, device=DEV)
        rows = entry_rows(batch, torch.full_like(cols, int(batch.token_req[tok])), cols, 32)
        s = torch.einsum("hd,nd->hn", q[tok].double(), keys[rows].double()).relu()
        ref = (s * w[tok].double()[:, None]).sum(0)
        scale = float(ref.abs().max())
        worst["mma"] = max(worst["mma"], float((got[tok, :v].double() - ref).abs().max()) / scale)
        worst["triton"] = max(worst["triton"], float((tri[tok, :v].double() - ref).abs().max()) / scale)
    print(f"indexer scoring, largest error / row's largest score: {worst}")
    assert worst["mma"] <= 1e-5


def test_kernels_batch_invariant():
    """A decode token's top-k and attention output do not depend on its batch in deterministic mode
    (the top-k never does: every score is one MMA row whatever the chunking)."""
    from hybridkv.ops.backend import deterministic
    segs = [(2**20 - 1 - 4099 * i, 1) for i in range(8)]
    batch, nblk = batch_for(segs)
    q = torch.randn(8, H, D, device=DEV).bfloat16()
    qi = fp4_round_trip(hadamard_transform(torch.randn(8, HI, DI, device=DEV)), 32).bfloat16()
    wi = torch.randn(8, HI, device=DEV) * HI ** -0.5
    ipool = pack_index_fp4(fp4_round_trip(hadamard_transform(torch.randn(nblk * 32, DI, device=DEV)), 32))
    ipool = index_rows_to_blocks(ipool.view(nblk, 32, -1), DI)
    new_kv, ring = main_entries(8, "fp8"), main_entries(8 * W, "fp8").view(8, W, -1)
    pool, hpool = main_entries(nblk * 32, "fp8").view(nblk, 32, -1), main_entries(nblk, "fp8").view(nblk, 1, -1)
    sink = torch.randn(H, device=DEV)
    kw = dict(fmt="fp8", head_dim=D, rope_dim=ROPE, window=W)

    def run(rows, b):
        idx = idx_k.indexer_topk_paged(qi[rows], wi[rows], b, ipool, TOPK, 4, "fp4", DI, fp4_queries=True)
        csa = attn_k.sparse_attn_paged(q[rows], sink, D ** -0.5, b, new_kv[rows], ring, pool, idx, 4, **kw)
        hca = attn_k.sparse_attn_paged(q[rows], sink, D ** -0.5, b, new_kv[rows], ring, hpool, None, 128, **kw)
        return idx, csa, hca

    one = PagedBatch(batch.token_req[:1], batch.positions[3:4], batch.slots[3:4], batch.block_tables[3:4],
                     batch.seg_start[3:4], batch.seg_row0[:1], 128)
    full = run(slice(0, 8), batch)
    alone = run(slice(3, 4), one)
    assert torch.equal(full[0][3:4], alone[0])
    with deterministic():
        full = run(slice(0, 8), batch)
        alone = run(slice(3, 4), one)
    for a, b in zip(full, alone):
        assert torch.equal(a[3:4], b)


@pytest.mark.parametrize("kind,L", [("main", 8), ("main", 128), ("index", 8)])
def test_compress(kind, L):
    n = 4096 if L == 8 else 256
    d = D if kind == "main" else DI
    kv, score = torch.randn(n, L, d, device=DEV), torch.randn(n, L, d, device=DEV)
    w = 1 + 0.1 * torch.randn(d, device=DEV)
    j = torch.arange(n, device=DEV)
    freqs = rope_freqs(j * L, yarn_inv_freq(ROPE, 160000.0, 16, 65536, 32, 1).to(DEV))
    ref = finish_entries(softmax_pool(kv, score), w, 1e-6, freqs, kind, torch.bfloat16).float()
    ebytes = 584 if kind == "main" else 68
    out = torch.zeros(n, ebytes, dtype=torch.uint8, device=DEV)
    compress_k.compress_write(kv, score, w, 1e-6, freqs.real, freqs.imag, kind, out, True,
                              j.to(torch.int32), out_bf16=True)
    got = unpack_main_fp8(out, D, ROPE) if kind == "main" else unpack_index_fp4(out, DI)
    assert rel_rms(ref, got) <= 1e-2


def test_mhc():
    t, hc, dim = 64, 4, 4096
    x = torch.randn(t, hc, dim, device=DEV).bfloat16()
    fn = torch.randn(24, hc * dim, device=DEV) * 0.01
    scale, base = torch.rand(3, device=DEV) + 0.5, torch.randn(24, device=DEV) * 0.1
    mixes = x.flatten(1).float() @ fn.T
    y_ref, post_ref, comb_ref = mhc_ref.mhc_pre(x, mixes, scale, base, 20, 1e-6, 1e-6)
    y, post, comb = mhc_k.mhc_pre(x, mixes, scale, base, 20, 1e-6, 1e-6)
    assert rel_rms(y_ref.float(), y.float()) <= 1e-2 and rel_rms(comb_ref, comb) <= 1e-4
    f = torch.randn(t, dim, device=DEV).bfloat16()
    assert rel_rms(mhc_ref.mhc_post(f, x, post_ref, comb_ref).float(), mhc_k.mhc_post(f, x, post, comb).float()) <= 1e-2
