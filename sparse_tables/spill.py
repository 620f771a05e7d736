"""The RocksDB tier of a shard: cold row records keyed by their uint64 key.

A record is the row's whole arena record (``RowLayout.stride`` little-endian uint32 words: key, values,
optimizer state, show, click, last_seen, tick, flags); the RocksDB key is the uint64 key big-endian, so
iteration runs in key order. Writes go in one ``WriteBatch`` per eviction pass, reads in one multi-get
per call. The tier is a cache of this process's live table, not durable state (checkpoints are): its
writes skip the write-ahead log and it is deleted when the table closes.

The spill directory (``SpillDir``) is claimed, never taken::

    {spill_path}/
        .sparse-engine-spill    marker, JSON {"pid", "host", "created"}: this engine made the directory
        .lock                   flock(LOCK_EX | LOCK_NB), held open for the table's lifetime
        rocksdb/                the database

A missing or empty directory is created (or adopted) and marked. A directory with the marker whose lock
is free was left by a run that died; it is wiped and reused. Anything else is refused with
``SpillDirError`` naming the path: a non-empty directory without the marker (its files are not
touched), or one whose lock another table or process holds. Only directories carrying the marker are
ever deleted.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from rocksdict import (BlockBasedIndexType, BlockBasedOptions, Cache, DBCompactionStyle, DBCompressionType, Options,
                       Rdict, ReadOptions, UniversalCompactOptions, WriteBatch, WriteBufferManager, WriteOptions)

from . import waits
from ._catch_up import CATCH_UP
from ._pending import EMPTY as _NO_KEYS, PendingDeletes
from ._spill_reads import SpillReads, key_bytes as _key_bytes
from ._spill_dir import DB_NAME, LOCK_NAME, MARKER_NAME, SpillDir, sweep_dead  # noqa: F401 (this module's API)
from .errors import SpillDirError, SpillError, SpillFailedError
from .keysets import ScalableBloom

log = logging.getLogger(__name__)


class ScanView(NamedTuple):
    """A read view of a ``SpillStore`` (``snapshot``): two iterators made at one instant, so they see the
    same rows: ``values`` yields the records in key order (each holds its key: the scan needs no key
    objects, 2.35-2.68M rows/s against 1.51-1.58M/s for (key, record) pairs), ``probe`` seeks (it
    checks where ``values`` stopped, and ``seek_records`` reads through it). ``dead`` : uint64[p], the
    store's pending deletes at that instant (``_pending``): rows the view holds that were deleted."""
    values: object
    probe: object
    dead: np.ndarray = _NO_KEYS


def table_options(budget=None, block_size: int | None = None, partitioned: bool = False) -> BlockBasedOptions:
    """The block-based table options of a spill store (``rocksdb_options``); with a ``budget.MemoryBudget``
    the budget's shared block cache (made here, with its write-buffer manager, by the first store).
    ``block_size`` (bytes, default ``BLOCK_SIZE``) and ``partitioned`` (a two-level index and partitioned
    filters) exist for ``bench/rocksdb_cold_read_bench.py``, which measured them (``BLOCK_SIZE``)."""
    table = BlockBasedOptions()
    # RocksDB's own Bloom filter, 10 bits per key (~1% false positives): a miss costs no data block
    # read. Filter and index blocks live in the block cache (counted by its capacity instead of growing
    # outside it), the level-0 ones pinned there.
    table.set_bloom_filter(10, False)
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    table.set_pin_top_level_index_and_filter(True)
    table.set_block_size(BLOCK_SIZE if block_size is None else int(block_size))
    if partitioned:
        table.set_index_type(BlockBasedIndexType.two_level_index_search())
        table.set_partition_filters(True)
        table.set_metadata_block_size(4096)
    if budget is not None:
        if budget.cache is None:
            budget.cache = Cache(budget.rocksdb_bytes)
            budget.write_buffer_manager = WriteBufferManager.new_write_buffer_manager_with_cache(
                budget.rocksdb_bytes - budget.cache_bytes, False, budget.cache)
        table.set_block_cache(budget.cache)
    return table


def rocksdb_options(budget=None, compaction: str = "level") -> Options:
    """RocksDB options for a spill store: point lookups of ~100-byte records, batched writes.

    With a ``budget.MemoryBudget`` its stores share one block cache of ``budget.rocksdb_bytes`` and one
    write-buffer manager whose memtables are charged to that cache, so RocksDB's memory is one number
    the budget counts; without one, a store gets a cache of its own (32 MiB, RocksDB's default).
    ``compaction``: ``level`` or ``universal`` (``TableConfig.spill_compaction``).
    """
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    table = table_options(budget)
    if budget is not None:
        opts.set_write_buffer_manager(budget.write_buffer_manager)
        opts.set_write_buffer_size(budget.write_buffer_bytes)
    else:
        opts.set_write_buffer_size(64 << 20)
    opts.set_max_write_buffer_number(2)
    opts.set_block_based_table_factory(table)
    # no Bloom filter on the last level: a key read here has passed the store's own ScalableBloom, so it
    # is (but for ~1% false positives) in the database, mostly on the last level, where a filter only
    # costs block cache room. The upper levels keep theirs. Drops ~90% of the filter bytes, which
    # otherwise crowd a small budget's cache (memtables are charged to it too). scale_bench at 20M keys,
    # 1 GB budget: pull 230k-256k keys/s at the end against 206k-213k in three runs without, growth
    # 136-142 s against 157-165 s.
    opts.set_optimize_filters_for_hits(True)
    opts.set_compression_type(COMPRESSION())
    # leveled compaction with dynamic level sizes (space amplification ~1.1; the default), or universal
    # (TableConfig.spill_compaction: fewer rewrites per row, docs/scale-measurements.md); RocksDB's default
    # write-stall triggers (20 / 36 level-0 files) and a rate limit on flush and compaction writes, so
    # background writing leaves the disk and a core to the requests
    if compaction == "universal":
        opts.set_compaction_style(DBCompactionStyle.universal())
        universal = UniversalCompactOptions()
        universal.max_size_amplification_percent = UNIVERSAL_MAX_AMP_PERCENT
        opts.set_universal_compaction_options(universal)
    else:
        opts.set_compaction_style(DBCompactionStyle.level())
        opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_level_zero_file_num_compaction_trigger(L0_TRIGGERS[0])
    opts.set_level_zero_slowdown_writes_trigger(L0_TRIGGERS[1])
    opts.set_level_zero_stop_writes_trigger(L0_TRIGGERS[2])
    opts.set_max_background_jobs(BACKGROUND_JOBS)
    opts.set_max_subcompactions(SUBCOMPACTIONS)
    opts.set_ratelimiter(RATE_LIMIT_BYTES_PER_S, 100_000, 10)
    return opts


# bench/rocksdb_bench.py on real trained rows (docs/scale-measurements.md): lz4 stores them in 78% of the
# bytes of no compression (70 vs 91 bytes per row of 72) at the same point-read rate; zstd saves 10% more but reads
# up to 2x slower. Blocks of 4 KiB (RocksDB's default): a promotion reads one random row of a big table,
# so each read decompresses and checksums a whole block for one record. In the scale workload
# (bench/scale_bench.py's traffic in-process, 10M-13M keys, a 1 GB budget) RocksDB's multi-gets took 27.6 s
# with 16 KiB blocks and 15.8 s with 4 KiB (160k -> 210k keys/s); dense reads (many keys per block) favour
# 16 KiB slightly. The index blocks are 4x larger than with 16 KiB (~45 MB of the block cache at 10^8 keys).
# 2 KiB and 1 KiB blocks, and a two-level index with partitioned filters, left a cold read's CPU where it was
# (bench/rocksdb_cold_read_bench.py, 25M rows: 12-18 us a key for every layout, 4.9 us warm;
# docs/scale-measurements.md).
BLOCK_SIZE = 4096
COMPRESSION = DBCompressionType.lz4
RATE_LIMIT_BYTES_PER_S = 256 << 20
# Compaction must keep up with a budgeted server's eviction writes, or its backlog grows without bound
# (scale_bench, 100M keys, 4 GB: 17 GB pending, ~50 level-0 files and 66 s of write stalls at the end with
# 2 background jobs). RocksDB's thread pools are per process, shared by the shards' databases: 2 jobs
# gave them 1 flush and 1 compaction thread at a time, and a level-0 compaction of random keys into the
# base level (which every flush overlaps) cannot run beside that level's own compaction, so level 0
# piled up. 4 jobs (3 compaction threads) and 2 subcompactions (a level-0 compaction split in two key
# ranges): bench/spill_ingest_bench.py, RocksDB alone, 100M rows, 275 s against 377 s, no stall until
# 80M rows; scale_bench: 1.7 GB pending, 14 level-0 files and 0.2 s stalled at 100M keys.
BACKGROUND_JOBS = 4
SUBCOMPACTIONS = 2
# universal compaction (TableConfig.spill_compaction): tiered sorted runs, each row rewritten fewer times,
# at up to this many percent more bytes on disk than the live rows between merges (RocksDB's default is
# 200; the disk target of a budgeted table is 1.2x the record size). A full merge keeps its inputs until
# it ends: scale_bench at 100M keys, 4 GB, peaked at 10.1 GB for ~5.2 GB of live rows (1.9x, du every 15 s),
# and at 1.63x the bytes of the rows then on disk in a run that samples both (engine plan's disk_peak_over_live)
UNIVERSAL_MAX_AMP_PERCENT = 50
# level-0 files (compaction trigger, writes slow down, stop): RocksDB's defaults, and while a base restore
# loads (``SpillStore.bulk``) far more: its small memtables (a budget's share per shard: 4-64 MiB) flush
# faster than compaction merges them, and the default slowdown made a 30M-row restore wait on stalls
# (44-49 s, against 31 s with these raised; bench/scale_bench.py --keep, then the restore in-process).
# Compaction waits too, as RocksDB's own PrepareForBulkLoad has it (auto compaction off; a raised file
# trigger alone does not hold it, since RocksDB also scores level 0 by its bytes): merging while loading
# spends the cores on rows that the next flushes overlap again. A 100M-row restore (4 GB budget, 4
# shards) took 105 s with 3 compaction threads merging as usual, 98 s with the file trigger at 256,
# 81-83 s with the single compaction thread of before, and 62.7-66.9 s with compaction off; level 0 then
# held 148 files a shard, merged 30 s after the load (RSS 1.045 of the budget during the load, 1.04 while
# merging: the level-0 filters are pinned in the block cache). RocksDB applies no level-0 stall while
# auto compaction is off, so a load that leaves as many level-0 files as the raised slowdown trigger turns
# compaction back on (``_write``). When the load ends, the process's stores catch up one at a time
# (``_catch_up``: several at once held their rows on disk twice together, a server's disk peak), each
# getting its stall triggers back once level 0 is under the slowdown trigger.
L0_TRIGGERS = (4, 20, 36)
# rows per RocksDB write batch, which bounds how long a write holds the GIL (a thread beside a 400k-row
# put of 152-byte records paused at most 3.4-5.9 ms in these batches, 114-120 ms in one batch)
WRITE_BATCH_ROWS = 8192
# a full scan (a base dump, an expiry pass) reads each file sequentially: 2 MiB of readahead turns its
# 4 KiB block reads into few large ones (pread was 18% of a 20M-row base save's busy time without)
SCAN_READAHEAD = 2 << 20
L0_TRIGGERS_BULK = (L0_TRIGGERS[0], 400, 800)
BULK_SETTLE_S = 600.0
# Write stalls. RocksDB delays writes (to its delayed write rate) once compaction falls behind (level 0 at
# the slowdown trigger, pending compaction bytes) and stops them at the stop trigger or with every memtable
# waiting for its flush. rocksdict's write holds the GIL for its whole call, so a stalled write froze every
# Python thread of the server for the stall's length: the RPC threads of every shard and the health
# service; a stop even blocked the thread that would have lifted it (``_catch_up``'s thread needs the GIL to
# call SetOptions). Writes therefore ask RocksDB not to wait (``no_slowdown``: it refuses with "Result
# incomplete: Write stall") and ``SpillStore._write`` waits here with the GIL released, then writes the
# batch again: the writing shard waits out the stall as before (its lock held), the other threads run.
# A stall longer than STALL_TIMEOUT_S (compaction stuck, the disk gone) fails the write with SpillError.
STALL_TIMEOUT_S = 300.0
STOP_NAP_S = 0.005          # poll period while writes are stopped (RocksDB's own stop waits on a signal)
# The spill filter (``ScalableBloom``) never forgets a key, while expiry passes delete keys from RocksDB: a
# job whose keys churn (new ones arriving, old ones expiring) grew it with every key it ever spilled. A
# soak of 40 expiry passes (400k new keys a pass, 880k on disk throughout) took it from 4.5 to 46 bytes
# per key on disk (5 filters; 16M keys ever) and its false positives on absent keys from 1.0% to 3.8%:
# memory a budget takes from the RAM tier. And the delta after a pass read every key the pass deleted
# back from RocksDB under the table's exclusive lock (is it there again? the filter said maybe): 1.6 s
# for 1M expired keys. An expiry pass sees every key on disk, so it fills a new filter with the keys it
# leaves there and swaps it in (``begin_filter_rebuild``): ~32 ns a key (bench: 10M sorted keys), about
# 4% of the pass, and the filter holds the keys on disk alone, one filter deep.
FILTER_MIN_KEYS = 1 << 20     # keys the first filter of a store's spill filter holds (1.25 MiB)


class SpillStore(SpillReads):
    """Row records in RocksDB, plus a Bloom filter of every key ever written (its scans and seeks of a
    read view: ``_spill_reads.SpillReads``).

    A ``delete(keys, defer=True)`` that RocksDB refuses keeps its keys as pending deletes
    (``pending_deletes``): every read (``get``, ``scan``, ``seek_records``) treats them as absent, and
    every later write batch deletes them ahead of its own operations (a key put in that batch ends
    present), the set emptying when such a write succeeds.

    A write error after which RocksDB stops writing for good (a flush or compaction failed: a full
    disk, the directory removed; ``_check_stopped``) leaves the store ``failed``: every later write is
    refused at once with ``SpillFailedError``, reads still work, and ``close`` removes it as usual.

    Parameters
    ----------
    path : str
        The spill directory, claimed through ``SpillDir`` (created or reused; refused when foreign or
        in use); the database lives in its ``rocksdb/`` subdirectory.
    stride : int
        Words (uint32) per record.
    budget : budget.MemoryBudget, optional
        The server's budget this store's RocksDB memory is part of (``rocksdb_options``).
    compaction : str
        ``level`` or ``universal`` (``TableConfig.spill_compaction``).

    Raises
    ------
    SpillDirError
        The directory cannot be claimed (see ``SpillDir``), or RocksDB cannot open a database in it
        (a full disk, say): a configuration to change, not a fault a restart would mend.
    """

    def __init__(self, path: str, stride: int, budget=None, compaction: str = "level"):
        self.path = Path(path)
        self.stride = stride
        self._dir = SpillDir(self.path)
        try:
            self._db = Rdict(str(self._dir.db_path), rocksdb_options(budget, compaction))
        except Exception as exc:  # rocksdict raises plain Exception subclasses
            self._dir.release()
            raise SpillDirError(f"spill directory {self.path}: RocksDB cannot open a database in it: {exc}; set "
                                f"spill_path to a writable directory on a file system with room",
                                str(self.path)) from exc
        self._write_opts = WriteOptions()
        self._write_opts.disable_wal = True
        self._write_opts.no_slowdown = True      # stalls are waited out GIL-free (STALL_TIMEOUT_S)
        self.stall_timeout_s = STALL_TIMEOUT_S
        self.stalls = 0                          # writes RocksDB refused at least once because of a stall
        self.stall_s = 0.0                       # seconds writes spent waiting out stalls
        self._paced = False                      # the last write met a slowdown: pace the next one
        self._last_nbytes = 0                    # bytes of the last write (RocksDB's delay charges it)
        self._bloom = ScalableBloom(initial_capacity=FILTER_MIN_KEYS)
        self._rebuild: ScalableBloom | None = None   # the filter a full scan fills (begin_filter_rebuild)
        self._settled = threading.Event()      # set: RocksDB's own level-0 triggers are in force
        self._settled.set()
        self._catch_up_submitted = 0.0           # when bulk(False) handed this store to CATCH_UP
        self.catch_up_error: str | None = None   # why CATCH_UP could not catch this store up
        self._compaction_deferred = False       # a bulk load holds auto compaction off (``bulk``)
        self._pending = PendingDeletes()         # deletes RocksDB refused, carried by the next write
        self.failed: str | None = None           # why RocksDB stopped writing for good (_check_stopped)
        self.failed_cause = ""                   # RocksDB's error then
        self._background_errors = 0              # RocksDB's count of them when last looked at
        self.count = 0  # keys present in the database (pending deletes not counted)
        self.reads = 0
        self.writes = 0

    def _properties(self, names: tuple) -> dict:
        """{name: int} of RocksDB integer properties ((name, property) pairs; 0 where unavailable)."""
        out = {}
        for name, prop in names:
            try:
                out[name] = int(self._db.property_int_value(prop) or 0)
            except Exception:  # property names vary across RocksDB builds
                out[name] = 0
        return out

    def compaction(self) -> dict:
        """RocksDB's background work now: ``running_compactions``, ``pending_compaction_bytes``,
        ``level0_files``, ``write_stopped`` (0/1) and ``delayed_write_rate`` (bytes/s; 0: no stall)."""
        return self._properties((("running_compactions", "rocksdb.num-running-compactions"),
                                 ("pending_compaction_bytes", "rocksdb.estimate-pending-compaction-bytes"),
                                 ("level0_files", "rocksdb.num-files-at-level0"),
                                 ("write_stopped", "rocksdb.is-write-stopped"),
                                 ("delayed_write_rate", "rocksdb.actual-delayed-write-rate")))

    def memory(self) -> dict:
        """RocksDB's own memory now, bytes: ``rocksdb_block_cache`` (the whole cache, shared by every
        store of a budget; index and filter blocks included), ``rocksdb_memtables``,
        ``rocksdb_table_readers`` (index and filter blocks held outside the cache: ~0 here)."""
        return self._properties((("rocksdb_block_cache", "rocksdb.block-cache-usage"),
                                 ("rocksdb_memtables", "rocksdb.size-all-mem-tables"),
                                 ("rocksdb_table_readers", "rocksdb.estimate-table-readers-mem")))

    def bulk(self, on: bool) -> None:
        """A bulk load starts (True) or ends (False). Starting turns RocksDB's auto compaction off and
        raises its level-0 write-stall triggers to ``L0_TRIGGERS_BULK`` (live ``SetOptions``), so the
        load neither merges while it writes nor slows down (a load that leaves as many level-0 files as
        the raised slowdown trigger turns compaction back on: ``_write``). Ending with level 0 under the
        slowdown trigger of ``L0_TRIGGERS`` turns compaction on and puts those triggers back at once.
        Ending over it submits the store to the process's ``_catch_up.CATCH_UP``, which turns the
        stores' compaction on one at a time, each once the one before it has brought level 0 under the
        slowdown trigger (``catch_up_poll``, at most ``BULK_SETTLE_S``), and then puts its triggers
        back: a catch-up compaction holds a shard's rows on disk twice while it runs, and several at
        once were a server's disk peak (that module's docstring). Meanwhile ``bulk_loading`` stays True
        and the first writes after a restore are not stopped by the level-0 files still waiting.

        Raises
        ------
        SpillError
            RocksDB refused the options.
        """
        if on:
            self._leave_catch_up()                   # of an earlier load: the triggers go up again
            self._set_options({"disable_auto_compactions": "true"})
            self._compaction_deferred = True
            self._set_l0(L0_TRIGGERS_BULK)
            self._settled.clear()
            return
        if self._level0_files() < L0_TRIGGERS[1]:
            self._resume_compaction()
            self._settle_now()
            return
        self._catch_up_submitted = time.monotonic()
        CATCH_UP.submit(self)

    def catch_up_start(self) -> None:
        """``CATCH_UP``'s turn of this store: compaction on (SpillError when RocksDB refuses)."""
        self._resume_compaction()

    def catch_up_poll(self) -> bool:
        """``CATCH_UP`` asks whether this store has caught up: level 0 under the slowdown trigger (the
        merge of the load's level-0 files, which all overlap, is one compaction and removes them as it
        ends), or ``BULK_SETTLE_S`` since ``bulk(False)`` submitted it (a store whose turn comes later
        than that is settled at its first poll, so none waits longer with compaction off, however many
        stores are ahead of it). Then its write-stall triggers are back and the answer is True
        (SpillError when RocksDB refuses)."""
        waited, l0 = time.monotonic() - self._catch_up_submitted, self._level0_files()
        if l0 < L0_TRIGGERS[1] or waited > BULK_SETTLE_S:
            self._settle_now()
            log.info("RocksDB spill store at %s: caught up %.1f s after its bulk load ended (%d level-0 "
                     "files)", self._dir.db_path, waited, l0)
            return True
        return False

    def catch_up_failed(self, exc: Exception) -> None:
        """``CATCH_UP`` could not turn compaction on or read level 0 (RocksDB refused): said once, at
        error level, and kept in ``catch_up_error``; ``bulk_loading`` stays True, and a write that piles
        level 0 up to the raised slowdown trigger tries to turn compaction on again (``_write``)."""
        self.catch_up_error = f"RocksDB spill store at {self._dir.db_path}: catch-up after a bulk load: {exc}"
        log.error("%s", self.catch_up_error)

    def _resume_compaction(self) -> None:
        """Auto compaction back on after ``bulk(True)`` put it off (nothing otherwise)."""
        if self._compaction_deferred:
            self._set_options({"disable_auto_compactions": "false"})
            self._compaction_deferred = False

    @property
    def bulk_loading(self) -> bool:
        """True from ``bulk(True)`` until the store has caught up (``bulk``)."""
        return not self._settled.is_set()

    def _level0_files(self) -> int:
        return self._properties((("l0", "rocksdb.num-files-at-level0"),))["l0"]

    def _leave_catch_up(self) -> None:
        """Out of ``CATCH_UP`` (a new load, close): returns once its thread has let go of this store."""
        CATCH_UP.cancel(self)
        self._settled.set()

    def _set_l0(self, triggers: tuple[int, int, int]) -> None:
        self._set_options({"level0_file_num_compaction_trigger": str(triggers[0]),
                           "level0_slowdown_writes_trigger": str(triggers[1]),
                           "level0_stop_writes_trigger": str(triggers[2])})

    def _set_options(self, options: dict) -> None:
        try:
            self._db.set_options(options)
        except Exception as exc:  # rocksdict raises plain Exception subclasses
            raise SpillError(f"RocksDB spill store at {self._dir.db_path}: set_options: {exc}") from exc

    def _settle_now(self) -> None:
        self._set_l0(L0_TRIGGERS)
        self._settled.set()

    def __repr__(self) -> str:
        return f"SpillStore({str(self._dir.db_path)!r})"

    @property
    def bloom_bytes(self) -> int:
        """Bytes of the spill filter, and of the one a full scan is filling (``begin_filter_rebuild``)."""
        return self._bloom.nbytes + (self._rebuild.nbytes if self._rebuild is not None else 0)

    def begin_filter_rebuild(self) -> None:
        """Start a new spill filter for a full scan (an expiry pass) to fill with the keys it finds on disk
        and leaves there (``filter_keep``), sized for the keys on disk now (10 bits each, at least
        ``FILTER_MIN_KEYS``). The present filter keeps every key ever written, so keys deleted
        since cost memory and false positives for ever. Call under the table's exclusive lock before the
        scan's view is made, and ``end_filter_rebuild`` after the scan (in a finally). Meanwhile the
        present filter answers every read, and keys new to the store enter both."""
        self._rebuild = ScalableBloom(initial_capacity=max(self.count, FILTER_MIN_KEYS))

    def filter_keep(self, keys: np.ndarray) -> None:
        """keys : uint64[n], keys a full scan found on disk and left there: into the filter being rebuilt
        (nothing when none is)."""
        if self._rebuild is not None and len(keys):
            self._rebuild.add(np.ascontiguousarray(keys, dtype=np.uint64))

    def end_filter_rebuild(self, complete: bool) -> None:
        """End ``begin_filter_rebuild``: with ``complete`` (the scan saw every key on disk and each one it
        kept went to ``filter_keep``) the new filter replaces the present one; otherwise (a read or write
        error stopped it) the new one is dropped and the present one, which holds every key, stays."""
        new, self._rebuild = self._rebuild, None
        if new is None or not complete:
            return
        old = self._bloom
        self._bloom = new
        log.info("RocksDB spill store at %s: spill filter rebuilt from the %d keys on disk (%d bytes; it had "
                 "taken %d keys, %d bytes)", self._dir.db_path, new.added, new.nbytes, old.added, old.nbytes)

    def put(self, keys: np.ndarray, records: np.ndarray, new_mask: np.ndarray, *,
            presorted: bool = False) -> None:
        """Write records in batches of ``WRITE_BATCH_ROWS``. keys : uint64[m], distinct; records :
        uint32[m, stride]; new_mask : bool[m], True where the key was not in the database before (keeps
        ``count``; a key with a pending delete counts as new whatever it says); presorted : the caller
        knows keys are increasing (no sort, no reordering copy).

        rocksdict's ``write`` holds the GIL for its whole call (its multi-get does not), and building a
        batch is one C loop that holds it too: one batch of an eviction pass froze every Python thread
        of the server, other shards' requests included, for as long as it took (400k rows: 84 ms). A
        batch at a time, the other threads run between batches. A failed write leaves the batches
        before it written and counted, and the ``SpillError`` carries their keys as ``written``
        (uint64[j], increasing unless the caller passed ``presorted`` keys); each batch's keys enter the
        Bloom filter before it is written (a key there that is not on disk costs one read; one on disk
        but not there would be lost).

        Raises
        ------
        SpillError
            A write failed or stalled too long (``_write``; ``SpillFailedError`` when the store failed
            for good); ``written``: the keys already on disk."""
        if len(keys) == 0:
            return
        # in key order: RocksDB's memtable (a skiplist) inserts sorted keys 2-10x faster than random
        # ones (200k rows of 96 bytes: 1.1-2.1 us per row random, 0.1-0.5 us sorted)
        if not presorted:
            order = np.argsort(keys)
            keys, records, new_mask = keys[order], records[order], new_mask[order]
        if len(self._pending):          # a pending delete's key is not counted: its put makes it new
            new_mask = new_mask | self._pending.contains(keys)
        records = np.ascontiguousarray(records, dtype="<u4")
        for start in range(0, len(keys), WRITE_BATCH_ROWS):
            part = slice(start, start + WRITE_BATCH_ROWS)
            k, new = keys[part], new_mask[part]
            kb, vals = _key_bytes(k), records[part].view(f"V{4 * self.stride}").ravel().tolist()
            self._bloom.add(np.ascontiguousarray(k[new], dtype=np.uint64))
            self.filter_keep(k[new])         # a rebuild's scan never sees these: its view came before
            try:
                self._write(lambda wb: collections.deque(map(wb.put, kb, vals), maxlen=0),   # the loop runs in C
                            f"{len(k)} rows")
            except SpillError as exc:
                exc.written = keys[:start]     # the keys the batches before this one wrote (see put)
                raise
            self.count += int(new.sum())
            self.writes += len(k)

    def _write(self, fill, what: str, with_pending: bool = True) -> None:
        """Write one batch, ``fill(batch)`` adding its operations, waiting out RocksDB's write stalls with
        the GIL released (``STALL_TIMEOUT_S``). A refused write consumed its batch, so each attempt
        fills a new one. ``stall_s`` gains every second waited (after a refusal, and the pacing before
        a write under a slowdown); ``stalls`` counts the writes RocksDB refused at least once. The
        pending deletes go first in the batch (RocksDB applies a batch in order: a key deleted there and
        put by ``fill`` ends present) and are forgotten once it is written; a failed write keeps them.

        Raises
        ------
        SpillError
            RocksDB failed the write, or stalled it for longer than ``stall_timeout_s`` (the message
            names the store and RocksDB's state: level-0 files, pending compaction bytes).
        SpillFailedError
            The store is ``failed``, or this write found RocksDB stopped for good (``_check_stopped``).
        """
        if self.failed is not None:
            raise self._failed_error(what)
        dead = self._pending.keys if with_pending else _NO_KEYS
        if len(dead) > WRITE_BATCH_ROWS:
            # a large backlog is written first in batches of its own, each forgotten once written: one
            # batch of 10M deletes would build ~0.5 GB of key bytes on every attempt, holding the GIL
            for start in range(0, len(dead), WRITE_BATCH_ROWS):
                kb = _key_bytes(dead[start:start + WRITE_BATCH_ROWS])
                self._write(lambda wb: collections.deque(map(wb.delete, kb), maxlen=0),
                            f"{len(kb)} pending deletes", with_pending=False)
                self._pending.forget_first(len(kb))
            dead = self._pending.keys
        if len(dead):                                # deletes refused before: first in every batch
            dead_kb, inner = _key_bytes(dead), fill
            what = f"{what} and {len(dead)} pending deletes"

            def fill(wb):
                collections.deque(map(wb.delete, dead_kb), maxlen=0)
                inner(wb)
        started = None
        t0 = time.monotonic()
        paced = False
        nap = STOP_NAP_S / 2                         # back-off after a refusal no stall explains
        stall = None                                 # a wait by design, told to the server's watchdog
        try:
            while True:
                wb = WriteBatch(raw_mode=True)
                fill(wb)
                nbytes = wb.size_in_bytes()          # what RocksDB's delay charges (header and varints too)
                if self._paced and started is None and not paced:   # the last write met a slowdown
                    paced = True
                    self._wait_delay(nbytes, 1.0, t0, what)
                try:
                    self._db.write(wb, self._write_opts)
                    if len(dead):
                        self._pending.clear()        # nothing else writes meanwhile (the table's lock)
                        log.info("RocksDB spill store at %s: %d pending deletes written", self._dir.db_path,
                                 len(dead))
                    if self._compaction_deferred and self._level0_files() >= L0_TRIGGERS_BULK[1]:
                        # RocksDB applies no level-0 stall while auto compaction is off: nothing else
                        # would bound level 0 (and its filters pinned in the cache) in a load this big
                        log.warning("RocksDB spill store at %s: a bulk load reached %d level-0 files; "
                                    "compaction resumes", self._dir.db_path, L0_TRIGGERS_BULK[1])
                        self._resume_compaction()
                    break
                except Exception as exc:  # rocksdict raises plain Exception subclasses
                    if "Write stall" not in str(exc):
                        self._check_stopped(what)
                        raise SpillError(f"RocksDB spill store at {self._dir.db_path}: writing {what} failed: "
                                         f"{exc}") from exc
                finally:
                    self._last_nbytes = nbytes       # RocksDB charges the next write for it, refused or not
                started = time.monotonic() if started is None else started
                if stall is None:
                    stall = waits.began()
                if self._wait_stop(started, what):
                    continue                         # a stop reserves no delay: write again at once
                # RocksDB reserved the refused write's delay (WriteController::GetDelay: its credit zeroed,
                # the next refill that much later) and credits only the time after it: wait twice the delay
                self._wait_delay(nbytes, 2.0, started, what)
                if not self._paced:                  # refused, and no stall visible: back off, never spin
                    nap = min(2 * nap, 0.05)
                    time.sleep(nap)
        finally:
            if stall is not None:
                waits.ended(stall)
            if started is not None:
                self.stalls += 1
            if started is not None or paced:
                self.stall_s += time.monotonic() - t0

    def _check_stopped(self, what: str) -> None:
        """Raise SpillFailedError (and mark the store ``failed``, logged once) when RocksDB has stopped
        writing for good: its count of background errors rose (a flush or compaction failed) and a
        flush, which such a database refuses with that error, fails. RocksDB then answers writes with
        the error, or (``no_slowdown``) with "Write stall" and writes stopped, which no wait ends. A
        refusal without a background error (a fault outside RocksDB's database) leaves it usable."""
        errors = self._properties((("n", "rocksdb.background-errors"),))["n"]
        if self.failed is None and errors > self._background_errors:
            self._background_errors = errors
            try:
                self._db.flush()
            except Exception as exc:  # rocksdict raises plain Exception subclasses
                self.failed_cause = str(exc)
                self.failed = f"RocksDB spill store at {self._dir.db_path} stopped writing for good: {exc}"
                log.error("%s (it takes no write again, even once there is room; reads still work)", self.failed)
        if self.failed is not None:
            raise self._failed_error(what)

    def _failed_error(self, what: str) -> SpillFailedError:
        return SpillFailedError(f"{self.failed}; writing {what} failed", str(self.path), self.failed_cause)

    def _stall_state(self, started: float, what: str) -> dict:
        """RocksDB's state (``compaction``); past ``stall_timeout_s`` since ``started``, a SpillError;
        a SpillFailedError at once when RocksDB stopped writing for good (``_check_stopped``)."""
        self._check_stopped(what)
        state = self.compaction()
        waited = time.monotonic() - started
        if waited > self.stall_timeout_s:
            raise SpillError(
                f"RocksDB spill store at {self._dir.db_path}: writes stalled for {waited:.0f} s "
                f"(limit {self.stall_timeout_s:g} s): {state['level0_files']} level-0 files, "
                f"{state['pending_compaction_bytes']} bytes of compaction pending, "
                f"{state['running_compactions']} compactions running, stopped={bool(state['write_stopped'])}; "
                f"writing {what} failed, nothing of it was written")
        return state

    def _wait_stop(self, started: float, what: str) -> bool:
        """While RocksDB stops writes, poll its state (naps of 5 ms growing to 50 ms; nothing is rebuilt
        or written meanwhile). True if it waited."""
        nap, waited = STOP_NAP_S, False
        while self._stall_state(started, what)["write_stopped"]:
            time.sleep(nap)
            nap, waited = min(2 * nap, 0.05), True
        return waited

    def _wait_delay(self, nbytes: int, times: float, started: float, what: str) -> None:
        """Under a slowdown, sleep ``times`` x the delay RocksDB charges a write (the larger of ``nbytes``
        and the last write's size, at its delayed write rate), in naps of at most 0.1 s that end early
        when the slowdown lifts. Sets ``_paced`` to whether a slowdown is on."""
        state = self._stall_state(started, what)
        rate = state["delayed_write_rate"]
        self._paced = rate > 0
        if not self._paced or state["write_stopped"]:
            return
        end = time.monotonic() + times * max(nbytes, self._last_nbytes) / rate + 0.001
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
            state = self._stall_state(started, what)
            if state["write_stopped"] or not state["delayed_write_rate"]:
                return

    def may_contain(self, keys: np.ndarray) -> np.ndarray:
        """keys : uint64[n] -> bool[n]; False: the key was never written here (the Bloom filter)."""
        return self._bloom.may_contain(keys)

    def get(self, keys: np.ndarray, *, filtered: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Read the records of the keys that are present, in one multi-get.

        keys : uint64[n] -> (found : int64[m] positions into keys, records : uint32[m, stride]).
        Keys the Bloom filter rules out are not read at all (``filtered``: the caller already kept
        only keys ``may_contain`` allows), nor keys with a pending delete (absent).

        Raises
        ------
        SpillError
            RocksDB reported a read error (a corrupt block, an I/O error), naming the store.
        """
        maybe = np.arange(len(keys)) if filtered else np.flatnonzero(self._bloom.may_contain(keys))
        if len(self._pending) and len(maybe):
            maybe = maybe[~self._pending.contains(keys[maybe])]
        if len(maybe) == 0:
            return maybe, np.empty((0, self.stride), np.uint32)
        # in key order: RocksDB's multi-get then walks each block once (2x the rows/s of random order)
        maybe = maybe[np.argsort(keys[maybe], kind="stable")]
        try:
            vals = self._db.get(_key_bytes(keys[maybe]))
        except Exception as exc:  # rocksdict raises plain Exception subclasses (a corrupt block, I/O)
            raise SpillError(f"RocksDB spill store {self._dir.db_path}: reading {len(maybe)} keys failed: "
                             f"{exc}") from exc
        self.reads += len(maybe)
        hit = [i for i, v in enumerate(vals) if v is not None]
        if not hit:
            return np.empty(0, np.int64), np.empty((0, self.stride), np.uint32)
        records = self._records([vals[i] for i in hit], "a multi-get")
        found = maybe[np.asarray(hit, dtype=np.int64)]
        order = np.argsort(found, kind="stable")   # callers get positions in their own order
        return found[order], records[order]

    def delete(self, keys: np.ndarray, *, defer: bool = False) -> None:
        """Delete keys known to be present, in one batch (with the pending deletes, ``_write``).

        Parameters
        ----------
        keys : uint64[n]
            Distinct keys present in the store (not pending).
        defer : bool
            For rows already dead elsewhere (an expiry pass removed them from RAM first): if RocksDB
            refuses the write, the keys become pending deletes (absent to every read from now on,
            uncounted, deleted by the next write that succeeds) before the error is raised. With no
            keys, a write still goes out when deletes are pending (a retry). Without ``defer`` a
            refused delete changes nothing: the keys stay present.

        Raises
        ------
        SpillError
            The write failed or stalled too long (``_write``); with ``defer`` its ``pending`` attribute
            holds the keys deferred (uint64[n], sorted).
        """
        if len(keys) == 0 and not (defer and len(self._pending)):
            return
        keys = np.sort(np.asarray(keys, np.uint64))
        kb = _key_bytes(keys)
        try:
            self._write(lambda wb: collections.deque(map(wb.delete, kb), maxlen=0), f"{len(kb)} deletes")
        except SpillError as exc:
            if defer:
                self.count -= self._pending.add(keys)
                exc.pending = keys
                log.warning("RocksDB spill store at %s: %d deletes refused; kept as pending deletes (read "
                            "as absent, retried with the next write), %d pending in all", self._dir.db_path,
                            len(keys), len(self._pending))
            raise
        self.count -= len(keys)

    @property
    def pending_deletes(self) -> int:
        """Keys whose delete RocksDB refused and that the next write deletes (read as absent meanwhile)."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        """Bytes of the pending deletes' keys (8 per key)."""
        return self._pending.nbytes

    def snapshot(self) -> "ScanView":
        """A read view of the database as of now, for ``scan``. RocksDB fixes an iterator's view when the
        iterator is made, so both of the view's iterators are made here, under the caller's lock (every
        write to the store happens under the table's exclusive lock); a view made later (as rocksdict's
        ``Snapshot.items()`` was, at the first read of a dump, after its RAM rows) sees every write up
        to then, and a dump taken while pushes went on held rows evicted after its instant twice (RAM
        copy and RocksDB) and rows made after it. A scan reads ahead ``SCAN_READAHEAD`` bytes per file
        and leaves the block cache to the point reads (``seek_view`` is the view for seeks). (rocksdict's
        ``Snapshot.iter`` drops the snapshot from its read options, so the two iterators, not a
        ``Snapshot``, share the view.)"""
        ro = ReadOptions()
        ro.set_readahead_size(SCAN_READAHEAD)
        ro.fill_cache(False)
        return ScanView(self._db.values(read_opt=ro), self._db.iter(ro), self._pending.keys)

    def seek_view(self) -> "ScanView":
        """A read view of the database as of now for ``seek_records`` alone (its ``values`` is None: no
        scan iterator, which would read the first block at once), made under the caller's lock as
        ``snapshot``'s; without readahead (12,000 keys among 4M: 76-79k/s without, 63k/s with)."""
        ro = ReadOptions()
        ro.fill_cache(False)
        return ScanView(None, self._db.iter(ro), self._pending.keys)

    def disk_bytes(self) -> int:
        total = 0
        for prop in ("rocksdb.total-sst-files-size", "rocksdb.cur-size-all-mem-tables"):
            try:
                total += int(self._db.property_int_value(prop) or 0)
            except Exception:  # property names vary across RocksDB builds
                log.debug("RocksDB property %s unavailable", prop)
        return total

    def close(self) -> None:
        """Close the database, delete the spill directory (it carries our marker) and drop its lock.
        RocksDB's own close error is logged, not raised (the store is a cache deleted here anyway: a
        store stopped by a write error, ``failed``, reports that error again as it closes), so the
        directory and its lock always go."""
        try:
            self._leave_catch_up()
            db, self._db = self._db, None
            if db is not None:
                try:
                    db.close()
                except Exception as exc:  # rocksdict raises plain Exception subclasses
                    log.warning("RocksDB spill store at %s: closing it reported: %s; its directory is removed "
                                "all the same", self._dir.db_path, exc)
        finally:
            self._dir.release()
