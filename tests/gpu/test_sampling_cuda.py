"""The sampler on the GPU: a step's unseeded sampled rows drawn together on the device, at each
row's own distribution; an engine serving them beside seeded and greedy requests under async
scheduling and graph replays."""

from pathlib import Path

import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.engine.sampling import draw_rows, filtered_probs_rows

MODEL = Path(__file__).parents[2] / "models" / "tiny-v4"


def test_unseeded_rows_draw_on_the_device_at_their_distributions():
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0], device="cuda")
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2),
             SamplingParams(temperature=0.5, top_p=0.7)]
    n = 4000
    params = [kinds[i % 3] for i in range(3 * n)]
    tokens = draw_rows(base.repeat(3 * n, 1), params, [None] * len(params)).tokens
    assert tokens.is_cuda
    want = filtered_probs_rows(base.repeat(3, 1).cpu(), kinds)
    for j in range(3):
        freq = torch.bincount(tokens[j::3].cpu(), minlength=8).float() / n
        assert bool((freq[want[j] == 0] == 0).all())
        assert bool(((freq - want[j]).abs() <= 5 * (want[j] * (1 - want[j]) / n).sqrt() + 1e-9).all()), (j, freq)


def test_unseeded_sampled_requests_beside_seeded_and_greedy_ones():
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (700, 300, 500, 200)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.9),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, seed=3),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=20)]
    runs = []
    for _ in range(2):
        llm = LLM(MODEL, device="cuda", dtype=torch.bfloat16, num_blocks=256, max_num_seqs=4,
                  max_num_batched_tokens=8192)
        runs.append(llm.generate(prompts, params))
        assert llm.engine.stats.queued_steps > 0 and llm.engine.stats.graph_steps > 0
    for a, b in zip(*runs):
        assert len(a.output_ids) == len(b.output_ids) == 12
    # a row's numbers do not depend on what the other rows hold: the greedy and the seeded requests
    # repeat whatever the unseeded ones drew
    assert runs[0][0].output_ids == runs[1][0].output_ids
    assert runs[0][2].output_ids == runs[1][2].output_ids
