"""Mounting and unmounting a FUSE file system without libfuse.

As root (CAP_SYS_ADMIN): open /dev/fuse and mount(2) with `fd=N` in the options. Anyone
else: run the setuid `fusermount3` (package fuse3), which mounts and hands the /dev/fuse
descriptor back over a Unix socket named in `_FUSE_COMMFD` (SCM_RIGHTS), as libfuse does.
`MountError` carries the reason in one line: mount(2)'s errno, or fusermount3's own words.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import errno
import os
import shutil
import socket
import subprocess

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountError(OSError):
    """A mount that could not be made; str() is the one-line reason."""


def escape_option(value: str) -> str:
    """Escape a value for a comma-separated mount option list (fusermount3 reads `\\,`)."""
    return value.replace("\\", "\\\\").replace(",", "\\,")


def fusermount() -> str | None:
    return shutil.which("fusermount3")


def mount(mountpoint: str, fsname: str, subtype: str, *, allow_other: bool = False, max_read: int = 1 << 20,
          read_only: bool = True, privileged: bool | None = None) -> int:
    """Mount a FUSE file system at `mountpoint`; return the /dev/fuse descriptor serving it.

    `privileged` None: try mount(2) and fall back to fusermount3 on EPERM (as libfuse does).
    """
    if privileged is None or privileged:
        try:
            return _mount_syscall(mountpoint, fsname, subtype, allow_other, max_read, read_only)
        except MountError as exc:
            if privileged or exc.errno not in (errno.EPERM, errno.EACCES):
                raise
    return _mount_fusermount(mountpoint, fsname, subtype, allow_other, max_read, read_only)


def _mount_syscall(mountpoint: str, fsname: str, subtype: str, allow_other: bool, max_read: int,
                   read_only: bool) -> int:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise MountError(exc.errno, f"cannot open /dev/fuse: {exc.strerror}") from None
    st = os.stat(mountpoint)
    opts = [f"fd={fd}", f"rootmode={st.st_mode & 0o170000:o}", f"user_id={os.getuid()}",
            f"group_id={os.getgid()}", "default_permissions", f"max_read={max_read}"]
    if allow_other:
        opts.append("allow_other")
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    res = _libc.mount(os.fsencode(fsname), os.fsencode(mountpoint), f"fuse.{subtype}".encode(), flags,
                      ",".join(opts).encode())
    if res != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise MountError(err, f"mount(2) of {mountpoint} failed: {os.strerror(err)}")
    return fd


def _mount_fusermount(mountpoint: str, fsname: str, subtype: str, allow_other: bool, max_read: int,
                      read_only: bool) -> int:
    binary = fusermount()
    if binary is None:
        raise MountError(errno.ENOENT, "fusermount3 not found: install the fuse3 package (apt-get install fuse3)")
    opts = ["ro" if read_only else "rw", "nosuid", "nodev", "default_permissions", f"max_read={max_read}",
            f"fsname={escape_option(fsname)}", f"subtype={subtype}"]
    if allow_other:
        opts.append("allow_other")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        proc = subprocess.Popen([binary, "-o", ",".join(opts), "--", mountpoint], env=env,
                                pass_fds=(theirs.fileno(),), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        theirs.close()
        fd = _receive_fd(ours)
        _, err = proc.communicate(timeout=30)
        if fd is None or proc.returncode != 0:
            if fd is not None:
                os.close(fd)
            reason = err.decode(errors="replace").strip().splitlines()
            raise MountError(errno.EPERM, reason[-1] if reason else f"fusermount3 exited with {proc.returncode}")
        os.set_inheritable(fd, False)
        return fd
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()


def _receive_fd(sock: socket.socket) -> int | None:
    fds = array.array("i")
    try:
        _msg, ancdata, _flags, _addr = sock.recvmsg(1, socket.CMSG_LEN(fds.itemsize))
    except OSError:
        return None
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return fds[0] if fds else None


def unmount(mountpoint: str, lazy: bool = False) -> None:
    """Unmount: umount2(2) when allowed, fusermount3 -u otherwise. MountError on failure."""
    res = _libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0)
    if res == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY:
        raise MountError(err, f"{mountpoint} is busy")
    if err not in (errno.EPERM, errno.EACCES):
        raise MountError(err, f"unmounting {mountpoint} failed: {os.strerror(err)}")
    binary = fusermount()
    if binary is None:
        raise MountError(err, f"unmounting {mountpoint} needs root or fusermount3")
    proc = subprocess.run([binary, "-u", *(["-z"] if lazy else []), "--", mountpoint], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise MountError(errno.EBUSY if "busy" in proc.stderr.lower() else errno.EPERM,
                         lines[-1] if lines else f"fusermount3 -u exited with {proc.returncode}")
