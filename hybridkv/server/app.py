"""The FastAPI application: OpenAI routes, the bearer key, request limits, error objects, SSE.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize (the
prompt a chat request becomes, and its token ids), GET /health, GET /metrics (Prometheus),
GET /stats (the memory panel's JSON), GET / (the web page).

Every error is an OpenAI error object `{"error": {"message", "type", "param", "code"}}`. A
request is refused with 429 and Retry-After when `max_concurrency + max_queued` requests are in
flight; a streaming client that goes away has its request aborted (blocks freed at the next step
boundary); a non-streaming one is watched for disconnects the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv.chat.replies import REASONING, ReplyParser
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.errors import RequestError
from hybridkv.server.chat import plan_chat, token_logprobs, tool_call_objects, usage
from hybridkv.server.driver import EngineDriver, RequestHandle
from hybridkv.server.metrics import Metrics
from hybridkv.server.protocol import APIError, ChatRequest, CompletionRequest, bad, parse_body

log = logging.getLogger("hybridkv.server")
STATIC = Path(__file__).parent / "static"


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 << 20
    max_prompt_tokens: int | None = None     # default: what the engine can hold
    max_tokens_limit: int | None = None      # default: the engine's max_model_len
    max_queued: int = 64                     # requests beyond the running batch before 429
    default_thinking: bool = False
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    extra_stop_token_ids: list[int] = field(default_factory=list)


class _State:
    def __init__(self, driver: EngineDriver, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics):
        self.driver, self.tok, self.config, self.metrics = driver, tokenizer, config, metrics
        eng = driver.engine
        self.max_model_len = eng.max_model_len
        pool_tokens = eng.store.pool.num_blocks * eng.store.block_tokens
        self.max_prompt = config.max_prompt_tokens or min(eng.max_model_len - 1, pool_tokens - 1)
        self.max_tokens_limit = config.max_tokens_limit or eng.max_model_len
        self.max_inflight = eng.ec.max_num_seqs + config.max_queued
        self.inflight = 0
        self.created = int(time.time())


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(driver: EngineDriver, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics) -> FastAPI:
    st = _State(driver, tokenizer, config, metrics)
    metrics.snapshot_source = lambda: driver.snapshot

    @asynccontextmanager
    async def lifespan(app):
        if not driver.alive:
            driver.start()
        yield
        driver.stop()

    app = FastAPI(title="hybridkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hybridkv = st

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status in (413, 429):
            metrics.rejected(e.status)
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal server error ({type(e).__name__})", type="internal_error"))

    # ----- helpers -----
    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        limit = config.max_body_bytes
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

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{config.model_name}'",
                           param="model", type="not_found_error", code="model_not_found")

    def sampling(req, max_tokens: int | None, n_prompt: int, logprobs: int | None) -> SamplingParams:
        if max_tokens is not None and max_tokens > st.max_tokens_limit:
            raise bad(f"max_tokens is {max_tokens}; this server allows at most {st.max_tokens_limit}", "max_tokens")
        room = st.max_model_len - n_prompt
        if max_tokens is None:
            max_tokens = min(room, st.max_tokens_limit)
        elif n_prompt + max_tokens > st.max_model_len:
            raise bad(f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context length "
                      f"{st.max_model_len}; lower max_tokens to {room} or less", "max_tokens")
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

    def check_prompt(ids: list[int], param: str) -> None:
        if not ids:
            raise bad("the prompt is empty", param)
        if len(ids) > st.max_prompt:
            raise bad(f"the prompt has {len(ids)} tokens; this server takes at most {st.max_prompt}", param)

    async def submit(ids, params, want_tokens: bool, param: str) -> RequestHandle:
        if st.inflight >= st.max_inflight:
            raise APIError(429, f"the server is full ({st.inflight} requests in flight); retry shortly",
                           type="rate_limit_error", code="server_busy", headers={"Retry-After": "1"})
        st.inflight += 1
        try:
            return await driver.submit(ids, params, want_tokens)
        except RequestError as e:
            st.inflight -= 1
            raise bad(str(e), param) from None
        except BaseException:
            st.inflight -= 1
            raise

    async def collect(request: Request, handle: RequestHandle, on_output) -> None:
        """Consume a request's outputs, aborting it if the client goes away."""
        async def watch():
            while True:
                await asyncio.sleep(0.25)
                if await request.is_disconnected():
                    driver.abort(handle.request_id)
                    return
        watcher = asyncio.create_task(watch())
        try:
            async for out in handle:
                on_output(out)
        finally:
            watcher.cancel()
            if not handle.finished:
                driver.abort(handle.request_id)
            st.inflight -= 1

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # ----- routes -----
    @app.get("/health")
    async def health():
        if not driver.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": st.created,
                                            "owned_by": "hybridkv", "max_model_len": st.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats():
        return {"model": config.model_name, "memory": driver.snapshot, "totals": metrics.totals(),
                "inflight": st.inflight, "max_inflight": st.max_inflight, "engine_alive": driver.alive,
                "failed_steps": driver.steps_failed}

    @app.get("/")
    async def index():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        raw = await read_body(request)
        try:
            is_chat = "messages" in json.loads(raw)
        except (ValueError, TypeError):
            is_chat = False     # parse_body names the problem
        if is_chat:
            req = parse_body(raw, ChatRequest)
            prompt = plan_chat(req, config.default_thinking).prompt
        else:
            req = parse_body(raw, CompletionRequest)
            if not isinstance(req.prompt, str):
                raise bad("prompt must be a string here", "prompt")
            prompt = req.prompt
        ids = tokenizer.encode(prompt)
        return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids, "prompt": prompt}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.time()
        authorize(request)
        req = parse_body(await read_body(request), ChatRequest)
        check_model(req.model)
        plan = plan_chat(req, config.default_thinking)
        ids = tokenizer.encode(plan.prompt)
        check_prompt(ids, "messages")
        if req.top_logprobs and not req.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        params = sampling(req, req.max_completion_tokens or req.max_tokens, len(ids),
                          req.top_logprobs if req.logprobs else None)
        handle = await submit(ids, params, req.logprobs, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(arrival)
        parser = ReplyParser(plan.thinking, plan.parse_tools)
        acc = {"reasoning_tokens": 0, "logprobs": [], "last": None}

        def absorb(out):
            if parser.state == REASONING:
                acc["reasoning_tokens"] += len(out.token_ids)
            pieces = parser.feed(out.text) + (parser.finish() if out.finished else [])
            if req.logprobs:
                acc["logprobs"] += token_logprobs(out.token_texts, out.logprobs, out.top_logprobs)
            acc["last"] = out
            return pieces

        def chunk(delta, finish=None, logprobs=None):
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": config.model_name,
                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if req.stream_options and req.stream_options.include_usage:
                c["usage"] = None
            return c

        def final_usage(out):
            return usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens,
                         acc["reasoning_tokens"] if plan.thinking else 0)

        if req.stream:
            async def events():
                try:
                    yield sse(chunk({"role": "assistant", "content": ""}))
                    async for out in handle:
                        n_lp = len(acc["logprobs"])
                        pieces = absorb(out)
                        lp = {"content": acc["logprobs"][n_lp:]} if req.logprobs else None
                        for kind, text in pieces:
                            yield sse(chunk({"reasoning_content" if kind == REASONING else "content": text},
                                            logprobs=lp))
                            lp = None
                        if lp and lp["content"]:
                            yield sse(chunk({}, logprobs=lp))
                        if out.finished:
                            if out.error:
                                yield sse(APIError(500, out.error, type="internal_error").body())
                                break
                            calls = parser.reply.tool_calls
                            if calls:
                                yield sse(chunk({"tool_calls": tool_call_objects(calls, streaming=True)}))
                            yield sse(chunk({}, finish="tool_calls" if calls else out.finish_reason))
                            if req.stream_options and req.stream_options.include_usage:
                                c = chunk({})
                                c["choices"], c["usage"] = [], final_usage(out)
                                yield sse(c)
                    yield "data: [DONE]\n\n"
                finally:
                    if not handle.finished:
                        driver.abort(handle.request_id)
                    st.inflight -= 1
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        await collect(request, handle, absorb)
        out = acc["last"]
        if out is None or out.finish_reason == "abort":
            return Response(status_code=499)
        if out.error:
            raise APIError(500, out.error, type="internal_error")
        reply = parser.reply
        message = {"role": "assistant", "content": reply.content if (reply.content or not reply.tool_calls) else None,
                   "reasoning_content": reply.reasoning if plan.thinking else None}
        if reply.tool_calls:
            message["tool_calls"] = tool_call_objects(reply.tool_calls, streaming=False)
        return {"id": rid, "object": "chat.completion", "created": created, "model": config.model_name,
                "choices": [{"index": 0, "message": message,
                             "logprobs": {"content": acc["logprobs"]} if req.logprobs else None,
                             "finish_reason": "tool_calls" if reply.tool_calls else out.finish_reason}],
                "usage": final_usage(out)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.time()
        authorize(request)
        req = parse_body(await read_body(request), CompletionRequest)
        check_model(req.model)
        if req.echo or req.suffix or (req.best_of or 1) != 1:
            raise bad("echo, suffix and best_of are not supported", "echo" if req.echo else
                      ("suffix" if req.suffix else "best_of"))
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad("batched prompts are not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, "prompt")
        params = sampling(req, req.max_tokens, len(ids), req.logprobs)
        want = req.logprobs is not None
        handle = await submit(ids, params, want, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(arrival)
        acc = {"text": "", "tokens": [], "lps": [], "top": [], "last": None}

        def absorb(out):
            acc["text"] += out.text
            acc["tokens"] += out.token_texts
            acc["lps"] += out.logprobs
            acc["top"] += [dict(t) for t in out.top_logprobs] if req.logprobs else []
            acc["last"] = out

        def lp_obj(tokens, lps, top, offset):
            offsets, pos = [], offset
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top or None, "text_offset": offsets}

        def choice(text, finish, lp):
            return {"id": rid, "object": "text_completion", "created": created, "model": config.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

        if req.stream:
            async def events():
                try:
                    async for out in handle:
                        start = len(acc["text"])
                        absorb(out)
                        lp = lp_obj(out.token_texts, out.logprobs, [dict(t) for t in out.top_logprobs],
                                    start) if want else None
                        if out.error:
                            yield sse(APIError(500, out.error, type="internal_error").body())
                            break
                        if out.text or lp or out.finished:
                            c = choice(out.text, out.finish_reason if out.finished else None, lp)
                            if req.stream_options and req.stream_options.include_usage:
                                c["usage"] = None
                            yield sse(c)
                        if out.finished and req.stream_options and req.stream_options.include_usage:
                            c = choice("", None, None)
                            c["choices"], c["usage"] = [], usage(out.prompt_tokens, out.completion_tokens,
                                                                 out.cached_tokens)
                            yield sse(c)
                    yield "data: [DONE]\n\n"
                finally:
                    if not handle.finished:
                        driver.abort(handle.request_id)
                    st.inflight -= 1
            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        await collect(request, handle, absorb)
        out = acc["last"]
        if out is None or out.finish_reason == "abort":
            return Response(status_code=499)
        if out.error:
            raise APIError(500, out.error, type="internal_error")
        body = choice(acc["text"], out.finish_reason,
                      lp_obj(acc["tokens"], acc["lps"], acc["top"], 0) if want else None)
        body["usage"] = usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        return body

    return app
