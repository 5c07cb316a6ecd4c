"""The sparse attention kernels against the plain-torch reference (fp32, small shapes)."""

import pytest
import torch
import triton
import triton.language as tl

from helpers import random_batch, random_entries, rel_rms
from hybridkv.ops.sparse_attn import reference
from hybridkv.ops.sparse_attn import triton as attn_triton
from hybridkv.ops.sparse_attn.reference import gather_paged


@pytest.fixture(scope="module")
def kernels():
    from hybridkv.ops.sparse_attn import triton as k
    return k


SPLIT_CFG = (16, 16, 24, 4, 1)      # (BLOCK_H, BLOCK_N, split rows, warps, stages): pieces end mid-tile


@pytest.mark.parametrize("n_idx,cfg,d", [(24, None, 64), (90, None, 64), (90, SPLIT_CFG, 64),
                                         (130, (16, 16, 16, 4, 1), 64), (40, None, 96), (90, SPLIT_CFG, 96),
                                         (90, SPLIT_CFG, 48)],
                         ids=["one-piece", "one-piece-long", "split-partial-tiles", "many-pieces", "d96", "d96-split",
                              "d48-split"])
def test_contiguous_matches_reference(kernels, device, n_idx, cfg, d):
    g = torch.Generator().manual_seed(0)
    t, h, n = 5, 4, 50
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(n, d, generator=g)
    idx = torch.randint(0, n, (t, n_idx), generator=g)
    idx[torch.rand(t, n_idx, generator=g) < 0.3] = -1
    idx[0] = -1                                           # a token with nothing but the sink
    sink = torch.randn(h, generator=g)
    ref = reference.sparse_attn(q, kv, idx, sink, 0.125)
    out = kernels.sparse_attn(q.to(device), kv.to(device), idx.to(device), sink.to(device), 0.125, cfg=cfg).cpu()
    assert rel_rms(ref, out) <= 1e-3
    assert torch.allclose(out[0], torch.zeros_like(out[0]))


def test_merge_over_several_blocks_of_pieces(kernels, device):
    """More pieces than two merge blocks, the largest scores in the last block and one block of pieces
    with no valid row: the running maximum of the merge must rescale what it has summed."""
    g = torch.Generator().manual_seed(1)
    bs = kernels.COMBINE_CFG["BLOCK_S"]
    cfg = (16, 16, 16, 4, 1)
    n_idx = 16 * (2 * bs + 3)
    t, h, n, d = 3, 4, 64, 64
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(n, d, generator=g)
    kv[n - 8:] *= 4.0                                      # rows with large scores for some heads
    idx = torch.randint(0, n - 8, (t, n_idx), generator=g)
    idx[:, -16:] = torch.arange(n - 16, n)                  # ...read in the last piece
    idx[1, 16 * bs:16 * (bs + 1)] = -1                      # token 1: a whole piece without rows
    sink = torch.randn(h, generator=g)
    ref = reference.sparse_attn(q, kv, idx, sink, 0.125)
    out = kernels.sparse_attn(q.to(device), kv.to(device), idx.to(device), sink.to(device), 0.125, cfg=cfg).cpu()
    assert rel_rms(ref, out) <= 1e-3


def _paged_case(kind: str, fmt: str, device: str, segments, seed=0):
    g = torch.Generator().manual_seed(seed)
    d, rope, h, window, bt = 128, 64, 4, 16, 16
    ratio = {"swa": 0, "csa": 4, "hca": 16}[kind]
    batch = random_batch(segments, num_blocks=24, block_tokens=bt, num_slots=5, gen=g)
    t = batch.num_tokens
    q = torch.randn(t, h, d, generator=g)
    new_kv = random_entries(t, d, rope, fmt, g)
    ring = random_entries(5 * window, d, rope, fmt, g).reshape(5, window, -1)
    pool = idx = None
    if ratio:
        epb = bt // ratio
        pool = random_entries(24 * epb, d, rope, fmt, g, pool=True).reshape(24, epb, -1)
    if kind == "csa":
        vis = (batch.positions.long() + 1) // ratio
        k = 60
        idx = torch.stack([torch.randint(0, max(int(v), 1), (k,), generator=g) for v in vis.tolist()])
        idx = torch.where((idx < vis.unsqueeze(1)) & (torch.rand(t, k, generator=g) < 0.8), idx, -1)
    sink = torch.randn(h, generator=g)
    return batch, q, new_kv, ring, pool, idx, ratio, sink, dict(fmt=fmt, head_dim=d, rope_dim=rope, window=window)


SEGMENTS = [(0, 5), (37, 1), (70, 9), (200, 1)]   # a first chunk, decodes, a later chunk that crosses the ring


@pytest.mark.parametrize("cfg", [None, SPLIT_CFG, (64, 16, 24, 4, 1)], ids=["default", "split", "split-64-heads"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "v41"])
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_paged_matches_reference(kernels, device, kind, fmt, cfg):
    batch, q, new_kv, ring, pool, idx, ratio, sink, kw = _paged_case(kind, fmt, device, SEGMENTS)
    rows, index = gather_paged(batch, new_kv, ring, pool, idx, ratio, **kw)
    ref = reference.sparse_attn(q, rows, index, sink, 0.1)
    dv = lambda x: None if x is None else x.to(device)  # noqa: E731
    out = kernels.sparse_attn_paged(q.to(device), sink.to(device), 0.1, batch.to(device), dv(new_kv), dv(ring),
                                    dv(pool), dv(idx), ratio, cfg=cfg, **kw).cpu()
    assert rel_rms(ref, out) <= 1e-3


def test_deterministic_token_does_not_depend_on_batch(kernels, device):
    """Deterministic mode: a token's output bits are the same alone and inside a batch of others."""
    from hybridkv.ops.backend import deterministic
    from hybridkv.ops.paged import PagedBatch
    batch, q, new_kv, ring, pool, idx, ratio, sink, kw = _paged_case("hca", "fp8", device, [(37, 1), (200, 1), (90, 1)])
    dv = lambda x: x.to(device)  # noqa: E731
    with deterministic():
        full = kernels.sparse_attn_paged(dv(q), dv(sink), 0.1, batch.to(device), dv(new_kv), dv(ring), dv(pool), None,
                                         ratio, max_pos=199, **kw).cpu()
        one = PagedBatch(*(getattr(batch, f)[i] for f, i in (("token_req", slice(0, 1)), ("positions", slice(1, 2)),
                                                                ("slots", slice(1, 2)), ("block_tables", slice(1, 2)),
                                                                ("seg_start", slice(1, 2)), ("seg_row0", slice(0, 1)))),
                         block_tokens=batch.block_tokens)
        alone = kernels.sparse_attn_paged(dv(q[1:2]), dv(sink), 0.1, one.to(device), dv(new_kv[1:2]), dv(ring),
                                          dv(pool), None, ratio, max_pos=199, **kw).cpu()
    assert torch.equal(full[1:2], alone)


def test_paged_prefill_configuration(kernels, device, monkeypatch):
    """The many-token configuration (one piece per token, 64-head blocks) computes the same thing."""
    monkeypatch.setattr(kernels, "_config", lambda t, rows, h, dev, fp8=False: (16, 32, max(32, -(-rows // 32) * 32), 4, 1))
    batch, q, new_kv, ring, pool, idx, ratio, sink, kw = _paged_case("hca", "fp8", device, [(100, 3), (5, 2)], seed=3)
    rows, index = gather_paged(batch, new_kv, ring, pool, idx, ratio, **kw)
    ref = reference.sparse_attn(q, rows, index, sink, 0.1)
    out = kernels.sparse_attn_paged(q.to(device), sink.to(device), 0.1, batch.to(device), new_kv.to(device),
                                    ring.to(device), pool.to(device), None, ratio, **kw).cpu()
    assert rel_rms(ref, out) <= 1e-3


@pytest.mark.parametrize("cfg", [None, SPLIT_CFG], ids=["default", "split"])
def test_output_in_bf16_is_the_float32_output_rounded(kernels, device, cfg):
    """`out_dtype`: the kernels store the float32 result rounded once (directly, or by the split's
    combine): on the GPU bit for bit what rounding their float32 output gives; Triton's interpreter
    rounds toward zero when it stores bf16, so there within one bf16 step."""
    batch, q, new_kv, ring, pool, idx, ratio, sink, kw = _paged_case("csa", "fp8", device, SEGMENTS)
    dv = lambda x: None if x is None else x.to(device)  # noqa: E731
    args = (q.to(device), sink.to(device), 0.1, batch.to(device), dv(new_kv), dv(ring), dv(pool), dv(idx), ratio)
    f32 = kernels.sparse_attn_paged(*args, cfg=cfg, **kw)
    b16 = kernels.sparse_attn_paged(*args, cfg=cfg, out_dtype=torch.bfloat16, **kw)
    assert b16.dtype == torch.bfloat16
    if device == "cuda":
        assert torch.equal(b16.cpu(), f32.cpu().bfloat16())
    else:
        assert ((b16.cpu().float() - f32.cpu()).abs() <= f32.cpu().abs() * 2.0**-7).all()


@pytest.mark.parametrize("cfg", [None, SPLIT_CFG], ids=["default", "split"])
def test_output_written_over_the_queries(kernels, device, cfg):
    """`out=q`: each program reads its token's query heads before it writes their output, so the
    result written over q is the result written to a new tensor, bit for bit."""
    batch, q, new_kv, ring, pool, idx, ratio, sink, kw = _paged_case("csa", "fp8", device, SEGMENTS)
    dv = lambda x: None if x is None else x.to(device)  # noqa: E731
    qd = q.to(device).contiguous()
    args = (sink.to(device), 0.1, batch.to(device), dv(new_kv), dv(ring), dv(pool), dv(idx), ratio)
    fresh = kernels.sparse_attn_paged(qd, *args, cfg=cfg, **kw)
    over = kernels.sparse_attn_paged(qd, *args, cfg=cfg, out=qd, **kw)
    assert over.data_ptr() == qd.data_ptr() and torch.equal(over.cpu(), fresh.cpu())


def test_public_function_on_cpu_is_the_reference():
    from hybridkv.ops.sparse_attn import sparse_attn_paged
    batch, q, new_kv, ring, pool, idx, ratio, sink, kw = _paged_case("csa", "fp8", "cpu", SEGMENTS)
    rows, index = gather_paged(batch, new_kv, ring, pool, idx, ratio, **kw)
    assert torch.equal(sparse_attn_paged(q, sink, 0.1, batch, new_kv, ring, pool, idx, ratio, **kw),
                       reference.sparse_attn(q, rows, index, sink, 0.1))


@triton.jit
def _decode(WORDS, s_row, OUT, D: tl.constexpr, ROPE: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BN)
    kv = attn_triton._load_rows(WORDS + rows * s_row, rows >= 0, D, ROPE, True, tl.float32)
    tl.store(OUT + rows[:, None] * D + tl.arange(0, D)[None, :], kv)


@pytest.mark.parametrize("d", [128, 512])
def test_fp8_entry_decoding_is_exact(device, d):
    """Packed 584-B-style entries decode bit-exactly (all e4m3 codes but NaN, a spread of scales, bf16 rope)."""
    from hybridkv.ops.kv_formats import unpack_main_fp8
    g = torch.Generator().manual_seed(7)
    rope, n = 64, 16
    buf = random_entries(n, d, rope, "fp8", g)
    nope = d - rope
    codes = torch.arange(nope * n) % 256
    codes[(codes & 0x7F) == 0x7F] = 0                                       # e4m3 NaN codes
    buf[:, :nope] = codes.view(n, nope).to(torch.uint8)
    buf[:, nope + 2 * rope:nope + 2 * rope + nope // 64] = torch.randint(110, 140, (n, nope // 64), dtype=torch.uint8,
                                                                         generator=g)
    out = torch.empty(n, d, device=device)
    words = buf.view(torch.int32)
    _decode[(1,)](words.to(device), words.shape[1], out, D=d, ROPE=rope, BN=n)
    assert torch.equal(out.cpu(), unpack_main_fp8(buf, d, rope))


@triton.jit
def _decode_v41(BYTES, s_row, OUT, D: tl.constexpr, BN: tl.constexpr, POOL_ROWS: tl.constexpr):
    rows = tl.arange(0, BN)
    kv = attn_triton._load_rows(BYTES + rows * s_row, rows >= 0, D, 0, 2, tl.float32, D, POOL_ROWS)
    tl.store(OUT + rows[:, None] * D + tl.arange(0, D)[None, :], kv)


@pytest.mark.parametrize("pool", [False, True], ids=["window-row", "global-entry"])
def test_v41_row_decoding_is_exact(device, pool):
    """V4.1's packed rows decode bit-exactly: every e4m3 code but NaN (window rows) or every E2M1
    code (global entries), under a spread of scales."""
    from hybridkv.ops.kv_formats import unpack_v41_global, unpack_v41_window
    g = torch.Generator().manual_seed(8)
    d, n = 128, 16
    buf = random_entries(n, d, 0, "v41", g, pool=pool)
    if pool:
        buf[:, :d // 2] = (torch.arange(n * d // 2) % 256).view(n, d // 2).to(torch.uint8)
        scales = torch.exp2(torch.randint(-9, 8, (n, d // 16), generator=g).float()) * (
            1 + torch.randint(0, 8, (n, d // 16), generator=g) / 8)
        buf[:, d // 2:] = scales.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = torch.arange(n * d) % 256
        codes[(codes & 0x7F) == 0x7F] = 0
        buf[:, :d] = codes.view(n, d).to(torch.uint8)
        buf[:, d:] = torch.randint(110, 140, (n, d // 32), dtype=torch.uint8, generator=g)
    out = torch.empty(n, d, device=device)
    _decode_v41[(1,)](buf.view(torch.int8).to(device), buf.shape[1], out, D=d, BN=n, POOL_ROWS=pool)
    want = (unpack_v41_global if pool else unpack_v41_window)(buf, d)
    assert torch.equal(out.cpu(), want)
