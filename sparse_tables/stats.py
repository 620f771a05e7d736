"""``SparseTable.stats()``: a shard's counters and sizes, read without ever waiting behind a writer.

A shard's exclusive lock can be held for long: an expiry pass (``shrink``) holds it for the whole shard
(47-89 s at 10^8 keys), and so do ``release_ram`` before a base load, a restore's batches, arena growth
and compactions. A scrape (``/metrics``) or a ``Stats`` RPC that waited for it would time out, leave a
thread blocked per scrape, and read as a target down during every expiry pass. So the fields come in
two kinds:

**Live** (current at every call; no table lock): the cumulative counters (``pull_keys``, ``pull_hits``,
``pull_misses``, ``push_keys``, ``created``, ``rejected``, ``rows_refused_full``, ``deleted``,
``evictions``, ``promotions``, ``spill_writes``, ``compactions``, ``compacted_rows``, ``released_bytes``,
``loaded_to_disk``, ``loaded_unasked`` and the ``SPILL_TIME_NS`` nanosecond counters): Python ints
updated under the table's small ``_stats_lock``, which is only ever held to add or copy them. The
constants ``row_bytes``, ``max_rows`` and ``memory["sketch"]``. RocksDB's own figures: ``disk_bytes``,
``memory["rocksdb_*"]`` and ``rocksdb`` (RocksDB properties, thread-safe on RocksDB's side, and the
store's Python counters). A budget's ``memory_budget`` and ``rows_cap`` (``MemoryBudget``, own lock).

**Sizes** (one consistent instant of the shard's arrays, read under its shared lock): ``rows``,
``rows_in_ram``, ``rows_spilled``, ``ram_bytes``, ``index_slots``, ``pending_deletes`` and
``memory["rows"|"index"|"filters"|"dirty_keys"]``. They need the lock: a compaction, growth or a
release of RAM swaps the arena and index, an expiry pass changes the row counts mid-way, and
``rows_spilled`` scans the arena. When the shared lock is not free within ``STATS_LOCK_WAIT_S`` (a
writer holds it or waits for it), the sizes of the last read that got it are served instead: ``stale``
True and ``stats_age_s`` their age. Every call reports both (``stale`` False, ``stats_age_s`` 0.0 when
read now). A shard built and never read serves its sizes at construction (no rows).

The memory governor (``engine.ps.governor``) does not read ``stats()``: it reads the budgets'
``MemoryBudget.counted_bytes``, which the shards report under their locks as they change, so a stale
snapshot here never enters its arithmetic.

Fields of ``SparseTable.stats()`` (counts; bytes; nanoseconds for ``*_ns``):
``rows`` (all), ``rows_in_ram``, ``rows_spilled`` (authoritative in RocksDB), ``memory`` (bytes of this
shard by part: ``rows``, ``index``, ``filters``, ``dirty_keys``, ``sketch``, and RocksDB's measured
``rocksdb_block_cache`` (shared: the whole cache), ``rocksdb_memtables``, ``rocksdb_table_readers``),
with a budget ``memory_budget`` (the server's parts, ``MemoryBudget.parts``) and ``rows_cap``;
``compactions``, ``compacted_rows``, ``released_bytes`` (arena pages given back under a budget),
``rocksdb`` (spilling tables: RocksDB's compactions, write stalls (``write_stalls``, ``write_stall_s``
seconds), ``point_reads``: keys asked by multi-gets, ``SpillStore.compaction``; ``catching_up`` 1 from a
bulk load until its catch-up compaction is done, ``catch_up_failed`` 1 when RocksDB refused it,
``SpillStore.bulk``; ``failed`` 1 once the store stopped writing for good, ``SpillStore.failed``), ``ram_bytes`` (arena rows in use, index, sketch, filters, dirty keys),
``disk_bytes``, ``index_slots``, ``row_bytes``, ``pull_keys``, ``pull_hits``/``pull_misses`` (RAM),
``push_keys``, ``created``, ``rejected`` (not admitted), ``rows_refused_full`` (new keys refused because
the table held ``max_rows`` rows), ``max_rows`` (0: no limit), ``deleted``, ``evictions``,
``promotions``, ``spill_writes``, ``pending_deletes`` (keys whose RocksDB delete was refused, read as
absent until the next write deletes them; not counted in ``rows_spilled``), ``loaded_to_disk`` (rows a
load wrote straight to RocksDB) and ``loaded_unasked`` (those of them written without asking RocksDB
whether the key was there: a base's, or a trusted delta's, ``sparse_tables._delta``); the nanosecond
counters of ``sparse_tables._spill_tier.SPILL_TIME_NS``; ``stale`` (bool) and ``stats_age_s`` (float
seconds) as above.

Counters are cumulative over the shards a ``SparseHost`` replaced: a base load or a clear hands them
to the new shards (``carry_counters``), so Prometheus never reads a counter reset inside a live server.
"""
from __future__ import annotations

from time import monotonic as _now   # bound here: a test that patches time.monotonic does not feed it

from . import _kernels as K

#: seconds a ``stats()`` call waits for a shard's shared lock before serving the last sizes read: long
#: enough to get past a push (milliseconds), short enough that a scrape of many shards stays fast
STATS_LOCK_WAIT_S = 0.02
#: the RocksDB counters of ``stats()["rocksdb"]`` that are cumulative (carried over like the others)
SPILL_COUNTERS = ("write_stalls", "write_stall_s", "point_reads")


def spill_totals(spill, carried: dict) -> dict:
    """``SPILL_COUNTERS`` of the live store ``spill`` (None: none) plus those ``carried`` from shards it
    replaced (``carry_counters``)."""
    live = (spill.stalls, spill.stall_s, spill.reads) if spill is not None else (0, 0.0, 0)
    return {k: carried[k] + v for k, v in zip(SPILL_COUNTERS, live)}


def read_sizes(t) -> dict:
    """The sizes of shard ``t`` (a ``SparseTable``) that need its lock (module docstring): rows, bytes.
    Lock held (shared or exclusive), or ``t`` still being built."""
    state = t._state
    nram = int(state[K.S_NRAM])
    spilled = t._rows_spilled()
    rows_bytes = int(state[K.S_NEXT]) * t.layout.row_bytes
    index_bytes, index_slots = t._index.nbytes, len(t._index)
    dirty_bytes = t._spilled_dirty.nbytes + t._deleted_bytes
    spill = t._spill
    bloom_bytes = spill.bloom_bytes if spill is not None else 0
    return {"rows": nram + spilled, "rows_in_ram": nram, "rows_spilled": spilled,
            "ram_bytes": rows_bytes + index_bytes + t._sketch.nbytes + dirty_bytes + bloom_bytes,
            "index_slots": index_slots, "pending_deletes": spill.pending_deletes if spill is not None else 0,
            "memory": {"rows": rows_bytes, "index": index_bytes, "filters": bloom_bytes,
                       "dirty_keys": dirty_bytes}}


def new_snapshot(t) -> tuple[float, dict]:
    """(monotonic seconds, ``read_sizes``) for ``t._stats_snap``; lock held, or construction."""
    return _now(), read_sizes(t)


def table_stats(t) -> dict:
    """``SparseTable.stats()`` of shard ``t`` (module docstring). Never waits behind a writer beyond
    ``STATS_LOCK_WAIT_S``; never raises for a held lock."""
    with t._stats_lock:
        out = dict(t._counters)
        carried = dict(t._spill_carry)
    with t._lock.try_shared(STATS_LOCK_WAIT_S) as held:
        if held:
            snap = new_snapshot(t)
    with t._stats_lock:
        if held and snap[0] >= t._stats_snap[0]:
            t._stats_snap = snap
        elif not held:
            snap = t._stats_snap
    taken, sizes = snap
    memory = dict(sizes["memory"])
    out.update({k: v for k, v in sizes.items() if k != "memory"})
    out.update(stale=not held, stats_age_s=0.0 if held else round(_now() - taken, 3),
               row_bytes=t.layout.row_bytes, max_rows=t.config.max_rows)
    spill = t._spill       # read once: a close meanwhile sets it to None (RocksDB reads then give 0)
    out["disk_bytes"] = spill.disk_bytes() if spill is not None else 0
    out["memory"] = {**memory, "sketch": t._sketch.nbytes, **(spill.memory() if spill is not None else {})}
    if spill is not None:
        totals = spill_totals(spill, carried)
        out["rocksdb"] = {**spill.compaction(), **totals, "write_stall_s": round(totals["write_stall_s"], 3),
                          "catching_up": int(spill.bulk_loading),
                          "catch_up_failed": int(spill.catch_up_error is not None),
                          "failed": int(spill.failed is not None)}
    if t._budget is not None:
        out["memory_budget"] = t._budget.parts()
        out["rows_cap"] = t._budget.rows_cap()
    return out


def carry_counters(new, old) -> None:
    """Add shard ``old``'s cumulative counters (``_counters`` and RocksDB's ``SPILL_COUNTERS``, themselves
    including whatever ``old`` was carried) into shard ``new``'s. Gauges (rows, bytes) are not carried.
    Call before ``old`` is closed (its RocksDB counters go with its store)."""
    with old._stats_lock:
        counters = dict(old._counters)
        carried = dict(old._spill_carry)
    spill_counts = spill_totals(old._spill, carried)
    with new._stats_lock:
        for k, v in counters.items():
            new._counters[k] = new._counters.get(k, 0) + v
        for k, v in spill_counts.items():
            new._spill_carry[k] += v
