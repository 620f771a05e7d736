"""The RocksDB tier of a ``SparseTable``: promotion, eviction, the memory budget's upkeep, loads that go
straight to disk, expiry over spilled rows, and the released state of a shard during a base load
(``release_ram`` / ``restore_ram``: these two take the lock; every other method runs with the table's
lock held exclusively). A mixin of ``table.SparseTable`` that uses its arrays (``_index``, ``_arena_u``,
``_state``, ...)."""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from . import _kernels as K
from ._arena import release_from
from ._compact import compact_arena
from ._evict import exact_victims, sample_lru
from ._inputs import record_keys as _record_keys
from ._load_kernels import DUPLICATES, SORTED_UNIQUE
from .budget import HEADROOM_ROWS, MAX_LOAD
from .errors import SpillError, SpillFailedError, TableInputError
from .keysets import unique_keys
from .rows import EXISTED_NO, EXISTED_UNKNOWN

#: nanosecond counters of ``SparseTable.stats()`` that say where a spilling table's time goes (wall
#: time of the calling thread, summed over calls; a budgeted server's shards share cores, locks and
#: RocksDB's cache, so these include waits for them):
#: ``spill_lock_wait_ns`` / ``pull_spilled_ns``: pulls that missed RAM, waiting for the shard's exclusive
#: lock / holding it (promotion, read, the eviction the promotions cause);
#: ``push_lock_wait_ns`` / ``push_locked_ns``: pushes, the same (every table: a RAM-only table's is the
#: update itself);
#: ``promote_ns`` (of it ``promote_read_ns``, RocksDB's multi-get): rows brought back into RAM;
#: ``evict_ns`` (of it ``evict_write_ns``, RocksDB's write batches): rows written out of RAM;
#: ``promote_read_cpu_ns`` / ``evict_write_cpu_ns``: the CPU time of the calling thread in those reads and
#: writes (``time.thread_time_ns``): wall time beyond it waited for a core, the disk or a lock.
SPILL_TIME_NS = ("spill_lock_wait_ns", "pull_spilled_ns", "push_lock_wait_ns", "push_locked_ns",
                 "promote_ns", "promote_read_ns", "evict_ns", "evict_write_ns",
                 "promote_read_cpu_ns", "evict_write_cpu_ns")

RELEASED_ROWS = 16                  # arena rows and index slots between release_ram and restore_ram
EVICT_PASS_ROWS = 1 << 16           # rows a call may evict beyond its cap, and the most one pass gathers and writes
SAMPLED_LRU_MIN_ROWS = 1 << 20      # RAM tiers from this size choose eviction victims by sampling
LRU_SAMPLES_PER_VICTIM = 4           # Redis's maxmemory-samples is 5


class SpillTier:
    """Methods of ``SparseTable`` for its spill tier (see the module docstring)."""

    @property
    def spill_failed(self) -> str | None:
        """Why this shard's RocksDB store stopped writing for good (``SpillStore.failed``: the store
        and RocksDB's error), or None. From then on the table refuses every call that reads or changes
        rows (``SpillFailedError``) and is only good for ``close``."""
        spill = self._spill
        return None if spill is None else spill.failed

    def _refuse_if_failed(self) -> None:
        """SpillFailedError when the spill store failed for good: the call that met the failure may
        have applied its update in part (a push updates RAM rows before its eviction pass writes), so
        no call may read or build on this state (lock held, by every call that reads or changes rows)."""
        spill = self._spill
        if spill is not None and spill.failed is not None:
            raise SpillFailedError(f"{self.name}: {spill.failed}; this shard refuses every read and write "
                                   f"from now on (a call that met the failure may have applied its update "
                                   f"in part): close it", str(spill.path), spill.failed_cause)

    @contextmanager
    def bulk_load(self, distinct: bool = False):
        """Context for a base restore into this (fresh) table: RocksDB's auto compaction is off and its
        level-0 write stalls are raised for its duration (``SpillStore.bulk``), so the load's many
        flushes do not wait on compaction. Compaction catches up afterwards, the process's stores one
        at a time (``_catch_up``), each keeping the raised triggers until its turn has merged its level
        0. RAM-only tables: nothing changes.

        ``distinct``: the caller vouches that the rows loaded within never repeat a key (a base
        checkpoint: each key lives in one part file, each batch is checked for repeats, and the reader
        checks each file's keys against its vshard group). Rows beyond the RAM tier then go to RocksDB
        without asking whether their keys are there already: that question (the Bloom filter, then a
        multi-get of each of its false positives through every level-0 file) took 22% of a 100M-row
        restore (py-spy). A key repeated across batches anyway is overwritten as it would be otherwise,
        but counted twice in ``rows_spilled``.

        Raises
        ------
        TableInputError
            ``distinct`` for a table that holds rows.
        """
        if self._spill is None:
            yield self
            return
        if distinct and len(self):
            raise TableInputError(f"{self.name}: bulk_load(distinct=True) needs an empty table, this one "
                                  f"holds {len(self)} rows")
        self._spill.bulk(True)
        self._load_distinct = distinct
        if distinct:            # an empty table: a base restored into it is exact (``finish_restore``)
            self._restore_start = (self._changes, True)
        try:
            yield self
        finally:
            self._load_distinct = False
            self._spill.bulk(False)

    def release_ram(self) -> int:
        """Spilled tables: write every row in RAM to RocksDB, give the arena and index memory back (the
        big arrays are their own mappings, so the pages return to the OS at once) and keep no row in RAM
        until ``restore_ram``: meanwhile a pull reads the rows it misses from RocksDB without promoting
        them, and a push or load brings its rows in, updates them and writes them back within the call.
        Nothing is lost. A server calls this on the old shards before it loads a base into fresh ones,
        so the old shards cost disk rather than RAM while the new ones fill the budget (and reads of the
        old shards during the load cannot take RAM back). RAM-only tables: nothing happens.

        Returns
        -------
        int : rows moved out of RAM

        Raises
        ------
        SpillError
            A write of the rows failed (``SpillFailedError``: the store failed, now or before; its rows
            then stay in RAM and nothing is released).
        """
        if self._spill is None:
            return 0
        with self._lock.exclusive():
            self._refuse_if_failed()
            n = int(self._state[K.S_NRAM])
            if n:
                self._evict(n)
            self._released = True
            self._alloc_arrays(RELEASED_ROWS, RELEASED_ROWS)
            if self._budget is not None:
                self._budget.report(self._budget_token, self._growing_bytes(), 0)
        return n

    def restore_ram(self) -> None:
        """End ``release_ram`` (a base load failed and these shards stay live): the arena and index are
        allocated at their initial sizes again (a budgeted shard's, fixed by the budget: no growth by
        copying) and rows come back into RAM on the pulls and pushes that need them. Idempotent; nothing
        happens once the store failed (``spill_failed``: the shard takes no call but ``close``)."""
        if self._spill is None:
            return
        with self._lock.exclusive():
            if not self._released or self._spill.failed is not None:   # a failed store: left as it is
                return
            n = int(self._state[K.S_NRAM])
            if n:               # none at the end of a call while released; kept for safety
                self._evict(n)
            self._released = False
            self._alloc_arrays(*self._sizes)
            if self._budget is not None:
                self._budget.report(self._budget_token, self._growing_bytes(), 0)

    def _pull_spilled(self, keys: np.ndarray, miss: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The keys of a pull that missed RAM: ``keys[miss]`` (miss : int64[m], positions into keys and
        out) are promoted from RocksDB and read into ``out[miss]``; returns the positions still missing
        (no row anywhere). Lock held exclusively.

        A budgeted table promotes at most the rows its arena holds without growing (and its budget
        allows): a pull whose promotions exceed that works in chunks of the unique keys, each chunk
        promoted and read into ``out`` before the next chunk's eviction pass may take its rows, so the
        arena is never copied under the lock. Between ``release_ram`` and ``restore_ram`` the rows are
        read from RocksDB and nothing is promoted."""
        self._next_tick()
        if self._released:
            return self._pull_disk(keys, miss, out)
        sub = keys[miss]
        ukeys = unique_keys(sub)
        if self._budget is not None and len(ukeys) > self._promote_room():
            on_disk = self._spill.may_contain(ukeys)
            rows = np.empty(len(ukeys), np.int64)
            K.find_rows(self._index, self._arena_u, ukeys, rows)
            on_disk |= rows >= 0    # in RAM by a push since the shared read: an eviction may take them
            if int(np.count_nonzero(on_disk)) > self._promote_room():
                return self._pull_in_chunks(keys, miss, out, sub, ukeys, on_disk)
        self._promote(ukeys)
        sub_out = np.empty((len(sub), self.layout.dim), np.float32)
        still = self._pull_ram(sub, sub_out, self._tick, True)
        out[miss] = sub_out
        self._maybe_evict()
        return miss[still]

    def _pull_in_chunks(self, keys, miss, out, sub, ukeys, on_disk) -> np.ndarray:
        """``_pull_spilled`` for promotions beyond the room: ukeys : uint64[u] sorted unique ``sub``,
        on_disk : bool[u] (the Bloom filter's maybe) decides the chunk bounds."""
        order = np.argsort(sub, kind="stable")
        sorted_sub = sub[order]
        cum = np.cumsum(on_disk)            # candidates for promotion among ukeys[:i + 1]
        still = []
        a = 0
        while a < len(ukeys):
            if a:
                self._maybe_evict()         # the previous chunk's rows were read: they may go now
            done = int(cum[a - 1]) if a else 0
            room = self._promote_room()
            if room < 1:                    # cannot happen under a budget (cap + headroom fit the arena)
                room = int(cum[-1]) - done
            b = max(a + 1, int(np.searchsorted(cum, done + room, side="right")))
            self._promote(ukeys[a:b])
            lo = np.searchsorted(sorted_sub, ukeys[a], "left")
            hi = np.searchsorted(sorted_sub, ukeys[b - 1], "right")
            pos = miss[order[lo:hi]]
            part = np.empty((len(pos), self.layout.dim), np.float32)
            s = self._pull_ram(keys[pos], part, self._tick, True)
            out[pos] = part
            still.append(pos[s])
            a = b
        self._maybe_evict()
        return np.sort(np.concatenate(still))

    def _promote_room(self) -> int:
        """Rows a promotion can add without growing the arena or the index, nor (under a budget) taking
        the arena past the rows the budget allows (at least 1024, as ``rows_cap``)."""
        st = self._state
        nram = int(st[K.S_NRAM])
        room = min(self._arena_u.shape[0] - int(st[K.S_NEXT]) + int(st[K.S_NFREE]),
                   int(MAX_LOAD * len(self._index)) - nram)
        if self._budget is not None:
            room = min(room, max(self._budget.rows_allowed() - nram, 1024))
        return room

    def _pull_disk(self, keys, miss, out) -> np.ndarray:
        """``_pull_spilled`` while released: read ``keys[miss]`` from RocksDB into ``out[miss]`` without
        promoting; returns the positions with no row."""
        sub = keys[miss]
        sub_out = np.empty((len(sub), self.layout.dim), np.float32)
        miss_ram = self._pull_ram(sub, sub_out, self._tick, False)   # none at rest: a call leaves RAM empty
        out[miss] = sub_out
        miss = miss[miss_ram]
        if not len(miss):
            return miss
        ukeys, inverse = np.unique(keys[miss], return_inverse=True)
        pos, records = self._spill.get(ukeys)
        dim, voff = self.layout.dim, self.layout.values
        values = np.zeros((len(ukeys), dim), np.float32)
        values[pos] = records[:, voff:voff + dim].view(np.float32)
        out[miss] = values[inverse]
        found = np.zeros(len(ukeys), np.bool_)
        found[pos] = True
        return miss[~found[inverse]]

    def _load_to_disk(self, records, keys, rows, n_new, order, known=None):
        """A load into a full RAM tier: the rows beyond its room that are not in RAM go straight to
        RocksDB (one sorted batch) instead of into RAM and out again by eviction. ``order`` is
        ``_load_kernels.key_order(keys)``; ``known`` : uint8[m] or None, the trusted ``existed`` of a
        delta's rows (``_delta``): a row that says ``EXISTED_NO`` or ``EXISTED_YES`` is written without
        asking RocksDB whether its key is there. Returns (keep, n_new): the rows left for RAM (a slice
        or bool[m]) and how many of them are not in RAM. Lock held exclusively."""
        nram = int(self._state[K.S_NRAM])
        cap = self._ram_cap()
        if nram + n_new <= cap or order == DUPLICATES:
            return slice(None), n_new          # duplicate keys in one batch: the RAM path overwrites in order
        room = max(0, cap - nram)
        if n_new == len(keys):                 # every row new (a base restore): the tail as views, no copies
            direct = slice(room, len(keys))
            keep = slice(0, room)
        else:
            absent = np.flatnonzero(rows < 0)
            direct = absent[room:]
            keep = np.ones(len(keys), np.bool_)
            keep[direct] = False
        dk = keys[direct]
        recs = records[direct]
        recs[:, self.layout.meta + K.M_TICK] = 0
        recs[:, self.layout.meta + K.M_FLAGS] = 0      # clean: a load is what a checkpoint holds
        if self._load_distinct:                        # bulk_load(distinct=True): none of them is there
            new_mask, ask = np.ones(len(dk), np.bool_), np.empty(0, np.int64)
        elif known is not None:                        # a delta's own answer; the unknown ones are asked
            kd = known[direct]
            new_mask, ask = kd == EXISTED_NO, np.flatnonzero(kd == EXISTED_UNKNOWN)
        else:
            new_mask, ask = np.zeros(len(dk), np.bool_), np.arange(len(dk))
        if len(ask):
            maybe = self._spill.may_contain(dk[ask])
            new_mask[ask[~maybe]] = True
            maybe = ask[maybe]
            if len(maybe):                             # already on disk: overwritten, not counted again
                pos, _ = self._spill.get(dk[maybe], filtered=True)
                new_mask[maybe] = True
                new_mask[maybe[pos]] = False
        self._spill.put(dk, recs, new_mask, presorted=order == SORTED_UNIQUE)
        self._count(loaded_to_disk=len(dk), loaded_unasked=len(dk) - len(ask))
        return keep, n_new - len(dk)

    def _promote(self, ukeys: np.ndarray) -> None:
        """Bring rows of unique keys that are on disk into RAM (one multi-get). Lock held exclusively."""
        t0 = time.perf_counter_ns()
        ukeys = ukeys[self._spill.may_contain(ukeys)]   # a key never written to disk needs no lookup here
        rows = np.empty(len(ukeys), np.int64)
        K.find_rows(self._index, self._arena_u, ukeys, rows)
        missing = ukeys[rows < 0]
        if not len(missing):
            self._count(promote_ns=time.perf_counter_ns() - t0)
            return
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        pos, records = self._spill.get(missing, filtered=True)
        t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        read = {"promote_read_ns": t2 - t1, "promote_read_cpu_ns": c2 - c1}
        if not len(pos):
            self._count(promote_ns=t2 - t0, **read)
            return
        self._reserve(len(pos))
        dirty = self._spilled_dirty.contains(missing[pos])
        # read back: the key came again after its eviction, so the row is reused (SLRU's protected rows)
        clean = K.F_ON_DISK | K.F_SYNCED | K.F_REUSED
        # the generation a row was created in comes back with it (a delta's ``existed``, ``_delta``)
        gens = records[:, self.layout.meta + K.M_FLAGS] & ~K.FLAG_BITS
        # a dirty one stays in the set of spilled dirty keys (``F_LISTED``: its next eviction adds it no more)
        flags = np.where(dirty, clean | K.F_DIRTY | K.F_LISTED, clean) | gens
        K.upsert_records(self._index, self._arena_u, self._state, self._lay, records,
                         flags.astype(np.uint32), self._tick)
        self._count(promotions=len(pos), promote_ns=time.perf_counter_ns() - t0, **read)

    def _maybe_evict(self) -> None:
        """Past the RAM tier's cap (``memory_rows``, or what the memory budget leaves), write rows (in
        ``config.eviction``'s order) to RocksDB until the low watermark; under a budget, report the parts that
        grow and give back the pages of rows the budget no longer allows (lock held exclusively)."""
        if self._spill is None:
            return
        if self._budget is not None:
            self._budget.report(self._budget_token, self._growing_bytes(), int(self._state[K.S_NEXT]))
        cap = self._ram_cap()
        nram = int(self._state[K.S_NRAM])
        if nram > cap:
            # down to the low watermark, but at most EVICT_PASS_ROWS past the cap per call: a call then
            # writes about what it added, and no request waits behind one pass of a tenth of the tier
            k = min(nram - int(cap * self.config.spill_low_watermark), max(nram - cap, EVICT_PASS_ROWS))
            # and in passes of EVICT_PASS_ROWS: when the cap falls far below the rows held (the memory
            # governor shrank the budget's rows), one pass of the whole excess gathered, sorted and
            # wrote millions of records at once, ~250 MB of transient arrays, which the governor read as
            # unaccounted RSS and answered by shrinking the cap again (scale_bench's restore of a base
            # and a delta at 50M keys, 2 GB: the RAM tier 14.3M -> 9.0M rows, RSS 1.35 of the budget)
            while k > 0:
                step = min(k, EVICT_PASS_ROWS)
                self._evict(step)
                k -= step
        if self._released and max(self._arena_u.shape[0], len(self._index)) > RELEASED_ROWS:
            self._alloc_arrays(RELEASED_ROWS, RELEASED_ROWS)   # no row left (cap 0): the call's pages go
        if self._budget is not None:
            self._fit_budget(cap)

    def _ram_cap(self) -> int:
        """Rows the RAM tier may keep after a call: ``memory_rows``, what the budget leaves, or 0 between
        ``release_ram`` and ``restore_ram``."""
        if self._released:
            return 0
        return self.config.memory_rows if self._budget is None else self._budget.rows_cap()

    def _evict_within_call(self, part_done: bool) -> bool:
        """A budgeted push whose new or promoted rows exceed the arena's headroom: run the eviction pass
        now instead of growing the arena (a copy under the lock, past the budget). Returns whether the
        push can go on without growing: the pass made room, or (``part_done``) the keys promoted so far
        are all pushed and the next part is promoted after the pass."""
        before = int(self._state[K.S_NRAM])
        self._maybe_evict()
        return part_done or int(self._state[K.S_NRAM]) < before

    def _promote_prefix(self, ukeys: np.ndarray, start: int) -> int:
        """Promote the rows on disk of a push's unique keys ``ukeys[start:]``: all of them, or under a
        budget the longest run ``ukeys[start:end]`` whose promotions fit the arena without growing (the
        push then takes the rest in parts, an eviction pass between them). Returns ``end``."""
        rest = ukeys[start:]
        # a released shard (no rows kept) lets one call's rows in; ``_maybe_evict`` writes them back
        room = self._promote_room() if self._budget is not None and not self._released else len(rest)
        if len(rest) <= room or room < 1:
            self._promote(rest)
            return len(ukeys)
        cum = np.cumsum(self._spill.may_contain(rest))
        end = max(1, int(np.searchsorted(cum, room, side="right")))
        self._promote(rest[:end])
        return start + end

    def _fit_budget(self, cap: int) -> None:
        """Report this shard's growing bytes and arena rows to the budget; when the arena has handed out
        more rows than the budget allows (it shrank as filters and dirty keys grew), compact the live
        rows below the cap plus a call's headroom and return the pages above to the OS."""
        self._budget.report(self._budget_token, self._growing_bytes(), int(self._state[K.S_NEXT]))
        allowed = self._budget.rows_allowed()
        if int(self._state[K.S_NEXT]) > allowed:
            target = max(int(self._state[K.S_NRAM]), min(cap + HEADROOM_ROWS, allowed))
            moved = compact_arena(self._index, self._arena_u, self._state, self._lay, target)
            if moved >= 0:
                released = release_from(self._arena_u, target * self.layout.row_bytes)
                self._count(compactions=1, compacted_rows=moved, released_bytes=released)
            self._budget.report(self._budget_token, self._growing_bytes(), int(self._state[K.S_NEXT]))

    def _growing_bytes(self) -> int:
        """Bytes that grow with the keys on disk: the spill Bloom filter, the dirty spilled keys, the keys
        deleted since the last clear (the next delta's tombstones: an expiry pass's can be many) and the
        pending deletes' keys."""
        spill = self._spill
        return ((spill.bloom_bytes + spill.pending_bytes if spill is not None else 0) + self._spilled_dirty.nbytes
                + self._deleted_bytes)

    def _evict(self, k: int) -> None:
        """Write k RAM rows, the first in ``config.eviction``'s order (``sparse_tables._evict``), to RocksDB
        (only rows not already there unchanged) and drop them from RAM. Lock held exclusively; spill tier present; 0 < k <= rows in RAM."""
        t0 = time.perf_counter_ns()
        nram = int(self._state[K.S_NRAM])
        sel = np.empty(k, np.int64)
        segmented = self.config.eviction == "slru"
        if nram >= SAMPLED_LRU_MIN_ROWS and nram >= 8 * k:
            # a big RAM tier: sampled, O(k) instead of a scan of every row (sparse_tables._evict)
            self._evict_seed += 1
            k = sample_lru(self._arena_u, self._state, self._lay, k, LRU_SAMPLES_PER_VICTIM,
                           np.uint64(self._evict_seed), sel, segmented)
        else:
            k = exact_victims(self._arena_u, self._state, self._lay, k, LRU_SAMPLES_PER_VICTIM, segmented, sel)
        sel = sel[:k]
        records = np.empty((k, self.layout.stride), np.uint32)
        K.gather_records(self._arena_u, sel, records)
        keys = _record_keys(records)
        flags = records[:, self.layout.meta + K.M_FLAGS]
        synced = K.F_ON_DISK | K.F_SYNCED
        write = (flags & synced) != synced
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            self._spill.put(keys[write], records[write], (flags[write] & K.F_ON_DISK) == 0)
        except SpillError as exc:
            # the rows stay in RAM; those whose batches were written must say they are on disk, or
            # deleting (or expiring) one would leave its copy there to come back on the next pull
            done = getattr(exc, "written", None)
            if done is not None and len(done):
                at = np.empty(len(done), np.int64)
                K.find_rows(self._index, self._arena_u, done, at)
                self._arena_u[at[at >= 0], self.layout.meta + K.M_FLAGS] |= np.uint32(K.F_ON_DISK)
            raise
        t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        # the dirty rows whose keys the set lacks: a key added at each dirty eviction repeated it in every
        # sorted run the set had frozen at MAX_RUN keys (a job with no checkpoint, scaled to 128k-key
        # runs: 2.2 -> 9.6 entries per spilled row over 200 hours, runs 20 -> 100, and growing)
        listed = K.F_DIRTY | K.F_LISTED
        self._spilled_dirty.add(keys[(flags & listed) == K.F_DIRTY])
        K.remove_rows(self._index, self._arena_u, self._state, self._lay, sel)
        self._count(evictions=k, spill_writes=int(write.sum()), evict_ns=time.perf_counter_ns() - t0,
                    evict_write_ns=t2 - t1, evict_write_cpu_ns=c2 - c1)

    def _shrink_disk(self, args, deleted: list, earlier: list) -> None:
        """Expiry over rows authoritative in RocksDB; appends the keys of each chunk it deletes to
        ``deleted`` as it goes (and those of rows of an earlier generation to ``earlier``, ``_delta``), so a pass a read error stops has recorded what it deleted. A chunk whose
        delete RocksDB refuses raises before its keys are recorded: those rows are still there, in
        RocksDB only, and read as they were (nothing of them is pending). A write-back of decayed rows
        that fails after some of its batches leaves those rows decayed on disk and dirty (in the next
        delta), the others as they were."""
        decayed = args[2] != 1.0
        spill = self._spill
        spill.begin_filter_rebuild()        # the pass sees every key on disk: a filter of those it leaves
        complete = False
        try:
            for keys, recs in spill.scan(spill.snapshot()):
                self._shrink_chunk(args, keys, recs, decayed, deleted, earlier)
            complete = True
        finally:
            spill.end_filter_rebuild(complete)

    def _shrink_chunk(self, args, keys, recs, decayed, deleted, earlier) -> None:
        """One chunk of ``_shrink_disk``'s scan: keys : uint64[m], recs : uint32[m, stride], every key on
        disk in a key range. Rows also in RAM were expired with the RAM tier; their disk copies stay."""
        rows = np.empty(len(keys), np.int64)
        K.find_rows(self._index, self._arena_u, keys, rows)
        cold = np.flatnonzero(rows < 0)
        on_disk = keys
        keys, recs = keys[cold], recs[cold]
        kill = np.empty(len(keys), np.bool_)
        K.shrink_records(recs, self._lay, *args, kill)
        self._spill.delete(keys[kill])
        left = np.ones(len(on_disk), np.bool_)      # the rebuilt filter: every key here but those deleted
        left[cold[kill]] = False
        self._spill.filter_keep(on_disk[left])
        deleted.append(keys[kill])
        earlier.append(keys[kill][self._earlier(recs[kill, self.layout.meta + K.M_FLAGS])])
        if decayed:
            keep = ~kill
            try:
                self._spill.put(keys[keep], recs[keep], np.zeros(int(keep.sum()), np.bool_))
            except SpillError as exc:
                # the batches written hold decayed rows: the next delta must carry them, or a
                # checkpoint (base + deltas) would keep them undecayed while the table has them decayed
                self._spilled_dirty.add(getattr(exc, "written", keys[:0]))
                raise
            self._spilled_dirty.add(keys[keep])

