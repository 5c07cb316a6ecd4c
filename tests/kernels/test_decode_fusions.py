"""The fused decode launches (the window row's round trip, pack and ring store; each compressor's
state update, block completion and packed store) change nothing: one fixed-shape decode step
through them gives the logits, ring rows, compressor states and pool bytes of the same step
through the unfused operations, to the bit. Both run their Triton kernels (in the interpreter on
the CPU); the step completes a CSA entry for one request and not for the other. And the attention's
wq_a and wkv, read by one GEMM, give what the two GEMMs give."""

from pathlib import Path

import torch

from helpers import interpreter_only, next_decode_step
from hybridkv.model import attention, linear
from hybridkv.model.attention import Attention

FP8_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v4-tiny-fp8"
SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-v4"


def _store_tensors(store) -> list[torch.Tensor]:
    out = list(store.ring)
    for sts in store.states:
        for kv, score in sts.values():
            out += [kv, score]
    for ents in store.entries:
        out += list(ents.values())
    return out


def _replayer(eng, graphs, heads, seqs, cap):
    """The store as it is now, and a function that resets the store to it and runs the fixed-shape
    decode step again: [logits] + every store tensor after it."""
    caches = [s.cache for s in seqs]
    before = [t.clone() for t in _store_tensors(eng.store)]

    def step():
        for t, b in zip(_store_tensors(eng.store), before):
            t.copy_(b)
        logits = graphs._forward(graphs._host_inputs(heads, caches, cap), cap)
        return [logits.clone()] + [t.clone() for t in _store_tensors(eng.store)]
    return before, step


@interpreter_only      # the CPU engine with the kernels in the interpreter; on CUDA the GPU tests compare paths
def test_fused_decode_launches_equal_the_unfused_operations(monkeypatch):
    eng, seqs, graphs, heads, cap = next_decode_step(FP8_FIXTURE, "fp8", ("fp8", "fp4"), seed=1, padding=1)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    positions = [s.num_computed for s in seqs]
    assert (positions[0] + 1) % 4 == 0 and (positions[1] + 1) % 4
    before, step = _replayer(eng, graphs, heads, seqs, cap)

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


@interpreter_only
def test_fused_compressors_and_window_rows_over_a_float_store_with_plain_scales_equal_the_unfused_operations(
        monkeypatch):
    """A checkpoint whose KV round trips take plain amax/448 scales (the shipped model quantises only
    its experts) decodes over a bf16 store: each compressor's decode step and each layer's window row
    (round trip and ring store, `write_window_float`) are one launch there too, and change nothing to
    the bit."""
    eng, seqs, graphs, heads, cap = next_decode_step(SHIPPED, "bf16", ("bf16", "bf16"), seed=2, padding=1)
    assert not eng.model.config.kv_pow2_scales
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    positions = [s.num_computed for s in seqs]
    assert (positions[0] + 1) % 4 == 0 and (positions[1] + 1) % 4    # one request completes a ratio-4 entry
    before, step = _replayer(eng, graphs, heads, seqs, cap)

    calls, windows = [], []
    real, real_window = attention.compress_decode_paged, attention.write_window_float
    with monkeypatch.context() as m:
        m.setattr(attention, "compress_decode_paged", lambda *a, **kw: calls.append(a[13]) or real(*a, **kw))
        m.setattr(attention, "write_window_float", lambda *a: windows.append(a[-1]) or real_window(*a))
        fused = step()
    cfg = eng.model.config
    assert len(calls) == sum(1 + (cfg.layer_ratio(i) == 4) for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i))
    assert set(calls) == {"bf16"}
    assert windows == [False] * cfg.num_hidden_layers          # plain scales, every layer
    with monkeypatch.context() as m:
        m.setattr(Attention, "_fused_compressors", lambda self, dkv: ())
        m.setattr(Attention, "_window_fused", lambda self, dkv: False)
        unfused = step()
    assert any(not torch.equal(a, b) for a, b in zip(fused[1:], before))
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)
