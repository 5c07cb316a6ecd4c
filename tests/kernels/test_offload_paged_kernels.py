"""An offloading memory policy on the paged kernels (in the interpreter on the CPU): decode steps
whose CSA layers select among the resident blocks, read the device pages, store new entries into
them and write a completed block back to host memory give the reference path's tokens and logits."""

from pathlib import Path

import numpy as np
import torch

from helpers import decode_after_prefill, interpreter_only
from hybridkv.engine import LLM, SamplingParams

FP8_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v4-tiny-fp8"


def _decode(kernels: bool, monkeypatch):
    llm = LLM(FP8_FIXTURE, num_blocks=16, max_num_seqs=1, max_num_batched_tokens=1024, kv_format="fp8",
              memory_policy="recency-200")
    eng = llm.engine
    eng.record_logits = True
    g = torch.Generator().manual_seed(4)
    seq = eng.add_request(torch.randint(10, 500, (509,), generator=g).tolist(),
                          SamplingParams(max_tokens=5, ignore_eos=True))

    def two_of_four_blocks_resident(engine):
        assert engine.stats.pages_evicted > 0

    decode_after_prefill(eng, ("fp8", "fp4") if kernels else None, monkeypatch, two_of_four_blocks_resident)
    return seq.output_ids, torch.stack(seq.step_logits).float(), eng.stats.pages_written_back


@interpreter_only      # on CUDA tests/gpu runs the kernels themselves
def test_offloading_policy_decodes_through_the_kernels_as_the_reference_path_does(monkeypatch):
    ref_ids, ref_logits, ref_written = _decode(False, monkeypatch)
    ids, logits, written = _decode(True, monkeypatch)
    assert ids == ref_ids
    assert float((logits - ref_logits).norm() / ref_logits.norm()) < 2e-2
    assert ref_written == 0 and written == 1     # block 3 completed at position 511


@interpreter_only
def test_flashmemory_scores_the_recalls_due_in_a_step_at_once_over_the_stored_keys(monkeypatch, tmp_path):
    """On the paged kernels the memory indexer scores every request whose decode recall a step's
    token runs in one pass (`paged_scores` over the FP4 keys where the store holds them), which gives
    what the request-by-request path (keys unpacked, float32) gives, within the kernel's rounding of
    the queries to fp16 (3.5e-5 here, the scores spreading 0.04); the policy gets each complete
    block's ranking key of those scores, computed where they are."""
    from hybridkv.engine.core import EngineCore
    from hybridkv.memory.indexer import MemoryIndexer
    from hybridkv.memory.policies import FlashMemory
    from hybridkv.presets import load_config
    path = MemoryIndexer.random(load_config(FP8_FIXTURE)).save(tmp_path)
    eng = LLM(FP8_FIXTURE, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=1024, kv_format="fp8",
              memory_policy="flashmemory-0.5", memory_indexer=str(path)).engine
    g = torch.Generator().manual_seed(5)
    seqs = [eng.add_request(torch.randint(10, 500, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=66, ignore_eos=True)) for n in (509, 430)]
    while len(seqs[0].output_ids) < 63:                  # the reference path up to the step before the recall
        eng.step()
    seen, ranks = [], {}
    due_probabilities, scores = EngineCore._due_probabilities, EngineCore._memory_scores
    resident_many = FlashMemory.resident_many

    def batched(self, due):
        probs = due_probabilities(self, due)
        for i, seq in enumerate(due):                    # request by request, over the same cache
            visible = seq.num_computed // 4
            seen.append((seq.request_id, visible, probs[i, :visible].float().cpu(), scores(self, seq)))
        return probs

    def spy(self, ctxs):
        for ctx in ctxs:
            if "block_ranks" in ctx.extra:
                ranks[ctx.request_id] = (ctx.extra["block_ranks"], ctx.extra["visible_chunks"])
        return resident_many(self, ctxs)
    monkeypatch.setattr(EngineCore, "_due_probabilities", batched)
    monkeypatch.setattr(FlashMemory, "resident_many", spy)
    eng.store.kernel_formats = ("fp8", "fp4")
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    while eng.has_unfinished():
        eng.step()
    # the recall after 64 decode steps, both requests in one step: each scores the chunks it sees
    assert [visible for _, visible, _, _ in seen] == [(509 + 63) // 4, (430 + 63) // 4]
    for rid, visible, got, want in seen:
        assert got.shape == want.shape == (visible,)
        assert float((got - want).abs().max()) < 5e-4 and 0 < float(got.std())
        key, visible_chunks = ranks[rid]
        assert visible_chunks == visible and key.shape == (visible // 32,)
        assert np.array_equal(key, eng.memory.block_ranks(got, visible // 32, 32).numpy())
