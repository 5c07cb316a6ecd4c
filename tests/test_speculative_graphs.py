"""The speculative step that the engine captures into CUDA graphs (engine/spec_graphs.py), checked on
the CPU where its fixed-shape forward runs eagerly over the paged kernels' path: greedy outputs equal
plain decoding's in a ragged batch with drafts accepted 0..k times side by side (rejected tokens
completing ratio-4 and ratio-128 entries) and where a stop token falls among accepted drafts, and
the cache state the fixed-shape rollback leaves equals plain decoding's.
tests/gpu/test_speculative_cuda.py captures and replays."""

import random

import pytest
import torch

from engine_helpers import prompts_of
from test_speculative import assert_states_close, cache_state, crossing_plan, make

from hybridkv.engine import SamplingParams
from hybridkv.engine.spec_graphs import MTPDecodeKV, SpeculativeGraphs
from hybridkv.engine.speculative import MTPCache


def _paged(llm, speculate: bool) -> None:
    """The paged kernels' path (CUDA decides this itself), and with speculation the fixed-shape step."""
    eng = llm.engine
    eng.store.kernel_formats = ("fp8", "fp4") if eng.store.fmt == "fp8" else ("bf16", "bf16")
    if speculate:
        eng.spec_graphs = SpeculativeGraphs(eng.model, eng.store, eng.drafter.cache, eng.store.new_seq().slot,
                                            capture=False)


def _run(llm, prompts, max_tokens, states: dict, oracle=None, stop: list[int] = ()):
    eng = llm.engine
    finish = eng._finish

    def wrapped(seq, reason):
        states[seq.request_id] = cache_state(eng, seq)
        finish(seq, reason)
    eng._finish = wrapped
    if oracle is not None:
        oracle(eng)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop))
    seqs = [eng.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
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

        def graph_step(tokens, caches, positions, mtp_starts):
            by_cache = {id(s.cache): s for s in eng.requests.values()}
            order[:] = [by_cache[id(c)] for c in caches]
            starts_at[:] = zip(positions, tokens)
            return step(tokens, caches, positions, mtp_starts)

        def graph_results(g, n):      # before the host emits: `emitted` tokens are still to come
            targets, logprobs, drafts = results(g, n)
            fixed = []
            for seq, (p, toks), t, d in zip(order, starts_at, targets, drafts):
                accepted = next((i for i, (x, y) in enumerate(zip(toks[1:], t)) if x != y), g.k)
                rollbacks.append((p, accepted + 1, g.k + 1))
                fixed.append(fix(seq, d, accepted + 1))
            return targets, logprobs, fixed
        eng.spec_graphs.step = graph_step
        eng.spec_graphs.results = graph_results
    return install


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_fixed_shape_speculative_steps_equal_plain_decoding(fixtures, prefix_caching):
    """Three requests (a batch padded to four) verifying k = 3 oracle drafts through the fixed-shape
    step: the same tokens as plain decoding on the same path, most steps taken by the fixed-shape
    step, rollbacks of every length, and at the end the same window rows, compressor states and
    entries. Without prefix caching no snapshot boundary sends a step to the eager path, so rejected
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
    assert st.spec_graph_steps >= 0.7 * st.spec_drafts / len(prompts)
    assert {m for _, m, _ in verified} == {1, 2, 3, 4}          # every rollback length, and none

    def rejected_completions(ratio):
        return sum(any((p + 1) % ratio == 0 for p in range(s + m, s + n)) for s, m, n in verified)
    assert rejected_completions(4) >= 5
    if not prefix_caching:
        assert rejected_completions(128) >= 1
    for rid in ref:
        assert_states_close(got[rid], want[rid], bound=1e-4)


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
    assert llm.engine.stats.spec_graph_steps >= 5 and {m for _, m, _ in verified} == {k + 1}


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
