"""The tiers a mount's options ask for, built in one place: the RAM tier, the NVMe tier
under the cache dir (if --disk-size is not 0), the cluster's shared tier (--shared-cache),
chained by the composite cache. A new tier is built here."""

from __future__ import annotations

import logging
import os
import shutil

from cachefs.config import Config, parse_servers
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.multilevel import MultiLevelCache
from cachefs.tiers.shared import SharedTier

log = logging.getLogger(__name__)

STORE_DIR = "store"  # the NVMe tier under the cache dir; "blocks" held the diskcache format


def build_cache(config: Config, policies: dict[str, str], stats: Stats) -> MultiLevelCache:
    assert config.ram_size is not None and config.disk_size is not None
    max_idle = config.max_idle or None
    ram = MemoryTier(config.ram_size, stats, policy=policies["ram"], max_idle=max_idle)
    _drop_old_format(config.cache_dir)
    disk = (DiskTier(os.path.join(config.cache_dir, STORE_DIR), config.disk_size, stats,
                     policy=policies["disk"], max_idle=max_idle, min_free=config.min_free or 0,
                     scrub_every=config.scrub_interval)
            if config.disk_size else None)
    return MultiLevelCache(ram, disk, stats, _shared(config, stats) if config.shared_cache else None)


def _shared(config: Config, stats: Stats) -> SharedTier:
    """The cluster's memcached tier (cachefs/tiers/shared.py), between NVMe and the source."""
    assert config.shared_cache is not None
    namespace = config.shared_namespace or os.path.basename(config.source.rstrip("/")) or "root"
    tier = shared_tier(config.shared_cache, namespace, config.block_size, stats)
    for problem in tier.check():
        log.warning("%s", problem)
    stats.set_info(shared_cache=config.shared_cache, shared_namespace=namespace)
    log.info("shared tier: %s, namespace %r", config.shared_cache, namespace)
    return tier


def shared_tier(spec: str, namespace: str, block_size: int, stats: Stats) -> SharedTier:
    """A client of the shared tier's servers (`spec`: memcached://HOST:PORT[,...]), as the
    daemon and its fetch processes each hold one."""
    return SharedTier(parse_servers(spec), namespace, block_size, stats)


def _drop_old_format(cache_dir: str) -> None:
    """Remove an NVMe tier of the older format (diskcache, until version 0.1): its blocks
    cannot be passed through, and nothing reads them any more."""
    old = os.path.join(cache_dir, "blocks")
    if os.path.isfile(os.path.join(old, "cache.db")):
        shutil.rmtree(old, ignore_errors=True)
        log.warning("removed the NVMe tier of an older cachefs in %s (a format this version does not read); "
                    "its files will be fetched again", old)
