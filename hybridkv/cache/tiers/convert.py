"""Between the device store and records: what a block or a state snapshot is as a `Record`, and
the identity that says which store layout a record fits."""

from __future__ import annotations

import hashlib
import json

import torch

from hybridkv.cache.tiers.record import Record, compact
from hybridkv.errors import CacheEntryError


def layout_identity(store, model_identity: str, computation: dict | None = None) -> str:
    """Model identity + everything that shapes the stored bytes (entry format, dtypes, block size,
    window, layer ratios) + the engine settings that change what is computed into them
    (`computation`: an indexer ablation, a memory policy that hides entries from attention; left
    out where empty, so that the entries of engines at the defaults keep their identity). Records of
    another identity are foreign and never loaded."""
    cfg = store.config
    # version 2: packed indexer keys in the block layout (codes first in each block)
    desc = {"version": 2, "model": model_identity, "format": store.fmt, "dtype": str(store.dtype),
            "block_tokens": store.block_tokens, "window": cfg.sliding_window,
            "ratios": [cfg.layer_ratio(i) for i in range(store.num_layers)],
            "codecs": {k: [c.width, str(c.storage_dtype)] for k, c in store.codec.items()}}
    if computation:
        desc["computation"] = computation
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:32]


def block_record(store, block_id: int, key: bytes, tokens) -> Record:
    """A copy of one device block's entries of every layer (taken now: the block may be reused)."""
    store.sync_host()        # offload mode: CSA main entries written back to host memory
    tensors = {f"{layer}.{kind}": pool[block_id].clone()
               for layer, ents in enumerate(store.entries) for kind, pool in ents.items()}
    tensors["tokens"] = torch.tensor(list(tokens), dtype=torch.int32)
    return Record("block", key, tensors)


def _expect(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(like.shape) or t.dtype != like.dtype:
        raise CacheEntryError(f"{name}: stored {t.dtype}{list(t.shape)}, the store holds {like.dtype}{list(like.shape)}")


def check_block(store, rec: Record, tokens) -> None:
    """Raise CacheEntryError unless the record is this block (same tokens) in this store's layout."""
    names = {f"{layer}.{kind}": pool[0] for layer, ents in enumerate(store.entries) for kind, pool in ents.items()}
    if set(rec.tensors) != set(names) | {"tokens"}:
        raise CacheEntryError("block record has other tensors than this store's layers")
    for name, like in names.items():
        _expect(name, rec.tensors[name], like)
    tokens = list(tokens)
    stored = rec.tensors["tokens"]
    # checked before it is listed: a header may declare any shape for a tensor of equal elements
    if stored.dtype != torch.int32 or tuple(stored.shape) != (len(tokens),):
        raise CacheEntryError(f"block record's token ids are {stored.dtype}{list(stored.shape)}, "
                              f"not int32[{len(tokens)}]")
    if stored.tolist() != tokens:
        raise CacheEntryError("block record holds other token ids than the prefix it is stored under")


def load_block(store, block_id: int, rec: Record) -> None:
    for layer, ents in enumerate(store.entries):
        for kind, pool in ents.items():
            pool[block_id].copy_(rec.tensors[f"{layer}.{kind}"], non_blocking=True)


def state_record(key: bytes, snapshot) -> Record:
    return Record("state", key, {f"{layer}.{i}": t for layer, ts in enumerate(snapshot) for i, t in enumerate(ts)})


def snapshot_of(store, rec: Record):
    """The record as a device snapshot (per layer: window ring, then kv, score per compressor)."""
    out = []
    for layer in range(store.num_layers):
        likes = [store.ring[layer][0]] + [x[0] for pair in store.states[layer].values() for x in pair]
        ts = []
        for i, like in enumerate(likes):
            t = rec.tensors.get(f"{layer}.{i}")
            if t is None:
                raise CacheEntryError(f"state record lacks tensor {layer}.{i}")
            _expect(f"{layer}.{i}", t, like)
            ts.append(torch.empty_like(like).copy_(t, non_blocking=True))
        out.append(ts)
    if len(rec.tensors) != sum(len(ts) for ts in out):
        raise CacheEntryError("state record has tensors this store does not")
    return out


def to_host(rec: Record, pin: bool) -> Record:
    """The record with host tensors (pinned when the device is a GPU); tensors whose elements are
    all equal are kept as one element."""
    out = {}
    for name, t in rec.tensors.items():
        if t.device.type != "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t)
            t = host
        elif pin and not t.is_pinned():
            t = t.pin_memory()
        out[name] = compact(t)
    return Record(rec.kind, rec.key, out, rec.created)
