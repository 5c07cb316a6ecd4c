"""The fused compressor kernel against pooling + finishing in plain torch."""

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


@pytest.mark.parametrize("kind,L", [("main", 8), ("main", 128), ("index", 8)], ids=["csa-main", "hca", "csa-index"])
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
