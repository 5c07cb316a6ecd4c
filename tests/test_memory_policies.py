"""Memory policies: CSA main KV kept on the device only for resident blocks, the rest in host
memory; the indexer can only select resident entries; bytes measured from the allocator."""

import pytest
import torch

from hybridkv.cache.paged import PagedDecodeKV
from hybridkv.engine import LLM, SamplingParams
from hybridkv.errors import ConfigError
from hybridkv.memory import PolicyContext, parse_policy
from hybridkv.memory.policies import OracleTopK, RandomBlocks, Recency


def prompt(n, seed=0):
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(fixtures, policy, ids, max_tokens=12, **kw):
    llm = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=2, memory_policy=policy, **kw)
    llm.engine.record_logits = True
    seq = llm.engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.store.pool.check()
    return llm, seq


def test_parse_and_errors():
    assert str(parse_policy("recency-2k")) == "recency-2048"
    assert isinstance(parse_policy("random-0.1"), RandomBlocks) and isinstance(parse_policy("oracle-8"), OracleTopK)
    with pytest.raises(ConfigError, match="unknown memory policy"):
        parse_policy("lru")
    with pytest.raises(ConfigError, match="fraction in"):
        parse_policy("random-2")


def test_policies_choose_blocks():
    ctx = PolicyContext("r", num_blocks=10, position=1200, block_tokens=128, decode_steps=0,
                        attention_mass=torch.tensor([0.1, 5.0, 0.2, 3.0, 0, 0, 0, 0, 0, 9.0]))
    assert Recency(300).resident(ctx) == {7, 8, 9}
    assert OracleTopK(2).resident(ctx) == {1, 3, 9}            # top mass among complete blocks + newest
    r = RandomBlocks(0.34).resident(ctx)
    assert len(r) == 3 and 9 in r and r == RandomBlocks(0.34).resident(ctx)


def test_a_share_of_the_blocks_counts_the_one_being_filled():
    """`-p` below 1 keeps ⌊p·n⌋ of a request's n blocks, the one being filled among them, under every
    policy: at 32K (256 blocks) 0.15 keeps 38, 14.8 % of `full`'s CSA main entries, not 39."""
    from hybridkv.memory.policies import FlashMemory, complete_blocks_kept
    assert [complete_blocks_kept(0.15, c) for c in (255, 15, 5, 0)] == [37, 1, 0, 0]
    assert complete_blocks_kept(0.15, 19) == 2          # 0.15 · 20 is 3 however the product rounds
    ctx = PolicyContext("r", num_blocks=256, position=32700, block_tokens=128, decode_steps=0,
                        attention_mass=torch.arange(256.0))
    for policy in (parse_policy("recency-0.15"), RandomBlocks(0.15), OracleTopK(0.15)):
        kept = policy.resident(ctx)
        assert len(kept) == 38 and 255 in kept, policy
    assert parse_policy("recency-0.15").resident(ctx) == set(range(218, 256))
    assert OracleTopK(0.15).resident(ctx) == set(range(218, 256))   # the most mass: the highest complete blocks
    # a prompt that ends a block (32,768 tokens): 256 complete blocks, and the one the first decoded
    # token opens counts towards the share: 37 of them now, 38 blocks with it
    ended = PolicyContext("r", num_blocks=256, position=32768, block_tokens=128, decode_steps=0,
                          attention_mass=torch.arange(256.0))
    for policy in (parse_policy("recency-0.15"), RandomBlocks(0.15), OracleTopK(0.15)):
        assert len(policy.resident(ended)) == 37, policy
    assert parse_policy("recency-0.15").resident(ended) == set(range(219, 256))
    ranked = FlashMemory(0.15)
    ended.extra = {"chunk_probs": torch.rand(256 * 32, generator=torch.Generator().manual_seed(1)), "block_chunks": 32}
    assert len(ranked.resident(ended)) == 37
    assert str(parse_policy("recency-0.15")) == "recency-0.15" and str(parse_policy("recency-1k")) == "recency-1024"
    with pytest.raises(ConfigError, match="share in"):
        Recency(share=1.0)
    probs = torch.rand(256 * 32, generator=torch.Generator().manual_seed(0))
    assert int(FlashMemory(0.15).blocks(probs, 255 * 32 + 7, 32).sum()) == 38
    # 2K (15 complete blocks): one complete block, which the ranking chooses, not the newest
    probs = torch.zeros(15 * 32 + 3)
    probs[3 * 32 + 5] = 0.9
    assert torch.nonzero(FlashMemory(0.15).blocks(probs, probs.numel(), 32)).flatten().tolist() == [3, 15]
    # a budget of two complete blocks still keeps the newest, and the ranking's best
    assert torch.nonzero(FlashMemory(0.2).blocks(probs, probs.numel(), 32)).flatten().tolist() == [3, 14, 15]


def test_offload_with_everything_resident_matches_full(fixtures):
    ids = prompt(700, seed=1)
    _, full = run(fixtures, "full", ids)
    _, all_resident = run(fixtures, "recency-100000", ids)
    assert all_resident.output_ids == full.output_ids
    for a, b in zip(all_resident.step_logits, full.step_logits):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_recency_keeps_only_recent_csa_kv_on_device(fixtures, monkeypatch):
    ids = prompt(1500, seed=2)
    selected = []
    gather = PagedDecodeKV.gather_entries

    def spy(self, layer_id, kind, idx):
        if kind == "kv" and self.page_tables is not None:
            pages = self.page_tables[torch.arange(idx.shape[0]).unsqueeze(1), idx // 32]
            selected.append(pages)
        return gather(self, layer_id, kind, idx)
    monkeypatch.setattr(PagedDecodeKV, "gather_entries", spy)
    llm, seq = run(fixtures, "recency-256", ids, max_tokens=20)
    _, full = run(fixtures, "full", ids, max_tokens=20)
    store = llm.engine.store
    # 12 blocks (1519 tokens); the last 256 tokens + the newest block stay on the device
    assert seq.device_kv_bytes["CSA main"] == 3 * store.page_bytes()
    assert full.device_kv_bytes["CSA main"] == 12 * store.block_bytes()["CSA main"]
    assert seq.device_kv_bytes["HCA"] == full.device_kv_bytes["HCA"]   # HCA and indexer keys stay
    assert llm.engine.stats.pages_evicted >= 9
    # after the policy ran, no selection ever pointed at a non-resident block: the pages the
    # decode steps read are real pages (a -1 would mean host-only data was selected)
    assert selected and all(bool((p >= 0).all()) for p in selected)
    assert store.page_pool.num_used == 0 and store.pool.num_used == 0


def test_oracle_uses_prompt_end_attention(fixtures):
    ids = prompt(1200, seed=3)
    llm, seq = run(fixtures, "oracle-2", ids)
    assert seq.capture is not None and len(seq.capture.mass) == 3          # the 3 CSA layers
    assert all(m.numel() == 1200 // 4 for m in seq.capture.mass.values())
    assert seq.device_kv_bytes["CSA main"] == 3 * llm.engine.store.page_bytes()  # top 2 + newest


@pytest.mark.parametrize("policy", ["recency-512", "flashmemory-0.5"])
def test_a_prefix_hit_under_an_offloading_policy_equals_the_request_computed_whole(fixtures, policy,
                                                                                   warm_start_indexer):
    """A second request over the same prompt takes its blocks from the prefix cache: their CSA
    entries come from host memory (the device pages loaded from there), and the policy then keeps
    its share; outputs and logits equal the first request's and a run without prefix caching."""
    ids = prompt(900, seed=5)
    kw = {"memory_indexer": str(warm_start_indexer)} if policy.startswith("flashmemory") else {}
    llm = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=2, memory_policy=policy, **kw)
    assert llm.engine.ec.enable_prefix_caching
    llm.engine.record_logits = True
    seqs = []
    for _ in range(2):
        seqs.append(llm.engine.add_request(ids, SamplingParams(max_tokens=10, ignore_eos=True, seed=3)))
        while llm.engine.has_unfinished():
            llm.engine.step()
    first, second = seqs
    assert second.num_cached_tokens >= 768 and first.num_cached_tokens == 0
    llm.engine.store.pool.check()
    _, plain = run(fixtures, policy, ids, max_tokens=10, enable_prefix_caching=False, **kw)
    assert first.output_ids == second.output_ids == plain.output_ids
    for a, b in zip(second.step_logits, plain.step_logits):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)


def test_flashmemory_with_its_whole_budget_matches_full(fixtures, warm_start_indexer):
    ids = prompt(700, seed=1)
    _, full = run(fixtures, "full", ids)
    llm, whole = run(fixtures, "flashmemory-1", ids, memory_indexer=str(warm_start_indexer))
    assert whole.output_ids == full.output_ids
    for a, b in zip(whole.step_logits, full.step_logits):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert llm.engine.stats.pages_evicted == 0


def test_flashmemory_recalls_what_its_scorer_names_at_its_cadence(fixtures, warm_start_indexer, monkeypatch):
    """A deterministic scorer: at the end of the prefill it names the chunks of block 5, 64 decode
    steps later those of block 2. The policy keeps the newest complete block and the named one (and
    the block being filled); no decode step reads a block that is not resident (the engine raises)."""
    from hybridkv.engine.core import EngineCore

    calls = []

    def scores(self, seq):
        visible = seq.num_computed // 4
        calls.append((len(seq.output_ids), visible))
        p = torch.zeros(visible)
        if len(seq.output_ids) > 1:
            p[64:96] = 0.9                     # block 2's 32 chunks
        else:
            p[160:192] = 0.9                   # block 5's
        return p
    monkeypatch.setattr(EngineCore, "_memory_scores", scores)
    ids = prompt(1500, seed=2)                 # 12 blocks: 11 complete, budget 0.25 -> 3 blocks
    llm, seq = run(fixtures, "flashmemory-0.25", ids, max_tokens=70, memory_indexer=str(warm_start_indexer))
    assert calls == [(1, 375), (65, 391)]      # the prefill's end, then 64 decode steps later
    store = llm.engine.store
    # first call: 11 complete blocks and the one being filled, budget ⌊0.25 · 12⌋ = 3: block 10 (newest),
    # block 5 and block 11 being filled: 9 evicted. Second: ⌊0.25 · 13⌋ = 3, blocks 11 and 2 and the filling 12:
    # block 2 comes back from host memory, 10 and 5 leave
    assert llm.engine.stats.pages_evicted == 9 + 2 and llm.engine.stats.pages_loaded == 1
    assert seq.device_kv_bytes["CSA main"] == 3 * store.page_bytes()


def test_the_first_recall_scores_from_the_prompts_last_rows_however_it_was_chunked(fixtures, warm_start_indexer,
                                                                                    monkeypatch):
    """At the prefill's end the memory indexer scores the prompt's last 32 positions (their attention
    inputs gathered over the prefill's chunks) and the policy gets the last row's probabilities and
    their mean; 64 decode steps later, the step's one row. A prompt in one chunk and the same prompt
    whose last chunk has 10 rows score the same rows; a prefix hit leaves those 32 positions to
    compute."""
    from hybridkv.memory.indexer import MemoryIndexer
    from hybridkv.memory.policies import FlashMemory

    calls, policy_probs = [], []
    probabilities, resident = MemoryIndexer.probabilities, FlashMemory.resident

    def record(self, xs, positions, keys):
        out = probabilities(self, xs, positions, keys)
        calls.append((positions.tolist(), {layer: x.clone() for layer, x in xs.items()}, out))
        return out

    def spy(self, ctx):
        policy_probs.append(ctx.extra["chunk_probs"])
        return resident(self, ctx)
    monkeypatch.setattr(MemoryIndexer, "probabilities", record)
    monkeypatch.setattr(FlashMemory, "resident", spy)
    ids = prompt(778, seed=8)
    kw = dict(memory_indexer=str(warm_start_indexer), max_tokens=66)
    run(fixtures, "flashmemory-0.5", ids, max_num_batched_tokens=1024, **kw)
    run(fixtures, "flashmemory-0.5", ids, max_num_batched_tokens=384, **kw)     # chunks of 384, 384, 10
    assert [c[0] for c in calls] == [list(range(746, 778)), [841]] * 2
    (_, whole, _), (_, one_row, _), (_, chunked, _) = calls[0], calls[1], calls[2]
    assert all(x.shape[0] == 1 for x in one_row.values())
    for layer, x in whole.items():
        assert x.shape[0] == 32 and torch.allclose(x, chunked[layer], atol=1e-5)
    assert policy_probs[0].shape == (2, 778 // 4) and policy_probs[1].shape == (841 // 4,)
    assert torch.allclose(policy_probs[0][0], calls[0][2][-1], atol=1e-6)        # the last row
    assert torch.allclose(policy_probs[0][1], calls[0][2].mean(0), atol=1e-6)     # the mean over 32
    assert torch.allclose(policy_probs[0], policy_probs[2], atol=1e-5)

    llm = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=1, memory_policy="flashmemory-0.5",
              memory_indexer=str(warm_start_indexer))
    assert llm.engine.prefix.compute_tail == 32
    for n in range(2):
        seq = llm.engine.add_request(prompt(780, seed=9), SamplingParams(max_tokens=1))
        while llm.engine.has_unfinished():
            llm.engine.step()
    assert seq.num_cached_tokens == 640        # 6 blocks end before 780 - 32; 768 would leave 12


def test_a_recalled_page_holds_the_host_copys_bytes(fixtures):
    llm = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=2, memory_policy="recency-128")
    seq = llm.engine.add_request(prompt(900, seed=4), SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.step()
    store, cache = llm.engine.store, seq.cache
    before = {layer: pages[cache.pages[0]].clone() for layer, pages in store.pages.items()} if cache.pages[0] >= 0 else None
    store.set_resident(cache, {len(cache.block_table) - 1})          # block 0 leaves the device
    assert cache.pages[0] < 0
    store.set_resident(cache, {0, len(cache.block_table) - 1})       # and comes back
    for layer, pages in store.pages.items():
        assert torch.equal(pages[cache.pages[0]], store.entries[layer]["kv"][cache.block_table[0]])
        if before is not None:
            assert torch.equal(pages[cache.pages[0]], before[layer])
    while llm.engine.has_unfinished():
        llm.engine.step()


class _CopiesInFlight:
    """Stands in for the copy stream's event: the copies report arrival at the fourth query."""

    def __init__(self):
        self.queries = 0

    def query(self):
        self.queries += 1
        return self.queries >= 4


def test_a_recall_takes_over_only_when_its_pages_have_arrived(fixtures, monkeypatch):
    """While a recall's copies are in flight, the blocks resident before stay readable and the
    recalled ones are not read; the decode steps meanwhile go on (each asks once whether they have
    arrived); at the first step that finds them arrived the new resident set takes over, and the
    recalled page holds the host copy's bytes."""
    from hybridkv.cache.paged import PagedKVStore
    copy = PagedKVStore._copy_pages
    monkeypatch.setattr(PagedKVStore, "_copy_pages",
                        lambda self, loads: copy(self, loads) or (_CopiesInFlight() if any(d for _, d in loads) else None))
    llm = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=2, memory_policy="recency-128")
    seq = llm.engine.add_request(prompt(900, seed=4), SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.step()                                   # the prefill; recency keeps the newest blocks
    store, cache, stats = llm.engine.store, seq.cache, llm.engine.stats
    old = list(cache.pages)
    assert old[0] < 0 and cache.recall is None
    keep = {0, len(cache.block_table) - 1}
    assert store.start_recall(cache, keep) == 1
    used, loaded, evicted = store.page_pool.num_used, stats.pages_loaded, stats.pages_evicted
    for _ in range(2):                                  # in flight: the old set is what is read
        assert store.settle_recall(cache) is None and cache.pages == old
        llm.engine.step()
    assert cache.recall is None                         # the second step found the pages arrived
    gone = sum(p >= 0 for p in old) - 1
    assert (stats.pages_loaded, stats.pages_evicted) == (loaded + 1, evicted + gone)
    assert [b for b, p in enumerate(cache.pages) if p >= 0] == sorted(keep)
    assert store.page_pool.num_used == used - gone
    for layer, pages in store.pages.items():
        assert torch.equal(pages[cache.pages[0]], store.entries[layer]["kv"][cache.block_table[0]])
    while llm.engine.has_unfinished():
        llm.engine.step()
    store.pool.check()
    assert store.page_pool.num_used == 0


def test_flashmemory_without_an_indexer_or_with_another_models_is_refused(fixtures, tmp_path):
    from hybridkv.memory.indexer import MemoryIndexer
    from hybridkv.train.export import float_model

    with pytest.raises(ConfigError, match="needs a memory indexer.*train-memory-indexer"):
        LLM(fixtures / "v4-tiny", num_blocks=8, memory_policy="flashmemory")
    shipped = float_model(fixtures.parents[1] / "models" / "tiny-v4")
    path = MemoryIndexer.from_native(shipped).save(tmp_path)
    with pytest.raises(ConfigError, match="a memory indexer for another model"):
        LLM(fixtures / "v4-tiny", num_blocks=8, memory_policy="flashmemory", memory_indexer=str(path))


def test_requests_recalling_in_one_step_leave_each_request_a_page_for_its_next_block(fixtures, monkeypatch):
    """Copies in flight hold a request's old resident set and its new pages at once. When that would
    leave fewer free pages than one a request (the block each may open before its recall arrives),
    the request's old set is evicted before its copies instead: two requests recalling in the same
    step do not starve each other's next block."""
    from hybridkv.cache.paged import PagedKVStore
    from hybridkv.presets import load_config
    copy = PagedKVStore._copy_pages
    monkeypatch.setattr(PagedKVStore, "_copy_pages",
                        lambda self, loads: copy(self, loads) or (_CopiesInFlight() if any(d for _, d in loads) else None))
    store = PagedKVStore(load_config(fixtures / "v4-tiny"), 16, 2, resident_pages=11)
    a, b = store.new_seq(), store.new_seq()
    for seq in (a, b):
        seq.block_table = [store.pool.allocate() for _ in range(5)]
        store.attach_pages(seq)
        store.set_resident(seq, {3, 4})                 # two pages each: 7 free
    assert store.page_pool.num_free == 7
    assert store.start_recall(a, {0, 1, 2, 4}) == 3     # 3 ≤ 7 − 2: a holds its old set while copying
    assert a.pages[3] >= 0 and store.page_pool.num_free == 4
    assert store.start_recall(b, {0, 1, 2, 4}) == 3     # 3 > 4 − 2: b's block 3 leaves first
    assert b.pages[3] < 0 and store.page_pool.num_free == 2
    for seq in (a, b):                                  # each opens a block before its recall arrives
        seq.block_table.append(store.pool.allocate())
        store.attach_pages(seq)
    for seq in (a, b):
        assert store.settle_recall(seq, wait=True) == (3, 1)
        assert [i for i, p in enumerate(seq.pages) if p >= 0] == [0, 1, 2, 4, 5]


def test_requests_recalling_in_the_same_step_start_one_copy_and_decode_as_alone(fixtures, monkeypatch):
    """Requests whose recalls fall in the same step have their pages filled by one copy (one gather
    over the host pool on CUDA), and each decodes what it decodes alone."""
    from hybridkv.cache.paged import PagedKVStore
    copy, calls = PagedKVStore._copy_pages, []

    def spy(self, loads):
        calls.append(sum(1 for _, d in loads if d))     # requests with pages to fill in this copy
        return copy(self, loads)
    monkeypatch.setattr(PagedKVStore, "_copy_pages", spy)
    ids = [prompt(700, seed=5), prompt(700, seed=6)]
    llm = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=2, memory_policy="random-0.5")
    seqs = [llm.engine.add_request(x, SamplingParams(max_tokens=70, ignore_eos=True), request_id=f"r{i}")
            for i, x in enumerate(ids)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.store.pool.check()
    assert calls.count(2) >= 1 and 1 not in calls        # the decode recall at step 64: both requests, one copy
    for i, (x, seq) in enumerate(zip(ids, seqs)):    # random-p draws from the request's id
        alone = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=2, memory_policy="random-0.5").engine
        one = alone.add_request(x, SamplingParams(max_tokens=70, ignore_eos=True), request_id=f"r{i}")
        while alone.has_unfinished():
            alone.step()
        assert seq.output_ids == one.output_ids
