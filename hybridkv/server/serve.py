"""Assemble a server from a model directory (model, tokenizer, engine, driver, metrics, app) and
run it with uvicorn."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from hybridkv.chat.format import EOS
from hybridkv.engine.core import EngineConfig, EngineCore
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.errors import CheckpointError
from hybridkv.server.app import ServerConfig, create_app
from hybridkv.server.driver import EngineDriver
from hybridkv.server.metrics import Metrics


@dataclass
class Server:
    app: object
    driver: EngineDriver
    engine: EngineCore
    tokenizer: Tokenizer
    config: ServerConfig


def prefix_cache_options(text: str) -> dict:
    """--prefix-cache: off | full | checkpoint(N) | zero (the window policy of prefix hits)."""
    t = text.strip().lower()
    if t == "off":
        return {"enable_prefix_caching": False}
    return {"enable_prefix_caching": True, "window_policy": t}


def _generation_defaults(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    gen = json.loads(path.read_text())
    out = {}
    if isinstance(gen.get("temperature"), (int, float)):
        out["default_temperature"] = float(gen["temperature"]) if gen.get("do_sample", True) else 0.0
    if isinstance(gen.get("top_p"), (int, float)):
        out["default_top_p"] = float(gen["top_p"])
    return out


def build_server(model_dir: str | Path, *, tokenizer_path: str | Path | None = None, device: str = "cpu",
                 served_model_name: str | None = None, api_key: str | None = None, prefix_cache: str = "full",
                 max_concurrency: int = 16, num_blocks: int = 512, kv_format: str = "native",
                 max_batched_tokens: int = 2048, max_model_len: int | None = None, **server_options) -> Server:
    from hybridkv.weights import checkpoint_identity, load_model

    model_dir = Path(model_dir)
    tok_file = Path(tokenizer_path) if tokenizer_path else model_dir / "tokenizer.json"
    if not tok_file.exists():
        raise CheckpointError(f"{tok_file} not found: the server needs the model's tokenizer.json "
                              f"(or pass --tokenizer PATH)")
    tokenizer = Tokenizer(tok_file)
    model, config = load_model(model_dir, device=device)
    ec = EngineConfig(kv_format=kv_format, num_blocks=num_blocks, max_num_seqs=max_concurrency,
                      max_num_batched_tokens=max_batched_tokens, max_model_len=max_model_len,
                      **prefix_cache_options(prefix_cache))
    engine = EngineCore(model, tokenizer, checkpoint_identity(model_dir), ec)
    name = served_model_name or model_dir.resolve().name
    eos_id = tokenizer.token_to_id(EOS)
    extra_stops = [eos_id] if eos_id is not None and eos_id != config.eos_token_id else []
    options = {**_generation_defaults(model_dir), **server_options}
    sc = ServerConfig(model_name=name, api_key=api_key, extra_stop_token_ids=extra_stops, **options)
    metrics = Metrics(name)
    driver = EngineDriver(engine, metrics, eos_text=EOS if eos_id is not None else None)
    return Server(create_app(driver, tokenizer, sc, metrics), driver, engine, tokenizer, sc)


def run(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    import uvicorn

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(server.app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
