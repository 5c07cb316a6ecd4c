"""The `hybridkv` command line."""

from __future__ import annotations

import argparse
import json
import sys

from hybridkv.errors import HybridKVError


def _parse_count(text: str) -> int:
    """'1M' -> 1048576, '64k' -> 65536, '1000' -> 1000."""
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 64k, 1M)") from None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.2f} {unit}" if unit != "B" else f"{n:,.2f} B"
        n /= 1024
    return str(n)


def cmd_kv_calc(a: argparse.Namespace) -> int:
    from hybridkv.cache.layout import kv_layout
    from hybridkv.config import ModelConfig
    from hybridkv.presets import get_preset

    config = get_preset(a.preset) if a.preset else ModelConfig.from_json(a.config)
    lay = kv_layout(config, a.format)
    n = a.context
    report = {
        "model": a.preset or a.config, "family": config.family, "format": lay.fmt, "context": n,
        "entry_bytes": {"main": lay.entries.main, "index": lay.entries.index, "window": lay.entries.window},
        "bytes_per_token": lay.per_token, "bytes_per_token_total": lay.bytes_per_token,
        "fixed_bytes": lay.fixed, "fixed_bytes_total": lay.fixed_bytes,
        "total_bytes": lay.total(n),
    }
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['model']} ({config.family}), format {lay.fmt}, context {n:,} tokens")
    print(f"entry bytes: main {lay.entries.main}, indexer key {lay.entries.index}, window row {lay.entries.window}")
    print(f"\n{'kind':<20}{'bytes/token':>14}{'at context':>18}")
    for kind, b in lay.per_token.items():
        print(f"{kind:<20}{b:>14,.4g}{_human(b * n):>18}")
    print(f"{'growing total':<20}{lay.bytes_per_token:>14,.6g}{_human(lay.bytes_per_token * n):>18}")
    print(f"\n{'fixed per request':<20}{'bytes':>14}")
    for kind, b in lay.fixed.items():
        print(f"{kind:<20}{b:>14,}{_human(b):>18}")
    print(f"\ntotal at {n:,} tokens: {lay.total(n):,.0f} B ({_human(lay.total(n))})")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from hybridkv.demo import run_demo

    return run_demo(a.model, a.max_tokens, a.chunk, a.prompt_tokens, device=a.device, dtype=a.dtype)


def cmd_generate(a: argparse.Namespace) -> int:
    import time

    from hybridkv.engine import LLM, EngineConfig, SamplingParams
    from hybridkv.errors import RequestError

    if torchrun_worker(a):
        return 0
    llm = LLM(a.model_dir, device=a.device, dtype=a.dtype, engine_config=EngineConfig.from_args(a))
    if a.prompt_ids is not None:
        prompt = [int(x) for x in a.prompt_ids.replace(",", " ").split()]
    elif a.prompt_file is not None:
        prompt = open(a.prompt_file, encoding="utf-8").read()
    else:
        prompt = a.prompt
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop or [])
    t0 = time.perf_counter()
    try:
        seq = llm.engine.add_request(prompt, params)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    while llm.engine.has_unfinished():
        for ev in llm.engine.step():
            out = ev.text if llm.tokenizer is not None else f"{ev.token_id} "
            print(out, end="", flush=True)
    elapsed = time.perf_counter() - t0
    n_out = len(seq.output_ids)
    decode_s = elapsed - (seq.ttft or 0)
    store = llm.engine.store
    blocks = -(-len(seq.token_ids) // store.block_tokens)
    held = blocks * sum(store.block_bytes().values())
    print()
    print(f"[prompt {len(seq.prompt_ids)} tokens, cached {seq.num_cached_tokens}, TTFT {1000 * (seq.ttft or 0):.1f} ms, "
          f"{n_out} tokens at {(n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0:.1f} tok/s, "
          f"finish {seq.finish_reason}; KV {store.bytes_per_token():.2f} B/token ({store.fmt}): {_human(held)} in "
          f"{blocks} blocks + {_human(sum(r[0].nbytes for r in store.ring))} window]", file=sys.stderr)
    if seq.spec_steps:
        print(f"[speculative mtp: {seq.spec_steps} verify steps, {seq.spec_accepted_tokens} of "
              f"{seq.spec_draft_tokens} draft tokens accepted, acceptance length "
              f"{1 + seq.spec_accepted_tokens / seq.spec_steps:.2f}]", file=sys.stderr)
    llm.close()
    tiers = llm.engine.cache_stats()
    print("[prefix cache: " + "; ".join(
        f"{name} {t.get('hits', 0)} hits, stored {_human(t.get('stored_bytes', 0))}, loaded "
        f"{_human(t.get('loaded_bytes', 0))}, evicted {_human(t.get('evicted_bytes', 0))}"
        for name, t in tiers.items() if name != "writer") + "]", file=sys.stderr)
    return 0


def _serve_limit_arguments(s: argparse.ArgumentParser) -> None:
    """serve's connection limits and host-memory budget."""
    from hybridkv.server import hostmem, limits

    limits.add_arguments(s)
    hostmem.add_arguments(s)


def server_from_args(a: argparse.Namespace):
    """The server `hybridkv serve` runs (model, engine, app), not yet listening."""
    import os

    from hybridkv.engine import EngineConfig
    from hybridkv.server.serve import build_server

    api_key = a.api_key or os.environ.get("HYBRIDKV_API_KEY") or None
    if a.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"warning: serving on {a.host} without an API key (--api-key or HYBRIDKV_API_KEY)", file=sys.stderr)
    return build_server(a.model_dir, engine_config=EngineConfig.from_args(a), device=a.device, dtype=a.dtype,
                        tokenizer_path=a.tokenizer, served_model_name=a.served_model_name, api_key=api_key,
                        max_queued=a.max_queued, max_body_bytes=a.max_body_bytes, public_metrics=a.public_metrics,
                        max_prompt_tokens=a.max_prompt_tokens, max_tokens_limit=a.max_tokens_limit,
                        default_thinking=a.thinking, host_memory_budget=a.host_memory_budget)


def torchrun_worker(a: argparse.Namespace) -> bool:
    """Under torchrun, ranks other than 0 build their shard and serve rank 0's commands until it
    closes; returns True there (the command is done), False on rank 0 and outside torchrun."""
    from hybridkv.distributed.group import torchrun_env
    if torchrun_env() is None:
        return False
    from hybridkv.engine.sharded import LaunchSpec, run_torchrun_worker
    from hybridkv.engine import EngineConfig
    return run_torchrun_worker(LaunchSpec.of(a.model_dir, a.device, a.dtype, EngineConfig.from_args(a),
                                             getattr(a, "tokenizer", None)))


def cmd_serve(a: argparse.Namespace) -> int:
    from hybridkv.server import limits
    from hybridkv.server.serve import run

    if torchrun_worker(a):
        return 0
    listen = limits.from_args(a)
    server = server_from_args(a)
    dtype = str(server.engine.model.dtype).removeprefix("torch.")
    print(f"serving {server.config.model_name} ({dtype} on {a.device}) on http://{a.host}:{a.port} "
          f"(web page at /, metrics at /metrics)", file=sys.stderr)
    run(server, a.host, a.port, a.log_level, listen)
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from hybridkv.eval.cli import main as eval_main

    return eval_main(a.args)


def train_recipe(a: argparse.Namespace):
    """The recipe `hybridkv train` runs: the named one with the command line's overrides."""
    import math
    from dataclasses import replace

    from hybridkv.errors import TrainingError
    from hybridkv.train.recipes import get_recipe

    finite = math.isfinite
    for flag, value, ok, rule in (("--steps", a.steps, lambda v: v >= 1, "must be at least 1"),
                                  ("--lr", a.lr, lambda v: finite(v) and v > 0, "must be a positive learning rate"),
                                  ("--answer-weight", a.answer_weight, lambda v: finite(v) and v >= 0, "must be >= 0"),
                                  ("--answer-end-weight", a.answer_end_weight, lambda v: finite(v) and v >= 0,
                                   "must be >= 0")):
        if value is not None and not ok(value):
            raise TrainingError(f"{flag} {value}: {rule}")
    recipe = get_recipe(a.recipe)
    if a.steps is not None:
        recipe = replace(recipe, steps=a.steps)
    if a.lr is not None:
        recipe = replace(recipe, lr=a.lr)
    if a.seed is not None:
        recipe = replace(recipe, seed=a.seed)
    if a.answer_weight is not None:
        recipe = replace(recipe, loss=replace(recipe.loss, answer=a.answer_weight))
    if a.answer_end_weight is not None:
        recipe = replace(recipe, loss=replace(recipe.loss, answer_end=a.answer_end_weight))
    return recipe


def cmd_train(a: argparse.Namespace) -> int:
    from pathlib import Path

    from hybridkv.errors import TrainingError

    recipe = train_recipe(a)
    if a.export_only and not a.export:
        raise TrainingError("--export-only writes the run in --out to --export DIR: pass --export")
    run_dir = Path(a.out or f"runs/{recipe.name}")
    if not a.export_only:
        from hybridkv.train.loop import train
        from hybridkv.train.rundir import portable_parts

        progress = train(recipe, run_dir, a.device, a.max_minutes, a.resume, init_from=a.init_from,
                         portable_dir=a.portable_state)
        print(f"step {progress['step']}/{recipe.steps}, {progress['tokens'] / 1e6:.1f}M tokens, "
              f"{progress['seconds'] / 60:.1f} min over {progress['commands']} command(s)", file=sys.stderr)
        if a.portable_state:
            n = len(portable_parts(Path(a.portable_state)))
            print(f"portable state: {n} file(s) in {a.portable_state}", file=sys.stderr)
    if a.export:
        from hybridkv.train.export import export_model

        out = export_model(recipe, run_dir, a.export, base=a.init_from)
        print(f"exported {out}", file=sys.stderr)
    return 0


def cmd_train_memory_indexer(a: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from hybridkv.errors import TrainingError
    from hybridkv.train.memory_training import MemoryTrainConfig, train_memory_indexer

    model_dir = Path(a.model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise TrainingError(f"{model_dir}: no tokenizer.json (a model directory that --export wrote)")
    labels = a.labels or f"runs/memory-labels/{model_dir.resolve().name}"
    if a.validate_only:
        from hybridkv.train.memory_training import revalidate_memory_indexer
        report = revalidate_memory_indexer(model_dir, a.out or model_dir, labels, a.device,
                                           echo=lambda *x: print(*x, file=sys.stderr))
        print(f"rewrote the measures of {Path(a.out or model_dir)}'s memory indexer report "
              f"(under {report['policy']})", file=sys.stderr)
        return 0
    overrides = {k: getattr(a, k) for k in ("docs", "val_docs", "vote", "stride", "steps", "batch_positions",
                                            "lr", "budget", "seed", "top_p", "window") if getattr(a, k) is not None}
    if a.length is not None:
        try:
            overrides["lengths"] = tuple(int(x) for x in a.length.split(","))
        except ValueError:
            raise TrainingError(f"--length {a.length!r}: prompt tokens, or several separated by commas") from None
    cfg = replace(MemoryTrainConfig(), **overrides)
    for k in ("docs", "val_docs", "vote", "stride", "steps", "batch_positions", "window"):
        if getattr(cfg, k) < 1:
            raise TrainingError(f"--{k.replace('_', '-')} {getattr(cfg, k)}: must be at least 1")
    if not 0 < cfg.top_p <= 1:
        raise TrainingError(f"--top-p {cfg.top_p}: must be in (0, 1]")
    if min(cfg.lengths) < 1:
        raise TrainingError(f"--length {a.length}: every length must be at least 1")
    layers = [int(x) for x in a.layers.split(",")] if a.layers else None
    report = train_memory_indexer(model_dir, a.out or model_dir, cfg, labels, a.device, layers,
                                  echo=lambda *x: print(*x, file=sys.stderr))
    print(f"wrote {report['path']}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hybridkv.engine.config import EngineConfig, add_model_arguments

    p = argparse.ArgumentParser(prog="hybridkv", description="DeepSeek-V4-family models and their KV memory system")
    sub = p.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kv-calc", help="KV bytes per token and per request, by layer kind")
    src = k.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="v4-flash, v4-pro, v4.1-flash, v3.2, v4-tiny, ...")
    src.add_argument("--config", help="a config.json or model directory")
    k.add_argument("--context", type=_parse_count, default=1 << 20, help="tokens (e.g. 128k, 1M; default 1M)")
    k.add_argument("--format", choices=["bf16", "fp8", "v41"], default=None,
                   help="entry format (default: fp8 for V4, v41 for V4.1)")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_kv_calc)

    g = sub.add_parser("generate", help="stream a completion from a model directory, then one line of stats")
    g.add_argument("model_dir")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    src.add_argument("--prompt-ids", help="token ids, comma or space separated (models without a tokenizer)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    EngineConfig.add_arguments(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible server with the V4 chat format, metrics and a web page")
    s.add_argument("model_dir")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set HYBRIDKV_API_KEY)")
    s.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics and /stats without the API key (for a scraper); /health is always open")
    s.add_argument("--max-queued", type=int, default=64, help="requests waiting beyond those before 429")
    s.add_argument("--max-body-bytes", type=int, default=16 << 20)
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="default: what the engine can hold")
    s.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted (default: context)")
    s.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: MODEL_DIR/tokenizer.json)")
    s.add_argument("--served-model-name", default=None, help="model id in the API (default: the directory name)")
    s.add_argument("--thinking", action="store_true", help="thinking mode unless a request says otherwise")
    s.add_argument("--log-level", default="info")
    EngineConfig.add_arguments(s)
    _serve_limit_arguments(s)
    s.set_defaults(func=cmd_serve)

    e = sub.add_parser("eval", help="long-context evaluation (RULER, MRCR, passkey) under memory policies; "
                                    "'hybridkv eval compare A.json B.json'", add_help=False)
    e.add_argument("args", nargs=argparse.REMAINDER)
    e.set_defaults(func=cmd_eval)

    t = sub.add_parser("train", help="train a small V4-architecture model from a recipe (smoke, tiny-v4)")
    t.add_argument("--recipe", required=True, help="smoke | tiny-v4 | tiny-v4-needles | ...")
    t.add_argument("--out", default=None, help="run directory (default: runs/RECIPE)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--max-minutes", type=float, default=None, help="checkpoint and stop after this long")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    t.add_argument("--init-from", default=None,
                   help="start from this exported model (recipes that continue another, e.g. tiny-v4-needles); "
                        "a --resume continues the run's own state instead; a recipe that trains one part "
                        "(tiny-v4-mtp-chain) also needs it to --export, which keeps the other tensors as it "
                        "holds them")
    t.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    t.add_argument("--lr", type=float, default=None, help="override the recipe's peak learning rate")
    t.add_argument("--seed", type=int, default=None,
                   help="override the recipe's data seed (a second pass of a continuation sees new examples)")
    t.add_argument("--answer-weight", type=float, default=None,
                   help="override the recipe's extra weight on the answer tokens' loss")
    t.add_argument("--answer-end-weight", type=float, default=None,
                   help="override the recipe's extra weight on the answers' closing tokens (period, EOS)")
    t.add_argument("--portable-state", default=None,
                   help="also write the weights and progress in files of <= 15 MiB to this directory, at "
                        "every checkpoint (every 5 minutes and the last); no optimizer moments: a run resumed "
                        "from them restarts those")
    t.add_argument("--export", default=None, help="write the trained model in the release format here")
    t.add_argument("--export-only", action="store_true", help="export the run in --out without training")
    t.set_defaults(func=cmd_train)

    m = sub.add_parser("train-memory-indexer",
                       help="train FlashMemory's memory indexer for a V4 model on labels from the model itself")
    m.add_argument("model_dir")
    m.add_argument("--out", default=None, help="weights file or directory (default: MODEL_DIR/memory_indexer.safetensors)")
    m.add_argument("--labels", default=None, help="label files, reused when present (default: runs/memory-labels/NAME)")
    m.add_argument("--device", default="cpu")
    m.add_argument("--layers", default=None, help="target CSA layers, comma separated (default: every CSA layer)")
    m.add_argument("--length", default=None,
                   help="document prompt tokens; several separated by commas take turns (e.g. 16384,32768)")
    m.add_argument("--top-p", type=float, default=None,
                   help="labels: each CSA layer picks the top-p of its top-k softmax (default 0.6)")
    m.add_argument("--window", type=int, default=None,
                   help="positives: chunks picked at any of the next N positions (default 64, the recall interval)")
    for name, typ in (("docs", int), ("val-docs", int), ("vote", int), ("stride", int), ("steps", int),
                      ("batch-positions", int), ("lr", float), ("budget", float), ("seed", int)):
        m.add_argument(f"--{name}", type=typ, default=None)
    m.add_argument("--validate-only", action="store_true",
                   help="measure the weights at --out again on the validation documents their report names, "
                        "under the serving policy as it is now, and rewrite the report's measures (no training)")
    m.set_defaults(func=cmd_train_memory_indexer)

    d = sub.add_parser("demo", help="the main job on the shipped model: chunked prefill, greedy decode, KV accounting")
    d.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    d.add_argument("--prompt-tokens", type=int, default=2048, help="length of the passkey prompt")
    add_model_arguments(d)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:
        # everything after "eval" is the evaluation's own command line, options first included
        # ("hybridkv eval -h", "hybridkv eval --tasks passkey MODEL"): argparse's REMAINDER would
        # refuse a leading option
        args = argparse.Namespace(func=cmd_eval, args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HybridKVError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
