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
    assert len(r) == 4 and 9 in r and r == RandomBlocks(0.34).resident(ctx)


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


def test_prefix_caching_conflict_is_explicit(fixtures):
    with pytest.raises(ConfigError, match="prefix caching cannot be combined"):
        LLM(fixtures / "v4-tiny", num_blocks=8, memory_policy="recency-512", enable_prefix_caching=True)
