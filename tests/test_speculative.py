"""Speculative decoding with the MTP block (engine/speculative.py): greedy outputs equal to decoding
without speculation in ragged batches, with prefix hits, chunked prefill and preemption; rollback
that leaves the cache as a request decoded without speculation leaves it; rejection sampling that
keeps the main model's distribution."""

import random

import pytest
import torch

from engine_helpers import prompts_of, rel

from hybridkv.engine import LLM, SamplingParams
from hybridkv.engine import speculative as spec
from hybridkv.engine.sampling import filtered_probs
from hybridkv.errors import ConfigError

MODEL = "models/tiny-v4"


def make(model_dir, **kw):
    opts = dict(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=512)
    opts.update(kw)
    return LLM(model_dir, **opts)


def run(llm, prompts, max_tokens, params=None, capture=None):
    """Requests r0, r1, ... to completion; {id: output ids}. `capture` receives each request's cache
    state (`cache_state`) just before it finishes."""
    eng = llm.engine
    if capture is not None:
        finish = eng._finish

        def wrapped(seq, reason):
            capture[seq.request_id] = cache_state(eng, seq)
            finish(seq, reason)
        eng._finish = wrapped
    seqs = [eng.add_request(p, params or SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"r{i}")
            for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    eng.store.pool.check()
    assert all(b.ref_count == 0 for b in eng.store.pool.blocks)
    return {s.request_id: s.output_ids for s in seqs}


def cache_state(eng, seq) -> dict[str, torch.Tensor]:
    """Everything a request's next tokens read: the window rows of its last `window` positions, every
    compressor's state and every visible compressed entry, per layer."""
    store, c, n = eng.store, seq.cache, seq.num_computed
    W = store.config.sliding_window
    view = store.view(c)
    out = {}
    pos = torch.arange(max(c.window_start, n - W, 0), n)
    for i in range(store.num_layers):
        out[f"window {i}"] = store.codec["window"].decode(store.ring[i][c.slot][pos % W]).float()
        for kind, (kv, score) in store.states[i].items():
            out[f"state {i} {kind} kv"] = kv[c.slot].clone()
            out[f"state {i} {kind} score"] = score[c.slot].clone()
        r = store.config.layer_ratio(i)
        for kind in store.entries[i] if r else ():
            out[f"entries {i} {kind}"] = view.layer(i).entries(kind, n // r).float()
    out["num_computed"] = torch.tensor(n)
    return out


def assert_states_close(got: dict, want: dict, bound: float = 1e-4) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, name
        if name == "num_computed":
            assert int(g) == int(w)
            continue
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g)), name   # -inf score rows (empty state slots) agree
        if finite.any() and w[finite].abs().max() > 0:
            assert rel(g[finite], w[finite]) <= bound, (name, rel(g[finite], w[finite]))


class Oracle:
    """Replaces the MTP drafts with the reference continuation, wrong at a chosen position: the
    number of drafts accepted follows `plan(request, next verify position, k)`; the MTP block still
    runs (its cache is filled as usual)."""

    def __init__(self, eng, refs: dict[str, list[int]], plan, vocab: int):
        self.eng, self.refs, self.plan, self.vocab = eng, refs, plan, vocab
        self.rollbacks: list[tuple[int, int, int]] = []       # (start, kept, length) of every verify
        real_run, real_take = eng.drafter.run, spec.VerifyCheckpoint.take

        def run(work):
            drafts = real_run(work)
            for rid, d in drafts.items():
                seq = eng.requests[rid]
                truth = refs[rid][len(seq.output_ids):len(seq.output_ids) + len(d.tokens)]
                # past the reference's last token (drafts beyond max_tokens): tokens the model need not agree with
                truth += [(t + 1) % vocab for t in d.tokens[len(truth):]]
                a = min(plan(rid, seq.num_tokens - 1, len(d.tokens)), len(d.tokens))
                d.tokens = truth[:a] + [(t + 1) % vocab for t in truth[a:a + 1]] + truth[a + 1:]
            return drafts
        eng.drafter.run = run
        oracle = self

        class Recording(spec.VerifyCheckpoint):
            def rollback(self, model, m):
                oracle.rollbacks.append((self.start, m, self.length))
                super().rollback(model, m)
        spec.VerifyCheckpoint.take = classmethod(lambda cls, *a: real_take.__func__(Recording, *a))
        self._restore = lambda: setattr(spec.VerifyCheckpoint, "take", real_take)

    def close(self):
        self._restore()

    def rejected_completions(self, ratio: int) -> int:
        """Verify steps in which a rejected token completed an entry of this ratio."""
        return sum(1 for s, m, n in self.rollbacks
                   if any((p + 1) % ratio == 0 for p in range(s + m, s + n)))


def crossing_plan(seed: int):
    """Accept 0..k drafts at random, but reject right away where the verify window would complete a
    ratio-128 entry (so a rejected token completes it: ratio-4 entries are completed every 4)."""
    rng = random.Random(seed)

    def plan(rid, start, k):
        if any((p + 1) % 128 == 0 for p in range(start + 1, start + k + 1)):
            return 0
        return rng.randint(0, k)
    return plan


@pytest.fixture
def wave_sizes(monkeypatch) -> list[int]:
    """The number of requests in every verify wave the engines build (appended as they run)."""
    sizes = []
    build = spec.verify_waves

    def counted(*args, **kw):
        out = build(*args, **kw)
        sizes.extend(len(rows) for _, _, rows in out)
        return out
    monkeypatch.setattr("hybridkv.engine.core.verify_waves", counted)
    return sizes


@pytest.mark.parametrize("waves", [True, False], ids=["decode-waves", "segments"])
def test_greedy_equals_non_speculative_with_rollbacks_across_entries(fixtures, waves, wave_sizes):
    """Ragged batch with oracle drafts (accept lengths 0..3 side by side, rejected tokens completing
    ratio-4 and ratio-128 entries): outputs and the cache state at the end equal a run without
    speculation, entry by entry. The verify rows run as decode waves (several requests in one wave)
    or as segments."""
    d, k = fixtures / "v4-tiny", 3
    prompts = prompts_of([5, 122, 250], seed=1)
    want_state, oracle_state = {}, {}
    ref = run(make(d), prompts, 12, capture=want_state)
    llm = make(d, speculative="mtp", num_speculative_tokens=k, speculative_verify="waves" if waves else "segments")
    oracle = Oracle(llm.engine, ref, crossing_plan(k), llm.config.vocab_size)
    try:
        assert run(llm, prompts, 12, capture=oracle_state) == ref
    finally:
        oracle.close()
    assert (max(wave_sizes) == 3) if waves else not wave_sizes
    st = llm.engine.stats
    assert st.spec_accepted_tokens > 0 and st.spec_accepted_tokens < st.spec_draft_tokens
    assert sum(st.spec_accepted_hist) == st.spec_drafts and st.spec_accepted_hist[k] > 0
    assert oracle.rejected_completions(128) >= 2 and oracle.rejected_completions(4) >= 5
    for rid in ref:
        assert_states_close(oracle_state[rid], want_state[rid])


def test_random_mtp_block_rejects_and_outputs_stay(fixtures):
    """The fixture's random MTP block drafts wrong tokens nearly always: every step rolls back."""
    d = fixtures / "v4-tiny"
    prompts = prompts_of([30, 126], seed=6)
    ref = run(make(d), prompts, 10)
    llm = make(d, speculative="mtp", num_speculative_tokens=2)
    assert run(llm, prompts, 10) == ref
    assert llm.engine.stats.spec_drafts >= 8


def test_verify_waves_on_the_paged_path_attend_in_one_batch(fixtures, monkeypatch):
    """On the paged kernels' path the verify rows of all waves are selected and attended as one batch
    (`PagedDecodeKV.wave_rows`), ragged waves included (a request near max_tokens drafts fewer): the
    outputs and the cache state at the end equal plain decoding's on the same path, with rejected
    tokens completing ratio-4 and ratio-128 entries."""
    import hybridkv.cache.paged as paged
    d, k = fixtures / "v4-tiny", 3
    prompts = prompts_of([5, 122, 250], seed=1)
    layouts = []
    build = paged._wave_rows

    def counted(views, args):
        out = build(views, args)
        layouts.append(([len(v.positions) for v in views], out is not None))
        return out
    monkeypatch.setattr(paged, "_wave_rows", counted)
    want_state, oracle_state = {}, {}
    # the longest request nears the model length: it drafts fewer than k there (ragged waves)
    plain = make(d, max_model_len=264)
    plain.engine.store.kernel_formats = ("bf16", "bf16")          # the paged path (CUDA decides this itself)
    ref = run(plain, prompts, 14, capture=want_state)
    llm = make(d, speculative="mtp", num_speculative_tokens=k, speculative_verify="waves", max_model_len=264)
    llm.engine.store.kernel_formats = ("bf16", "bf16")
    oracle = Oracle(llm.engine, ref, crossing_plan(k), llm.config.vocab_size)
    try:
        assert run(llm, prompts, 14, capture=oracle_state) == ref
    finally:
        oracle.close()
    assert layouts and all(built for _, built in layouts)
    assert any(len(set(sizes)) > 1 for sizes, _ in layouts)        # ragged waves
    assert any(sizes == [3] * (k + 1) for sizes, _ in layouts)
    assert oracle.rejected_completions(128) >= 2 and oracle.rejected_completions(4) >= 5
    for rid in ref:
        assert_states_close(oracle_state[rid], want_state[rid])


@pytest.mark.parametrize("waves", [True, False], ids=["decode-waves", "segments"])
def test_rollback_equals_the_state_the_kept_tokens_leave(fixtures, waves, monkeypatch):
    """One verify step over positions 124..127 (k = 3) that keeps 124..125, with packed fp8/fp4
    entries: after the rollback the window rings and compressor states equal, bit for bit, those the
    same forward leaves after position 125 (each layer's state copied when it reaches 125: the verify
    rows as decode waves, or as segments cut there), and the stored entries
    position 127 completed (ratio 4 and ratio 128) are the bytes stored before the step."""
    d = fixtures / "v4-tiny-fp8"
    prompt = prompts_of([124], seed=2)[0]
    results = []
    for cut in (False, True):
        llm = make(d, speculative="mtp", num_speculative_tokens=3, kv_format="fp8",
                   speculative_verify="waves" if waves else "segments")
        eng, store = llm.engine, llm.engine.store
        seq = eng.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        eng.step()                                           # prefill: the first token, and a draft
        seq.draft = spec.Draft([5, 6, 7], None)
        (chunk,) = eng.scheduler.schedule()
        assert (chunk.start, chunk.length) == (124, 4)
        slot, table = seq.cache.slot, list(seq.cache.block_table)
        before = [{k: v[table].clone() for k, v in e.items()} for e in store.entries]
        cp = spec.VerifyCheckpoint.take(store, seq.cache, chunk.start, chunk.length)
        at_cut = {}
        if cut and waves:
            done = spec.RecordingDecodeKV.done

            def wave_done(dkv, layer_id):
                if dkv.host_positions == [125]:
                    at_cut[layer_id] = store.capture_state(slot, layer_id)
                done(dkv, layer_id)
            monkeypatch.setattr(spec.RecordingDecodeKV, "done", wave_done)
        elif cut:
            chunk.segments = [(124, 2), (126, 2)]
            view = cp.view

            def capture(layer_id, end_pos):
                if end_pos == 126:
                    at_cut[layer_id] = store.capture_state(slot, layer_id)
            cp.view = lambda hook: view(capture)
        eng._forward([chunk], {id(chunk): cp}, {})
        if cut:
            results.append([at_cut[i] for i in range(store.num_layers)])
            continue
        cp.rollback(eng.model, 2)
        results.append([store.capture_state(slot, i) for i in range(store.num_layers)])
        for i, e in enumerate(store.entries):
            for kind, pool in e.items():
                assert torch.equal(pool[table], before[i][kind]), f"{kind} entries of layer {i}"
        assert sum(1 for i in range(store.num_layers) if store.entries[i]) >= 2
    rolled, kept = results
    for i, (a, b) in enumerate(zip(rolled, kept)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"layer {i}"


@pytest.mark.parametrize("verify", ["waves", "segments"])
@pytest.mark.parametrize("policy", ["full", "checkpoint(256)", "zero"])
def test_prefix_hits_and_chunked_prefill(fixtures, policy, verify):
    """The first request decodes across position 256 with oracle drafts (rejections included); the
    second request's prompt continues the first one's output, so it hits the block and the state
    snapshot the first published while speculating (a wave's snapshot, or a segment's); chunks of
    100 tokens. Outputs and hits equal the same runs without speculation."""
    d = fixtures / "v4-tiny"
    base, extra = prompts_of([250, 20], seed=3)
    opts = dict(window_policy=policy, max_num_batched_tokens=100)
    plain = make(d, **opts)
    ref = run(plain, [base], 16)
    second = base + ref["r0"][:10] + extra
    ref["r1"] = run(plain, [second], 8)["r0"]
    llm = make(d, speculative="mtp", num_speculative_tokens=2, speculative_verify=verify, **opts)
    oracle = Oracle(llm.engine, {"r0": ref["r0"]}, crossing_plan(7), llm.config.vocab_size)
    try:
        assert run(llm, [base], 16) == {"r0": ref["r0"]}
        oracle.refs = {"r0": ref["r1"]}
        assert run(llm, [second], 8) == {"r0": ref["r1"]}
    finally:
        oracle.close()
    assert oracle.rejected_completions(128) >= 1
    assert len(llm.engine.prefix.snapshots) == len(plain.engine.prefix.snapshots)
    assert llm.engine.stats.cached_prompt_tokens == plain.engine.stats.cached_prompt_tokens == 256


def test_preemption_and_budget_limits(fixtures):
    """A pool too small for the batch (requests are preempted and recomputed) and a step budget that
    cuts drafts: outputs equal decoding without speculation."""
    d = fixtures / "v4-tiny"
    prompts = prompts_of([200, 230, 260, 120], seed=4)
    opts = dict(num_blocks=6, max_num_batched_tokens=64)
    ref = run(make(d, **opts), prompts, 40)
    llm = make(d, speculative="mtp", num_speculative_tokens=3, **opts)
    oracle = Oracle(llm.engine, ref, crossing_plan(3), llm.config.vocab_size)
    try:
        assert run(llm, prompts, 40) == ref
    finally:
        oracle.close()
    assert llm.engine.scheduler.num_preemptions > 0


def test_shipped_model_greedy_equals_non_speculative():
    """tiny-v4 with its trained MTP block on pass-key prompts whose answers cross a 128-token block
    (the drafts complete ratio-4 and ratio-128 entries, accepted or not), batch of 3."""
    from hybridkv.tasks.generators import Pools, make_sample
    from hybridkv.tasks.tokenizer import TaskTokenizer

    tok = TaskTokenizer.load(f"{MODEL}/tokenizer.json")
    pools = Pools(tok, seed=0, n_sentences=256, n_needles=64)
    prompts = [make_sample("passkey", i, pools, n).prompt for i, n in enumerate((252, 254, 380))]
    params = SamplingParams(max_tokens=12)
    ref = run(make(MODEL), prompts, 0, params)
    llm = make(MODEL, speculative="mtp", num_speculative_tokens=3)
    assert run(llm, prompts, 0, params) == ref
    st = llm.engine.stats
    assert st.spec_accepted_tokens > 0      # the trained MTP block drafts pass-key digits right


# ----- sampling -----
def test_rejection_sampling_keeps_the_target_distribution():
    """Vocabulary of 6: the first emitted token follows p1 whatever the draft distribution q1, and the
    second follows p2 when the first draft was accepted (chi-square, 20000 draws)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 1.5, -0.5, 0.7, 0.2, 1.0], [0.1] * 6])
    q = [torch.tensor([0.05, 0.05, 0.4, 0.3, 0.1, 0.1]), torch.tensor([0.3, 0.1, 0.1, 0.1, 0.2, 0.2])]
    params = SamplingParams(temperature=1.0, max_tokens=4)
    p = [filtered_probs(row, params) for row in logits]
    n = 20000
    first = torch.zeros(6)
    second = torch.zeros(6)
    for _ in range(n):
        d1 = int(torch.multinomial(q[0], 1, generator=g))
        d2 = int(torch.multinomial(q[1], 1, generator=g))
        out = spec.accept(logits, spec.Draft([d1, d2], q), params, torch.rand(3, generator=g))
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    def chi2(counts, probs):
        expect = probs * counts.sum()
        return float(((counts - expect) ** 2 / expect).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001
    assert chi2(first, p[0]) < 20.5, (first / n, p[0])
    assert chi2(second, p[1]) < 20.5, (second / second.sum(), p[1])
    assert second.sum() > 0.2 * n        # the accept branch really ran


def test_sampled_engine_outputs_follow_the_model(fixtures):
    """The engine with speculation (top-k 3, so 3 × 3 outcomes) over 300 seeds: the joint frequency
    of the 2nd and 3rd output tokens (the verified ones) matches the main model's probabilities
    given the first token, computed without speculation."""
    d = fixtures / "v4-tiny"
    prompt = prompts_of([12], seed=5)[0]
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    llm = make(d, speculative="mtp", num_speculative_tokens=2, max_num_seqs=64, num_blocks=128)
    outs = llm.generate([prompt] * 300, [SamplingParams(seed=s, **params) for s in range(300)])
    plain = make(d)
    plain.engine.record_logits = True
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.output_ids)] = counts.get(tuple(o.output_ids), 0) + 1
    firsts = {o.output_ids[0] for o in outs}
    exact: dict[tuple[int, ...], float] = {}
    sp = SamplingParams(**params)
    for t1 in firsts:
        n1 = sum(c for k, c in counts.items() if k[0] == t1)
        seq = plain.engine.add_request(prompt + [t1], SamplingParams(max_tokens=1, ignore_eos=True))
        while plain.engine.has_unfinished():
            plain.engine.step()
        p2 = filtered_probs(seq.step_logits[0], sp)
        for t2 in torch.nonzero(p2).flatten().tolist():
            seq2 = plain.engine.add_request(prompt + [t1, t2], SamplingParams(max_tokens=1, ignore_eos=True))
            while plain.engine.has_unfinished():
                plain.engine.step()
            p3 = filtered_probs(seq2.step_logits[0], sp)
            for t3 in torch.nonzero(p3).flatten().tolist():
                exact[(t1, t2, t3)] = n1 * float(p2[t2] * p3[t3])
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - e) ** 2 / e for k, e in exact.items() if e > 0)
    dof = len(exact) - len(firsts)
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)
    assert llm.engine.stats.spec_drafts > 0


# ----- options -----
def test_bad_options_are_refused(fixtures):
    with pytest.raises(ConfigError, match="MTP"):
        make(fixtures / "v41-tiny", speculative="mtp")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        make(fixtures / "v4-tiny", speculative="mtp", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="speculative method"):
        make(fixtures / "v4-tiny", speculative="eagle")
    with pytest.raises(ConfigError, match="offloads"):
        make(fixtures / "v4-tiny", speculative="mtp", memory_policy="recency-4", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="speculative_verify 'rows'"):
        make(fixtures / "v4-tiny", speculative="mtp", speculative_verify="rows")


@pytest.mark.parametrize("n_requests,waves", [(1, False), (2, True)])
def test_auto_verify_on_the_cpu_runs_waves_for_two_or_more_requests(fixtures, wave_sizes, n_requests, waves):
    """speculative_verify 'auto' on the CPU: one verifying request runs its rows as a segment, two
    or more as decode waves (which then hold every request)."""
    d = fixtures / "v4-tiny"
    prompts = prompts_of([40, 70][:n_requests], seed=3)
    ref = run(make(d), prompts, 6)
    assert run(make(d, speculative="mtp", num_speculative_tokens=2), prompts, 6) == ref
    assert (max(wave_sizes) == 2) if waves else not wave_sizes


def test_command_line_flags():
    import argparse

    from hybridkv.engine import EngineConfig

    p = argparse.ArgumentParser()
    EngineConfig.add_arguments(p)
    ec = EngineConfig.from_args(p.parse_args(["--speculative", "mtp", "--num-speculative-tokens", "3"]))
    assert (ec.speculative, ec.num_speculative_tokens) == ("mtp", 3)
    vllm = '{"method": "mtp", "num_speculative_tokens": 2}'
    ec = EngineConfig.from_args(p.parse_args(["--speculative-config", vllm]))
    assert (ec.speculative, ec.num_speculative_tokens) == ("mtp", 2)
    assert EngineConfig.from_args(p.parse_args([])).speculative is None
    assert EngineConfig.from_args(p.parse_args([])).speculative_verify == "auto"
    assert EngineConfig.from_args(p.parse_args(["--speculative-verify", "waves"])).speculative_verify == "waves"
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", '{"method": "ngram"}'])


def test_server_reports_acceptance_in_usage_and_metrics():
    import httpx

    from serverkit import LiveServer

    server = LiveServer(speculative="mtp", num_speculative_tokens=2)
    try:
        # greedy: the acceptance (and so the counts) must not depend on the random state other tests left
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 8,
                                                           "ignore_eos": True, "temperature": 0}, timeout=60).json()
        u = r["usage"]
        sd = u["speculative_decoding"]
        assert u["completion_tokens"] == 8 and sd["num_drafts"] >= 3, sd
        # each verify emits its accepted drafts and one token more (the first token comes from the
        # prefill): drafts past max_tokens, verified at the last step, are not counted
        assert u["completion_tokens"] >= 1 + sd["num_accepted_tokens"] + sd["num_drafts"], sd
        details = u["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] == sd["num_accepted_tokens"]
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == sd["num_draft_tokens"]
        server.wait_idle()
        text = httpx.get(server.url + "/metrics", timeout=10).text
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(("vllm:spec_decode", "hybridkv:spec_decode"))}
        assert values['vllm:spec_decode_num_drafts_total{model_name="tiny"}'] == sd["num_drafts"]
        assert values['vllm:spec_decode_num_draft_tokens_total{model_name="tiny"}'] == sd["num_draft_tokens"]
        assert values['hybridkv:spec_decode_accepted_tokens_per_step_count{model_name="tiny"}'] == sd["num_drafts"]
        hist = "hybridkv:spec_decode_accepted_tokens_per_step_sum"
        assert values[hist + '{model_name="tiny"}'] == sd["num_accepted_tokens"]
    finally:
        server.close()


def test_generate_command_speculates(fixtures, capsys):
    from hybridkv.cli import main

    args = ["generate", str(fixtures / "v4-tiny"), "--prompt-ids", "5 6 7 8", "--max-tokens", "6", "--num-blocks", "8"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative", "mtp", "--num-speculative-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "[speculative mtp: " in out.err and "acceptance length" in out.err


def test_mtp_window_holds_only_rows_of_the_main_model_streams(fixtures):
    """After decoding with k = 3 (chained drafts write speculative MTP rows, then put them back), the
    MTP layer's window rows equal those of a teacher-forced MTP pass over the final tokens."""
    from hybridkv.model import ContiguousKV, ForwardBatch

    d = fixtures / "v4-tiny"
    llm = make(d, speculative="mtp", num_speculative_tokens=3)
    eng = llm.engine
    rows = {}
    step = eng.step

    def wrapped():
        events = step()
        cache = eng.drafter.cache
        for seq in eng.scheduler.running:     # the MTP block has run over every computed position
            if seq.draft is not None and len(seq.draft.tokens) == 3:    # a whole chain ran this step
                n = seq.num_computed
                first = max(seq.mtp_start, n - cache.window)
                rows[seq.request_id] = (list(seq.token_ids), first, n, cache.rows(seq.cache.slot, first, n - first))
        return events
    eng.step = wrapped
    run(llm, prompts_of([40, 160], seed=8), 20)
    assert len(rows) == 2 and eng.stats.spec_draft_tokens > 2 * eng.stats.spec_drafts
    model, cfg = llm.model, llm.config
    for tokens, first, n, got in rows.values():
        with torch.inference_mode():
            x = torch.tensor(tokens[:n + 1])
            h = model(x[:n], ForwardBatch.build([(ContiguousKV(cfg), 0, n)]))
            kv = ContiguousKV(cfg)
            model.mtp_forward(h, x[1:n + 1], ForwardBatch.build([(kv, 0, n)]))
        ring = kv.layer(cfg.num_hidden_layers).ring
        want = ring[torch.arange(first, n) % cfg.sliding_window]
        assert n - first == min(n, cfg.sliding_window)
        assert rel(got.float(), want.float()) < 1e-3, rel(got.float(), want.float())
