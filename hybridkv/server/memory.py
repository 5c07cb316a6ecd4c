"""A snapshot of the memory system for /metrics, /stats and the web page.

Bytes are reported per tier and per kind, in three states:
- `active`: held by requests now (their blocks, and the window/compressor state of their slots);
- `cached`: kept for prefix hits and free to be reused (cached blocks nobody holds, window-state
  snapshots);
- `capacity`: what the tier has allocated for the kind (window-state snapshots are allocated on
  demand, up to the engine's `snapshot_bytes` budget, reported as `snapshot_budget`).

With MTP speculation the device tier also holds the MTP layer's window ring ("MTP window") and, once
a sampled request has verified in a speculative graph, the draft distributions its acceptance reads
("draft distributions"), both by request slot.

The device tier is read from the engine's paged store. The prefix-cache tiers below it (host
DRAM, disk, Redis) are reported as `engine.tier_usage()` gives them, under `lower_tiers`: per tier,
bytes and entries held, capacity, hits, misses, evictions, expirations (None where unknown).
"""

from __future__ import annotations

from hybridkv.engine.core import EngineCore

SLOT_KINDS = ("window", "compressor state")
SNAPSHOT_KIND = "window snapshots"


def device_tier(engine: EngineCore) -> dict[str, dict[str, int]]:
    store, pool = engine.store, engine.store.pool
    capacity = store.nbytes_by_kind()
    per_block = store.block_bytes()
    per_slot = {"window": sum(r[0].nbytes for r in store.ring),
                "compressor state": sum(a[0].nbytes + b[0].nbytes for s in store.states for a, b in s.values())}
    used_slots = store.max_slots - store.num_free_slots
    cached_free = sum(1 for b in pool.blocks if b.ref_count == 0 and b.hash is not None)
    out = {}
    for kind in store.entry_kinds():   # V4: CSA main / CSA indexer / HCA; V4.1: global KV / indexer keys
        if capacity.get(kind):
            out[kind] = {"active": pool.num_used * per_block[kind], "cached": cached_free * per_block[kind],
                         "capacity": capacity[kind]}
    for kind in SLOT_KINDS:
        if capacity.get(kind):
            out[kind] = {"active": used_slots * per_slot[kind], "cached": 0, "capacity": capacity[kind]}
    snaps = engine.prefix.snapshots
    out[SNAPSHOT_KIND] = {"active": 0, "cached": snaps.nbytes, "capacity": snaps.nbytes}   # allocated on demand
    out.update(speculative_state(engine, used_slots))
    return out


def speculative_state(engine: EngineCore, used_slots: int) -> dict[str, dict[str, int]]:
    """Device memory of MTP speculation by slot: the MTP layer's window ring, and the draft
    distributions that sampled requests' acceptance reads in the speculative graph (allocated when
    the first sampled graph is built: slots × k × vocab float32)."""
    out = {}
    drafter = getattr(engine, "drafter", None)
    if drafter is None:
        return out
    tensors = {"MTP window": drafter.cache.ring}
    graphs = getattr(engine, "spec_graphs", None)
    if graphs is not None and graphs.draft_probs is not None:
        tensors["draft distributions"] = graphs.draft_probs
    for kind, t in tensors.items():
        out[kind] = {"active": used_slots * t[0].nbytes, "cached": 0, "capacity": t.nbytes}
    return out


def memory_policy_usage(engine: EngineCore) -> dict:
    """The memory policy and, when it offloads CSA entries, the page traffic so far: pages recalled to
    the device, evicted, written back to host memory (the paged kernels' path), and one page's bytes."""
    st, store = engine.stats, engine.store
    return {"name": str(engine.memory), "offloads": store.offload,
            "page_bytes": store.page_bytes() if store.offload else 0, "pages_loaded": st.pages_loaded,
            "pages_evicted": st.pages_evicted, "pages_written_back": st.pages_written_back}


def snapshot_counts(engine: EngineCore) -> dict:
    """Window-state snapshots at block boundaries so far: kept in the device store, evicted from it,
    given to the lower tiers alone, and not taken for want of room in any store; and one's bytes."""
    prefix = engine.prefix
    return {"stored": prefix.snapshots.stored, "evicted": prefix.snapshots.evicted, "below": prefix.snapshots_below,
            "skipped": prefix.snapshots_skipped, "bytes_each": engine.snapshot_nbytes}


def memory_snapshot(engine: EngineCore) -> dict:
    pool, sched = engine.store.pool, engine.scheduler
    return {
        "tiers": {"device": device_tier(engine)},
        "lower_tiers": engine.tier_usage(),
        "blocks": {"total": pool.num_blocks, "active": pool.num_used,
                   "cached": sum(1 for b in pool.blocks if b.ref_count == 0 and b.hash is not None),
                   "block_tokens": engine.store.block_tokens, "evictions": pool.evictions},
        "kv_usage": pool.num_used / pool.num_blocks,
        "requests": {"running": len(sched.running), "waiting": len(sched.waiting)},
        "preemptions": sched.num_preemptions,
        "slots": {"total": engine.store.max_slots, "free": engine.store.num_free_slots},
        "snapshot_budget": engine.prefix.snapshots.capacity,
        "snapshots": snapshot_counts(engine),
        "window_policy": str(engine.policy),
        "memory_policy": memory_policy_usage(engine),
        "kv_format": engine.store.fmt,
        "prefix_caching": engine.prefix.enabled,
    }
