"""The sharded engine's model on CUDA: two ranks share the one GPU over gloo (NCCL refuses two
ranks on one device; HYBRIDKV_DIST_BACKEND / HYBRIDKV_DIST_ONE_GPU), so the expert-parallel
routing through the grouped FP4 kernels, the vocabulary-parallel head and the split attention
run on the device, against one process in bf16."""

from pathlib import Path

import torch

from hybridkv.engine import LLM, SamplingParams

FIXTURE = Path(__file__).parents[1] / "fixtures" / "v4-tiny-fp8"
PROMPTS = [list(range(100, 133)), [7, 8, 9], list(range(300, 324))]


def _first_rows(**options):
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(FIXTURE, device="cuda", dtype=torch.bfloat16, cuda_graphs=False, num_blocks=64, **options) as llm:
        llm.engine.record_logits = True
        llm.engine.finished = {}
        outs = llm.generate(PROMPTS, sp)
        return torch.stack([llm.engine.finished[o.request_id].step_logits[0].float().cpu() for o in outs])


def test_two_ranks_on_one_gpu_match_one_process(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_DIST_BACKEND", "gloo")
    monkeypatch.setenv("HYBRIDKV_DIST_ONE_GPU", "1")
    one = _first_rows()
    # (the fixture's FP4 experts, 128 wide, do not split over 2 ranks along 128-wide activation
    # blocks: expert parallel only)
    for options in (dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, parallel_reduce="ordered")):
        two = _first_rows(**options)
        worst = (one - two).abs().max().item()
        print(f"{options}: prefill logits max |diff| {worst:.3e} (of {one.abs().max().item():.2f})")
        # bf16 partial sums across ranks through FP8 activation roundings (measured 0.21 under the
        # sum layout on 2026-12-03); a wrong slice or a lost expert differs by the logits' own size
        assert worst < 0.5, options
