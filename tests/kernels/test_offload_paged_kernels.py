"""An offloading memory policy on the paged kernels (in the interpreter on the CPU): decode steps
whose CSA layers select among the resident blocks, read the device pages, store new entries into
them and write a completed block back to host memory give the reference path's tokens and logits."""

from pathlib import Path

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
