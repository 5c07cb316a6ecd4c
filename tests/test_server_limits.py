"""Connection limits of the server, over real loopback sockets: a connection that never finishes
its headers (or its body) is closed after the deadline, connections above the cap are answered
503 and closed while the server keeps answering once slots free up, and a flood of the same
warning logs a bounded number of lines."""

from __future__ import annotations

import io
import logging
import socket
import time

import httpx
import pytest
from serverkit import LiveServer

from hybridkv.errors import ConfigError
from hybridkv.server.limits import ListenLimits, RateLimitFilter, fd_capped

MARGIN = 4.0     # seconds past a deadline before a connection counts as left open (the machine may be loaded)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(0.2)
    return s


def _closed_by_server(s: socket.socket, within: float, drip: bytes = b"") -> tuple[bool, bytes, float]:
    """Send `drip` one byte every 0.2 s until the server closes the connection or `within`
    seconds pass. Returns (closed, bytes received, seconds until closed)."""
    t0, got, i = time.monotonic(), b"", 0
    while time.monotonic() - t0 < within:
        if i < len(drip):
            try:
                s.send(drip[i:i + 1])
            except OSError:
                return True, got, time.monotonic() - t0
            i += 1
        try:
            chunk = s.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return True, got, time.monotonic() - t0
        if not chunk:
            return True, got, time.monotonic() - t0
        got += chunk
    return False, got, time.monotonic() - t0


@pytest.fixture(scope="module")
def limited():
    srv = LiveServer(limits=ListenLimits(timeout_header=1.0, timeout_body=1.0, timeout_keep_alive=1.0,
                                         max_connections=8))
    yield srv
    srv.close()


def test_slowloris_headers_are_cut_off(limited):
    s = _connect(limited.port)
    try:
        drip = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        closed, got, took = _closed_by_server(s, 1.0 + MARGIN, drip)
    finally:
        s.close()
    assert closed, f"a connection dripping its headers was still open after {took:.1f}s"
    assert took >= 0.9 and not got.startswith(b"HTTP/1.1 200")


def test_silent_connection_is_cut_off(limited):
    s = _connect(limited.port)
    try:
        closed, _, took = _closed_by_server(s, 1.0 + MARGIN)
    finally:
        s.close()
    assert closed, f"a connection that sent nothing was still open after {took:.1f}s"


def test_stalled_body_is_cut_off(limited):
    s = _connect(limited.port)
    try:
        s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        closed, _, took = _closed_by_server(s, 1.0 + MARGIN)
    finally:
        s.close()
    assert closed, f"a request whose body stalled was still open after {took:.1f}s"


def test_complete_requests_still_work_and_keep_alive_ends(limited):
    s = _connect(limited.port)
    try:
        s.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        closed, got, took = _closed_by_server(s, 1.0 + MARGIN)
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 200"), got[:100]
    assert closed, f"an idle keep-alive connection was still open after {took:.1f}s"


def test_connections_above_the_cap_are_refused(limited):
    held = [_connect(limited.port) for _ in range(8)]
    extras = []
    try:
        time.sleep(0.3)                    # the server has accepted the first 8
        extras = [_connect(limited.port) for _ in range(4)]
        for s in extras:
            closed, got, _ = _closed_by_server(s, MARGIN)
            assert closed and got.startswith(b"HTTP/1.1 503"), got[:100]
        # the held connections never send headers: the header deadline frees their slots
        deadline = time.monotonic() + 1.0 + 2 * MARGIN
        while True:
            try:
                if httpx.get(limited.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "/health did not answer after the idle connections timed out"
            time.sleep(0.2)
    finally:
        for s in held + extras:
            s.close()


def test_flood_of_bad_requests_logs_a_bounded_number_of_lines(limited):
    # uvicorn's own handler (a test runner may add capturing handlers, StreamHandlers too, beside it)
    handlers = [h for h in logging.getLogger("uvicorn").handlers if type(h) is logging.StreamHandler]
    assert handlers, "uvicorn's log handler is missing"
    buf = io.StringIO()
    old = [h.setStream(buf) for h in handlers]
    try:
        for _ in range(150):
            s = _connect(limited.port)
            s.send(b"NOT HTTP AT ALL\r\n\r\n")
            _closed_by_server(s, 2.0)
            s.close()
    finally:
        for h, stream in zip(handlers, old, strict=True):
            h.setStream(stream)
    lines = [ln for ln in buf.getvalue().splitlines() if "Invalid HTTP request" in ln]
    assert 1 <= len(lines) <= 5, buf.getvalue()[-2000:]


def test_rate_limit_filter_counts_what_it_suppressed():
    now = [0.0]
    flt = RateLimitFilter(interval=10.0, clock=lambda: now[0])
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.addFilter(flt)
    logger = logging.getLogger("hybridkv.test_rate_limit")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        for i in range(10_000):
            logger.error("accept failed: Too many open files (fd %d)", i)
        logger.info("an info line always passes")
        now[0] = 11.0
        logger.error("accept failed: Too many open files (fd %d)", 0)
    finally:
        logger.removeHandler(handler)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert "9999 more like this" in lines[2]


def test_limits_are_validated_and_capped_by_the_open_file_limit():
    import resource
    with pytest.raises(ConfigError, match="--timeout-header"):
        ListenLimits(timeout_header=0)
    with pytest.raises(ConfigError, match="--max-connections"):
        ListenLimits(max_connections=0)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        assert fd_capped(soft * 2) < soft
        assert fd_capped(1) == 1


def test_serve_flags():
    from hybridkv.cli import build_parser
    from hybridkv.server.limits import from_args
    a = build_parser().parse_args(["serve", "m"])
    assert from_args(a) == ListenLimits(10.0, 10.0, 5.0, 1024) and a.host_memory_budget is None
    a = build_parser().parse_args(["serve", "m", "--timeout-header", "2", "--max-connections", "64",
                                   "--host-memory-budget", "8G"])
    assert (from_args(a).timeout_header, from_args(a).max_connections, a.host_memory_budget) == (2.0, 64, "8G")
