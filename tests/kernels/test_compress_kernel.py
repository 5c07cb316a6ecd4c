"""The fused compressor kernel against pooling + finishing in plain torch."""

import dataclasses

import pytest
import torch

from helpers import rel_rms
from hybridkv.ops.compress.reference import finish_entries, softmax_pool
from hybridkv.ops.kv_formats import index_blocks_to_rows, unpack_index_fp4, unpack_main_fp8
from hybridkv.ops.rope import rope_freqs, yarn_inv_freq


@pytest.fixture(scope="module")
def kernels():
    from hybridkv.ops.compress import triton as k
    return k


def _case(kind, n, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = 128 if kind == "main" else 64
    rope = 64 if kind == "main" else 16
    kv = torch.randn(n, L, d, generator=g) * 3
    score = torch.randn(n, L, d, generator=g)
    score[0, : L // 2] = float("-inf")                  # block 0 of an overlapping compressor: no previous block
    w = 1 + 0.1 * torch.randn(d, generator=g)
    j = torch.randperm(4 * n, generator=g)[:n]
    freqs = rope_freqs(j * L, yarn_inv_freq(rope, 160000.0))
    ref = finish_entries(softmax_pool(kv, score), w, 1e-6, freqs, kind, torch.float32)
    return kv, score, w, freqs, j, ref


def test_float_main_entries_with_plain_fp8_scales(kernels, device):
    """A checkpoint without scale_fmt ue8m0 round-trips its main entries with amax/448 scales: the
    kernel's float entries follow that definition, not the power-of-two one."""
    kv, score, w, freqs, j, ref_pow2 = _case("main", 5, 8, seed=3)
    ref = finish_entries(softmax_pool(kv, score), w, 1e-6, freqs, "main", torch.float32, pow2=False)
    out = torch.empty(5, kv.shape[-1], device=device)
    kernels.compress_write(kv.to(device), score.to(device), w.to(device), 1e-6, freqs.real.to(device),
                           freqs.imag.to(device), "main", out, False, torch.arange(5, dtype=torch.int32, device=device),
                           pow2=False)
    assert rel_rms(ref, out.cpu()) <= 1e-5 < rel_rms(ref_pow2, out.cpu())
    with pytest.raises(ValueError, match="ue8m0"):
        kernels.compress_write(kv.to(device), score.to(device), w.to(device), 1e-6, freqs.real.to(device),
                               freqs.imag.to(device), "main", torch.empty(5, 200, dtype=torch.uint8, device=device),
                               True, torch.arange(5, dtype=torch.int32, device=device), pow2=False)


@pytest.mark.parametrize("kind,L", [("main", 8), ("main", 128), ("index", 8), ("main", 12), ("index", 3)],
                         ids=["csa-main", "hca", "csa-index", "ratio-6-overlap", "ratio-3"])
def test_float_entries(kernels, device, kind, L):
    kv, score, w, freqs, j, ref = _case(kind, 5, L)
    out = torch.empty(5, kv.shape[-1], device=device)
    kernels.compress_write(kv.to(device), score.to(device), w.to(device), 1e-6, freqs.real.to(device),
                           freqs.imag.to(device), kind, out, False, torch.arange(5, dtype=torch.int32, device=device))
    assert rel_rms(ref, out.cpu()) <= 1e-3


@pytest.mark.parametrize("kind,block_layout", [("main", False), ("index", False), ("index", True)],
                         ids=["main", "index-rows", "index-blocks"])
def test_packed_paged_write(kernels, device, kind, block_layout):
    """Packed entries land in their paged rows (indexer keys also in the pool's block layout)."""
    n, L, epb = 6, 8, 4
    kv, score, w, freqs, j, ref = _case(kind, n, L, seed=1)
    d = kv.shape[-1]
    ebytes = {"main": 200, "index": d // 2 + d // 32}[kind]          # main: 64 nope + 128 rope + 1 scale, padded to 8
    bt = torch.tensor([[3, 0, 5, 7, 1, 2], [6, 4, 8, 9, 10, 11]], dtype=torch.int32)
    req = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.int32)
    pool = torch.zeros(12, epb, ebytes, dtype=torch.uint8)
    out = pool.to(device)
    kernels.compress_write(kv.to(device), score.to(device), w.to(device), 1e-6, freqs.real.to(device),
                           freqs.imag.to(device), kind, out.view(-1, ebytes), True, j.to(torch.int32).to(device),
                           req.to(device), bt.to(device), epb, block_layout=block_layout)
    out = out.cpu()
    if block_layout:
        out = index_blocks_to_rows(out, d)
    rows = out.view(-1, ebytes)[(bt[req.long(), j // epb].long() * epb + j % epb)]
    got = unpack_main_fp8(rows, d, 64) if kind == "main" else unpack_index_fp4(rows, d)
    # rope dims are stored in bf16: compare against the reference rounded the same way
    if kind == "main":
        ref = torch.cat([ref[:, :-64], ref[:, -64:].bfloat16().float()], 1)
    assert rel_rms(ref, got) <= 1e-3
    written = torch.zeros(12 * epb, dtype=torch.bool)
    written[bt[req.long(), j // epb].long() * epb + j % epb] = True
    assert (out.view(-1, ebytes)[~written] == 0).all()           # nothing else touched


@pytest.mark.parametrize("kind,packed", [("main", True), ("index", True), ("main", False)], ids=["fp8", "fp4", "float"])
def test_entry_id_minus_one_is_not_stored(kernels, device, kind, packed):
    """Fixed-shape decode hands every request's rows to the kernel, −1 where no block completed:
    those are computed but leave the pool untouched; the others land where they belong."""
    n, L, epb = 6, 8, 4
    kv, score, w, freqs, j, ref = _case(kind, n, L, seed=2)
    d = kv.shape[-1]
    ebytes = {"main": 200, "index": d // 2 + d // 32}[kind] if packed else d
    bt = torch.tensor([[3, 0, 5, 7, 1, 2], [6, 4, 8, 9, 10, 11]], dtype=torch.int32)
    req = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.int32)
    ids = torch.where(torch.tensor([True, False, True, False, False, True]), j, -1).to(torch.int32)
    fill = 7 if packed else 0.5
    pool = torch.full((12 * epb, ebytes), fill, dtype=torch.uint8 if packed else torch.float32, device=device)
    kernels.compress_write(kv.to(device), score.to(device), w.to(device), 1e-6, freqs.real.to(device),
                           freqs.imag.to(device), kind, pool, packed, ids.to(device), req.to(device), bt.to(device),
                           epb)
    pool = pool.cpu()
    keep = ids >= 0
    dest = bt[req[keep].long(), ids[keep].long() // epb].long() * epb + ids[keep].long() % epb
    untouched = torch.ones(12 * epb, dtype=torch.bool)
    untouched[dest] = False
    assert (pool[untouched] == fill).all()
    rows = pool[dest]
    if packed:
        got = unpack_main_fp8(rows, d, 64) if kind == "main" else unpack_index_fp4(rows, d)
    else:
        got = rows
    want = ref[keep]
    if kind == "main":
        want = torch.cat([want[:, :-64], want[:, -64:].bfloat16().float()], 1) if packed else want
    assert rel_rms(want, got) <= 1e-3


@pytest.mark.parametrize("store", ["packed", "float", "float-plain-scales"])
@pytest.mark.parametrize("layer,kind", [(1, "main"), (1, "index"), (2, "main")], ids=["csa-main", "csa-index", "hca"])
def test_decode_step_equals_the_state_update_and_paged_write(device, monkeypatch, layer, kind, store):
    """`compress_decode_paged` (one launch, adding the position bias itself) against
    `Compressor.update_decode` writing through `compress_paged` (packed stores) or storing the
    compressor's own finished entries (float stores: bf16 values, main entries with power-of-two or
    plain amax/448 FP8 scales) (scores with the bias added as `Compressor.project` adds it): the same
    states and the same pool bytes, to the bit. Requests whose token ends a block (and one whose
    block is the first, with no previous block), others that do not, in slots out of order. Both
    sides run the Triton kernels (the pooled entries then see the same float32 operations)."""
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    from hybridkv.model.compressor import Compressor
    from hybridkv.ops.compress import compress_decode_paged, compress_paged
    from hybridkv.ops.kv_formats import index_entry_bytes, main_entry_bytes
    from hybridkv.presets import get_preset
    cfg = get_preset("v4-tiny-fp8")
    g = torch.Generator().manual_seed(layer * 10 + len(kind))
    d = cfg.index_head_dim if kind == "index" else cfg.head_dim
    comp = Compressor(cfg, layer, d, kind == "index", torch.bfloat16)
    comp.kv_pow2 = store != "float-plain-scales"
    packed = store == "packed"
    with torch.no_grad():
        comp.norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
        comp.ape.copy_(torch.randn(comp.ape.shape, generator=g))
    r, width = comp.ratio, (2 if comp.overlap else 1) * d
    state_rows = (2 if comp.overlap else 1) * r
    slots = torch.tensor([3, 0, 5, 2])
    # ends a block / ends the first block / mid-block / first token of a block
    positions = torch.tensor([5 * r - 1, r - 1, 3 * r + 1, 2 * r])
    st_kv = torch.randn(6, state_rows, width, generator=g) * 2
    st_score = torch.randn(6, state_rows, width, generator=g)
    if comp.overlap:
        st_score[0, :r] = float("-inf")                # slot 0 ends its first block: no previous block
        st_kv[0, :r] = 0
    kv = torch.randn(4, width, generator=g) * 2
    score = torch.randn(4, width, generator=g)
    epb = 16 // r if r < 16 else 1
    ebytes = index_entry_bytes(d) if kind == "index" else main_entry_bytes(d, cfg.qk_rope_head_dim)
    fmt = ("fp4" if kind == "index" else "fp8") if packed else "bf16"
    bt = torch.randperm(40, generator=g)[:32].view(4, 8).int()
    inv_freq = yarn_inv_freq(cfg.qk_rope_head_dim, 160000.0)
    kv, score, st_kv, st_score, bt, slots, positions = (t.to(device) for t in (kv, score, st_kv, st_score, bt, slots,
                                                                                 positions))
    comp = comp.to(device)

    def run(fused: bool, save=None):
        a_kv, a_score = st_kv.clone(), st_score.clone()
        pool = (torch.zeros(40, epb, ebytes, dtype=torch.uint8, device=device) if packed else
                torch.zeros(40, epb, d, dtype=torch.bfloat16, device=device))
        if fused:
            freqs = rope_freqs((positions + 1 - r).clamp(min=0), inv_freq)
            compress_decode_paged(a_kv, a_score, slots, positions, kv, score, r, comp.overlap, comp.norm.weight,
                                  comp.norm.eps, (freqs.real.contiguous(), freqs.imag.contiguous()),
                                  "index" if comp.rotate else "main", pool, fmt, bt, epb, ape=comp.ape, save=save,
                                  pow2=comp.kv_pow2)
        else:
            def write(block_rows, block_starts, requests, entry_ids):
                if not packed:      # the layer's writer for float stores: the compressor's entries, stored
                    rows = bt[requests.long(), entry_ids.clamp(min=0) // epb].long() * epb + entry_ids % epb
                    keep = entry_ids >= 0
                    pool.view(-1, d)[rows[keep]] = comp.finish(block_rows, block_starts, inv_freq)[keep]
                    return
                compress_paged(*block_rows, comp.norm.weight, comp.norm.eps, rope_freqs(block_starts, inv_freq),
                               "index" if comp.rotate else "main", pool, fmt, bt, requests, entry_ids.int(), epb)
            s_kv, s_score = a_kv[slots], a_score[slots]
            comp.update_decode(s_kv, s_score, kv, score + comp.ape[positions % r], positions, inv_freq, write)
            a_kv[slots], a_score[slots] = s_kv, s_score
        return a_kv, a_score, pool

    want, got = run(False), run(True)
    assert int((want[2] != 0).sum()) > 0             # entries were written
    for w, o in zip(want, got):
        assert torch.equal(w, o)
    # the same launch copying each request's state before its update (a speculative verify wave's copy)
    save = tuple(torch.full((4, state_rows, width), 7.0, device=device) for _ in range(2))
    for w, o in zip(want, run(True, save)):
        assert torch.equal(w, o)
    assert torch.equal(save[0], st_kv[slots]) and torch.equal(save[1], st_score[slots])
    with pytest.raises(ValueError, match="state copies"):
        run(True, (save[0][:3], save[1][:3]))


@pytest.mark.parametrize("dtype,ratio", [(torch.float32, 2), (torch.bfloat16, 2), (torch.float32, 3),
                                         (torch.float32, 12)])
def test_v41_decode_step_returns_the_latent_the_state_update_finishes(device, dtype, ratio):
    """`compress_decode_latent` (V4.1's ratio-2 compressor, one launch; and ratios that are not powers
    of two, which the kernel takes in chunks of the rows' largest power-of-two divisor) against
    `Compressor.update_decode` finishing each block a token ends (softmax pooling, the output dtype,
    RMSNorm): the same states to the bit, the same entry ids (−1 where a token ends no block, whose
    row is zeros), the latents within the pooling's float32 rounding (an online softmax here)."""
    from hybridkv.config import ModelConfig
    from hybridkv.model.compressor import Compressor
    from hybridkv.ops.compress import triton as kernels
    cfg = ModelConfig.from_json("tests/fixtures/v41-tiny/config.json")
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == 2)
    # every ratio-2 layer at `ratio` (the layers sharing one's KV keep its ratio)
    cfg = dataclasses.replace(cfg, compress_ratios=tuple(ratio if r == 2 else r for r in cfg.compress_ratios))
    g = torch.Generator().manual_seed(7)
    comp = Compressor(cfg, layer, cfg.head_dim, False, dtype)
    with torch.no_grad():
        comp.norm.weight.copy_(1 + 0.1 * torch.randn(cfg.head_dim, generator=g))
    r, d = comp.ratio, cfg.head_dim
    assert r == ratio and comp.latent and not comp.overlap and not comp.stateless
    slots = torch.tensor([3, 0, 5, 2])
    positions = torch.tensor([5 * r - 1, r - 1, 3 * r, 2 * r])           # ends a block, the first, none, none
    st_kv = torch.randn(6, r, d, generator=g) * 2
    st_score = torch.randn(6, r, d, generator=g)
    kv = torch.randn(4, d, generator=g) * 2
    score = torch.randn(4, d, generator=g)
    want = {}

    def finish(block_rows, starts, requests, ids):
        with torch.no_grad():
            want["latent"] = torch.where((ids >= 0).unsqueeze(-1), comp.finish(block_rows, starts, None), 0.0)
        want["ids"] = ids

    s_kv, s_score = st_kv[slots], st_score[slots]
    comp.update_decode(s_kv, s_score, kv, score, positions, None, finish)
    want_kv, want_score = st_kv.clone(), st_score.clone()
    want_kv[slots], want_score[slots] = s_kv, s_score
    a_kv, a_score = st_kv.to(device), st_score.to(device)
    latent, ids = kernels.compress_decode_latent(a_kv, a_score, slots.to(device), positions.to(device), kv.to(device),
                                                 score.to(device), r, comp.norm.weight.detach().to(device), comp.norm.eps,
                                                 dtype)
    assert torch.equal(a_kv.cpu(), want_kv) and torch.equal(a_score.cpu(), want_score)
    assert ids.tolist() == want["ids"].tolist() == [4, 0, -1, -1]
    assert latent.dtype == dtype and not latent[2:].any()
    # (measured: 1.1e-7 in float32, equal in bf16; a bf16 rounding may still part on a tie)
    assert rel_rms(want["latent"][:2].float(), latent[:2].cpu().float()) <= (1e-6 if dtype == torch.float32 else 1e-3)
