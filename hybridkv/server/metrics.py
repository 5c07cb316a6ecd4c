"""Prometheus metrics. Where vLLM has a counterpart the name is vLLM's (`vllm:...`, label
`model_name`), so dashboards and autoscalers written for vLLM read them unchanged; the memory
system's own series are `hybridkv:...` with `tier` and `kind` labels: the device's KV by kind
(`hybridkv:kv_cache_bytes`, `hybridkv:kv_blocks`) and each prefix-cache tier below it
(`hybridkv:kv_tier_bytes`, `hybridkv:kv_tier_hits_total`, `hybridkv:kv_tier_evictions_total`, ...).

Counters and histograms are updated by the engine thread as tokens come out; gauges are read
from the driver's latest memory snapshot when Prometheus scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

SPEC_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 16)   # draft tokens accepted per verify step
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
disable_created_metrics()   # no *_created series (vLLM's exporter has none either)

E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)

# the lower tiers' series: (key of engine.tier_usage(), name, counter?, help)
TIER_SERIES = (
    ("bytes", "hybridkv:kv_tier_bytes", False, "Bytes held by a prefix-cache tier below the device."),
    ("capacity", "hybridkv:kv_tier_capacity_bytes", False, "Bytes a prefix-cache tier may hold."),
    ("entries", "hybridkv:kv_tier_entries", False, "Records (KV blocks, window states) held by a tier."),
    ("hits", "hybridkv:kv_tier_hits", True, "Records found in a tier and loaded."),
    ("misses", "hybridkv:kv_tier_misses", True, "Loads asked of a tier that found no usable record."),
    ("evictions", "hybridkv:kv_tier_evictions", True, "Records removed from a tier for space (LRU)."),
    ("evicted_bytes", "hybridkv:kv_tier_evicted_bytes", True, "Bytes removed from a tier for space."),
    ("expired", "hybridkv:kv_tier_expirations", True, "Records removed when their kind's lifetime ran out."),
    ("stored_bytes", "hybridkv:kv_tier_stored_bytes", True, "Bytes written to a tier."),
    ("loaded_bytes", "hybridkv:kv_tier_loaded_bytes", True, "Bytes loaded from a tier."),
    ("bad", "hybridkv:kv_tier_bad_entries", True, "Corrupted, truncated or foreign entries found and removed."),
    ("errors", "hybridkv:kv_tier_errors", True, "I/O failures of a tier (it pauses; requests go on)."),
    ("dropped", "hybridkv:kv_tier_dropped_writes", True, "Writes a tier skipped (paused, or a record too large)."),
)


def tier_families(model_name: str, usage: dict[str, dict[str, int | None]]):
    """The TIER_SERIES of a memory snapshot's `lower_tiers` (a value of None is left out)."""
    for key, metric, is_counter, doc in TIER_SERIES:
        family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(metric, doc,
                                                                             labels=["model_name", "tier"])
        for tier, values in usage.items():
            if values.get(key) is not None:
                family.add_metric([model_name, tier], values[key])
        yield family


class _SnapshotCollector:
    def __init__(self, metrics: "Metrics"):
        self.m = metrics

    def collect(self):
        snap = self.m.snapshot_source() if self.m.snapshot_source else None
        if not snap:
            return
        name = self.m.model_name

        def gauge(metric, doc, value, labels=(), values=()):
            g = GaugeMetricFamily(metric, doc, labels=["model_name", *labels])
            g.add_metric([name, *values], value)
            return g

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", snap["requests"]["running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", snap["requests"]["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).", snap["kv_usage"])
        used = GaugeMetricFamily("hybridkv:kv_cache_bytes",
                                 "KV bytes by tier and kind; state active = held by requests, cached = kept for "
                                 "prefix hits.", labels=["model_name", "tier", "kind", "state"])
        cap = GaugeMetricFamily("hybridkv:kv_cache_capacity_bytes", "KV bytes allocated, by tier and kind.",
                                labels=["model_name", "tier", "kind"])
        for tier, kinds in snap["tiers"].items():
            for kind, v in kinds.items():
                used.add_metric([name, tier, kind, "active"], v["active"])
                used.add_metric([name, tier, kind, "cached"], v["cached"])
                cap.add_metric([name, tier, kind], v["capacity"])
        yield used
        yield cap
        b = snap["blocks"]
        blocks = GaugeMetricFamily("hybridkv:kv_blocks", "KV blocks of the device pool by state.",
                                   labels=["model_name", "state"])
        blocks.add_metric([name, "active"], b["active"])
        blocks.add_metric([name, "cached"], b["cached"])
        blocks.add_metric([name, "free"], b["total"] - b["active"])
        yield blocks
        yield from tier_families(name, snap.get("lower_tiers", {}))
        snaps = snap.get("snapshots")
        if snaps:
            taken = CounterMetricFamily("hybridkv:prefix_snapshots",
                                        "Window-state snapshots at block boundaries: kept in the device store "
                                        "(stored), dropped from it for space (evicted), given to the lower tiers "
                                        "alone (below), not taken for want of room in any store (skipped).",
                                        labels=["model_name", "event"])
            for event in ("stored", "evicted", "below", "skipped"):
                taken.add_metric([name, event], snaps[event])
            yield taken
        mp = snap.get("memory_policy")
        if mp and mp["offloads"]:
            pages = CounterMetricFamily("hybridkv:memory_policy_pages",
                                        "CSA pages a memory policy moved: recalled to the device (loaded), dropped "
                                        "from it (evicted), copied to host memory when their block completed "
                                        "(written_back).", labels=["model_name", "policy", "event"])
            moved = CounterMetricFamily("hybridkv:memory_policy_transfer_bytes",
                                        "Bytes of CSA pages copied between host memory and the device.",
                                        labels=["model_name", "policy", "direction"])
            for event in ("loaded", "evicted", "written_back"):
                pages.add_metric([name, mp["name"], event], mp["pages_" + event])
            moved.add_metric([name, mp["name"], "to_device"], mp["pages_loaded"] * mp["page_bytes"])
            moved.add_metric([name, mp["name"], "to_host"], mp["pages_written_back"] * mp["page_bytes"])
            yield pages
            yield moved
        host = snap.get("host")
        if host:
            mem = GaugeMetricFamily("hybridkv:host_memory_bytes",
                                    "Host memory of the server process: resident (RSS), budget (--host-memory-budget, "
                                    "absent when unset), and each host pool's use and capacity.",
                                    labels=["model_name", "kind", "state"])
            if host.get("resident") is not None:
                mem.add_metric([name, "resident", "used"], host["resident"])
            if host.get("budget") is not None:
                mem.add_metric([name, "budget", "capacity"], host["budget"])
            for kind, v in host["pools"].items():
                mem.add_metric([name, kind, "used"], v["used"])
                mem.add_metric([name, kind, "capacity"], v["capacity"])
            yield mem


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.snapshot_source = None            # () -> dict, set by the app
        r, labels = self.registry, ["model_name"]

        def counter(n, doc, extra=()):
            return Counter(n, doc, [*labels, *extra], registry=r)

        def hist(n, doc, buckets):
            return Histogram(n, doc, labels, buckets=buckets, registry=r)

        self._prompt = counter("vllm:prompt_tokens", "Prompt tokens processed (cached or computed).")
        self._cached = counter("vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        self._generation = counter("vllm:generation_tokens", "Tokens generated.")
        self._pc_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self._pc_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._preempt = counter("vllm:num_preemptions", "Requests preempted (their KV freed and recomputed later).")
        self._success = counter("vllm:request_success", "Requests finished, by reason.", ["finished_reason"])
        self._rejected = counter("hybridkv:requests_rejected", "Requests answered with an error before running, "
                                 "by HTTP status.", ["status"])
        self._ttft = hist("vllm:time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self._itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                         ITL_BUCKETS)
        self._e2e = hist("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        self._spec = {key: counter(f"vllm:spec_decode_{key}", doc) for key, doc in (
            ("num_drafts", "Speculative verify steps (one per request and step with draft tokens)."),
            ("num_draft_tokens", "Draft tokens proposed."),
            ("num_accepted_tokens", "Draft tokens accepted."))}
        self._spec_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position "
                                 "in the draft.", ["position"])
        self._spec_hist = hist("hybridkv:spec_decode_accepted_tokens_per_step", "Draft tokens accepted per verify "
                               "step (the mean acceptance length is 1 + sum / count).", SPEC_BUCKETS)
        self._spec_seen: dict | None = None
        self.registry.register(_SnapshotCollector(self))
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)
        self.preemptions = self._preempt.labels(model_name)
        self._totals = dict.fromkeys(("prompt_tokens", "cached_prompt_tokens", "generation_tokens", "requests"), 0)

    # ----- called by the engine thread -----
    def token(self, live, now: float) -> None:
        n = self.model_name
        self._generation.labels(n).inc()
        self._totals["generation_tokens"] += 1
        if live.first_time is None:
            seq = live.seq
            self._totals["prompt_tokens"] += len(seq.prompt_ids)
            self._totals["cached_prompt_tokens"] += seq.num_cached_tokens
            self._ttft.labels(n).observe(now - live.arrival)
            self._prompt.labels(n).inc(len(seq.prompt_ids))
            self._cached.labels(n).inc(seq.num_cached_tokens)
            self._pc_queries.labels(n).inc(len(seq.prompt_ids))
            self._pc_hits.labels(n).inc(seq.num_cached_tokens)
        else:
            self._itl.labels(n).observe(now - live.last_time)

    def finished(self, live, reason: str, now: float) -> None:
        self._success.labels(self.model_name, reason).inc()
        self._totals["requests"] += 1
        self._e2e.labels(self.model_name).observe(now - live.arrival)

    def speculative(self, stats) -> None:
        """Count what the engine's speculative steps did since the last call (from its EngineStats)."""
        n = self.model_name
        now = {"num_drafts": stats.spec_drafts, "num_draft_tokens": stats.spec_draft_tokens,
               "num_accepted_tokens": stats.spec_accepted_tokens, "pos": list(stats.spec_accepted_per_pos),
               "hist": list(stats.spec_accepted_hist)}
        seen = self._spec_seen or {k: (0 if isinstance(v, int) else [0] * len(v)) for k, v in now.items()}
        for key, c in self._spec.items():
            c.labels(n).inc(now[key] - seen[key])
        for pos, (a, b) in enumerate(zip(now["pos"], seen["pos"])):
            self._spec_pos.labels(n, str(pos)).inc(a - b)
        for accepted, (a, b) in enumerate(zip(now["hist"], seen["hist"])):
            for _ in range(a - b):
                self._spec_hist.labels(n).observe(accepted)
        self._spec_seen = now

    # ----- called by the app -----
    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> dict:
        """Running totals for /stats: prompt tokens, of which cached (the prefix hit rate), generated
        tokens, finished requests."""
        return dict(self._totals)
