"""The engine thread: the only code that touches the EngineCore while the server runs.

Request handlers (asyncio) talk to it through a command queue (add, abort); the thread admits
commands between steps, runs `step()`, and hands each request's outputs to that request's asyncio
queue. Text is the engine's (`Event.text`, engine/detokenize.py), so the server and `LLM.stream`
release the same text. An exception
inside a step fails the requests of that step (their blocks are freed) and the loop goes on.
The thread also publishes a snapshot of the memory system for /metrics and the web page, and
gives freed host memory back when the engine goes idle (hostmem.HostMemory). When the server stops,
the thread fails the requests still live and closes the engine, which writes the tiers' queued
prefix-cache records before the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from hybridkv.distributed.group import DistributedError
from hybridkv.engine.core import EngineCore, Event
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.sequence import Sequence
from hybridkv.errors import RequestError
from hybridkv.server.hostmem import HostMemory
from hybridkv.server.memory import memory_snapshot

log = logging.getLogger("hybridkv.server")


class EngineFailure(RuntimeError):
    """The engine failed while serving a request (the request is aborted; the server goes on)."""


@dataclass
class Output:
    """What one engine step produced for one request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)       # only when logprobs were asked for
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    speculative: tuple[int, int, int] | None = None    # (verify steps, draft tokens, accepted) with speculation


class RequestHandle:
    """The asyncio side of one request: iterate over its outputs."""

    def __init__(self, request_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop):
        self.request_id, self.prompt_tokens, self.loop = request_id, prompt_tokens, loop
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Output:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        self.finished = out.finished
        return out


@dataclass
class _Live:
    handle: RequestHandle
    seq: Sequence
    arrival: float
    want_tokens: bool
    first_time: float | None = None
    last_time: float | None = None


class EngineDriver:
    def __init__(self, engine: EngineCore, metrics=None, snapshot_interval: float = 0.2,
                 host: HostMemory | None = None):
        self.engine, self.metrics = engine, metrics
        self.host = host or HostMemory(engine)
        self.snapshot_interval = snapshot_interval
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._preemptions = 0
        self._last_snapshot = 0.0
        self.snapshot: dict = self._memory_snapshot()
        self.steps_failed = 0
        self.alive = False
        self.fatal: str | None = None    # why the engine stopped for good (a sharded engine lost a rank)
        self.on_fatal = None             # called with that message from the engine thread (serve exits)

    # ----- asyncio side -----
    def start(self) -> None:
        self.alive = True
        self._thread.start()

    def stop(self, timeout: float = 90.0) -> None:
        """Stop the engine thread; it finishes the step in flight, fails the requests still live
        and closes the engine (the disk and Redis tiers' queued writes are written first)."""
        self._stop.set()
        self._cmds.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %.0f s (tier writes still pending)", timeout)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, want_tokens: bool = False) -> RequestHandle:
        """Queue a request; raises RequestError when the engine refuses it."""
        loop = asyncio.get_running_loop()
        handle = RequestHandle(f"req-{uuid.uuid4().hex}", len(prompt_ids), loop)
        accepted = loop.create_future()
        self._cmds.put(("add", handle, prompt_ids, params, want_tokens, accepted, time.perf_counter()))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(handle.request_id)
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (at the next step boundary)."""
        self._cmds.put(("abort", request_id))

    # ----- engine thread -----
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iteration()
                except DistributedError as e:   # the other ranks are gone: nothing can be computed any more
                    self.fatal = f"{type(e).__name__}: {e}"
                    log.error("the sharded engine stops: %s", self.fatal)
                    break
                except Exception as e:  # noqa: BLE001 - a bug in one request's bookkeeping fails that step only
                    log.exception("engine loop iteration failed")
                    self.steps_failed += 1
                    self._fail_running(f"internal server error ({type(e).__name__}: {e}); the request was aborted")
        finally:
            try:
                self._fail_all("the server is shutting down; the request was aborted" if self.fatal is None
                               else f"the engine stopped ({self.fatal}); the request was aborted")
            finally:
                try:
                    self.engine.close()
                except Exception:  # noqa: BLE001 - report and stop; nothing else runs after this
                    log.exception("closing the engine failed")
                self.alive = False
                if self.fatal is not None and self.on_fatal is not None:
                    self.on_fatal(self.fatal)

    def _iteration(self) -> None:
        busy = self.engine.has_unfinished()
        try:
            cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=self.snapshot_interval)
            while True:
                self._command(cmd)
                cmd = self._cmds.get_nowait()
        except queue.Empty:
            pass
        if self.engine.has_unfinished():
            self._step()
            self.host.busy()
        elif self.host.idle():
            self._publish(force=True)
        self._publish()

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, handle, ids, params, want_tokens, accepted, arrival = cmd
            try:
                seq = self.engine.add_request(ids, params, handle.request_id)
            except RequestError as e:
                self._resolve(accepted, e)
                return
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine thread
                self._resolve(accepted, EngineFailure(f"the engine could not take the request: {e}"))
                if isinstance(e, DistributedError):
                    raise
                log.exception("engine refused a request")
                return
            self._live[handle.request_id] = _Live(handle, seq, arrival, want_tokens)
            self._resolve(accepted, None)
        elif kind == "abort":
            live = self._live.pop(cmd[1], None)
            if live is not None:
                try:
                    self.engine.abort(cmd[1])
                except DistributedError:
                    raise
                except Exception:  # noqa: BLE001
                    log.exception("abort failed for %s", cmd[1])
                self.host.work_done()
                if self.metrics is not None:
                    self.metrics.finished(live, "abort", time.perf_counter())
                self._send(live, Output(finished=True, finish_reason="abort", prompt_tokens=len(live.seq.prompt_ids),
                                        completion_tokens=len(live.seq.output_ids)))
                self._publish(force=True)

    @staticmethod
    def _resolve(fut: asyncio.Future, error: Exception | None) -> None:
        def done():
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(None)
        fut.get_loop().call_soon_threadsafe(done)

    @staticmethod
    def _send(live: _Live, out: Output) -> None:
        live.handle.loop.call_soon_threadsafe(live.handle.queue.put_nowait, out)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("engine step failed")
            self.steps_failed += 1
            self._fail_running(f"internal engine error ({type(e).__name__}: {e}); the request was aborted")
            return
        n = self.engine.scheduler.num_preemptions
        if self.metrics is not None and n > self._preemptions:
            self.metrics.preemptions.inc(n - self._preemptions)
        self._preemptions = n
        if self.metrics is not None and self.engine.speculative:
            self.metrics.speculative(self.engine.stats)
        for ev in events:
            live = self._live.get(ev.request_id)
            if live is not None:
                self._deliver(live, ev)
        if any(ev.finished for ev in events):
            self._publish(force=True)

    def _fail_running(self, message: str) -> None:
        self.host.work_done()
        for seq in list(self.engine.scheduler.running):
            live = self._live.pop(seq.request_id, None)
            try:
                self.engine.abort(seq.request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort after a failed step failed for %s", seq.request_id)
            if live is not None:
                if self.metrics is not None:
                    self.metrics.finished(live, "error", time.perf_counter())
                self._send(live, Output(finished=True, finish_reason="error", error=message,
                                        prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids)))

    def _fail_all(self, message: str) -> None:
        """Finish every live request, running or waiting, with `message` (the server stops)."""
        for rid, live in list(self._live.items()):
            del self._live[rid]
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort at shutdown failed for %s", rid)
            self._send(live, Output(finished=True, finish_reason="error", error=message,
                                    prompt_tokens=len(live.seq.prompt_ids),
                                    completion_tokens=len(live.seq.output_ids)))

    def _deliver(self, live: _Live, ev: Event) -> None:
        seq, now = live.seq, time.perf_counter()
        out = Output(ev.text, [ev.token_id] if ev.token_id is not None else [], finished=ev.finished,
                     finish_reason=ev.finish_reason, prompt_tokens=len(seq.prompt_ids),
                     cached_tokens=seq.num_cached_tokens, completion_tokens=len(seq.output_ids),
                     error=seq.error if ev.finish_reason == "error" else None)
        if self.engine.speculative:
            out.speculative = (seq.spec_steps, seq.spec_draft_tokens, seq.spec_accepted_tokens)
        if ev.token_id is not None:
            i = -1 if ev.index is None else ev.index       # a speculative step emits several tokens
            out.logprobs = [seq.logprobs[i]]
            if live.want_tokens:
                tok = self.engine.tokenizer
                out.token_texts = [tok.decode([ev.token_id]) if tok else str(ev.token_id)]
                if seq.params.logprobs:
                    out.top_logprobs = [[(tok.decode([t]) if tok else str(t), lp) for t, lp in seq.top_logprobs[i]]]
        if self.metrics is not None and ev.token_id is not None:
            self.metrics.token(live, now)
        live.last_time = now
        if live.first_time is None:
            live.first_time = now
        if ev.finished:
            self._live.pop(seq.request_id, None)
            self.host.work_done()
            if self.metrics is not None:
                self.metrics.finished(live, ev.finish_reason or "stop", now)
        self._send(live, out)

    def _publish(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last_snapshot >= self.snapshot_interval:
            try:
                self.snapshot = self._memory_snapshot()
            except Exception:  # noqa: BLE001 - a stats failure must not stop serving
                log.exception("memory snapshot failed")
            self._last_snapshot = now

    def _memory_snapshot(self) -> dict:
        """The memory system (memory.memory_snapshot) plus the process's host memory under
        "host": resident bytes, the budget, each host pool's use and capacity."""
        snap = memory_snapshot(self.engine)
        snap["host"] = self.host.usage()
        return snap
