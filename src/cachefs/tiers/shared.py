"""The shared tier: blocks kept on memcached servers that every node of a cluster reads.

Lookup order is RAM, local NVMe, this tier, the source. What a node fetches from the
source is put here in the background (a bounded queue: the job's reads never wait for a
put, and a put that does not fit the queue is dropped and counted); what a node gets from
here is stored locally as any other fill.

Keys are the same on every node for the same version of a file: built from what every
NFS client sees alike (the path under the source root, the size, the mtime), the block
size and the index, and a namespace (`--shared-namespace`, by default the name of the
source directory), hashed: `cfs1:<xxh3-128 hex>:<index>`. Never inode numbers or device ids.

Every item carries its own header: a magic, the identity hash it was stored under, the
length, the number of parts and an xxh3-64 of the bytes, verified on every get. A
mismatch is a miss and a counter (`shared.checksum_failures`), never bytes for a reader.

A block bigger than what one memcached item may hold (`item_size_max`, read from each
server at mount) is split into parts, all on the server its key hashes to (rendezvous
hashing over the server list). A server that does not answer within `timeout` is marked
down for `down_for` seconds (one warning); its keys go to the source meanwhile, then the
next request is the probe that brings it back ("answering again"). A read never fails
because of this tier.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import xxhash

from cachefs.blocks import block_extent
from cachefs.config import DEFAULT_DOWN_FOR, DEFAULT_PENDING_BYTES, DEFAULT_TIMEOUT
from cachefs.identity import BlockKey, EntryInfo, FileId
from cachefs.stats import Stats

log = logging.getLogger(__name__)

KEY_PREFIX = b"cfs1:"
_MAGIC = b"CFS1"
# magic, identity (16), length, parts, xxh3-64 of the data
_HEADER = struct.Struct("<4s16sIHQ")
ITEM_OVERHEAD = 256  # bytes memcached needs besides the value in an item (key, flags, CAS)
DEFAULT_ITEM_MAX = 1 << 20


class Client(Protocol):
    """What the tier needs of a memcached client (pymemcache's, or a test's)."""

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes]: ...

    def set_many(self, values: dict[bytes, bytes], expire: int = 0, noreply: bool | None = None) -> list: ...

    def stats(self, *args: str) -> dict: ...

    def close(self) -> None: ...


def block_identity(namespace: str, block_size: int, fid: FileId, index: int) -> bytes:
    """16 bytes naming a block of a file version, alike on every node: the path under the
    source root, the size and the mtime (what every NFS client sees alike), never inode
    numbers or device ids."""
    text = "\0".join((namespace, fid.path, str(fid.size), str(fid.mtime_ns), str(block_size), str(index)))
    return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogateescape"))


def item_key(namespace: str, block_size: int, fid: FileId, index: int) -> bytes:
    """The memcached key of a block: `cfs1:<identity hex>:<index>`."""
    return KEY_PREFIX + block_identity(namespace, block_size, fid, index).hex().encode() + b":" + str(index).encode()


def pymemcache_client(address: tuple[str, int], timeout: float) -> Client:
    from pymemcache.client.base import PooledClient

    return PooledClient(address, connect_timeout=timeout, timeout=timeout, no_delay=True, max_pool_size=32)


class _Server:
    __slots__ = ("address", "client", "down_until", "hits", "item_max", "misses", "name", "warned")

    def __init__(self, address: tuple[str, int], client: Client):
        self.address = address
        self.name = f"{address[0]}:{address[1]}"
        self.client = client
        self.down_until = 0.0
        self.item_max = DEFAULT_ITEM_MAX
        self.hits = 0
        self.misses = 0
        self.warned = False


class SharedTier:
    """A tier on memcached servers, shared by the nodes of a cluster (see the module)."""

    name = "shared"

    def __init__(self, servers: list[tuple[str, int]], namespace: str, block_size: int, stats: Stats,
                 timeout: float = DEFAULT_TIMEOUT, down_for: float = DEFAULT_DOWN_FOR,
                 connect: Callable[[tuple[str, int], float], Client] = pymemcache_client,
                 pending_bytes: int = DEFAULT_PENDING_BYTES, clock: Callable[[], float] = time.monotonic):
        if not servers:
            raise ValueError("no servers")
        self.namespace = namespace
        self.block_size = block_size
        self.stats = stats
        self.timeout = timeout
        self.down_for = down_for
        self._clock = clock
        self._servers = [_Server(a, connect(a, timeout)) for a in servers]
        self._mine = threading.local()  # this thread's hits and misses, by server (see server_counts)
        self._weights = [xxhash.xxh64_intdigest(s.name.encode()) for s in self._servers]
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # the put queue has room again
        self._queue: queue.SimpleQueue[tuple[FileId, int, bytes | Callable[[], bytes | None], int] | None] = \
            queue.SimpleQueue()
        self._pending = 0
        self._pending_max = pending_bytes
        self._closed = False
        self._putter = threading.Thread(target=self._put_loop, name="cachefs-shared-put", daemon=True)
        self._putter.start()
        stats.gauge("shared.servers_down", self.servers_down)
        stats.gauge("shared.pending_bytes", lambda: self._pending)
        stats.gauge("shared.servers", self.servers)

    # -- at mount --------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Ask every server for its item size limit; return one line per server that did
        not answer (marked down, tried again later). Blocks are split to fit each limit."""
        problems = []
        for s in self._servers:
            try:
                settings = s.client.stats("settings")
                s.item_max = int(settings.get(b"item_size_max", settings.get("item_size_max", DEFAULT_ITEM_MAX)))
            except Exception as exc:
                self._failed(s, exc)
                problems.append(f"shared cache server {s.name} does not answer ({exc}); its blocks come from "
                                "the source until it does")
        return problems

    # -- keys and items --------------------------------------------------------------------

    def identity(self, fid: FileId, index: int) -> bytes:
        return block_identity(self.namespace, self.block_size, fid, index)

    def key(self, fid: FileId, index: int) -> bytes:
        return item_key(self.namespace, self.block_size, fid, index)

    def server_for(self, key: bytes) -> _Server:
        """Rendezvous hashing: the server whose hash with the key is highest. Adding or
        removing a server moves only the keys that were (or become) its own."""
        h = xxhash.xxh64_intdigest(key)
        best = max(range(len(self._servers)), key=lambda i: xxhash.xxh64_intdigest(h.to_bytes(8, "little"),
                                                                                     seed=self._weights[i]))
        return self._servers[best]

    def _parts(self, ident: bytes, data: bytes, item_max: int) -> list[bytes]:
        room = max(4096, item_max - ITEM_OVERHEAD)
        first = room - _HEADER.size
        rest = data[first:]
        n = 1 + (len(rest) + room - 1) // room
        header = _HEADER.pack(_MAGIC, ident, len(data), n, xxhash.xxh3_64_intdigest(data))
        return [header + data[:first]] + [rest[i:i + room] for i in range(0, len(rest), room)]

    # -- get -------------------------------------------------------------------------------

    def get(self, key: BlockKey, lo: int = 0, hi: int | None = None, info: EntryInfo | None = None) -> bytes | None:
        """The tier protocol's get: block `key` of the file version `info` describes (the
        shared tier names blocks by path and version, alike on every node, not by the
        node's entry id), bytes [lo:hi]; None for a miss."""
        assert info is not None
        fid, index = info.fid, key[1]
        data = self.get_block(fid, index, block_extent(index, fid.size, self.block_size)[1])
        return data if data is None or (lo, hi) == (0, None) else data[lo:hi]

    def get_block(self, fid: FileId, index: int, length: int) -> bytes | None:
        """The block, verified, or None (a miss: not there, damaged, or the server down)."""
        return self.get_many([(fid, index, length)])[0]

    def _assemble(self, server: _Server, key: bytes, first: bytes, ident: bytes, length: int) -> bytes | None:
        if len(first) < _HEADER.size:
            self.stats.incr("shared.checksum_failures")
            return None
        magic, stored_ident, size, n, digest = _HEADER.unpack_from(first)
        if magic != _MAGIC or stored_ident != ident or size != length or n < 1:
            self.stats.incr("shared.checksum_failures")
            return None
        chunks = [first[_HEADER.size:]]
        if n > 1:
            keys = [key + b"/" + str(i).encode() for i in range(1, n)]
            got = server.client.get_many(keys)
            if len(got) != len(keys):
                return None  # a part was evicted: a plain miss
            chunks += [got[k] for k in keys]
        data = b"".join(chunks)
        if len(data) != size or xxhash.xxh3_64_intdigest(data) != digest:
            self.stats.incr("shared.checksum_failures")
            return None
        return data

    def get_many(self, blocks: list[tuple[FileId, int, int]]) -> list[bytes | None]:
        """Several blocks ((fid, index, length) each), verified, in one request per server:
        a directory of small files costs a round trip, not one per file."""
        out: list[bytes | None] = [None] * len(blocks)
        by_server: dict[int, list[int]] = {}
        keys = [self.key(fid, index) for fid, index, _ in blocks]
        for i, key in enumerate(keys):
            by_server.setdefault(id(self.server_for(key)), []).append(i)
        for indexes in by_server.values():
            server = self.server_for(keys[indexes[0]])
            if not self._usable(server):
                self.stats.incr("shared.misses", len(indexes))
                continue
            try:
                found = server.client.get_many([keys[i] for i in indexes])
                for i in indexes:
                    first = found.get(keys[i])
                    if first is not None:
                        fid, index, length = blocks[i]
                        out[i] = self._assemble(server, keys[i], first, self.identity(fid, index), length)
            except Exception as exc:
                self._failed(server, exc)
                self.stats.add_many({"shared.errors": 1, "shared.misses": len(indexes)})
                continue
            self._answered(server)
            hits = [out[i] for i in indexes if out[i] is not None]
            server.hits += len(hits)
            server.misses += len(indexes) - len(hits)
            tally = self._tally().setdefault(server.name, [0, 0])
            tally[0] += len(hits)
            tally[1] += len(indexes) - len(hits)
            self.stats.add_many({"shared.hits": len(hits), "shared.misses": len(indexes) - len(hits),
                                 "shared.bytes": sum(len(x) for x in hits if x is not None)})
        return out

    def store_many(self, blocks: list[tuple[FileId, int, bytes]]) -> int:
        """Store several blocks now, one request per server; returns how many were stored."""
        by_server: dict[int, tuple[_Server, dict[bytes, bytes], list[int]]] = {}
        for fid, index, data in blocks:
            key = self.key(fid, index)
            server = self.server_for(key)
            entry = by_server.setdefault(id(server), (server, {}, []))
            parts = self._parts(self.identity(fid, index), data, server.item_max)
            entry[1][key] = parts[0]
            entry[1].update({key + b"/" + str(i).encode(): part for i, part in enumerate(parts[1:], 1)})
            entry[2].append(len(data))
        stored = 0
        for server, values, sizes in by_server.values():
            if not self._usable(server):
                continue
            try:
                failed = server.client.set_many(values, noreply=False)
            except Exception as exc:
                self._failed(server, exc)
                self.stats.incr("shared.errors")
                continue
            self._answered(server)
            if failed:
                self.stats.incr("shared.errors")
                continue
            stored += len(sizes)
            self.stats.add_many({"shared.puts": len(sizes), "shared.put_bytes": sum(sizes)})
        return stored

    # -- put -------------------------------------------------------------------------------

    def put(self, key: BlockKey, data: bytes | Callable[[], bytes | None], info: EntryInfo, evict: bool = True,
            wait: float = 0.0) -> bool:
        """The tier protocol's put: queue block `key` of the file version `info` describes
        (see put_block; a shared tier evicts as memcached does, whatever `evict`)."""
        fid, index = info.fid, key[1]
        return self.put_block(fid, index, data, block_extent(index, fid.size, self.block_size)[1], wait)

    def put_block(self, fid: FileId, index: int, data: bytes | Callable[[], bytes | None], size: int,
                  wait: float = 0.0) -> bool:
        """Queue a block for the shared tier (or a callable that reads it when its turn
        comes). If the queue is full, wait up to `wait` seconds for room (read-ahead and
        warming may: they are background work), then give up: False, counted. The job's
        own reads pass no wait: they never wait on the cluster."""
        with self._room:
            if wait > 0:
                self._room.wait_for(lambda: self._closed or self._pending + size <= self._pending_max, wait)
            if self._closed or self._pending + size > self._pending_max:
                self.stats.incr("shared.put_dropped")
                return False
            self._pending += size
        self._queue.put((fid, index, data, size))
        return True

    def _put_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fid, index, data, size = item
            try:
                value = data() if callable(data) else data
                if value is not None:
                    self.store_many([(fid, index, value)])
            except Exception as exc:  # a failed put is only a lost chance to share
                log.debug("shared put of %s block %d failed: %s", fid.path, index, exc)
            finally:
                with self._room:
                    self._pending -= size
                    self._room.notify_all()

    # -- servers up and down ---------------------------------------------------------------

    def _usable(self, server: _Server) -> bool:
        """Up, or down long enough that this request may be the probe."""
        if not server.down_until:
            return True
        now = self._clock()
        with self._lock:
            if now < server.down_until:
                return False
            server.down_until = now + self.down_for  # one probe at a time
            return True

    def _failed(self, server: _Server, exc: BaseException) -> None:
        with self._lock:
            was_up = not server.down_until
            server.down_until = self._clock() + self.down_for
        if was_up:
            self.stats.incr("shared.down_events")
            log.warning("shared cache server %s does not answer (%s); its blocks come from the source, "
                        "trying it again every %gs", server.name, exc, self.down_for)

    def _answered(self, server: _Server) -> None:
        if server.down_until:
            with self._lock:
                server.down_until = 0.0
            log.warning("shared cache server %s answering again", server.name)

    def servers_down(self) -> int:
        return sum(1 for s in self._servers if s.down_until)

    def server_counts(self, this_thread: bool = False) -> dict[str, tuple[int, int]]:
        """Hits and misses so far, by server; `this_thread`: this thread's (a fetch process
        reports what one batch added, while its other threads answer other batches)."""
        if this_thread:
            return {name: (hits, misses) for name, (hits, misses) in self._tally().items()}
        return {s.name: (s.hits, s.misses) for s in self._servers}

    def _tally(self) -> dict[str, list[int]]:
        tally = getattr(self._mine, "tally", None)
        if tally is None:
            tally = self._mine.tally = {}
        return tally

    def add_server_counts(self, counts: dict[str, tuple[int, int]]) -> None:
        """Add what a fetch process counted per server: `cachefs stats` shows the node's."""
        for s in self._servers:
            hits, misses = counts.get(s.name, (0, 0))
            s.hits += hits
            s.misses += misses

    def servers(self) -> list[dict[str, Any]]:
        """One line per server for `cachefs stats`: up or down, and its share of the hits."""
        total = sum(s.hits for s in self._servers) or 1
        return [{"server": s.name, "up": not s.down_until, "hits": s.hits, "misses": s.misses,
                 "hit_share": round(s.hits / total, 4), "item_size_max": s.item_max} for s in self._servers]

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until the queued puts are done (warming, tests)."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending

    def close(self) -> None:
        with self._room:
            self._closed = True
            self._room.notify_all()
        self._queue.put(None)
        self._putter.join(timeout=5)
        for s in self._servers:
            try:
                s.client.close()
            except Exception:
                pass
