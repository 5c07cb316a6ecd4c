"""The process group one sharded model computes over: `Parallel` (this process's rank, the world,
the collectives the model calls) and how a process joins it (`connect`).

A world of one is the single-process engine: every collective is then the identity, so the
sharded code path and the plain one are the same code. Collectives run on torch.distributed
(NCCL on CUDA, gloo on the CPU) with a timeout, so a rank that dies ends the others' next
collective with an error instead of a hang.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridkv.errors import ConfigError

DEFAULT_TIMEOUT_S = 120.0
REDUCES = ("sum", "ordered")
_HEADER_BYTES = 64      # a command's broadcast: its pickled length (int64), then up to 56 bytes of it


class DistributedError(RuntimeError):
    """A sharded engine cannot go on (its server stops rather than keep failing requests)."""


class RankFailure(DistributedError):
    """A collective failed or timed out: another rank died or stopped answering."""


@dataclass(eq=False)
class Parallel:
    """This process's place in a world of `world` ranks. `group` (the collectives of the forward)
    and `control` (the engine's commands, always on the CPU: gloo) are set by `connect`; a world of
    one has neither."""
    rank: int = 0
    world: int = 1
    experts: str = "ep"      # routed experts: "ep" whole experts per rank, "tp" every expert's width split
    # "sum": attention heads, vocabulary and experts split, partial sums added across ranks (float
    # round-off differs from one process, and quantised activations can turn that into a rounding
    # step); "ordered": only the routed experts (and the embedding) split, every pair's output
    # gathered and added in the one-process order: the one process's results to the bit
    reduce: str = "sum"
    group: object | None = field(default=None, repr=False)
    control: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank} of a world of {self.world}")
        if self.experts not in ("ep", "tp"):
            raise ConfigError(f"routed experts split {self.experts!r}: use 'ep' (expert parallel) or 'tp'")
        if self.reduce not in REDUCES:
            raise ConfigError(f"parallel reduce {self.reduce!r}: use one of {', '.join(REDUCES)}")
        if self.reduce == "ordered" and self.experts == "tp" and self.world > 1:
            raise ConfigError("parallel reduce 'ordered' needs whole experts per rank (expert parallel): a split "
                              "expert's partial sums cannot be added in the one-process order")

    @property
    def ordered(self) -> bool:
        return self.reduce == "ordered" and self.world > 1

    @property
    def single(self) -> bool:
        return self.world == 1

    def part(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of n items; an error names `what` when n does
        not divide evenly."""
        if n % self.world:
            raise ConfigError(f"{what}: {n} do not split evenly over {self.world} ranks")
        size = n // self.world
        return self.rank * size, (self.rank + 1) * size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of t over the ranks, in place (every rank receives the same values)."""
        if self.single:
            return t
        _collective(dist.all_reduce, t, group=self.group)
        return t

    def gather_columns(self, t: torch.Tensor, total: int) -> torch.Tensor:
        """[N, chunk] per rank (rank r's columns r·chunk onward, the last one's padded) -> [N, total]."""
        if self.single:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        _collective(dist.all_gather, parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :total]

    def broadcast(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (pickled, over the CPU group: the engine's commands). A small
        object (a step's command) travels inside the fixed-size header: one collective a step where
        torch's broadcast_object_list takes two."""
        if self.single:
            return obj
        header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            data = pickle.dumps(obj)
            header[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            if len(data) <= _HEADER_BYTES - 8:
                header[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        _collective(dist.broadcast, header, src=0, group=self.control)
        n = int(header[:8].view(torch.int64))
        if n <= _HEADER_BYTES - 8:
            payload = header[8:8 + n]
        else:
            payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
                       else torch.empty(n, dtype=torch.uint8))
            _collective(dist.broadcast, payload, src=0, group=self.control)
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def all_gather_ints(self, value: int) -> list[int]:
        """Every rank's `value` (int64), over the CPU group."""
        if self.single:
            return [value]
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        _collective(dist.all_gather, parts, torch.tensor([value], dtype=torch.int64), group=self.control)
        return [int(p) for p in parts]


SINGLE = Parallel()     # the whole model in one process (never connected)


def _collective(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except RankFailure:
        raise
    except Exception as e:   # gloo and NCCL raise RuntimeError (or DistBackendError) with the peer's failure
        raise RankFailure(f"a collective across the ranks failed ({type(e).__name__}: {str(e)[:300]}); "
                          f"another rank has died or stopped answering") from e


def backend_for(device: str | torch.device) -> str:
    """NCCL on CUDA, gloo on the CPU; HYBRIDKV_DIST_BACKEND=gloo forces gloo (ranks sharing one
    GPU in tests: NCCL refuses two ranks on one device)."""
    forced = os.environ.get("HYBRIDKV_DIST_BACKEND")
    if forced:
        if forced not in ("gloo", "nccl"):
            raise ConfigError(f"HYBRIDKV_DIST_BACKEND={forced!r}: use gloo or nccl")
        return forced
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def connect(par: Parallel, init_method: str, device: str | torch.device,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> Parallel:
    """Join `par`'s world (init_method: "tcp://host:port", or "env://" under torchrun) and give it
    its groups. One world per process. On CUDA, rank r computes on the device's index plus r."""
    if par.single:
        return par
    if dist.is_initialized():
        raise ConfigError("this process already belongs to a torch.distributed world; one sharded engine "
                          "per process")
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(_rank_device(dev, par.rank))
    timeout = timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend_for(dev), init_method=init_method, rank=par.rank, world_size=par.world,
                                timeout=timeout)
    except Exception as e:
        raise RankFailure(f"rank {par.rank} could not join the world of {par.world} at {init_method}: {e}") from e
    par.group = dist.group.WORLD
    par.control = dist.new_group(backend="gloo", timeout=timeout) if backend_for(dev) != "gloo" else par.group
    return par


def _rank_device(dev: torch.device, rank: int) -> torch.device:
    if os.environ.get("HYBRIDKV_DIST_ONE_GPU") == "1":   # tests: every rank on the one device given
        return torch.device("cuda", dev.index or 0)
    return torch.device("cuda", (dev.index or 0) + rank)


def rank_device(device: str | torch.device, par: Parallel) -> torch.device:
    """The device rank `par.rank` computes on: the same CPU, or the rank's own GPU."""
    dev = torch.device(device)
    return _rank_device(dev, par.rank) if dev.type == "cuda" and not par.single else dev


def leave(par: Parallel | None = None) -> None:
    """Leave the world this process joined (no-op if none), and drop `par`'s handles on its groups.
    The handles must go: a process group that a Python reference keeps alive past
    destroy_process_group is freed by the interpreter's last garbage collection, while gloo's
    worker threads still release tensors, which aborts the process at exit ("terminate called
    without an active exception")."""
    if par is not None:
        par.group = par.control = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:   # a world whose peers are already gone: nothing left to release cleanly
            pass


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world) when started by torchrun (RANK / WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
