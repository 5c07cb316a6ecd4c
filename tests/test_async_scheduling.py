"""Async scheduling (engine/core.py): a graph decode step is queued before the host reads the
previous step's tokens, its input ids taken from that step's draws on the device. Checked on the CPU
through the graphs' fixed-shape forward (the same code path, run eagerly) against the engine without
it: requests that end by length, by a stop token mid-batch, a sampled request, an abort and an
arrival between steps, block boundaries crossed by queued steps, and the prefix cache those steps
register. Where the steps are the same, the logits are the same to the bit. A request that a stop
token ends still has a row in the step queued behind it, so that step's batch is one row larger
than without async scheduling: the other rows' logits differ there by the GEMMs' rounding over
another batch size (as between any two batch compositions; the tokens here do not)."""

from pathlib import Path

import pytest
import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.engine.graphs import DecodeGraphs

FP8_FIXTURE = Path(__file__).parents[1] / "tests" / "fixtures" / "v4-tiny-fp8"


def _engine(async_scheduling: bool, num_blocks: int = 64):
    llm = LLM(FP8_FIXTURE, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=2048, kv_format="fp8",
              async_scheduling=async_scheduling)
    eng = llm.engine
    eng.store.kernel_formats = ("fp8", "fp4")          # the paged path's formats (CUDA decides this itself)
    eng.graphs = DecodeGraphs(eng.model, eng.store, capture=False)
    eng.record_logits = True
    eng.finished = {}
    return eng


def _prompts():
    g = torch.Generator().manual_seed(0)
    # 1148 tokens: its decode crosses the 1152 block boundary (a new block, an HCA entry) in queued steps
    return [torch.randint(10, 500, (n,), generator=g).tolist() for n in (1148, 700, 300)]


def _drive(eng, plan):
    """Run `plan` (step index -> callable(engine)) while stepping until done; every request's
    outputs, finish reason, logprobs and step logits by request id."""
    step = 0
    while eng.has_unfinished():
        if step in plan:
            plan[step](eng)
        eng.step()
        step += 1
    return {rid: (s.output_ids, s.finish_reason, s.logprobs, torch.stack(s.step_logits) if s.step_logits else None)
            for rid, s in eng.finished.items()}


def _same(a, b, exact: bool = True):
    assert a.keys() == b.keys()
    for rid in a:
        (ids_a, why_a, lp_a, lg_a), (ids_b, why_b, lp_b, lg_b) = a[rid], b[rid]
        assert ids_a == ids_b and why_a == why_b, rid
        assert (lg_a is None) == (lg_b is None), rid
        if exact:
            assert lp_a == lp_b and (lg_a is None or torch.equal(lg_a, lg_b)), rid
        else:
            assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-5, rid
            assert lg_a is None or (lg_a - lg_b).abs().max() < 1e-4 * lg_a.abs().max(), rid


@pytest.fixture(scope="module")
def reference_tokens():
    """The tokens request 1 decodes alone: a stop token and a stop string are chosen from them."""
    eng = _engine(False)
    eng.add_request(_prompts()[1], SamplingParams(max_tokens=12, ignore_eos=True), request_id="probe")
    return _drive(eng, {})["probe"][0]


def _run(on: bool, params: list[SamplingParams]):
    eng = _engine(on)
    for i, (p, sp) in enumerate(zip(_prompts(), params)):
        eng.add_request(p, sp, request_id=f"r{i}")
    return _drive(eng, {}), eng.stats


def test_queued_decode_steps_equal_the_engine_without_them_to_the_bit():
    """Requests of different lengths (each leaves the queue when its last token is known in
    advance) and a sampled one with logprobs: the same steps, the same logits."""
    params = [SamplingParams(max_tokens=9, ignore_eos=True),
              SamplingParams(max_tokens=13, ignore_eos=True),
              SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, seed=5, logprobs=2)]
    (ref, ref_stats), (out, stats) = _run(False, params), _run(True, params)
    _same(ref, out)
    assert [len(out[f"r{i}"][0]) for i in range(3)] == [9, 13, 14]
    assert ref_stats.queued_steps == 0 and stats.queued_steps >= 10
    assert (ref_stats.graph_steps, ref_stats.steps, ref_stats.forward_tokens) == \
        (stats.graph_steps, stats.steps, stats.forward_tokens)


def test_a_sharded_engines_schedule_check_sees_every_forward_queued_ones_included():
    """The check a sharded engine's ranks compare their schedules with (engine/sharded.py) does not
    turn async scheduling off: it is called before every forward, each queued step's included, with
    that forward's chunks, and the outputs are those of the engine without queued steps."""
    params = [SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=13, ignore_eos=True),
              SamplingParams(max_tokens=14, ignore_eos=True)]
    ref, ref_stats = _run(False, params)
    eng = _engine(True)
    checked = []
    eng.schedule_check = lambda chunks: checked.append([(c.seq.request_id, c.start, c.length) for c in chunks])
    for i, (p, sp) in enumerate(zip(_prompts(), params)):
        eng.add_request(p, sp, request_id=f"r{i}")
    _same(ref, _drive(eng, {}))
    assert eng.stats.queued_steps >= 10
    # one check per forward: the scheduled ones (an empty schedule is checked too) and the queued ones
    forwards = [c for c in checked if c]
    assert len(forwards) == ref_stats.steps
    assert sum(n for step in forwards for _, _, n in step) == eng.stats.forward_tokens == ref_stats.forward_tokens
    # a queued step's check names the positions it decodes: each request's last prompt token onward
    decoded = {}
    for step in forwards:
        for rid, start, n in step:
            if n == 1:
                decoded.setdefault(rid, []).append(start)
    for i, p in enumerate(_prompts()):
        assert decoded[f"r{i}"] == list(range(len(p), len(p) + len(decoded[f"r{i}"])))


def test_a_stop_token_mid_batch_costs_one_dropped_row(reference_tokens):
    stop_token = reference_tokens[6]
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    (ref, ref_stats), (out, stats) = _run(False, params), _run(True, params)
    _same(ref, out, exact=False)
    assert out["r1"][1] == "stop" and out["r1"][0] == reference_tokens[:7]
    assert stats.forward_tokens == ref_stats.forward_tokens + 1        # r1's row in the step queued behind its stop
    assert stats.steps == ref_stats.steps


def test_abort_and_arrival_between_queued_steps():
    """An abort and a new request between steps leave the others' outputs as without async
    scheduling; the engine returns to the scheduler for the newcomer and queues again once it
    decodes."""
    prompts = _prompts()
    late = torch.randint(10, 500, (260,), generator=torch.Generator().manual_seed(7)).tolist()
    runs, engines = [], []
    for on in (False, True):
        eng = _engine(on)
        eng.add_request(prompts[0], SamplingParams(max_tokens=16, ignore_eos=True), request_id="a")
        eng.add_request(prompts[1], SamplingParams(max_tokens=16, ignore_eos=True), request_id="b")
        eng.add_request(prompts[2], SamplingParams(max_tokens=16, ignore_eos=True), request_id="c")
        plan = {4: lambda e: e.abort("b"),
                7: lambda e: e.add_request(late, SamplingParams(max_tokens=8, ignore_eos=True), request_id="late")}
        runs.append(_drive(eng, plan))
        engines.append(eng)
    _same(*runs, exact=False)
    assert runs[1]["b"][1] == "abort" and runs[1]["late"][1] == "length" and len(runs[1]["late"][0]) == 8
    assert engines[1].stats.queued_steps > 5
    # the prefix cache holds what the queued steps computed: a continuation of request a hits it
    for eng in engines:
        seq = eng.finished["a"]
        follow = eng.add_request(seq.token_ids[:1154], SamplingParams(max_tokens=1, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        assert follow.num_cached_tokens == 1152


def test_a_pool_without_the_next_blocks_falls_back_to_the_scheduler():
    """18 blocks hold the three prompts' blocks and no more: when the 1148-token request's decode
    reaches position 1152 no block is free for it, so no step is queued there; the scheduler
    preempts the newest request as it would, and the outputs are the engine's without async
    scheduling."""
    prompts = _prompts()
    runs = []
    for on in (False, True):
        eng = _engine(on, num_blocks=18)
        refused = []

        def extend(seqs, plain=eng.scheduler.extend_decodes):
            ok = plain(seqs)
            refused.append(not ok)
            return ok
        eng.scheduler.extend_decodes = extend
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True), request_id=f"r{i}")
        runs.append((_drive(eng, {}), eng.scheduler.num_preemptions, eng.stats.queued_steps, sum(refused)))
    _same(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1] == 1                 # the same preemption
    assert runs[1][3] == 1 and runs[1][2] > 3            # refused once, queued before and after
