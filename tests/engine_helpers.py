"""Small helpers the engine, tier and training tests share."""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against b."""
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def prompts_of(lengths, seed=0, vocab=512) -> list[list[int]]:
    """Seeded random token prompts of the given lengths (ids 2..vocab-1: no BOS/EOS)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


aten = torch.ops.aten
# a value read back by the host, a shape that depends on values, a tensor made from host data
HOST_BOUND = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
              aten.bincount, aten.lift_fresh, aten.lift_fresh_copy, aten.equal, aten.is_nonzero}


class HostReadRecorder(TorchDispatchMode):
    """Counts the host-bound operations dispatched inside it, and `Tensor.tolist` (a host read that
    dispatches no operator on the CPU): what a CUDA-graph capture refuses, checked on the CPU."""

    def __init__(self):
        super().__init__()
        self.flagged = Counter()
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        recorder, tolist = self, self._tolist

        def counted_tolist(t, *args, **kwargs):
            recorder.flagged["tolist"] += 1
            return tolist(t, *args, **kwargs)
        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket
        if op in HOST_BOUND:
            self.flagged[str(op)] += 1
        elif op in (aten.index, aten.index_put, aten.index_put_) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            self.flagged["boolean mask indexing"] += 1
        return func(*args, **(kwargs or {}))
