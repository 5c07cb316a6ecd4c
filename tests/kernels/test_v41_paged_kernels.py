"""V4.1 decode attention on the paged kernels (in the interpreter on the CPU): a decode group reading
the window from each layer's ring and the selected global entries from the kv source's pool, both in
the packed "v41" layout, gives the reference path's logits."""

from pathlib import Path

import torch

from helpers import decode_after_prefill, interpreter_only
from hybridkv.engine import LLM, SamplingParams

V41_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v41-tiny"


def _decode(kernels: bool, monkeypatch):
    llm = LLM(V41_FIXTURE, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=1024, kv_format="v41")
    eng = llm.engine
    eng.record_logits = True
    g = torch.Generator().manual_seed(5)
    seqs = [eng.add_request(torch.randint(10, 500, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=4, ignore_eos=True)) for n in (200, 141)]
    decode_after_prefill(eng, ("v41", "fp4") if kernels else None, monkeypatch)
    return [s.output_ids for s in seqs], [torch.stack(s.step_logits).float() for s in seqs]


@interpreter_only      # on CUDA the store takes this path itself (tests/gpu)
def test_v41_decode_group_through_the_kernels_equals_the_reference_path(monkeypatch):
    ref_ids, ref_logits = _decode(False, monkeypatch)
    ids, logits = _decode(True, monkeypatch)
    assert ids == ref_ids
    for a, b in zip(ref_logits, logits):
        assert torch.equal(a[0], b[0])
        assert float((b[1:] - a[1:]).norm() / a[1:].norm()) < 1e-3


@interpreter_only
def test_v41_store_keeps_indexer_heads_the_kernels_cannot_range_over_on_the_reference_path(monkeypatch):
    """The paged kernels range over the indexer head (`tl.arange`, a power of two): a V4.1 config with
    96-dim indexer heads (valid: a multiple of the FP4 block) runs the reference path, as it would
    with no kernels, instead of failing to compile at its first decode step."""
    import dataclasses

    from hybridkv.cache.paged import PagedKVStore
    from hybridkv.presets import load_config
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    cfg = load_config(V41_FIXTURE)
    assert PagedKVStore(cfg, 8, 1, "v41", torch.float32).kernel_formats == ("v41", "fp4")
    wide = dataclasses.replace(cfg, index_head_dim=96)
    assert PagedKVStore(wide, 8, 1, "v41", torch.float32).kernel_formats is None
