"""The main job on the shipped model: load it, prefill a prompt in chunks, decode greedily, and
account for the KV the run actually holds, next to what the deployment byte layout would need."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hybridkv.cache.layout import default_format, entry_bytes, kv_layout
from hybridkv.engine.config import resolve_dtype
from hybridkv.errors import CheckpointError
from hybridkv.eval.scoring import string_match_all, word_match_all
from hybridkv.model import ContiguousKV, ForwardBatch
from hybridkv.weights import load_model

_REPO = Path(__file__).resolve().parents[1]
# The shipped model (trained by `hybridkv train --recipe tiny-v4`; see its README for what it can do).
DEFAULT_MODEL = _REPO / "models" / "tiny-v4"


def greedy_generate(model, prompt: torch.Tensor, max_tokens: int, chunk: int,
                    stop_id: int | None = None) -> tuple[list[int], ContiguousKV, dict]:
    """Prefill `prompt` [n] in chunks of `chunk`, then decode greedily up to `max_tokens` or through
    `stop_id`. Returns (new ids, state, timings)."""
    kv = ContiguousKV(model.config, model.dtype, prompt.device)
    t0 = time.perf_counter()
    pos = 0
    with torch.no_grad():
        while pos < prompt.numel():
            n = min(chunk, prompt.numel() - pos)
            h = model(prompt[pos:pos + n], ForwardBatch.build([(kv, pos, n)], prompt.device))
            pos += n
        next_id = int(model.logits(h[-1:]).argmax(-1))
        t1 = time.perf_counter()
        out = [next_id]
        while len(out) < max_tokens and next_id != stop_id:
            h = model(torch.tensor([next_id], device=prompt.device), ForwardBatch.build([(kv, pos, 1)], prompt.device))
            pos += 1
            next_id = int(model.logits(h).argmax(-1))
            out.append(next_id)
        t2 = time.perf_counter()
    return out, kv, {"prefill_s": t1 - t0, "decode_s": t2 - t1}


# (kind of compressed entry in kv-calc's breakdown, LayerKV kind, priced as an indexer key?) by layer kind
_ENTRY_KINDS = {
    "csa": (("CSA main", "kv", False), ("CSA indexer", "index", True)),
    "hca": (("HCA", "kv", False),),
    "full": (("global KV", "kv", False), ("indexer keys", "index", True)),
}


def kv_accounting(kv: ContiguousKV, fmt: str | None = None) -> list[tuple[str, int | None, int, int]]:
    """(kind, entries, bytes held by this run, bytes in the deployment layout `fmt`) per kind; the
    compressed kinds are kv-calc's (`kv_layout(config).per_token`), then "window" and "compressor
    state". The default format is the family's (fp8 for V4, v41 for V4.1)."""
    cfg = kv.config
    eb = entry_bytes(cfg, fmt or default_format(cfg))
    held: dict[str, int] = {}
    counts: dict[str, int] = {}
    priced: dict[str, int] = {}
    breakdown = kv_layout(cfg, "bf16").per_token
    for kinds in _ENTRY_KINDS.values():
        for name, _, is_index in kinds:
            if name in breakdown:
                held[name] = counts[name] = 0
                priced[name] = eb.index if is_index else eb.main
    for layer_id, layer in enumerate(kv.layers):
        nb = layer.nbytes()
        for name, entry_kind, _ in _ENTRY_KINDS.get(cfg.layer_kind(layer_id), ()):
            counts[name] += layer.num_entries(entry_kind)
            held[name] += nb[entry_kind]
    rows = [(name, counts[name], held[name], counts[name] * priced[name]) for name in held]
    total = kv.nbytes()
    rows.append(("window", len(kv.layers) * cfg.sliding_window, total["window"],
                 len(kv.layers) * cfg.sliding_window * eb.window))
    rows.append(("compressor state", None, total["compressor state"], total["compressor state"]))
    return rows


def run_demo(model_dir: str | None, max_tokens: int, chunk: int, prompt_tokens: int = 2048, device: str = "cpu",
             dtype: str | torch.dtype | None = "auto") -> int:
    path = Path(model_dir) if model_dir else DEFAULT_MODEL
    if not path.exists():
        raise CheckpointError(f"model directory {path} does not exist; pass --model DIR")
    t = time.perf_counter()
    model, cfg = load_model(path, device=device, dtype=resolve_dtype(dtype, device))
    load_s = time.perf_counter() - t
    print(f"model {path} ({cfg.family}, {cfg.num_hidden_layers} layers, ratios {list(cfg.compress_ratios)}), "
          f"loaded in {load_s:.2f}s on {device} ({str(model.dtype).removeprefix('torch.')})")
    tok, expected = None, None
    if (path / "tokenizer.json").exists():  # a passkey prompt in the model's own tokenizer
        from hybridkv.tasks.generators import Pools, make_sample
        from hybridkv.tasks.tokenizer import TaskTokenizer
        tok = TaskTokenizer.load(path)
        sample = make_sample("passkey", 0, Pools(tok, seed=0), prompt_tokens, depth=0.5)
        prompt, expected = torch.tensor(sample.prompt, device=device), sample.answers
        print(f"prompt: a {prompt.numel()}-token passkey task (needle at half depth), prefill in chunks of {chunk}, "
              f"up to {max_tokens} greedy tokens (stopping at EOS)")
    else:
        prompt = torch.randint(2, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).to(device)
        print(f"prompt: {prompt.numel()} token ids (seeded), prefill in chunks of {chunk}, {max_tokens} greedy tokens")
    out, kv, tm = greedy_generate(model, prompt, max_tokens, chunk, tok.eos_id if tok is not None else None)
    if tok is not None:
        text = tok.decode(out)
        verdict = ("retrieved" if word_match_all(text, expected) else
                   "found, but inside a longer string" if string_match_all(text, expected) else "not retrieved")
        print(f"output: {text!r}   expected pass key: {expected[0]} ({verdict})")
    else:
        print(f"generated ids: {out}")
    n_ctx = prompt.numel() + len(out) - 1
    print(f"prefill {prompt.numel() / tm['prefill_s']:.0f} tok/s, decode {(len(out) - 1) / max(tm['decode_s'], 1e-9):.1f} "
          f"tok/s; context {n_ctx} tokens\n")
    fmt = default_format(cfg)
    print(f"KV held by this run ({str(model.dtype).replace('torch.', '')} storage) and in the {fmt} deployment layout:")
    print(f"{'kind':<18}{'entries':>9}{'held bytes':>14}{fmt + ' bytes':>14}")
    rows = kv_accounting(kv, fmt)
    for kind, n, held, fp8 in rows:
        print(f"{kind:<18}{'-' if n is None else n:>9}{held:>14,}{fp8:>14,}")
    grow = sum(r[3] for r in rows[:-2])
    print(f"{'total':<18}{'':>9}{sum(r[2] for r in rows):>14,}{sum(r[3] for r in rows):>14,}")
    print(f"compressed KV: {grow / n_ctx:.2f} B/token in {fmt} over {n_ctx} tokens "
          f"(kv-calc: hybridkv kv-calc --config {path} --context {n_ctx})")
    return 0
