"""The FUSE kernel protocol, as `include/uapi/linux/fuse.h` (7.45) defines it: opcodes, flags,
and the wire structures as precompiled `struct.Struct`s. Nothing here does I/O.

Every structure is little-endian on the machines cachefs runs on and padded to 8 bytes,
exactly as the kernel lays it out; `tests/test_fuse_protocol.py` pins the sizes.
"""

from __future__ import annotations

import stat as stat_mod
import struct
from collections.abc import Iterable
from typing import NamedTuple

KERNEL_VERSION = 7
KERNEL_MINOR = 45   # what this module implements; the kernel may offer less or more
MIN_MINOR = 31      # the oldest protocol we serve: Linux 5.10 speaks 7.32

ROOT_ID = 1

# -- opcodes ----------------------------------------------------------------------------------
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE, STATFS, RELEASE = 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18
FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = 20, 21, 22, 23, 24, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, GETLK, SETLK, SETLKW, ACCESS, CREATE = 27, 28, 29, 30, 31, 32, 33, 34, 35
INTERRUPT, BMAP, DESTROY, IOCTL, POLL, NOTIFY_REPLY, BATCH_FORGET, FALLOCATE = 36, 37, 38, 39, 40, 41, 42, 43
READDIRPLUS, RENAME2, LSEEK, COPY_FILE_RANGE, SETUPMAPPING, REMOVEMAPPING = 44, 45, 46, 47, 48, 49
SYNCFS, TMPFILE, STATX, COPY_FILE_RANGE_64 = 50, 51, 52, 53

OPCODE_NAMES = {v: k.lower() for k, v in globals().items() if k.isupper() and isinstance(v, int)
                and 1 <= v <= 53 and k not in ("ROOT_ID", "KERNEL_VERSION", "KERNEL_MINOR", "MIN_MINOR")}

# Requests that change the file system: a read-only mirror answers them with EROFS.
WRITE_OPS = frozenset({SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE, SETXATTR,
                       REMOVEXATTR, CREATE, FALLOCATE, RENAME2, COPY_FILE_RANGE, TMPFILE,
                       COPY_FILE_RANGE_64})

# -- notifications (written by the server, unique 0, error = the code) -----------------------
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_DELETE = 6

# -- INIT flags ----------------------------------------------------------------------------
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
POSIX_ACL = 1 << 20
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
NO_OPENDIR_SUPPORT = 1 << 24
INIT_EXT = 1 << 30
# flags2 (bits 32-63 of the 64-bit flag word)
PASSTHROUGH = 1 << 37
NO_EXPORT_SUPPORT = 1 << 38

# -- OPEN reply flags ------------------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

# -- ioctls on /dev/fuse ---------------------------------------------------------------------


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (229 << 8) | nr


DEV_IOC_CLONE = _ioc(2, 0, 4)           # _IOR(229, 0, uint32_t)
DEV_IOC_BACKING_OPEN = _ioc(1, 1, 16)   # _IOW(229, 1, struct fuse_backing_map)
DEV_IOC_BACKING_CLOSE = _ioc(1, 2, 4)   # _IOW(229, 2, uint32_t)

# -- structures ------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")        # len opcode unique nodeid uid gid pid total_extlen pad
OUT_HEADER = struct.Struct("<IiQ")             # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")      # fuse_attr, 88 bytes
ENTRY_OUT = struct.Struct("<QQQQII")           # nodeid generation entry_valid attr_valid nsecs; + ATTR
ATTR_OUT = struct.Struct("<QII")               # attr_valid attr_valid_nsec dummy; + ATTR
INIT_IN = struct.Struct("<IIII")               # major minor max_readahead flags (+ flags2 with INIT_EXT)
INIT_IN_FLAGS2 = struct.Struct("<I")
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")  # ... flags2 max_stack_depth request_timeout unused[11]
OPEN_IN = struct.Struct("<II")                 # flags open_flags
OPEN_OUT = struct.Struct("<QIi")               # fh open_flags backing_id
READ_IN = struct.Struct("<QQIIQII")            # fh offset size read_flags lock_owner flags pad
RELEASE_IN = struct.Struct("<QIIQ")            # fh flags release_flags lock_owner
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
GETATTR_IN = struct.Struct("<IIQ")
GETXATTR_IN = struct.Struct("<II")             # size pad
GETXATTR_OUT = struct.Struct("<II")
ACCESS_IN = struct.Struct("<II")
INTERRUPT_IN = struct.Struct("<Q")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")    # fuse_kstatfs: 5 counts, bsize namelen frsize pad, spare
DIRENT = struct.Struct("<QQII")                # ino off namelen type; + name, padded to 8
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")
BACKING_MAP = struct.Struct("<iIQ")            # fd flags padding
U32 = struct.Struct("<I")

assert IN_HEADER.size == 40 and OUT_HEADER.size == 16 and ATTR.size == 88
assert ENTRY_OUT.size + ATTR.size == 128 and ATTR_OUT.size + ATTR.size == 104
assert INIT_OUT.size == 64 and OPEN_OUT.size == 16 and READ_IN.size == 40 and STATFS_OUT.size == 80


class Attr(NamedTuple):
    """What a FUSE server reports of an inode (the fields of struct fuse_attr); times in ns."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    blocks: int = 0
    rdev: int = 0
    blksize: int = 1 << 20


def pack_attr(a: Attr) -> bytes:
    return ATTR.pack(a.ino, a.size, a.blocks, a.atime_ns // 1_000_000_000, a.mtime_ns // 1_000_000_000,
                     a.ctime_ns // 1_000_000_000, a.atime_ns % 1_000_000_000, a.mtime_ns % 1_000_000_000,
                     a.ctime_ns % 1_000_000_000, a.mode, a.nlink, a.uid, a.gid, a.rdev, a.blksize, 0)


def split_timeout(seconds: float) -> tuple[int, int]:
    """A cache timeout as (seconds, nanoseconds), as entry_valid/attr_valid take it."""
    seconds = max(0.0, seconds)
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def pack_entry(nodeid: int, attr: Attr, entry_timeout: float, attr_timeout: float, generation: int = 0) -> bytes:
    es, ens = split_timeout(entry_timeout)
    as_, ans = split_timeout(attr_timeout)
    return ENTRY_OUT.pack(nodeid, generation, es, as_, ens, ans) + pack_attr(attr)


_ENTRY_ATTR = struct.Struct("<QQQQII" + ATTR.format[1:])  # entry_out and its attr, in one pack


def pack_entry_of(nodeid: int, ino: int, mode: int, nlink: int, uid: int, gid: int, size: int, atime_ns: int,
                  mtime_ns: int, ctime_ns: int, blocks: int, rdev: int, valid: tuple[int, int],
                  blksize: int = 1 << 20) -> bytes:
    """pack_entry() from the fields themselves, the entry and attribute timeouts both
    `valid` (seconds, nanoseconds): one struct pack for the hot path of a lookup."""
    s, ns = valid
    return _ENTRY_ATTR.pack(nodeid, 0, s, s, ns, ns, ino, size, blocks, atime_ns // 1_000_000_000,
                            mtime_ns // 1_000_000_000, ctime_ns // 1_000_000_000, atime_ns % 1_000_000_000,
                            mtime_ns % 1_000_000_000, ctime_ns % 1_000_000_000, mode, nlink, uid, gid, rdev,
                            blksize, 0)


def pack_attr_out(attr: Attr, attr_timeout: float) -> bytes:
    s, ns = split_timeout(attr_timeout)
    return ATTR_OUT.pack(s, ns, 0) + pack_attr(attr)


def pack_dirent(ino: int, off: int, name: bytes, mode: int) -> bytes:
    """One struct fuse_dirent: d_type from the mode's S_IFMT bits, padded to 8 bytes."""
    record = DIRENT.pack(ino, off, len(name), stat_mod.S_IFMT(mode) >> 12) + name
    return record + b"\0" * (-len(record) % 8)


def pack_dirents(items: Iterable[tuple[bytes, int, int]]) -> tuple[bytes, list[int]]:
    """READDIR's records of (name, mode, ino) items, their offsets 1, 2, ... (a later
    READDIR's offset is the index of the next item), in one pass; and where each record
    ends. An ino of 0 (unknown) is sent as 0xFFFFFFFF: 0 would hide the entry."""
    parts: list[bytes] = []
    ends: list[int] = []
    pos = 0
    pack = DIRENT.pack
    head = DIRENT.size
    for i, (name, mode, ino) in enumerate(items, 1):
        n = len(name)
        pad = -(head + n) % 8
        parts += (pack(ino or 0xFFFFFFFF, i, n, (mode & 0o170000) >> 12), name, _PAD[pad])
        pos += head + n + pad
        ends.append(pos)
    return b"".join(parts), ends


_PAD = [b"\0" * n for n in range(8)]


def pack_direntplus(entry: bytes, ino: int, off: int, name: bytes, mode: int) -> bytes:
    """One struct fuse_direntplus: an entry_out (see pack_entry) then the dirent."""
    return entry + pack_dirent(ino, off, name, mode)


def dirent_size(name: bytes, plus: bool) -> int:
    size = DIRENT.size + len(name)
    size += -size % 8
    return size + (ENTRY_OUT.size + ATTR.size if plus else 0)


def cstring(data: bytes | memoryview, offset: int = 0) -> bytes:
    """A NUL-terminated string at `offset`; ValueError when the NUL is missing (a malformed request)."""
    raw = bytes(data[offset:])
    end = raw.find(b"\0")
    if end < 0:
        raise ValueError("string without its terminating NUL")
    return raw[:end]
