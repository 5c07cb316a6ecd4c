"""What every route shares: the server's configuration and limits, the engine driver, the
tokenizer, the metrics and the in-flight count, held in one `AppState` on `app.state` and handed
to routes by the `app_state` dependency."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.server.driver import EngineDriver
from hybridkv.server.metrics import Metrics


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 << 20
    public_metrics: bool = False             # /metrics and /stats without the API key (for a scraper)
    max_prompt_tokens: int | None = None     # default: what the engine can hold
    max_tokens_limit: int | None = None      # default: the engine's max_model_len
    max_queued: int = 64                     # requests beyond the running batch before 429
    default_thinking: bool = False
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    extra_stop_token_ids: list[int] = field(default_factory=list)


class AppState:
    """The server's shared state. `inflight` is changed only by `streaming.Generation`."""

    def __init__(self, driver: EngineDriver, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics):
        self.driver, self.tokenizer, self.config, self.metrics = driver, tokenizer, config, metrics
        eng = driver.engine
        self.max_model_len = eng.max_model_len
        pool_tokens = eng.store.pool.num_blocks * eng.store.block_tokens
        self.max_prompt = config.max_prompt_tokens or min(eng.max_model_len - 1, pool_tokens - 1)
        # No token spans more bytes than the vocabulary's longest (+1 for a decoder's dropped
        # leading space), so text longer than this has more tokens than a prompt may: refused
        # before the tokenizer spends seconds on it.
        self.max_prompt_bytes = self.max_prompt * (tokenizer.max_token_bytes + 1)
        self.max_tokens_limit = config.max_tokens_limit or eng.max_model_len
        self.max_inflight = eng.ec.max_num_seqs + config.max_queued
        self.inflight = 0
        self.created = int(time.time())


def app_state(request: Request) -> AppState:
    """FastAPI dependency: the AppState of the app serving this request."""
    return request.app.state.hybridkv
