"""Each reference op against the math it claims."""

import math

import pytest
import torch

from hybridkv.ops.compress import pool_blocks
from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.indexer_topk import candidate_blocks, causal_topk, index_scores
from hybridkv.ops.quant import (E2M1_VALUES, FP4_AMAX_FLOOR, FP8_AMAX_FLOOR, dequant_fp4_weight, dequant_fp8_weight,
                                e2m1_round, fp4_round_trip, fp8_round_trip, pack_fp4, pow2_scale, quant_fp4,
                                quant_fp8_weight, unpack_fp4)
from hybridkv.ops.rope import apply_rope, rope_freqs, yarn_inv_freq
from hybridkv.ops.sinkhorn import hc_split_sinkhorn
from hybridkv.ops.sparse_attn import sparse_attn


def test_pow2_scale_is_ceil_log2():
    amax = torch.tensor([448.0, 448.0 * 2, 1.0, 447.0, 449.0, 6.0, 1e-4])
    got = pow2_scale(amax, 448.0)
    expect = torch.tensor([2.0 ** math.ceil(math.log2(float(a) * (1 / 448))) for a in amax.tolist()])
    assert torch.equal(got, expect)
    assert torch.equal(pow2_scale(torch.tensor([6.0, 12.0, 7.0]), 6.0), torch.tensor([1.0, 2.0, 2.0]))
    # magnitudes the quantisers meet (down to their amax floors), powers of two and their
    # neighbours, against frexp
    g = torch.Generator().manual_seed(0)
    a = torch.cat([torch.exp2(torch.empty(20000).uniform_(-20, 20, generator=g)),
                   torch.exp2(torch.arange(-20.0, 21.0))])
    a = torch.cat([a, torch.nextafter(a, torch.tensor(0.0)), torch.nextafter(a, torch.tensor(1e30))])
    for qmax, floor in ((448.0, FP8_AMAX_FLOOR), (6.0, FP4_AMAX_FLOOR)):
        a = torch.cat([a, torch.tensor([floor])])
        x = a * torch.tensor(1.0 / qmax)
        mant, exp = torch.frexp(x)
        assert torch.equal(pow2_scale(a, qmax), torch.ldexp(torch.ones_like(x), torch.where(mant == 0.5, exp - 1, exp)))


def test_e2m1_round_ties_to_even():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, 7.0, -0.25, -2.5, 0.26])
    assert e2m1_round(v).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -2.0, 0.5]


def test_fp4_round_trip_values_on_grid():
    x = torch.randn(4, 64)
    y = fp4_round_trip(x, 32)
    blocks = y.view(4, 2, 32)
    scale = pow2_scale(x.view(4, 2, 32).abs().amax(-1), 6.0)
    codes = (blocks / scale.unsqueeze(-1)).abs()
    assert torch.isin(codes, E2M1_VALUES).all()
    assert (y - x).abs().max() <= scale.max() * 1.0  # at most half the widest gap (2) × scale


def test_fp8_round_trip_pow2_and_plain():
    x = torch.randn(3, 128) * 5
    y = fp8_round_trip(x, 64, pow2=True)
    s = pow2_scale(x.view(3, 2, 64).abs().amax(-1, keepdim=True), 448.0)
    assert torch.equal(y.view(3, 2, 64), (x.view(3, 2, 64) / s).to(torch.float8_e4m3fn).float() * s)
    z = fp8_round_trip(x, 64, pow2=False)
    assert (z - x).abs().max() < 0.07 * x.abs().max() and not torch.equal(y, z)


def test_fp4_pack_unpack_round_trip():
    vals = E2M1_VALUES[torch.randint(0, 8, (5, 64))] * torch.where(torch.rand(5, 64) < 0.5, -1.0, 1.0)
    packed = pack_fp4(vals)
    assert packed.dtype == torch.int8 and packed.shape == (5, 32)
    assert torch.equal(unpack_fp4(packed), vals)
    # low nibble holds the even element
    one = pack_fp4(torch.tensor([[0.5, 6.0]]))
    assert int(one.view(torch.uint8)) == (0x7 << 4) | 0x1


def test_fp8_weight_quant_dequant():
    w = torch.randn(200, 300)
    q, s = quant_fp8_weight(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float8_e8m0fnu
    back = dequant_fp8_weight(q, s, (128, 128))
    assert ((back - w).abs() / w.abs().clamp(min=1e-2)).median() < 0.05


def test_fp4_weight_dequant_uses_scale_per_32():
    vals = torch.ones(2, 64)
    s = torch.tensor([[1.0, 4.0], [0.5, 2.0]]).to(torch.float8_e8m0fnu)
    w = dequant_fp4_weight(pack_fp4(vals), s, 32)
    assert torch.equal(w[:, :32], torch.tensor([[1.0], [0.5]]).expand(2, 32))
    assert torch.equal(w[:, 32:], torch.tensor([[4.0], [2.0]]).expand(2, 32))


def test_hadamard_is_orthonormal():
    x = torch.randn(7, 64)
    y = hadamard_transform(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(hadamard_transform(y), x, atol=1e-5)  # H/sqrt(d) is its own inverse
    assert torch.allclose(hadamard_transform(torch.eye(4))[1], torch.tensor([1.0, -1, 1, -1]) / 2)


def test_rope_interleaved_and_inverse():
    inv = yarn_inv_freq(8, 10000.0)
    pos = torch.arange(5)
    f = rope_freqs(pos, inv)
    x = torch.randn(5, 3, 12)
    y = apply_rope(x, f)
    assert torch.equal(y[..., :4], x[..., :4])  # only the last 8 dims rotate
    # adjacent pairs rotate as complex numbers
    c = torch.complex(x[..., 4::2], x[..., 5::2]) * f.unsqueeze(1)
    assert torch.allclose(y[..., 4::2], c.real, atol=1e-6) and torch.allclose(y[..., 5::2], c.imag, atol=1e-6)
    assert torch.allclose(apply_rope(y, f, inverse=True), x, atol=1e-6)


def test_yarn_interpolates_low_frequencies_only():
    plain = yarn_inv_freq(64, 160000.0)
    yarn = yarn_inv_freq(64, 160000.0, factor=16, original_seq_len=65536, beta_fast=32, beta_slow=1)
    assert torch.equal(yarn[:4], plain[:4])              # high frequencies untouched
    assert torch.allclose(yarn[-1], plain[-1] / 16)       # lowest frequency divided by the factor


def test_sinkhorn_doubly_stochastic():
    mixes = torch.randn(10, 24)
    pre, post, comb = hc_split_sinkhorn(mixes, torch.tensor([1.0, 1.0, 1.0]), torch.zeros(24), 4, 20, 1e-6)
    assert ((pre > 0) & (pre < 1.01)).all() and ((post > 0) & (post < 2)).all()
    assert torch.allclose(comb.sum(-2), torch.ones(10, 4), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(10, 4), atol=1e-3)


def test_pool_blocks_overlap_matches_definition():
    d, r = 3, 4
    kv, score = torch.randn(2, r, 2 * d), torch.randn(2, r, 2 * d)
    prev_kv, prev_score = torch.zeros(r, 2 * d), torch.full((r, 2 * d), float("-inf"))
    out = pool_blocks(kv, score, True, prev_kv, prev_score)
    # block 0: only its own tokens through channels [d, 2d)
    w0 = score[0, :, d:].softmax(0)
    assert torch.allclose(out[0], (w0 * kv[0, :, d:]).sum(0))
    # block 1: block 0's tokens via [0, d) and its own via [d, 2d), one softmax over 8 rows
    rows_s = torch.cat([score[0, :, :d], score[1, :, d:]])
    rows_kv = torch.cat([kv[0, :, :d], kv[1, :, d:]])
    assert torch.allclose(out[1], (rows_s.softmax(0) * rows_kv).sum(0))


def test_causal_topk():
    scores = torch.tensor([[5.0, 4.0, 3.0, 9.0], [1.0, 7.0, 2.0, 0.0]])
    idx = causal_topk(scores, torch.tensor([2, 4]), 3)
    assert sorted(i for i in idx[0].tolist() if i >= 0) == [0, 1] and idx[0].tolist().count(-1) == 1
    assert idx[1].tolist() == [1, 2, 0]


def test_index_scores():
    q, w, k = torch.randn(3, 4, 8), torch.randn(3, 4), torch.randn(5, 8)
    expect = (torch.relu(torch.einsum("thd,nd->thn", q, k)) * w.unsqueeze(-1)).sum(1)
    assert torch.allclose(index_scores(q, w, k), expect)


@pytest.mark.parametrize("sink", [-2.0, 3.0])
def test_sparse_attn_matches_softmax_with_sink(sink):
    t, h, d, n = 3, 2, 8, 6
    q, kv = torch.randn(t, h, d), torch.randn(n, d)
    idx = torch.tensor([[0, 2, -1], [5, -1, -1], [1, 3, 4]])
    o = sparse_attn(q, kv, idx, torch.full((h,), sink), 0.5)
    for ti in range(t):
        sel = [i for i in idx[ti].tolist() if i >= 0]
        logits = torch.cat([(q[ti] @ kv[sel].T) * 0.5, torch.full((h, 1), sink)], dim=1)
        p = logits.softmax(-1)[:, :-1]
        assert torch.allclose(o[ti], p @ kv[sel], atol=1e-6)


def test_fp4_e4m3_scales():
    """V4.1 global KV: FP4 in blocks of 16 whose scale is e4m3(amax / 6), not a power of two."""
    x = torch.randn(3, 64) * 3
    q, s = quant_fp4(x, 16, "e4m3")
    amax = x.view(3, 4, 16).abs().amax(-1)
    assert torch.equal(s, (amax / 6).to(torch.float8_e4m3fn).float())
    assert torch.isin(q.abs(), E2M1_VALUES).all()
    y = fp4_round_trip(x, 16, "e4m3")
    assert torch.equal(y.view(3, 4, 16), q.view(3, 4, 16) * s.unsqueeze(-1))
    assert not torch.equal(y, fp4_round_trip(x, 16))  # differs from power-of-two scales
    tiny = torch.full((1, 16), 1e-6)  # amax is clamped at 6·2^-9: the scale stays a normal e4m3 value
    assert float(quant_fp4(tiny, 16, "e4m3")[1]) == 2.0**-9
    with pytest.raises(ValueError, match="unknown FP4 scale format"):
        quant_fp4(x, 16, "e5m2")


def test_causal_topk_by_position():
    scores = torch.tensor([[1.0, 9.0, 3.0, 7.0, 5.0], [4.0, 2.0, 8.0, 1.0, 0.0]])
    idx = causal_topk(scores, torch.tensor([5, 2]), 3, by_position=True)
    assert idx.tolist() == [[1, 3, 4], [0, 1, -1]]


def test_candidate_blocks():
    """Blocks score their best entry; the newest visible entry's block is always kept; a block with
    no visible entry never is; the mask covers whole blocks (cut at N)."""
    ninf = float("-inf")
    s = torch.tensor([[5.0, 1.0, 2.0, 2.0, 9.0, 0.0, 3.0, ninf, ninf, ninf]])  # visible 7, blocks of 2
    keep = candidate_blocks(s, torch.tensor([7]), 2, 2)
    # block scores [5, 2, 9, 3, -inf]: the newest entry (6) is in block 3, pinned; then block 2 (9)
    assert keep.tolist() == [[False, False, False, False, True, True, True, True, False, False]]
    keep = candidate_blocks(s, torch.tensor([7]), 3, 2)
    assert keep[0, :2].all() and not keep[0, 2:4].any()
    # more blocks asked for than are reachable: invisible blocks stay out
    few = torch.tensor([[1.0, 2.0, ninf, ninf, ninf]])
    assert candidate_blocks(few, torch.tensor([2]), 3, 2).tolist() == [[True, True, False, False, False]]
    # nothing visible yet: nothing is pinned
    assert not candidate_blocks(torch.full((1, 4), ninf), torch.tensor([0]), 2, 2).any()


def test_hadamard_after_inference_mode_still_trains():
    """The cached Hadamard matrix built under inference mode (serving) must not poison a later
    training step in the same process."""
    from hybridkv.ops.hadamard import hadamard_transform
    with torch.inference_mode():
        hadamard_transform(torch.randn(2, 64))
    x = torch.randn(2, 64, requires_grad=True)
    hadamard_transform(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("layer", [6, 8])      # v41-tiny's candidate source, and a layer inside its pool
def test_v41_selection_in_row_slices_equals_the_whole(monkeypatch, layer):
    """A prefill chunk's V4.1 selection runs in row slices when [rows, heads, entries] would not fit
    at once: the same top-k and the same published candidate pool as in one piece."""
    from hybridkv.config import ModelConfig
    from hybridkv.model import csa2
    cfg = ModelConfig.from_json("tests/fixtures/v41-tiny/config.json")
    ind = csa2.LatentIndexer(cfg, layer, "float", torch.float32)
    g = torch.Generator().manual_seed(layer)
    t, n = 37, 60
    q = torch.randn(t, ind.n_heads, ind.head_dim, generator=g)
    w = torch.randn(t, ind.n_heads, generator=g)
    keys = torch.randn(n, ind.head_dim, generator=g)
    positions = torch.arange(n * ind.ratio - t, n * ind.ratio)
    pool = torch.rand(t, n, generator=g) < 0.5 if ind.uses_candidates else None
    whole = ind.select(q, w, keys, positions, pool)
    monkeypatch.setattr(csa2, "SCORE_ELEMENTS", 5 * ind.n_heads * n)    # slices of 5 rows
    sliced = ind.select(q, w, keys, positions, pool)
    assert torch.equal(whole[0], sliced[0])
    assert (whole[1] is None) == (not ind.is_candidate_source)
    if whole[1] is not None:
        assert torch.equal(whole[1], sliced[1])


def test_indexer_topk_in_row_slices_equals_all_rows_at_once():
    """The reference top-k scores a long chunk's rows in slices ([rows, heads, entries] products kept
    small); each row's selection is the one all rows at once give (here 4 heads × 4096 entries: 64
    rows a slice, 200 rows, causal visibility)."""
    from hybridkv.ops.indexer_topk import indexer_topk
    g = torch.Generator().manual_seed(0)
    q, w, keys = torch.randn(200, 4, 16, generator=g), torch.rand(200, 4, generator=g), torch.randn(4096, 16, generator=g)
    visible = torch.arange(200) * 20 + 1
    assert torch.equal(indexer_topk(q, w, keys, visible, 64), causal_topk(index_scores(q, w, keys), visible, 64))


def test_paged_indexer_topk_in_row_slices_equals_each_request_at_once():
    """The paged reference top-k scores a request's rows in slices too: two requests (a 300-row
    prefill segment at position 3800 whose rows take two slices, and one decode row) over 4096-entry
    block tables in shuffled blocks, one block host-only, give what scoring each request's rows at
    once over its visible keys gives."""
    from hybridkv.ops.indexer_topk.reference import indexer_topk_paged
    from hybridkv.ops.paged import PagedBatch
    g = torch.Generator().manual_seed(1)
    ratio, bt, per = 4, 128, 32
    tables = [torch.randperm(160, generator=g)[:128].tolist(), torch.randperm(160, generator=g)[:40].tolist()]
    batch = PagedBatch.build([(0, 3800, 300, tables[0]), (1, 5000, 1, tables[1])], bt)
    pool = torch.randn(160, per, 16, generator=g)
    q, w = torch.randn(301, 4, 16, generator=g), torch.rand(301, 4, generator=g)
    resident = torch.zeros(2, 128, dtype=torch.int32)
    resident[0, 5] = -1
    got = indexer_topk_paged(q, w, batch, pool, 64, ratio, resident=resident)
    for r, rows in ((0, slice(0, 300)), (1, slice(300, 301))):
        visible = (batch.positions[rows].long() + 1) // ratio
        n = int(visible.max())
        keys = pool[torch.tensor(tables[r])].reshape(-1, 16)[:n]
        scores = index_scores(q[rows], w[rows], keys)
        if r == 0:
            scores[:, 5 * per:6 * per] = float("-inf")
        want = causal_topk(scores, visible, 64)
        assert torch.equal(got[rows, :want.shape[1]], want)


def test_indexer_mma_switch(monkeypatch):
    """The integer tensor-core scoring of FP4 indexer keys is opt-in, its switch validated, and never
    taken for tensors off CUDA."""
    from hybridkv.ops.indexer_topk import score_mma
    monkeypatch.delenv("HYBRIDKV_INDEXER_MMA", raising=False)
    assert not score_mma.enabled()
    monkeypatch.setenv("HYBRIDKV_INDEXER_MMA", "1")
    assert score_mma.enabled()
    i32 = torch.zeros(2, dtype=torch.int32)
    assert not score_mma.usable(torch.zeros(2, 64, 128), torch.zeros(2, 64), 128, True, 32, i32.view(2, 1), i32, i32)
    monkeypatch.setenv("HYBRIDKV_INDEXER_MMA", "yes")
    with pytest.raises(ValueError, match="HYBRIDKV_INDEXER_MMA"):
        score_mma.enabled()
