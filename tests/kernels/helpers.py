"""Shared pieces of the kernel tests: the error measure, a random paged batch, and the mark of
tests that only make sense in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops.kv_formats import pack_main_fp8, pack_v41_global, pack_v41_window
from hybridkv.ops.paged import PagedBatch
from hybridkv.ops.quant import fp4_round_trip, fp8_round_trip


# a test that drives the kernels with CPU tensors through the interpreter (HYBRIDKV_KERNELS=triton on
# the CPU, stand-ins for what only the interpreter lacks); where CUDA exists tests/gpu checks the same
# behaviour on the device
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="interpreter test: tests/gpu covers this on CUDA")


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((ref - out).square().mean().sqrt() / ref.square().mean().sqrt().clamp(min=1e-30))


def random_entries(n: int, head_dim: int, rope_dim: int, fmt: str, gen: torch.Generator,
                   pool: bool = False) -> torch.Tensor:
    """n entries already on the storage grid: float32 rows for "bf16" (kept fp32 for the interpreter),
    packed uint8 rows for "fp8", and for "v41" packed window rows, or global KV entries where `pool`
    (a spread of magnitudes, so that the scales differ between blocks)."""
    x = torch.randn(n, head_dim, generator=gen)
    if fmt == "v41":
        x = x * torch.exp2(torch.randint(-6, 6, (n, head_dim // 16), generator=gen).float()).repeat_interleave(16, 1)
        if pool:
            return pack_v41_global(fp4_round_trip(x, 16, "e4m3"))
        return pack_v41_window(fp8_round_trip(x, 32, pow2=True))
    if fmt != "fp8":
        return x
    x = torch.cat([fp8_round_trip(x[:, : head_dim - rope_dim], 64), x[:, head_dim - rope_dim:].bfloat16().float()], 1)
    return pack_main_fp8(x, rope_dim)


def random_batch(segments: list[tuple[int, int]], num_blocks: int, block_tokens: int, num_slots: int,
                 gen: torch.Generator, device="cpu") -> PagedBatch:
    """segments: (start_pos, length) per request; each gets a distinct ring slot and random blocks."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    slots = torch.randperm(num_slots, generator=gen).tolist()
    items = []
    for r, (start, length) in enumerate(segments):
        need = (start + length + block_tokens - 1) // block_tokens
        blocks, perm = perm[:need], perm[need:]
        items.append((slots[r], start, length, blocks))
    return PagedBatch.build(items, block_tokens=block_tokens, device=device)


def decode_after_prefill(engine, formats: tuple[str, str] | None, monkeypatch, prefilled=None) -> None:
    """Run `engine`'s first step (the prefills, on the reference path; `prefilled(engine)` checks
    its state then), then its remaining decode steps through the paged kernels in the interpreter,
    reading the store in `formats`, or on the reference path where formats is None."""
    engine.step()
    if prefilled is not None:
        prefilled(engine)
    if formats is not None:
        engine.store.kernel_formats = formats
        monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    while engine.has_unfinished():
        engine.step()
    monkeypatch.delenv("HYBRIDKV_KERNELS", raising=False)


def next_decode_step(model_dir, kv_format: str, formats: tuple[str, str], seed: int, padding: int,
                     num_blocks: int = 16):
    """An engine (CPU) with two requests of 299 and 262 prompt tokens prefilled on the plain-torch
    paged definitions, its store read in `formats` as on CUDA, and the fixed-shape decode forward of
    their next step: (engine, requests, DecodeGraphs without capture, its inputs' heads [2 +
    padding, 3], the context bucket). The caller turns the kernels on (HYBRIDKV_KERNELS=triton)."""
    from hybridkv.engine import LLM, SamplingParams
    from hybridkv.engine.graphs import DecodeGraphs, context_bucket
    eng = LLM(model_dir, num_blocks=num_blocks, max_num_seqs=3, max_num_batched_tokens=1024,
              kv_format=kv_format).engine
    eng.store.kernel_formats = formats
    g = torch.Generator().manual_seed(seed)
    seqs = [eng.add_request(torch.randint(10, 500, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=4, ignore_eos=True)) for n in (299, 262)]
    while any(s.first_token_time is None for s in seqs):
        eng.step()
    graphs = DecodeGraphs(eng.model, eng.store, capture=False)
    heads = torch.tensor([[s.token_ids[s.num_computed], s.num_computed, s.cache.slot] for s in seqs]
                         + [[0, 0, graphs.pad_slot]] * padding)
    return eng, seqs, graphs, heads, context_bucket(max(s.num_computed for s in seqs), eng.store.block_tokens)
