"""Configuration: every default and tuning constant in one place, with its unit and the
reason for it; the daemon's parts' constants are grouped by part at the end.

Not here, on purpose: the cache policy's parameters (cachefs/policy.py: they are the
algorithm, shared with tools/simulate.py), facts of the kernel's and the formats'
interfaces (fuse/protocol.py, the index and shared-tier item layouts), and the job-side
helpers' own (diagnose, hintclient), which must not import the daemon's configuration.
The options of `cachefs mount` are declared in cachefs/options.py."""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field

from cachefs.errors import CachefsError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Cache block size (bytes). A file up to this size is one block; larger files are split.
# 1 MiB, measured with tools/blocksize.py (docs/benchmarks.md, "Choosing the block size"): cold random
# 128 KiB reads of a big file ran 2.1x faster than with 4 MiB blocks and pulled 3x fewer
# bytes from the store (8.6x vs 26.9x what was asked); larger blocks only helped a
# sequential read without read-ahead (1.26x at 4 MiB), which read-ahead serves better.
# It also equals the largest kernel read request, so one request maps to one block.
DEFAULT_BLOCK_SIZE = 1 * MiB

# Read-ahead: "off", "file" (ahead of sequential readers inside big files) or "dir" (that,
# plus the not-yet-read files of every directory the job reads, in sorted order).
READAHEAD_MODES = ("off", "file", "dir")
DEFAULT_READAHEAD = "dir"

# Furthest a sequential reader is read ahead (bytes), and the most of one file that
# directory read-ahead fetches before the reader shows up.
DEFAULT_READAHEAD_MAX = 32 * MiB

# Source fetchers in the prefetch pool (read-ahead and warming; demand misses run in the
# reader's own FUSE thread): 16 for a network store, 8 when the source is a local
# spinning disk. Measured in docs/benchmarks.md.
DEFAULT_PREFETCH_WORKERS = 16


def default_fetch_processes() -> int:
    """Fetch processes for passthrough fills (cachefs/fetcher.py): one per two cores, at
    least one, at most four. One was as fast as four on 2 cores (docs/design.md)."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))
ROTATIONAL_PREFETCH_WORKERS = 8


def stores_ordered(machine: str | None = None) -> bool:
    """Whether this CPU makes one core's memory stores visible to the others in program
    order (x86-64), which the serving processes' shared table relies on: Python has no
    memory fences (docs/design.md, "Serving processes")."""
    return (machine or platform.machine()).lower() in ("x86_64", "amd64", "i386", "i686")


def default_serve_processes() -> int:
    """Serving processes for passthrough (cachefs/fuse/serve.py): one per two cores, at
    least one, at most eight (docs/design.md: sizing); none where stores_ordered() is not so."""
    if not stores_ordered():
        return 0
    return max(1, min(8, (os.cpu_count() or 1) // 2))


# Node ids the serving processes' table holds (4 bytes each, plus 4 per serving process,
# in a sparse shared file: pages are touched only for the ids in use). Node ids are reused
# after the kernel forgets them, so this bounds the nodes the kernel holds at once, not the
# files of a tree; a node beyond it has its opens answered by the main process.
NODE_TABLE_CAPACITY = 1 << 24
# Seconds before a table node's switch to the copy RAM holds (or, once RAM let it go, to
# the NVMe tier's) is tried again when its registration could not be closed: a reader had
# the other copy open (see tablenodes.py, _close_rows). Doubled while the tries close
# nothing (a file held open for hours), up to SWITCH_RETRY_MAX: an idle mount stays idle.
SWITCH_RETRY = 0.1
SWITCH_RETRY_MAX = 10.0

# Seconds between two looks, in a mount that started without an entry table, at whether the
# NVMe tier has passed --backing-files (or CHECKPOINT_MIN_FILES) and stopped growing: then its
# entries are written as a table whose records the serving processes answer (a checkpoint,
# see checkpointing.py), and those that are idle leave the daemon's memory for it (about 1 KB
# each in memory; 22 bytes of columns and a 211-byte record on disk).
CHECKPOINT_EVERY = 5.0
CHECKPOINT_MIN_FILES = 16384  # fewer files than this cost the daemon less than ~45 MB kept in memory
CHECKPOINT_QUIET = 1000   # stopped growing: by less than 1/1000 of the files held since the last look
CHECKPOINT_NEXT = 8       # a next generation: the files stored since are more than 1/8 of the table's
# While a cold epoch still fetches, a next generation once the files stored since are more than
# 1/CHECKPOINT_GROWING of the table's: the daemon holds at most the last ninth of the files in
# memory (a half at each doubling, then a fifth at each quarter, had set the first mount's
# high-water mark), for tables written that add up to less than nine times the last (each
# generation is written at most once per CHECKPOINT_EVERY: 4.7 times at 200,000 files)
CHECKPOINT_GROWING = 8

# Names published ahead (cachefs/published.py, _publish_dir): the cached files of a
# directory the daemon looks a file up in are published to the serving processes before
# their first lookup, up to the names' limit less AHEAD_ROOM (left to the
# job's own lookups); directories remembered as done, at most AHEAD_DIRS_MAX (then forgotten
# and done again: a published name is skipped).
AHEAD_ROOM = 8192
AHEAD_DIRS_MAX = 100_000

# Metadata TTL (seconds) for stat results and directory listings, in cachefs and in the
# kernel. Training data sets are immutable while a job runs; an hour keeps a whole epoch
# from ever asking the source for metadata twice. Use --metadata-ttl 1 for a changing tree.
DEFAULT_METADATA_TTL = 3600.0

# Negative lookups (ENOENT) are cached this long (seconds): short, because a file that
# appears on the source should appear in the mount soon.
DEFAULT_NEGATIVE_TTL = 5.0

# A source request taking longer than this (seconds) fails with ETIMEDOUT instead of
# blocking its reader: an NFS server that died, a hard-mounted share that hangs. The
# request runs on a thread of its own, so a hung one holds that thread, never the reader.
# 0 turns the limit off (requests then run in the caller's thread).
DEFAULT_SOURCE_TIMEOUT = 60.0

# Threads for source requests under --source-timeout: more than the FUSE threads and the
# prefetch pool together, so that a few hung requests starve nothing.
SOURCE_THREADS = 64

# After SOURCE_DOWN_AFTER requests in a row got no answer (timed out, or ENOTCONN from a
# dead mount), the source counts as down: other requests fail at once
# (ETIMEDOUT) instead of each waiting the full timeout, cached data and metadata keep being
# served (expired metadata too), and one request every this many seconds probes it.
SOURCE_RETRY = 5.0
SOURCE_DOWN_AFTER = 3

# Listings bring names and types, no attributes (see Metadata._list). Once a reader lists
# a directory, the directories a walk lists next (its subdirectories, in name order, up to
# LIST_AHEAD beyond the last one a reader listed) are stat'ed and listed ahead,
# LISTING_STAT_WORKERS at a time (see cachefs/listahead.py). The same workers fetch the
# attributes `cachefs stats --coverage --exact` needs.
LISTING_STAT_WORKERS = 16
LIST_AHEAD = 32

# RAM tier (bytes): a quarter of physical memory, at most 4 GiB, unless --ram-size says.
DEFAULT_RAM_FRACTION = 0.25
DEFAULT_RAM_MAX = 4 * GiB

# NVMe tier (bytes): half of the free space on the cache disk at mount time, at most 64 GiB.
DEFAULT_DISK_FRACTION = 0.5
DEFAULT_DISK_MAX = 64 * GiB

# Largest read the kernel sends in one request (bytes): the FUSE maximum on Linux >= 4.20.
MAX_READ = 1 * MiB

# How opens are served. "auto": FUSE passthrough where the kernel grants it and the
# daemon may register backing files (CAP_SYS_ADMIN), zero-message opens otherwise; "on":
# passthrough, falling back per open where refused; "off": zero-message opens. Passthrough
# wins once the data does not fit in RAM: a cached file's reads never reach the daemon;
# zero-message opens win while the page cache holds everything (no OPEN/RELEASE per file).
PASSTHROUGH_MODES = ("auto", "on", "off")
DEFAULT_PASSTHROUGH = "auto"

# Cold files up to this size are fetched whole when opened in passthrough mode, stored,
# and then read by the kernel directly; larger ones are served block by block (with
# read-ahead) until they are complete, and passed through from then on.
WHOLE_FILE_MAX = 16 * MiB

# Directory read-ahead with a shared tier: sibling files per fetch process request (one
# shared-tier round trip for all of them). Not without one: from the source a batch is as
# slow as its slowest file, and a reader waiting for one file waits for it (cold epoch
# 1,537 -> 1,359 files/s with batches of 16, for 0.12 ms less CPU per file).
DIR_BATCH = 16

# Seconds read-ahead and warming wait for room in the shared tier's put queue (so that
# what they fetch is shared); a reader's own miss never waits.
SHARED_PUT_WAIT = 30.0

# Blocks of big files a random reader missed once, remembered to fetch a block whole
# (in the background) when it is missed a second time.
MISSED_BLOCKS = 1 << 16

# Backing files kept registered with the kernel after the last open of their file closes
# (passthrough): the next epoch opens the same files, and registering one again (an open,
# the ioctl, and closing another to make room) was a fifth of a 200,000-file epoch's
# samples when 16,384 were kept: keeping them all made that epoch 1.4-1.6x as fast. Each
# costs about BACKING_BYTES (the kernel's open file, the cache file's inode it pins, the
# daemon's record), so at most 1/BACKING_RAM_SHARE of the machine's memory goes to them,
# and at least BACKING_CACHE_MIN are kept.
BACKING_CACHE_MIN = 16384
BACKING_BYTES = 1536
BACKING_RAM_SHARE = 64


def backing_limit(ram: int | None = None) -> int:
    """How many backing files to keep registered on a machine with `ram` bytes of memory
    (this one's by default)."""
    if ram is None:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(BACKING_CACHE_MIN, ram // BACKING_RAM_SHARE // BACKING_BYTES)

# FUSE request threads. FUSE_READERS of them take requests; one that waits on the source
# hands its place to another, up to FUSE_MAX_THREADS (the misses in flight: 8 DataLoader
# workers plus kernel read-ahead need more than 10). More readers than this only fight
# over the interpreter: measured on 2,000 cached files with 8 readers, daemon CPU per file
# 0.08 ms with 1 thread, 0.1 with 2-3, 0.15 with 4, 0.2 with 8 (cachefs/fuse/session.py).
# Once FUSE_MAX_THREADS threads exist and all but the last FUSE_READERS wait (a store that
# stopped answering under a job with many readers), a request that would wait too is
# refused with EAGAIN, so that those readers keep answering what needs no wait: the
# kernel's requests for cached files.
FUSE_READERS = 2
FUSE_MAX_THREADS = 64

# Seconds a daemon told to stop (SIGTERM, SIGINT, SIGHUP) keeps serving files that are
# still open after its lazy unmount, before it exits (and the kernel fails what is left).
SHUTDOWN_GRACE = 5.0

# Cache policy of both tiers: "keep" (admit until full, then keep what you have, with
# ageing; wins on every epoch pattern tools/simulate.py replays) or "lru". docs/design.md, "Cache policy".
DEFAULT_POLICY = "keep"

# A block unread this long (seconds) is evicted before any other, whatever the policy, so
# a dataset nobody reads any more does not lock a new one out. 0 turns the rule off.
DEFAULT_MAX_IDLE = 24 * 3600.0

# How often the NVMe tier re-reads every cached block to find bit rot (one bounded pass;
# 0: never). Blocks written since an unclean stop are checked after the next start (and by
# their first read, if it comes first) whatever this says.
DEFAULT_SCRUB_INTERVAL = 7 * 24 * 3600.0

# Space kept free on the cache disk (bytes): 5% of its size, at most 10 GiB, unless
# --min-free says. The NVMe tier shrinks when other programs fill the disk.
DEFAULT_MIN_FREE_FRACTION = 0.05
DEFAULT_MIN_FREE_MAX = 10 * GiB

# malloc arenas for the daemon's ~40 threads. glibc's default (8 per core) lets each thread
# keep freed blocks in an arena of its own, and RSS then drifts far above the RAM budget.
MALLOC_ARENAS = 2
GC_THRESHOLDS = (10_000, 10, 100)  # the daemon's collector (daemon._tune_gc): (700, 10, 10) by default

# Metadata entries kept in the daemon (stat results, extended attributes; a tenth as many
# listings). About 1.25 KB per file looked up, node ids and listings included (tools/metamem.py).
METADATA_MAX_ENTRIES = 500_000

# How long `cachefs mount` waits for the daemon to report the mount ready (seconds).
MOUNT_READY_TIMEOUT = 30.0

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kb": 1000, "kib": KiB,
    "m": MiB, "mb": 1000**2, "mib": MiB,
    "g": GiB, "gb": 1000**3, "gib": GiB,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """Parse '16GiB', '512M', '1.5GB', '4096' into bytes.

    KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of 1024 (as in rclone and dd);
    KB/MB/GB/TB are powers of 1000. Raises CachefsError on anything else.
    """
    if str(text).strip().startswith("-"):
        raise CachefsError(f"invalid {what} {text!r}: must not be negative")
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise CachefsError(
            f"invalid {what} {text!r}: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB), e.g. 16GiB"
        )
    try:
        return int(float(m.group(1)) * _UNITS[unit])
    except OverflowError:
        raise CachefsError(f"invalid {what} {text!r}: too large") from None


def format_size(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


MAX_DURATION = 365 * 24 * 3600  # seconds: the longest --metadata-ttl, --source-timeout, ...


def parse_duration(text: str, what: str = "duration") -> float:
    """Parse seconds, optionally with a unit: '30', '1.5s', '10m', '1h'."""
    m = re.match(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*(ms|s|m|h|)\s*$", str(text))
    if not m:
        raise CachefsError(f"invalid {what} {text!r}: expected seconds, e.g. 30, 500ms, 10m or 1h")
    scale = {"ms": 0.001, "s": 1, "": 1, "m": 60, "h": 3600}[m.group(2)]
    seconds = float(m.group(1)) * scale
    if seconds > MAX_DURATION:  # past what timers and the kernel's timeouts can hold
        raise CachefsError(f"invalid {what} {text!r}: at most {MAX_DURATION // 3600:.0f}h (a year)")
    return seconds


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cachefs")


@dataclass
class Config:
    """Everything a mount needs; built by the CLI, read by every layer."""

    source: str
    mountpoint: str
    cache_dir: str = field(default_factory=default_cache_dir)
    ram_size: int | None = None  # bytes; None = DEFAULT_RAM_* rule
    disk_size: int | None = None  # bytes; None = DEFAULT_DISK_* rule; 0 = no NVMe tier
    block_size: int = DEFAULT_BLOCK_SIZE
    metadata_ttl: float = DEFAULT_METADATA_TTL
    negative_ttl: float = DEFAULT_NEGATIVE_TTL
    foreground: bool = False
    allow_other: bool = False
    log_file: str | None = None
    verbose: int = 0
    debug_fuse: bool = False
    zero_message_open: bool = True
    passthrough: str = DEFAULT_PASSTHROUGH  # "auto", "on", "off"
    readahead: str = DEFAULT_READAHEAD
    prefetch_workers: int | None = None  # None: by the source's kind (see validate)
    fetch_processes: int | None = None  # None: default_fetch_processes(); 0 = fetch in the daemon
    serve_processes: int | None = None  # None: default_serve_processes(); 0 = the daemon answers all
    backing_files: int | None = None  # None: backing_limit() (by the machine's memory)
    warm: bool = False
    metrics_addr: str | None = None  # HOST:PORT of the Prometheus endpoint; None = off
    shared_cache: str | None = None  # memcached://HOST:PORT[,...]; None = no shared tier
    shared_namespace: str | None = None  # None = the source directory's name
    policy: str = DEFAULT_POLICY  # "keep", "lru", or per tier: "ram=lru,disk=keep"
    max_idle: float = DEFAULT_MAX_IDLE  # seconds; 0 = off
    scrub_interval: float = DEFAULT_SCRUB_INTERVAL  # seconds between full scrubs; 0 = never
    min_free: int | None = None  # bytes; None = DEFAULT_MIN_FREE_* rule
    source_timeout: float = DEFAULT_SOURCE_TIMEOUT  # seconds; 0 = off


# -- Demand first at the source (cachefs/gate.py) --------------------------------------

CONGESTED = 3.0      # a demand request this many times its floor (plus SLACK) is congested
SLACK = 0.003        # seconds: jitter that is not congestion (a store at 0.1 ms, a busy CPU)
FLOOR_CREEP = 0.05   # the floors rise this share per second without a lower sample

# -- The NVMe tier (cachefs/tiers/disk.py) ---------------------------------------------

SUSPEND_AFTER = 8       # cache-disk failures in a row that turn the tier off ...
SUSPEND_FOR = 60.0      # ... for this many seconds
EXACT_MARGIN = 8 << 20  # bytes: closer than this to a limit, every write re-measures
EXACT_EVERY = 256       # and at least every this many writes
INDEX_MIN = 64 << 10    # the index is compacted when it outgrows max(INDEX_MIN, 2 x its live part)
INDEX_FLUSH_BYTES = 64 << 10  # index lines are written in batches of this many bytes ...
INDEX_FLUSH_EVERY = 0.2       # ... or after this many seconds
SCRUB_RATE = 64 << 20   # bytes a second the restart check reads, for blocks it must read
# After a clean stop, an entry whose file has not changed since (ctime before the stop, the
# size recorded) is trusted without reading it: the restart check stats at most this many
# files a second, and a file changed within CLEAN_MARGIN_NS before the stop is read anyway.
TRUST_RATE = 20_000
CLEAN_MARGIN_NS = 2_000_000_000
# A serving process tests a file the same way when it registers a backing id for it (its
# open's, at an fstat): while such registrations come, the restart check waits (this many
# seconds without one), so as not to stat files the job is about to open and test anyway.
VOUCH_QUIET = 1.0
# After a start from the entry table, one pass deletes the files no entry describes (an
# orphan costs disk space only): at most this many files a second (1.5-2.2 us each: ~2% of
# a core), and only while the job opens no cached file, so that it does not land on an
# epoch.
SWEEP_RATE = 10_000
# The periodic pass over the whole tier for bit rot (--scrub-interval): at most this many
# bytes and blocks a second. Small files cost the scrub per block, not per byte: going
# round a 200,000-file tier at 4 MiB/s forever kept an idle mount at 17-25% of a core.
SCRUB_IDLE_RATE = 4 << 20
SCRUB_IDLE_BLOCKS = 50
WRITER_NICE = 19        # the scrub's nice value

# -- The shared tier (cachefs/tiers/shared.py) -----------------------------------------

DEFAULT_TIMEOUT = 0.5  # seconds: a node's NVMe answers in well under this; a live server too
DEFAULT_DOWN_FOR = 5.0
DEFAULT_PENDING_BYTES = 64 << 20  # puts waiting for the background thread

# -- The file stores (cachefs/tiers/store.py) ------------------------------------------

FD_CACHE = 256          # open descriptors kept for reading entry files

# -- The source (cachefs/source.py) ----------------------------------------------------

KEPT_FILES = 64  # big source files kept open between block reads

# -- The prefetch pool (cachefs/prefetch.py) -------------------------------------------

# Seconds an idle worker waits before it asks the feeders for work again, doubling while
# they have none, up to PREFETCH_POLL_MAX (a wake-up resets it).
PREFETCH_POLL = 0.2
PREFETCH_POLL_MAX = 2.0

# -- Fetch processes (cachefs/fetcher.py) ----------------------------------------------

BATCH_THREADS = 8  # source visits of one batch in parallel

# -- The control socket (cachefs/control.py) -------------------------------------------

# Bounds on what a connection may cost the daemon (every local user can reach the socket):
MAX_CONNECTIONS = 32       # the owner's (and root's) requests served at once; more are told "busy"
REQUEST_TIMEOUT = 10.0     # seconds a connection has to send its request line
REQUEST_MAX = 1 << 20      # bytes of a request line
REFUSALS_QUEUED = 64       # another user's connections waiting for their "permission denied"
REFUSAL_READ = 128 << 10   # bytes read from one of them (closing on unread data resets it)
REFUSAL_TIMEOUT = 0.5      # seconds spent on one of them
ACCEPT_RETRY = 0.1         # seconds before accept() is tried again after it failed (EMFILE)

# -- Order hints (cachefs/hints.py) ----------------------------------------------------

# Share of the RAM tier that hinted, not-yet-read blocks may hold, over all sessions. The
# rest keeps blocks read recently (two jobs on one dataset, a re-read), and a window this
# deep is far ahead of any reader: the pool fetches faster than a job consumes.
HINT_RAM_SHARE = 0.5
# A worker that finds hinted work wakes another while more than this share of the
# session's window is free (see HintBoard.__call__; tools/torchbench.py hint measured 16
# threads woken per read serving an NVMe-speed epoch 1.0x, one per read 1.3x).
WAKE_MORE_ROOM = 0.25
# A hinted block already on NVMe is fetched ahead into RAM only if an NVMe read takes at
# least this long (seconds, moving average). Below it, the reader's own read costs less
# CPU than fetching ahead, pinning and waking a pool thread: measured with
# tools/torchbench.py hint on this 2-core machine, where NVMe reads take ~0.2 ms, hinted
# epochs ran at 0.63x of plain ones when every block was fetched ahead.
HINT_DISK_LATENCY = 0.001
# How many blocks read ahead of their hinted fetch the daemon remembers (so as not to pin
# them after the read): ~100 bytes each; a job more than this far ahead of the pool has
# had its window's worth of misses already.
HINT_READ_MEMORY = 1 << 14
# While a hint session is open, each serving process reports after this many opens (a
# hinted file's pin goes when the daemon hears of its open; see ServeTable.report_opens)
# instead of after 512 requests: a report per four opens, each a message and ~30 us of the
# daemon's CPU, against pins of read files holding the window's room for a hundred files.
HINT_REPORT_OPENS = 4
# Paths a session may queue in the daemon; a client past this is cut off at the oldest.
MAX_QUEUED_PATHS = 1 << 16

# -- Direct reads (cachefs/directio.py) ------------------------------------------------

# Only buffers up to this size are kept (16 x 2 MiB at most, outside --ram-size): with
# --block-size 256MiB, 16 kept block-sized buffers held 1.8 GiB after the reads were done.
# A bigger read maps its own buffer and unmaps it after.
BUFFER_KEPT_MAX = 2 << 20

SHARED_SCHEME = "memcached://"  # --shared-cache memcached://HOST:PORT[,HOST:PORT...]


def parse_servers(spec: str) -> list[tuple[str, int]]:
    """`memcached://HOST:PORT[,HOST:PORT...]` -> [(host, port), ...]; ValueError with the reason.
    `+` separates servers too: mount -o and fstab split options on commas."""
    if not spec.startswith(SHARED_SCHEME):
        raise ValueError(f"expected {SHARED_SCHEME}HOST:PORT[,HOST:PORT...]")
    servers = []
    for part in spec[len(SHARED_SCHEME):].replace("+", ",").split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part.strip()!r} is not HOST:PORT")
        servers.append((host, int(port)))
    if len(set(servers)) != len(servers):
        raise ValueError("a server is named twice")
    return servers
