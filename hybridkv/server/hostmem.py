"""Host memory of a serving process: allocator settings that give freed memory back, a
rate-limited `malloc_trim` when the engine goes idle, the resident size, and the host-memory
budget (what the configured pools may hold, checked at start and reported with their use).

Why the allocator needs help: glibc keeps memory that was freed. Each thread that allocates
(the event loop, the engine thread, the prefix-cache writer, tokenizer and torch threads) gets
an arena of its own, up to 8 per core, and freed chunks stay inside it; after a large block is
freed the mmap threshold also rises to its size, so later tensors of that size come from the
arenas rather than from mmap and are never unmapped. Host-DRAM tier records, window snapshots
and per-request tensors of distinct long prompts therefore pile up as resident memory long after
they are freed. `tune_allocator` caps the arenas and pins the mmap threshold (as MALLOC_ARENA_MAX
and MALLOC_MMAP_THRESHOLD_ would; variables set by the user win), and `HostMemory.idle` returns
free pages with `malloc_trim(0)` once work has finished.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from dataclasses import dataclass
from functools import cached_property

from hybridkv.cache.tiers.config import parse_size
from hybridkv.errors import ConfigError

log = logging.getLogger("hybridkv.server")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
ALLOWANCE = 1 << 30          # interpreter, torch, tokenizer, per-step activations and request buffers
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _libc = False
    return _libc or None


def tune_allocator(arena_max: int = 2, mmap_threshold: int = 4 << 20, trim_threshold: int = 32 << 20) -> bool:
    """Cap glibc's arenas and fix its mmap/trim thresholds (no dynamic raise); False where the C
    library is not glibc. Environment variables MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_ and
    MALLOC_TRIM_THRESHOLD_ take precedence. Call before the server's threads start."""
    libc = _glibc()
    if libc is None:
        return False
    for env, param, value in (("MALLOC_ARENA_MAX", M_ARENA_MAX, arena_max),
                              ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, mmap_threshold),
                              ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, trim_threshold)):
        if env not in os.environ:
            libc.mallopt(param, value)
    return True


def trim() -> bool:
    """Give free heap pages of every arena back to the system (glibc only)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def resident_bytes() -> int | None:
    """The process's resident set size (VmRSS), None where /proc is not available."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def parse_budget(text: str | int | None) -> int | None:
    """`--host-memory-budget` in bytes ('8G', '512MiB', ...; None: no budget)."""
    if text is None or text == "":
        return None
    try:
        value = parse_size(text)
    except ConfigError as e:
        raise ConfigError(f"--host-memory-budget: {e}") from None
    if value <= 0:
        raise ConfigError(f"--host-memory-budget {text!r}: must be positive")
    return value


def _fmt(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class HostMemory:
    """The host-memory pools of one engine, its budget, and the idle trim."""

    def __init__(self, engine, budget: int | str | None = None, trim_interval: float = 2.0,
                 busy_trim_interval: float = 30.0):
        self.engine, self.budget = engine, parse_budget(budget)
        self.trim_interval, self.busy_trim_interval = trim_interval, busy_trim_interval
        self._dirty = False            # work finished since the last trim
        self._last_trim = 0.0
        self.trims = 0
        self._lock = threading.Lock()

    # ----- budget -----
    @cached_property
    def capacities(self) -> dict[str, int]:
        """Host bytes each configured pool may hold (its capacity, not its use; fixed for the
        engine's life, so computed once rather than at every snapshot)."""
        eng = self.engine
        out = {}
        tiers = getattr(eng, "tiers", None)
        dram = tiers.tier("dram") if tiers is not None else None
        out["dram tier"] = dram.capacity if dram is not None else 0
        out["tier write queue"] = tiers._writer.max_pending if tiers is not None else 0
        out["window snapshots"] = eng.prefix.snapshots.capacity if eng.prefix.enabled else 0
        if eng.device.type == "cpu":    # on CPU the device pool and the weights are host memory too
            out["kv pool"] = sum(eng.store.nbytes_by_kind().values())
            out["weights"] = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        out["allowance"] = ALLOWANCE
        return out

    def check(self) -> None:
        """Raise ConfigError when the pools cannot fit the budget."""
        if self.budget is None:
            return
        pools = self.capacities
        need = sum(pools.values())
        if need > self.budget:
            parts = ", ".join(f"{k} {_fmt(v)}" for k, v in pools.items() if v)
            raise ConfigError(f"--host-memory-budget {_fmt(self.budget)} is smaller than what the server is configured "
                              f"to hold ({_fmt(need)}: {parts}); lower --kv-dram-size, the snapshot budget or "
                              f"--num-blocks, or raise the budget")

    def usage(self) -> dict:
        """Resident bytes, the budget, and each pool's use next to its capacity (for /stats and
        /metrics)."""
        eng = self.engine
        tiers = getattr(eng, "tiers", None)
        dram = tiers.tier("dram") if tiers is not None else None
        pools = self.capacities
        used = {"dram tier": dram.stats.bytes if dram is not None else 0,
                "tier write queue": tiers._writer.pending if tiers is not None else 0,
                "window snapshots": eng.prefix.snapshots.nbytes}
        return {"resident": resident_bytes(), "budget": self.budget, "trims": self.trims,
                "pools": {k: {"used": used.get(k, v), "capacity": v} for k, v in pools.items() if k != "allowance"},
                "allowance": pools["allowance"]}

    # ----- giving memory back -----
    def work_done(self) -> None:
        """A request finished or was aborted: the next idle moment trims."""
        self._dirty = True

    def idle(self) -> bool:
        """Called by the engine thread when nothing runs: trim if work finished since the last
        trim and the last one is `trim_interval` seconds old. True if it trimmed."""
        return self._trim_after(self.trim_interval)

    def busy(self) -> bool:
        """Called by the engine thread after a step: under continuous load the engine never goes
        idle, so trim at most every `busy_trim_interval` seconds."""
        return self._trim_after(self.busy_trim_interval)

    def _trim_after(self, interval: float) -> bool:
        now = time.monotonic()
        if not self._dirty or now - self._last_trim < interval:
            return False
        with self._lock:
            self._dirty, self._last_trim = False, now
            trim()
            self.trims += 1
        resident = resident_bytes() or 0
        if self.budget is not None and resident > self.budget:
            log.warning("resident memory %s is above --host-memory-budget %s after giving free memory back",
                        _fmt(resident), _fmt(self.budget))
        return True


def add_arguments(parser) -> None:
    """`--host-memory-budget` of `hybridkv serve`."""
    parser.add_argument("--host-memory-budget", default=None, metavar="SIZE",
                        help="host memory the server may plan for, e.g. 8G: the DRAM tier, its write queue, window "
                             "snapshots, on CPU the KV pool and weights, plus a 1 GiB allowance must fit, else the "
                             "server refuses to start (default: no budget; usage is reported in /stats and /metrics)")
