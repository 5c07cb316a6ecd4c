"""One request in the engine, from admission to its last output, for every route, streamed or
not: the only code that changes the in-flight count (429 past the limit) and aborts requests.

A request leaves the in-flight count exactly once, however it ends: finished, failed, or its
client gone (a streaming client that disconnects closes the stream; a non-streaming one is
watched for disconnects). A request that has not finished by then is aborted: its blocks are
freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from hybridkv.engine.sampling import SamplingParams
from hybridkv.errors import RequestError
from hybridkv.server.driver import Output, RequestHandle
from hybridkv.server.protocol import APIError, bad
from hybridkv.server.state import AppState

DISCONNECT_POLL_S = 0.25


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Generation:
    """A request admitted to the engine. Make one with `await Generation.start(...)`, then either
    `await collect(...)` (a JSON reply) or return `stream(...)` (server-sent events)."""

    def __init__(self, st: AppState, handle: RequestHandle):
        self.st, self.handle = st, handle
        self._open = True

    @classmethod
    async def start(cls, st: AppState, ids: list[int], params: SamplingParams, want_tokens: bool,
                    param: str) -> "Generation":
        """Admit a request (429 when the server is full; 400 naming `param` when the engine refuses it)."""
        if st.inflight >= st.max_inflight:
            raise APIError(429, f"the server is full ({st.inflight} requests in flight); retry shortly",
                           type="rate_limit_error", code="server_busy", headers={"Retry-After": "1"})
        st.inflight += 1
        try:
            handle = await st.driver.submit(ids, params, want_tokens)
        except RequestError as e:
            st.inflight -= 1
            raise bad(str(e), param) from None
        except BaseException:
            st.inflight -= 1
            raise
        return cls(st, handle)

    def close(self) -> None:
        """Abort the request unless it finished, and leave the in-flight count (idempotent)."""
        if self._open:
            self._open = False
            if not self.handle.finished:
                self.st.driver.abort(self.handle.request_id)
            self.st.inflight -= 1

    async def collect(self, request: Request, on_output: Callable[[Output], object]) -> Output | None:
        """Feed every output to `on_output`, aborting the request if the client goes away. Returns
        the last output; None when the request was aborted (the client is gone); raises a 500
        APIError when the engine failed it."""
        async def watch():
            while True:
                await asyncio.sleep(DISCONNECT_POLL_S)
                if await request.is_disconnected():
                    self.st.driver.abort(self.handle.request_id)
                    return
        watcher = asyncio.create_task(watch())
        last = None
        try:
            async for out in self.handle:
                on_output(out)
                last = out
        finally:
            watcher.cancel()
            self.close()
        if last is None or last.finish_reason == "abort":
            return None
        if last.error:
            raise APIError(500, last.error, type="internal_error")
        return last

    def stream(self, render: Callable[[Output], Iterable[dict]], first: Iterable[dict] = ()) -> StreamingResponse:
        """Server-sent events: the objects of `first`, then `render(out)`'s for each output, then
        `[DONE]`. An engine failure sends an OpenAI error object in place of the output."""
        async def body():
            try:
                for obj in first:
                    yield sse(obj)
                async for out in self.handle:
                    if out.error:
                        yield sse(APIError(500, out.error, type="internal_error").body())
                        break
                    for obj in render(out):
                        yield sse(obj)
                yield "data: [DONE]\n\n"
            finally:
                self.close()
        return _EventStream(self, body())


class _EventStream(StreamingResponse):
    """A streaming response that releases its request when the response ends, also when the
    client goes away before the body was ever started."""

    def __init__(self, generation: Generation, body):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()
