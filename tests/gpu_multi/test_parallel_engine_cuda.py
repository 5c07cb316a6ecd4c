"""The sharded engine on two GPUs over NCCL against one GPU: a V4-Flash-shaped stack (real
attention and expert widths, fewer experts and a smaller vocabulary) under both expert layouts,
decode steps replayed from CUDA graphs that hold the collectives and queued ahead (async
scheduling); and the ordered layout over NCCL.

The prompts stay below the CSA top-k's reach (512 entries of 4 tokens), so attention selects
every entry and no near-tie of a random model's indexer scores turns round-off into a different
selection; three of the four blocks route by hash. What remains between layouts is bf16
round-off: the sum layout adds partial sums across ranks, and FP8 activation quantisers and the
random stack's four blocks magnify any rounding difference. Its size is measured in the same
test as the floor: one GPU's graph replays against its own eager steps (the MoE summed in one
GEMM against expert by expert: two equally valid roundings)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.tools.random_checkpoint import shaped_config, write_random_checkpoint

FP8_FIXTURE = Path(__file__).parents[1] / "fixtures" / "v4-tiny-fp8"
STEPS = 8
PROMPT_LENGTHS = (1500, 700, 33)


@pytest.fixture(scope="module")
def flash_stack(tmp_path_factory):
    """Four V4-Flash blocks (window, window, CSA, HCA) with 16 experts of the real width."""
    out = tmp_path_factory.mktemp("v4flash-4")
    write_random_checkpoint(shaped_config("v4-flash", layers=4, vocab=4096, experts=16), out, jobs=4)
    return out


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _decode(model_dir, prompts, **options):
    """(outputs, each request's logits rows [first token + decode steps], the engine's stats)."""
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, device="cuda", dtype=torch.bfloat16, kv_format="fp8", num_blocks=128,
             max_num_seqs=len(prompts), enable_prefix_caching=False, **options) as llm:
        llm.engine.record_logits = True
        llm.engine.finished = {}
        outs = llm.generate(prompts, sp)
        assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
        rows = [torch.stack(llm.engine.finished[o.request_id].step_logits).float().cpu() for o in outs]
        return outs, rows, replace(llm.engine.stats)


def _compared_rows(one, other):
    """Relative differences (‖a − b‖ / ‖a‖) of the rows whose earlier tokens agree: after the first
    token where two layouts chose differently, their contexts differ and the rows are not
    comparable."""
    (outs_a, rows_a), (outs_b, rows_b) = one, other
    diffs = []
    for oa, ob, ra, rb in zip(outs_a, outs_b, rows_a, rows_b):
        same = next((i for i, (x, y) in enumerate(zip(oa.output_ids, ob.output_ids)) if x != y), STEPS)
        for i in range(min(same + 1, len(ra))):
            diffs.append(float((ra[i] - rb[i]).norm() / ra[i].norm()))
    return diffs


@pytest.fixture(scope="module")
def one_gpu(flash_stack):
    """One GPU's decode of the prompts with graphs, and its relative differences from its own eager
    decode (the floor of what two equally valid bf16 computations differ by)."""
    prompts = _prompts(4096)
    outs, rows, stats = _decode(flash_stack, prompts)
    eager_outs, eager_rows, eager_stats = _decode(flash_stack, prompts, cuda_graphs=False)
    assert stats.graph_steps >= STEPS - 1 and eager_stats.graph_steps == 0
    floor = _compared_rows((eager_outs, eager_rows), (outs, rows))
    return prompts, outs, rows, floor


def _median(xs):
    return sorted(xs)[len(xs) // 2]


@pytest.mark.parametrize("experts", ["ep", "tp"])
def test_two_gpus_decode_as_one_with_graphs(flash_stack, one_gpu, experts):
    prompts, outs1, rows1, floor = one_gpu
    sp = dict(tensor_parallel_size=2, expert_parallel_size=2 if experts == "ep" else 1)
    outs2, rows2, stats = _decode(flash_stack, prompts, **sp)
    # every decode step after the first token replayed a captured graph, collectives included, and
    # (async scheduling) most were queued before the previous step's tokens were read
    assert stats.graph_steps >= STEPS - 1 and stats.queued_steps >= 3, stats
    diffs = _compared_rows((outs1, rows1), (outs2, rows2))
    agree = sum(a.output_ids == b.output_ids for a, b in zip(outs1, outs2))
    print(f"\n{experts}: {len(diffs)} rows compared, relative logits difference median {_median(diffs):.2e}, "
          f"largest {max(diffs):.2e}; {agree} of {len(prompts)} requests chose the same {STEPS} tokens; one GPU's "
          f"graphs against its eager steps: median {_median(floor):.2e}, largest {max(floor):.2e}")
    # a wrong slice, a lost expert or a missing reduction differs by the logits' own size; the
    # layouts' round-off stays within a small multiple of the floor
    assert _median(diffs) <= 2 * _median(floor) + 0.01
    assert max(diffs) <= 2 * max(floor) + 0.05


def test_ordered_layout_over_nccl():
    """The ordered layout (experts gathered and added in one process's order; eager, its expert
    loop cannot be captured) on the FP8 fixture. Not to the bit here: one GPU sums its experts in
    the grouped FP4 kernel, the ordered layout expert by expert (to the bit on the CPU,
    tests/test_distributed.py); within the sum layout's bound of the one-rank-per-GPU test on one
    GPU (tests/gpu/test_distributed_cuda.py)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in (150, 33, 3)]
    outs1, rows1, _ = _decode(FP8_FIXTURE, prompts, cuda_graphs=False)
    outs2, rows2, _ = _decode(FP8_FIXTURE, prompts, cuda_graphs=False, tensor_parallel_size=2,
                              parallel_reduce="ordered")
    worst = max((ra[0] - rb[0]).abs().max().item() for ra, rb in zip(rows1, rows2))
    print(f"\nordered: first-token logits max |diff| {worst:.3e} (of {rows1[0].abs().max().item():.2f})")
    assert worst < 0.5
