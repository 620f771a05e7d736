"""``SparseTable``: one shard of a sparse embedding table.

A uint64 key maps to a row of ``dim`` float32 values plus optimizer state and metadata (show, click,
last_seen, LRU tick, flags). Rows live in a contiguous arena indexed by a Numba open-addressing hash
index; with ``spill_path`` set, least-recently-used rows move to RocksDB past ``memory_rows`` and come
back on the next pull or push that needs them. Without ``spill_path``, ``max_rows`` (when set) caps the
rows: past it a new key is refused like a key admission does not admit, and counted. Every public
method is thread-safe: pulls share a readers-writer lock (and a large pull is split across threads, the
kernels releasing the GIL); pushes, shrink and loads take it exclusively, so no reader ever sees a torn
row; ``stats()`` never waits behind them (``sparse_tables.stats``).

Example::

    >>> import numpy as np
    >>> from sparse_tables import SparseTable, TableConfig
    >>> t = SparseTable(TableConfig(dim=4, optimizer="sgd", learning_rate=1.0, initializer="zeros"))
    >>> keys = np.array([7, 9, 7], dtype=np.uint64)
    >>> t.push(keys, np.ones((3, 4), np.float32))     # key 7 twice: its gradients are summed
    >>> t.pull(np.array([7, 9, 11], dtype=np.uint64))[:, 0]
    array([-2., -1.,  0.], dtype=float32)
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa

from . import _kernels as K
from ._arena import big_array as _big_array, pow2 as _pow2
from ._snapshot import RecordSnapshot, take as take_snapshot
from ._admission import AdmissionSketch
from ._delta import DeltaCapture
from ._spill_tier import SPILL_TIME_NS, SpillTier
from ._load_kernels import DUPLICATES, key_order
from ._inputs import check_counts as _check_counts, check_keys as _check_keys, record_keys as _record_keys
from ._optimizers import HP_SIZE
from .budget import HEADROOM_ROWS, MemoryBudget
from .stats import SPILL_COUNTERS
from .config import INITIALIZER_CODE, OPTIMIZER_CODE, RowLayout, TableConfig
from .errors import SpillError, SpillFailedError, TableConfigError, TableFullError, TableInputError
from ._warn import WARN_GATES as _WARN_GATES, WARN_GATES_LOCK as _WARN_GATES_LOCK, WarnGate as _WarnGate
from .keysets import SortedKeySet, in_sorted, unique_keys
from .rows import EXISTED_UNKNOWN, EXISTED_YES, batch_to_records, existed_column, records_to_batch, row_schema
from .rwlock import RWLock
from .spill import SpillStore
from .stats import carry_counters as _carry_counters, new_snapshot, table_stats

log = logging.getLogger(__name__)

MAX_LOAD = 0.8            # index load factor that triggers a rehash into twice the slots
PARALLEL_PULL_MIN = 16384  # keys per thread below which a pull runs on the calling thread
TICK_REBASE = 1 << 31
FULL_WARNING_INTERVAL_S = 60.0   # a full table (max_rows) logs at most one warning per interval and name


class SparseTable(SpillTier, DeltaCapture, AdmissionSketch):
    """One shard of a sparse table.

    Parameters
    ----------
    config : TableConfig
    clock : callable returning float seconds, optional
        The table clock used for ``last_seen`` and expiry (default ``time.time``). Stored with one-second
        resolution as uint32.
    initial_rows : int
        Arena rows allocated up front (grows by doubling; untouched pages cost no RAM).
    name : str, optional
        Names the table in log messages; the shards of one table pass the same name, so a full table
        (``max_rows``) warns once per ``FULL_WARNING_INTERVAL_S`` for all of them.
    budget : MemoryBudget, optional
        The RAM budget this shard shares with the other shards of its table on the server (a
        ``SparseHost`` makes one from ``memory_bytes``). Without it, ``config.memory_bytes`` (when set)
        gives this shard a budget of its own. With a budget, the RAM tier holds what the budget leaves
        (``MemoryBudget.rows_cap``) instead of ``memory_rows``, and ``initial_rows`` is ignored.

    Raises
    ------
    SpillDirError
        ``spill_path`` holds files this engine did not create, another table or process uses it, the
        file system refuses it (read-only, a file on the way, no permission, no room), or RocksDB
        cannot open its database there.
    TableConfigError
        ``memory_bytes`` leaves no room for a RAM tier, or exceeds this machine's physical memory
        (``MemoryBudget.check_host``), or the arena and index cannot be mapped (ENOMEM); the message
        names the field.
    """

    def __init__(self, config: TableConfig, *, clock: Callable[[], float] = time.time,
                 initial_rows: int = 1024, name: str | None = None, budget: MemoryBudget | None = None):
        self.config = config
        self.name = name or "sparse table"
        self.layout = RowLayout.of(config)
        self.schema = row_schema(self.layout, config.optimizer)
        self._clock = clock
        lay = self.layout
        self._lay = np.array([lay.dim, lay.values, lay.state, lay.meta, lay.stride], np.int64)
        self._opt = OPTIMIZER_CODE[config.optimizer]
        hp = np.zeros(HP_SIZE, np.float64)
        hp[:] = [config.learning_rate, config.epsilon, config.initial_accumulator, config.beta1,
                 config.beta2, config.ftrl_beta, config.ftrl_l1, config.ftrl_l2, config.min_bound,
                 config.max_bound]
        self._hp = hp
        self._seed = np.uint64(config.seed % (1 << 64))
        self._init_kind = INITIALIZER_CODE[config.initializer]
        self._state = np.zeros(K.STATE_SLOTS, np.int64)
        self._state[K.S_FREE_HEAD] = -1
        self._state[K.S_GEN] = 1
        if config.uses_admission:
            self._sketch = np.zeros((config.sketch_depth, config.sketch_width), np.uint32)
        else:
            self._sketch = np.zeros((0, 0), np.uint32)
        if budget is None and config.memory_bytes:
            try:
                budget = MemoryBudget(config.memory_bytes, 1, lay.row_bytes, self._sketch.nbytes)
                budget.check_host()
            except TableConfigError as exc:
                raise TableConfigError(f"TableConfig.{exc}") from None
        self._budget = budget
        self._budget_token = budget.register() if budget is not None else None
        if budget is not None:
            # sized once for the largest RAM tier the budget allows: growth touches new pages of the
            # mapping and never copies the arena or rehashes the index under the lock
            initial_rows, slots = budget.max_rows_per_shard, budget.index_slots
        else:
            slots = _pow2(max(16, int(initial_rows / MAX_LOAD) + 1))
            if config.spill_path and initial_rows >= config.memory_rows:
                # a call adds rows before its eviction pass: room for them, so filling the tier never
                # copies the arena (untouched pages of the mapping cost nothing)
                initial_rows += HEADROOM_ROWS
        self._sizes = (max(16, initial_rows), slots)   # arena rows and index slots (restore_ram)
        self._released = False                          # release_ram: no rows in RAM until restore_ram
        try:
            self._alloc_arrays(*self._sizes)
        except OSError as exc:      # mmap's ENOMEM: more than the machine lets this process map
            if budget is not None:
                budget.forget(self._budget_token)
            what = f"memory_bytes={config.memory_bytes}" if budget is not None else f"initial_rows={initial_rows}"
            raise TableConfigError(f"{self.name}: {what}: its arena ({self._sizes[0]} rows of {lay.row_bytes} "
                                   f"bytes) and index ({slots} slots) cannot be mapped: {exc}") from None
        self._spill = (SpillStore(config.spill_path, lay.stride, budget, config.spill_compaction)
                       if config.spill_path else None)
        self._spilled_dirty = SortedKeySet()   # 8 bytes per key: it grows with the keys on disk
        self._load_distinct = False            # inside bulk_load(distinct=True)
        self._deleted: list[np.ndarray] = []   # keys deleted since the last clear (the next delta's tombstones)
        self._deleted_bytes = 0                # their bytes: counted with the dirty keys (_growing_bytes)
        self._checkpoint: str | None = None    # the checkpoint this table holds exactly (mark_checkpoint)
        self._existed_trusted = False          # inside delta_load of a delta whose parent it holds
        self._changes = 0                      # pushes, deletes and expiry passes so far (_delta)
        self._restore_start = None             # (changes, held the parent) at a restore's start
        self._tick = 1
        self._evict_seed = 0
        self._lock = RWLock()             # try_shared: stats() never waits behind a writer
        self._stats_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._counters = dict(pull_keys=0, pull_hits=0, pull_misses=0, push_keys=0, created=0,
                              rejected=0, rows_refused_full=0, deleted=0, evictions=0, promotions=0,
                              spill_writes=0, compactions=0, compacted_rows=0, released_bytes=0,
                              loaded_to_disk=0, loaded_unasked=0, **{k: 0 for k in SPILL_TIME_NS})
        self._spill_carry = dict.fromkeys(SPILL_COUNTERS, 0)   # carry_counters (stats.SPILL_COUNTERS)
        if name:
            with _WARN_GATES_LOCK:
                self._full_gate = _WARN_GATES.setdefault(name, _WarnGate())
        else:
            self._full_gate = _WarnGate()
        self._stats_snap = new_snapshot(self)   # sizes served while a writer holds the lock (stats)

    # ------------------------------------------------------------------------------ public API
    def pull(self, keys: np.ndarray, *, init_missing: bool = False, out: np.ndarray | None = None,
             rows: np.ndarray | None = None) -> np.ndarray:
        """Values of keys.

        Parameters
        ----------
        keys : uint64[n]
            Duplicates allowed.
        init_missing : bool
            Training pulls: keys without a row read the initial value a push would create for them
            (a pure function of seed and key), so a worker starts from the value the server will hold.
            Ignored when admission is on (not-yet-admitted keys read zeros). Nothing is created.
        out : float32[n, dim], optional
            Written in place instead of a new array (a server writes straight into its reply).
        rows : int64[m], optional
            Pull only ``keys[rows]`` into ``out[rows]`` (distinct positions; the keys of this shard in
            a request spanning several shards); ``out`` is then required and other rows are untouched.

        Returns
        -------
        float32[n, dim]
            ``out`` (or a new array). Unknown keys read zeros (or their initial value with
            ``init_missing``).

        Raises
        ------
        TableInputError
            keys is not a 1-D uint64 array.
        SpillError
            RocksDB failed reading or promoting the rows not in RAM; ``SpillFailedError`` when its
            store failed for good (``spill_failed``: then every call is refused).
        """
        keys = _check_keys(keys)
        dim = self.layout.dim
        if out is None:
            if rows is not None:
                raise TableInputError("pull: rows needs out (the array the rows are written to)")
            out = np.empty((len(keys), dim), np.float32)
        elif out.shape != (len(keys), dim) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise TableInputError(f"pull: out must be a C-contiguous float32[{len(keys)}, {dim}] array, "
                                  f"got {out.dtype}{list(out.shape)}")
        track = self._spill is not None
        if rows is not None:
            rows = np.ascontiguousarray(rows, np.int64)
            if len(rows) and (rows.min() < 0 or rows.max() >= len(keys)):
                raise TableInputError(f"pull: rows must be positions in [0, {len(keys)}), got "
                                      f"[{rows.min()}, {rows.max()}]")
        n = len(keys) if rows is None else len(rows)
        with self._lock.shared():
            self._refuse_if_failed()
            if rows is None:
                miss = self._pull_ram(keys, out, self._tick, track)
            else:
                miss = np.empty(len(rows), np.int64)
                miss = miss[:K.pull_rows_at(self._index, self._arena_u, self._arena_f, self._lay, keys, rows,
                                            out, self._tick, track, miss)]
        hits = n - len(miss)
        t0 = t1 = t2 = 0
        if len(miss) and self._spill is not None:
            t0 = time.perf_counter_ns()
            with self._lock.exclusive():
                t1 = time.perf_counter_ns()
                miss = self._pull_spilled(keys, miss, out)
                t2 = time.perf_counter_ns()
        if init_missing and len(miss) and not self.config.uses_admission:
            out[miss] = self.initial_values(keys[miss])
        self._count(pull_keys=n, pull_hits=hits, pull_misses=n - hits, spill_lock_wait_ns=t1 - t0,
                    pull_spilled_ns=t2 - t1)
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray, *, shows: np.ndarray | None = None,
             clicks: np.ndarray | None = None) -> None:
        """Apply the optimizer to the rows of keys, creating rows subject to admission and ``max_rows``.

        A key admission does not admit, or a new key once the table holds ``max_rows`` rows, gets no
        row: its update is dropped and counted (``stats()["rejected"]``, ``stats()["rows_refused_full"]``;
        a full table also logs a warning at most once a minute). Keys with rows are updated regardless.

        Parameters
        ----------
        keys : uint64[n]
            Duplicates are combined: their gradients, shows and clicks are summed before the update.
        grads : float32[n, dim]
        shows, clicks : float32[n], optional
            Counts behind each gradient. With shows, the combined gradient is divided by the combined
            show count before the update (Paddle's CtrCommonAccessor), so updates do not depend on
            batch size; show and click feed the expiry score. Without, show grows by occurrences.

        Raises
        ------
        TableInputError
            Wrong dtype or shape, length mismatch, NaN/Inf gradients, negative counts. The table is
            unchanged.
        SpillError
            RocksDB refused the eviction pass that writes rows back after the update; the update is
            applied (all of it, or under a budget the parts before that pass) and the rows stay in RAM.
            ``SpillFailedError``: the store stopped writing for good (``spill_failed``), now or before
            (then nothing was applied). A table whose store failed refuses every later call, so the
            update is never applied twice; a server's restart from its newest checkpoint drops it with
            the rest of what was trained since.
        """
        keys = _check_keys(keys)
        grads = self._check_matrix(grads, len(keys), "grads")
        shows, clicks = _check_counts(shows, clicks, len(keys))
        self._apply(keys, grads, shows, clicks, mode=0)

    def push_delta(self, keys: np.ndarray, deltas: np.ndarray, *, shows: np.ndarray | None = None,
                   clicks: np.ndarray | None = None) -> None:
        """GEO: ``value += delta`` with no optimizer (duplicates summed), held to the weight bounds; rows
        are created as by push.

        keys : uint64[n]; deltas : float32[n, dim]; shows, clicks : float32[n], optional: the counts the
        worker saw behind each delta since its last sync, added to the rows' show and click (and counted
        for admission) as a push's are; without them show grows by occurrences. Raises TableInputError
        and SpillError as ``push``.
        """
        keys = _check_keys(keys)
        deltas = self._check_matrix(deltas, len(keys), "deltas")
        shows, clicks = _check_counts(shows, clicks, len(keys))
        self._apply(keys, deltas, shows, clicks, mode=1)

    def initial_values(self, keys: np.ndarray) -> np.ndarray:
        """The values a push would create for keys : uint64[n] -> float32[n, dim] (nothing is created)."""
        keys = _check_keys(keys)
        out = np.empty((len(keys), self.layout.dim), np.float32)
        K.initial_values(keys, self.layout.dim, self._seed, self._init_kind, self.config.init_range,
                         self.config.min_bound, self.config.max_bound, out)
        return out

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """keys : uint64[n] -> bool[n], True where the key has a row (in RAM or RocksDB). Raises
        SpillError for a read error of RocksDB (``SpillFailedError``: its store failed, ``spill_failed``)."""
        keys = _check_keys(keys)
        with self._lock.shared():
            self._refuse_if_failed()
            return self._present(keys)

    def delete(self, keys: np.ndarray, *, tombstones: bool = False, at_parent: bool = False) -> int:
        """Delete the rows of keys : uint64[n] (absent keys are ignored); those the last clear's
        checkpoint held are reported as tombstones by ``dirty_rows`` (a row created since and deleted
        again needs none). Returns the number of rows deleted.

        ``tombstones``: the keys are a delta's tombstones, applied as part of its load (not a change
        that would keep ``finish_restore`` from marking the table); ``at_parent``: each of them had a
        row at the delta's parent checkpoint, so inside a trusted ``delta_load``
        (``sparse_tables._delta``) those not in RAM are deleted from RocksDB without reading them first.

        Raises
        ------
        SpillError
            RocksDB refused the delete of the rows' disk copies (one batch): nothing was deleted
            (``SpillFailedError``: the store failed for good, ``spill_failed``).
        """
        keys = unique_keys(_check_keys(keys))
        with self._lock.exclusive():
            self._refuse_if_failed()
            trusted = tombstones and at_parent and self._existed_trusted
            if not tombstones:
                self._changed()
            rows = np.empty(len(keys), np.int64)
            K.find_rows(self._index, self._arena_u, keys, rows)
            in_ram = rows >= 0
            flags = self._arena_u[rows[in_ram], self.layout.meta + K.M_FLAGS]
            gone, earlier = [keys[in_ram]], [keys[in_ram][self._earlier(flags)]]
            if self._spill is not None:
                if trusted:                     # tombstones of the parent this table holds: on disk
                    on_disk = keys[~in_ram]
                    earlier.append(on_disk)
                else:
                    pos, recs = self._spill.get(keys[~in_ram])
                    on_disk = keys[~in_ram][pos]
                    earlier.append(on_disk[self._earlier(recs[:, self.layout.meta + K.M_FLAGS])])
                # one batch, all or nothing: a second write failing after a first would leave RAM rows
                # flagged on disk whose copies are gone
                self._spill.delete(np.concatenate([keys[in_ram][(flags & K.F_ON_DISK) != 0], on_disk]))
                gone.append(on_disk)
            K.remove_rows(self._index, self._arena_u, self._state, self._lay, rows[in_ram])
            deleted = np.concatenate(gone)
            self._note_deleted(np.concatenate(earlier))
        self._count(deleted=len(deleted))
        return len(deleted)

    def shrink(self, now: float | None = None) -> int:
        """Expiry pass over every row (RAM and RocksDB), as Paddle's accessor Shrink.

        Show and click are multiplied by ``show_click_decay``; a row is deleted when its score
        ``(show - click) * nonclk_coeff + click * click_coeff`` is below ``delete_threshold`` or it was
        last pushed more than ``expire_after`` seconds before ``now``. Deleted keys are reported as
        tombstones by ``dirty_rows`` (as by ``delete``). Admission counts are halved (they age like TinyLFU's).

        Parameters
        ----------
        now : float, seconds of the table clock, optional (default: the clock)

        Returns
        -------
        int : rows deleted

        Raises
        ------
        SpillError
            RocksDB reported a read error while the pass scanned it (``SpillStore.scan``), or refused a
            write of the pass. The rows the pass deleted before are gone and reported as tombstones by
            ``dirty_rows``, as a whole pass's. The pass first removes the expired rows from RAM, then
            deletes their RocksDB copies: if that write fails, those rows stay deleted (their copies
            become pending deletes, ``SpillStore.delete(defer=True)``: read as absent by pull, contains,
            dumps and checkpoints, and deleted by the next write that succeeds; ``stats()
            ["pending_deletes"]``), the error says so and carries ``pending`` (uint64[k], those keys) and
            ``deleted`` (int, the rows the pass deleted), and the pass stops there: the rows only on
            disk are expired by the next pass, and admission counts are not halved.
            ``SpillFailedError`` at once: the store failed for good (``spill_failed``).
        """
        now_s = int(self._clock() if now is None else now)
        cfg = self.config
        expire_s = -1 if cfg.expire_after is None else int(cfg.expire_after)
        args = (now_s, expire_s, cfg.show_click_decay, cfg.delete_threshold, cfg.nonclk_coeff,
                cfg.click_coeff)
        with self._lock.exclusive():
            self._refuse_if_failed()
            self._changed()
            nram = int(self._state[K.S_NRAM])
            out_keys = np.empty(nram, np.uint64)
            out_disk = np.empty(nram, np.bool_)
            out_earlier = np.empty(nram, np.bool_)
            n = K.shrink_ram(self._index, self._arena_u, self._arena_f, self._state, self._lay, *args,
                             out_keys, out_disk, out_earlier)
            deleted = [out_keys[:n].copy()]
            earlier = [out_keys[:n][out_earlier[:n]]]
            try:
                if self._spill is not None:
                    self._delete_expired_copies(out_keys[:n][out_disk[:n]], n)
                    self._shrink_disk(args, deleted, earlier)    # appends each chunk's keys as it deletes them
            finally:        # a read error mid-pass: the rows deleted so far still become tombstones
                deleted_keys = np.concatenate(deleted)
                self._note_deleted(np.concatenate(earlier))
                self._count(deleted=len(deleted_keys))
                if self._budget is not None:    # the tombstones' keys, and the filter the pass rebuilt
                    self._budget.report(self._budget_token, self._growing_bytes(), int(self._state[K.S_NEXT]))
            if self._sketch.size:
                self._sketch >>= 1
        return len(deleted_keys)

    def _note_deleted(self, keys: np.ndarray) -> None:
        """keys : uint64[k] whose rows the last clear's checkpoint held and a delete removed (lock held)."""
        self._deleted.append(keys)
        self._deleted_bytes += keys.nbytes

    def _delete_expired_copies(self, keys: np.ndarray, n: int) -> None:
        """Delete the RocksDB copies of expired rows the pass removed from RAM (keys : uint64[k], of its
        ``n`` RAM rows deleted); with none, the deletes still pending are retried. A refused write keeps
        the keys as pending deletes, so the rows never come back, and raises (see ``shrink``)."""
        try:
            self._spill.delete(keys, defer=True)
        except SpillError as exc:
            what = (f"to delete {len(keys)} disk copies of them: they are pending deletes" if len(keys) else
                    "the retry of earlier pending deletes")
            msg = (f"{self.name}: expiry pass: {n} expired row(s) are deleted, but RocksDB refused {what} "
                   f"({self._spill.pending_deletes} in all, read as absent, deleted by the next write that "
                   f"succeeds); the pass stopped before the rows on disk: {exc}")
            err = SpillFailedError(msg, exc.path, exc.cause) if isinstance(exc, SpillFailedError) else SpillError(msg)
            err.pending, err.deleted = getattr(exc, "pending", keys), n
            raise err from exc

    @property
    def budget(self) -> MemoryBudget | None:
        """The memory budget this shard shares (``memory_bytes``), or None."""
        return self._budget

    def __len__(self) -> int:
        return int(self._state[K.S_NRAM]) + self._rows_spilled()

    def stats(self) -> dict:
        """Counters and sizes of this shard: a dict of counts, bytes, nanoseconds (``*_ns``) and seconds
        (``stats_age_s``), fields listed in ``sparse_tables.stats``. Never waits behind a writer: the
        counters are always current; the sizes (``rows``, ``ram_bytes``, ...) are read under the shared
        lock when it is free within ``stats.STATS_LOCK_WAIT_S``, else the last ones read are served with
        ``stale`` True and ``stats_age_s`` their age in seconds. Raises nothing for a held lock."""
        return table_stats(self)

    def carry_counters(self, old: "SparseTable") -> None:
        """Continue ``old``'s cumulative counters (pulls, pushes, rows created, call times, RocksDB's
        stalls and reads; not gauges such as rows or bytes): a server whose shards are replaced by a
        base load or a clear calls this on each new shard before closing the old one, so the counters
        it exports never go back."""
        _carry_counters(self, old)

    def rows(self, chunk_rows: int = 65536, *, clear: bool = False,
             sketch: list | None = None) -> Iterator[pa.RecordBatch]:
        """Every row, RAM and RocksDB, exactly once, as RecordBatches of ``self.schema``.

        The RAM rows are copied and RocksDB's read view made (``SpillStore.snapshot``) at one instant under
        the lock, so the dump is one consistent state of the shard even while pushes go on. A table that
        spills copies its RAM rows into a spool file in its spill directory (``_snapshot``), not RAM.
        ``clear``: a base's instant; the dirty state is cleared (``clear_dirty``) in the same locked step
        when iteration starts, so every row the next delta holds changed after the base's instant and
        its ``existed`` answers for the base (``sparse_tables._delta``). ``sketch``: a list that receives a
        copy of the admission sketch (uint32[depth, width]) taken in that same step, when iteration
        starts (nothing without admission; ``sparse_tables._admission``).

        Raises
        ------
        SpillError
            While iterated: RocksDB reported a read error (``SpillStore.scan``). At once:
            ``SpillFailedError``, the store failed for good (``spill_failed``: no dump of its state).
        """
        with self._lock.exclusive() if clear else self._lock.shared():
            self._refuse_if_failed()
            if clear:
                self._clear_dirty_locked()
            self._copy_sketch(sketch)
            spill = self._spill         # the dump's own reference: a close meanwhile does not drop it
            # the RAM rows with an older copy on disk (which the scan skips) come as a sorted key array
            ram = self._snapshot_live(0, int(K.F_ON_DISK))
            try:
                snapshot = spill.snapshot() if spill is not None else None
            except BaseException:
                ram.close()
                raise
        try:
            for recs in ram.chunks(chunk_rows):
                yield records_to_batch(recs, self.layout, self.schema)
            if snapshot is not None:
                for keys, recs in spill.scan(snapshot, chunk_rows):
                    keep = ~in_sorted(ram.flagged_keys, keys)
                    if keep.any():
                        yield records_to_batch(recs[keep], self.layout, self.schema)
        finally:
            ram.close()

    def load_rows(self, batches: Iterable[pa.RecordBatch]) -> int:
        """Insert or overwrite rows from RecordBatches of the row schema (bit-exact, optimizer state
        included). Loaded rows are clean (not dirty). Returns the number of rows loaded.

        A batch of a delta may carry ``existed`` (``rows.delta_schema``): inside ``delta_load`` of a
        delta whose parent this table holds, a table that spills takes it as the truth about each key
        (no RocksDB read to learn whether a row is new); elsewhere it is checked and ignored.

        Raises
        ------
        TableInputError
            A batch misses a column, has a wrong type or width, or nulls, or an ``existed`` value
            other than 0, 1 or 2 (that batch is not applied).
        TableFullError
            A batch would take the table past ``max_rows`` (that batch is not applied; earlier ones are).
            A checkpoint reader counts the rows it will load before it loads them.
        SpillError
            RocksDB refused a write of the rows (earlier batches are loaded); ``SpillFailedError`` when
            its store failed for good (``spill_failed``), before this batch or within it.
        """
        total = 0
        limit = self.config.max_rows
        for batch in batches:
            records = batch_to_records(batch, self.layout)
            existed = existed_column(batch)
            keys = _record_keys(records)
            total += len(records)
            with self._lock.exclusive():
                self._refuse_if_failed()
                self._next_tick()
                # room for the rows not in RAM yet (new, or promoted from RocksDB); overwrites need none
                rows = np.empty(len(keys), np.int64)
                K.find_rows(self._index, self._arena_u, keys, rows)
                n_new = int(np.count_nonzero(rows < 0))
                if limit and int(self._state[K.S_NRAM]) + n_new > limit:   # RAM-only: rows < 0 are new
                    have = int(self._state[K.S_NRAM])
                    raise TableFullError(f"{self.name}: loading {len(keys)} row(s) ({n_new} new) into "
                                         f"{have} would exceed max_rows={limit}; nothing of this batch "
                                         f"was loaded", limit=limit, rows=have + n_new)
                # checkpoint rows never repeat a key, and rows dumped from RocksDB come sorted: one
                # O(n) pass instead of np.unique's sort (the RAM path applies repeats in order)
                order = key_order(keys) if self._spill is not None else DUPLICATES
                known = existed if self._existed_trusted and order != DUPLICATES else None
                if self._spill is not None and n_new:
                    keep, n_new = self._load_to_disk(records, keys, rows, n_new, order, known)
                    records, keys, rows = records[keep], keys[keep], rows[keep]
                    known = known[keep] if known is not None else None
                self._reserve(n_new)
                flags = np.zeros(len(records), np.uint32)
                if self._spill is not None and known is None:
                    self._promote(keys if order != DUPLICATES else unique_keys(keys))
                elif self._spill is not None:
                    # a key the parent held and RAM does not is on disk: its row comes in flagged so
                    # (its copy there is stale) without reading it; only the unknown ones are asked
                    unknown = known == EXISTED_UNKNOWN
                    if unknown.any():
                        self._promote(keys[unknown])
                    flags[(known == EXISTED_YES) & (rows < 0)] = K.F_ON_DISK
                ok = K.upsert_records(self._index, self._arena_u, self._state, self._lay, records,
                                      flags, self._tick)
                if not ok:
                    raise RuntimeError("arena full after reserve: internal capacity error")
                self._maybe_evict()
        return total

    def close(self) -> None:
        """Release the RocksDB tier (its directory is removed, even when its store failed: see
        ``SpillStore.close``) and the pull threads."""
        with self._lock.exclusive():
            if self._budget is not None:
                self._budget.forget(self._budget_token)
            spill, self._spill = self._spill, None
            try:
                if spill is not None:
                    spill.close()
            finally:
                if self._pool is not None:
                    self._pool.shutdown()
                    self._pool = None

    def __enter__(self) -> "SparseTable":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------ internals
    def _apply(self, keys, grads, shows, clicks, mode: int) -> None:
        n = len(keys)
        has_shows = shows is not None
        empty = np.empty(0, np.float32)
        if not has_shows:
            shows = clicks = empty
        inverse = np.empty(n, np.int64)
        nu = K.dedup_index(keys, grads, shows, clicks, inverse)
        if nu < 0:
            i = -nu - 1
            what = "deltas" if mode else "grads"
            raise TableInputError(f"{what}[{i}] (key {int(keys[i])}): expected finite values and "
                                  f"non-negative shows/clicks, got a NaN, Inf or negative count")
        if nu == n:  # no duplicates (the usual case after a client's dedup): use the inputs as they are
            ukeys, ugrads, ushows, uclicks = keys, grads, shows, clicks
            ucounts = np.empty(0, np.int64)   # every key once (push_rows reads an empty count as 1)
        else:
            ukeys = np.empty(nu, np.uint64)
            ugrads = np.empty((nu, self.layout.dim), np.float32)
            ushows = np.empty(nu if has_shows else 0, np.float32)
            uclicks = np.empty(nu if has_shows else 0, np.float32)
            ucounts = np.empty(nu, np.int64)
            K.dedup_sum(keys, grads, shows, clicks, inverse, ukeys, ugrads, ushows, uclicks, ucounts)
        created = rejected = refused = 0
        limit = self.config.max_rows
        t0 = time.perf_counter_ns()
        with self._lock.exclusive():
            t1 = time.perf_counter_ns()
            self._refuse_if_failed()
            self._changed()
            self._next_tick()
            now_s = self._now_s()
            # keys done..end have their rows in RAM (all keys, but under a budget those that fit)
            end = self._promote_prefix(ukeys, 0) if self._spill is not None else nu
            args = (ukeys, ugrads, ushows, uclicks, ucounts, has_shows, mode, now_s)
            done = 0
            while done < nu:
                # the kernel stops at the first new key past its row cap (the index's load limit, or
                # max_rows) or past a full arena: keys done.. are untouched
                cap = int(MAX_LOAD * len(self._index))
                c, rj, k = self._push_rows(args, slice(done, end), min(cap, limit) if limit else cap)
                created, rejected, done = created + c, rejected + rj, done + k
                if done == nu:
                    break
                nram = int(self._state[K.S_NRAM])
                if limit and nram >= limit:
                    # full: the rest's present keys are updated, its new keys refused as not admitted
                    refused = self._push_present(args, done)
                    break
                if self._budget is not None and not self._released and self._evict_within_call(done == end):
                    # a budgeted table does not grow: rows were written back (or the promoted part is
                    # done); bring in the next part of the rest that fits
                    end = self._promote_prefix(ukeys, done)
                    continue
                self._reserve(min(nu - done, limit - nram) if limit else nu - done)   # grow, go on
                if end < nu:
                    end = self._promote_prefix(ukeys, done)
            self._maybe_evict()
            t2 = time.perf_counter_ns()
        self._count(push_keys=n, created=created, rejected=rejected, rows_refused_full=refused,
                    push_lock_wait_ns=t1 - t0, push_locked_ns=t2 - t1)
        if refused:
            self._warn_full(refused)

    def _push_rows(self, args, pick, cap: int) -> tuple[int, int, int]:
        """One ``K.push_rows`` call on the unique keys ``args[0][pick]`` of a deduplicated push
        (``pick``: a slice, taken as views, or int64 positions); a new row is made only while the rows
        in RAM are below ``cap``. Returns (created, rejected by admission, keys done). Lock held."""
        ukeys, ugrads, ushows, uclicks, ucounts, has_shows, mode, now_s = args
        cfg = self.config
        keys = ukeys[pick]
        return K.push_rows(
            self._index, self._arena_u, self._arena_f, self._state, self._lay, keys, ugrads[pick],
            ushows[pick] if has_shows else ushows, uclicks[pick] if has_shows else uclicks,
            ucounts[pick] if len(ucounts) else ucounts,
            has_shows, mode, self._opt, self._hp, now_s, self._tick, self._seed, self._init_kind,
            cfg.init_range, self._sketch, cfg.min_count, cfg.admit_probability, cap,
            np.empty(len(keys), np.int64), np.empty(K.PIPELINE_BLOCK, np.uint64),
            np.empty(K.PIPELINE_BLOCK, np.int64))

    def _push_present(self, args, start: int) -> int:
        """The table is full (``max_rows``): update the rows of the keys ``args[0][start:]`` that have
        one and refuse the others (no row, no sketch count: as keys admission does not admit).
        Returns the keys refused. Lock held exclusively."""
        tail = args[0][start:]
        rows = np.empty(len(tail), np.int64)
        K.find_rows(self._index, self._arena_u, tail, rows)
        have = start + np.flatnonzero(rows >= 0)
        if len(have):
            self._push_rows(args, have, int(MAX_LOAD * len(self._index)))   # all present: creates none
        return len(tail) - len(have)

    def _warn_full(self, refused: int) -> None:
        n = self._full_gate.add(refused, FULL_WARNING_INTERVAL_S)
        if n:
            log.warning("%s is full (a shard reached its max_rows=%d): %d new key(s) refused since the "
                        "last warning; their pushes are dropped and pulls read them as not admitted. "
                        "Training goes on; raise max_rows, add servers, or expire rows (expire_after / "
                        "delete_threshold with shrink) to make room", self.name, self.config.max_rows, n)

    def _pull_ram(self, keys, out, tick, track) -> np.ndarray:
        """Gather RAM rows (parallel for large pulls); returns positions of misses (int64)."""
        n = len(keys)
        threads = self.config.num_threads
        if threads <= 1 or n < 2 * PARALLEL_PULL_MIN:
            miss = np.empty(n, np.int64)
            nm = K.pull_rows(self._index, self._arena_u, self._arena_f, self._lay, keys, out, tick,
                             track, miss)
            return miss[:nm]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="table-pull")
        bounds = np.linspace(0, n, threads + 1).astype(np.int64)

        def part(a, b):
            miss = np.empty(b - a, np.int64)
            nm = K.pull_rows(self._index, self._arena_u, self._arena_f, self._lay, keys[a:b], out[a:b],
                             tick, track, miss)
            return miss[:nm] + a

        futures = [self._pool.submit(part, bounds[i], bounds[i + 1]) for i in range(threads)]
        return np.concatenate([f.result() for f in futures])

    def _snapshot_live(self, flag_mask: int, collect_flag: int) -> RecordSnapshot:
        """The live RAM rows (with any of ``flag_mask``'s flags when it is not 0) copied now, into the
        spill directory's spool file when the table spills (``_snapshot.take``); the keys of those with
        ``collect_flag`` come sorted in ``flagged_keys``. Lock held."""
        rows = np.empty(int(self._state[K.S_NRAM]), np.int64)
        n = K.live_rows(self._arena_u, self._state, self._lay, flag_mask, rows)
        spool = self._spill.path if self._spill is not None else None
        return take_snapshot(self._arena_u, rows[:n], self.layout.meta + K.M_FLAGS, collect_flag, spool)

    def _present(self, keys: np.ndarray) -> np.ndarray:
        """bool[n]: key has a row in RAM or on disk (lock held)."""
        rows = np.empty(len(keys), np.int64)
        K.find_rows(self._index, self._arena_u, keys, rows)
        present = rows >= 0
        if self._spill is not None and (~present).any():
            absent = np.flatnonzero(~present)
            pos, _ = self._spill.get(keys[absent])
            present[absent[pos]] = True
        return present

    def _rows_spilled(self) -> int:
        """Rows only in RocksDB: its keys (pending deletes excluded: ``SpillStore.count``) less the RAM
        rows with a copy there."""
        if self._spill is None:
            return 0
        if not self._state[K.S_NEXT]:       # no row ever in RAM (a new table): none flagged
            return self._spill.count
        return self._spill.count - K.count_flag(self._arena_u, self._state, self._lay, K.F_ON_DISK)

    def _alloc_arrays(self, rows: int, slots: int) -> None:
        """Empty arena of ``rows`` rows and index of ``slots`` slots (at start, or replacing arrays that
        hold no row: the old mappings go back to the OS). Lock held exclusively, or construction."""
        self._arena_u = _big_array((rows, self.layout.stride), np.uint32)
        self._arena_f = self._arena_u.view(np.float32)
        self._index = _big_array((slots,), np.uint64)
        self._index.fill(K.EMPTY)
        gen = self._state[K.S_GEN]          # the generation outlives the arrays (release_ram, restore_ram)
        self._state[:] = 0
        self._state[K.S_FREE_HEAD] = -1
        self._state[K.S_GEN] = gen

    def _reserve(self, n_new: int) -> None:
        """Make room for n_new more rows in the arena and the index (lock held exclusively)."""
        st = self._state
        need_rows = int(st[K.S_NEXT]) + n_new - int(st[K.S_NFREE])
        cap = self._arena_u.shape[0]
        if need_rows > cap:
            new_cap = max(2 * cap, need_rows)
            arena = _big_array((new_cap, self.layout.stride), np.uint32)
            used = int(st[K.S_NEXT])
            arena[:used] = self._arena_u[:used]
            self._arena_u = arena
            self._arena_f = arena.view(np.float32)
        need_slots = int(st[K.S_NRAM]) + n_new
        if need_slots > MAX_LOAD * len(self._index):
            slots = _pow2(int(need_slots / MAX_LOAD) + 1)
            slots = max(slots, 2 * len(self._index))
            index = _big_array((slots,), np.uint64)
            index.fill(K.EMPTY)
            K.rebuild_index(index, self._arena_u, self._lay, st)
            self._index = index

    def _next_tick(self) -> None:
        self._tick += 1
        if self._tick >= TICK_REBASE:
            shift = self._tick - (1 << 20)
            K.rebase_ticks(self._arena_u, self._state, self._lay, shift)
            self._tick -= shift

    def _now_s(self) -> int:
        now = self._clock()
        if not (0 <= now < 2 ** 32):
            raise TableInputError(f"table clock: expected seconds in [0, 2**32), got {now}")
        return int(now)

    def _check_matrix(self, arr, n: int, name: str) -> np.ndarray:
        dim = self.layout.dim
        if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.shape != (n, dim):
            got = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise TableInputError(f"{name}: expected float32[{n}, {dim}] (one row per key), got {got}")
        return np.ascontiguousarray(arr)

    def _count(self, **kw) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                self._counters[k] += int(v)

