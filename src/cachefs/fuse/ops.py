"""What a file system is to a FUSE session: the `Operations` it implements, and the
values it hands back (`Entry`, `Opened`, `DirItem`, `StatFs`, `FuseError`). The session
(cachefs/fuse/session.py) turns requests into these calls and the values into replies.
"""

from __future__ import annotations

import bisect
import errno
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from cachefs.fuse import protocol as p

if TYPE_CHECKING:
    from cachefs.fuse.session import Session

Buffer = bytes | bytearray | memoryview


class FuseError(Exception):
    """Raised by an operation to reply with an errno (positive, as in errno.ENOENT)."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(code, message or os.strerror(code))
        self.errno = code


class Request(NamedTuple):
    """Who is asking: the caller's ids, from the request header."""

    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int


class Entry(NamedTuple):
    """A lookup's answer: the node id the kernel will use, its attributes, and how long the
    kernel may keep the name (entry_timeout) and the attributes (attr_timeout)."""

    nodeid: int
    attr: p.Attr
    entry_timeout: float
    attr_timeout: float
    generation: int = 0


class Opened(NamedTuple):
    """An open's answer: the handle, FOPEN_* flags, and a backing id with FOPEN_PASSTHROUGH."""

    fh: int = 0
    flags: int = 0
    backing_id: int = 0


class DirItem(NamedTuple):
    name: bytes
    mode: int  # S_IFMT bits are what readdir reports as d_type
    ino: int = 0


class StatFs(NamedTuple):
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    bsize: int
    namelen: int
    frsize: int


@dataclass
class Connection:
    """What the INIT negotiation settled; the Operations see it in init()."""

    minor: int = 0
    kernel_flags: int = 0
    flags: int = 0
    max_readahead: int = 0
    max_read: int = 1 << 20
    passthrough: bool = False      # the kernel grants FUSE_PASSTHROUGH on this connection
    no_open: bool = False          # the kernel supports zero-message opens


class Operations:
    """A file system. Every method may raise FuseError (or OSError) to reply with an errno.
    What is not overridden answers ENOSYS, and everything that would write answers EROFS
    (the session does that before any method is called)."""

    # What the file system asks for at INIT; the kernel grants the subset it supports.
    want_passthrough = False
    want_no_open = False
    want_readdirplus = True

    def init(self, conn: Connection, session: Session) -> None:
        pass

    def destroy(self) -> None:
        pass

    def lookup(self, req: Request, parent: int, name: bytes) -> Entry | bytes:
        """The entry (or, for speed, the packed fuse_entry_out: protocol.pack_entry_of)."""
        raise FuseError(errno.ENOSYS)

    def lookup_known(self, req: Request, parent: int, name: bytes) -> Entry | bytes | None:
        """A lookup for a READDIRPLUS entry, answered only if it costs no wait (None: the
        entry goes without attributes, and the kernel looks it up when it needs it)."""
        return self.lookup(req, parent, name)

    def readdirplus_entries(self, req: Request, nodeid: int) -> bool:
        """Whether this READDIRPLUS's entries are worth a lookup_known each; False: names
        and types only (what a walk that stats nothing needs)."""
        return True

    def forget(self, nodeid: int, nlookup: int) -> None:
        pass

    def served(self, report: memoryview) -> None:
        """What the serving processes answered since their last report (cachefs/fuse/serve.py:
        decode_report)."""

    def getattr(self, req: Request, nodeid: int, fh: int | None) -> tuple[p.Attr, float]:
        raise FuseError(errno.ENOSYS)

    def readlink(self, req: Request, nodeid: int) -> bytes:
        raise FuseError(errno.ENOSYS)

    def open(self, req: Request, nodeid: int, flags: int) -> Opened:
        raise FuseError(errno.ENOSYS)

    def read(self, req: Request, nodeid: int, fh: int, offset: int, size: int) -> Buffer | Sequence[Buffer]:
        raise FuseError(errno.ENOSYS)

    def release(self, req: Request, nodeid: int, fh: int) -> None:
        pass

    def flush(self, req: Request, nodeid: int, fh: int) -> None:
        raise FuseError(errno.ENOSYS)  # the kernel then stops sending FLUSH altogether

    def opendir(self, req: Request, nodeid: int, flags: int) -> Opened:
        return Opened()

    def readdir(self, req: Request, nodeid: int, fh: int) -> Sequence[tuple[bytes, int, int]]:
        """The directory's entries ("." and ".." included), the same list for one handle:
        the session hands them out in pieces by offset. Plain (name, mode, ino) tuples do
        too: a listing of 200,000 names makes 200,000 of them."""
        raise FuseError(errno.ENOSYS)

    def releasedir(self, req: Request, nodeid: int, fh: int) -> None:
        pass

    def statfs(self, req: Request, nodeid: int) -> StatFs:
        return StatFs(0, 0, 0, 0, 0, 4096, 255, 4096)

    def getxattr(self, req: Request, nodeid: int, name: bytes) -> bytes:
        raise FuseError(errno.ENODATA)

    def listxattr(self, req: Request, nodeid: int) -> Iterable[bytes]:
        return ()

    def access(self, req: Request, nodeid: int, mask: int) -> None:
        pass


_NO_ENTRY = bytes(p.ENTRY_OUT.size + p.ATTR.size)  # node id 0: a name without attributes


class DirHandle:
    __slots__ = ("ends", "fh", "items", "records")

    def __init__(self, fh: int):
        self.fh = fh
        self.items: Sequence[tuple[bytes, int, int]] | None = None
        self.records = b""  # the items as READDIR records, packed at the first READDIR
        self.ends: list[int] | None = None  # where each record ends in `records`


class Handlers:
    """How each request becomes a call on `Operations` and its reply parts: the session's
    half that a new opcode changes (with its structs in protocol.py and its answer in the
    file system). Mixed into Session, whose state it uses."""

    ops: Operations
    max_read: int
    conn: Connection
    destroyed: bool
    _dirs: dict[int, DirHandle]
    _dirs_lock: threading.Lock
    _next_dir_fh: int
    _stopped: threading.Event

    def handler_table(self) -> dict[int, Callable[[Request, memoryview], list[Buffer] | None]]:
        """Opcode -> the handler that decodes it, calls the file system and packs the reply."""
        return {
            p.LOOKUP: self._lookup, p.FORGET: self._forget, p.BATCH_FORGET: self._batch_forget,
            p.GETATTR: self._getattr, p.READLINK: self._readlink, p.OPEN: self._open, p.READ: self._read,
            p.RELEASE: self._release, p.FLUSH: self._flush, p.OPENDIR: self._opendir,
            p.READDIR: self._readdir, p.READDIRPLUS: self._readdirplus, p.RELEASEDIR: self._releasedir,
            p.STATFS: self._statfs, p.GETXATTR: self._getxattr, p.LISTXATTR: self._listxattr,
            p.ACCESS: self._access, p.INTERRUPT: self._interrupt, p.DESTROY: self._destroy,
            p.FSYNC: self._ok, p.FSYNCDIR: self._ok,
        }

    # -- request handlers: parse, call the file system, pack the reply ---------------------

    def _lookup(self, req: Request, payload: memoryview) -> list[Buffer]:
        name = p.cstring(payload)
        e = self.ops.lookup(req, req.nodeid, name)
        if isinstance(e, bytes):  # packed already (pack_entry_of)
            return [e]
        return [p.pack_entry(e.nodeid, e.attr, e.entry_timeout, e.attr_timeout, e.generation)]

    def _forget(self, req: Request, payload: memoryview) -> None:
        if len(payload) >= p.FORGET_IN.size:
            self.ops.forget(req.nodeid, p.FORGET_IN.unpack_from(payload)[0])

    def _batch_forget(self, req: Request, payload: memoryview) -> None:
        if len(payload) < p.BATCH_FORGET_IN.size:
            return
        count = p.BATCH_FORGET_IN.unpack_from(payload)[0]
        count = min(count, (len(payload) - p.BATCH_FORGET_IN.size) // p.FORGET_ONE.size)
        for i in range(count):
            nodeid, nlookup = p.FORGET_ONE.unpack_from(payload, p.BATCH_FORGET_IN.size + i * p.FORGET_ONE.size)
            self.ops.forget(nodeid, nlookup)

    def _getattr(self, req: Request, payload: memoryview) -> list[Buffer]:
        fh = None
        if len(payload) >= p.GETATTR_IN.size:
            flags, _, handle = p.GETATTR_IN.unpack_from(payload)
            fh = handle if flags & 1 else None
        attr, timeout = self.ops.getattr(req, req.nodeid, fh)
        return [p.pack_attr_out(attr, timeout)]

    def _readlink(self, req: Request, payload: memoryview) -> list[Buffer]:
        return [self.ops.readlink(req, req.nodeid)]

    def _open(self, req: Request, payload: memoryview) -> list[Buffer]:
        flags = p.OPEN_IN.unpack_from(payload)[0]
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT):
            raise FuseError(errno.EROFS)
        o = self.ops.open(req, req.nodeid, flags)
        return [p.OPEN_OUT.pack(o.fh, o.flags, o.backing_id)]

    def _read(self, req: Request, payload: memoryview) -> list[Buffer]:
        fh, offset, size, *_ = p.READ_IN.unpack_from(payload)
        data = self.ops.read(req, req.nodeid, fh, offset, min(size, self.max_read))
        if isinstance(data, (bytes, bytearray, memoryview)):
            return [data]
        return list(data)

    def _release(self, req: Request, payload: memoryview) -> list[Buffer]:
        fh = p.RELEASE_IN.unpack_from(payload)[0]
        self.ops.release(req, req.nodeid, fh)
        return []

    def _flush(self, req: Request, payload: memoryview) -> list[Buffer]:
        fh = p.FORGET_IN.unpack_from(payload)[0]  # fuse_flush_in starts with the handle
        self.ops.flush(req, req.nodeid, fh)
        return []

    def _ok(self, req: Request, payload: memoryview) -> list[Buffer]:
        return []

    def _opendir(self, req: Request, payload: memoryview) -> list[Buffer]:
        flags = p.OPEN_IN.unpack_from(payload)[0]
        o = self.ops.opendir(req, req.nodeid, flags)
        with self._dirs_lock:
            fh = self._next_dir_fh
            self._next_dir_fh += 1
            self._dirs[fh] = DirHandle(o.fh)
        return [p.OPEN_OUT.pack(fh, o.flags, 0)]

    def _dir_handle(self, req: Request, fh: int, offset: int) -> DirHandle:
        """A directory handle with its listing: taken when it is read from the start, and
        the same for every later piece (offsets index into it)."""
        with self._dirs_lock:
            handle = self._dirs.get(fh)
        if handle is None:
            raise FuseError(errno.EBADF)
        if handle.items is None or offset == 0:
            handle.items = self.ops.readdir(req, req.nodeid, handle.fh)
            handle.ends = None
        return handle

    def _readdir(self, req: Request, payload: memoryview) -> list[Buffer]:
        """The records from `offset` on that fit in `size` bytes: a slice of the listing's
        records, packed once (a listing of 200 entries is one READDIR, its records packed
        in one pass, not a reply part each)."""
        fh, offset, size, *_ = p.READ_IN.unpack_from(payload)
        handle = self._dir_handle(req, fh, offset)
        ends = handle.ends
        if ends is None:
            assert handle.items is not None
            handle.records, ends = p.pack_dirents(handle.items)
            handle.ends = ends
        if offset >= len(ends):
            return []
        start = ends[offset - 1] if offset else 0
        stop = bisect.bisect_right(ends, start + size, lo=offset)  # the records that fit
        return [memoryview(handle.records)[start:ends[stop - 1]]] if stop > offset else []

    def _readdirplus(self, req: Request, payload: memoryview) -> list[Buffer]:
        """The records from `offset` on that fit in `size` bytes, each with the entry of a
        lookup the file system answers without waiting (lookup_known), or none: the kernel
        then takes the name and type, and looks the entry up when someone needs it. One
        reply part for all of them."""
        fh, offset, size, *_ = p.READ_IN.unpack_from(payload)
        items = self._dir_handle(req, fh, offset).items
        assert items is not None
        out: list[bytes] = []
        used = 0
        lookup_known = self.ops.lookup_known if self.ops.readdirplus_entries(req, req.nodeid) else None
        nodeid = req.nodeid
        for i in range(offset, len(items)):
            name, mode, ino = items[i]
            used += p.dirent_size(name, True)
            if used > size:  # sized before the lookup it counts
                break
            entry = _NO_ENTRY
            if lookup_known is not None and name != b"." and name != b"..":
                try:  # counts as a lookup: the kernel will FORGET it
                    e = lookup_known(req, nodeid, name)
                    if e is None:
                        pass
                    elif isinstance(e, bytes):
                        entry = e
                        ino = p.ATTR.unpack_from(e, p.ENTRY_OUT.size)[0]
                    else:
                        entry = p.pack_entry(e.nodeid, e.attr, e.entry_timeout, e.attr_timeout, e.generation)
                        ino = e.attr.ino
                except (FuseError, OSError):
                    pass
            out.append(p.pack_direntplus(entry, ino or 0xFFFFFFFF, i + 1, name, mode))
        return [b"".join(out)] if out else []

    def _releasedir(self, req: Request, payload: memoryview) -> list[Buffer]:
        fh = p.RELEASE_IN.unpack_from(payload)[0]
        with self._dirs_lock:
            found = self._dirs.pop(fh, None)
        if found is not None:
            self.ops.releasedir(req, req.nodeid, found.fh)
        return []

    def _statfs(self, req: Request, payload: memoryview) -> list[Buffer]:
        s = self.ops.statfs(req, req.nodeid)
        return [p.STATFS_OUT.pack(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize, 0)]

    def _xattr_reply(self, value: bytes, size: int) -> list[Buffer]:
        if size == 0:
            return [p.GETXATTR_OUT.pack(len(value), 0)]
        if len(value) > size:
            raise FuseError(errno.ERANGE)
        return [value]

    def _getxattr(self, req: Request, payload: memoryview) -> list[Buffer]:
        size = p.GETXATTR_IN.unpack_from(payload)[0]
        name = p.cstring(payload, p.GETXATTR_IN.size)
        return self._xattr_reply(self.ops.getxattr(req, req.nodeid, name), size)

    def _listxattr(self, req: Request, payload: memoryview) -> list[Buffer]:
        size = p.GETXATTR_IN.unpack_from(payload)[0]
        names = b"".join(n + b"\0" for n in self.ops.listxattr(req, req.nodeid))
        return self._xattr_reply(names, size)

    def _access(self, req: Request, payload: memoryview) -> list[Buffer]:
        mask = p.ACCESS_IN.unpack_from(payload)[0]
        self.ops.access(req, req.nodeid, mask)
        return []

    def _interrupt(self, req: Request, payload: memoryview) -> None:
        # A request the caller gave up on: its reply, when it comes, is dropped by the
        # kernel (our write then fails with ENOENT). Nothing to cancel in a read-only cache.
        return None

    def _destroy(self, req: Request, payload: memoryview) -> list[Buffer]:
        self.destroyed = True
        try:
            self.ops.destroy()
        finally:
            self._stopped.set()
        return []
