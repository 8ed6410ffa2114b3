"""`cachefs mount` and `cachefs umount`: check everything up front, then serve in the
foreground or as a daemon (cachefs.daemon), and report how it went.

`cachefs mount` checks the source, the mount point, the cache dir and the sizes before
anything is written or mounted (cachefs.validate), so bad input costs a one-line error and
nothing else. As a daemon it forks, and the parent returns only when the child's FUSE
init has run (the mount is live) or the child has failed, whose message it prints.
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

import psutil

from cachefs.config import (
    MOUNT_READY_TIMEOUT,
    Config,
    format_size,
)
from cachefs.daemon import sd_notify, serve, setup_logging
from cachefs.errors import CachefsError
from cachefs.mounttable import (
    FSTYPE,
    find_mount,
    kernel_unmount,
    probe,
    read_control,
)
from cachefs.validate import default_log_file, hung_mount, prepare_cache_dir, validate

log = logging.getLogger(__name__)


def mount(config: Config, out: Callable[[str], None] = print, check_only: bool = False) -> int:
    """`cachefs mount`: validate, then serve in the foreground or as a daemon (or, with
    `check_only`, say that it would)."""
    os.umask(0o077)  # the cache dir, its blocks and the log are private to this user
    lock = None if check_only else _lock_mountpoint(config.mountpoint)
    try:
        return _mount(config, out, check_only, lock)
    finally:
        if lock is not None:
            os.close(lock)


def _lock_mountpoint(path: str) -> int | None:
    """Hold an exclusive lock on the mount point directory while a mount is set up, so that
    of two `cachefs mount` on one point at the same moment exactly one mounts; the other
    then finds it a mount point. None where there is nothing to lock (validate says why)."""
    state, real = probe(path)
    if state == "hung":
        raise hung_mount(real)  # asked once: validate would wait out the same timeout again
    if state != "none":
        return None  # a mount already: validate refuses it (or clears a dead one)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _mount(config: Config, out: Callable[[str], None], check_only: bool, lock: int | None) -> int:
    notices = validate(config, check_only=check_only)
    for notice in notices:
        print(f"cachefs: {notice}", file=sys.stderr)
    summary = (f"{config.source} at {config.mountpoint} (RAM {format_size(config.ram_size or 0)}, "
               f"NVMe {format_size(config.disk_size or 0)} in {config.cache_dir})")
    if check_only:
        out(f"cachefs: check passed: would mount {summary}")
        return 0
    prepare_cache_dir(config)
    if config.log_file is None and not config.foreground:
        config.log_file = default_log_file(config)
    if config.foreground:
        return _serve_here(config, out, lock, summary)
    return _start_daemon(config, out, lock, summary)


def _serve_here(config: Config, out: Callable[[str], None], lock: int | None, summary: str) -> int:
    """--foreground: serve in this process until unmounted."""
    setup_logging(max(config.verbose, 1 if config.debug_fuse else 0), config.log_file)

    def ready() -> None:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)  # mounted: another mount now finds a mount point
        out(f"cachefs: mounted {summary}; Ctrl-C to unmount")
        sd_notify(f"READY=1\nSTATUS=serving {config.source} at {config.mountpoint}")

    try:
        serve(config, on_ready=ready)
    except (OSError, RuntimeError) as exc:
        log.debug("%s", traceback.format_exc())
        print(f"cachefs: error: mount failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _start_daemon(config: Config, out: Callable[[str], None], lock: int | None, summary: str) -> int:
    """Fork the daemon, and wait until it says the mount is live (or why it is not)."""
    assert config.log_file is not None
    try:
        log_start = os.path.getsize(config.log_file)  # what this mount adds to the log starts here
    except OSError:
        log_start = 0
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _daemon(config, lock, wfd)  # never returns
    os.close(wfd)
    deadline = time.monotonic() + MOUNT_READY_TIMEOUT
    text = _read_ready(rfd, deadline)
    if text == "OK" and _wait_live(config.mountpoint, pid):
        out(f"cachefs: mounted {summary} (daemon pid {pid}, log {config.log_file})")
        return 0
    if text == "OK":
        text = "the daemon stopped right after mounting"
    elif not text:
        text = "the daemon did not report ready in time" if time.monotonic() >= deadline else "the daemon exited"
    if not text.startswith("ERR"):
        last = _last_error_line(config.log_file, log_start)
        if last:
            text += f": {last}"
    if not text.startswith("ERR"):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    print(f"cachefs: error: mount failed: {text.removeprefix('ERR ')} (log: {config.log_file})", file=sys.stderr)
    return 1


def _daemon(config: Config, lock: int | None, wfd: int) -> NoReturn:
    """The forked daemon: detach, log to the log file, serve; tell the parent "OK" once
    mounted, or "ERR why" if it could not mount."""
    if lock is not None:
        os.close(lock)  # the caller's lock, released when the mount is live
    code = 1
    try:
        os.setsid()
        os.chdir("/")  # do not keep the caller's directory (and its file system) busy
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.close(devnull)
        assert config.log_file is not None
        logfd = os.open(config.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(logfd, 1)
        os.dup2(logfd, 2)
        os.close(logfd)
        setup_logging(max(config.verbose, 1 if config.debug_fuse else 0), config.log_file)

        def ready() -> None:
            os.write(wfd, b"OK\n")
            os.close(wfd)

        serve(config, on_ready=ready)
        code = 0
    except BaseException as exc:
        log.error("daemon failed: %s", exc)
        log.debug("%s", traceback.format_exc())
        try:
            os.write(wfd, f"ERR {exc}\n".encode())  # fails harmlessly if ready() closed it
        except OSError:
            pass
    finally:
        os._exit(code)


def _read_ready(rfd: int, deadline: float) -> str:
    """The daemon's one line ("OK", "ERR why"), or "" if it closed the pipe or the
    deadline passed first."""
    message = b""
    while time.monotonic() < deadline:
        readable, _, _ = select.select([rfd], [], [], 0.2)
        if readable:
            chunk = os.read(rfd, 4096)
            if not chunk:
                break
            message += chunk
            if message.endswith(b"\n"):
                break
    os.close(rfd)
    return message.decode(errors="replace").strip()


def _last_error_line(log_file: str | None, start: int) -> str:
    """The last line the daemon logged at ERROR or above (or a traceback's last line) since
    `start`: the reason, when the daemon died without telling the parent."""
    if not log_file:
        return ""
    try:
        with open(log_file, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if " ERROR " in line or " CRITICAL " in line:
            return line.split(": ", 1)[-1].strip()
        if line and not line.startswith((" ", "\t", "Traceback")) and "Error" in line.split(":")[0]:
            return line.strip()  # an uncaught exception's last line, e.g. "MemoryError: ..."
    return ""


def _wait_live(mountpoint: str, pid: int, timeout: float = 5.0) -> bool:
    """After init: the mount answers and the daemon is still alive (libfuse can fail after init)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
        entry = find_mount(mountpoint)
        if entry is not None and entry.fstype == FSTYPE:
            try:
                os.stat(mountpoint)
                return True
            except OSError:
                pass
        time.sleep(0.02)
    return False


def unmount(mountpoint: str, timeout: float = 30.0) -> str:
    """Unmount a cachefs mount and wait for its daemon to finish writing the cache."""
    state, mp = probe(mountpoint)
    entry = find_mount(mp)
    if entry is None:
        raise CachefsError(f"{mountpoint} is not mounted")
    if entry.fstype != FSTYPE:
        raise CachefsError(f"{mountpoint} is a {entry.fstype} mount, not cachefs")
    if state == "dead":
        problem = kernel_unmount(mp, lazy=True)
        if problem is not None:
            raise CachefsError(f"could not clear the stale mount {mp}: {problem}")
        return f"cleared stale mount {mp} (its daemon had died)"
    if state == "hung":
        # alive but not answering (stopped, or stuck in the source): the kernel can still
        # unmount it if nothing holds it; the daemon ends when it runs again
        problem = kernel_unmount(mp)
        if problem is not None:
            if "busy" in problem.lower():
                raise CachefsError(f"{mp} is busy and its daemon does not answer (stopped or hung): close the "
                                   f"files using it and retry, or detach it with: umount -l {mp}")
            raise CachefsError(f"unmounting {mp} failed: {problem}")
        return f"unmounted {mp}; its daemon does not answer (stopped or hung) and exits when it runs again"
    pid = None
    try:
        pid = int(read_control(mp, "user.cachefs.info")["pid"])
    except (CachefsError, ValueError, KeyError):
        pass
    waiting = []  # the daemon and its fetch processes: done when every one has exited
    if pid is not None:
        try:
            daemon = psutil.Process(pid)
            waiting = [daemon, *daemon.children(recursive=True)]
        except psutil.Error:
            pass
    problem = kernel_unmount(mp)
    if problem is not None:
        if "busy" in problem.lower():
            raise CachefsError(f"{mp} is busy: close the files and shells using it, then retry")
        raise CachefsError(f"unmounting {mp} failed: {problem}")
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        waiting = [p for p in waiting if _running(p)]
        if waiting:
            time.sleep(0.02)
    if waiting:
        return f"unmounted {mp}; its daemon (pid {pid}) is still finishing cache writes"
    return f"unmounted {mp}"


def _running(proc: psutil.Process) -> bool:
    """Whether a process has not exited yet (a zombie has: only its exit status is left)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

