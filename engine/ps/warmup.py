"""Compile the parameter-server kernels before the first real request (Numba JIT warm-up).

The table, optimizer, routing and codec kernels are Numba functions compiled on their first call (and
cached on disk afterwards, ``cache=True``). Without a warm-up, a cold start compiles them inside the
first training requests: on a 2-core machine the first pull and push of a CTR job took ~6 s, during
which the workers waited on the server in an order set by who compiled what first, so the first
updates of an async job interleaved nothing like the steady state (and the reported examples/s
counted compile time). :func:`warm_up` runs every training-path request once, on a throwaway
in-process cluster with the same table configs, before a server listens or a worker trains.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

from .. import failpoints
from ..scratch import ScratchDir

log = logging.getLogger(__name__)

_KEYS = 256    # keys per warm-up request: enough to reach every local shard of both throwaway servers
_GROW = 16384  # keys of one push that outgrows the shards' initial hash index (compiles the rehash)
_SPILL_ROWS = 512  # RAM rows per shard of a throwaway table that spills: the growth push spills to RocksDB


def read_only(arr: np.ndarray) -> np.ndarray:
    """A read-only copy of ``arr``, as a pull reply or an Arrow column arrives (Numba compiles read-only
    arrays apart from writable ones, so a warm-up feeds both)."""
    out = arr.copy()
    out.flags.writeable = False
    return out


WARM_UP_PREFIX = "engine-warm-up-"  # the warm-up's throwaway directories (``engine.scratch.ScratchDir``)


def warm_up(sparse: dict, dense: dict, *, local_shards: int = 4) -> float:
    """Run each request kind of training and evaluation once on a throwaway cluster.

    Two in-process ``PSServer`` ranks (so client routing and reply assembly run as with a real cluster)
    hold copies of the tables in ``local_shards`` shards each, as the real servers (one shard and several
    take different paths); a table that spills gets a temporary RocksDB directory and ``memory_rows`` so
    small that the warm-up spills rows and reads them back. Requests go through the wire codec, so the
    kernels compile for the array types a real request brings (Numba compiles read-only views of
    received bytes apart from writable arrays). Nothing of the real tables is touched.

    Parameters
    ----------
    sparse : dict of str -> sparse_tables.TableConfig
    dense : dict of str -> DenseTableConfig
    local_shards : int
        ``cluster.local_shards`` of the job.

    Returns
    -------
    float
        Seconds spent (compiling on a cold start, loading Numba's cache otherwise).
    """
    with failpoints.suspended():      # a chaos test's points aim at the job's requests, not these
        return _warm_up(sparse, dense, local_shards)


def _warm_up(sparse: dict, dense: dict, local_shards: int) -> float:
    from .client import PSClient
    from .server import PSServer
    from .transport import InProcessTransport

    t0 = time.perf_counter()
    scratch = ScratchDir(WARM_UP_PREFIX)   # its spill stores; a SIGKILLed role's is removed by the next
    # memory_bytes off: a budget would size (and touch) the real index for a throw-away table
    sparse = {n: dataclasses.replace(c, spill_path=os.path.join(scratch.path, n), memory_rows=_SPILL_ROWS,
                                     memory_bytes=0)
              if c.spill_path else c for n, c in sparse.items()}
    servers: list = []
    client = None
    rng = np.random.default_rng(0)
    try:
        for i in range(2):
            servers.append(PSServer(sparse, dense, index=i, num_servers=2, num_vshards=64,
                                    local_shards=local_shards))
        client = PSClient(InProcessTransport(servers), threads=2, name="warm-up")
        dense_table = next(iter(dense), None)     # Step's dense part (each optimizer ran in DENSE_STEP)
        for name in dense:
            size = 2 * _KEYS
            client.init_dense(name, np.zeros(size, np.float32))
            grad = rng.standard_normal(size).astype(np.float32)
            client.push_pull_dense(name, grad)                  # async: DENSE_STEP
            client.push_dense(name, grad, accumulate=True)      # sync: held until the barrier
            client.push_dense(name, grad)
            client.push_dense_delta(name, grad)                 # GEO
            client.pull_dense(name)
        for name, cfg in sparse.items():
            keys = rng.integers(1, 2**63, _KEYS, dtype=np.uint64)
            grads = rng.standard_normal((_KEYS, cfg.dim)).astype(np.float32)
            shows = np.ones(_KEYS, np.float32)
            clicks = (rng.random(_KEYS) < 0.5).astype(np.float32)
            client.pull(name, keys)                              # training and evaluation reads
            client.pull(name, keys, init_missing=True)
            client.push(name, keys, grads, shows=shows, clicks=clicks)
            grow = rng.integers(1, 2**63, _GROW, dtype=np.uint64)
            client.push(name, grow, np.zeros((_GROW, cfg.dim), np.float32), shows=np.ones(_GROW, np.float32))
            if cfg.uses_admission:
                _grow_without_admission(cfg, grow)
            client.pull(name, keys)                              # rows a spilling table moved to disk
            client.pull(name, keys, init_missing=True)
            client.push(name, np.concatenate([keys, keys[:8]]), np.concatenate([grads, grads[:8]]),
                        shows=np.concatenate([shows, shows[:8]]), accumulate=True)   # sync, duplicates
            client.push_delta(name, keys, grads)                # GEO
            client.push_delta(name, keys, grads, return_values=True)
            client.barrier("warm-up", 1, apply_pending=True, all_servers=True)
            extra = {}
            if dense_table is not None:
                extra = {"dense_table": dense_table,
                         "dense_grad": rng.standard_normal(2 * _KEYS).astype(np.float32)}
            client.push_pull(name, keys, grads, keys[::-1].copy(), shows=shows, clicks=clicks, **extra)
    finally:
        if client is not None:
            client.close()
        for s in servers:
            s.close()
        scratch.close()
    if any(getattr(t, "spill_path", None) for t in sparse.values()):
        # the dirty-keys set of a spilling table merges its runs once 64k keys were evicted dirty: a merge
        # of two runs compiles here, not under a shard's lock in the middle of a push
        from sparse_tables.keysets import SortedKeySet
        s = SortedKeySet()
        s.add(np.arange(2 * SortedKeySet.TAIL, dtype=np.uint64))
        s.add(np.arange(SortedKeySet.TAIL, dtype=np.uint64) * np.uint64(3))
    seconds = time.perf_counter() - t0
    log.info("parameter-server kernels ready in %.1f s", seconds)
    return seconds


def _grow_without_admission(cfg, keys: np.ndarray) -> None:
    """Feature admission keeps the growth push from creating rows (a key needs ``min_count``
    occurrences), so the shards never outgrow their first index; grow a throwaway table of the same
    layout without admission instead, which compiles the rehash and arena growth the job will run."""
    from sparse_tables import SparseTable

    table = SparseTable(dataclasses.replace(cfg, min_count=1, admit_probability=1.0, spill_path=None))
    try:
        table.push(keys, np.zeros((len(keys), cfg.dim), np.float32), shows=np.ones(len(keys), np.float32))
    finally:
        table.close()


__all__ = ["WARM_UP_PREFIX", "read_only", "warm_up"]
