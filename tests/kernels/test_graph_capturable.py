"""The decode forward that the engine captures into CUDA graphs must not synchronise with the host
or build tensors from host data: a capture refuses both (and, run eagerly, each is a stall per
step). Checked on the CPU by recording the torch operations the fixed-shape forward dispatches while
the paged ops run their Triton kernels (in the interpreter), against the engine's eager decode step,
which does synchronise (the MoE's per-expert token counts). A host tensor moved to the device (a
cached CPU constant) is invisible here, where both are the CPU: tests/gpu captures for real."""

from pathlib import Path

import pytest
import torch

from engine_helpers import HostReadRecorder as _Recorder
from helpers import interpreter_only, next_decode_step
from hybridkv.ops.indexer_topk import triton as indexer_kernels

FP8_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v4-tiny-fp8"
V41_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v41-tiny"


@interpreter_only
def test_fixed_shape_decode_forward_never_waits_for_the_device(monkeypatch):
    eng, seqs, graphs, heads, cap = next_decode_step(FP8_FIXTURE, "fp8", ("fp8", "fp4"), seed=0, padding=2)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")  # from here the ops run their kernels
    # the selection that 1M-token decode steps use: candidates gathered by several programs per token
    monkeypatch.setattr(indexer_kernels, "SPLIT_MIN_TILES", 1)
    caches = [s.cache for s in seqs]
    assert (seqs[0].num_computed + 1) % 4 == 0        # the first request completes a CSA entry now
    saved = {(c.slot, i): eng.store.capture_state(c.slot, i) for c in caches for i in range(eng.store.num_layers)}
    inputs = graphs._host_inputs(heads, caches, cap)     # host work before the replay: not recorded
    static = _Recorder()
    with static:
        logits = graphs._forward(inputs, cap)
    assert torch.isfinite(logits).all()
    assert not static.flagged, dict(static.flagged)
    for (slot, i), tensors in saved.items():
        eng.store.restore_state(slot, i, tensors)
    eager = _Recorder()
    with eager:
        eng.step()                                    # the same step, launched eagerly
    assert eager.flagged                              # what the recorder catches, and why graphs need their own path


@interpreter_only
def test_v41_fixed_shape_decode_forward_never_waits_for_the_device(monkeypatch):
    """V4.1 in its packed layout: the decode group scored over the stored keys by the kernels, the
    Full layers' entries appended with fixed shapes (one request completes a ratio-2 entry in this
    step, the other does not; ratio-1 layers complete one every step, the padding rows none), the
    Reuse layers' shared selection; no host synchronisation."""
    eng, seqs, graphs, heads, cap = next_decode_step(V41_FIXTURE, "v41", ("v41", "fp4"), seed=0, padding=2,
                                                     num_blocks=64)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    assert (seqs[0].num_computed + 1) % 2 == 0 and (seqs[1].num_computed + 1) % 2 == 1
    inputs = graphs._host_inputs(heads, [s.cache for s in seqs], cap)
    static = _Recorder()
    with static:
        logits = graphs._forward(inputs, cap)
    assert torch.isfinite(logits).all()
    assert not static.flagged, dict(static.flagged)


@interpreter_only
def test_a_decode_step_of_more_than_64_requests_never_waits_for_the_device(monkeypatch):
    """With HYBRIDKV_GRAPH_BATCH above 64, a captured step holds more requests: with 2 requests and 63
    padding rows the indexer still scores one token per program (its tile path groups a request's
    tokens on the host), and nothing else in the forward reads the device back."""
    from hybridkv.engine.graphs import DecodeGraphs, max_graph_batch
    from hybridkv.errors import ConfigError
    assert max_graph_batch() == 64
    for bad in ("0", "2048", "many"):
        monkeypatch.setenv("HYBRIDKV_GRAPH_BATCH", bad)
        with pytest.raises(ConfigError, match="HYBRIDKV_GRAPH_BATCH"):
            max_graph_batch()
    monkeypatch.setenv("HYBRIDKV_GRAPH_BATCH", "256")
    eng, seqs, graphs, heads, cap = next_decode_step(FP8_FIXTURE, "fp8", ("fp8", "fp4"), seed=0, padding=63)
    assert graphs.max_batch == 256            # read when the graphs were built
    monkeypatch.setenv("HYBRIDKV_GRAPH_BATCH", "many")
    with pytest.raises(ConfigError, match="HYBRIDKV_GRAPH_BATCH"):
        DecodeGraphs(eng.model, eng.store, capture=False)
    monkeypatch.delenv("HYBRIDKV_GRAPH_BATCH")
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    inputs = graphs._host_inputs(heads, [s.cache for s in seqs], cap)
    static = _Recorder()
    with static:
        logits = graphs._forward(inputs, cap)
    assert logits.shape[0] == 65 and torch.isfinite(logits[:2]).all()
    assert not static.flagged, dict(static.flagged)
