"""One item of the lower cache tiers and its byte format (the same on disk and in Redis).

A `Record` is what the prefix cache persists under a prefix chain hash (the key):
- kind "block" (long-lived): one logical block's compressed entries of every layer, named
  "{layer}.kv" and "{layer}.index", in the device store's entry format (native, bf16 or packed
  fp8/fp4 bytes), plus the block's token ids ("tokens", int32) so that a hit is confirmed by tokens;
- kind "state" (short-lived): the window ring and compressor state of every layer at the boundary
  where that block ends, named "{layer}.{i}" in the order `PagedKVStore.capture_state` gives them.

Byte format, version 1:

    b"HKVCACH1" | sha256 (32 B) of what follows | u32 header length | header (JSON) | tensor bytes

The header holds the kind, the key (hex), the identity (model and entry layout, see
`tiers.convert.layout_identity`), the creation time, and per tensor its name, dtype, shape and
offset into the tensor bytes — or a fill value for a tensor whose elements are all equal (the
compressor state at a block boundary is mostly empty, so it costs nothing to keep). `decode`
checks the digest, then every header field, before it builds a tensor; anything wrong raises
`CacheEntryError`, so a truncated, corrupted or foreign entry is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field

import torch

from hybridkv.errors import CacheEntryError

MAGIC = b"HKVCACH1"
KINDS = ("block", "state")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
           "int32": torch.int32}
_NAMES = {v: k for k, v in _DTYPES.items()}
_HEAD = len(MAGIC) + 32 + 4


@dataclass
class Record:
    kind: str                                  # "block" | "state"
    key: bytes                                 # the prefix chain hash of the block (ending there)
    tensors: dict[str, torch.Tensor]
    created: float = 0.0
    # a CUDA event the tensors' copies were recorded before (host tensors filled asynchronously): the
    # writer waits on it before it reads them
    ready: object | None = field(default=None, repr=False, compare=False)
    _encoded: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes the tensors hold (a fill tensor counts one element)."""
        return sum(t.untyped_storage().nbytes() if t.stride() and min(t.stride()) == 0 else t.nbytes
                   for t in self.tensors.values())

    def encode(self, identity: str) -> bytes:
        """The byte form (computed once and kept: disk and Redis store the same bytes)."""
        if self._encoded is None:
            self._encoded = encode(self, identity)
        return self._encoded


def is_fill(t: torch.Tensor) -> bool:
    return t.numel() > 1 and all(s == 0 for s in t.stride())


def compact(t: torch.Tensor) -> torch.Tensor:
    """A host tensor whose elements are all equal becomes one element expanded to its shape."""
    if t.numel() <= 1 or is_fill(t):
        return t
    first = t.reshape(-1)[:1]
    if bool((t == first).all()):
        return first.clone().reshape([1] * t.dim()).expand(t.shape)
    return t


def encode(rec: Record, identity: str) -> bytes:
    if rec.kind not in KINDS:
        raise ValueError(f"unknown record kind {rec.kind!r}")
    metas, chunks, offset = [], [], 0
    for name, t in rec.tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name} has dtype {t.dtype}, which the cache format does not store")
        meta = {"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape)}
        if is_fill(t):
            meta["fill"] = t.reshape(-1)[0].item()
        else:
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            meta["offset"], meta["nbytes"] = offset, raw.nbytes
            chunks.append(memoryview(raw))
            offset += raw.nbytes
        metas.append(meta)
    header = json.dumps({"version": 1, "kind": rec.kind, "key": rec.key.hex(), "identity": identity,
                         "created": rec.created, "payload": offset, "tensors": metas}).encode()
    body = b"".join([struct.pack("<I", len(header)), header, *chunks])
    return MAGIC + hashlib.sha256(body).digest() + body


def decode(buf: bytes | bytearray | memoryview, identity: str, kind: str, key: bytes) -> Record:
    """The record in `buf`, which must be a complete, intact entry of this identity, kind and key."""
    view = memoryview(buf)
    if len(view) < _HEAD or bytes(view[:len(MAGIC)]) != MAGIC:
        raise CacheEntryError("not a hybridkv cache entry (bad magic or truncated header)")
    digest = bytes(view[len(MAGIC):len(MAGIC) + 32])
    if hashlib.sha256(view[len(MAGIC) + 32:]).digest() != digest:
        raise CacheEntryError("checksum mismatch (the entry is truncated or corrupted)")
    (hlen,) = struct.unpack_from("<I", view, len(MAGIC) + 32)
    if _HEAD + hlen > len(view):
        raise CacheEntryError("header runs past the end of the entry")
    try:
        head = json.loads(bytes(view[_HEAD:_HEAD + hlen]))
    except (ValueError, RecursionError) as e:
        raise CacheEntryError(f"unreadable header: {e}") from None
    if not isinstance(head, dict):
        raise CacheEntryError(f"the header is a JSON {type(head).__name__}, not an object")
    try:
        return _decode_body(buf, view, head, hlen, identity, kind, key)
    except CacheEntryError:
        raise
    except Exception as e:  # noqa: BLE001 - an entry whose digest holds but whose header lies is corrupt
        raise CacheEntryError(f"malformed header: {type(e).__name__}: {e}") from None


def _decode_body(buf, view: memoryview, head: dict, hlen: int, identity: str, kind: str, key: bytes) -> Record:
    if head.get("version") != 1:
        raise CacheEntryError(f"entry format version {head.get('version')!r}, this build reads 1")
    if head.get("identity") != identity:
        raise CacheEntryError("entry written for another model or entry layout (identity mismatch)")
    if head.get("kind") != kind or head.get("key") != key.hex():
        raise CacheEntryError("entry stored under the wrong key or kind")
    base = _HEAD + hlen
    if base + int(head.get("payload", -1)) != len(view):
        raise CacheEntryError("payload length does not match the header")
    tensors: dict[str, torch.Tensor] = {}
    storage = buf if isinstance(buf, bytearray) else bytearray(view)
    try:
        for m in head["tensors"]:
            dtype, shape = _DTYPES[m["dtype"]], [int(s) for s in m["shape"]]
            if "fill" in m:
                one = torch.tensor([m["fill"]], dtype=torch.float64).to(dtype)
                tensors[m["name"]] = one.reshape([1] * len(shape)).expand(shape)
                continue
            off, n = int(m["offset"]), int(m["nbytes"])
            numel = 1
            for s in shape:
                numel *= s
            if off < 0 or base + off + n > len(view) or n != numel * torch.empty(0, dtype=dtype).element_size():
                raise CacheEntryError(f"tensor {m['name']} does not fit its declared bytes")
            raw = torch.frombuffer(storage, dtype=torch.uint8, count=n, offset=base + off) if n else \
                torch.empty(0, dtype=torch.uint8)
            tensors[m["name"]] = raw.view(dtype).reshape(shape)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, OverflowError) as e:
        raise CacheEntryError(f"malformed tensor table: {e}") from None
    return Record(kind, key, tensors, float(head.get("created", 0.0)))
