"""GEO mode (Paddle's geo-SGD): train a bounded local copy, exchange deltas every ``k_steps``.

Per sparse table the worker keeps two SparseTable instances over the rows it has used recently:
``local`` (trained with plain SGD at ``geo.learning_rate``; the gradient pushes of the worker loop
go there) and ``synced`` (each row's value at its last sync). Every ``k_steps`` steps, ``sync``:

1. takes the rows changed since the last sync (``local.dirty_rows(clear=True)``),
2. pushes ``delta = (local - synced) / num_workers`` to the servers (``push_delta``: added, no
   optimizer), and the dense delta likewise,
3. pulls the servers' current values of those rows (which include the other workers' deltas) and
   writes them into both ``local`` and ``synced``.

A row enters the local copy on first use with the server's value (``init_missing=True``, so a
brand-new key starts from the value the server will create). The copy is bounded: after a sync, rows
not touched for ``geo.evict_after_steps`` steps are dropped (their deltas were already sent), so the
local copy holds only the working set of the last ``evict_after_steps`` steps.

Dense parameters live on the worker between syncs, stepped with the optimizer their dense table is
configured with (``tables.dense.NAME``: Adam with its learning_rate, beta1, beta2, epsilon, or SGD; the
same ``models.optim`` code the servers' dense table and hybrid mode run, built by
``engine.allreduce.make_optimizer``), as the design asks ("dense parameters live ... on the worker (GEO),
with Adam"). To change GEO's dense learning rate, set the table's (the servers apply GEO's dense deltas
without their optimizer); the former plain-SGD step ``geo.dense_learning_rate`` is ignored, with a warning, by the config.
At a sync the worker pushes ``delta = (local - synced) * scale`` and pulls the fresh values into
``local`` and ``synced``; the optimizer's state (Adam's ``m``, ``v`` and step count ``t``) stays on the
worker across syncs: a sync refreshes the parameters, never the moments. That state is in no checkpoint
(like the local sparse copy, and like the worker-side optimizer state of Paddle's GEO): a restarted or
resumed worker starts it from zero (``m = v = 0``, ``t = 0``) on the checkpoint's parameters.

``delta_scale``: ``mean`` (Paddle's geo-SGD: ``(local - synced) / num_workers``) or ``sum`` (each
worker's change is added in full, as Hogwild threads on one table would: right for Word2Vec, where every
worker trains a disjoint part of the corpus with the full per-word learning rate; ``mean`` would halve
it with two workers).

Replicas (``sparse_replica``): a model that updates rows in place (Word2Vec) may hold the local copy of a
fixed key set as one dense array ``float32[n, dim]`` and train it directly. At each sync the rows whose
value differs from their last synced value are the touched ones: their delta is pushed and their fresh
values pulled, as above. Every ``evict_after_steps`` steps every row of the replica is refreshed from
the servers (the replica's bound on staleness: rows only other workers train). A replica's sync sends
no show counts, so a row's count on the servers is the number of syncs that changed it, which depends
on ``k_steps``: Word2Vec, the one model with replicas, uses no show-based admission or expiry (counting
each step's changed rows costs a scan of the whole replica per step, ~4% of a Word2Vec step).
"""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from sparse_tables import SparseTable, TableConfig
from sparse_tables.keysets import unique_keys

from ..allreduce import make_optimizer
from ..errors import ConfigError
from ..ps.warmup import read_only
from ._kernels import replica_deltas, set_replica_rows
from .base import Mode

log = logging.getLogger(__name__)


class _LocalTable:
    def __init__(self, dim: int, lr: float, evict_after: int, clock):
        base = dict(dim=dim, optimizer="sgd", initializer="zeros", expire_after=float(evict_after),
                    num_threads=1)
        self.dim = dim
        self.local = SparseTable(TableConfig(learning_rate=lr, **base), clock=clock)
        self.synced = SparseTable(TableConfig(learning_rate=1.0, **base), clock=clock)

    def set_rows(self, keys: np.ndarray, values: np.ndarray, step: int) -> None:
        """Write values into local and synced (bit-exact, clean, last_seen = step)."""
        for t in (self.local, self.synced):
            n = len(keys)
            cols = [pa.array(keys, pa.uint64()),
                    pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa.float32()), self.dim),
                    pa.array(np.zeros(n, np.float32)), pa.array(np.zeros(n, np.float32)),
                    pa.array(np.full(n, step, np.uint32), pa.uint32())]
            t.load_rows([pa.RecordBatch.from_arrays(cols, schema=t.schema)])


class _LocalDense:
    """A dense table's local copy: ``local`` (float32[P], stepped by ``opt``), ``synced`` (values at the
    last sync) and ``opt`` (``models.optim.Adam`` or ``SGD``: its state outlives syncs)."""

    def __init__(self, params: np.ndarray, opt):
        self.opt = opt
        self.refresh(params)

    def refresh(self, params: np.ndarray) -> None:
        """The servers' fresh values into ``local`` (an own, writable copy) and ``synced``; the optimizer's
        state is kept."""
        self.local = np.array(params, np.float32).ravel()
        self.synced = self.local.copy()


class _Replica:
    """The local copy of a fixed key set as dense arrays: ``local`` (trained in place by the model) and
    ``synced`` (values at the last sync), row ``i`` = ``keys[i]``."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        self.keys = keys
        self.local = np.array(values, np.float32, order="C")   # own, writable (pulls may be read-only views)
        self.synced = self.local.copy()
        self._order = np.argsort(keys, kind="stable")
        self._sorted = keys[self._order]
        self._changed = self._deltas = None

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys : uint64[n]`` -> int64[n]. Raises ConfigError for a key outside the set."""
        pos = np.minimum(np.searchsorted(self._sorted, keys), len(self._sorted) - 1)
        bad = self._sorted[pos] != keys
        if bad.any():
            raise ConfigError(f"key {int(keys[bad][0])} is not in the replica's key set "
                              f"({len(self.keys)} keys)")
        return self._order[pos]

    def set_rows(self, rows, values: np.ndarray) -> None:
        if isinstance(rows, slice):
            self.local[rows] = values
            self.synced[rows] = values
        else:
            set_replica_rows(self.local, self.synced, rows, values)

    def deltas(self, scale: np.float32) -> tuple[np.ndarray, np.ndarray]:
        """(changed rows int64[n], their deltas float32[n, dim] scaled) since the last sync; views of
        scratch arrays reused by the next call."""
        if self._changed is None:
            self._changed = np.empty(len(self.keys), np.int64)
            self._deltas = np.empty_like(self.local)
        n = replica_deltas(self.local, self.synced, np.float32(scale), self._changed, self._deltas)
        return self._changed[:n], self._deltas[:n]


class GeoMode(Mode):
    """GEO-SGD; see the module docstring.

    Parameters
    ----------
    k_steps : int
        Steps between syncs.
    learning_rate : float
        Local plain-SGD step size of the sparse rows.
    dense_tables : dict[str, engine.config.DenseTableConfig], optional
        ``tables.dense`` of the config: the optimizer (adam or sgd; learning_rate, beta1, beta2, epsilon)
        each dense table's local copy is stepped with. A dense table missing here raises ConfigError at
        its first use.
    evict_after_steps : int
        Rows of the local copy untouched for this many steps are dropped after a sync (replicas: every
        row is refreshed).
    delta_scale : {"mean", "sum"}
        Deltas are divided by ``num_workers`` (mean) or pushed in full (sum); see the module docstring.
    """

    name = "geo"
    prefetches_rows = True

    def __init__(self, client, *, rank: int, num_workers: int, barrier_timeout_s: float = 600.0,
                 k_steps: int = 10, learning_rate: float = 0.05, dense_tables: dict | None = None,
                 evict_after_steps: int = 1000, delta_scale: str = "mean"):
        super().__init__(client, rank=rank, num_workers=num_workers, barrier_timeout_s=barrier_timeout_s)
        if delta_scale not in ("mean", "sum"):
            raise ConfigError(f"geo.delta_scale must be one of ['mean', 'sum'], got {delta_scale!r}")
        self.k_steps, self.lr = k_steps, learning_rate
        self.dense_tables = dict(dense_tables or {})
        self.evict_after = evict_after_steps
        self.delta_scale = delta_scale
        self._tables: dict[str, _LocalTable] = {}
        self._replicas: dict[str, _Replica] = {}
        self._dense: dict[str, _LocalDense] = {}
        self._last_evict = 0
        self.syncs = 0

    def warm_up(self, dims) -> None:
        """Run what the local copy does in training and at a sync (SGD pushes, dirty rows, expiry, replica
        deltas) on throwaway tables of each width in ``dims``, with writable and read-only inputs (a pull
        reply or an Arrow column is read-only, and Numba compiles the two apart), so the job's steps
        compile nothing."""
        rng = np.random.default_rng(0)
        for dim in sorted(set(dims)):
            t = _LocalTable(dim, self.lr, self.evict_after, lambda: 0.0)
            keys = rng.integers(1, 2**63, 64, dtype=np.uint64)
            values = rng.standard_normal((64, dim)).astype(np.float32)
            for k, v in ((keys, values), (read_only(keys), read_only(values))):
                t.set_rows(k, v, 0)
                t.local.contains(k)
                t.local.pull(k)
                t.synced.pull(k)
                t.local.push(k, v, shows=np.ones(64, np.float32), clicks=np.zeros(64, np.float32))
                t.local.push_delta(k, v)
                t.local.dirty_rows(clear=True)
                r = _Replica(k, v)
                r.local += 1.0
                r.deltas(np.float32(0.5))
                r.set_rows(np.arange(8), v[:8])
            for table in (t.local, t.synced):
                table.shrink(now=float(self.evict_after + 1))
                table.clear_dirty()
        for cfg in self.dense_tables.values():      # the dense step's kernel (writable float32 arrays)
            make_optimizer(8, cfg).step(np.zeros(8, np.float32), np.ones(8, np.float32))

    def _clock(self) -> float:
        return float(self.step)

    def _table(self, table: str) -> _LocalTable:
        t = self._tables.get(table)
        if t is None:
            dim = self.client.sparse_dim(table)
            t = self._tables[table] = _LocalTable(dim, self.lr, self.evict_after, self._clock)
        return t

    def local_rows(self, table: str) -> int:
        """Rows currently in the local copy of ``table``."""
        return len(self._tables[table].local) if table in self._tables else 0

    def sparse_replica(self, table: str, keys: np.ndarray) -> np.ndarray:
        """The replica of ``keys`` in ``table`` (module docstring); created on the first call with the
        servers' values (unknown keys: their initial values), the same array afterwards.

        Raises
        ------
        ConfigError
            A second call with a different key set, or ``table`` already has a row-wise local copy.
        """
        keys = np.ascontiguousarray(keys, np.uint64)
        r = self._replicas.get(table)
        if r is not None:
            if not np.array_equal(r.keys, keys):
                raise ConfigError(f"geo: table {table!r} already has a replica of another key set")
            return r.local
        if table in self._tables:
            raise ConfigError(f"geo: table {table!r} is already trained through pull_sparse; a replica "
                              f"must be asked for before the first pull")
        if len(np.unique(keys)) != len(keys):
            raise ConfigError(f"geo: replica keys of table {table!r} must be unique")
        r = self._replicas[table] = _Replica(keys, self.client.pull(table, keys, init_missing=True))
        return r.local

    def prefetch_sparse(self, table: str, keys: np.ndarray):
        """The servers' values of the keys of ``keys : uint64[n]`` that are not in the local copy now,
        for a later ``pull_sparse(table, keys, prefetched=...)`` (the CTR worker fetches batch t+1's
        while step t computes). Safe to call beside the training thread: it only reads the local copy.
        Returns (keys uint64[m] sorted unique, values float32[m, dim]) or None (nothing to fetch, or a
        replica table)."""
        if table in self._replicas or not len(keys):
            return None
        t = self._tables.get(table)
        missing = keys if t is None else keys[~t.local.contains(keys)]
        if not len(missing):
            return None
        missing = unique_keys(missing)
        return missing, self.client.pull(table, missing, init_missing=True)

    def pull_sparse(self, table: str, keys: np.ndarray, prefetched=None) -> np.ndarray:
        """Local values of ``keys : uint64[n]`` -> float32[n, dim]; a key missing from the local copy
        enters it with the servers' value, taken from ``prefetched`` (``prefetch_sparse``'s result)
        when it holds the key, else fetched now (a row evicted since the prefetch)."""
        r = self._replicas.get(table)
        if r is not None:
            return r.local[r.positions(keys)]
        t = self._table(table)
        if len(keys):
            missing = keys[~t.local.contains(keys)]
            if len(missing):
                missing = unique_keys(missing)
                values = np.empty((len(missing), t.dim), np.float32)
                have = np.zeros(len(missing), np.bool_)
                if prefetched is not None:            # never empty: prefetch_sparse gives None then
                    pkeys, pvalues = prefetched
                    pos = np.minimum(np.searchsorted(pkeys, missing), len(pkeys) - 1)
                    have = pkeys[pos] == missing
                    values[have] = pvalues[pos[have]]
                if not have.all():
                    values[~have] = self.client.pull(table, missing[~have], init_missing=True)
                t.set_rows(missing, values, self.step)
        return t.local.pull(keys)

    def push_sparse_grads(self, table, keys, grads, shows=None, clicks=None) -> None:
        t = self._table(table)
        if len(keys):
            new = ~t.local.contains(keys)
            if new.any():   # a push without a pull first: start those rows from the server's values
                self.pull_sparse(table, keys[new])
        t.local.push(keys, grads, shows=shows, clicks=clicks)

    def push_sparse_delta(self, table, keys, deltas) -> None:
        """Added to the local copy (sent at the next sync)."""
        r = self._replicas.get(table)
        if r is not None:
            r.local[r.positions(keys)] += deltas
            return
        t = self._table(table)
        if len(keys):
            new = ~t.local.contains(keys)
            if new.any():
                self.pull_sparse(table, keys[new])
        t.local.push_delta(keys, deltas)

    def _local_dense(self, table: str) -> _LocalDense:
        d = self._dense.get(table)
        if d is None:
            cfg = self.dense_tables.get(table)
            if cfg is None:
                raise ConfigError(f"geo: dense table {table!r} has no optimizer settings (tables.dense."
                                  f"{table}); declared dense tables: {sorted(self.dense_tables)}")
            fresh = self.client.pull_dense(table)
            d = self._dense[table] = _LocalDense(fresh, make_optimizer(fresh.size, cfg))
        return d

    def init_dense(self, table: str, params: np.ndarray) -> np.ndarray:
        """As ``Mode.init_dense``; the table's local copy and its optimizer state start afresh (zero
        moments) from the servers' values at the next use."""
        self._dense.pop(table, None)
        return super().init_dense(table, params)

    def pull_dense(self, table: str) -> np.ndarray:
        """This worker's local parameters (a copy, float32[P]); the first call pulls them from the servers."""
        return self._local_dense(table).local.copy()

    def push_dense_grads(self, table: str, grad: np.ndarray) -> None:
        """One optimizer step of the local copy with ``grad : float32[P]`` (the table's optimizer, e.g.
        Adam; see the module docstring); sent to the servers as a delta at the next sync."""
        d = self._local_dense(table)
        d.opt.step(d.local, np.require(np.ravel(grad), np.float32, ("C", "W")))

    def end_step(self, examples: int = 0) -> None:
        super().end_step(examples)
        if self.step % self.k_steps == 0:
            self.sync()

    def drain(self) -> None:
        """``sync`` now."""
        self.sync()

    def sync(self) -> None:
        """Push the deltas of every touched row and of the dense tables, then refresh them."""
        scale = np.float32(1.0 / self.num_workers if self.delta_scale == "mean" else 1.0)
        refresh = self.step - self._last_evict >= self.evict_after
        for name, r in self._replicas.items():
            self._sync_replica(name, r, scale, refresh)
        for name, t in self._tables.items():
            batches, _ = t.local.dirty_rows(clear=True)
            batches = [b for b in batches if b.num_rows]
            if not batches:
                continue
            keys = np.concatenate([b.column("key").to_numpy() for b in batches])
            values = np.concatenate([b.column("values").flatten().to_numpy().reshape(-1, t.dim)
                                     for b in batches])
            # the shows and clicks seen since the last sync (set_rows zeroed them then): the servers add
            # them to the rows as an async push's, for expiry, admission and export filters; before,
            # a delta carried none and each sync counted one show per key per worker and no click
            shows, clicks = (np.concatenate([b.column(c).to_numpy() for b in batches]).astype(np.float32)
                             for c in ("show", "click"))
            delta = (values - t.synced.pull(keys)) * scale
            fresh = self.client.push_delta(name, keys, np.ascontiguousarray(delta, np.float32), shows=shows,
                                           clicks=clicks, return_values=True)
            t.set_rows(keys, fresh, self.step)
        for name, d in self._dense.items():         # parameters refreshed, optimizer state kept
            self.client.push_dense_delta(name, (d.local - d.synced) * scale)
            d.refresh(self.client.pull_dense(name))
        self.syncs += 1
        if refresh:
            self._evict()

    def _sync_replica(self, name: str, r: _Replica, scale: np.float32, refresh: bool) -> None:
        changed, delta = r.deltas(scale)
        fresh = None
        if len(changed):   # one round trip: the servers add the deltas and reply with the rows' values
            fresh = self.client.push_delta(name, r.keys[changed], delta, return_values=True)
        if refresh:
            r.set_rows(slice(None), self.client.pull(name, r.keys, init_missing=True))
        elif fresh is not None:
            r.set_rows(changed, fresh)

    def _evict(self) -> None:
        self._last_evict = self.step
        for t in self._tables.values():
            dropped = t.local.shrink(now=self.step)
            t.synced.shrink(now=self.step)
            t.local.clear_dirty()
            t.synced.clear_dirty()
            if dropped:
                log.debug("geo: dropped %d rows untouched for %d steps", dropped, self.evict_after)

    def finish(self) -> None:
        self.sync()
        super().finish()
