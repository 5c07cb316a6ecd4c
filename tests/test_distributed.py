"""The sharded engine on the CPU (gloo; each test starts its ranks as processes): logits of
prefill and 20 decode steps against one process, prefix hits, sliced loading, and the engine
stopping with an error when a rank dies or stops answering."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybridkv.engine.sharded import RankDivergence, ShardedEngine
from hybridkv.distributed.group import Parallel, RankFailure
from hybridkv.distributed.sharding import checkpoint_slices
from hybridkv.engine import LLM, SamplingParams
from hybridkv.errors import ConfigError
from hybridkv.weights import checkpoint_files, load_model

FIXTURES = Path(__file__).parent / "fixtures"
STEPS = 20
# a ragged batch: lengths across the ratio-4 and ratio-128 compression blocks, then the first two
# prompts' heads again (prefix hits) with new tails
PROMPTS = [list(range(5, 5 + 150)), list(range(100, 100 + 33)), [7, 8, 9]]
LONG = (PROMPTS, [PROMPTS[0][:136] + [11, 12, 13], PROMPTS[1] + [14, 15]])
# a ragged batch that stays below the indexer's top-k (16 entries of 4 tokens on the fixtures)
SHORT = ([list(range(100, 100 + 33)), [7, 8, 9], list(range(300, 300 + 24))],)


@pytest.fixture(autouse=True)
def one_thread():
    """Every rank and the one-process baseline on one thread: a float32 GEMM's sums depend on how
    many threads split it (the ranks use the leader's count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _decode(model_dir, rounds_of_prompts, **options):
    """Greedy outputs, every emitted row's logits and the cached prompt tokens of each request, for
    each round of prompts (one engine: a later round can hit an earlier one's prefix)."""
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, num_blocks=128, **options) as llm:
        llm.engine.record_logits = True
        llm.engine.finished = {}
        rounds = []
        for prompts in rounds_of_prompts:
            outs = llm.generate(prompts, sp)
            assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
            rounds.append([(o.output_ids, torch.stack(llm.engine.finished[o.request_id].step_logits),
                            o.cached_tokens) for o in outs])
    if isinstance(llm.engine, ShardedEngine):
        # closing frees the process group now: a handle kept until the interpreter's exit lets
        # gloo's threads abort the process there
        assert llm.engine.parallel.group is None and llm.engine.parallel.control is None
        assert not torch.distributed.is_initialized()
    return rounds


_BASELINES: dict[tuple, list] = {}


def _baseline(model_dir: Path, rounds_of_prompts, common: dict):
    key = (str(model_dir), id(rounds_of_prompts), tuple(sorted(common.items())))
    if key not in _BASELINES:
        _BASELINES[key] = _decode(model_dir, rounds_of_prompts, **common)
    return _BASELINES[key]


def _compare(model_dir: Path, rounds_of_prompts, bound: float, common: dict | None = None, **options) -> float:
    """The sharded engine (`options`) against one process, both with `common`."""
    common = common or {}
    base = _baseline(model_dir, rounds_of_prompts, common)
    shard = _decode(model_dir, rounds_of_prompts, **common, **options)
    worst = 0.0
    for round_base, round_shard in zip(base, shard):
        for (ids_a, logits_a, cached_a), (ids_b, logits_b, cached_b) in zip(round_base, round_shard):
            assert logits_a.shape == logits_b.shape == (STEPS, logits_a.shape[1])
            worst = max(worst, (logits_a - logits_b).abs().max().item())
            assert ids_a == ids_b
            assert cached_a == cached_b
    assert worst <= bound, worst
    if len(shard) > 1:
        assert sum(c for _, _, c in shard[1]) > 0      # the second round did hit the prefix cache
    return worst


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory) -> Path:
    """A random float checkpoint with 16 routed experts."""
    out = tmp_path_factory.mktemp("wide-moe") / "ckpt"
    subprocess.run([sys.executable, "-m", "hybridkv.tools.random_checkpoint", str(out), "--preset", "v4-tiny",
                    "--experts", "16", "--layers", "3"], check=True, capture_output=True)
    return out


# float32 round-off of partial sums added across ranks: measured up to 3.6e-6 on logits of about 4.
# The sum layouts are held to it where no quantiser or top-k sits near a tie: past the indexer's
# top-k, an FP8 / FP4 cache rounding or a selection can turn that round-off into a whole step
# (measured: 5.7e-5 at the 150-token prefill, 1.1e-2 later), which the ordered reduce avoids.
SUM_BOUND = 2e-5


@pytest.mark.parametrize("world,experts", [(2, None), (4, None), (2, 1)],
                         ids=["2-ranks-expert-parallel", "4-ranks-heads-within-groups", "2-ranks-expert-width"])
def test_sum_layouts_equal_one_process_within_round_off(world, experts):
    _compare(FIXTURES / "v4-tiny", SHORT, SUM_BOUND, tensor_parallel_size=world, expert_parallel_size=experts)


def test_wide_moe_checkpoint_splits_its_experts(wide_moe):
    _compare(wide_moe, SHORT, SUM_BOUND, tensor_parallel_size=4)
    assert _compare(wide_moe, LONG, 0.0, tensor_parallel_size=4, parallel_reduce="ordered") == 0.0


@pytest.mark.parametrize("fixture,world", [("v4-tiny", 4), ("v4-tiny-fp8", 2), ("v41-tiny", 2),
                                           ("v41-tiny-fp8", 4)])
def test_ordered_reduce_is_one_process_to_the_bit(fixture, world):
    """Ragged batches across both compression ratios, 20 decode steps, then prefix hits: the
    ordered reduce gives the one process's logits to the bit on every fixture (V4.1 included)."""
    assert _compare(FIXTURES / fixture, LONG, 0.0, tensor_parallel_size=world, parallel_reduce="ordered") == 0.0


_ELEMENT = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E8M0": 1}


@pytest.mark.parametrize("policy", ["zero", "checkpoint(256)"])
def test_window_policies_keep_the_ranks_together(policy):
    """Prefix hits under the bounded-replay window policies: the same hits, replays and logits."""
    assert _compare(FIXTURES / "v4-tiny", LONG, 0.0, common={"window_policy": policy}, tensor_parallel_size=2,
                    parallel_reduce="ordered") == 0.0


def _stored_bytes(model_dir: Path, model) -> int:
    """What the rank's tensors take in the checkpoint's own dtypes."""
    files, where = checkpoint_files(model_dir), checkpoint_slices(model)
    total = 0
    for name, t in model.state_dict().items():
        ckpt = where[name][0]
        with safe_open(files[ckpt], "pt") as f:
            total += t.numel() * _ELEMENT[f.get_slice(ckpt).get_dtype()]
    return total


def test_each_rank_reads_only_its_slices(wide_moe):
    whole, _ = load_model(wide_moe)
    whole_bytes = whole.bytes_loaded
    assert whole_bytes == _stored_bytes(wide_moe, whole)
    expert_bytes = sum(t.nbytes for n, t in whole.state_dict().items() if ".experts." in n)
    shards = [load_model(wide_moe, parallel=Parallel(r, 4))[0] for r in range(4)]
    for r, m in enumerate(shards):
        assert m.bytes_loaded == _stored_bytes(wide_moe, m) < whole_bytes   # its own tensors' bytes, nothing more
        where = checkpoint_slices(m)
        names = [n for n in m.state_dict() if ".experts." in n and n.startswith("layers.1.")]
        assert {where[n][0].split(".")[4] for n in names} == {str(e) for e in range(4 * r, 4 * r + 4)}
        # its experts hold the checkpoint's values of those experts
        e0 = 4 * r
        assert torch.equal(m.layers[1].ffn.experts[0].w1.weight, whole.layers[1].ffn.experts[e0].w1.weight)
        assert torch.equal(m.layers[1].attn.wq_b.weight,
                           whole.layers[1].attn.wq_b.weight.unflatten(0, (4, -1))[r])
    assert sum(sum(t.nbytes for n, t in m.state_dict().items() if ".experts." in n) for m in shards) == expert_bytes


def test_a_layout_that_does_not_divide_is_refused():
    with pytest.raises(ConfigError, match="cannot be split over 3 ranks"):
        load_model(FIXTURES / "v4-tiny", parallel=Parallel(0, 3))
    with pytest.raises(ConfigError, match="expert_parallel_size"):
        LLM(FIXTURES / "v4-tiny", tensor_parallel_size=2, expert_parallel_size=4)


def test_a_rank_that_stops_answering_ends_the_engine_with_an_error():
    """A worker frozen (SIGSTOP) mid-run: the leader's next collective times out with RankFailure
    within the timeout instead of hanging; a worker killed: refused before the next command."""
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(FIXTURES / "v4-tiny", tensor_parallel_size=2, distributed_timeout=5.0)
    try:
        assert llm.generate([PROMPTS[1]], sp)[0].finish_reason == "length"
        worker = llm.engine._procs[0]
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="another rank has died or stopped answering"):
            llm.generate([PROMPTS[0]], sp)
        assert time.monotonic() - t0 < 30
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        with pytest.raises(RankFailure, match="rank 1 .* has exited"):
            llm.engine.step()
    finally:
        if llm.engine._procs[0].poll() is None:
            llm.engine._procs[0].kill()
        llm.close()


def test_ranks_that_schedule_differently_stop_the_engine():
    """Each step's schedule is compared across ranks before its forward."""
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm = LLM(FIXTURES / "v4-tiny", tensor_parallel_size=2, distributed_timeout=10.0)
    try:
        llm.engine.core.add_request([1, 2, 3], sp)     # on the leader alone
        with pytest.raises(RankDivergence, match="scheduled different work"):
            llm.engine.step()
    finally:
        for p in llm.engine._procs:
            p.kill()
        llm.close()


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _port_below_ephemeral_range() -> int:
    """A free port for a server that starts ranks before it binds: their rendezvous and gloo's pair
    sockets take ephemeral ports, and one of them once took a port chosen the usual way (bind to 0,
    release) before the server bound it. Ports below the ephemeral range are never handed out so."""
    import random
    import socket

    bounds = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(bounds.read_text().split()[0]) if bounds.exists() else 32768
    for port in random.Random(os.getpid()).sample(range(max(1024, low - 8000), low), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


def test_serve_stops_with_an_error_when_a_rank_dies(tmp_path):
    """`hybridkv serve --tensor-parallel-size 2`: a request is answered; after its worker rank is
    killed, the next request fails and the server exits with an error naming the lost rank."""
    import httpx

    port = _port_below_ephemeral_range()
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", str(FIXTURES / "v4-tiny"),
                                 "--tokenizer", str(FIXTURES / "tokenizer-tiny" / "tokenizer.json"),
                                 "--tensor-parallel-size", "2", "--distributed-timeout", "5", "--port", str(port),
                                 "--num-blocks", "64", "--log-level", "warning"],
                                stdout=err, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        body = {"model": "v4-tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        workers = _children(proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code >= 500 or "error" in r.text
        except httpx.HTTPError:   # the server may close the connection as it stops
            pass
        assert proc.wait(timeout=30) != 0
        text = log.read_text()
        assert "hybridkv serve stopped: RankFailure" in text, text[-2000:]
        assert "rank 1" in text or "another rank has died" in text
    finally:
        if proc.poll() is None:
            proc.kill()


def test_torchrun_starts_the_same_engine(tmp_path):
    """`torchrun --nproc-per-node 2 -m hybridkv.cli generate ... --tensor-parallel-size 2`: rank 0
    prints what one process prints (env:// rendezvous, the workers from torchrun)."""
    args = ["generate", str(FIXTURES / "v4-tiny"), "--prompt-ids", " ".join(map(str, PROMPTS[1])),
            "--max-tokens", "8", "--temperature", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "hybridkv.cli", *args], capture_output=True, text=True, env=env,
                         timeout=120)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), "-m", "hybridkv.cli", *args,
                          "--tensor-parallel-size", "2", "--parallel-reduce", "ordered"],
                         capture_output=True, text=True, env=env, timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    assert _token_line(one.stdout) == _token_line(two.stdout) is not None


def _token_line(out: str):
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return lines[0] if lines else None


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _disk_round_two(model_dir: Path, disk: Path, **options):
    """Round one in one engine, round two in a fresh engine over the same disk tier: the second
    round's prefixes come from disk (each rank reads its own files)."""
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    tiers = {"dram_bytes": 0, "disk_dir": str(disk)}
    with LLM(model_dir, num_blocks=128, tiers=tiers, **options) as llm:
        llm.generate(LONG[0], sp)
    with LLM(model_dir, num_blocks=128, tiers=tiers, **options) as llm:
        llm.engine.record_logits = True
        llm.engine.finished = {}
        outs = llm.generate(LONG[1], sp)
        return [(o.output_ids, torch.stack(llm.engine.finished[o.request_id].step_logits), o.cached_tokens)
                for o in outs]


def test_disk_tier_hits_on_every_rank(tmp_path):
    one = _disk_round_two(FIXTURES / "v4-tiny-fp8", tmp_path / "one")
    two = _disk_round_two(FIXTURES / "v4-tiny-fp8", tmp_path / "two", tensor_parallel_size=2,
                          parallel_reduce="ordered")
    assert sum(c for _, _, c in one) > 0
    for (ids_a, logits_a, cached_a), (ids_b, logits_b, cached_b) in zip(one, two):
        assert (ids_a, cached_a) == (ids_b, cached_b)
        assert torch.equal(logits_a, logits_b)
    assert {p.name for p in (tmp_path / "two").iterdir()} != set()

