"""The engine's decode steps replayed from CUDA graphs (engine/graphs.py) against the same engine
launching the paged kernels one by one: the same answers, close logits, the window-state snapshots
the prefix cache serves later requests from, and batch-invariant logits in deterministic mode."""

from pathlib import Path

import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.eval.runner import build_samples, score
from hybridkv.ops.backend import deterministic
from hybridkv.tasks.tokenizer import TaskTokenizer

ROOT = Path(__file__).parents[2]
MODEL = ROOT / "models" / "tiny-v4"
FP8_FIXTURE = ROOT / "tests" / "fixtures" / "v4-tiny-fp8"


def _run(model, prompts, max_tokens, graphs: bool, **kw):
    llm = LLM(model, device="cuda", dtype=torch.bfloat16, num_blocks=512, max_num_seqs=len(prompts),
              max_num_batched_tokens=8192, cuda_graphs=graphs, **kw)
    llm.engine.record_logits = True
    llm.engine.finished = {}
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    logits = [torch.stack(llm.engine.finished[o.request_id].step_logits).float() for o in outs]
    return llm.engine, outs, logits


def test_graph_replays_answer_as_eager_decode():
    tok = TaskTokenizer.load(MODEL)
    samples = [s for _, s in build_samples(tok, ["passkey", "niah_single_2"], [1536, 6144], 2, seed=5)]
    prompts = [s.prompt for s in samples]
    eng, graphed, g_logits = _run(MODEL, prompts, 12, True)
    assert eng.graphs is not None and eng.graphs.captures >= 1
    assert eng.stats.graph_steps >= 11        # every pure decode step (the first token ends the prefill)
    eager_eng, eager, e_logits = _run(MODEL, prompts, 12, False)
    assert eager_eng.graphs is None and eager_eng.stats.graph_steps == 0
    for s, a, b in zip(samples, eager, graphed):
        print(f"\n{s.task} {len(s.prompt)}: eager {a.text!r} graphs {b.text!r}")
        assert a.output_ids == b.output_ids
        assert score(s, b.text) == 1.0
    worst = max(float(((a - b).norm(dim=-1) / a.norm(dim=-1)).max()) for a, b in zip(e_logits, g_logits))
    print(f"decode logits, largest relative difference: {worst:.2e} "
          f"({eng.graphs.captures} captures, {eng.graphs.replays} replays)")
    # bf16: the replayed MoE sums its routed experts inside one GEMM (one rounding) where eager decode
    # rounds each expert's output, and the kernels' split sizes follow the context bucket; over 12
    # steps × 8 prompts, the steps after the end-of-sentence token included, the H200 measured 0.105
    assert worst < 0.2


def test_graph_replays_publish_snapshots_that_serve_later_requests():
    """fp8/FP4 store, three requests, one of them completing an HCA block (position 1023) and a
    128-token window snapshot during decode: a later request continuing that request's tokens is
    served from the snapshot a replayed step published."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (1020, 700, 2100)]
    eng, _, graphed = _run(FP8_FIXTURE, prompts, 8, True, kv_format="fp8")
    _, _, eager = _run(FP8_FIXTURE, prompts, 8, False, kv_format="fp8")
    # random weights: the CSA top-k has near-ties that bf16 rounding differences flip, so these are
    # printed, not bounded (0.298 / 0.043 / 0.052 on the H200); the trained model's test bounds them
    first = [float((a[1] - b[1]).norm() / a[1].norm()) for a, b in zip(eager, graphed)]
    print(f"\nfirst decode step, relative difference: {', '.join(f'{x:.2e}' for x in first)}")
    assert eng.stats.graph_steps >= 7
    seq = next(s for s in eng.finished.values() if len(s.prompt_ids) == 1020)
    assert eng.prefix.snapshots.get(seq.block_hashes[1024 // 128 - 1]) is not None   # published by a replay
    # a new request with that prompt and the decoded tokens is served from the cache past 1024
    follow = eng.add_request(seq.token_ids[:1026], SamplingParams(max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert follow.num_cached_tokens == 1024


def test_graph_replays_are_batch_invariant_in_deterministic_mode():
    g = torch.Generator().manual_seed(1)
    target = torch.randint(10, 500, (2500,), generator=g).tolist()
    others = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (900, 3100, 40)]
    with deterministic():
        eng, _, alone = _run(FP8_FIXTURE, [target], 6, True, kv_format="fp8")
        eng_b, _, batched = _run(FP8_FIXTURE, others[:2] + [target] + others[2:], 6, True, kv_format="fp8")
    assert eng.stats.graph_steps >= 5 and eng_b.stats.graph_steps >= 5
    assert torch.equal(alone[0], batched[2])


def test_async_scheduling_decodes_as_the_engine_without_it():
    """Graph steps queued before the host reads the previous step's tokens (their input ids copied on
    the device, their host inputs from pinned memory): the same tokens as without async scheduling,
    with requests that end by length at different steps and one that a stop token ends mid-batch
    (its row stays in the step queued behind its stop token, so that step's batch is one larger)."""
    tok = TaskTokenizer.load(MODEL)
    samples = [s for _, s in build_samples(tok, ["passkey", "niah_single_2"], [1536, 3072], 2, seed=7)]
    prompts = [s.prompt for s in samples]

    def run(on: bool, stop: list[int]):
        llm = LLM(MODEL, device="cuda", dtype=torch.bfloat16, num_blocks=512, max_num_seqs=len(prompts),
                  max_num_batched_tokens=8192, async_scheduling=on)
        llm.engine.record_logits = True
        llm.engine.finished = {}
        params = [SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True, stop_token_ids=stop if i == 1 else [])
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
        logits = [torch.stack(llm.engine.finished[o.request_id].step_logits).float() for o in outs]
        return llm.engine, outs, logits

    sync_eng, ref, ref_logits = run(False, [])
    eng, out, logits = run(True, [])
    assert sync_eng.stats.queued_steps == 0 and eng.stats.queued_steps >= 10
    for s, a, b, la, lb in zip(samples, ref, out, ref_logits, logits):
        assert a.output_ids == b.output_ids and score(s, b.text) == score(s, a.text)
    worst = max(float((la - lb).abs().max()) for la, lb in zip(ref_logits, logits))
    print(f"\nlargest logit difference, the same batches with and without async scheduling: {worst:.3g}")
    assert worst < 0.05
    stop = [ref[1].output_ids[4]]
    _, ref, _ = run(False, stop)
    eng, out, _ = run(True, stop)
    assert out[1].finish_reason == "stop" and len(out[1].output_ids) <= 5
    assert [o.output_ids for o in out] == [o.output_ids for o in ref]


def test_seeded_sampling_runs_on_the_gpu_and_repeats():
    """A request with a seed draws from a generator on the engine's device (torch's CUDA sampling
    refuses a CPU generator): the same seed gives the same tokens in another run, beside greedy
    requests that finish as they would, through graph replays and async scheduling."""
    tok = TaskTokenizer.load(MODEL)
    samples = [s for _, s in build_samples(tok, ["passkey"], [1536], 3, seed=9)]
    prompts = [s.prompt for s in samples]
    params = [SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=1),
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=2, top_p=0.9)]
    runs = []
    for _ in range(2):
        llm = LLM(MODEL, device="cuda", dtype=torch.bfloat16, num_blocks=256, max_num_seqs=3,
                  max_num_batched_tokens=8192)
        runs.append(llm.generate(prompts, params))
        assert llm.engine.stats.queued_steps > 0
    for a, b in zip(*runs):
        assert a.finish_reason == b.finish_reason == "length" and len(a.output_ids) == 16
        assert a.output_ids == b.output_ids
    assert runs[0][1].output_ids != runs[0][2].output_ids


def test_v41_graph_replays_answer_as_eager_decode():
    """V4.1 in its packed layout: decode steps replayed from CUDA graphs (Full layers appending their
    entries with fixed shapes, the indexer scored by the kernels) against the same engine launching
    them one by one. Float32: the fixture's random weights turn bf16 rounding differences into
    other FP4/FP8 codes; what differs here is the MoE's summation order alone."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (900, 301, 150)]
    v41 = ROOT / "tests" / "fixtures" / "v41-tiny"
    kw = dict(kv_format="v41", dtype=torch.float32)
    llm = LLM(v41, device="cuda", num_blocks=512, max_num_seqs=3, max_num_batched_tokens=8192, cuda_graphs=True, **kw)
    llm.engine.record_logits, llm.engine.finished = True, {}
    graphed = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    eng = llm.engine
    g_logits = [torch.stack(eng.finished[o.request_id].step_logits).float() for o in graphed]
    assert eng.store.kernel_formats == ("v41", "fp4")
    assert eng.graphs is not None and eng.graphs.captures >= 1 and eng.stats.graph_steps >= 7
    eager_llm = LLM(v41, device="cuda", num_blocks=512, max_num_seqs=3, max_num_batched_tokens=8192,
                    cuda_graphs=False, **kw)
    eager_llm.engine.record_logits, eager_llm.engine.finished = True, {}
    eager = eager_llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    e_logits = [torch.stack(eager_llm.engine.finished[o.request_id].step_logits).float() for o in eager]
    worst = max(float(((a - b).norm(dim=-1) / a.norm(dim=-1)).max()) for a, b in zip(e_logits, g_logits))
    print(f"\nV4.1 decode logits, graphs against eager, largest relative difference: {worst:.2e}")
    assert [o.output_ids for o in eager] == [o.output_ids for o in graphed]
    assert worst < 1e-3


def test_flashmemory_graph_replays_answer_as_eager_decode():
    """flashmemory on the shipped model with its memory indexer: decode steps replayed from graphs
    (device pages among the inputs, the memory indexer reading the graph's own layer inputs at the
    recall 64 steps in) answer as eager decode, with the same pages recalled."""
    tok = TaskTokenizer.load(MODEL)
    samples = [s for _, s in build_samples(tok, ["passkey", "niah_single_2"], [6144], 2, seed=5)]
    prompts = [s.prompt for s in samples]
    kw = dict(memory_policy="flashmemory-0.15", enable_prefix_caching=False)
    eng, graphed, g_logits = _run(MODEL, prompts, 70, True, **kw)
    assert eng.stats.graph_steps >= 69 and eng.stats.queued_steps >= 60 and eng.stats.pages_written_back > 0
    eager_eng, eager, e_logits = _run(MODEL, prompts, 70, False, **kw)
    for s, a, b in zip(samples, eager, graphed):
        assert a.output_ids[:8] == b.output_ids[:8] and score(s, b.text) == score(s, a.text) == 1.0
    if all(a.output_ids == b.output_ids for a, b in zip(eager, graphed)):     # bf16 may part them after the answers
        assert eng.stats.pages_loaded == eager_eng.stats.pages_loaded


def test_forks_on_the_gpu_decode_what_their_request_decodes():
    """EngineCore.fork on CUDA under flashmemory (pinned host rows, device pages, graph replays): two
    copies of a prefilled passkey request answer as the request does, token for token."""
    tok = TaskTokenizer.load(MODEL)
    sample = build_samples(tok, ["passkey"], [6144], 1, seed=6)[0][1]
    llm = LLM(MODEL, device="cuda", dtype=torch.bfloat16, num_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=8192, memory_policy="flashmemory-0.15", enable_prefix_caching=False)
    eng = llm.engine
    src = eng.add_request(sample.prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    while not src.output_ids:
        eng.step()
    forks = eng.fork(src.request_id, 2)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.graph_steps >= 10
    for f in forks:
        assert f.output_ids == src.output_ids
    assert score(sample, tok.decode(src.output_ids)) == 1.0
    assert eng.store.page_pool.num_used == 0 and eng.store.pool.num_used == 0


def test_graph_replays_beyond_64_requests_answer_as_eager_decode(monkeypatch):
    """HYBRIDKV_GRAPH_BATCH=128: a decode step of 72 requests is captured and replayed (padded to 128),
    and answers what eager decode answers."""
    monkeypatch.setenv("HYBRIDKV_GRAPH_BATCH", "128")
    tok = TaskTokenizer.load(MODEL)
    samples = [s for _, s in build_samples(tok, ["passkey", "niah_single_2"], [512], 36, seed=6)]
    prompts = [s.prompt for s in samples]
    eng, graphed, _ = _run(MODEL, prompts, 8, True)
    assert len(prompts) == 72 and eng.graphs.captures >= 1 and eng.stats.graph_steps >= 7
    _, eager, _ = _run(MODEL, prompts, 8, False)
    same = sum(a.output_ids == b.output_ids for a, b in zip(eager, graphed))
    right = sum(score(s, b.text) == 1.0 for s, b in zip(samples, graphed))
    print(f"\n72 requests: {same} of 72 answer as eager decode, {right} right")
    assert same >= 70 and right >= sum(score(s, a.text) == 1.0 for s, a in zip(samples, eager)) - 2


def test_programmatic_dependent_launch_changes_no_number(monkeypatch):
    """HYBRIDKV_PDL=1 (hybridkv.ops.pdl): the decode step's kernels launched with programmatic stream
    serialization, replayed from graphs and launched eagerly, give the logits of the same step without
    it to the bit (the same kernels and reduction orders; only when each may start changes)."""
    tok = TaskTokenizer.load(MODEL)
    samples = [s for _, s in build_samples(tok, ["passkey", "niah_single_2"], [1536, 6144], 2, seed=5)]
    prompts = [s.prompt for s in samples]
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("HYBRIDKV_PDL", flag)
        for graphs in (True, False):
            eng, outs, logits = _run(MODEL, prompts, 12, graphs)
            assert (eng.stats.graph_steps >= 11) == graphs
            runs[flag, graphs] = ([o.output_ids for o in outs], logits)
    for graphs in (True, False):
        (ids0, l0), (ids1, l1) = runs["0", graphs], runs["1", graphs]
        assert ids0 == ids1
        for a, b in zip(l0, l1):
            assert torch.equal(a, b), float((a - b).abs().max())
