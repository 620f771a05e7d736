"""Training modes, one file each behind one interface (``base.Mode``): sync, async, GEO, hybrid."""
from __future__ import annotations

from ..errors import ConfigError
from .asynchronous import AsyncMode
from .base import Mode
from .geo import GeoMode
from .sync import SyncMode


#: modes whose workers run the same steps together (``Mode.lockstep``), by name: for the launcher, which
#: does not import the mode classes (hybrid's imports MPI)
LOCKSTEP_MODES = frozenset({"sync", "hybrid"})


def make_mode(cfg, client, *, rank: int, num_workers: int) -> Mode:
    """The Mode named by ``cfg.mode`` (an EngineConfig), bound to ``client``.

    Raises
    ------
    ConfigError
        Unknown mode.
    """
    common = dict(rank=rank, num_workers=num_workers, barrier_timeout_s=cfg.client.barrier_timeout_s)
    if cfg.mode == "sync":
        return SyncMode(client, **common)
    if cfg.mode == "async":
        return AsyncMode(client, **common)
    if cfg.mode == "geo":
        g = cfg.geo
        return GeoMode(client, k_steps=g.k_steps, learning_rate=g.learning_rate, dense_tables=cfg.dense_tables,
                       evict_after_steps=g.evict_after_steps, delta_scale=g.delta_scale, **common)
    if cfg.mode == "hybrid":      # imported here: mpi4py initializes MPI on import
        from .hybrid import HybridMode
        return HybridMode(client, dense_tables=cfg.dense_tables, sync_steps=cfg.hybrid.dense_sync_steps,
                          overlap_buckets=cfg.hybrid.bucket_floats or None, insecure=cfg.security.insecure,
                          **common)
    raise ConfigError(f"mode must be one of ['sync', 'async', 'geo', 'hybrid'], got {cfg.mode!r}")


__all__ = ["Mode", "SyncMode", "AsyncMode", "GeoMode", "make_mode"]
