"""Choosing the rows an eviction pass writes to RocksDB (Numba).

Two orders (``TableConfig.eviction``). ``lru``: the least recently used rows (oldest tick). ``slru``,
segmented LRU (Karedla, Love and Wherry 1994; memcached's and Caffeine's caches split the same way): a
row carries ``F_REUSED`` once a pull found it in RAM or it was read back from RocksDB (the protected
segment); rows without it (the probationary segment: created and not pulled since) go first, oldest
first, then the least recently used of the rest. A key seen once then leaves RAM before a key that
comes back. The probationary segment keeps about ``1 / per_victim`` of the tier, so a key gets that
long to come back, and protected rows that stop coming back still age out by tick.

Simulated on ``bench/scale_bench.py``'s traffic scaled down (1M keys, a RAM tier of 300k rows, Zipf(1.05)
truncated to the keys seen plus 30% new keys, eviction passes of 2000 rows): pulled keys read back from
disk over the last 10% of the growth 13.8% with sampled LRU, 8.2% with sampled SLRU, 8.2% with the exact
choice below; an LFU by access count, 8-9%.

The exact choice (``exact_victims``) reads every live row: O(rows in RAM) per pass, ~0.3 s for a RAM
tier of 30M rows, under the table's exclusive lock. ``sample_lru`` reads O(k): it draws
``k * per_victim`` rows at random and evicts the k first in the order above among the live ones, the
sampled LRU Redis uses (``maxmemory-samples``). A row among the oldest ``1 / per_victim`` of the tier is
then very likely evicted first; a hot row (recent tick) practically never is. Under ``slru`` the
probationary rows among the draws go first, so they settle near ``1 / per_victim`` of the tier (fewer,
and the draws find fewer than k of them).

The draws are stratified: the arena rows handed out are cut into ``k * per_victim`` equal strata and one
row is drawn uniformly in each, so every row has the same chance (within one part in a stratum's size)
and the draws come out distinct and in increasing address order. Unsorted draws over a 2M-row arena
cost 31 ms a pass of 65,536 victims in ``bench/table_bench.py``'s spill workload (a TLB miss and a page
walk per draw, the page tables evicted by the push between passes), ~3x the same kernel on a warm
arena; in address order the hardware prefetcher and the TLB see a forward stream.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._kernels import F_FREE, F_REUSED, L_META, M_FLAGS, M_TICK, S_NEXT, U64, splitmix64
from ._prefetch import prefetch_last

_AHEAD = 16


@njit(nogil=True, cache=True)
def sample_lru(arena_u, state, lay, k, per_victim, seed, out, segmented):
    """out[:n] = the first k distinct live rows in eviction order (``segmented``: rows without
    ``F_REUSED`` first, each segment oldest tick first; else oldest tick first) among ``k * per_victim``
    rows drawn one per stratum of the arena rows handed out (free rows skipped). Returns n (<= k;
    smaller only when the draws found fewer than k live rows). out : int64[>= k]; seed : uint64.

    Draws are in increasing row order and prefetched ahead; the k first are found by a partition of
    the drawn ranks (tick, plus 2^32 for a protected row), not a sort.
    """
    n_next = state[S_NEXT]
    if n_next == 0 or k <= 0:
        return 0
    flags_w = lay[L_META] + M_FLAGS
    tick_w = lay[L_META] + M_TICK
    m = min(n_next, k * per_victim)
    ids = np.empty(m, np.int64)
    x = U64(seed)
    for i in range(m):             # stratum i is rows [i * n_next // m, (i + 1) * n_next // m)
        lo = (i * n_next) // m
        width = ((i + 1) * n_next) // m - lo
        x = splitmix64(x)
        ids[i] = lo + np.int64(x % U64(width))
    cand = np.empty(m, np.int64)
    ticks = np.empty(m, np.uint64)
    c = 0
    for i in range(m):
        if i + _AHEAD < m:
            prefetch_last(arena_u, ids[i + _AHEAD])    # flags and tick are the record's last words
        r = ids[i]
        if arena_u[r, flags_w] & F_FREE:
            continue
        cand[c] = r
        ticks[c] = U64(arena_u[r, tick_w])
        if segmented and arena_u[r, flags_w] & F_REUSED:
            ticks[c] += U64(1) << U64(32)
        c += 1
    if c == 0:
        return 0
    kk = min(k, c)
    taken = np.empty(kk, np.int64)
    n = _take(ticks, c, np.partition(ticks[:c], kk - 1)[kk - 1], kk, taken, 0)
    for j in range(n):
        out[j] = cand[taken[j]]
    return n


@njit(nogil=True, cache=True)
def exact_victims(arena_u, state, lay, k, per_victim, segmented, out):
    """out[:k] = the first k live rows in eviction order over the whole tier (``segmented``: the
    oldest rows without ``F_REUSED``, as many as exceed ``1 / per_victim`` of the live rows, then the
    oldest of the rest; else the oldest). O(rows in RAM). Returns n = min(k, live rows)."""
    flags_w = lay[L_META] + M_FLAGS
    tick_w = lay[L_META] + M_TICK
    n_next = state[S_NEXT]
    rows = np.empty(n_next, np.int64)
    ranks = np.empty(n_next, np.uint64)
    live = 0
    probation = 0
    for r in range(n_next):
        f = arena_u[r, flags_w]
        if f & F_FREE:
            continue
        rows[live] = r
        ranks[live] = U64(arena_u[r, tick_w])
        if segmented:
            if f & F_REUSED:
                ranks[live] += U64(1) << U64(32)       # protected: after every probationary row
            else:
                probation += 1
        live += 1
    kk = min(k, live)
    if kk <= 0:
        return 0
    first = min(kk, max(0, probation - live // per_victim)) if segmented else 0
    # the ``first`` oldest probationary rows go, then the oldest of all the others (a second
    # partition over ticks alone)
    taken = np.empty(kk, np.int64)          # positions into rows / ranks
    n = 0
    if first > 0:
        n = _take(ranks, live, np.partition(ranks[:live], first - 1)[first - 1], first, taken, 0)
    if segmented:
        for i in range(live):
            ranks[i] &= U64(0xFFFFFFFF)
        for j in range(n):                  # out of the second partition: ranked past every tick
            ranks[taken[j]] = U64(1) << U64(40)
    if n < kk:
        threshold = np.partition(ranks[:live], kk - n - 1)[kk - n - 1]
        n = _take(ranks, live, threshold, kk, taken, n)
    for j in range(n):
        out[j] = rows[taken[j]]
    return n


@njit(nogil=True, cache=True)
def _take(ranks, live, threshold, k, out, n):
    """Append to out[n:] the positions ranked below threshold, then ties at it, until n == k; returns n."""
    for i in range(live):
        if ranks[i] < threshold and n < k:
            out[n] = i
            n += 1
    for i in range(live):
        if n >= k:
            break
        if ranks[i] == threshold:
            out[n] = i
            n += 1
    return n
