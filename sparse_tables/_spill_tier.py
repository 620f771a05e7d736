"""The RocksDB tier of a ``SparseTable``: promotion, eviction, the memory budget's upkeep, loads that go
straight to disk and expiry over spilled rows. A mixin of ``table.SparseTable``: every method runs with
the table's lock held exclusively and uses its arrays (``_index``, ``_arena_u``, ``_state``, ...)."""
from __future__ import annotations

import numpy as np

from . import _kernels as K
from ._arena import release_from
from ._compact import compact_arena
from ._evict import sample_lru
from ._inputs import record_keys as _record_keys
from ._load_kernels import DUPLICATES, SORTED_UNIQUE
from .budget import HEADROOM_ROWS

EVICT_PASS_ROWS = 1 << 16           # rows an eviction pass may write beyond what brings RAM under its cap
SAMPLED_LRU_MIN_ROWS = 1 << 20      # RAM tiers from this size choose eviction victims by sampling
LRU_SAMPLES_PER_VICTIM = 4           # Redis's maxmemory-samples is 5


class SpillTier:
    """Methods of ``SparseTable`` for its spill tier (see the module docstring)."""

    def _load_to_disk(self, records, keys, rows, n_new, order):
        """A load into a full RAM tier: the rows beyond its room that are not in RAM go straight to
        RocksDB (one sorted batch) instead of into RAM and out again by eviction. ``order`` is
        ``_load_kernels.key_order(keys)``. Returns the records, keys and count of new rows left for RAM.
        Lock held exclusively."""
        nram = int(self._state[K.S_NRAM])
        cap = self.config.memory_rows if self._budget is None else self._budget.rows_cap()
        if nram + n_new <= cap or order == DUPLICATES:
            return records, keys, n_new        # duplicate keys in one batch: the RAM path overwrites in order
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
        new_mask = ~self._spill.may_contain(dk)
        if not new_mask.all():                         # already on disk: overwritten, not counted again
            maybe = np.flatnonzero(~new_mask)
            pos, _ = self._spill.get(dk[maybe], filtered=True)
            new_mask[maybe] = True
            new_mask[maybe[pos]] = False
        self._spill.put(dk, recs, new_mask, presorted=order == SORTED_UNIQUE)
        self._count(loaded_to_disk=len(dk))
        return records[keep], keys[keep], n_new - len(dk)

    def _promote(self, ukeys: np.ndarray) -> None:
        """Bring rows of unique keys that are on disk into RAM (one multi-get). Lock held exclusively."""
        ukeys = ukeys[self._spill.may_contain(ukeys)]   # a key never written to disk needs no lookup here
        rows = np.empty(len(ukeys), np.int64)
        K.find_rows(self._index, self._arena_u, ukeys, rows)
        missing = ukeys[rows < 0]
        if not len(missing):
            return
        pos, records = self._spill.get(missing, filtered=True)
        if not len(pos):
            return
        self._reserve(len(pos))
        dirty = self._spilled_dirty.contains(missing[pos])
        flags = np.where(dirty, K.F_ON_DISK | K.F_SYNCED | K.F_DIRTY, K.F_ON_DISK | K.F_SYNCED)
        K.upsert_records(self._index, self._arena_u, self._state, self._lay, records,
                         flags.astype(np.uint32), self._tick)
        self._count(promotions=len(pos))

    def _maybe_evict(self) -> None:
        """Past the RAM tier's cap (``memory_rows``, or what the memory budget leaves), write the least
        recently used rows to RocksDB until the low watermark; under a budget, report the parts that
        grow and give back the pages of rows the budget no longer allows (lock held exclusively)."""
        if self._spill is None:
            return
        if self._budget is None:
            cap = self.config.memory_rows
        else:
            self._budget.report(self._budget_token, self._growing_bytes(), int(self._state[K.S_NEXT]))
            cap = self._budget.rows_cap()
        nram = int(self._state[K.S_NRAM])
        if nram > cap:
            # down to the low watermark, but at most EVICT_PASS_ROWS past the cap per call: a call then
            # writes about what it added, and no request waits behind one pass of a tenth of the tier
            k = nram - int(cap * self.config.spill_low_watermark)
            self._evict(min(k, max(nram - cap, EVICT_PASS_ROWS)))
        if self._budget is not None:
            self._fit_budget(cap)

    def _evict_within_call(self, rest: np.ndarray) -> bool:
        """A push that adds more new rows than a budgeted arena's headroom: evict now instead of growing
        the arena (a copy under the lock, past the budget), then bring back the keys still to push that
        the eviction took (otherwise they would get fresh rows beside their disk copies). Returns False
        when the eviction made no room (the caller grows as usual)."""
        before = int(self._state[K.S_NRAM])
        self._maybe_evict()
        if int(self._state[K.S_NRAM]) >= before:
            return False
        self._promote(np.unique(rest))
        return True

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
        """Bytes that grow with the keys on disk: the spill Bloom filter and the dirty spilled keys."""
        return (self._spill.bloom_bytes if self._spill is not None else 0) + self._spilled_dirty.nbytes

    def _evict(self, k: int) -> None:
        """Write the k least recently used RAM rows to RocksDB (only rows not already there unchanged)
        and drop them from RAM. Lock held exclusively; spill tier present; 0 < k <= rows in RAM."""
        nram = int(self._state[K.S_NRAM])
        sel = np.empty(k, np.int64)
        if nram >= SAMPLED_LRU_MIN_ROWS and nram >= 8 * k:
            # a big RAM tier: sampled LRU, O(k) instead of a scan of every row's tick (sparse_tables._evict)
            self._evict_seed += 1
            k = sample_lru(self._arena_u, self._state, self._lay, k, LRU_SAMPLES_PER_VICTIM,
                           np.uint64(self._evict_seed), sel)
            sel = sel[:k]
        else:
            rows = np.empty(nram, np.int64)
            ticks = np.empty(nram, np.uint32)
            K.lru_ticks(self._arena_u, self._state, self._lay, rows, ticks)
            threshold = np.partition(ticks, k - 1)[k - 1]
            K.select_lru(rows, ticks, threshold, k, sel)
        records = np.empty((k, self.layout.stride), np.uint32)
        K.gather_records(self._arena_u, sel, records)
        keys = _record_keys(records)
        flags = records[:, self.layout.meta + K.M_FLAGS]
        synced = K.F_ON_DISK | K.F_SYNCED
        write = (flags & synced) != synced
        self._spill.put(keys[write], records[write], (flags[write] & K.F_ON_DISK) == 0)
        self._spilled_dirty.add(keys[(flags & K.F_DIRTY) != 0])
        K.remove_rows(self._index, self._arena_u, self._state, self._lay, sel)
        self._count(evictions=k, spill_writes=int(write.sum()))

    def _shrink_disk(self, args) -> list[np.ndarray]:
        """Expiry over rows authoritative in RocksDB; returns the deleted keys."""
        deleted = []
        decayed = args[2] != 1.0
        for keys, recs in self._spill.scan(self._spill.snapshot()):
            rows = np.empty(len(keys), np.int64)
            K.find_rows(self._index, self._arena_u, keys, rows)
            cold = rows < 0
            keys, recs = keys[cold], recs[cold]
            kill = np.empty(len(keys), np.bool_)
            K.shrink_records(recs, self._lay, *args, kill)
            self._spill.delete(keys[kill])
            deleted.append(keys[kill])
            if decayed:
                keep = ~kill
                self._spill.put(keys[keep], recs[keep], np.zeros(int(keep.sum()), np.bool_))
                self._spilled_dirty.add(keys[keep])
        return deleted

