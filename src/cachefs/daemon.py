"""The daemon: build the cache and the core from a checked Config, mount, serve until
unmounted or told to stop, and shut down cleanly (signals, the fetch processes, the
NVMe tier's clean mark).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from cachefs import __version__
from cachefs.config import (
    DEFAULT_PREFETCH_WORKERS,
    FUSE_MAX_THREADS,
    FUSE_READERS,
    GC_THRESHOLDS,
    MALLOC_ARENAS,
    MAX_READ,
    SHUTDOWN_GRACE,
    Config,
    default_fetch_processes,
    format_size,
)
from cachefs.policy import parse_policy_spec
from cachefs.validate import prepare_cache_dir

log = logging.getLogger(__name__)


def build_core(config: Config, hooks=None):  # type: ignore[no-untyped-def]  # -> Core (lazy imports: the CLI imports this module cheaply)
    """The daemon's stack from a checked Config: the source, the tiers, the core. The
    FUSE layer is given `hooks` (cachefs.hooks.KernelHooks) to tell the core what INIT
    decided."""
    from cachefs.core import Core, source_namespace
    from cachefs.hints import attach
    from cachefs.prefetch import Prefetcher
    from cachefs.source import open_source
    from cachefs.stats import Stats
    from cachefs.tiers.build import build_cache

    stats = Stats()
    stats.set_info(version=__version__, source=config.source, mountpoint=config.mountpoint,
                   cache_dir=config.cache_dir, block_size=config.block_size,
                   metadata_ttl=config.metadata_ttl, readahead=config.readahead,
                   source_timeout_s=config.source_timeout,
                   prefetch_workers=config.prefetch_workers, fetch_processes=config.fetch_processes)
    source = open_source(config.source)
    policies = parse_policy_spec(config.policy)
    stats.set_info(policy=policies, max_idle_s=config.max_idle, min_free=config.min_free)
    cache = build_cache(config, policies, stats)
    workers = config.prefetch_workers if config.prefetch_workers is not None else DEFAULT_PREFETCH_WORKERS
    prefetcher = Prefetcher(workers, stats) if workers > 0 else None
    core = Core(source, cache, stats, namespace=source_namespace(config.source),
                block_size=config.block_size, metadata_ttl=config.metadata_ttl,
                negative_ttl=config.negative_ttl, prefetcher=prefetcher, readahead=config.readahead,
                source_timeout=config.source_timeout,
                check_acls=config.allow_other,  # other users: never more than the source's ACLs grant
                hooks=hooks, hints=attach if prefetcher is not None else None)  # order hints
    if prefetcher is not None:
        prefetcher.start()
    return core


def _paths_of(request: dict) -> list[str]:
    """A request's "paths": a non-empty list of paths under the mount ("/"-rooted)."""
    paths = request.get("paths")
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p.startswith("/") for p in paths):
        raise ValueError("paths must be a non-empty list of strings starting with /")
    return paths


def _interval_of(request: dict) -> float:
    """A request's progress "interval" (seconds, 0.05 to 60; 0.5 if not given)."""
    interval = request.get("interval", 0.5)
    if type(interval) not in (int, float) or not 0.05 <= interval <= 60:
        raise ValueError("interval must be a number of seconds from 0.05 to 60")
    return float(interval)


def control_handlers(core) -> dict:  # type: ignore[no-untyped-def]
    """What the control socket answers (see cachefs/control.py)."""
    from cachefs.control import follow

    def stats(request: dict, send) -> dict:  # type: ignore[no-untyped-def]
        return core.stats.snapshot()

    def warm(request: dict, send) -> dict:  # type: ignore[no-untyped-def]
        from cachefs import warm as warming

        paths = _paths_of(request)
        shard = request.get("shard")
        if shard is not None and not (isinstance(shard, list) and len(shard) == 2
                                      and all(type(x) is int for x in shard) and 0 <= shard[0] < shard[1]):
            raise ValueError("shard must be [RANK, WORLD] with 0 <= RANK < WORLD")
        interval = _interval_of(request)
        job = warming.start(core, paths, (shard[0], shard[1]) if shard else None)
        try:
            follow(job.progress, lambda: job.done, send, interval)
            if core.cache.shares:  # done means the other nodes can read it
                follow(job.progress, lambda: core.cache.drain_shared(0.0), send, interval)
            result = job.progress()
        finally:
            warming.finish(core, job)  # a client that went away (Ctrl-C) stops its warm
        return result

    def coverage_of(request: dict, send) -> dict:  # type: ignore[no-untyped-def]
        from cachefs.coverage import coverage

        path = request.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError("path must be a string starting with /")
        return coverage(core, path, progress=send, every=_interval_of(request), exact=request.get("exact") is True)

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
    from cachefs import warm as warming

    job = warming.start(core, ["/"])
    while not job.done:
        time.sleep(0.5)
    p = job.progress()
    warming.finish(core, job)
    log.warning("--warm finished (%s): %d files loaded (%s), %d already cached, %d did not fit, %d failed, %.0fs",
                p["state"], p["files_loaded"], format_size(p["bytes_loaded"]), p["files_cached"],
                p["files_total"] - p["files_done"] + p["files_no_room"], p["files_failed"], p["elapsed_s"])


def _tune_gc() -> None:
    """The daemon keeps millions of long-lived objects (per cached file, per node): with
    the interpreter's default thresholds a collection of them all ran 17 times in the
    first epoch after a remount of 200,000 files (2.7 million objects), 5.7 s of CPU in
    all, up to 1.15 s at once with the interpreter lock held (every request waited).
    Young collections every 10,000 new objects instead of 700, and a full one every 100
    middle ones instead of 10: none in that epoch, and 0.02 ms less CPU per file. What
    the daemon frees it frees by reference counts; the collector is for cycles, which
    its long-lived objects do not form."""
    gc.set_threshold(*GC_THRESHOLDS)


def _limit_malloc_arenas() -> None:
    """Cap glibc's malloc arenas (see config.MALLOC_ARENAS); a no-op on other C libraries."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-8, MALLOC_ARENAS)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


# Long (69 lines) for a reason: the daemon's life in order (build, mount, serve, tear down)
# under one try/finally, so that every exit path releases what was made.
def serve(config: Config, on_ready: Callable[[], None] | None = None) -> None:
    """Build the stack, mount, and serve until unmounted or told to stop (blocks).

    SIGTERM, SIGINT and SIGHUP unmount (lazily: files still open keep being served for
    SHUTDOWN_GRACE seconds), then the cache is written out and serve() returns.
    """
    from cachefs import fuse
    from cachefs.control import ControlServer, address_for
    from cachefs.directio import raise_descriptor_limit
    from cachefs.fs import CachefsFS
    from cachefs.hints import HintBoard

    os.umask(0o077)  # every file the daemon creates (cache blocks, logs) is private
    _limit_malloc_arenas()
    _tune_gc()
    log.info("file descriptors: up to %d (the caches of open files take a share of it)", raise_descriptor_limit())
    prepare_cache_dir(config)
    from cachefs.hooks import KernelHooks

    hooks = KernelHooks()  # what the file system learns at INIT, for the core
    core = build_core(config, hooks)
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
                               observer=fs.observe, on_reply_failed=fs.reply_failed)
        session.trace = config.debug_fuse
        stop = _stop_on_signals(config.mountpoint, session)
        session.negotiate()
        fs.start_serving(session.conn)
        if isinstance(core.hints, HintBoard):
            core.hints.watch(fs.hint_sessions)
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
    cache = core.cache
    # the source's resolved root: a fetch process given the descriptor resolves nothing
    # (a realpath of a network mount's root is a request to it at every start)
    root = getattr(core.source, "root", config.source)
    core.use_fetchers(Fetchers(root, cache.fill_dir, core.namespace, core.block_size, n, channels,
                               _root_fd(core.source), config.shared_cache if cache.shares else None,
                               cache.shared_namespace, cache.ram_fill_dir))
    log.info("fetch processes: %d (%d channels)", n, channels)


def _root_fd(source) -> int:  # type: ignore[no-untyped-def]
    """The source's descriptor of its root, which fetch processes inherit (so they serve
    the tree the mount serves, whatever the path names later); -1 if it has none."""
    root_fd = getattr(source, "root_fd", None)
    return root_fd() if root_fd is not None else -1


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

