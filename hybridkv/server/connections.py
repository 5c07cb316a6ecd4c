"""uvicorn's h11 protocol with the per-connection limits `hybridkv.server.limits` describes:
header and body deadlines and a cap on open connections. Apart from `limits` so that building the
command line (which reads `limits`' arguments) needs no server packages."""

from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("hybridkv.server")

_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: 27\r\n\r\ntoo many open connections\r\n")


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body deadlines and a cap on open connections. The
    limits are read from `config.hybridkv_limits` (set by `uvicorn_config`)."""

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.limits = config.hybridkv_limits         # a hybridkv.server.limits.ListenLimits
        self._deadline: object = None      # asyncio.TimerHandle of the armed header/body deadline
        self._deadline_kind: str | None = None
        self._refused = False

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.limits.max_connections:
            self._refused = True
            self.transport = transport
            transport.write(_REFUSAL)
            transport.close()
            log.warning("refused a connection: %d connections are open (--max-connections)", len(self.connections))
            return
        super().connection_made(transport)
        self._arm("header", self.limits.timeout_header)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._follow_state()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._refused:
            self.connections.discard(self)
            return
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()   # arms uvicorn's keep-alive timer for the next request
        self._disarm()

    # ----- deadlines -----
    def _follow_state(self) -> None:
        """After a chunk of input: headers still incomplete -> keep (or arm) the header deadline;
        inside a body -> restart the body deadline; otherwise none."""
        state = self.conn.their_state
        if state is h11.IDLE and not self.transport.is_closing():
            if self._deadline_kind != "header":
                self._arm("header", self.limits.timeout_header)
        elif state is h11.SEND_BODY:
            self._arm("body", self.limits.timeout_body)
        else:
            self._disarm()

    def _arm(self, kind: str, seconds: float) -> None:
        self._disarm()
        self._deadline_kind = kind
        self._deadline = self.loop.call_later(seconds, self._expired, kind)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_kind = None, None

    def _expired(self, kind: str) -> None:
        self._deadline, self._deadline_kind = None, None
        if self.transport.is_closing():
            return
        if kind == "body" and self.flow is not None and self.flow.read_paused:
            self._arm("body", self.limits.timeout_body)    # the app is not reading: not the client's fault
            return
        state = self.conn.their_state
        if (kind == "header" and state is h11.IDLE) or (kind == "body" and state is h11.SEND_BODY):
            log.debug("closing a connection that did not send its %s in time",
                      "headers" if kind == "header" else "body")
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.transport.close()
