"""Key sets in bounded, flat memory: an exact uint64 hash set and a scalable Bloom filter.

``SortedKeySet`` tracks keys that must be found again exactly (rows evicted while dirty) in 8 bytes a
key (``KeySet`` is an exact hash set, 17-34 bytes a slot). ``ScalableBloom`` answers "may this key be on
disk?" so that pulls and pushes of brand-new keys skip the RocksDB read; it never forgets a key, so
false positives only cost a read. Their loops run in Numba (``bench/keyset_bench.py`` measures the
filter and the sorted set's membership against the code they replaced).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._kernels import fmix64
from ._prefetch import prefetch

U64 = np.uint64
_H1 = np.uint64(0x2545F4914F6CDD1D)
_H2 = np.uint64(0x9FB21C651E98DF25)


def unique_keys(keys: np.ndarray) -> np.ndarray:
    """keys : uint64[n] -> uint64[m], sorted, each once: ``np.unique(keys)`` by a sort and one compare.

    numpy 2.4's ``np.unique`` (without return_index/inverse/counts) takes 9-60x as long on uint64
    (this machine: 1k keys 89 against 10 us, 10k 1.15 ms against 67 us, 1M 0.70 s against 12 ms), which
    made a delta's capture of 700k spilled dirty keys hold the table's exclusive lock for 0.48 s.

    Raises
    ------
    TypeError
        keys is not a uint64 array (no silent cast: a negative int64 key would wrap).
    """
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64:
        raise TypeError(f"unique_keys: keys must be a uint64 array, got "
                        f"{getattr(keys, 'dtype', type(keys).__name__)}")
    out = np.sort(keys)
    if len(out) < 2:
        return out
    keep = np.empty(len(out), np.bool_)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]


@njit(nogil=True, cache=True)
def _set_add(slots, occupied, keys):
    mask = U64(slots.shape[0] - 1)
    added = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        s = fmix64(k) & mask
        while occupied[s]:
            if slots[s] == k:
                break
            s = (s + U64(1)) & mask
        if not occupied[s]:
            occupied[s] = True
            slots[s] = k
            added += 1
    return added


@njit(nogil=True, cache=True)
def _set_contains(slots, occupied, keys, out):
    mask = U64(slots.shape[0] - 1)
    for i in range(keys.shape[0]):
        k = keys[i]
        s = fmix64(k) & mask
        found = False
        while occupied[s]:
            if slots[s] == k:
                found = True
                break
            s = (s + U64(1)) & mask
        out[i] = found


_SEARCH_GROUP = 32                  # binary searches run in lockstep: their cache misses overlap


@njit(nogil=True, cache=True)
def _in_sorted(run, keys, out):
    """out[i] |= keys[i] in run (uint64[p] sorted, p >= 1): branchless binary searches, 32 keys in
    lockstep, so each level's 32 loads are independent and their cache misses overlap (a search's own
    loads depend on each other); numpy's searchsorted does one search at a time."""
    n, m = run.shape[0], keys.shape[0]
    base = np.empty(_SEARCH_GROUP, np.int64)
    for g0 in range(0, m, _SEARCH_GROUP):
        g = min(_SEARCH_GROUP, m - g0)
        for t in range(g):
            base[t] = 0
        size = n
        while size > 1:                 # invariant: run[base] <= key, or base = 0
            half = size >> 1
            for t in range(g):
                if run[base[t] + half] <= keys[g0 + t]:
                    base[t] += half
            size -= half
        for t in range(g):
            if run[base[t]] == keys[g0 + t]:
                out[g0 + t] = True


def in_sorted(sorted_keys: np.ndarray, keys: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """keys : uint64[n] -> bool[n], True where the key is in ``sorted_keys`` (uint64[p], sorted,
    repeats allowed); with ``out`` (bool[n]) the answers are OR-ed into it, and it is returned.

    A binary search per key (O(n log p)) over a plain sorted array: 8 bytes per member where a
    ``KeySet`` takes 17-34 per slot, for sets built once and only queried. The searches run 32 at a
    time in lockstep (``_in_sorted``): 22M spilled dirty keys in 9 runs, calls of 2,000 sorted keys,
    1.27 us a key against 2.25 us through numpy's ``searchsorted`` (``bench/keyset_bench.py``).
    """
    if out is None:
        out = np.zeros(len(keys), np.bool_)
    if len(sorted_keys) and len(keys):
        _in_sorted(np.ascontiguousarray(sorted_keys, dtype=np.uint64),
                   np.ascontiguousarray(keys, dtype=np.uint64), out)
    return out


class KeySet:
    """An exact set of uint64 keys (open addressing, load <= 0.5, grows by doubling). Not thread-safe."""

    def __init__(self, capacity: int = 1024):
        cap = 1 << max(4, int(2 * capacity - 1).bit_length())
        self._slots = np.zeros(cap, np.uint64)
        self._occupied = np.zeros(cap, np.bool_)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes + self._occupied.nbytes

    def add(self, keys: np.ndarray) -> None:
        """keys : uint64[n]."""
        if len(keys) == 0:
            return
        if 2 * (self._n + len(keys)) > len(self._slots):
            old = self.to_array()
            cap = 1 << int(4 * (self._n + len(keys)) - 1).bit_length()
            self._slots = np.zeros(cap, np.uint64)
            self._occupied = np.zeros(cap, np.bool_)
            self._n = _set_add(self._slots, self._occupied, old)
        self._n += _set_add(self._slots, self._occupied, keys)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """keys : uint64[n] -> bool[n]."""
        out = np.zeros(len(keys), np.bool_)
        if self._n:
            _set_contains(self._slots, self._occupied, keys, out)
        return out

    def to_array(self) -> np.ndarray:
        """All keys, uint64[len(self)], in no particular order."""
        return self._slots[self._occupied].copy()

    def clear(self) -> None:
        self.__init__(1024)



class SortedKeySet:
    """An exact set of uint64 keys in 8 bytes per key: sorted runs plus an unsorted tail (a small LSM).

    For sets that grow with the keys on disk (rows evicted while dirty, kept until the next delta
    checkpoint) where ``KeySet``'s 17 bytes per slot at load <= 0.5 (up to 68 bytes per key after its
    power-of-two growth) would take a memory budget's RAM tier. ``add`` appends to the tail; a tail of
    64k keys is sorted into a run, and runs of similar size are merged (one two-pointer pass,
    ``_merge_sorted``) up to ``MAX_RUN`` keys (4M: 32 MiB), so a merge's transient output and pause stay
    bounded however large the set grows. ``contains`` sorts the tail into a run and does a binary
    search per run (~25 runs at 88M keys). Duplicates across runs are allowed (``len`` counts distinct
    keys).
    Not thread-safe.
    """

    TAIL = 1 << 16
    MAX_RUN = 1 << 22

    def __init__(self):
        self._runs: list[np.ndarray] = []
        self._tail: list[np.ndarray] = []
        self._tail_n = 0

    def __len__(self) -> int:
        return len(self.to_array())

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._runs) + 8 * self._tail_n

    def add(self, keys: np.ndarray) -> None:
        """keys : uint64[n] (duplicates allowed)."""
        if len(keys) == 0:
            return
        self._tail.append(np.array(keys, dtype=np.uint64, copy=True))
        self._tail_n += len(keys)
        if self._tail_n >= self.TAIL:
            self._flush_tail()

    def _flush_tail(self) -> None:
        if not self._tail:
            return
        run = np.concatenate(self._tail)
        run.sort()                      # duplicates may stay: merges drop them, contains does not mind
        self._tail, self._tail_n = [], 0
        self._runs.append(run)
        while (len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1])
               and len(self._runs[-2]) + len(self._runs[-1]) <= self.MAX_RUN):
            b, a = self._runs.pop(), self._runs.pop()
            self._runs.append(_merge_sorted(a, b))

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """keys : uint64[n] -> bool[n]."""
        keys = np.asarray(keys, dtype=np.uint64)
        self._flush_tail()              # a sorted run: binary search (np.isin would sort the tail each call)
        out = np.zeros(len(keys), np.bool_)
        for run in self._runs:
            in_sorted(run, keys, out)
        return out

    def runs(self) -> list[np.ndarray]:
        """The set's sorted runs now (the tail sorted into a run of its own), uint64 arrays that may
        repeat keys. Changes nothing, so it is safe under a shared lock beside other readers; and the
        set never changes an array it made (an add makes a run, a merge a new array), so a delta dump
        reads these later, outside the table's lock, while the set goes on (``merged_chunks``)."""
        runs = list(self._runs)
        if self._tail:
            runs.append(np.sort(np.concatenate(self._tail)))
        return runs

    def to_array(self) -> np.ndarray:
        """All keys, uint64[len(self)], sorted, each once."""
        parts = self._runs + self._tail
        if not parts:
            return np.empty(0, np.uint64)
        return unique_keys(np.concatenate(parts))

    def clear(self) -> None:
        self.__init__()


def merged_chunks(runs: list, chunk: int):
    """Yield the distinct keys of sorted runs in ascending order, about ``chunk`` at a time.

    runs : list of (uint64[n_i] sorted, bool[n_i] or None): a run and which of its keys to keep (None:
    all). Each step takes, from every run, its keys up to the smallest of the runs' ``chunk``-th next
    keys, so a step holds at most ``chunk`` keys per run: a delta's 88M spilled dirty keys (0.7 GB)
    are never concatenated and sorted whole (that held ~2.5 GB and the table's lock for seconds).
    Yields uint64[m] sorted, distinct, m >= 1.
    """
    pos = [0] * len(runs)
    while True:
        live = [i for i, (run, _) in enumerate(runs) if pos[i] < len(run)]
        if not live:
            return
        hi = min(runs[i][0][min(pos[i] + chunk, len(runs[i][0])) - 1] for i in live)
        parts = []
        for i in live:
            run, keep = runs[i]
            end = int(np.searchsorted(run, hi, side="right"))
            part = run[pos[i]:end]
            parts.append(part if keep is None else part[keep[pos[i]:end]])
            pos[i] = end
        keys = unique_keys(np.concatenate(parts))
        if len(keys):
            yield keys


def _merge_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The distinct keys of two sorted uint64 arrays, sorted: one two-pointer pass into one output array
    (shrunk in place to the distinct count). Concatenating, sorting and masking took three more arrays
    of the merged size (a 16M-key merge: ~0.45 GB for an instant, seen as RSS peaks of a budgeted
    server at 100M keys); this takes the output alone."""
    out = np.empty(len(a) + len(b), np.uint64)
    n = _merge_distinct(a, b, out)
    if n < len(out):
        out.resize(n, refcheck=False)    # realloc: no copy for a large (mmapped) block
    return out


@njit(nogil=True, cache=True)
def _merge_distinct(a, b, out):
    i = j = n = 0
    na, nb = a.shape[0], b.shape[0]
    while i < na or j < nb:
        if j >= nb or (i < na and a[i] <= b[j]):
            v = a[i]
            i += 1
        else:
            v = b[j]
            j += 1
        if n == 0 or out[n - 1] != v:
            out[n] = v
            n += 1
    return n


_BLOCK_WORDS = 8                    # a block is 512 bits: one 64-byte cache line
_PREFETCH_KEYS = 8                  # keys ahead whose blocks a query asks the CPU to fetch


@njit(inline="always")
def _block_start(h, start, nblocks):
    """The first word of a key's block: ``start`` + 8 x (the high 32 bits of h scaled to nblocks),
    Lemire's multiply-shift range reduction (no division; nblocks < 2**32)."""
    return U64(start) + ((((h >> U64(32)) * U64(nblocks)) >> U64(32)) << U64(3))


@njit(nogil=True, cache=True)
def _bloom_add(pool, start, nblocks, nhash, keys):
    for i in range(keys.shape[0]):
        h = fmix64(keys[i] ^ _H1)
        base = _block_start(h, start, nblocks)
        bits = h * _H2                  # the in-block bit positions: 9-bit slices of a second mix
        for j in range(nhash):
            q = (bits >> U64(9 * j)) & U64(511)
            pool[base + (q >> U64(6))] |= U64(1) << (q & U64(63))


@njit(nogil=True, cache=True)
def _bloom_query(pool, starts, nblocks, nhash, keys, out):
    n, nf = keys.shape[0], starts.shape[0]
    for i in range(min(_PREFETCH_KEYS, n)):
        h = fmix64(keys[i] ^ _H1)
        for f in range(nf):
            prefetch(pool, _block_start(h, starts[f], nblocks[f]))
    for i in range(n):
        if i + _PREFETCH_KEYS < n:      # the blocks of a key 8 ahead: their cache misses overlap
            h = fmix64(keys[i + _PREFETCH_KEYS] ^ _H1)
            for f in range(nf):
                prefetch(pool, _block_start(h, starts[f], nblocks[f]))
        h = fmix64(keys[i] ^ _H1)
        bits = h * _H2
        hit = False
        for f in range(nf - 1, -1, -1):     # the newest, largest filter first: it holds most keys
            base = _block_start(h, starts[f], nblocks[f])
            hit = True
            for j in range(nhash):
                q = (bits >> U64(9 * j)) & U64(511)
                if ((pool[base + (q >> U64(6))] >> (q & U64(63))) & U64(1)) == U64(0):
                    hit = False
                    break
            if hit:
                break
        out[i] = hit


class ScalableBloom:
    """Scalable Bloom filter (Almeida et al. 2007) of blocked filters: a chain of filters, each twice the
    capacity of the previous, so that each keeps its false-positive rate however many keys arrive.

    Each filter is cache-line blocked (Putze, Sanders & Singler 2007, "Cache-, hash- and space-efficient
    Bloom filters"): a key's ``nhash`` bits all fall in one 512-bit block, chosen by Lemire's
    multiply-shift reduction of one 64-bit hash, so a query costs one cache miss per filter, and a query
    of a batch prefetches the blocks of the key 8 ahead in every filter of the chain at once. 10 bits and
    6 bits set per key give 0.96% false positives per full filter (measured: 16M keys; the classic filter
    with 7 hashes, 0.81%), so a chain of 5 full filters answers "maybe" for ~4% of absent keys.
    All filters live in one pool, each aligned to a cache line; a new filter copies the pool once
    (as many bytes as the filters before it, a few milliseconds).

    It never forgets a key, so its size follows the keys ever added, not those still present: its owner
    replaces it at every expiry pass with a filter of the keys it still holds
    (``spill.SpillStore.begin_filter_rebuild``; ``added`` says how many each took).
    """

    def __init__(self, initial_capacity: int = 1 << 20, bits_per_key: int = 10, nhash: int = 6):
        if not 1 <= nhash <= 7:
            raise ValueError(f"ScalableBloom: nhash must be in 1..7 (9 bits of a 64-bit hash each), got {nhash}")
        self._bits_per_key = bits_per_key
        self._nhash = nhash
        self._initial_capacity = initial_capacity
        self.clear()

    @property
    def nbytes(self) -> int:
        return self._pool.nbytes

    @property
    def added(self) -> int:
        """Keys added since the filter was made or cleared, duplicates included (each took capacity)."""
        return self._added

    def add(self, keys: np.ndarray) -> None:
        """Record keys : uint64[n] (duplicates only cost capacity)."""
        self._added += len(keys)
        start = 0
        while start < len(keys):
            if self._count >= self._capacity:
                self._grow()
            chunk = keys[start:start + self._capacity - self._count]
            _bloom_add(self._pool, self._starts[-1], self._nblocks[-1], self._nhash, chunk)
            self._count += len(chunk)
            start += len(chunk)

    def _grow(self) -> None:
        """Append a filter of ``_next_capacity`` keys: a new pool, the old filters copied to its start."""
        cap = self._next_capacity
        nblocks = -(-cap * self._bits_per_key // 512)
        used = int(self._starts[-1] + 8 * self._nblocks[-1]) - self._align if len(self._starts) else 0
        pool = np.zeros(used + 8 * nblocks + _BLOCK_WORDS, np.uint64)
        align = (-(pool.ctypes.data // 8)) % _BLOCK_WORDS      # the first word on a 64-byte boundary
        pool[align:align + used] = self._pool[self._align:self._align + used]
        self._starts = np.append(self._starts - self._align + align, align + used)
        self._nblocks = np.append(self._nblocks, nblocks)
        self._pool, self._align = pool, align
        self._capacity, self._count = cap, 0
        self._next_capacity = 2 * cap

    def may_contain(self, keys: np.ndarray) -> np.ndarray:
        """keys : uint64[n] -> bool[n]; False means certainly never added."""
        out = np.zeros(len(keys), np.bool_)
        if len(self._starts) and len(keys):
            _bloom_query(self._pool, self._starts, self._nblocks, self._nhash,
                         np.ascontiguousarray(keys, dtype=np.uint64), out)
        return out

    def clear(self) -> None:
        self._pool = np.zeros(0, np.uint64)
        self._align = 0
        self._starts = np.zeros(0, np.int64)     # each filter's first word in the pool
        self._nblocks = np.zeros(0, np.int64)    # each filter's 512-bit blocks
        self._capacity = self._count = 0
        self._added = 0
        self._next_capacity = self._initial_capacity
