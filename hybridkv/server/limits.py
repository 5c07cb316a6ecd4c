"""How the server listens: the uvicorn configuration `hybridkv serve` and the tests share, with
the connection limits uvicorn lacks.

uvicorn's h11 protocol closes an idle keep-alive connection after `timeout_keep_alive`, but never
one that has not finished sending its headers or its body (it cancels the keep-alive timer on
the first byte), and it accepts every connection until the process runs out of file descriptors.
`hybridkv.server.connections.LimitedH11Protocol` adds, per connection:
- a header deadline, armed when the connection opens (or the first byte of a next request
  arrives) and cancelled once the request's headers are complete;
- a body deadline, re-armed on every chunk of a request body (not while the app itself holds
  reading back);
- a cap on open connections: above it a new connection gets a 503 and is closed at once, so the
  open-file limit is never reached.
Repeated warnings and errors (a flood of the same failure) go through `RateLimitFilter`.
"""

from __future__ import annotations

import argparse
import logging
import resource
import threading
import time
from dataclasses import dataclass

from hybridkv.errors import ConfigError

log = logging.getLogger("hybridkv.server")

FD_RESERVE = 64          # descriptors kept for the model files, tier files, logs and the listening socket


@dataclass
class ListenLimits:
    timeout_header: float = 10.0      # seconds to send a request's headers
    timeout_body: float = 10.0        # seconds between two chunks of a request body
    timeout_keep_alive: float = 5.0   # an idle keep-alive connection is closed after this
    max_connections: int = 1024       # open connections; more are answered 503 and closed

    def __post_init__(self) -> None:
        for name in ("timeout_header", "timeout_body", "timeout_keep_alive"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ConfigError(f"--max-connections must be a positive integer, got {self.max_connections!r}")


def fd_capped(max_connections: int) -> int:
    """max_connections, lowered to fit under the process's open-file limit (RLIMIT_NOFILE) with
    FD_RESERVE descriptors to spare; a lowered value is logged."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    room = max(1, soft - FD_RESERVE)
    if max_connections > room:
        log.warning("--max-connections %d does not fit under the open-file limit (ulimit -n = %d, %d kept in "
                    "reserve): using %d; raise the limit to allow more", max_connections, soft, FD_RESERVE, room)
        return room
    return max_connections


class RateLimitFilter(logging.Filter):
    """Let one record of each (logger, level, first line of the message template) through per
    `interval` seconds, for warnings and above; the next one that passes says how many were
    suppressed. The template, not the formatted text, so that the same failure with different
    arguments (another socket, another file descriptor) counts as the same message.
    One filter object can sit on several handlers: each record is decided once."""

    def __init__(self, interval: float = 10.0, clock=time.monotonic, max_keys: int = 4096):
        super().__init__()
        self.interval, self.clock, self.max_keys = interval, clock, max_keys
        self._seen: dict[tuple, list] = {}        # key -> [time of the last record let through, suppressed since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        decided = getattr(record, "_hybridkv_rate_limit", None)
        if decided is not None:
            return decided
        ok = self._decide(record)
        record._hybridkv_rate_limit = ok
        return ok

    def _decide(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0])
        now = self.clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.interval:
                entry[1] += 1
                return False
            suppressed = entry[1] if entry is not None else 0
            if len(self._seen) >= self.max_keys:
                self._seen.clear()
            self._seen[key] = [now, 0]
        if suppressed:
            record.msg = f"{record.getMessage()} [{suppressed} more like this in the last {self.interval:g}s " \
                         f"were not logged]"
            record.args = None
        return True


def install_rate_limit(interval: float = 10.0, loggers=("", "uvicorn", "uvicorn.error", "uvicorn.access",
                                                         "asyncio")) -> RateLimitFilter:
    """Put one RateLimitFilter on every handler of these loggers (call after logging is set up)."""
    flt = RateLimitFilter(interval)
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RateLimitFilter) for f in handler.filters):
                handler.addFilter(flt)
    return flt


def uvicorn_config(app, limits: ListenLimits | None = None, *, host: str = "127.0.0.1", port: int = 8000,
                   log_level: str = "info", timeout_graceful_shutdown: int = 5):
    """The uvicorn.Config of the server: our protocol, its limits, keep-alive, and a backlog no
    larger than the connection cap."""
    import uvicorn

    from hybridkv.server.connections import LimitedH11Protocol

    limits = limits or ListenLimits()
    cap = fd_capped(limits.max_connections)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=LimitedH11Protocol,
                            timeout_keep_alive=limits.timeout_keep_alive, backlog=min(2048, max(cap, 16)),
                            timeout_graceful_shutdown=timeout_graceful_shutdown)
    config.hybridkv_limits = ListenLimits(limits.timeout_header, limits.timeout_body, limits.timeout_keep_alive,
                                          cap)
    # uvicorn's own handlers (set up by the Config above); the root logger's are the process's,
    # and `serve.run` limits them: a library must not filter handlers it does not own (a test
    # runner's, say)
    install_rate_limit(loggers=("uvicorn", "uvicorn.error", "uvicorn.access"))
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection-limit flags of `hybridkv serve`."""
    g = parser.add_argument_group("connections")
    d = ListenLimits()
    g.add_argument("--timeout-header", type=float, default=d.timeout_header, metavar="S",
                   help=f"close a connection that has not sent a request's headers within S seconds "
                        f"(default {d.timeout_header:g})")
    g.add_argument("--timeout-body", type=float, default=d.timeout_body, metavar="S",
                   help=f"close a connection whose request body stalls for S seconds (default {d.timeout_body:g})")
    g.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive, metavar="S",
                   help=f"close an idle keep-alive connection after S seconds (default {d.timeout_keep_alive:g})")
    g.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help=f"open connections at most; more are answered 503 and closed (default {d.max_connections}, "
                        f"lowered to fit the open-file limit)")


def from_args(a: argparse.Namespace) -> ListenLimits:
    return ListenLimits(a.timeout_header, a.timeout_body, a.timeout_keep_alive, a.max_connections)
