"""Mounting: validate everything up front, then serve in the foreground or as a daemon.

`cachefs mount` checks the source, the mount point, the cache dir and the sizes before
anything is written or mounted, so bad input costs a one-line error and nothing else. As a
daemon it forks, and the parent returns only when the child's FUSE init has run (the mount
is live) or the child has failed, whose message it prints.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from cachefs import __version__
from cachefs.config import (
    DEFAULT_DISK_FRACTION,
    DEFAULT_DISK_MAX,
    DEFAULT_MIN_FREE_FRACTION,
    DEFAULT_MIN_FREE_MAX,
    DEFAULT_PREFETCH_WORKERS,
    DEFAULT_RAM_FRACTION,
    DEFAULT_RAM_MAX,
    FUSE_MAX_THREADS,
    FUSE_READERS,
    MALLOC_ARENAS,
    MAX_READ,
    MOUNT_READY_TIMEOUT,
    ROTATIONAL_PREFETCH_WORKERS,
    SHUTDOWN_GRACE,
    Config,
    default_fetch_processes,
    format_size,
)
from cachefs.errors import CachefsError
from cachefs.policy import parse_policy_spec

log = logging.getLogger(__name__)

FSTYPE = "fuse.cachefs"


# -- /proc/self/mountinfo --------------------------------------------------------------

@dataclass
class MountEntry:
    mountpoint: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal
    out, i = bytearray(), 0
    raw = field.encode("utf-8", "surrogateescape")
    while i < len(raw):
        if raw[i:i + 1] == b"\\" and i + 3 < len(raw) + 1 and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def list_mounts() -> list[MountEntry]:
    entries = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and len(rfields) >= 2:
                    entries.append(MountEntry(_unescape(fields[4]), rfields[0], _unescape(rfields[1])))
    except OSError:
        pass
    return entries


def find_mount(path: str) -> MountEntry | None:
    """The mount whose mount point is exactly `path` (the last one if stacked)."""
    path = os.path.realpath(os.path.abspath(path))  # mountinfo records resolved paths
    found = None
    for entry in list_mounts():
        if entry.mountpoint == path:
            found = entry
    return found


def cachefs_mounts() -> list[MountEntry]:
    return [m for m in list_mounts() if m.fstype == FSTYPE]


def fusermount_available() -> bool:
    return shutil.which("fusermount3") is not None


def kernel_unmount(mountpoint: str, lazy: bool = False) -> str | None:
    """Unmount (umount2 as root, fusermount3 -u otherwise); None, or the one-line reason it failed."""
    from cachefs.fuse.kernel import MountError, unmount

    try:
        unmount(mountpoint, lazy=lazy)
        return None
    except MountError as exc:
        return str(exc.strerror or exc)


def is_stale(mountpoint: str, timeout: float = 5.0) -> bool:
    """A FUSE mount whose daemon is gone (or hangs for `timeout` seconds).

    statfs, because the kernel never caches it: stat() of a dead mount's root can still
    succeed from the attribute cache. In a thread, because a stopped daemon makes it block.
    """
    result: list[bool] = []

    def probe() -> None:
        try:
            os.statvfs(mountpoint)
            result.append(False)
        except OSError as exc:
            result.append(exc.errno == errno.ENOTCONN)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return result[0] if result else True


# -- validation ----------------------------------------------------------------------------

def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def resolve_sizes(config: Config) -> None:
    """Fill in default tier sizes from this machine (documented in the README, "Options")."""
    if config.ram_size is None:
        total = psutil.virtual_memory().total
        config.ram_size = int(min(DEFAULT_RAM_MAX, total * DEFAULT_RAM_FRACTION))
    if config.disk_size is None:
        free = shutil.disk_usage(_nearest_existing(config.cache_dir)).free
        config.disk_size = int(min(DEFAULT_DISK_MAX, free * DEFAULT_DISK_FRACTION))
    if config.min_free is None:
        total = shutil.disk_usage(_nearest_existing(config.cache_dir)).total
        config.min_free = int(min(DEFAULT_MIN_FREE_MAX, total * DEFAULT_MIN_FREE_FRACTION))


def source_is_rotational(path: str) -> bool:
    """True when `path` lies on a local spinning disk (sysfs says rotational)."""
    try:
        dev = os.stat(path).st_dev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for candidate in (f"{base}/queue/rotational", f"{base}/../queue/rotational"):  # disk, partition
            if os.path.exists(candidate):
                with open(candidate) as f:
                    return f.read().strip() == "1"
    except OSError:
        pass
    return False


def validate(config: Config, check_only: bool = False) -> list[str]:
    """Check a mount request; raise CachefsError (exit 2) on bad input, return notices.

    Writes nothing, except (only once every other check has passed) clearing a stale
    cachefs mount left at the mount point by a dead daemon, which the notices report,
    and creating the cache dir. With `check_only` (`cachefs mount --check`, `mount -f`)
    it writes nothing at all and says what it would do.
    """
    notices: list[str] = []
    # Relative paths are the caller's: resolve them before anything (the daemon runs in /).
    config.cache_dir = os.path.abspath(os.path.expanduser(config.cache_dir))
    src = os.path.abspath(config.source)
    if not os.path.exists(src):
        raise CachefsError(f"source {config.source!r} does not exist")
    if not os.path.isdir(src):
        raise CachefsError(f"source {config.source!r} is not a directory")
    if not os.access(src, os.R_OK | os.X_OK):
        raise CachefsError(f"source {config.source!r} is not readable by this user")
    src = os.path.realpath(src)

    mp = os.path.realpath(os.path.abspath(config.mountpoint))
    stale = is_stale(mp)
    if stale:
        entry = find_mount(mp)
        if entry is None or entry.fstype != FSTYPE:
            kind = entry.fstype if entry else "unknown"
            raise CachefsError(f"{mp} is a dead mount of type {kind}; unmount it first: fusermount3 -uz {mp}")
    if _inside(mp, src):
        raise CachefsError(f"mount point {mp} is inside the source {src}: the mount would contain itself")
    if _inside(src, mp):
        raise CachefsError(f"source {src} is inside the mount point {mp}: the mount would hide it")

    cache = os.path.realpath(os.path.abspath(config.cache_dir))
    if _inside(cache, src):
        raise CachefsError(f"cache dir {cache} is inside the source {src}: cachefs never writes to the source")
    if _inside(cache, mp):
        raise CachefsError(f"cache dir {cache} is inside the mount point {mp}")
    if os.path.exists(cache):
        if not os.path.isdir(cache):
            raise CachefsError(f"cache dir {config.cache_dir!r} is not a directory")
        if os.stat(cache).st_uid != os.getuid():
            raise CachefsError(f"cache dir {config.cache_dir!r} belongs to another user; "
                               "it holds copies of data, so cachefs only uses its own")
    if config.log_file is not None:
        log_file = os.path.realpath(os.path.abspath(config.log_file))
        if _inside(log_file, src) or _inside(log_file, mp):
            raise CachefsError(f"log file {log_file} is inside the source or the mount point")
        if os.path.isdir(log_file):
            raise CachefsError(f"log file {config.log_file!r} is a directory")
        parent = os.path.dirname(log_file)
        if not _inside(parent, cache) and not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            raise CachefsError(f"cannot write the log file {config.log_file!r}: {parent} is not a writable directory")
        config.log_file = log_file
    if not 4096 <= config.block_size <= 256 << 20 or config.block_size % 4096:
        raise CachefsError(f"block size {config.block_size} must be a multiple of 4 KiB between 4 KiB and 256 MiB")
    if config.metadata_ttl < 0 or config.negative_ttl < 0:
        raise CachefsError("metadata TTLs must not be negative")
    if config.prefetch_workers is None:
        # One head: more than a few fetches in flight only make it seek between them
        # (measured on slowfs's disk model: 8 workers 5.95x the direct read, 16 workers
        # 4.5x); a network store wants more in flight (10 ms: 16 workers 2.9x, 8 2.1x).
        config.prefetch_workers = ROTATIONAL_PREFETCH_WORKERS if source_is_rotational(src) \
            else DEFAULT_PREFETCH_WORKERS
    if not 0 <= config.prefetch_workers <= 1024:
        raise CachefsError(f"--prefetch-workers {config.prefetch_workers} must be between 0 and 1024")
    if config.fetch_processes is None:
        config.fetch_processes = default_fetch_processes()
    if not 0 <= config.fetch_processes <= 64:
        raise CachefsError(f"--fetch-processes {config.fetch_processes} must be between 0 and 64")
    if config.warm and config.prefetch_workers == 0:
        raise CachefsError("--warm needs --prefetch-workers of at least 1")
    resolve_sizes(config)
    assert config.ram_size is not None and config.disk_size is not None
    total = psutil.virtual_memory().total
    if config.ram_size > total:
        raise CachefsError(f"--ram-size {format_size(config.ram_size)} exceeds this machine's memory "
                           f"({format_size(total)})")
    usage = shutil.disk_usage(_nearest_existing(cache))
    free = usage.free
    assert config.min_free is not None
    if config.disk_size and config.min_free >= usage.total:
        raise CachefsError(f"--min-free {format_size(config.min_free)} is not less than the cache disk's "
                           f"size ({format_size(usage.total)})")
    if config.disk_size and free < config.min_free:
        notices.append(f"warning: the cache disk has {format_size(free)} free, less than --min-free "
                       f"{format_size(config.min_free)}: the NVMe tier stores nothing until space is freed")
    if config.disk_size > free:
        notices.append(f"warning: --disk-size {format_size(config.disk_size)} is more than the "
                       f"{format_size(free)} free on the cache disk")
    if config.allow_other and os.getuid() != 0 and not _user_allow_other():
        raise CachefsError("--allow-other needs 'user_allow_other' in /etc/fuse.conf (or root)")
    if not os.path.exists("/dev/fuse"):
        raise CachefsError("/dev/fuse is missing: load the fuse module (modprobe fuse) or run with --device /dev/fuse")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise CachefsError("/dev/fuse is not open to this user (distributions make it mode 0666; in a container "
                           "pass --device /dev/fuse), or mount as root")
    if os.getuid() != 0 and not fusermount_available():
        raise CachefsError("fusermount3 not found: mounting as a user other than root needs it "
                           "(install the fuse3 package: apt-get install fuse3)")

    if stale and check_only:
        notices.append(f"would clear a stale cachefs mount at {mp} (its daemon had died)")
    elif stale:
        problem = kernel_unmount(mp, lazy=True)
        if problem is not None or is_stale(mp):
            raise CachefsError(f"{mp} is a stale cachefs mount and clearing it failed: {problem}")
        notices.append(f"cleared a stale cachefs mount at {mp} (its daemon had died)")
    if not os.path.exists(mp):
        raise CachefsError(f"mount point {config.mountpoint!r} does not exist (create it: mkdir -p {mp})")
    if not os.path.isdir(mp):
        raise CachefsError(f"mount point {config.mountpoint!r} is not a directory")
    entry = find_mount(mp)
    if not stale and (os.path.ismount(mp) or entry is not None):
        what = f" ({entry.fstype} of {entry.source})" if entry else ""
        raise CachefsError(f"{mp} is already a mount point{what}")
    if not stale and os.listdir(mp):
        raise CachefsError(f"mount point {config.mountpoint!r} is not empty")
    if check_only:
        parent = _nearest_existing(cache)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CachefsError(f"cache dir {cache} is not writable: {parent} is not writable by this user")
    else:
        _probe_cache_dir(cache)  # last: it creates the cache dir

    config.source, config.mountpoint, config.cache_dir = src, mp, cache
    return notices


def _probe_cache_dir(cache: str) -> None:
    """Create the cache dir if needed and prove a file can be written in it.

    os.access() is not enough: it says yes to root on a read-only file system.
    """
    try:
        os.makedirs(cache, mode=0o700, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=cache)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CachefsError(f"cache dir {cache} is not writable: {exc.strerror}") from None


def _user_allow_other() -> bool:
    try:
        with open("/etc/fuse.conf") as f:
            return any(line.strip() == "user_allow_other" for line in f)
    except OSError:
        return False


# -- serving -------------------------------------------------------------------------------

def prepare_cache_dir(config: Config) -> None:
    os.makedirs(config.cache_dir, mode=0o700, exist_ok=True)
    os.chmod(config.cache_dir, 0o700)


def default_log_file(config: Config) -> str:
    return os.path.join(config.cache_dir, "cachefs.log")


def build_core(config: Config):  # -> Core (kept lazy: the CLI imports this module cheaply)
    from cachefs.core import Core, source_namespace
    from cachefs.prefetch import Prefetcher
    from cachefs.source import LocalSource
    from cachefs.stats import Stats
    from cachefs.tiers.disk import DiskTier
    from cachefs.tiers.memory import MemoryTier
    from cachefs.tiers.multilevel import MultiLevelCache

    stats = Stats()
    stats.set_info(version=__version__, source=config.source, mountpoint=config.mountpoint,
                   cache_dir=config.cache_dir, block_size=config.block_size,
                   metadata_ttl=config.metadata_ttl, readahead=config.readahead,
                   source_timeout_s=config.source_timeout,
                   prefetch_workers=config.prefetch_workers, fetch_processes=config.fetch_processes)
    source = LocalSource(config.source)
    assert config.ram_size is not None and config.disk_size is not None
    policies = parse_policy_spec(config.policy)
    stats.set_info(policy=policies, max_idle_s=config.max_idle, min_free=config.min_free)
    max_idle = config.max_idle or None
    ram = MemoryTier(config.ram_size, stats, policy=policies["ram"], max_idle=max_idle)
    _drop_old_format(config.cache_dir)
    disk = (DiskTier(os.path.join(config.cache_dir, STORE_DIR), config.disk_size, stats,
                     policy=policies["disk"], max_idle=max_idle, min_free=config.min_free or 0)
            if config.disk_size else None)
    cache = MultiLevelCache(ram, disk, stats)
    workers = config.prefetch_workers if config.prefetch_workers is not None else DEFAULT_PREFETCH_WORKERS
    prefetcher = Prefetcher(workers, stats) if workers > 0 else None
    core = Core(source, cache, stats, namespace=source_namespace(config.source),
                block_size=config.block_size, metadata_ttl=config.metadata_ttl,
                negative_ttl=config.negative_ttl, prefetcher=prefetcher, readahead=config.readahead,
                source_timeout=config.source_timeout)
    if prefetcher is not None:
        prefetcher.start()
    return core


STORE_DIR = "store"  # the NVMe tier under the cache dir; "blocks" held the diskcache format


def _drop_old_format(cache_dir: str) -> None:
    """Remove an NVMe tier of the older format (diskcache, until version 0.1): its blocks
    cannot be passed through, and nothing reads them any more."""
    old = os.path.join(cache_dir, "blocks")
    if os.path.isfile(os.path.join(old, "cache.db")):
        shutil.rmtree(old, ignore_errors=True)
        log.warning("removed the NVMe tier of an older cachefs in %s (a format this version does not read); "
                    "its files will be fetched again", old)


def control_handlers(core) -> dict:  # type: ignore[no-untyped-def]
    """What the control socket answers (see cachefs/control.py)."""
    from cachefs.control import follow

    def stats(request: dict, send) -> dict:  # type: ignore[no-untyped-def]
        return core.stats.snapshot()

    def warm(request: dict, send) -> dict:  # type: ignore[no-untyped-def]
        paths = [str(p) for p in request["paths"]]
        job = core.start_warm(paths)
        try:
            follow(job.progress, lambda: job.done, send, float(request.get("interval", 0.5)))
            result = job.progress()
        finally:
            core.finish_warm(job)  # a client that went away (Ctrl-C) stops its warm
        return result

    def coverage_of(request: dict, send) -> dict:  # type: ignore[no-untyped-def]
        from cachefs.coverage import coverage

        return coverage(core, str(request["path"]), progress=send, every=float(request.get("interval", 0.5)))

    return {"stats": stats, "warm": warm, "coverage": coverage_of, "ping": lambda request, send: {"pong": True}}


def control_streams(core) -> dict:  # type: ignore[no-untyped-def]
    """Streaming requests of the control socket: order hints (cachefs/hints.py)."""

    def hint(request: dict, send, receive) -> dict:  # type: ignore[no-untyped-def]
        board = core.hints
        if board is None:
            raise RuntimeError("order hints need the prefetch pool (--prefetch-workers > 0)")
        session = board.open(str(request.get("label", ""))[:200], int(request.get("lookahead", 0)) or 1)
        try:
            send({"session": session.id, "budget_bytes": board.budget()})
            while (message := receive()) is not None:
                board.add(session, [str(p) for p in message.get("paths", ())], int(message.get("yielded", 0)))
        except (OSError, ValueError):
            pass  # the job went away mid-line (kill -9): the same as a clean end
        finally:
            board.close(session)
        return {"session": session.id}

    return {"hint": hint}


def _warm_at_mount(core) -> None:  # type: ignore[no-untyped-def]
    job = core.start_warm(["/"])
    while not job.done:
        time.sleep(0.5)
    p = job.progress()
    core.finish_warm(job)
    log.warning("--warm finished (%s): %d files loaded (%s), %d already cached, %d did not fit, %d failed, %.0fs",
                p["state"], p["files_loaded"], format_size(p["bytes_loaded"]), p["files_cached"],
                p["files_total"] - p["files_done"] + p["files_no_room"], p["files_failed"], p["elapsed_s"])


def _limit_malloc_arenas() -> None:
    """Cap glibc's malloc arenas (see config.MALLOC_ARENAS); a no-op on other C libraries."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-8, MALLOC_ARENAS)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def serve(config: Config, on_ready: Callable[[], None] | None = None) -> None:
    """Build the stack, mount, and serve until unmounted or told to stop (blocks).

    SIGTERM, SIGINT and SIGHUP unmount (lazily: files still open keep being served for
    SHUTDOWN_GRACE seconds), then the cache is written out and serve() returns.
    """
    from cachefs import fuse
    from cachefs.control import ControlServer, address_for
    from cachefs.fs import CachefsFS

    os.umask(0o077)  # every file the daemon creates (cache blocks, logs) is private
    _limit_malloc_arenas()
    prepare_cache_dir(config)
    core = build_core(config)
    control = ControlServer(address_for(config.mountpoint), control_handlers(core), streams=control_streams(core))
    control.start()
    info = {"version": __version__, "source": config.source, "mountpoint": config.mountpoint,
            "cache_dir": config.cache_dir, "log_file": config.log_file,
            "control": control.address.replace("\0", "@", 1)}
    metrics = None
    fd = -1
    session: fuse.Session | None = None
    try:
        if config.metrics_addr:
            from cachefs.metrics import start_metrics_server

            metrics = start_metrics_server(core.stats, config.metrics_addr)
            host, port = metrics.server_address[:2]
            info["metrics"] = f"http://{host}:{port}/metrics"
            core.stats.set_info(metrics=info["metrics"])
            log.info("Prometheus metrics at %s", info["metrics"])
        fs = CachefsFS(core, config, info=info)
        try:
            fd = fuse.mount(config.mountpoint, config.source, "cachefs", allow_other=config.allow_other,
                            max_read=MAX_READ)
        except fuse.MountError as exc:
            raise RuntimeError(exc.strerror or str(exc)) from None
        session = fuse.Session(fd, fs, readers=FUSE_READERS, max_threads=FUSE_MAX_THREADS, max_read=MAX_READ,
                               observer=fs.observe)
        stop = _stop_on_signals(config.mountpoint, session)
        session.negotiate()
        fs.start_serving(session.conn)
        start_fetchers(core, config)
        session.start()
        threading.Thread(target=tune_readahead, args=(config.mountpoint,), daemon=True).start()
        if config.warm:
            threading.Thread(target=_warm_at_mount, args=(core,), name="cachefs-warm", daemon=True).start()
        if on_ready is not None:
            on_ready()
        session.wait()
        if stop.is_set():
            log.info("unmounted %s after a signal", config.mountpoint)
        fs.destroy()
    finally:
        if session is not None:
            session.stop()
            session.close()
        if fd >= 0:
            os.close(fd)
        if metrics is not None:
            metrics.shutdown()
        control.close()
        core.close()


def start_fetchers(core, config: Config) -> None:  # type: ignore[no-untyped-def]
    """Fetch processes for passthrough fills into the NVMe tier (cachefs/fetcher.py)."""
    n = config.fetch_processes if config.fetch_processes is not None else default_fetch_processes()
    if n <= 0 or not core.fills_to_disk or core.prefetcher is None:
        return
    from cachefs.fetcher import Fetchers

    channels = core.prefetcher.workers + 4
    core.fetchers = Fetchers(core.source.root, core.cache.disk.data_dir, core.namespace, core.block_size, n,
                             channels)
    log.info("fetch processes: %d (%d channels)", n, channels)


def _stop_on_signals(mountpoint: str, session) -> threading.Event:  # type: ignore[no-untyped-def]
    """SIGTERM, SIGINT and SIGHUP: unmount lazily, and stop serving once the files still
    open are closed or SHUTDOWN_GRACE has passed. Returns the event set by a signal."""
    from cachefs import fuse

    stop = threading.Event()

    def shutdown() -> None:
        try:
            fuse.unmount(mountpoint, lazy=True)
        except fuse.MountError as exc:
            log.warning("unmounting %s failed: %s", mountpoint, exc)
        time.sleep(SHUTDOWN_GRACE)  # the session ends before this when no file is open
        session.stop()

    def handler(signum: int, _frame: object) -> None:
        if not stop.is_set():
            stop.set()
            threading.Thread(target=shutdown, name="cachefs-shutdown", daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, handler)
    return stop


def tune_readahead(mountpoint: str, size: int = MAX_READ) -> None:
    """Raise the kernel read-ahead of this mount from 128 KiB to `size` (root only).

    FUSE mounts get the kernel's default 128 KiB window, so a sequential reader reaches
    the daemon in 128 KiB requests; 1 MiB cuts the round trips into Python eightfold
    (measured: a 10 MB file went from 77 read requests to 10).
    """
    try:
        st = os.stat(mountpoint)
        path = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
        with open(path, "w") as f:
            f.write(str(size // 1024))
        log.info("kernel read-ahead of %s set to %d KiB", mountpoint, size // 1024)
    except OSError as exc:
        log.info("kernel read-ahead left at its default (%s); run as root to raise it", exc)


def setup_logging(verbose: int, log_file: str | None) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler: logging.Handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def mount(config: Config, out: Callable[[str], None] = print, check_only: bool = False) -> int:
    """`cachefs mount`: validate, then serve in the foreground or as a daemon (or, with
    `check_only`, say that it would)."""
    os.umask(0o077)  # the cache dir, its blocks and the log are private to this user
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
        setup_logging(config.verbose, config.log_file)

        def ready() -> None:
            out(f"cachefs: mounted {summary}; Ctrl-C to unmount")
            sd_notify(f"READY=1\nSTATUS=serving {config.source} at {config.mountpoint}")

        try:
            serve(config, on_ready=ready)
        except (OSError, RuntimeError) as exc:
            log.debug("%s", traceback.format_exc())
            print(f"cachefs: error: mount failed: {exc}", file=sys.stderr)
            return 1
        return 0

    assert config.log_file is not None
    try:
        log_start = os.path.getsize(config.log_file)  # what this mount adds to the log starts here
    except OSError:
        log_start = 0
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(rfd)
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
            setup_logging(config.verbose, config.log_file)

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

    os.close(wfd)
    deadline = time.monotonic() + MOUNT_READY_TIMEOUT
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
    text = message.decode(errors="replace").strip()
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


def sd_notify(message: str) -> bool:
    """Tell systemd (a Type=notify unit, see docs/admin.md) about our state; a no-op
    outside systemd. Returns whether the message was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", address, exc.strerror)
        return False


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


# -- control client ------------------------------------------------------------------------

def read_control(mountpoint: str, name: str) -> dict:
    """Read one user.cachefs.* attribute of a live cachefs mount as JSON."""
    mp = os.path.abspath(mountpoint)
    entry = find_mount(mp)
    if entry is None or entry.fstype != FSTYPE:
        raise CachefsError(f"{mountpoint} is not a cachefs mount point")
    try:
        raw = os.getxattr(mp, name)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise CachefsError(f"{mp} is a stale cachefs mount (its daemon died); run: cachefs umount {mp}") from None
        raise CachefsError(f"cannot read stats of {mp}: {exc.strerror}") from None
    return json.loads(raw)


def control_address(mountpoint: str) -> str:
    info = read_control(mountpoint, "user.cachefs.info")
    address = info.get("control")
    if not address:
        raise CachefsError(f"the daemon of {mountpoint} has no control socket (an older cachefs?)")
    return "\0" + address[1:] if address.startswith("@") else address


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, path inside the mount as '/a/b') of a path on a cachefs mount."""
    real = os.path.realpath(os.path.abspath(path))
    best = None
    for entry in cachefs_mounts():
        if _inside(real, entry.mountpoint) and (best is None or len(entry.mountpoint) > len(best)):
            best = entry.mountpoint
    if best is None:
        raise CachefsError(f"{path} is not on a cachefs mount")
    rel = "/" + os.path.relpath(real, best) if real != best else "/"
    return best, "/" if rel == "/." else rel


def unmount(mountpoint: str, timeout: float = 30.0) -> str:
    """Unmount a cachefs mount and wait for its daemon to finish writing the cache."""
    mp = os.path.abspath(mountpoint)
    entry = find_mount(mp)
    if entry is None:
        raise CachefsError(f"{mountpoint} is not mounted")
    if entry.fstype != FSTYPE:
        raise CachefsError(f"{mountpoint} is a {entry.fstype} mount, not cachefs")
    if is_stale(mp):
        problem = kernel_unmount(mp, lazy=True)
        if problem is not None:
            raise CachefsError(f"could not clear the stale mount {mp}: {problem}")
        return f"cleared stale mount {mp} (its daemon had died)"
    pid = None
    try:
        pid = int(json.loads(os.getxattr(mp, "user.cachefs.info"))["pid"])
    except (OSError, ValueError, KeyError):
        pass
    problem = kernel_unmount(mp)
    if problem is not None:
        if "busy" in problem.lower():
            raise CachefsError(f"{mp} is busy: close the files and shells using it, then retry")
        raise CachefsError(f"unmounting {mp} failed: {problem}")
    if pid is not None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            return f"unmounted {mp}; its daemon (pid {pid}) is still finishing cache writes"
    return f"unmounted {mp}"
