"""The slow directory, behind a narrow interface: stat, listdir, read_range, readlink, statfs.

Everything the core knows about the source goes through `Source`, so tests use
`cachefs.memsource.MemorySource` (in memory, counts calls, injects faults) instead.
`LocalSource` never writes, never follows a symlink itself, and never leaves its root.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat as stat_mod
import threading
from typing import Protocol

from cachefs.config import KEPT_FILES
from cachefs.directio import ALIGN as _ALIGN
from cachefs.directio import DescriptorCache
from cachefs.directio import pread as _pread
from cachefs.directio import pread_direct as _pread_direct
from cachefs.errors import SourceChanged
from cachefs.identity import Attr, DirEntry, FileId

log = logging.getLogger(__name__)


class Source(Protocol):
    """What cachefs needs from a slow store. Paths are absolute within the source ('/a/b')."""

    def stat(self, path: str) -> Attr: ...

    def listdir(self, path: str, attrs: bool = False) -> list[DirEntry]:
        """The directory's entries, each with its d_type; with `attrs`, each with its
        attributes too (what NFS's READDIRPLUS gives: one listing, no request per entry
        where the client caches them), an entry that vanished meanwhile left out."""
        ...

    def read_whole(self, path: str, limit: int, expect: FileId | None = None) -> tuple[Attr, bytes | None]:
        """A small file in one visit: its attributes and bytes (None for the bytes if it is
        larger than `limit`). SourceChanged if it is not `expect`, or changed while read."""
        ...

    def read_range(self, fid: FileId, offset: int, size: int) -> bytes:
        """Return exactly `size` bytes at `offset` of the file whose identity is `fid`.

        Raises SourceChanged when the file is no longer that version (other size or mtime),
        so a block of one version is never stored under another version's key.
        """
        ...

    def readlink(self, path: str) -> str: ...

    def statfs(self) -> dict: ...

    def getxattr(self, path: str, name: str) -> bytes: ...

    def listxattr(self, path: str) -> list[str]: ...


def check_relpath(path: str) -> str:
    """Validate a source-relative path from FUSE or a caller; return it without the leading '/'.

    The kernel never sends '..' or empty components, but the core is also called directly
    (tests, tools, the control interface), so a path that could escape the root is refused.
    """
    if not path.startswith("/") or "\0" in path:
        raise OSError(errno.EINVAL, "invalid path", path)
    rel = path.strip("/")
    if rel and any(part in ("", ".", "..") for part in rel.split("/")):
        raise OSError(errno.EINVAL, "invalid path component", path)
    return rel


# openat2(2) (Linux 5.6+) resolves a path under a directory descriptor in one system call
# and refuses to leave it: RESOLVE_BENEATH fails with EXDEV on a '..' or a symlink that
# would lead out.
_SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_syscall():  # type: ignore[no-untyped-def]
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()


_PATH_CHUNK = 3072  # bytes of a path given to one openat2 (PATH_MAX is 4096)



class LocalSource:
    """A directory reachable through the local VFS (NFS, SMB, sshfs, HDD, another FUSE).

    Every access resolves the parent directory to a file descriptor and checks through
    /proc/self/fd that it still lies inside the root, then works relative to that
    descriptor with O_NOFOLLOW: a directory swapped for a symlink on the source can never
    lead the daemon outside it. (O_NOFOLLOW alone guards only the last component.) The
    check costs local system calls only: opening a directory with O_PATH sends nothing to
    an NFS server whose dentries are cached.

    Everything, the root itself included, is reached through one descriptor of the root
    opened at the first access: if the path later names another directory (the source
    unmounted and something else mounted there, a bind mount moved, the directory renamed
    and a new one made), cachefs keeps serving the tree it mounted, whole and consistent,
    and says so once in the log (`root_moved`), instead of mixing the listing of one
    tree with the data of another.
    """

    def __init__(self, root: str, root_fd: int = -1):
        """`root_fd`: a descriptor of the root another process opened (a fetch process
        serves the daemon's tree, not whatever the path names when it starts)."""
        self.root = root if root_fd >= 0 else os.path.realpath(root)  # (the daemon's, resolved)
        # O_NOATIME keeps reads from writing atime to the source; it is only allowed for
        # the file's owner (or root), so fall back without it on EPERM.
        self._noatime = getattr(os, "O_NOATIME", 0)
        self._direct = hasattr(os, "O_DIRECT")
        # big source files kept open between block reads (see _read_range)
        self._kept: DescriptorCache[tuple[FileId, bool]] = DescriptorCache(
            lambda key: self._open_file(key[0].path, key[1]), KEPT_FILES, share=16)
        self._root_fd = root_fd
        self._root_lock = threading.Lock()
        self._openat2 = _syscall is not None and os.uname().sysname == "Linux"
        self._moved_warned = False

    def root_fd(self) -> int:
        """The descriptor (O_PATH) of the tree being served."""
        return self._rootfd()

    def _rootfd(self) -> int:
        # Opened on first use, not in __init__: the daemon closes inherited descriptors.
        if self._root_fd < 0:
            with self._root_lock:
                if self._root_fd < 0:
                    self._root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self._root_fd

    def root_moved(self) -> bool:
        """Whether the source path now names another directory than the one being served
        (logged once per move)."""
        try:
            now = os.stat(self.root)
        except OSError:
            moved = True
        else:
            held = os.fstat(self._rootfd())
            moved = (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)
        if moved and not self._moved_warned:
            log.warning("%s now names another directory than the one mounted (unmounted, moved or "
                        "renamed); cachefs keeps serving the tree it mounted: remount to serve the new one",
                        self.root)
        self._moved_warned = moved
        return moved

    def _openat2_call(self, rel: str | bytes, flags: int, base: int = -1) -> int:
        """openat2 under `base` (the root); a path longer than the kernel takes in one call
        (PATH_MAX) is opened a part at a time, each part beneath the directory before it."""
        assert _syscall is not None
        raw = os.fsencode(rel)
        base = self._rootfd() if base < 0 else base
        if len(raw) > _PATH_CHUNK:
            cut = raw.rfind(b"/", 0, _PATH_CHUNK)
            parent = self._openat2_call(raw[:cut], os.O_PATH | os.O_DIRECTORY, base)
            if parent < 0:
                return parent
            try:
                return self._openat2_call(raw[cut + 1:], flags, parent)
            finally:
                os.close(parent)
        how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
        fd = _syscall(_SYS_OPENAT2, base, raw, ctypes.byref(how), ctypes.sizeof(how))
        return int(fd) if fd >= 0 else -ctypes.get_errno()

    def _open_beneath(self, rel: str, flags: int) -> int | None:
        """openat2(root, rel, RESOLVE_BENEATH): one system call; None where there is no openat2."""
        if not self._openat2:
            return None
        fd = self._openat2_call(rel, flags)
        if fd >= 0:
            return fd
        err = -fd
        if err in (errno.ENOSYS, errno.EPERM) and self._openat2_call(".", os.O_PATH | os.O_DIRECTORY) < 0:
            # An old kernel or a seccomp filter: resolve through /proc/self/fd from now on.
            self._openat2 = False
            log.info("openat2 unavailable (%s); resolving paths through /proc/self/fd", os.strerror(err))
            return None
        if err == errno.EXDEV:
            raise PermissionError(errno.EACCES, "path leaves the source through a symlink", "/" + rel)
        raise OSError(err, os.strerror(err), "/" + rel)

    def _inside(self, fd: int, path: str) -> None:
        real = os.readlink(f"/proc/self/fd/{fd}")
        root = os.readlink(f"/proc/self/fd/{self._rootfd()}")  # where the served tree is now
        if real != root and not real.startswith(root.rstrip("/") + "/"):
            raise PermissionError(errno.EACCES, "path leaves the source through a symlink", path)

    def _parent(self, path: str) -> tuple[int, str]:
        """(O_PATH descriptor of the verified parent directory, last component)."""
        rel = check_relpath(path)
        parent, _, name = rel.rpartition("/")
        beneath = self._open_beneath(parent or ".", os.O_PATH | os.O_DIRECTORY)
        if beneath is not None:
            return beneath, name
        fd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._rootfd())
        try:
            self._inside(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    def stat(self, path: str) -> Attr:
        if path == "/":
            self.root_moved()  # the kernel asks for the root's attributes every --metadata-ttl
            return Attr.from_stat(os.fstat(self._rootfd()))
        # fstatat in the verified parent, not fstat of the file opened O_PATH: over a
        # network file system the open costs a lookup and the fstat another round trip
        # (where its client keeps no attributes), fstatat the lookup alone.
        fd, name = self._parent(path)
        try:
            return Attr.from_stat(os.stat(name, dir_fd=fd, follow_symlinks=False))
        finally:
            os.close(fd)

    def _open_dir(self, path: str) -> int:
        if path == "/":
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._rootfd())
        beneath = self._open_beneath(check_relpath(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        if beneath is not None:
            return beneath
        fd, name = self._parent(path)
        try:
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)

    def listdir(self, path: str, attrs: bool = False) -> list[DirEntry]:
        """With `attrs`, every entry with its attributes (one fstatat each beside the
        listing: the check of a directory after a restart, which costs the store less than
        a lookup each); without, d_type only: no request per entry."""
        out = []
        new = tuple.__new__
        dfd = self._open_dir(path)
        try:
            with os.scandir(dfd) as it:
                for entry in it:
                    if attrs:  # right after the listing: NFS and FUSE answer from what it brought
                        try:
                            a = Attr.from_stat(entry.stat(follow_symlinks=False))
                        except OSError:
                            continue  # vanished while listing
                        out.append(DirEntry(entry.name, stat_mod.S_IFMT(a.mode), a.ino, a))
                        continue
                    try:
                        # d_type from the directory itself: no per-entry stat on the source.
                        # Regular files first: most entries of a dataset are.
                        if entry.is_file(follow_symlinks=False):
                            kind = stat_mod.S_IFREG
                        elif entry.is_dir(follow_symlinks=False):
                            kind = stat_mod.S_IFDIR
                        elif entry.is_symlink():
                            kind = stat_mod.S_IFLNK
                        else:
                            kind = stat_mod.S_IFMT(entry.stat(follow_symlinks=False).st_mode)
                    except OSError:
                        kind = 0  # vanished while listing: report it, a lookup will say ENOENT
                    out.append(new(DirEntry, (entry.name, kind, entry.inode(), None)))  # DirEntry(...), faster
        finally:
            os.close(dfd)
        return out

    def _open_file(self, path: str, direct: bool = False) -> int:
        """A descriptor of the regular file at `path`, or SourceChanged: whatever else is
        there now (a FIFO, a device, a directory swapped in after its stat was cached) is
        never read as a file. O_NONBLOCK, so that opening a FIFO cannot wait for a writer.
        A file system that refuses O_DIRECT turns it off; a directory does not."""
        if direct:
            try:
                return self._open_regular(path, True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            fd = self._open_regular(path, False)  # not a regular file: SourceChanged here
            self._direct = False  # a regular file that refuses O_DIRECT: this file system does
            log.info("source does not support O_DIRECT at open; using buffered reads")
            return fd
        return self._open_regular(path, False)

    def _open_regular(self, path: str, direct: bool) -> int:
        fd = self._open_flags(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                              | (os.O_DIRECT if direct else 0))
        try:
            mode = os.fstat(fd).st_mode
        except BaseException:
            os.close(fd)
            raise
        if not stat_mod.S_ISREG(mode):
            os.close(fd)
            raise SourceChanged(path)
        return fd

    def _open_flags(self, path: str, flags: int) -> int:
        if self._noatime:
            try:
                return self._open_file_flags(path, flags | self._noatime)
            except PermissionError as exc:
                if exc.errno != errno.EPERM:
                    raise
                self._noatime = 0  # O_NOATIME is only for the file's owner (or root)
        return self._open_file_flags(path, flags)

    def _open_file_flags(self, path: str, flags: int) -> int:
        beneath = self._open_beneath(check_relpath(path), flags)
        if beneath is not None:
            return beneath
        fd, name = self._parent(path)
        try:
            return os.open(name, flags, dir_fd=fd)
        finally:
            os.close(fd)

    def read_range(self, fid: FileId, offset: int, size: int) -> bytes:
        if self._direct and offset % _ALIGN == 0:
            try:
                return self._read_range(fid, offset, size, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # tmpfs and some others refuse O_DIRECT: read through the page cache instead
                self._direct = False
                log.info("source does not support O_DIRECT (%s); using buffered reads", exc)
        return self._read_range(fid, offset, size, direct=False)

    def _read_range(self, fid: FileId, offset: int, size: int, direct: bool) -> bytes:
        part = size < fid.size  # a block of a big file: more are likely to follow
        # a big file stays open between block reads: one request to the store per read,
        # not an open and a read; each read is still checked against the version (_check)
        fd = self._kept.get((fid, direct)) if part else self._open_file(fid.path, direct)
        try:
            data = _pread_direct(fd, offset, size) if direct else _pread(fd, offset, size)
            # Checked after the read, on the descriptor read from: a file that was another
            # version when opened, or was rewritten during the read, fails here.
            self._check(fd, fid)
        except BaseException:
            if part:
                self._kept.forget((fid, direct))
            raise
        finally:
            os.close(fd)
        if len(data) != size:
            raise SourceChanged(fid.path)
        return data

    def read_whole(self, path: str, limit: int, expect: FileId | None = None) -> tuple[Attr, bytes | None]:
        """A small file in one visit: open, fstat, read, check, close. Returns its attributes
        and its bytes, or None for the bytes of a file larger than `limit` (not read).

        With `expect`, raises SourceChanged if the file is no longer that version; without,
        the version read is the one returned (the caller learns it here). A file rewritten
        during the read raises SourceChanged either way.
        """
        direct = self._direct
        try:
            fd = self._open_file(path, direct)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self._direct = direct = False
            fd = self._open_file(path, False)
        try:
            st = os.fstat(fd)
            attr = Attr.from_stat(st)
            if not stat_mod.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            fid = FileId.of(path, Attr.from_stat(st))
            if expect is not None and fid != expect:
                raise SourceChanged(path)
            if st.st_size > limit:
                return attr, None
            try:
                data = _pread_direct(fd, 0, st.st_size) if direct else _pread(fd, 0, st.st_size)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                self._direct = False  # opened with O_DIRECT, but reads refuse it (some FUSE)
                data = _pread(fd, 0, st.st_size)
            self._check(fd, fid)
        finally:
            os.close(fd)
        if len(data) != fid.size:
            raise SourceChanged(path)
        return attr, data

    @staticmethod
    def _check(fd: int, fid: FileId) -> None:
        st = os.fstat(fd)
        if not fid.matches(Attr.from_stat(st)):
            raise SourceChanged(fid.path)

    def readlink(self, path: str) -> str:
        # Returned as stored: the link is passed through, never resolved by cachefs.
        fd, name = self._parent(path)
        try:
            return os.readlink(name, dir_fd=fd)
        finally:
            os.close(fd)


    def statfs(self) -> dict:
        st = os.statvfs(self._rootfd())
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                "f_files", "f_ffree", "f_favail", "f_namemax")
        return {k: getattr(st, k) for k in keys}

    def _via_parent(self, path: str, fn):  # type: ignore[no-untyped-def]
        """Call fn(p) with a path through the verified parent's /proc/self/fd link."""
        if path == "/":
            return fn(f"/proc/self/fd/{self._rootfd()}/.")  # "/.": the directory, not the link
        fd, name = self._parent(path)
        try:
            return fn(f"/proc/self/fd/{fd}/{name}")
        finally:
            os.close(fd)

    def getxattr(self, path: str, name: str) -> bytes:
        return self._via_parent(path, lambda p: os.getxattr(p, name, follow_symlinks=False))

    def listxattr(self, path: str) -> list[str]:
        return self._via_parent(path, lambda p: os.listxattr(p, follow_symlinks=False))


def open_source(spec: str, root_fd: int = -1) -> Source:
    """The source a mount's SOURCE argument names: today a directory (any POSIX filesystem:
    NFS, Lustre, sshfs, a local disk), opened now, so that the tree served is the one the
    path names at mount time. A store with a scheme of its own (s3://, https://) is one
    module implementing Source, and one line here."""
    source = LocalSource(spec, root_fd)
    source.root_fd()
    return source
