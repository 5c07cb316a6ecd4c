"""EngineCore.fork: new requests that go on from a decoding request, each in a copy of its cache."""

import pytest
import torch

from engine_helpers import prompts_of, rel
from hybridkv.engine import LLM, SamplingParams
from hybridkv.errors import RequestError

# 740 prompt tokens and 70 decoded: the decoding completes a block (position 768, CSA and HCA
# entries) and an offloading policy recalls at the prefill's end and after 64 decode steps
PROMPT, DECODED = 740, 70


def engine(fixtures, policy="full", paged=False, indexer=None, **kw):
    if policy.startswith("flashmemory"):
        kw["memory_indexer"] = str(indexer)
    llm = LLM(fixtures / "v4-tiny", memory_policy=policy, **{"num_blocks": 48, "max_num_seqs": 4, **kw})
    if paged:      # the paged path's wiring in plain torch (as tests/test_engine_paged_path.py does)
        llm.engine.store.kernel_formats = ("bf16", "bf16")
    llm.engine.record_logits = True
    return llm.engine


def until_decoding(eng, seq):
    while not seq.output_ids:
        eng.step()


def run_all(eng):
    while eng.has_unfinished():
        eng.step()
    eng.store.pool.check()


@pytest.mark.parametrize("policy,paged", [("full", False), ("recency-256", False), ("flashmemory-0.5", True)])
def test_forks_decode_what_the_request_decodes(fixtures, warm_start_indexer, policy, paged):
    ids = prompts_of([PROMPT], seed=4)[0]
    params = SamplingParams(max_tokens=DECODED, ignore_eos=True)
    alone = engine(fixtures, policy, paged, warm_start_indexer)
    ref = alone.add_request(ids, params)
    run_all(alone)

    eng = engine(fixtures, policy, paged, warm_start_indexer)
    src = eng.add_request(ids, params)
    until_decoding(eng, src)
    forks = eng.fork(src.request_id, 2)
    assert eng.store.pool.num_used == 3 * len(src.cache.block_table)
    run_all(eng)
    for seq in [src, *forks]:
        assert seq.output_ids == ref.output_ids and seq.finish_reason == "length"
        assert len(seq.step_logits) == len(ref.step_logits) - 1 + (seq is src)
        for a, b in zip(seq.step_logits[::-1], ref.step_logits[::-1]):   # the forks' start at their 2nd token
            assert rel(a, b) < 1e-4, rel(a, b)      # a batch of three rounds unlike one row
    if policy != "full":
        assert eng.stats.pages_evicted > 0 and eng.stats.pages_loaded == 3 * alone.stats.pages_loaded
        assert eng.store.page_pool.num_used == 0
    assert eng.store.pool.num_used == 0 and eng.store.num_free_slots == eng.store.max_slots


@pytest.mark.parametrize("policy", ["full", "recency-256"])
def test_a_fork_holds_a_copy_of_the_cache_entry_by_entry(fixtures, policy):
    eng = engine(fixtures, policy)
    src = eng.add_request(prompts_of([PROMPT], seed=5)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    until_decoding(eng, src)
    fork, = eng.fork(src.request_id)
    store, a, b = eng.store, src.cache, fork.cache
    assert a.slot != b.slot and not set(a.block_table) & set(b.block_table)
    assert fork.num_computed == src.num_computed and fork.token_ids == src.token_ids
    frm, to = torch.tensor(a.block_table), torch.tensor(b.block_table)
    compared = 0
    for layer_id, ents in enumerate(store.entries):
        for kind, t in ents.items():
            assert torch.equal(t[to], t[frm]), (layer_id, kind)
            compared += 1
        assert torch.equal(store.ring[layer_id][b.slot], store.ring[layer_id][a.slot])
        for kv, score in store.states[layer_id].values():
            assert torch.equal(kv[b.slot], kv[a.slot]) and torch.equal(score[b.slot], score[a.slot])
    assert compared >= store.num_layers
    assert store.device_bytes(b) == store.device_bytes(a)
    if store.offload:
        assert [p >= 0 for p in b.pages] == [p >= 0 for p in a.pages]
        assert 0 < sum(p >= 0 for p in a.pages) < len(a.pages)
        assert not {p for p in a.pages if p >= 0} & {p for p in b.pages if p >= 0}
        for pa, pb in zip(a.pages, b.pages):
            if pa >= 0:
                assert torch.equal(store._page_csa[pb], store._page_csa[pa])
    run_all(eng)
    assert fork.output_ids == src.output_ids


def test_seeded_sampling_forks_go_on_with_the_requests_random_state(fixtures):
    ids = prompts_of([300], seed=6)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    alone = engine(fixtures)
    ref = alone.add_request(ids, params)
    run_all(alone)
    eng = engine(fixtures)
    src = eng.add_request(ids, params)
    until_decoding(eng, src)
    same, other = eng.fork(src.request_id)[0], eng.fork(src.request_id, params=SamplingParams(
        max_tokens=12, temperature=1.0, seed=12, ignore_eos=True))[0]
    run_all(eng)
    assert src.output_ids == same.output_ids == ref.output_ids
    assert other.output_ids[0] == ref.output_ids[0] and other.output_ids != ref.output_ids


def test_fork_refuses_what_it_cannot_copy_and_takes_nothing(fixtures):
    eng = engine(fixtures, num_blocks=24, max_num_seqs=6)
    src = eng.add_request(prompts_of([PROMPT], seed=7)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RequestError, match="not decoding"):
        eng.fork(src.request_id)                  # still waiting for its prefill
    with pytest.raises(RequestError, match="not decoding"):
        eng.fork("nobody")
    until_decoding(eng, src)
    free, running = eng.store.pool.num_free, list(eng.scheduler.running)
    with pytest.raises(RequestError, match=r"cannot fork 'req-0' 4 times: blocks for 3 \(a copy takes 6 blocks\)"):
        eng.fork(src.request_id, 4)               # 24 blocks: the request's 6 and room for 3 copies
    with pytest.raises(RequestError, match="requests for 5; slots for 5; blocks for 3"):
        eng.fork(src.request_id, 6)               # max_num_seqs 6
    with pytest.raises(RequestError, match="n must be"):
        eng.fork(src.request_id, 0)
    assert eng.store.pool.num_free == free and eng.scheduler.running == running
    assert eng.store.num_free_slots == eng.store.max_slots - 1
    run_all(eng)
