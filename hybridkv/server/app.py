"""The FastAPI application: the shared state, the routes (`server/routes/`), the web page's static
files, and the error objects.

Every error is an OpenAI error object `{"error": {"message", "type", "param", "code"}}`. What a
request passes before the engine is in `admission`; its life in the engine (the in-flight limit
with 429 and Retry-After, aborts when the client goes away, SSE) in `streaming`.
"""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.errors import RequestError
from hybridkv.server.driver import EngineDriver
from hybridkv.server.metrics import Metrics
from hybridkv.server.protocol import APIError, bad
from hybridkv.server.routes import ROUTERS
from hybridkv.server.routes.admin import STATIC
from hybridkv.server.state import AppState, ServerConfig

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("hybridkv.server")


class _ErrorJSON(JSONResponse):
    """An error body in ASCII JSON: a message that quotes the request (a model name, a role) may hold
    a lone surrogate, which has no UTF-8 form; escaped, it reaches the client as the request sent it."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error_response(e: APIError) -> JSONResponse:
    return _ErrorJSON(e.body(), status_code=e.status, headers=e.headers)


def create_app(driver: EngineDriver, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics) -> FastAPI:
    st = AppState(driver, tokenizer, config, metrics)
    metrics.snapshot_source = lambda: driver.snapshot

    @asynccontextmanager
    async def lifespan(app):
        if not driver.alive:
            driver.start()
        yield
        driver.stop()

    app = FastAPI(title="hybridkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hybridkv = st
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


async def _api_error(request: Request, e: APIError):
    if e.status in (413, 429):
        request.app.state.hybridkv.metrics.rejected(e.status)
    return _error_response(e)


async def _request_error(request: Request, e: RequestError):     # e.g. text the tokenizer cannot take
    return _error_response(bad(str(e)))


async def _http_error(request: Request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))


async def _internal(request: Request, e: Exception):
    log.exception("unhandled error")
    return _error_response(APIError(500, f"internal server error ({type(e).__name__})", type="internal_error"))
