"""The disk tier: a directory of checksummed entry files that survives restarts.

Layout under the configured directory (several engines, of one model or not, may share it):

    hybridkv-kv-v2/NS/{block,state}/NN/NAME.kv   NS = sha256(identity)[:16], NAME = sha256(identity || chain hash)
    hybridkv-kv-v2/tmp/NAME.HOST.PID.RAND.tmp    writes in progress

Each identity (model and entry layout) has its own namespace: an engine indexes, expires and evicts
only its own model's entries, so that a run of another model, or with other lifetimes or another
size limit, never removes them. Engines of one identity share its namespace and its entries; each
applies its own size limit and lifetimes to them (give them the same), except that a kind an engine
does not keep (lifetime 0) it never expires.

Writes go to a temporary file that is renamed over the final name when complete, so a reader sees
a whole entry or none, and two engines writing the same (content-addressed) entry only replace
it with identical bytes. A process killed mid-write leaves a temporary file, which is never read
and is removed on the next start (its writer is dead) or after an hour. Every entry carries a
checksum and the identity of its model and entry layout; one that fails a check is removed, never
loaded.

The index (name -> size, last use) is rebuilt from the directory on start and rescanned every few
minutes (other engines add files). A file's mtime is its last use (set from `clock`), so LRU order
and lifetimes survive restarts. Past the size limit the least recently used entries go; an entry
unused for its kind's lifetime expires. A write that fails (full disk, unwritable directory)
pauses persistence for a while with a warning; requests go on. A directory removed while the engine
runs is made again by the next write.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from hybridkv.cache.tiers.base import Tier, log
from hybridkv.cache.tiers.record import KINDS, Record, decode
from hybridkv.errors import CacheEntryError

VERSION_DIR = "hybridkv-kv-v2"
FORMER_DIRS = ("hybridkv-kv-v1",)       # layouts this build neither reads nor cleans


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, ttl: dict[str, float], identity: str,
                 clock=time.time, fsync: bool = False, retry_after: float = 60.0, rescan_every: float = 300.0,
                 sweep_every: float = 30.0):
        super().__init__(ttl, clock)
        self._ns = hashlib.sha256(identity.encode()).digest()
        self.root = Path(root).expanduser() / VERSION_DIR
        self.dir = self.root / self._ns.hex()[:16]
        self.tmp = self.root / "tmp"
        self.identity, self.capacity, self.fsync = identity, capacity_bytes, fsync
        self.retry_after, self.rescan_every, self.sweep_every = retry_after, rescan_every, sweep_every
        self._host = socket.gethostname().replace(".", "_")
        self._index: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()
        self._retry_at = float("-inf")
        self._next_rescan = self._next_sweep = float("-inf")
        try:
            for sub in (*(self.dir / k for k in KINDS), self.tmp):
                sub.mkdir(parents=True, exist_ok=True)
            probe = self.tmp / f"probe.{self._host}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._write_failed(e, "cannot use the directory")
        for former in FORMER_DIRS:
            if (self.root.parent / former).is_dir():
                log.warning("disk KV tier %s: %s holds entries of an earlier layout, which this build neither "
                            "reads nor removes; delete it once no older engine uses it",
                            self.root.parent, former)
        self._maintain()

    # ----- names -----
    def _name(self, key: bytes) -> str:
        return hashlib.sha256(self._ns + key).hexdigest()

    def _path(self, kind: str, name: str) -> Path:
        return self.dir / kind / name[:2] / f"{name}.kv"

    # ----- index -----
    def _scan(self) -> None:
        """Rebuild the index from the directory (merging what this process knows) and remove
        temporary files whose writer is gone."""
        found = []
        for kind in KINDS:
            try:
                subs = [s.path for s in os.scandir(self.dir / kind) if s.is_dir()]
            except OSError:
                continue
            for sub in subs:
                try:
                    files = list(os.scandir(sub))
                except OSError:
                    continue
                for f in files:
                    if not f.name.endswith(".kv"):
                        continue
                    try:
                        st = f.stat()
                    except OSError:
                        continue
                    found.append((kind, f.name[:-3], st.st_size, st.st_mtime))
        with self.lock:
            known = self._index
            rows = [(max(m, known.get((k, n), (0, m))[1]), k, n, s) for k, n, s, m in found]
            rows.sort()
            self._index = OrderedDict(((k, n), (s, t)) for t, k, n, s in rows)
            self.stats.entries = len(self._index)
            self.stats.bytes = sum(s for s, _ in self._index.values())
        self._clean_tmp()

    def _clean_tmp(self) -> None:
        try:
            files = list(os.scandir(self.tmp))
        except OSError:
            return
        for f in files:
            parts = f.name.split(".")
            if not f.name.endswith(".tmp") or len(parts) < 5:
                continue
            host, pid = parts[-4], parts[-3]
            try:
                stale = ((host == self._host and pid.isdigit() and not _pid_alive(int(pid)))
                         or time.time() - f.stat().st_mtime > 3600)
                if stale:
                    os.unlink(f.path)
            except OSError:
                pass

    def _forget(self, k: tuple[str, str]) -> int:
        item = self._index.pop(k, None)
        if item is None:
            return 0
        self.stats.entries -= 1
        self.stats.bytes -= item[0]
        return item[0]

    def _note(self, k: tuple[str, str], size: int, last_use: float) -> None:
        with self.lock:
            self._forget(k)
            self._index[k] = (size, last_use)
            self.stats.entries += 1
            self.stats.bytes += size

    def _unlink_if_unused(self, k: tuple[str, str], since: float) -> bool:
        """Remove an entry unless another engine used it after `since` (then refresh the index)."""
        path = self._path(*k)
        try:
            st = os.stat(path)
            if st.st_mtime > since:
                self._note(k, st.st_size, st.st_mtime)
                return False
            os.unlink(path)
        except OSError:
            pass
        with self.lock:
            self._forget(k)
        return True

    def _maintain(self, force: bool = False) -> None:
        now = self.clock()
        if force or now >= self._next_rescan:
            self._next_rescan = now + self.rescan_every
            self._scan()
        if force or now >= self._next_sweep:
            self._next_sweep = now + self.sweep_every
            with self.lock:
                # a kind this engine does not keep is not its to expire (another engine of the model may)
                stale = [(k, t) for k, (_, t) in self._index.items()
                         if self.holds(k[0]) and now - t > self.ttl[k[0]]]
            for k, t in stale:
                if self._unlink_if_unused(k, t):
                    self.stats.expired += 1
        for _ in range(len(self._index) + 1):
            with self.lock:
                if self.stats.bytes <= self.capacity or not self._index:
                    break
                k, (size, t) = next(iter(self._index.items()))
            if self._unlink_if_unused(k, t):
                self.stats.evictions += 1
                self.stats.evicted_bytes += size

    def sweep(self) -> None:
        """Rescan, expire and evict now (otherwise done every few seconds of writes)."""
        self._maintain(force=True)

    # ----- the interface -----
    def contains(self, key: bytes, kind: str) -> bool:
        name = self._name(key)
        with self.lock:
            item = self._index.get((kind, name))
        if item is not None and not self.expired(kind, item[1]):
            return True
        try:
            st = os.stat(self._path(kind, name))
        except OSError:
            return False
        if self.expired(kind, st.st_mtime):
            return False
        self._note((kind, name), st.st_size, st.st_mtime)
        return True

    def get(self, key: bytes, kind: str) -> Record | None:
        name = self._name(key)
        k, path = (kind, name), self._path(kind, name)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size > self.capacity:      # not an entry this tier wrote: never read into memory
                    buf = None
                else:
                    buf = bytearray(st.st_size)
                    f.readinto(buf)
        except FileNotFoundError:
            with self.lock:
                self._forget(k)
                self.stats.misses += 1
            return None
        except OSError as e:
            self.stats.errors += 1
            self.stats.misses += 1
            self.warn_once("read", f"disk KV tier {self.dir}: cannot read {path.name} ({e}); treated as a miss")
            return None
        now = self.clock()
        with self.lock:
            last = max(st.st_mtime, self._index.get(k, (0, st.st_mtime))[1])
        if now - last > self.ttl.get(kind, 0):
            self._remove_file(path, st.st_ino, k)
            self.stats.expired += 1
            self.stats.misses += 1
            return None
        try:
            if buf is None:
                raise CacheEntryError(f"{st.st_size} bytes, more than the tier's capacity ({self.capacity})")
            rec = decode(buf, self.identity, kind, key)
        except CacheEntryError as e:
            self._remove_file(path, st.st_ino, k)
            self.stats.bad += 1
            self.stats.misses += 1
            log.warning("disk KV tier %s: removed %s: %s", self.dir, path.name, e)
            return None
        try:
            os.utime(path, (now, now))
        except OSError:
            pass
        self._note(k, st.st_size, now)
        self.stats.hits += 1
        self.stats.loaded_bytes += st.st_size
        return rec

    def _remove_file(self, path: Path, inode: int, k: tuple[str, str]) -> None:
        """Remove the file we read unless another engine has replaced it since."""
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass
        with self.lock:
            self._forget(k)

    def discard(self, key: bytes, kind: str) -> None:
        name = self._name(key)
        try:
            os.unlink(self._path(kind, name))
        except OSError:
            pass
        with self.lock:
            self._forget((kind, name))
        self.stats.bad += 1

    def put(self, record: Record) -> None:
        if not self.holds(record.kind):
            return
        now = self.clock()
        if now < self._retry_at:
            self.stats.dropped += 1
            return
        name = self._name(record.key)
        k, path = (record.kind, name), self._path(record.kind, name)
        # always (re)written, though content-addressed: a request recomputes a block only when no
        # usable copy was found, and the rename replaces a damaged file with a good one
        data = record.encode(self.identity)
        tmp = self.tmp / f"{name}.{self._host}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:       # the directory was removed under the running engine
                self.tmp.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.utime(tmp, (now, now))
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self.stats.errors += 1
            self.stats.dropped += 1
            self._write_failed(e, "cannot write")
            return
        self._note(k, len(data), now)
        self.stats.stored += 1
        self.stats.stored_bytes += len(data)
        self._maintain()

    def _write_failed(self, e: OSError, what: str) -> None:
        self._retry_at = self.clock() + self.retry_after
        why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else (e.strerror or str(e))
        self.warn_once(f"write:{e.errno}", f"disk KV tier {self.dir}: {what} ({why}); persistence is paused for "
                                          f"{self.retry_after:.0f} s at a time, requests go on without it")
