"""The engine on CUDA attends through the paged Triton kernels (indexer top-k over the stored keys,
sparse attention over the ring and the pools): same answers as the reference path, the deployed
packed formats, and batch-invariant logits in deterministic mode."""

from pathlib import Path

import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.eval.runner import build_samples, score
from hybridkv.ops.backend import deterministic
from hybridkv.tasks.tokenizer import TaskTokenizer

ROOT = Path(__file__).parents[2]
MODEL = ROOT / "models" / "tiny-v4"
FP8_FIXTURE = ROOT / "tests" / "fixtures" / "v4-tiny-fp8"


def _generate(model, prompts, max_tokens, dtype=torch.bfloat16, **kw):
    llm = LLM(model, device="cuda", dtype=dtype, num_blocks=512, max_num_seqs=len(prompts),
              max_num_batched_tokens=8192, **kw)
    llm.engine.record_logits = True
    llm.engine.finished = {}
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    logits = [torch.stack(llm.engine.finished[o.request_id].step_logits).float() for o in outs]
    return llm.engine.store.kernel_formats, outs, logits


def test_kernel_path_answers_as_the_reference_path(monkeypatch):
    tok = TaskTokenizer.load(MODEL)
    samples = [s for _, s in build_samples(tok, ["passkey", "niah_single_2"], [1536, 6144], 2, seed=5)]
    prompts = [s.prompt for s in samples]
    formats, paged, paged_logits = _generate(MODEL, prompts, 12)
    assert formats == ("bf16", "bf16")
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    formats, ref, ref_logits = _generate(MODEL, prompts, 12)
    assert formats is None
    for s, a, b in zip(samples, ref, paged):
        print(f"\n{s.task} {len(s.prompt)}: reference {a.text!r} kernels {b.text!r}")
        assert score(s, b.text) == score(s, a.text) == 1.0
    first = [float((a[0] - b[0]).norm() / a[0].norm()) for a, b in zip(ref_logits, paged_logits)]
    print(f"first-token logits, relative difference: {', '.join(f'{x:.2e}' for x in first)}")
    assert max(first) < 5e-2


def test_kernel_path_reads_the_packed_formats(monkeypatch):
    """The fp8 store (584-byte entries, FP4 indexer keys) through the kernels: every attention call
    of the engine's run (each layer's prefill chunk and decode steps) is also computed by the
    reference paged ops on the same inputs (the same packed store, read through its codec), and the
    two agree within the kernels' rounding (bf16 operands) and top-k near-ties (H200, 2026-12-04: at
    most 2.0e-3 over 40 prefill calls, 1.0e-3 over 12 decode calls). A misread entry or key would
    part them by order 1. Logits are not compared across the two paths: this random
    fixture is chaotic (its FP8 round trips turn rounding differences into other codes; the
    first-token logits of the whole reference path parted from the kernels' by 0.06-0.31 on the
    H200, and on the CPU the reference attention alone moves them by up to 0.46 in float32)."""
    from hybridkv.model import attention
    monkeypatch.setenv("HYBRIDKV_CUDA_GRAPHS", "0")         # the reference ops sync: no capture
    through_kernels = attention.Attention._attend_kernels
    diffs = []

    def both(self, kargs, q, stored_rows, rows, out_dtype=torch.float32, out=None):
        with monkeypatch.context() as m:        # first: the kernels may write their result over q
            m.setenv("HYBRIDKV_KERNELS", "reference")
            ref = through_kernels(self, kargs, q, stored_rows, rows)
        got = through_kernels(self, kargs, q, stored_rows, rows, out_dtype, out=out)
        diffs.append((ref.shape[0], float((got.float() - ref).norm() / ref.norm())))
        return got

    monkeypatch.setattr(attention.Attention, "_attend_kernels", both)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (700, 420)]
    formats, _, _ = _generate(FP8_FIXTURE, prompts, 4, kv_format="fp8")
    assert formats == ("fp8", "fp4")
    prefill = [d for t, d in diffs if t > 2]
    decode = [d for t, d in diffs if t <= 2]
    print(f"\nfp8/fp4 store, kernels against the reference paged ops on the same inputs: {len(prefill)} prefill "
          f"calls, largest {max(prefill):.2e}; {len(decode)} decode calls, largest {max(decode):.2e}, median "
          f"{sorted(decode)[len(decode) // 2]:.2e}")
    assert prefill and decode
    assert max(prefill) < 1e-2 and max(decode) < 1e-2


def test_engine_logits_do_not_depend_on_the_batch_in_deterministic_mode():
    g = torch.Generator().manual_seed(1)
    target = torch.randint(10, 500, (2500,), generator=g).tolist()
    others = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (900, 3100, 40)]
    with deterministic():
        _, _, alone = _generate(FP8_FIXTURE, [target], 6, kv_format="fp8")
        _, _, batched = _generate(FP8_FIXTURE, others[:2] + [target] + others[2:], 6, kv_format="fp8")
    assert torch.equal(alone[0], batched[2])


def test_v41_decode_reads_the_packed_layout(monkeypatch):
    """V4.1 in its packed layout decodes through the kernels (window and selected global entries read
    packed, the indexer scored and selected over the stored keys; prefill stays on the reference
    path). The fixture's random weights make the model chaotic in bf16: its bf16 reference path is
    0.33 from its own float32 logits at 900 tokens (CPU too), so the kernels are held to what they
    change. bf16, eager on both sides: the kernels against the same run with the store offering no
    kernel formats (reference attention and selection, every other op as before), every step and
    token. (That run cannot replay CUDA graphs; against the kernels' graph replays its bf16 logits
    part by 2e-2 to 0.29 a step, the GEMMs' other shapes under a padded batch amplified by the
    chaotic model, as float32 shows: 7e-7. tests/gpu/test_engine_graphs_cuda.py compares the
    replays with eager steps in float32.) Float32: kernels against the whole reference path, the
    steps before the first whose tokens part. Measured on the H100 (2026-12-06): the bf16 runs equal,
    every step; float32 at most 1.5e-2 a step before the tokens part."""
    from hybridkv.cache import paged as paged_store
    from hybridkv.model import attention
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (900, 300)]
    v41 = ROOT / "tests" / "fixtures" / "v41-tiny"
    calls = []
    through_kernels = attention.Attention._attend_kernels_v41
    monkeypatch.setattr(attention.Attention, "_attend_kernels_v41",
                        lambda self, *a, **k: calls.append(1) or through_kernels(self, *a, **k))
    formats, out32, paged32 = _generate(v41, prompts, 6, kv_format="v41", dtype=torch.float32)
    assert formats == ("v41", "fp4") and calls
    _, out16, paged16 = _generate(v41, prompts, 6, kv_format="v41", cuda_graphs=False)
    with monkeypatch.context() as m:
        m.setattr(paged_store.PagedKVStore, "_kernel_formats", lambda self: None)
        formats, ref_out16, ref16 = _generate(v41, prompts, 6, kv_format="v41", cuda_graphs=False)
    assert formats is None
    assert [o.output_ids for o in out16] == [o.output_ids for o in ref_out16]
    for a, b in zip(ref16, paged16):
        # (equal on the H100; a near-tie in a top-k may take another entry: 1.7e-3 seen on the H200)
        assert float((a - b).norm() / a.norm()) < 1e-2
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    formats, ref_out32, ref32 = _generate(v41, prompts, 6, kv_format="v41", dtype=torch.float32)
    assert formats is None
    # the whole reference path differs in every op's rounding, which the fixture's FP4/FP8 round trips
    # and top-k choices can turn into another token: the steps are compared up to the first whose
    # tokens part (same inputs, same outputs). The parting step is printed, not bounded: on the H100
    # (2026-12-06) the 300-token prompt parts at its third step by 0.26, with V4's selection kernels
    # and with the top-k of the scores in torch alike, and with either FP8 linear kernel
    for a, b, oa, ob in zip(ref32, paged32, ref_out32, out32):
        same = [x == y for x, y in zip(oa.output_ids, ob.output_ids)]
        n = same.index(False) if False in same else len(same)
        rel = (a - b).norm(dim=-1) / a.norm(dim=-1)
        print(f"float32 logits by step, relative difference: {', '.join(f'{x:.1e}' for x in rel.tolist())}"
              f"{'' if n == len(same) else f' (tokens part at step {n})'}")
        assert n >= 2 and rel[:n].max() < 2e-2


def test_snapshots_for_the_lower_tiers_alone_are_copied_to_host_memory():
    """With room on the device for two snapshots and in the tier writer for three, a 700-token chunk's
    oldest snapshot (128) goes to the DRAM tier alone, through pinned host copies the writer waits
    for: it equals the snapshot an engine with room for all keeps on the device, and a prompt that
    shares the first 200 tokens hits there with the same outputs."""
    from engine_helpers import prompts_of

    base = prompts_of([700], seed=21)[0]
    other = base[:200] + prompts_of([150], seed=5)[0]

    def engine(**kw):
        llm = LLM(FP8_FIXTURE, device="cuda", dtype=torch.bfloat16, kv_format="fp8", num_blocks=64,
                  max_num_seqs=1, max_num_batched_tokens=1024, **kw)
        llm.engine.record_logits = True
        return llm

    def run(llm, prompt):
        seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        while llm.engine.has_unfinished():
            llm.engine.step()
        return seq

    ample = engine(tiers={"dram_bytes": 0})
    run(ample, base)
    size = ample.engine.snapshot_nbytes
    want = {k: snap for k, (snap, _) in ample.engine.prefix.snapshots._items.items()}
    want_other = run(ample, other)
    block = sum(ample.engine.store.block_bytes().values()) + 4 * ample.engine.store.block_tokens
    llm = engine(snapshot_bytes=2 * size + size // 2,
                 tiers={"dram_bytes": 1 << 30, "max_pending_bytes": 5 * block + 3 * size + size // 2})
    seq = run(llm, base)
    llm.engine.tiers.flush()
    assert (llm.engine.prefix.snapshots_below, llm.engine.prefix.snapshots_skipped) == (1, 2)
    key = seq.block_hashes[0]
    rec = llm.engine.tiers.tier("dram").get(key, "state")
    for layer, ts in enumerate(want[key]):
        for j, t in enumerate(ts):
            assert torch.equal(rec.tensors[f"{layer}.{j}"], t.cpu()), (layer, j)
    hit = run(llm, other)
    assert hit.num_cached_tokens == want_other.num_cached_tokens == 128
    assert hit.output_ids == want_other.output_ids
