"""Delta capture and delta loads of a ``SparseTable`` (a mixin of ``table.SparseTable`` that uses its
arrays and lock): the rows changed since the last clear (``dirty_dump``), each with whether its key
held a row at that clear, and a delta's load that trusts that answer when the table holds exactly the
delta's parent checkpoint (``delta_load``).

Why the answer travels with the rows. A delta restored into a table that spills must keep the count of
keys in RocksDB exact, so each of its rows going to disk had to be asked "is this key there already?":
the Bloom filter, then a read of every key it lets through. At 100M keys (4 GB budget) a 14.3M-row
delta, ~30% of it updates of spilled rows, restored at ~107-135k rows/s, ~8 us a read, a chain of 24
hourly deltas ~45 min beyond its base. The saving table knows the answer for free:

- Every row carries the **generation** in which it was created (the high bits of its flags word,
  ``_kernels.GEN_SHIFT``): a push that creates a row stamps the table's current generation, a load
  stamps 0 ("as the checkpoint held it"), and the stamp travels with the record to RocksDB and back.
- A clear of the dirty state (the instant of a base or a delta) starts the next generation.
- Every delete (``delete``, an expiry pass over RAM or RocksDB) notes the keys whose deleted row was
  of an earlier generation: rows the parent held.
- So at a delta's instant a dirty row's key had a row at the parent unless the row's stamp is the
  current generation (created since) and no row of an earlier generation was deleted under its key
  since (then the parent's row was deleted and the key created again: it existed). The tombstones are
  the noted keys without a row now: every one of them had a row at the parent, so a trusted load
  deletes them without reading RocksDB either, and a key created and deleted since the parent makes
  no tombstone. ``EXISTED_UNKNOWN`` is never written today; a loader asks RocksDB about such rows.

The loader trusts the column only inside ``delta_load(parent)`` on a table that holds exactly ``parent``
(``mark_checkpoint``, set by the checkpoint reader after a restore; any push, delete or expiry pass
drops it), so a delta applied onto any other state, or onto a table that took traffic meanwhile, pays
the reads and stays exact. Generations wrap after 2**24 - 1 clears (1,900 years of hourly deltas).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from . import _kernels as K
from .keysets import unique_keys
from .rows import DirtyRows


def _uri_key(uri) -> str:
    """A checkpoint URI as the table records it (``mark_checkpoint``, ``delta_load``): no trailing slash."""
    return str(uri).rstrip("/")


class DeltaCapture:
    """Methods of ``SparseTable`` for delta checkpoints (see the module docstring)."""

    def dirty_rows(self, clear: bool = False):
        """Rows changed and keys deleted since the last clear, gathered in memory (``dirty_dump``
        streams them).

        Returns
        -------
        (batches, deleted)
            batches : list of RecordBatch of ``rows.delta_schema(self.schema)`` (the row schema and
            ``existed``), each changed row once (RAM and spilled); deleted : uint64[k] sorted keys that
            had a row at the last clear and have none now (tombstones).
        """
        dump = self.dirty_dump(clear)
        try:
            return list(dump), dump.deleted
        finally:
            dump.close()

    def dirty_dump(self, clear: bool = False, chunk_rows: int = 65536, *,
                   sketch: list | None = None) -> DirtyRows:
        """Rows changed and keys deleted since the last clear (for delta checkpoints), as of now.

        The dirty RAM rows are copied and RocksDB's read view made at one instant under the lock; the
        spilled dirty rows are read from that view as the dump is iterated, outside the lock and
        ``chunk_rows`` at a time. (Read by one multi-get under the exclusive lock, an hour of an online
        job whose pushes touched millions of spilled rows stalled training for the whole read and held
        every row at once.)

        Parameters
        ----------
        clear : bool
            Clear the dirty state in the same locked step (and start the next generation), so a push
            racing with a delta save lands in the next delta rather than being lost.
        chunk_rows : int
            Rows per record batch.
        sketch : list, optional
            Receives a copy of the admission sketch (uint32[depth, width]) taken in the same locked
            step (nothing without admission; ``sparse_tables._admission``).

        Returns
        -------
        DirtyRows
            Iterable (more than once) of RecordBatch of ``rows.delta_schema(self.schema)``: each changed
            row once, with ``existed`` (uint8: ``rows.EXISTED_NO`` the key had no row at the last
            clear, ``EXISTED_YES`` it had); its ``deleted`` : uint64[k] sorted keys that had a row at
            the last clear and have none now (tombstones).

        Raises
        ------
        SpillError
            While iterated: RocksDB reported a read error (``SpillStore.seek_records``). At once:
            ``SpillFailedError``, the store failed for good (``spill_failed``).
        """
        lock = self._lock.exclusive() if clear else self._lock.shared()
        with lock:
            self._refuse_if_failed()
            records = self._snapshot_live(int(K.F_DIRTY), 0)
            self._copy_sketch(sketch)
            try:
                return self._dirty_dump_locked(records, clear, chunk_rows)
            except BaseException:
                records.close()
                raise

    def _dirty_dump_locked(self, records, clear: bool, chunk_rows: int) -> DirtyRows:
        spill, view, spilled = self._spill, None, []
        if spill is not None:
            # the spilled dirty keys not in RAM now (the dirty RAM rows are copied above): the set's own
            # runs, each with a mask, read and merged in chunks as the dump is iterated
            for run in self._spilled_dirty.runs():
                at = np.empty(len(run), np.int64)
                K.find_rows(self._index, self._arena_u, run, at)
                keep = at < 0
                if keep.any():
                    spilled.append((run, None if keep.all() else keep))
            view = spill.seek_view() if spilled else None
        # the keys whose row of an earlier generation (one the parent held) was deleted since the clear
        removed = unique_keys(np.concatenate(self._deleted)) if self._deleted else np.empty(0, np.uint64)
        deleted = removed[~self._present(removed)] if len(removed) else removed
        out = DirtyRows(records, spilled, spill, view, deleted, self.layout, self.schema, chunk_rows,
                        generation=int(self._state[K.S_GEN]), removed=removed)
        if clear:
            self._clear_dirty_locked()
            if self._budget is not None and spilled:
                # the cleared set's runs live on in the dump: the budget counts them until it is closed
                # (or collected), not as RAM the tier may fill meanwhile
                budget, token = self._budget, self._budget.register()
                budget.report(token, sum(r.nbytes + (0 if m is None else m.nbytes) for r, m in spilled), 0)
                out.on_close(lambda: budget.forget(token))
        return out

    def clear_dirty(self) -> None:
        """Forget which rows changed and which keys were deleted, and start the next generation."""
        with self._lock.exclusive():
            self._clear_dirty_locked()

    def _clear_dirty_locked(self) -> None:
        K.clear_flag(self._arena_u, self._state, self._lay, K.F_DIRTY | K.F_LISTED)
        self._spilled_dirty.clear()
        self._deleted = []
        self._deleted_bytes = 0
        if self._budget is not None:    # what it held is freed now, not at the next eviction pass
            self._budget.report(self._budget_token, self._growing_bytes(), int(self._state[K.S_NEXT]))
        self._state[K.S_GEN] = K.next_generation(int(self._state[K.S_GEN]))
        self._checkpoint = None

    def mark_checkpoint(self, uri: str) -> None:
        """Record that this table holds exactly its share of the checkpoint at ``uri`` (the caller
        vouches for it; the checkpoint reader uses ``finish_restore``). A later ``delta_load`` whose
        parent is ``uri`` then trusts the delta's ``existed`` column. Any push, delete, expiry pass or
        clear forgets it."""
        with self._lock.exclusive():
            self._checkpoint = _uri_key(uri)

    def finish_restore(self, uri: str) -> bool:
        """End a restore of the checkpoint at ``uri`` into this table (a base inside ``bulk_load
        (distinct=True)``, a delta inside ``delta_load``), in one locked step: forget the dirty state
        (the restored rows are the clean point of the next delta) and, when the table held the delta's
        parent at the load's start (a base: it was empty) and nothing but the load changed it since (no
        push, delete or expiry pass), record that it holds exactly ``uri`` (``mark_checkpoint``).
        Returns whether it did. Traffic during a load leaves the table unmarked, so the next delta
        loaded on it asks RocksDB about each row."""
        with self._lock.exclusive():
            start, self._restore_start = self._restore_start, None
            self._clear_dirty_locked()
            exact = start is not None and start[1] and start[0] == self._changes
            if exact:
                self._checkpoint = _uri_key(uri)
            return exact

    @property
    def checkpoint(self) -> str | None:
        """URI of the checkpoint this table holds exactly (``mark_checkpoint``), or None."""
        return self._checkpoint

    @contextmanager
    def delta_load(self, parent: str | None):
        """Context for loading a delta whose parent checkpoint is at URI ``parent``: when this table
        holds exactly that checkpoint (``mark_checkpoint``), ``load_rows`` within takes each row's
        ``existed`` column as the truth about its key and asks RocksDB nothing (rows that say
        ``EXISTED_UNKNOWN`` still ask). The table no longer holds ``parent`` from here on (a failed
        load leaves it between two checkpoints); a push, delete or expiry pass meanwhile ends the
        trust for the rest of the load. Yields whether the column is trusted."""
        with self._lock.exclusive():
            trusted = parent is not None and self._checkpoint is not None \
                and self._checkpoint == _uri_key(parent)
            self._checkpoint = None
            self._existed_trusted = trusted
            self._restore_start = (self._changes, trusted)      # for finish_restore
        try:
            yield trusted
        finally:
            with self._lock.exclusive():
                self._existed_trusted = False

    def _earlier(self, flags: np.ndarray) -> np.ndarray:
        """flags : uint32[m] flags words of rows -> bool[m], created in an earlier generation than the
        current one (rows the last clear's checkpoint held). Lock held."""
        return K.generations(flags) != np.uint32(self._state[K.S_GEN])

    def _changed(self) -> None:
        """A push, delete or expiry pass changed the table: it holds no checkpoint exactly any more
        (lock held exclusively)."""
        self._checkpoint = None
        self._existed_trusted = False
        self._changes += 1
