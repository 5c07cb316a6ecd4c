"""What a request passes before it reaches the engine: the bearer key, the body size limit, JSON
parsing into a schema, the model name, and the prompt and sampling limits. Each refusal is an
`APIError` naming the problem.

JSON parsing and tokenisation run in the thread pool, never on the event loop, so that a large
request cannot stall every other client (`/health` included); text too long to fit in a prompt
is refused by its byte length before the tokenizer sees it."""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from hybridkv.engine.sampling import SamplingParams
from hybridkv.errors import RequestError
from hybridkv.server.protocol import APIError, bad, parse_body
from hybridkv.server.state import AppState, app_state


async def authorize(request: Request, st: AppState = Depends(app_state)) -> None:
    """FastAPI dependency: refuse the request unless it carries the server's key (if it has one)."""
    _check_key(request, st.config.api_key)


async def authorize_metrics(request: Request, st: AppState = Depends(app_state)) -> None:
    """FastAPI dependency of /metrics and /stats: the server's key unless they are public."""
    if not st.config.public_metrics:
        _check_key(request, st.config.api_key)


def _check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                       type="authentication_error", code="invalid_api_key")


async def read_body(request: Request, st: AppState) -> bytes:
    limit = st.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_request(request: Request, st: AppState, schema):
    """The body, within the size limit, validated into `schema`."""
    return await run_in_threadpool(parse_body, await read_body(request, st), schema)


async def prompt_ids(st: AppState, text: str, param: str) -> list[int]:
    """The token ids of a text prompt (special-token strings read as special tokens), checked."""
    check_prompt_chars(st, len(text), param)
    ids = await run_in_threadpool(st.tokenizer.encode, text)
    check_prompt(st, ids, param)
    return ids


async def chat_prompt_ids(st: AppState, segments: list[tuple[str, bool]], param: str) -> list[int]:
    """The token ids of a chat prompt's segments (special tokens from the template only), checked."""
    check_prompt_chars(st, sum(len(text) for text, _ in segments), param)
    ids = await run_in_threadpool(st.tokenizer.encode_segments, segments)
    check_prompt(st, ids, param)
    return ids


def check_prompt_chars(st: AppState, n_chars: int, param: str) -> None:
    """Refuse a text too long to be a prompt this server takes, before it is tokenized (which holds
    the interpreter for seconds on megabytes). A character is at least one byte, so counting
    characters never refuses a prompt that fits."""
    if n_chars > st.max_prompt_bytes:
        raise bad(f"the prompt has {n_chars} characters, more than the {st.max_prompt} tokens this server takes "
                  f"can hold", param)


def check_model(st: AppState, name: str | None) -> None:
    served = st.config.model_name
    if name is not None and name != served:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{served}'",
                       param="model", type="not_found_error", code="model_not_found")


def check_prompt(st: AppState, ids: list[int], param: str) -> None:
    if not ids:
        raise bad("the prompt is empty", param)
    if len(ids) > st.max_prompt:
        raise bad(f"the prompt has {len(ids)} tokens; this server takes at most {st.max_prompt}", param)


def sampling_params(st: AppState, req, max_tokens: int | None, n_prompt: int, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for a chat or completion request, within the server's limits."""
    if max_tokens is not None and max_tokens > st.max_tokens_limit:
        raise bad(f"max_tokens is {max_tokens}; this server allows at most {st.max_tokens_limit}", "max_tokens")
    room = st.max_model_len - n_prompt
    if max_tokens is None:
        max_tokens = min(room, st.max_tokens_limit)
    elif n_prompt + max_tokens > st.max_model_len:
        raise bad(f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context length "
                  f"{st.max_model_len}; lower max_tokens to {room} or less", "max_tokens")
    config = st.config
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=config.default_temperature if req.temperature is None else req.temperature,
        top_p=config.default_top_p if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0), seed=req.seed, stop=stops,
        stop_token_ids=list(config.extra_stop_token_ids), ignore_eos=req.ignore_eos,
        logprobs=logprobs or None, cache_salt=req.cache_salt)
    try:
        params.validate()
    except RequestError as e:
        raise bad(str(e)) from None
    return params
