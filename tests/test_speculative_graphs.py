"""The speculative step that the engine captures into CUDA graphs (engine/spec_graphs.py), checked on
the CPU where its fixed-shape forward runs eagerly over the paged kernels' path: greedy outputs equal
plain decoding's in a ragged batch with drafts accepted 0..k times side by side (rejected tokens
completing ratio-4 and ratio-128 entries) and where a stop token falls among accepted drafts, and
the cache state the fixed-shape rollback leaves equals plain decoding's.
tests/gpu/test_speculative_cuda.py captures and replays."""

import random

import numpy as np
import pytest
import torch

from engine_helpers import HostReadRecorder, prompts_of
from test_speculative import MODEL, assert_states_close, cache_state, crossing_plan, make

from hybridkv.engine import SamplingParams
from hybridkv.engine.sequence import Status
from hybridkv.engine.sampling import filtered_probs
from hybridkv.ops.window import window_listing
from hybridkv.engine.spec_graphs import MTPDecodeKV, SpeculativeGraphs, mtp_waves, wave_listings
from hybridkv.engine.speculative import MTPCache


def _paged(llm, speculate: bool) -> None:
    """The paged kernels' path (CUDA decides this itself), and with speculation the fixed-shape step."""
    eng = llm.engine
    eng.store.kernel_formats = ("fp8", "fp4") if eng.store.fmt == "fp8" else ("bf16", "bf16")
    if speculate:
        eng.spec_graphs = SpeculativeGraphs(eng.model, eng.store, eng.drafter.cache, eng.store.new_seq().slot,
                                            capture=False)


def _run(llm, prompts, max_tokens, states: dict, oracle=None, stop: list[int] = ()):
    """Requests r0, r1, ... to completion; their outputs. `states[rid][n]` receives a request's cache
    state (`cache_state`) after each step it goes on from, n its positions computed: a step that ends
    it may leave positions past its last token on the device (drafts verified beyond max_tokens or a
    stop token), which nothing reads."""
    eng = llm.engine
    if oracle is not None:
        oracle(eng)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop))
    seqs = [eng.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            if s.status is Status.RUNNING and s.output_ids:
                states.setdefault(s.request_id, {})[s.num_computed] = cache_state(eng, s)
    eng.store.pool.check()
    return {s.request_id: s.output_ids for s in seqs}


def _oracle(refs: dict, plan, vocab: int, rollbacks: list):
    """Drafts from the reference continuation, wrong where `plan` says (as test_speculative's Oracle),
    through both the eager drafter (after prefill) and the fixed-shape step's MTP pass; `rollbacks`
    receives (first position, positions kept, positions verified) of every fixed-shape verify."""
    def install(eng):
        def fix(seq, tokens, emitted=0):
            done = len(seq.output_ids) + emitted
            truth = refs[seq.request_id][done:done + len(tokens)]
            # past the reference's last token (drafts beyond max_tokens): tokens the model need not agree with
            truth += [(t + 1) % vocab for t in tokens[len(truth):]]
            a = min(plan(seq.request_id, seq.num_tokens - 1 + emitted, len(tokens)), len(tokens))
            return truth[:a] + [(t + 1) % vocab for t in truth[a:a + 1]] + truth[a + 1:]

        run = eng.drafter.run

        def drafter_run(work):
            drafts = run(work)
            for rid, d in drafts.items():
                d.tokens = fix(eng.requests[rid], d.tokens)
            return drafts
        eng.drafter.run = drafter_run
        step, results = eng.spec_graphs.step, eng.spec_graphs.results
        order, starts_at = [], []

        def graph_step(tokens, caches, positions, mtp_starts, *sampling):
            by_cache = {id(s.cache): s for s in eng.requests.values()}
            order[:] = [by_cache[id(c)] for c in caches]
            starts_at[:] = zip(positions, tokens)
            return step(tokens, caches, positions, mtp_starts, *sampling)

        def graph_results(g, n):      # before the host emits: `emitted` tokens are still to come
            tokens, logprobs, accepted, drafts, tops = results(g, n)
            fixed = []
            for seq, (p, _), a, d in zip(order, starts_at, accepted, drafts):
                rollbacks.append((p, a + 1, g.k + 1))
                fixed.append(fix(seq, d, a + 1))
            return tokens, logprobs, accepted, fixed, tops
        eng.spec_graphs.step = graph_step
        eng.spec_graphs.results = graph_results
    return install


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_fixed_shape_speculative_steps_equal_plain_decoding(fixtures, prefix_caching):
    """Three requests (a batch padded to four) verifying k = 3 oracle drafts through the fixed-shape
    step: the same tokens as plain decoding on the same path, most steps taken by the fixed-shape
    step, rollbacks of every length, and after every step the same window rows, compressor states
    and entries. Without prefix caching the oracle may accept up to k drafts anywhere, so rejected
    tokens complete ratio-128 entries inside the fixed-shape step too."""
    d, k = fixtures / "v4-tiny", 3
    prompts = prompts_of([300, 700, 1148], seed=4)
    kw = dict(kv_format="native", enable_prefix_caching=prefix_caching, max_num_batched_tokens=4096)
    want, got = {}, {}
    plain = make(d, **kw)
    _paged(plain, False)
    ref = _run(plain, prompts, 40, want)
    llm = make(d, speculative="mtp", num_speculative_tokens=k, **kw)
    _paged(llm, True)
    verified: list[tuple[int, int, int]] = []
    plan = crossing_plan(5)
    if not prefix_caching:      # 0..k accepted anywhere: rejected tokens may complete ratio-128 entries
        rng = random.Random(5)

        def plan(rid, start, k):
            return rng.randint(0, k)
    out = _run(llm, prompts, 40, got, _oracle(ref, plan, llm.config.vocab_size, verified))
    assert out == ref
    st = llm.engine.stats
    print(f"\nverify steps of each request {st.spec_drafts / len(prompts):.1f}, "
          f"fixed-shape steps {st.spec_graph_steps}")
    assert st.steps - st.spec_graph_steps == 1                  # the prefill step alone ran eagerly
    assert {m for _, m, _ in verified} == {1, 2, 3, 4}          # every rollback length, and none

    def rejected_completions(ratio):
        return sum(any((p + 1) % ratio == 0 for p in range(s + m, s + n)) for s, m, n in verified)
    assert rejected_completions(4) >= 5
    if not prefix_caching:
        assert rejected_completions(128) >= 1
    for rid in ref:
        assert len(got[rid]) >= 5 and set(got[rid]) <= set(want[rid])
        for n, state in got[rid].items():
            assert_states_close(state, want[rid][n], bound=1e-4)


def test_a_stop_token_among_accepted_drafts_ends_the_request_there(fixtures):
    """Every draft right (the oracle), a stop token among them: the fixed-shape step keeps all k+1
    positions on the device, the host emits up to the stop token and ends the request there; the
    other request goes on. The same outputs as plain decoding with that stop token, the pool whole."""
    d, k = fixtures / "v4-tiny", 3
    prompts = prompts_of([300, 700], seed=6)
    kw = dict(kv_format="native", max_num_batched_tokens=4096)
    free = _run(_paged_llm(d, False, **kw), prompts, 30, {})
    at = next(i for i in range(8, 30) if free["r0"][i] not in free["r0"][:i] + free["r1"])   # r0's alone
    stop = free["r0"][at]
    ref = _run(_paged_llm(d, False, **kw), prompts, 30, {}, stop=[stop])
    assert len(ref["r0"]) == at + 1 and len(ref["r1"]) == 30
    # r0's first token comes from its prefill, then each step emits k + 1: the stop token is not a step's last
    assert (at - 1) % (k + 1) != k
    llm = _paged_llm(d, True, speculative="mtp", num_speculative_tokens=k, **kw)
    verified: list[tuple[int, int, int]] = []
    out = _run(llm, prompts, 30, {}, _oracle(free, lambda rid, start, k: k, llm.config.vocab_size, verified),
               stop=[stop])
    assert out == ref
    # every draft right but those past r1's last reference token, which its last step verifies
    st = llm.engine.stats
    assert st.spec_graph_steps >= 5 and sum(m != k + 1 for _, m, _ in verified) <= 1
    # the metrics count the drafts max_tokens leaves room for: the wrong ones past it are not among them
    assert 0 < st.spec_accepted_tokens == st.spec_draft_tokens


def _snapshots(llm) -> dict:
    return {key: snap for key, (snap, _) in llm.engine.prefix.snapshots._items.items()}


@pytest.mark.parametrize("policy", ["full", "checkpoint(256)"])
def test_snapshots_at_boundaries_among_the_verified_positions_equal_plain_decodings(fixtures, policy):
    """Two requests decoding across block boundaries with k = 3 oracle drafts accepted 0..3 times, so
    that a boundary falls among, at the end of and past the positions a step keeps, and r1 stops on a
    token among accepted drafts: after the prefill every step replays the fixed-shape step (none
    goes eager at a boundary, nor at the requests' last tokens), the outputs are plain decoding's,
    and so is every snapshot the prefix cache holds, layer by layer. A request whose prompt
    continues r0's output hits its blocks and the snapshot made inside a step, and decodes plain
    decoding's tokens."""
    d, k = fixtures / "v4-tiny", 3
    prompts = prompts_of([250, 372], seed=8)
    kw = dict(kv_format="native", window_policy=policy, max_num_batched_tokens=4096)
    plain = _paged_llm(d, False, **kw)
    free = _run(plain, prompts, 40, {})
    stop = free["r1"][31]
    assert stop not in free["r1"][:31] + free["r0"]
    plain = _paged_llm(d, False, **kw)
    ref = _run(plain, prompts, 40, {}, stop=[stop])
    llm = _paged_llm(d, True, speculative="mtp", num_speculative_tokens=k, **kw)
    verified: list[tuple[int, int, int]] = []
    rng = random.Random(5)
    out = _run(llm, prompts, 40, {}, _oracle(free, lambda rid, start, k: rng.randint(0, k),
                                             llm.config.vocab_size, verified), stop=[stop])
    assert out == ref and len(out["r1"]) == 32
    st = llm.engine.stats
    assert st.steps - st.spec_graph_steps == 1                  # the prefill step alone ran eagerly
    bt = llm.engine.store.block_tokens
    # where a boundary b (the state after the positions before it) fell in a step from p keeping m
    cases = {"among" if b - p < m else "at the end" if b - p == m else "past"
             for p, m, n in verified for b in range(p + 1, p + n + 1) if b % bt == 0}
    assert cases == {"among", "at the end", "past"}, cases
    want, got = _snapshots(plain), _snapshots(llm)
    assert want and set(got) == set(want)
    for key, snap in want.items():
        for i, (a, b) in enumerate(zip(snap, got[key])):
            for x, y in zip(a, b):
                assert torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-4), f"layer {i}"
    second = prompts[0] + ref["r0"][:12] + prompts_of([20], seed=9)[0]
    ref2 = _run(plain, [second], 8, {})
    hits = llm.engine.stats.cached_prompt_tokens
    assert _run(llm, [second], 8, {}, _oracle(ref2, lambda rid, start, k: rng.randint(0, k),
                                                llm.config.vocab_size, [])) == ref2
    assert llm.engine.stats.cached_prompt_tokens - hits == 256


def _paged_llm(d, speculate: bool, **kw):
    llm = make(d, **kw)
    _paged(llm, speculate)
    return llm


def test_mtp_decode_view_writes_only_the_kept_rows_and_lists_the_window_in_order():
    """MTPDecodeKV: rows whose `write` is False leave the ring as it was; the window keys are the ring
    rows from max(0, pos − W + 1) on, oldest first, valid from the request's first MTP position."""
    class Config:
        num_hidden_layers, sliding_window, head_dim = 2, 8, 4
    cache = MTPCache(Config, 3, torch.float32, "cpu")
    cache.ring.copy_(torch.arange(cache.ring.numel(), dtype=torch.float32).view_as(cache.ring))
    before = cache.ring.clone()
    view = MTPDecodeKV(cache, torch.tensor([5, 11]), torch.tensor([0, 2]), torch.tensor([2, 0]),
                       write=torch.tensor([True, False]))
    rows = torch.full((2, 4), -1.0)
    keys, valid = view.window(2, rows)
    assert torch.equal(cache.ring[0, 5], rows[0]) and torch.equal(cache.ring[2], before[2])
    assert torch.equal(cache.ring[1], before[1])
    assert torch.equal(keys[0, :6], cache.ring[0, :6]) and valid[0].tolist() == [False] * 2 + [True] * 4 + [False] * 2
    order = [(11 - 8 + 1 + j) % 8 for j in range(8)]
    assert torch.equal(keys[1], before[2, order]) and valid[1].all()
    # the verify waves' listings made at once are each wave's own
    positions, start = torch.tensor([[5, 6, 7], [11, 12, 13]]), torch.tensor([2, 0])
    listed, valid = wave_listings(positions, 8, start)
    for j in range(3):
        one = window_listing(positions[:, j], 8, start)
        assert torch.equal(listed[j], one[0]) and torch.equal(valid[j], one[1])


def test_mtp_waves_listed_at_once_equal_the_waves_one_after_another():
    """`MTPDecodeKV.wave_window` of `mtp_waves`: the windows of three waves at once (a ring that wraps, a window
    still filling, a request that keeps one row and one that keeps all three) list each kept row's
    window as the waves run one after another would, and leave the same ring."""
    class Config:
        num_hidden_layers, sliding_window, head_dim = 2, 8, 4
    gen = torch.Generator().manual_seed(0)
    positions, slots, start = torch.tensor([6, 2]), torch.tensor([2, 0]), torch.tensor([1, 0])
    kept = torch.tensor([1, 3])
    rows = torch.randn(3 * 2, 4, generator=gen)
    caches = [MTPCache(Config, 3, torch.float32, "cpu") for _ in range(2)]
    for c in caches:
        c.ring.copy_(torch.arange(c.ring.numel(), dtype=torch.float32).view_as(c.ring))

    every = positions.unsqueeze(1) + torch.arange(3)
    one_by_one = [MTPDecodeKV(caches[0], positions + j, slots, start, write=kept > j).window(2, rows[2 * j:2 * j + 2])
                  for j in range(3)]
    views = mtp_waves(caches[1], every, slots, start, kept)
    assert views[1].wave_window(views[1:], rows[2:]) is None       # (only the first view lists them all)
    keys, valid = views[0].wave_window(views, rows)
    assert torch.equal(caches[0].ring, caches[1].ring)
    for j, (k_one, v_one) in enumerate(one_by_one):
        for b in range(2):
            if j < kept[b]:
                assert torch.equal(valid[2 * j + b], v_one[b])
                assert torch.equal(keys[2 * j + b][v_one[b]], k_one[b][v_one[b]])


def test_sampled_fixed_shape_steps_follow_the_model_beside_greedy_requests():
    """tiny-v4 (its trained MTP block drafts tokens the model may sample) continuing filler text:
    unseeded sampled requests (top-k 2, four tokens, k = 1) verify through the fixed-shape step and the
    eager path taking turns, with drafts from the eager drafter and from the step's own MTP pass; the
    joint frequency of the four tokens over 248 requests matches the main model's
    probabilities computed without speculation (chi-square), drafts are accepted and rejected; greedy
    requests in the same steps give plain decoding's tokens."""
    from hybridkv.tasks.generators import Pools
    from hybridkv.tasks.tokenizer import TaskTokenizer

    tok = TaskTokenizer.load(f"{MODEL}/tokenizer.json")
    pools = Pools(tok, seed=0, n_sentences=256, n_needles=64)
    rng = np.random.default_rng(3)
    # past the window: the fixed-shape step needs it whole
    prompt, other = ([tok.bos_id, *pools.sentences.fill(rng, n)[0].astype(int).tolist()] for n in (160, 190))
    sp = SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    plain = make(MODEL, kv_format="native")
    _paged(plain, False)
    want = plain.generate([other], greedy)[0].output_ids
    torch.manual_seed(0)
    # every prompt prefilled in one step: the verify steps hold no prefill chunk
    llm = make(MODEL, speculative="mtp", num_speculative_tokens=1, kv_format="native", max_num_seqs=64,
               num_blocks=256, max_num_batched_tokens=16384)
    _paged(llm, True)
    eligible, calls = llm.engine._spec_graph_eligible, [0]

    def every_other(chunks):      # graph and eager steps take turns: drafts pass between them both ways
        calls[0] += 1
        return calls[0] % 2 == 1 and eligible(chunks)
    llm.engine._spec_graph_eligible = every_other
    graphs, step, checked = llm.engine.spec_graphs, llm.engine.spec_graphs.step, [0]

    def checked_step(tokens, caches, positions, mtp_starts, *sampling):
        # each sampled request's draft distribution is where the graph's acceptance reads it
        by_cache = {id(r.cache): r for r in llm.engine.requests.values()}
        for c in caches:
            seq = by_cache[id(c)]
            if seq.params.temperature > 0:
                assert torch.equal(graphs.draft_probs[c.slot, :1], torch.stack(seq.draft.probs[:1]))
                checked[0] += 1
        return step(tokens, caches, positions, mtp_starts, *sampling)
    graphs.step = checked_step
    outs = []
    for _ in range(4):     # 64 requests a round: the largest graph batch
        got = llm.generate([other] * 2 + [prompt] * 62, [greedy] * 2 + [sp] * 62)
        assert all(o.output_ids == want for o in got[:2])
        outs += [tuple(o.output_ids) for o in got[2:]]
    st = llm.engine.stats
    assert st.spec_graph_steps > 0 and checked[0] > 0
    assert st.spec_accepted_hist[0] > 8 and st.spec_accepted_hist[1] > 100
    plain.engine.record_logits = True

    def next_probs(prefix):
        seq = plain.engine.add_request(prompt + list(prefix), SamplingParams(max_tokens=1, ignore_eos=True))
        while plain.engine.has_unfinished():
            plain.engine.step()
        return filtered_probs(seq.step_logits[0], sp)

    exact = {(): 1.0}
    for _ in range(4):
        exact = {pre + (t,): w * float(p[t]) for pre, w in exact.items()
                 for p in [next_probs(pre)] for t in torch.nonzero(p).flatten().tolist()}
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[o] = counts.get(o, 0) + 1
    assert set(counts) <= set(exact)
    n = len(outs)
    chi2 = sum((counts.get(k, 0) - n * e) ** 2 / (n * e) for k, e in exact.items())
    dof = len(exact) - 1
    print(f"\nchi2 {chi2:.1f} dof {dof} graph steps {st.spec_graph_steps} accepted {st.spec_accepted_hist}")
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)


def test_sampled_acceptance_on_fixed_shapes_matches_the_eager_rule():
    """The fixed-shape acceptance against `speculative.accept` on one request's rows, with the
    uniforms the eager rule would draw: same accepted count and the residual's token."""
    from hybridkv.engine.sampling import draw_with_uniforms, filtered_probs_fixed

    torch.manual_seed(1)
    vocab, k = 7, 2
    for trial in range(200):
        logits = torch.randn(k + 1, vocab) * 2
        q = torch.softmax(torch.randn(k, vocab) * 2, -1)
        drafts = [int(torch.multinomial(q[i], 1)) for i in range(k)]
        u = torch.rand(2 * k + 1)
        p = filtered_probs_fixed(logits, torch.ones(k + 1), torch.zeros(k + 1), torch.ones(k + 1))
        # the eager rule, written out with these uniforms
        out = []
        for i, dr in enumerate(drafts):
            if u[i] * q[i, dr] < p[i, dr]:
                out.append(dr)
                continue
            r = (p[i] - q[i]).clamp(min=0)
            out.append(int(draw_with_uniforms(r[None], u[k:k + 1])))
            break
        else:
            out.append(int(draw_with_uniforms(p[k][None], u[k:k + 1])))

        class G:
            sampled, batch, top = True, 1, 0
            params = torch.tensor([[1.0, 0.0, 1.0]])
            uniforms = u[None]
            out: dict = {}
        G.k = k
        graphs = SpeculativeGraphs.__new__(SpeculativeGraphs)
        graphs.draft_probs = q[None]
        tokens, slots = torch.tensor([[0] + drafts]), torch.tensor([0])
        with HostReadRecorder() as reads:        # capturable: nothing read back by the host
            kept, following = graphs._accept(G, logits[:, None], tokens, slots)
        assert not reads.flagged, dict(reads.flagged)
        assert int(kept) == len(out) and following[0, :len(out)].tolist() == out, trial


def test_sampled_drafts_on_fixed_shapes_follow_the_mtp_distribution():
    """`_pick` for sampled rows: drafts drawn from the MTP block's filtered distribution with the
    step's uniforms (chi-square over 4000 rows), that distribution kept for the next step's
    acceptance; greedy rows take the argmax."""
    torch.manual_seed(2)
    vocab, rows = 6, 4000
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -3.0]]).expand(rows, vocab).contiguous()
    temp = torch.full((rows,), 0.8)
    temp[:10] = 0                                                 # greedy rows

    class G:
        sampled, batch, k, top = True, rows, 1, 0
        params = torch.stack([temp, torch.full((rows,), 4.0), torch.full((rows,), 0.95)], 1)
        uniforms = torch.rand(rows, 3)
    graphs = SpeculativeGraphs.__new__(SpeculativeGraphs)
    graphs.draft_probs = torch.zeros(rows, 1, vocab)
    slots = torch.arange(rows)
    with HostReadRecorder() as reads:            # capturable: nothing read back by the host
        drafts = graphs._pick(G, logits, slots, 0)
    assert not reads.flagged, dict(reads.flagged)
    q = graphs.draft_probs[20, 0]
    assert torch.allclose(q, filtered_probs(logits[0], SamplingParams(temperature=0.8, top_k=4, top_p=0.95)))
    assert (drafts[:10] == 3).all()
    counts = torch.bincount(drafts[10:], minlength=vocab).float()
    assert counts[q == 0].sum() == 0
    expect = q * (rows - 10)
    chi2 = float(((counts - expect) ** 2 / expect)[q > 0].sum())
    assert chi2 < 16.3, (counts, expect)       # P(chi2 > 16.3) = 0.001 at 3 degrees of freedom


def test_logprobs_through_the_fixed_shape_step_equal_plain_decoding(fixtures):
    """Greedy requests asking 3 and 5 top log-probabilities beside one asking none, k = 2 oracle drafts
    through the fixed-shape step: the same tokens, logprobs and top lists (ids, values within float
    rounding) as plain decoding, most steps fixed-shape."""
    d, k = fixtures / "v4-tiny", 2
    prompts = prompts_of([300, 420, 500], seed=9)
    kw = dict(kv_format="native", max_num_batched_tokens=4096)
    params = [SamplingParams(max_tokens=14, ignore_eos=True, logprobs=n) for n in (3, 5, None)]
    plain = _paged_llm(d, False, **kw)
    want = plain.generate(prompts, params)
    refs = {f"r{i}": o.output_ids for i, o in enumerate(want)}
    llm = _paged_llm(d, True, speculative="mtp", num_speculative_tokens=k, **kw)
    _oracle(refs, lambda rid, start, k: random.Random(start).randint(0, k), llm.config.vocab_size, [])(llm.engine)
    eng = llm.engine
    seqs = [eng.add_request(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.spec_graph_steps >= 3
    for seq, ref in zip(seqs, want):
        assert seq.output_ids == ref.output_ids
        assert torch.allclose(torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
        if ref.top_logprobs:
            for got_top, ref_top in zip(seq.top_logprobs, ref.top_logprobs):
                assert [i for i, _ in got_top] == [i for i, _ in ref_top]
                assert torch.allclose(torch.tensor([v for _, v in got_top]), torch.tensor([v for _, v in ref_top]),
                                      atol=1e-4)
        else:
            assert not any(seq.top_logprobs)


def test_a_seeded_request_draws_the_same_tokens_through_the_graph_and_eagerly():
    """tiny-v4 continuing filler text, seeded sampled requests (temperature 0.8, top-p 0.95, k = 2):
    each alone on the eager path, and all together beside unseeded and greedy requests with the
    fixed-shape step taking most steps, give the same tokens (their uniforms come from their own
    generators in the same calls on both paths)."""
    from hybridkv.tasks.generators import Pools
    from hybridkv.tasks.tokenizer import TaskTokenizer

    tok = TaskTokenizer.load(f"{MODEL}/tokenizer.json")
    pools = Pools(tok, seed=0, n_sentences=256, n_needles=64)
    rng = np.random.default_rng(4)
    prompts = [[tok.bos_id, *pools.sentences.fill(rng, n)[0].astype(int).tolist()] for n in (150, 170, 200, 230)]
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=s) for s in range(4)]
    kw = dict(speculative="mtp", num_speculative_tokens=2, kv_format="native", max_num_batched_tokens=16384)
    alone = []
    for p, sp in zip(prompts, seeded):
        eager = make(MODEL, **kw)
        _paged(eager, False)
        alone.append(eager.generate([p], sp)[0].output_ids)
    llm = make(MODEL, **kw)
    _paged(llm, True)
    others = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=16)]
    together = llm.generate(prompts + prompts[:2], seeded + others)
    assert [o.output_ids for o in together[:4]] == alone
    st = llm.engine.stats
    assert st.spec_graph_steps >= 3 and st.spec_accepted_hist[0] > 0 and sum(st.spec_accepted_hist[1:]) > 0


def test_memory_report_counts_the_mtp_window_and_the_draft_distributions():
    """/metrics' device tier shows what speculation holds by request slot: the MTP layer's window
    ring from the start, and the draft distributions once a sampled request verified in the
    fixed-shape step (slots × k × vocab float32); a plain engine shows neither."""
    from hybridkv.server.memory import memory_snapshot

    prompt = prompts_of([200], seed=8)[0]
    plain = make(MODEL, kv_format="native")
    assert not {"MTP window", "draft distributions"} & set(memory_snapshot(plain.engine)["tiers"]["device"])
    llm = make(MODEL, speculative="mtp", num_speculative_tokens=2, kv_format="native")
    _paged(llm, True)
    eng = llm.engine
    cfg, slots = eng.config, eng.store.max_slots
    ring = cfg.sliding_window * cfg.head_dim * 4
    device = memory_snapshot(eng)["tiers"]["device"]
    assert device["MTP window"] == {"active": 1 * ring, "cached": 0, "capacity": slots * ring}  # the graphs' pad slot
    assert "draft distributions" not in device
    seq = eng.add_request(prompt, SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
    while eng.stats.spec_graph_steps == 0:
        eng.step()
    device = memory_snapshot(eng)["tiers"]["device"]
    per_slot = 2 * cfg.vocab_size * 4
    assert device["MTP window"]["active"] == 2 * ring
    assert device["draft distributions"] == {"active": 2 * per_slot, "cached": 0, "capacity": slots * per_slot}
    while eng.has_unfinished():
        eng.step()
    assert len(seq.output_ids) == 12


def test_verify_waves_after_the_first_give_their_compressor_launches_buffers_for_the_states(fixtures):
    """`_VerifyWaveKV.state_snapshot`: the first wave keeps no copy; later waves hand the fused
    compressor launch one float32 buffer pair [batch, rows, width] per layer and kind, kept in wave
    order where the rollback reads them: views of their state group's buffers (`_StateCopies`), wave
    w's at [w − 1, member]."""
    from hybridkv.cache.paged import PagedKVStore
    from hybridkv.engine.spec_graphs import _StateCopies, _VerifyWaveKV
    from hybridkv.presets import load_config
    cfg = load_config(fixtures / "v4-tiny-fp8")
    store = PagedKVStore(cfg, 8, 4, "fp8", torch.bfloat16)
    layer, kind = next((i, k) for i in range(cfg.num_hidden_layers) for k in store.states[i])
    snapshots: dict = {}
    copies = _StateCopies(store, 2, 3)
    waves = []
    for j in range(3):
        w = _VerifyWaveKV.__new__(_VerifyWaveKV)
        w.store, w.slots, w.wave, w.snapshots, w.copies = store, torch.tensor([2, 0, 1]), j, snapshots, copies
        waves.append(w)
    assert waves[0].state_snapshot(layer, kind) is None and snapshots == {}
    got = [waves[j].state_snapshot(layer, kind) for j in (1, 2)]
    kv, score = store.states[layer][kind]
    assert len(snapshots[(layer, kind)]) == 2 and all(a is b for a, b in zip(snapshots[(layer, kind)], got))
    for pair in got:
        assert [tuple(t.shape) for t in pair] == [(3,) + tuple(kv.shape[1:]), (3,) + tuple(score.shape[1:])]
        assert all(t.dtype == torch.float32 and t.is_contiguous() for t in pair)
    g, m = copies.where[(layer, kind)]
    for w, pair in enumerate(got):
        assert all(t.data_ptr() == buf[w, m].data_ptr() for t, buf in zip(pair, copies.buffers[g]))
