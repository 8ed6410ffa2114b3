"""Checking a mount request before anything is written or mounted: the source, the mount
point, the cache dir, the sizes and options, with a one-line error for each mistake; and
the defaults that depend on the machine (sizes, read-ahead workers).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import stat
import tempfile

import psutil

from cachefs.config import (
    DEFAULT_DISK_FRACTION,
    DEFAULT_DISK_MAX,
    DEFAULT_MIN_FREE_FRACTION,
    DEFAULT_MIN_FREE_MAX,
    DEFAULT_PREFETCH_WORKERS,
    DEFAULT_RAM_FRACTION,
    DEFAULT_RAM_MAX,
    ROTATIONAL_PREFETCH_WORKERS,
    Config,
    default_fetch_processes,
    default_serve_processes,
    format_size,
    stores_ordered,
)
from cachefs.errors import CachefsError
from cachefs.mounttable import FSTYPE, _inside, find_mount, fusermount_available, kernel_unmount, probe

log = logging.getLogger(__name__)


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


def hung_mount(mp: str) -> CachefsError:
    """A mount point whose daemon is alive but does not answer: never mounted over."""
    return CachefsError(f"{mp} is already a cachefs mount point, and its daemon does not answer "
                        f"(stopped or hung); unmount it first: cachefs umount {mp}")


def validate(config: Config, check_only: bool = False) -> list[str]:
    """Check a mount request; raise CachefsError (exit 2) on bad input, return notices.

    Writes nothing, except (only once every other check has passed) clearing a stale
    cachefs mount left at the mount point by a dead daemon, which the notices report,
    and creating the cache dir. With `check_only` (`cachefs mount --check`, `mount -f`)
    it writes nothing at all and says what it would do. The checks run in this order, so
    that the first problem a user meets is the one reported.
    """
    # Relative paths are the caller's: resolve them before anything (the daemon runs in /).
    config.cache_dir = os.path.abspath(os.path.expanduser(config.cache_dir))
    src = _checked_source(config)
    mp, stale = _checked_mount_point(config, src)
    cache = _checked_cache_dir(config, src, mp)
    _check_log_file(config, src, mp, cache)
    _check_extras(config)
    _check_numbers(config, src)
    notices = _checked_budgets(config, cache)
    _check_fuse(config)
    notices += _prepared_mount_point(config, mp, stale, check_only)
    if check_only:
        parent = _nearest_existing(cache)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CachefsError(f"cache dir {cache} is not writable: {parent} is not writable by this user")
    else:
        _probe_cache_dir(cache)  # last: it creates the cache dir
    config.source, config.mountpoint, config.cache_dir = src, mp, cache
    return notices


def _checked_source(config: Config) -> str:
    """The source's real path, once it is a directory this user can read."""
    src = os.path.abspath(config.source)
    try:
        os.stat(src)
    except PermissionError:
        raise CachefsError(f"source {config.source!r} cannot be reached by this user: permission denied "
                           "(a directory on its path is not searchable, or it is another user's FUSE or "
                           "network mount)") from None
    except FileNotFoundError:
        raise CachefsError(f"source {config.source!r} does not exist") from None
    except OSError as exc:
        raise CachefsError(f"source {config.source!r} cannot be reached: {exc.strerror}") from None
    if not os.path.isdir(src):
        raise CachefsError(f"source {config.source!r} is not a directory")
    if not os.access(src, os.R_OK | os.X_OK):
        raise CachefsError(f"source {config.source!r} is not readable by this user")
    src = os.path.realpath(src)

    return src


def _checked_mount_point(config: Config, src: str) -> tuple[str, bool]:
    """The mount point's path, and whether a dead cachefs mount sits on it."""
    state, mp = probe(config.mountpoint)
    if state == "hung":
        raise hung_mount(mp)
    stale = state == "dead"
    if stale:
        entry = find_mount(mp)
        if entry is None or entry.fstype != FSTYPE:
            kind = entry.fstype if entry else "unknown"
            raise CachefsError(f"{mp} is a dead mount of type {kind}; unmount it first: fusermount3 -uz {mp}")
    if _inside(mp, src):
        raise CachefsError(f"mount point {mp} is inside the source {src}: the mount would contain itself")
    if _inside(src, mp):
        raise CachefsError(f"source {src} is inside the mount point {mp}: the mount would hide it")

    return mp, stale


def _checked_cache_dir(config: Config, src: str, mp: str) -> str:
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
    return cache


def _check_log_file(config: Config, src: str, mp: str, cache: str) -> None:
    if config.log_file is not None:
        log_file = os.path.realpath(os.path.abspath(config.log_file))
        if _inside(log_file, src) or _inside(log_file, mp):
            raise CachefsError(f"log file {log_file} is inside the source or the mount point")
        if os.path.isdir(log_file):
            raise CachefsError(f"log file {config.log_file!r} is a directory")
        if os.path.exists(log_file) and not stat.S_ISREG(os.stat(log_file).st_mode):
            raise CachefsError(f"log file {config.log_file!r} is not a regular file (a FIFO, a device, ...)")
        parent = os.path.dirname(log_file)
        if not _inside(parent, cache) and not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            raise CachefsError(f"cannot write the log file {config.log_file!r}: {parent} is not a writable directory")
        config.log_file = log_file


def _check_extras(config: Config) -> None:
    """Options that need a package cachefs does not require."""
    if config.shared_cache:
        try:
            import pymemcache  # noqa: F401 - only whether it is there
        except ImportError:
            raise CachefsError("--shared-cache needs pymemcache in cachefs's environment: "
                               "pip install pymemcache") from None
    if config.metrics_addr:
        try:
            import prometheus_client  # noqa: F401 - only whether it is there
        except ImportError:
            raise CachefsError("--metrics-addr needs prometheus-client in cachefs's environment: "
                               "pip install prometheus-client") from None
        _check_port_free(config.metrics_addr)


def _check_numbers(config: Config, src: str) -> None:
    """Values each option must hold, and the defaults that depend on the machine."""
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
    if config.serve_processes is None:
        config.serve_processes = default_serve_processes()
    if not 0 <= config.serve_processes <= 64:
        raise CachefsError(f"--serve-processes {config.serve_processes} must be between 0 and 64")
    if config.backing_files is not None and not 1 <= config.backing_files <= 1 << 31:
        raise CachefsError(f"--backing-files {config.backing_files} must be between 1 and {1 << 31}")
    if config.serve_processes and not stores_ordered():
        raise CachefsError(f"--serve-processes needs an x86-64 CPU (this is {platform.machine()}: its memory "
                           "stores may reach other cores out of order, which the serving processes' shared "
                           "table cannot guard against); use --serve-processes 0")
    if config.warm and config.prefetch_workers == 0:
        raise CachefsError("--warm needs --prefetch-workers of at least 1")


def _checked_budgets(config: Config, cache: str) -> list[str]:
    """The tiers' budgets against this machine's memory and cache disk; notices."""
    notices: list[str] = []
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
    most = usage.total - config.min_free
    if config.disk_size and config.disk_size > most:
        notices.append(f"note: --disk-size {format_size(config.disk_size)} is more than the cache disk can ever "
                       f"hold ({format_size(usage.total)}, {format_size(config.min_free)} of it kept free by "
                       f"--min-free): the NVMe tier's budget is {format_size(most)}")
        config.disk_size = most
    if config.disk_size > free:
        notices.append(f"warning: --disk-size {format_size(config.disk_size)} is more than the "
                       f"{format_size(free)} free on the cache disk: the NVMe tier holds what fits")
    if config.ram_size == 0:
        notices.append("note: --ram-size 0: no RAM tier of cachefs's own; what is read comes from the NVMe "
                       "tier (and the kernel's page cache)" if config.disk_size else
                       "note: --ram-size 0 and --disk-size 0: nothing is cached by cachefs; every read "
                       "goes to the source (the kernel's page cache still keeps what fits)")
    for other in _mounts_sharing(cache):
        notices.append(f"warning: {other} uses this cache dir too: each daemon counts the other's files "
                       "only from its next start, so together they can exceed --disk-size (give each "
                       "mount its own --cache-dir)")
    return notices


def _check_fuse(config: Config) -> None:
    """What mounting needs from this machine: /dev/fuse, fusermount3, fuse.conf."""
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



def _prepared_mount_point(config: Config, mp: str, stale: bool, check_only: bool) -> list[str]:
    """Clear a stale cachefs mount (unless `check_only`), then check the mount point is an
    empty directory that is not mounted; notices."""
    notices: list[str] = []
    if stale and check_only:
        notices.append(f"would clear a stale cachefs mount at {mp} (its daemon had died)")
    elif stale:
        problem = kernel_unmount(mp, lazy=True)
        if problem is not None or probe(mp)[0] == "dead":
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
    return notices


def _check_port_free(addr: str) -> None:
    """--metrics-addr: the port must be free now (checked before the cache dir is made)."""
    import socket

    from cachefs.metrics import parse_metrics_addr

    host, port = parse_metrics_addr(addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CachefsError(f"--metrics-addr {addr}: cannot listen on {host}:{port}: {exc.strerror}") from None


def _mounts_sharing(cache: str) -> list[str]:
    """Other live cachefs mounts whose daemon uses the cache dir `cache`."""
    from cachefs.mounttable import cachefs_mounts, read_control

    out = []
    for entry in cachefs_mounts():
        try:
            info = read_control(entry.mountpoint, "user.cachefs.info", timeout=2.0)
        except (CachefsError, OSError, ValueError):
            continue  # stale, hung or another user's: not ours to count
        if info and os.path.realpath(str(info.get("cache_dir", ""))) == cache:
            out.append(entry.mountpoint)
    return out


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


def prepare_cache_dir(config: Config) -> None:
    os.makedirs(config.cache_dir, mode=0o700, exist_ok=True)
    os.chmod(config.cache_dir, 0o700)


def default_log_file(config: Config) -> str:
    return os.path.join(config.cache_dir, "cachefs.log")

