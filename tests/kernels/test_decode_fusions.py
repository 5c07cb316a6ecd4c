"""The fused decode launches (the window row's round trip, pack and ring store; each compressor's
state update, block completion and packed store) change nothing: one fixed-shape decode step
through them gives the logits, ring rows, compressor states and pool bytes of the same step
through the unfused operations, to the bit. Both run their Triton kernels (in the interpreter on
the CPU); the step completes a CSA entry for one request and not for the other. And the attention's
wq_a and wkv, read by one GEMM, give what the two GEMMs give."""

from pathlib import Path

import torch

from helpers import interpreter_only
from hybridkv.engine import LLM, SamplingParams
from hybridkv.engine.graphs import DecodeGraphs, context_bucket
from hybridkv.model import attention, linear
from hybridkv.model.attention import Attention

FP8_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v4-tiny-fp8"


def _store_tensors(store) -> list[torch.Tensor]:
    out = list(store.ring)
    for sts in store.states:
        for kv, score in sts.values():
            out += [kv, score]
    for ents in store.entries:
        out += list(ents.values())
    return out


@interpreter_only      # the CPU engine with the kernels in the interpreter; on CUDA the GPU tests compare paths
def test_fused_decode_launches_equal_the_unfused_operations(monkeypatch):
    llm = LLM(FP8_FIXTURE, num_blocks=16, max_num_seqs=3, max_num_batched_tokens=1024, kv_format="fp8")
    eng = llm.engine
    eng.store.kernel_formats = ("fp8", "fp4")        # the paged path, as on CUDA
    g = torch.Generator().manual_seed(1)
    seqs = [eng.add_request(torch.randint(10, 500, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=4, ignore_eos=True)) for n in (299, 262)]
    while any(s.first_token_time is None for s in seqs):
        eng.step()
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    caches, positions = [s.cache for s in seqs], [s.num_computed for s in seqs]
    assert (positions[0] + 1) % 4 == 0 and (positions[1] + 1) % 4
    graphs = DecodeGraphs(eng.model, eng.store, capture=False)
    heads = torch.tensor([[s.token_ids[p], p, c.slot] for s, p, c in zip(seqs, positions, caches)]
                         + [[0, 0, graphs.pad_slot]])
    cap = context_bucket(max(positions), eng.store.block_tokens)
    before = [t.clone() for t in _store_tensors(eng.store)]

    def step():
        for t, b in zip(_store_tensors(eng.store), before):
            t.copy_(b)
        logits = graphs._forward(graphs._host_inputs(heads, caches, cap), cap)
        return [logits.clone()] + [t.clone() for t in _store_tensors(eng.store)]

    calls = {"compress": 0, "window": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper
    with monkeypatch.context() as m:
        m.setattr(attention, "compress_decode_paged", counted("compress", attention.compress_decode_paged))
        m.setattr(attention, "write_window_fp8", counted("window", attention.write_window_fp8))
        fused = step()
    cfg = eng.model.config
    ratios = [cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers)]
    assert calls == {"window": len(ratios), "compress": sum(1 + (r == 4) for r in ratios if r)}
    with monkeypatch.context() as m:
        m.setattr(Attention, "_window_fused", lambda self, dkv: False)
        m.setattr(Attention, "_fused_compressors", lambda self, dkv: ())
        unfused = step()
    assert any(not torch.equal(a, b) for a, b in zip(fused[1:], before))   # the step wrote the store
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)
    # wq_a and wkv share one buffer and one GEMM; read apart they give the same rows (the split-K
    # sums may add in another order)
    cfg = eng.model.config
    pair_rows = []
    real_pair = linear.paired_weights
    with monkeypatch.context() as m:
        def found(a, b):
            pair = real_pair(a, b)
            pair_rows.append(None if pair is None else pair[0].shape[0])
            return pair
        m.setattr(linear, "paired_weights", found)
        step()
    # one paired GEMM per layer for wq_a / wkv and one for the shared expert's w1 / w3
    assert pair_rows == [cfg.q_lora_rank + cfg.head_dim, 2 * cfg.moe_intermediate_size] * cfg.num_hidden_layers
    with monkeypatch.context() as m:
        m.setattr(linear, "paired_weights", lambda *a: None)
        apart = step()
    torch.testing.assert_close(apart[0], fused[0], rtol=1e-5, atol=1e-5)
