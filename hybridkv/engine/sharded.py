"""The engine of a model sharded over several processes (one per GPU, or CPU ranks in tests).

Every rank runs the same `EngineCore` over its shard: the same scheduler, block tables, prefix
cache and window policies, and (attention's KV head being every rank's) the same KV cache. Rank
0 is the leader: the caller (`LLM`, the server's driver) talks to its `ShardedEngine`, which
broadcasts each request, abort and step to the workers before doing it itself, so that every
rank takes the same steps in the same order. The model's collectives inside each forward keep
the ranks' numbers together; sampling agrees because every rank holds the same gathered logits
and a request's generator is seeded by the leader.

Before each forward the ranks compare a fingerprint of what they scheduled (requests, positions,
slots and block tables: every rank's paged cache holds the same blocks); a difference stops
the engine with `RankDivergence` rather than letting the shards compute different batches. A
rank that dies ends the others' next collective with `RankFailure` (torch.distributed's timeout,
`--distributed-timeout`); the leader also checks its workers' processes before each command.

Workers are started by `start` as spawned processes (tcp rendezvous on localhost), or by torchrun
(`run_torchrun_worker`; env:// rendezvous, several hosts with `--nnodes`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hybridkv.distributed import group
from hybridkv.distributed.group import DistributedError, Parallel, RankFailure
from hybridkv.errors import ConfigError, RequestError

log = logging.getLogger("hybridkv.distributed")

START_TIMEOUT_S = 600.0     # loading a shard of a large checkpoint


class RankDivergence(DistributedError):
    """The ranks scheduled different work for the same step."""


@dataclass
class LaunchSpec:
    """What every rank needs to build its part of the engine."""
    model_dir: str
    device: str
    dtype: str | None
    engine_config: object          # EngineConfig (the same on every rank)
    world: int
    experts: str = "ep"
    reduce: str = "sum"
    tokenizer_path: str | None = None   # default: the model directory's

    @classmethod
    def of(cls, model_dir, device, dtype, ec, tokenizer_path=None) -> "LaunchSpec":
        world = ec.tensor_parallel_size
        experts = "tp" if ec.expert_parallel_size == 1 and world > 1 else "ep"
        return cls(str(model_dir), str(device), None if dtype is None else str(dtype).removeprefix("torch."),
                   ec, world, experts, ec.parallel_reduce, None if tokenizer_path is None else str(tokenizer_path))

    def rank(self, r: int) -> Parallel:
        return Parallel(r, self.world, self.experts, self.reduce)


def check_supported(spec: LaunchSpec) -> None:
    """Refuse what several ranks cannot keep in step, with the reason."""
    from hybridkv.memory import parse_policy
    ec = spec.engine_config
    cuda = torch.device(spec.device).type == "cuda"
    if spec.world > 1 and cuda and spec.reduce == "ordered" and ec.cuda_graphs:
        raise ConfigError("parallel_reduce 'ordered' runs the routed experts expert by expert (host-synchronising), "
                          "which a captured decode step cannot: add --enforce-eager (cuda_graphs=False)")
    if spec.world > 1 and cuda and ec.cuda_graphs and group.backend_for(spec.device) == "gloo":
        raise ConfigError("gloo collectives on CUDA (HYBRIDKV_DIST_BACKEND=gloo) cannot be captured in the decode "
                          "CUDA graphs: add --enforce-eager (cuda_graphs=False), or use NCCL")
    if spec.world > 1 and cuda and parse_policy(ec.memory_policy).offloads:
        raise ConfigError(f"memory policy {ec.memory_policy!r} with {spec.world} ranks on CUDA: each GPU's recall "
                          f"copies arrive at their own time, so the ranks would attend over different entries; "
                          f"use one GPU, or the policy 'full'")


def build_rank(spec: LaunchSpec, par: Parallel):
    """(model, tokenizer, EngineCore) of rank `par.rank`: its shard read from its slices only."""
    from hybridkv.engine.config import resolve_dtype
    from hybridkv.engine.core import EngineCore
    from hybridkv.engine.tokenizer import Tokenizer
    from hybridkv.memory import parse_policy
    from hybridkv.memory.indexer import FILENAME as MEMORY_INDEXER_FILE
    from hybridkv.weights import checkpoint_identity, load_model

    device = group.rank_device(spec.device, par)
    model, _ = load_model(spec.model_dir, device=device, dtype=resolve_dtype(spec.dtype, device), parallel=par)
    # every rank detokenizes (stop strings end requests on all of them at the same step)
    tokenizer = (Tokenizer(Path(spec.tokenizer_path)) if spec.tokenizer_path
                 else Tokenizer.from_model_dir(Path(spec.model_dir)))
    ec = spec.engine_config
    if ec.memory_indexer is None and parse_policy(ec.memory_policy).needs_query:
        ec = replace(ec, memory_indexer=str(Path(spec.model_dir) / MEMORY_INDEXER_FILE))
    identity = checkpoint_identity(spec.model_dir)
    if not par.single:   # each rank's lower tiers hold its own copy (disk files, Redis keys)
        identity = f"{identity}-rank{par.rank}of{par.world}"
    engine = EngineCore(model, tokenizer, identity, ec)
    if engine.tiers is not None and not par.single:
        engine.tiers.lockstep = True
    return model, tokenizer, engine


def _schedule_fingerprint(chunks) -> int:
    h = hashlib.blake2b(digest_size=8)
    for c in chunks:
        cache = c.seq.cache
        table = (cache.slot, cache.block_table) if cache is not None else None
        h.update(f"{c.seq.request_id}:{c.start}:{c.length}:{int(c.wants_logits)}:{table};".encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def _join(engine, par: Parallel, spec: LaunchSpec, init_method: str) -> None:
    """Join the world and have `engine` compare each step's schedule with the other ranks'."""
    group.connect(par, init_method, spec.device, spec.engine_config.distributed_timeout)

    def check(chunks) -> None:
        mine = _schedule_fingerprint(chunks)
        if len(set(par.all_gather_ints(mine))) > 1:
            raise RankDivergence(f"rank {par.rank}: the ranks scheduled different work for step "
                                 f"{engine.stats.steps}; the sharded engine stops rather than compute it")
    engine.schedule_check = check


def serve_commands(engine, par: Parallel) -> None:
    """A worker's loop: the leader's commands, in its order, until it closes."""
    while True:
        cmd = par.broadcast(None)
        kind = cmd[0]
        if kind == "step":
            engine.step()
        elif kind == "add":
            try:
                engine.add_request(*cmd[1:])
            except RequestError:     # refused on the leader too: it never broadcasts those
                log.exception("rank %d refused a request the leader took", par.rank)
                raise
        elif kind == "abort":
            engine.abort(cmd[1])
        elif kind == "close":
            engine.close()
            return
        else:
            raise RuntimeError(f"unknown command {kind!r} from the leader")


def _worker_main(spec: LaunchSpec, rank: int, init_method: str, ready_fd: int, threads: int) -> None:
    """A spawned worker (`python -m hybridkv.engine.sharded_worker`): build the shard, report to the
    leader through `ready_fd` (an empty line, or the error), join the world, serve commands."""
    if threads:
        torch.set_num_threads(threads)
    _exit_with_leader()
    par = spec.rank(rank)
    with os.fdopen(ready_fd, "w") as ready:
        try:
            _, _, engine = build_rank(spec, par)
        except BaseException as e:   # noqa: BLE001 - reported to the leader, which raises it
            ready.write(f"{type(e).__name__}: {e}".replace("\n", " ") + "\n")
            raise SystemExit(2) from None
        ready.write("\n")
    try:
        _join(engine, par, spec, init_method)
        serve_commands(engine, par)
    except (RankFailure, RankDivergence) as e:
        log.error("rank %d stops: %s", rank, e)
        raise SystemExit(3) from None
    finally:
        group.leave(par)


def _exit_with_leader() -> None:
    """End this worker when the leader's process is gone (a leader that exits without close()
    would otherwise leave it waiting for a command until the collective timeout)."""
    leader = os.getppid()

    def watch() -> None:
        while os.getppid() == leader:
            time.sleep(1.0)
        os._exit(4)

    threading.Thread(target=watch, name="hybridkv-leader-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ShardedEngine:
    """Rank 0's engine: an `EngineCore` (what the caller reads: stats, requests, store) whose
    every request, abort and step is sent to the workers first."""

    def __init__(self, core, par: Parallel, procs: list | None = None):
        self.core, self.parallel, self._procs = core, par, procs or []
        self._seeds = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self._closed = False

    _OWN = frozenset({"core", "parallel", "_procs", "_seeds", "_closed"})

    def __getattr__(self, name):          # reads and settings go to rank 0's engine
        return getattr(self.__dict__["core"], name)

    def __setattr__(self, name, value) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.core, name, value)

    def _send(self, cmd: tuple) -> None:
        for rank, p in enumerate(self._procs, start=1):
            if p.poll() is not None:
                raise RankFailure(f"rank {rank} (pid {p.pid}) has exited with code {p.returncode}; "
                                  f"the sharded engine cannot continue")
        self.parallel.broadcast(cmd)

    def add_request(self, prompt, params=None, request_id: str | None = None):
        from hybridkv.engine.sampling import SamplingParams
        params = params or SamplingParams()
        if params.seed is None:   # every rank must draw the same tokens
            params = replace(params, seed=int(torch.randint(0, 2**62, (), generator=self._seeds)))
        seq = self.core.add_request(prompt, params, request_id)     # refused here: never sent
        self._send(("add", list(seq.prompt_ids), params, seq.request_id))
        return seq

    def abort(self, request_id: str) -> None:
        if request_id in self.core.requests:
            self._send(("abort", request_id))
        self.core.abort(request_id)

    def step(self):
        self._send(("step",))
        return self.core.step()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("close",))
        except RankFailure as e:
            log.error("closing the sharded engine: %s", e)
        self.core.close()
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        group.leave(self.parallel)


def start(spec: LaunchSpec, threads: int | None = None) -> tuple[ShardedEngine, object]:
    """Start ranks 1..world-1 as processes, build rank 0 here, connect them all. Returns (the
    leader's engine, rank 0's model). Workers are fresh interpreters (`python -m
    hybridkv.engine.sharded_worker`), so the caller's script is never imported again."""
    check_supported(spec)
    if (torch.device(spec.device).type == "cuda" and torch.cuda.device_count() < spec.world
            and os.environ.get("HYBRIDKV_DIST_ONE_GPU") != "1"):
        raise ConfigError(f"tensor_parallel_size {spec.world} needs {spec.world} GPUs; "
                          f"{torch.cuda.device_count()} are visible")
    if threads is None and torch.device(spec.device).type == "cpu":
        # the leader's thread count: a float32 GEMM's sums can depend on how many threads split it,
        # and every rank must compute what the others (and one process) compute
        threads = torch.get_num_threads()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs, pipes, par = [], [], None
    try:
        for r in range(1, spec.world):
            read_fd, write_fd = os.pipe()
            p = subprocess.Popen([sys.executable, "-m", "hybridkv.engine.sharded_worker", str(write_fd)],
                                 stdin=subprocess.PIPE, pass_fds=(write_fd,))
            os.close(write_fd)
            p.stdin.write(pickle.dumps((spec, r, init_method, threads or 0)))
            p.stdin.close()
            procs.append(p)
            pipes.append(os.fdopen(read_fd))
        par = spec.rank(0)
        model, _, engine = build_rank(spec, par)
        _wait_ready(procs, pipes)
        _join(engine, par, spec, init_method)
    except BaseException:
        for p in procs:
            p.kill()
        group.leave(par)
        raise
    finally:
        for f in pipes:
            f.close()
    return ShardedEngine(engine, par, procs), model


def _wait_ready(procs: list, pipes: list) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for rank, (p, f) in enumerate(zip(procs, pipes), start=1):
        left = deadline - time.monotonic()
        got, _, _ = select.select([f], [], [], max(0.0, left))
        if not got:
            raise RankFailure(f"rank {rank} did not load its shard within {START_TIMEOUT_S:.0f} s")
        line = f.readline()
        if line == "":
            raise RankFailure(f"rank {rank} exited with code {p.wait()} while loading its shard")
        if line.strip():
            raise ConfigError(f"rank {rank} could not build its shard: {line.strip()}")


def _torchrun_rank(spec: LaunchSpec) -> int | None:
    """This process's rank when torchrun started several (RANK / WORLD_SIZE), else None."""
    env = group.torchrun_env()
    if env is None or env[1] == 1:
        return None
    if env[1] != spec.world:
        raise ConfigError(f"torchrun started {env[1]} processes; tensor_parallel_size is {spec.world}")
    return env[0]


def run_torchrun_worker(spec: LaunchSpec) -> bool:
    """Under torchrun, on ranks other than 0: build the shard and serve the leader's commands
    until it closes, then return True (the caller exits); elsewhere return False."""
    rank = _torchrun_rank(spec)
    if not rank:
        return False
    par = spec.rank(rank)
    _, _, engine = build_rank(spec, par)
    try:
        _join(engine, par, spec, "env://")
        serve_commands(engine, par)
    finally:
        group.leave(par)
    return True


def build_engine(model_dir, device, dtype, ec, tokenizer_path=None):
    """(engine, rank 0's model) of a sharded engine: under torchrun this process is rank 0 and
    the others run `run_torchrun_worker`; otherwise the workers are started here."""
    spec = LaunchSpec.of(model_dir, device, dtype, ec, tokenizer_path)
    if _torchrun_rank(spec) is None:
        return start(spec)
    check_supported(spec)
    par = spec.rank(0)
    model, _, engine = build_rank(spec, par)
    _join(engine, par, spec, "env://")
    return ShardedEngine(engine, par), model
