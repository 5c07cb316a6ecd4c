"""Assemble a server from a model directory (model, tokenizer, engine, driver, metrics, app) and
run it with uvicorn."""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

from hybridkv.chat.format import EOS
from hybridkv.engine.config import EngineConfig, resolve_dtype
from hybridkv.engine.core import EngineCore
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.errors import CheckpointError
from hybridkv.server.app import ServerConfig, create_app
from hybridkv.server.driver import EngineDriver
from hybridkv.server.hostmem import HostMemory, tune_allocator
from hybridkv.server.limits import ListenLimits, install_rate_limit, uvicorn_config
from hybridkv.server.metrics import Metrics


@dataclass
class Server:
    app: object
    driver: EngineDriver
    engine: EngineCore
    tokenizer: Tokenizer
    config: ServerConfig


# build_server's keyword arguments before they took EngineConfig's field names
_RENAMED = {"max_concurrency": "max_num_seqs", "max_batched_tokens": "max_num_batched_tokens"}


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


def build_server(model_dir: str | Path, *, engine_config: EngineConfig | None = None, device: str = "cpu",
                 dtype: str | None = "auto", tokenizer_path: str | Path | None = None,
                 served_model_name: str | None = None, api_key: str | None = None,
                 host_memory_budget: int | str | None = None, **options) -> Server:
    """The server of a model directory. `options` are EngineConfig fields (over `engine_config`) and
    ServerConfig fields (limits, defaults); `dtype` "auto" is bfloat16 on CUDA, float32 elsewhere."""
    from hybridkv.weights import checkpoint_identity, load_model

    tune_allocator()     # before the engine's threads start: freed host memory goes back to the system
    for old, new in _RENAMED.items():
        if old in options:
            warnings.warn(f"build_server({old}=...) is deprecated; use {new}=", DeprecationWarning, stacklevel=2)
            options[new] = options.pop(old)
    engine_fields = {f.name for f in fields(EngineConfig)}
    engine_options = {k: v for k, v in options.items() if k in engine_fields}
    server_options = {k: v for k, v in options.items() if k not in engine_fields}
    ec = replace(engine_config or EngineConfig(), **engine_options)
    model_dir = Path(model_dir)
    tok_file = Path(tokenizer_path) if tokenizer_path else model_dir / "tokenizer.json"
    if not tok_file.exists():
        raise CheckpointError(f"{tok_file} not found: the server needs the model's tokenizer.json "
                              f"(or pass --tokenizer PATH)")
    tokenizer = Tokenizer(tok_file)
    if ec.tensor_parallel_size > 1:   # this process is rank 0 of a sharded engine
        from hybridkv.engine.sharded import build_engine
        engine, model = build_engine(model_dir, device, dtype, ec, tok_file)
        config = model.config
    else:
        model, config = load_model(model_dir, device=device, dtype=resolve_dtype(dtype, device))
        engine = EngineCore(model, tokenizer, checkpoint_identity(model_dir), ec)
    host = HostMemory(engine, host_memory_budget)
    host.check()
    name = served_model_name or model_dir.resolve().name
    eos_id = tokenizer.token_to_id(EOS)
    extra_stops = [eos_id] if eos_id is not None and eos_id != config.eos_token_id else []
    options = {**_generation_defaults(model_dir), **server_options}
    sc = ServerConfig(model_name=name, api_key=api_key, extra_stop_token_ids=extra_stops, **options)
    metrics = Metrics(name)
    driver = EngineDriver(engine, metrics, host=host)
    return Server(create_app(driver, tokenizer, sc, metrics), driver, engine, tokenizer, sc)


def run(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
        limits: ListenLimits | None = None) -> None:
    import uvicorn

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_rate_limit(loggers=("",))      # asyncio's accept errors, the engine's warnings: root's handlers
    uv = uvicorn.Server(uvicorn_config(server.app, limits, host=host, port=port, log_level=log_level))
    server.driver.on_fatal = lambda message: setattr(uv, "should_exit", True)
    uv.run()
    if server.driver.fatal is not None:
        raise SystemExit(f"hybridkv serve stopped: {server.driver.fatal}")
