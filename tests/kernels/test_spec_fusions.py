"""The speculative step's fused launches change nothing: the fixed-shape speculative step of
engine/spec_graphs.py through the Triton kernels (in the interpreter), with every verify wave's
compressor update in one launch per compressor and the rollback's kernels, gives the tokens, drafts,
window rows, compressor states, entries and MTP ring of the same step with a launch per wave and
the rollback's plain-torch composition, to the bit. One request keeps its drafts, the other rejects
them after a token that completes a ratio-4 entry."""

from pathlib import Path

import torch

from helpers import interpreter_only
from hybridkv.engine import LLM, SamplingParams
from hybridkv.engine.graphs import context_bucket
from hybridkv.engine.spec_graphs import SpeculativeGraphs
from hybridkv.model.attention import Attention
from hybridkv.ops import speculative as spec_ops

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-v4"
K = 2


def _tensors(eng) -> list[torch.Tensor]:
    store = eng.store
    out = [store.rings] + [t for g in store.state_groups for t in (g.kv, g.score)]
    for ents in store.entries:
        out += list(ents.values())
    return out + [eng.drafter.cache.ring]


@interpreter_only
def test_fused_speculative_step_equals_the_step_launched_wave_by_wave(monkeypatch):
    eng = LLM(SHIPPED, num_blocks=16, max_num_seqs=3, max_num_batched_tokens=1024, kv_format="bf16",
              speculative="mtp", num_speculative_tokens=K, enable_prefix_caching=False).engine
    g = torch.Generator().manual_seed(3)
    seqs = [eng.add_request(torch.randint(10, 500, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=64, ignore_eos=True)) for n in (299, 262)]
    while any(s.first_token_time is None for s in seqs):
        eng.step()                              # the prefills, on the plain-torch path
    positions = [s.num_computed for s in seqs]
    assert positions == [299, 262]    # both complete a ratio-4 entry: the first at once, the second at its first draft
    eng.store.kernel_formats = ("bf16", "bf16")
    spec = SpeculativeGraphs(eng.model, eng.store, eng.drafter.cache, eng.store.new_seq().slot, capture=False)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    cap = context_bucket(max(positions) + K, eng.store.block_tokens)
    before = [t.clone() for t in _tensors(eng)]

    def step(tokens):
        for t, b in zip(_tensors(eng), before):
            t.copy_(b)
        host = spec._host_inputs(tokens, [s.cache for s in seqs], positions, [s.mtp_start for s in seqs], 2, cap)
        graph = spec._build(host, K, cap)
        spec._forward(graph)
        out = [graph.out[name].clone() for name in ("tokens", "kept", "drafts", "logits")]
        return out + [t.clone() for t in _tensors(eng)]

    last = [s.token_ids[s.num_computed] for s in seqs]
    first = step([[t, 7, 7] for t in last])
    own = first[0][:, 0].tolist()               # each request's next token: request 0 drafts it right
    waves = []
    real = Attention._compress_waves_fused
    def counted(self, views, rows, fused):
        took = real(self, views, rows, fused)
        waves.append(len(views) if took else 0)
        return took
    monkeypatch.setattr(Attention, "_compress_waves_fused", counted)
    drafts = [[last[0], own[0], 7], [last[1], (own[1] + 1) % 500, 7]]
    fused = step(drafts)
    assert fused[1].tolist() == [2, 1] or fused[1].tolist() == [3, 1]
    cfg = eng.config
    assert waves == [K + 1 if cfg.layer_ratio(i) else 0 for i in range(cfg.num_hidden_layers)]
    monkeypatch.setattr(Attention, "_compress_waves_fused", lambda *a: False)
    monkeypatch.setattr(spec_ops, "use_triton", lambda x: False)
    apart = step(drafts)
    assert any(not torch.equal(a, b) for a, b in zip(fused[4:], before))      # the step wrote the store
    for a, b in zip(fused, apart):
        assert torch.equal(a, b)
