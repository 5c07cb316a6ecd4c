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


def _generate(model, prompts, max_tokens, **kw):
    llm = LLM(model, device="cuda", dtype=torch.bfloat16, num_blocks=512, max_num_seqs=len(prompts),
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
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (3000, 700)]
    formats, _, paged = _generate(FP8_FIXTURE, prompts, 2, kv_format="fp8")
    assert formats == ("fp8", "fp4")
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    _, _, ref = _generate(FP8_FIXTURE, prompts, 2, kv_format="fp8")
    first = [float((a[0] - b[0]).norm() / a[0].norm()) for a, b in zip(ref, paged)]
    print(f"\nfp8/fp4 store, first-token logits, relative difference: {', '.join(f'{x:.2e}' for x in first)}")
    assert max(first) < 0.1


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
    packed; prefill and the indexer's selection stay on the reference path): logits close to the
    reference path's (whose other ops also run their plain-torch definitions)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (900, 300)]
    v41 = ROOT / "tests" / "fixtures" / "v41-tiny"
    formats, _, paged = _generate(v41, prompts, 8, kv_format="v41")
    assert formats == ("v41", "fp4")
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    formats, _, ref = _generate(v41, prompts, 8, kv_format="v41")
    assert formats is None
    for a, b in zip(ref, paged):
        rel = float((a - b).norm() / a.norm())
        print(f"logits, relative difference: {rel:.2e}")
        assert rel < 5e-2
