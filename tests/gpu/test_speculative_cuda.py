"""MTP speculative decoding on the GPU in bf16, deterministic (batch-invariant) mode: greedy
speculative outputs equal plain decoding's token for token over prompts whose drafts cross
compression blocks, which holds only if a verify forward of k+1 tokens rounds as k+1 one-token
steps do (without that mode bf16 near-ties part them, BENCHMARKS.md). On CUDA the verify rows run
as decode waves (`speculative_verify` auto), so their attention is the decode path's; as one
segment per request it failed here (2026-12-02), and as waves too (2026-12-04: tokens parted at
the 22nd), since plain decoding replays CUDA graphs, whose MoE ran every expert over every token
and summed in w2's GEMM, while the eager verify forward ran each expert over its rows: the MoE now
has one arithmetic in deterministic mode (`MoE._expert_order_sum`). Verify steps now replay
CUDA graphs too (engine/spec_graphs.py): their verify rows are decode waves over the paged kernels."""

from pathlib import Path

import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.ops.backend import deterministic
from hybridkv.tasks.generators import Pools, make_sample
from hybridkv.tasks.tokenizer import TaskTokenizer

MODEL = Path(__file__).parents[2] / "models" / "tiny-v4"


def _outputs(llm, prompts, params):
    return [o.output_ids for o in llm.generate(prompts, params)]


def test_greedy_speculative_equals_plain_decoding_in_deterministic_mode():
    tok = TaskTokenizer.load(MODEL / "tokenizer.json")
    pools = Pools(tok, seed=0, n_sentences=256, n_needles=64)
    prompts = [make_sample("passkey", i, pools, n).prompt for i, n in enumerate((252, 254, 380, 1000))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype=torch.bfloat16, num_blocks=64, max_num_seqs=4)
    with deterministic():
        plain = _outputs(LLM(str(MODEL), **kw), prompts, params)
        for k in (1, 2, 3):
            llm = LLM(str(MODEL), speculative="mtp", num_speculative_tokens=k, **kw)
            assert _outputs(llm, prompts, params) == plain, f"k={k}"
            st = llm.engine.stats
            assert st.spec_accepted_tokens > 0
            # most verify steps replayed the speculative step's CUDA graphs (engine/spec_graphs.py)
            assert llm.engine.spec_graphs.replays > 0 and st.spec_graph_steps >= 0.5 * st.spec_drafts / len(prompts)


def test_seeded_sampled_speculation_runs_on_the_gpu_and_repeats():
    """Rejection sampling with a seeded request draws from a generator on the GPU (a CPU generator
    is refused by torch's CUDA sampling): it runs, its steps replay the speculative graph, and the
    same seed repeats its tokens."""
    tok = TaskTokenizer.load(MODEL / "tokenizer.json")
    pools = Pools(tok, seed=0, n_sentences=256, n_needles=64)
    prompts = [make_sample("passkey", i, pools, 400).prompt for i in range(2)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=3)
    outs = []
    for _ in range(2):
        llm = LLM(str(MODEL), speculative="mtp", num_speculative_tokens=2, device="cuda", dtype=torch.bfloat16,
                  num_blocks=64, max_num_seqs=2)
        outs.append(_outputs(llm, prompts, params))
        assert llm.engine.stats.spec_drafts > 0 and llm.engine.spec_graphs.replays > 0
    assert outs[0] == outs[1] and all(len(o) == 16 for o in outs[0])


def test_unseeded_sampled_speculation_replays_graphs_and_follows_the_model():
    """Unseeded sampled requests (top-k 2) verify in the speculative step's CUDA graph (device-side
    rejection sampling, engine/spec_graphs.py) beside greedy ones: the graphs replay, the greedy
    requests give plain decoding's tokens, and the sampled second token's frequencies given the first
    match the model's top-2 distribution (chi-square per first token)."""
    with deterministic():      # greedy rows equal plain decoding's only where bf16 near-ties cannot part them
        tok = TaskTokenizer.load(MODEL / "tokenizer.json")
        pools = Pools(tok, seed=0, n_sentences=256, n_needles=64)
        prompt, other = (make_sample("passkey", i, pools, 400).prompt for i in range(2))
        kw = dict(device="cuda", dtype=torch.bfloat16, num_blocks=256, max_num_seqs=64, max_num_batched_tokens=32768)
        greedy = SamplingParams(max_tokens=8, ignore_eos=True)
        sp = SamplingParams(temperature=1.0, top_k=2, max_tokens=8, ignore_eos=True)
        want = _outputs(LLM(str(MODEL), **kw), [other], greedy)[0]
        llm = LLM(str(MODEL), speculative="mtp", num_speculative_tokens=2, **kw)
        outs = []
        for _ in range(8):
            got = _outputs(llm, [other] * 2 + [prompt] * 62, [greedy] * 2 + [sp] * 62)
            assert got[0] == want and got[1] == want
            outs += got[2:]
        st = llm.engine.stats
        assert llm.engine.spec_graphs.replays > 0 and st.spec_graph_steps > 0
        assert st.spec_accepted_tokens > 0 and st.spec_accepted_hist[0] > 0
        plain = LLM(str(MODEL), **kw)
        plain.engine.record_logits = True
        from hybridkv.engine.sampling import filtered_probs
        for first in {o[0] for o in outs}:
            seconds = [o[1] for o in outs if o[0] == first]
            if len(seconds) < 50:
                continue
            seq = plain.engine.add_request(prompt + [first], SamplingParams(max_tokens=1, ignore_eos=True))
            while plain.engine.has_unfinished():
                plain.engine.step()
            p = filtered_probs(seq.step_logits[0].float().cpu(), sp)
            counts = torch.bincount(torch.tensor(seconds), minlength=p.numel()).float()
            assert counts[p == 0].sum() == 0
            expect = p * len(seconds)
            chi2 = float(((counts - expect) ** 2 / expect)[p > 0].sum())
            assert chi2 < 10.8, (first, counts[p > 0], expect[p > 0])      # 1 degree of freedom, P = 0.001
