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

    return run_demo(a.model, a.max_tokens, a.chunk)


def build_parser() -> argparse.ArgumentParser:
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

    d = sub.add_parser("demo", help="the main job on the shipped model: chunked prefill, greedy decode, KV accounting")
    d.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--chunk", type=int, default=100, help="prefill chunk size")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HybridKVError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
