"""Memory policies on the GPU: a recall's pages are copied from pinned host memory on a stream of
their own and take over only once they have arrived; the pages then hold the host copy's bytes, and
a request whose blocks all stay resident decodes as under `full`."""

import torch

from hybridkv.engine import LLM, SamplingParams


def _prompt(n, seed):
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_recalled_pages_arrive_on_the_copy_stream(fixtures):
    llm = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=2, memory_policy="recency-128", device="cuda",
              dtype=torch.float32)
    seq = llm.engine.add_request(_prompt(900, 4), SamplingParams(max_tokens=6, ignore_eos=True))
    llm.engine.step()
    store, cache = llm.engine.store, seq.cache
    assert store._host_csa.is_pinned() and cache.pages[0] < 0
    assert store.start_recall(cache, {0, len(cache.block_table) - 1}) == 1
    assert cache.recall.arrived is not None           # an event on the copy stream
    llm.engine.step()                                 # decoding goes on meanwhile
    store.settle_recall(cache, wait=True)
    assert cache.pages[0] >= 0
    for layer, pages in store.pages.items():
        assert torch.equal(pages[cache.pages[0]].cpu(), store.entries[layer]["kv"][cache.block_table[0]])
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert store.page_pool.num_used == 0


def test_everything_resident_decodes_as_full(fixtures):
    ids = _prompt(700, 1)
    outs = []
    for policy in ("full", "recency-100000"):
        llm = LLM(fixtures / "v4-tiny", num_blocks=32, max_num_seqs=2, memory_policy=policy, device="cuda",
                  dtype=torch.float32)
        outs.append(llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids)
    assert outs[0] == outs[1]
