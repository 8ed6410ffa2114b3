"""The file stores' on-disk layout, and the one write loop: shared by the tiers and by the
fetch processes, which write entry files the NVMe tier then adopts (cachefs/fetcher.py).

    <tier dir>/data/<first 2 hex digits of the entry id>/<entry id, 32 hex digits>

An entry file holds a file version's bytes at their own offsets (sparse while blocks are
missing); its blocks' xxh3 hashes are in the tier's index, never in the file, so the
kernel can pass reads through to it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from array import array
from collections.abc import Sequence

import xxhash

SUBDIR_CHARS = 2

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def entry_file(data_dir: str, name: str) -> str:
    """The path of the entry named `name` (its id in hex) under a tier's data directory."""
    return f"{data_dir}/{name[:SUBDIR_CHARS]}/{name}"


def create_exclusive(path: str) -> int:
    """Create an entry file that must not exist yet (FileExistsError if it does), and its
    directory if needed: a descriptor open for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        return os.open(path, flags, 0o600)


def write_all(fd: int, data: bytes | memoryview, offset: int = 0) -> None:
    """Write every byte of `data` at `offset` (pwrite may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def replace_durably(path: str, data: bytes | Sequence[bytes | bytearray | memoryview | array[int]]) -> None:
    """Put `data` (bytes, or buffers one after another) at `path` whole or not at all: a
    temporary file beside it, fsync'd, then renamed over (a file renamed without fsync can
    come back empty after a crash)."""
    tmp = path + ".new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        offset = 0
        for part in [data] if isinstance(data, bytes) else data:
            view = memoryview(part).cast("B")
            write_all(fd, view, offset)
            offset += view.nbytes
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def block_hash(data: bytes | memoryview) -> int:
    """The checksum the index records for a block: its xxh3 (64 bits)."""
    return xxhash.xxh3_64_intdigest(data)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free a range of an entry file (a dropped block), its size kept."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
