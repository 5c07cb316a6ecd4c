"""The row gather (`hybridkv.ops.row_gather`): the Triton kernel against the index copy it replaces,
for rows whose bytes divide into 8-, 4-, 2- and 1-byte words, rows longer than a tile, and repeated
source rows; the public function's checks."""

import pytest
import torch

from hybridkv.ops.row_gather import _words, gather_rows_
from hybridkv.ops.row_gather import triton as kernels


@pytest.mark.parametrize("shape,dtype", [((3, 8, 16), torch.float32), ((2, 5), torch.bfloat16),
                                         ((4, 3), torch.uint8), ((2, 2500), torch.int64), ((3, 7, 2), torch.int16)])
def test_kernel_gathers_what_the_index_copy_gathers(device, shape, dtype):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 100, (9, *shape), generator=g).to(dtype)
    dst = torch.randint(0, 100, (6, *shape), generator=g).to(dtype)
    src_rows, dst_rows = torch.tensor([4, 0, 8, 4]), torch.tensor([5, 1, 0, 3])
    want = dst.clone()
    want[dst_rows] = src[src_rows]
    src, dst = src.to(device), dst.to(device)
    kernels.gather_rows(_words(dst), dst_rows.to(device), _words(src), src_rows.to(device))
    assert torch.equal(dst.cpu(), want)


def test_words_takes_the_widest_type_the_row_divides_into():
    assert _words(torch.zeros(2, 3, dtype=torch.float32)).dtype == torch.int32
    assert _words(torch.zeros(2, 4, dtype=torch.float32)).dtype == torch.int64
    assert _words(torch.zeros(2, 3, dtype=torch.uint8)).dtype == torch.uint8
    assert _words(torch.zeros(2, 3, dtype=torch.bfloat16)).dtype == torch.int16


def test_gather_rows_checks_its_arguments():
    a, b = torch.zeros(3, 4), torch.zeros(3, 5)
    with pytest.raises(ValueError, match="rows of"):
        gather_rows_(a, torch.tensor([0]), b, torch.tensor([0]))
    with pytest.raises(ValueError, match="source rows"):
        gather_rows_(a, torch.tensor([0, 1]), a.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows_(a, torch.tensor([0]), torch.zeros(4, 3).t(), torch.tensor([0]))
    dst = torch.zeros(3, 4)
    gather_rows_(dst, torch.tensor([2]), torch.ones(3, 4), torch.tensor([1]))
    assert dst[2].eq(1).all() and dst[:2].eq(0).all()
