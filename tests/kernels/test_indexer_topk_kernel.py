"""Indexer scoring + top-k kernels against the reference, judged by the scores of what they select."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from helpers import random_batch
from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.indexer_topk import reference
from hybridkv.ops.indexer_topk import triton as idx_triton
from hybridkv.ops.kv_formats import index_rows_to_blocks, pack_index_fp4
from hybridkv.ops.paged import entry_rows
from hybridkv.ops.quant import fp4_round_trip


@pytest.fixture(scope="module")
def kernels():
    from hybridkv.ops.indexer_topk import triton as k
    return k


def check_selection(scores: torch.Tensor, visible: torch.Tensor, idx: torch.Tensor, topk: int) -> None:
    """idx selects min(topk, visible) distinct visible entries whose scores are the top ones."""
    for t in range(scores.shape[0]):
        v = int(visible[t])
        sel = [i for i in idx[t].tolist() if i >= 0]
        assert len(sel) == min(topk, v) and len(set(sel)) == len(sel) and all(i < v for i in sel)
        got = scores[t, sel].sort(descending=True).values
        want = scores[t, :v].topk(min(topk, v)).values
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (t, got[-3:], want[-3:])


def check_paged_selection(batch, q, w, keys, idx, topk, ratio) -> None:
    """Every token's selection (check_selection) against the reference scores of the keys its block
    table reaches, in ascending entry order."""
    vis = (batch.positions.long() + 1) // ratio
    for tok in range(batch.num_tokens):
        cols = torch.arange(int(vis[tok]))
        rows = entry_rows(batch, torch.full_like(cols, int(batch.token_req[tok])), cols, batch.block_tokens // ratio)
        s = reference.index_scores(q[tok:tok + 1], w[tok:tok + 1], keys[rows])
        check_selection(s, vis[tok:tok + 1], idx[tok:tok + 1], topk)
        sel = idx[tok][idx[tok] >= 0]
        assert torch.equal(sel, sel.sort().values)


@pytest.fixture(params=["resident", "tiles"])
def select_path(request, kernels, monkeypatch):
    """Selection with every key in registers (rows of at most `RESIDENT_SELECT_MAX` entries), or
    through the tile maxima and a candidate copy (longer rows)."""
    if request.param == "tiles":
        monkeypatch.setattr(kernels, "RESIDENT_SELECT_MAX", 0)
    return request.param


@pytest.mark.parametrize("n,topk", [(300, 16), (40, 64), (1100, 8)], ids=["select", "all-visible", "tile-bound"])
def test_contiguous(kernels, device, n, topk, select_path):
    """Few tiles (every key a candidate), all visible, and ≥ topk tiles (tile-maxima bound),
    over several scoring chunks with a partial last tile."""
    g = torch.Generator().manual_seed(1)
    t, h, d = 6, 4, 32
    q, w, keys = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g), torch.randn(n, d, generator=g)
    visible = torch.tensor([0, 1, 17, n // 2, n - 3, n])
    idx = kernels.indexer_topk(q.to(device), w.to(device), keys.to(device), visible.to(device), topk).cpu()
    assert idx.shape == (t, min(topk, n))
    check_selection(reference.index_scores(q, w, keys), visible, idx, min(topk, n))


@pytest.mark.parametrize("n,topk", [(200, 40), (1000, 10)], ids=["few-tiles", "tile-bound"])
def test_ties_are_not_failures(kernels, device, n, topk, select_path):
    """Many equal scores (zero keys give score 0): any choice among ties is right, the count exact;
    the kernel keeps the first ties in entry order and lists its selection in ascending order."""
    t, h, d = 2, 2, 16
    q, w = torch.ones(t, h, d), torch.ones(t, h)
    keys = torch.zeros(n, d)
    keys[::7] = 1.0
    visible = torch.tensor([n, 150])
    idx = kernels.indexer_topk(q.to(device), w.to(device), keys.to(device), visible.to(device), topk).cpu()
    check_selection(reference.index_scores(q, w, keys), visible, idx, topk)
    ones = torch.arange(0, n, 7)
    first = torch.cat([ones, torch.tensor([i for i in range(n) if i % 7])])[:topk]   # score order, ties by index
    assert torch.equal(idx[0].long(), first.sort().values)


def test_token_result_does_not_depend_on_batch(kernels, device, monkeypatch):
    """A token scored alone (one chunk) and in a batch (other chunking) selects the same entries."""
    g = torch.Generator().manual_seed(4)
    t, h, d, n = 5, 4, 32, 900
    q, w, keys = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g), torch.randn(n, d, generator=g)
    visible = torch.tensor([n, 700, n - 1, 650, 899])
    dv = lambda x: x.to(device)  # noqa: E731
    batch = kernels.indexer_topk(dv(q), dv(w), dv(keys), dv(visible), 8).cpu()
    monkeypatch.setattr(kernels, "_chunk", lambda *a: 4096)
    alone = kernels.indexer_topk(dv(q[2:3]), dv(w[2:3]), dv(keys), dv(visible[2:3]), 8).cpu()
    assert torch.equal(batch[2:3], alone)


def _paged_case(g: torch.Generator, fmt: str, kernels, block_t: int, monkeypatch):
    """Four requests (prefill chunks and decode tokens) over shuffled blocks of 16 positions, ratio 4,
    64-dim keys as floats or packed FP4, with the kernels' tiles forced to `block_t` tokens:
    (batch, q, w, keys, pool)."""
    h, d, bt, ratio = 4, 64, 16, 4
    batch = random_batch([(0, 5), (150, 1), (90, 7), (303, 1)], num_blocks=48, block_tokens=bt, num_slots=4, gen=g)
    t = batch.num_tokens
    q = fp4_round_trip(hadamard_transform(torch.randn(t, h, d, generator=g)), 32)
    w = torch.randn(t, h, generator=g)
    keys = fp4_round_trip(hadamard_transform(torch.randn(48 * bt // ratio, d, generator=g)), 32)
    pool = keys.reshape(48, bt // ratio, -1) if fmt != "fp4" else \
        index_rows_to_blocks(pack_index_fp4(keys).reshape(48, bt // ratio, -1), d)
    run = kernels._run
    monkeypatch.setattr(kernels, "_run", lambda *a, **kw: run(*a, **{**kw, "block_t": block_t}))
    return batch, q, w, keys, pool


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
@pytest.mark.parametrize("block_t", [1, 2], ids=["decode-tiles", "prefill-tiles"])
def test_paged(kernels, device, fmt, block_t, monkeypatch):
    d, bt, ratio, topk = 64, 16, 4, 12
    batch, q, w, keys, pool = _paged_case(torch.Generator().manual_seed(2), fmt, kernels, block_t, monkeypatch)
    t = batch.num_tokens
    idx = kernels.indexer_topk_paged(q.to(device), w.to(device), batch.to(device), pool.to(device), topk, ratio, fmt,
                                     d).cpu()
    vis = (batch.positions.long() + 1) // ratio
    n = int(vis.max())
    for tok in range(t):
        cols = torch.arange(n)
        rows = entry_rows(batch, torch.full_like(cols, int(batch.token_req[tok])), cols, bt // ratio)
        s = reference.index_scores(q[tok:tok + 1], w[tok:tok + 1], keys[rows.clamp(min=0)])
        check_selection(s, vis[tok:tok + 1], idx[tok:tok + 1], topk)
    ref = reference.indexer_topk_paged(q, w, batch, pool, topk, ratio, fmt, d)
    assert ref.shape == idx.shape


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
@pytest.mark.parametrize("block_t", [1, 2], ids=["decode-tiles", "prefill-tiles"])
def test_paged_selects_among_resident_blocks_only(kernels, device, fmt, block_t, monkeypatch):
    """With a memory policy's pages (−1: the block is on the host only), each token selects the top
    entries of its resident blocks; slots they cannot fill are −1; the reference agrees."""
    from hybridkv.ops.indexer_topk import indexer_topk_paged
    g = torch.Generator().manual_seed(7)
    d, bt, ratio, topk = 64, 16, 4, 12
    batch, q, w, keys, pool = _paged_case(g, fmt, kernels, block_t, monkeypatch)
    t = batch.num_tokens
    pages = torch.where(torch.rand(batch.block_tables.shape, generator=g) < 0.5, 1, -1).to(torch.int32)
    pages[2] = -1                      # request 2: only host blocks but its last (always resident)
    pages[2, 90 // bt] = 1
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton" if device == "cpu" else "auto")
    idx = indexer_topk_paged(q.to(device), w.to(device), batch.to(device), pool.to(device), topk, ratio, fmt, d,
                             resident=pages.to(device)).cpu()
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    ref = indexer_topk_paged(q, w, batch, pool, topk, ratio, fmt, d, resident=pages)
    per = bt // ratio
    vis = (batch.positions.long() + 1) // ratio
    for tok in range(t):
        r = int(batch.token_req[tok])
        cols = torch.arange(int(vis[tok]))
        cols = cols[pages[r, cols // per] >= 0]            # the resident visible entries
        rows = entry_rows(batch, torch.full_like(cols, r), cols, per)
        s = reference.index_scores(q[tok:tok + 1], w[tok:tok + 1], keys[rows])
        sel = [i for i in idx[tok].tolist() if i >= 0]
        assert len(sel) == min(topk, cols.numel()) and all(pages[r, i // per] >= 0 for i in sel)
        got = reference.index_scores(q[tok:tok + 1], w[tok:tok + 1],
                                     keys[entry_rows(batch, torch.full((len(sel),), r), torch.tensor(sel), per)])
        assert torch.allclose(got.sort(descending=True).values, s.topk(len(sel)).values, rtol=1e-5, atol=1e-6)
        assert sorted(i for i in ref[tok].tolist() if i >= 0) == sorted(sel)
    assert (idx < 0).any()             # request 2's few resident entries leave slots empty


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_paged_long(kernels, device, fmt):
    """Requests with ≥ topk tiles of visible entries, through shuffled block tables (decode tiles)."""
    g = torch.Generator().manual_seed(5)
    h, d, bt, ratio, topk = 4, 128, 64, 4, 8          # 68-B FP4 rows: read as int32 words
    batch = random_batch([(3999, 1), (2600, 1), (3100, 1)], num_blocks=180, block_tokens=bt, num_slots=3, gen=g)
    t = batch.num_tokens
    q = fp4_round_trip(hadamard_transform(torch.randn(t, h, d, generator=g)), 32)
    w = torch.randn(t, h, generator=g)
    keys = fp4_round_trip(hadamard_transform(torch.randn(180 * bt // ratio, d, generator=g)), 32)
    pool = keys.reshape(180, bt // ratio, -1) if fmt != "fp4" else \
        index_rows_to_blocks(pack_index_fp4(keys).reshape(180, bt // ratio, -1), d)
    idx = kernels.indexer_topk_paged(q.to(device), w.to(device), batch.to(device), pool.to(device), topk, ratio, fmt,
                                     d).cpu()
    check_paged_selection(batch, q, w, keys, idx, topk, ratio)


def test_maxima_tile_tightens_the_bound_for_few_tiles():
    """Tiles shrink until a row has four maxima per selected entry (V4-Flash top-512)."""
    assert idx_triton.maxima_tile(262144, 512) == 64         # 1M context, ratio 4
    assert idx_triton.maxima_tile(65536, 512) == 32           # 256K
    assert idx_triton.maxima_tile(32768, 512) == 16           # 128K
    assert idx_triton.maxima_tile(1000, 8) == 32
    assert idx_triton.maxima_tile(100, 512) == 16             # fewer tiles than topk: every key a candidate


@pytest.mark.parametrize("tile", [16, 32, 64])
@pytest.mark.parametrize("block_t", [1, 4], ids=["decode-tiles", "prefill-tiles"])
def test_paged_tile_bound_every_tile_size(kernels, device, tile, block_t, monkeypatch):
    """The tile-maxima bound with each maxima tile size, through decode and prefill scoring tiles:
    chunks of several tokens over ≥ topk tiles of FP4 keys (68-B rows)."""
    monkeypatch.setattr(kernels, "RESIDENT_SELECT_MAX", 0)      # the bound, not the registers
    g = torch.Generator().manual_seed(7)
    h, d, bt, ratio, topk = 4, 128, 64, 4, 6
    batch = random_batch([(3000, 5), (2040, 3)], num_blocks=100, block_tokens=bt, num_slots=2, gen=g)
    t = batch.num_tokens
    q = fp4_round_trip(hadamard_transform(torch.randn(t, h, d, generator=g)), 32)
    w = torch.randn(t, h, generator=g)
    keys = fp4_round_trip(hadamard_transform(torch.randn(100 * bt // ratio, d, generator=g)), 32)
    pool = index_rows_to_blocks(pack_index_fp4(keys).reshape(100, bt // ratio, -1), d)
    run = kernels._run
    monkeypatch.setattr(kernels, "_run", lambda *a, **kw: run(*a, **{**kw, "block_t": block_t}))
    monkeypatch.setattr(kernels, "maxima_tile", lambda n, k: tile)
    idx = kernels.indexer_topk_paged(q.to(device), w.to(device), batch.to(device), pool.to(device), topk, ratio,
                                     "fp4", d).cpu()
    vis = (batch.positions.long() + 1) // ratio
    assert int(vis.min()) // 64 >= topk        # ≥ topk tiles at every size: τ₀ is a real bound
    check_paged_selection(batch, q, w, keys, idx, topk, ratio)


class _Refused:
    """Stands in for a kernel a test must not launch."""

    def __getitem__(self, grid):
        raise AssertionError("a selection kernel the launch should not use ran")


@pytest.mark.parametrize("groups", [2, 4, None], ids=["2", "4", "by-batch"])
def test_split_selection_selects_what_one_program_does(kernels, device, groups, monkeypatch):
    """Candidates gathered by several programs per token and joined in entry order give exactly the
    one-program result: spread and clustered top keys (one range with more candidates than a join
    step moves at once), a run of equal scores, tokens with fewer tiles than topk (one of them with
    fewer than the programs gathering them), one with every entry selected. `by-batch`: the groups
    `select_groups` gives seven tokens (64 // 7 = 9 programs once failed to compile)."""
    g = torch.Generator().manual_seed(9)
    t, h, d, n, topk = 7, 4, 32, 1500, 24
    q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
    keys = torch.randn(n, d, generator=g)
    keys[600:700] *= 4                  # most of the top keys in one range
    keys[900:1000] = keys[900].clone()  # 100 equal scores
    visible = torch.tensor([n, 20, 300, n - 7, 1200, 950, 40])   # 40: fewer tiles than programs
    dv = lambda x: x.to(device)  # noqa: E731
    one = kernels.indexer_topk(dv(q), dv(w), dv(keys), dv(visible), topk).cpu()
    monkeypatch.setattr(kernels, "SPLIT_MIN_TILES", 1)
    if groups is not None:
        monkeypatch.setattr(kernels, "SELECT_GROUPS", groups)
    monkeypatch.setattr(kernels, "SPLIT_CFG", {**kernels.SPLIT_CFG, "final": {"CB": 16, "num_warps": 4}})
    monkeypatch.setattr(kernels, "select_kernel", _Refused())
    split = kernels.indexer_topk(dv(q), dv(w), dv(keys), dv(visible), topk).cpu()
    check_selection(reference.index_scores(q, w, keys), visible, split, topk)
    assert torch.equal(split, one)


def test_resident_selection_selects_what_the_tile_path_does(kernels, device, monkeypatch):
    """Every key in registers gives exactly the tile path's entries: random scores, a run of equal
    scores, rows with fewer entries than topk, all visible, one entry past a power of two."""
    g = torch.Generator().manual_seed(11)
    t, h, d, n, topk = 6, 4, 32, 1025, 24
    q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
    keys = torch.randn(n, d, generator=g)
    keys[300:400] = keys[300].clone()
    visible = torch.tensor([n, 20, 400, n - 1, 24, 700])
    dv = lambda x: x.to(device)  # noqa: E731
    resident = kernels.indexer_topk(dv(q), dv(w), dv(keys), dv(visible), topk).cpu()
    monkeypatch.setattr(kernels, "RESIDENT_SELECT_MAX", 0)
    tiles = kernels.indexer_topk(dv(q), dv(w), dv(keys), dv(visible), topk).cpu()
    check_selection(reference.index_scores(q, w, keys), visible, resident, topk)
    assert torch.equal(resident, tiles)


def test_select_groups_are_powers_of_two_for_every_split_launch(kernels):
    """The split selection's joining kernel ranges over its groups (`tl.arange`): every launch size
    that splits gets a power of two, shrinking as the tokens grow."""
    groups = [kernels.select_groups(t) for t in range(1, kernels.SPLIT_MAX_TOKENS + 1)]
    assert all(g & (g - 1) == 0 and 4 <= g <= kernels.SELECT_GROUPS for g in groups), groups
    assert groups == sorted(groups, reverse=True) and groups[0] == kernels.SELECT_GROUPS


def test_launches_of_many_tokens_select_in_one_program_per_token(kernels, device, monkeypatch):
    """Prefill-sized launches fill the GPU with one selection program per token: no split."""
    g = torch.Generator().manual_seed(3)
    t, h, d, n = 6, 4, 32, 1200
    q, w, keys = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g), torch.randn(n, d, generator=g)
    visible = torch.full((t,), n)
    monkeypatch.setattr(kernels, "SPLIT_MIN_TILES", 1)
    monkeypatch.setattr(kernels, "SPLIT_MAX_TOKENS", t - 1)
    monkeypatch.setattr(kernels, "gather_candidates_kernel", _Refused())
    idx = kernels.indexer_topk(q.to(device), w.to(device), keys.to(device), visible.to(device), 16).cpu()
    check_selection(reference.index_scores(q, w, keys), visible, idx, 16)


@triton.jit
def _decode16(POOL, s_row, OUT, D: tl.constexpr, WORDS: tl.constexpr, EPB: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BN)
    k, smax = idx_triton._fp4_keys16(rows // EPB, rows % EPB, POOL, s_row, D, WORDS, EPB)
    k = k.to(tl.float32) * (smax << 23).to(tl.float32, bitcast=True)[:, None]
    tl.store(OUT + rows[:, None] * D + tl.arange(0, D)[None, :], k)


@pytest.mark.parametrize("d", [64, 128], ids=["bytes", "words"])
def test_fp4_keys_as_scaled_fp16_are_exact(device, d):
    """The fp16 form the scoring MMA uses, times its row factor, is the packed value exactly (scales
    up to 2^20 apart within a row, every code), read from blocks of 4 keys in the block layout."""
    from hybridkv.ops.kv_formats import index_rows_to_blocks, unpack_index_fp4
    g = torch.Generator().manual_seed(8)
    n, epb = 16, 4
    buf = torch.randint(0, 256, (n, d // 2 + d // 32), dtype=torch.uint8, generator=g)
    buf[0, : d // 2] = (torch.arange(d // 2) * 17 % 256).to(torch.uint8)
    buf[:, d // 2:] = torch.randint(107, 128, (n, d // 32), dtype=torch.uint8, generator=g)
    words = d == 128
    blocks = index_rows_to_blocks(buf.view(n // epb, epb, -1), d).reshape(n, -1)
    pool = blocks.view(torch.int32) if words else blocks
    out = torch.empty(n, d, device=device)
    _decode16[(1,)](pool.to(device), pool.shape[1], out, D=d, WORDS=words, EPB=epb, BN=n)
    assert torch.equal(out.cpu(), unpack_index_fp4(buf, d))


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_paged_scores_are_the_reference_scores(kernels, device, fmt, monkeypatch):
    """`paged_scores` (the decode scoring launch alone, its keys turned back into floats): each row's
    scores over the entries its block table reaches equal the reference's (the FP4 keys' products
    exact in fp16, sums in fp32), −inf beyond a row's visible entries; the reference `paged_scores`
    equals them too."""
    from hybridkv.ops import indexer_topk
    d, ratio = 64, 4
    batch, q, w, keys, pool = _paged_case(torch.Generator().manual_seed(5), fmt, kernels, 1, monkeypatch)
    got = kernels.paged_scores(q.to(device), w.to(device), batch.to(device), pool.to(device), ratio, fmt, d).cpu()
    vis = (batch.positions.long() + 1) // ratio
    assert got.shape == (batch.num_tokens, int(vis.max()))
    for tok in range(batch.num_tokens):
        v = int(vis[tok])
        cols = torch.arange(v)
        rows = entry_rows(batch, torch.full_like(cols, int(batch.token_req[tok])), cols, 16 // ratio)
        want = reference.index_scores(q[tok:tok + 1], w[tok:tok + 1], keys[rows])[0]
        assert torch.allclose(got[tok, :v], want, rtol=1e-5, atol=1e-5)
        assert torch.isneginf(got[tok, v:]).all()
    ref = reference.paged_scores(q, w, batch, pool, ratio, fmt, d)
    assert torch.allclose(ref, got, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    assert torch.equal(indexer_topk.paged_scores(q, w, batch, pool, ratio, fmt, d), ref)


def test_resident_blocks_are_compacted_in_order_with_their_visible_entries(kernels):
    """The kernels see only a request's resident blocks, in order: their pool ids, how many of their
    entries each token sees (whole blocks before its position, the part of its own block) and which
    block of the request each one is (hand-computed: 16-token blocks, ratio 4, 4 entries a block)."""
    from hybridkv.ops.paged import PagedBatch
    tables = [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
    batch = PagedBatch.build([(0, 71, 1, tables[0]), (1, 39, 1, tables[1])], block_tokens=16)
    pages = torch.tensor([[5, -1, 6, -1, 7], [-1, -1, 8, 9, -1]], dtype=torch.int32)
    compact, visible, logical = kernels._compact_resident(batch, pages, 4)
    # request 0 at position 71 sees 18 entries: blocks 0-3 whole, 2 of block 4; resident 0, 2, 4
    # request 1 at position 39 sees 10: blocks 0-1 whole, 2 of block 2; resident 2, 3
    assert logical[0, :3].tolist() == [0, 2, 4] and logical[1, :2].tolist() == [2, 3]
    assert compact[0, :3].tolist() == [10, 12, 14] and compact[1, :2].tolist() == [22, 23]
    assert visible.tolist() == [2 * 4 + 2, 0 * 4 + 2]


def test_prefill_tiles_are_runs_of_one_requests_tokens_cut_every_block_t(kernels):
    """`_tiles` (vectorised): tiles of at most block_t consecutive tokens of one request, each run of a
    request's tokens cut from its start, against the definition written as a loop."""
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        lengths = torch.randint(1, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        req = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(lengths)])
        block_t = int(torch.randint(1, 9, (1,), generator=g))
        want, i = [], 0
        while i < len(req):
            j = i
            while j < len(req) and j - i < block_t and req[j] == req[i]:
                j += 1
            want.append((i, j - i))
            i = j
        t0, n = kernels._tiles(req.numpy(), block_t, req.device)
        assert list(zip(t0.tolist(), n.tolist())) == want


def test_prefill_tiles_come_from_the_batch_built_on_the_host(kernels, device, monkeypatch):
    """A prefill launch makes its tiles from the token requests `PagedBatch.build` kept on the host:
    no read of the device (on a GPU each read drained the queue, hundreds a 128K prompt), the same
    selection as tiles made from the device's copy; a batch whose host copy no longer describes its
    tokens is read from the device instead."""
    d, ratio, topk = 64, 4, 12
    batch, q, w, _, pool = _paged_case(torch.Generator().manual_seed(5), "fp4", kernels, 2, monkeypatch)
    batch = batch.to(device)
    assert torch.equal(torch.from_numpy(batch.host_token_req), batch.token_req.cpu())
    args = (q.to(device), w.to(device), batch, pool.to(device), topk, ratio, "fp4", d)
    read = torch.Tensor.cpu
    reads = []

    def counted(self, *a, **kw):
        reads.append(self.shape)
        return read(self, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    idx = kernels.indexer_topk_paged(*args)
    assert reads == []
    from_device = kernels.indexer_topk_paged(*args[:2], dataclasses.replace(batch, host_token_req=None), *args[3:])
    assert reads == [batch.token_req.shape]
    stale = dataclasses.replace(batch, host_token_req=batch.host_token_req[:-1])
    assert torch.equal(kernels.indexer_topk_paged(*args[:2], stale, *args[3:]), idx)
    assert len(reads) == 2
    monkeypatch.setattr(torch.Tensor, "cpu", read)
    assert torch.equal(idx.cpu(), from_device.cpu())
