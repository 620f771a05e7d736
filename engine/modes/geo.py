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

Dense parameters live on the worker between syncs (plain SGD at ``geo.dense_learning_rate``).
"""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from sparse_tables import SparseTable, TableConfig

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


class GeoMode(Mode):
    """GEO-SGD; see the module docstring.

    Parameters
    ----------
    k_steps : int
        Steps between syncs.
    learning_rate, dense_learning_rate : float
        Local plain-SGD step sizes.
    evict_after_steps : int
        Rows of the local copy untouched for this many steps are dropped after a sync.
    """

    name = "geo"

    def __init__(self, client, *, rank: int, num_workers: int, barrier_timeout_s: float = 600.0,
                 k_steps: int = 10, learning_rate: float = 0.05, dense_learning_rate: float = 0.05,
                 evict_after_steps: int = 1000):
        super().__init__(client, rank=rank, num_workers=num_workers, barrier_timeout_s=barrier_timeout_s)
        self.k_steps, self.lr, self.dense_lr = k_steps, learning_rate, dense_learning_rate
        self.evict_after = evict_after_steps
        self._tables: dict[str, _LocalTable] = {}
        self._dense: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._last_evict = 0
        self.syncs = 0

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

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        t = self._table(table)
        if len(keys):
            missing = keys[~t.local.contains(keys)]
            if len(missing):
                missing = np.unique(missing)
                t.set_rows(missing, self.client.pull(table, missing, init_missing=True), self.step)
        return t.local.pull(keys)

    def push_sparse_grads(self, table, keys, grads, shows=None, clicks=None) -> None:
        t = self._table(table)
        if len(keys):
            new = ~t.local.contains(keys)
            if new.any():   # a push without a pull first: start those rows from the server's values
                self.pull_sparse(table, keys[new])
        t.local.push(keys, grads, shows=shows, clicks=clicks)

    def init_dense(self, table: str, params: np.ndarray) -> np.ndarray:
        self._dense.pop(table, None)
        return super().init_dense(table, params)

    def pull_dense(self, table: str) -> np.ndarray:
        if table not in self._dense:
            fresh = self.client.pull_dense(table)
            self._dense[table] = (fresh, fresh.copy())
        return self._dense[table][0].copy()

    def push_dense_grads(self, table: str, grad: np.ndarray) -> None:
        if table not in self._dense:
            self.pull_dense(table)
        local = self._dense[table][0]
        local -= np.float32(self.dense_lr) * grad

    def end_step(self) -> None:
        super().end_step()
        if self.step % self.k_steps == 0:
            self.sync()

    def sync(self) -> None:
        """Push the deltas of every touched row and of the dense tables, then refresh them."""
        scale = np.float32(1.0 / self.num_workers)
        for name, t in self._tables.items():
            batches, _ = t.local.dirty_rows(clear=True)
            batches = [b for b in batches if b.num_rows]
            if not batches:
                continue
            keys = np.concatenate([b.column("key").to_numpy() for b in batches])
            values = np.concatenate([b.column("values").flatten().to_numpy().reshape(-1, t.dim)
                                     for b in batches])
            delta = (values - t.synced.pull(keys)) * scale
            self.client.push_delta(name, keys, np.ascontiguousarray(delta, np.float32))
            t.set_rows(keys, self.client.pull(name, keys, init_missing=True), self.step)
        for name, (local, synced) in self._dense.items():
            self.client.push_dense_delta(name, (local - synced) * scale)
            fresh = self.client.pull_dense(name)
            self._dense[name] = (fresh, fresh.copy())
        self.syncs += 1
        if self.step - self._last_evict >= self.evict_after:
            self._evict()

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
