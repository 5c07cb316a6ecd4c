"""Where a run's peak GPU memory comes from: the peak of each phase of a benchmark above a base,
and, for the phases that `trace`'s patterns name (fnmatch: `decode:*`), the tensors live at that
phase's peak grouped by the line of hybridkv that allocated them.

    phases = MemoryPhases(base=torch.cuda.memory_allocated(), trace={"decode 64 x 131072"})
    with phases("decode 64 x 131072"):
        ...
    phases.rows         # one dict a phase: start, peak and end bytes above the base, and `top`
    phases.peak         # the run's peak above the base (the most of the phases' peaks)

A traced phase records the allocator's history (`torch.cuda.memory._record_memory_history`, with
Python stacks: it slows allocation, so trace only the phases in question). Blocks allocated before
the phase began are in its `start`, not in `top`.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from fnmatch import fnmatch

import torch

HISTORY_ENTRIES = 2_000_000


def live_at_peak(events: list[dict], top: int = 12) -> list[tuple[str, int]]:
    """The blocks allocated within a trace and live at its highest point, summed by the first
    hybridkv frame of their allocation (the first frame of all where none is hybridkv's); the `top`
    largest groups as (where, bytes). `events`: the allocator's trace (`alloc` / `free_completed`
    actions with `addr`, `size` and `frames`)."""
    live, cur, high, at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > high:
                high, at = cur, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])
    where: dict[int, int] = {}
    for i, e in enumerate(events[: at + 1]):
        if e["action"] == "alloc":
            where[e["addr"]] = i
        elif e["action"] == "free_completed":
            where.pop(e["addr"], None)
    groups: Counter[str] = Counter()
    for i in where.values():
        groups[_site(events[i].get("frames") or [])] += events[i]["size"]
    return groups.most_common(top)


def _site(frames: list[dict]) -> str:
    ours = [f for f in frames if "hybridkv/" in f.get("filename", "")]
    f = (ours or frames or [{}])[0]
    name = f.get("filename", "?").split("hybridkv/")[-1]
    return f"{name}:{f.get('line', '?')} {f.get('name', '')}".strip()


class MemoryPhases:
    """Per-phase peaks of `torch.cuda.max_memory_allocated` above `base` (see the module docstring)."""

    def __init__(self, base: int, trace: set[str] | None = None, enabled: bool = True):
        self.base, self.trace, self.enabled = base, trace or set(), enabled
        self.rows: list[dict] = []
        self.peak = 0

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        traced = any(fnmatch(name, pattern) for pattern in self.trace)
        if traced:
            _record(True)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            row = dict(phase=name, start_bytes=start - self.base, peak_bytes=peak - self.base,
                       end_bytes=torch.cuda.memory_allocated() - self.base)
            if traced:
                events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
                _record(False)
                row["trace_events"] = len(events)
                row["top"] = live_at_peak(events)
            self.peak = max(self.peak, row["peak_bytes"])
            self.rows.append(row)


def _record(on: bool) -> None:
    if not on:
        torch.cuda.memory._record_memory_history(enabled=None)
        return
    try:        # a fresh history for each traced phase
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=HISTORY_ENTRIES,
                                                 clear_history=True)
    except TypeError:
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=HISTORY_ENTRIES)
