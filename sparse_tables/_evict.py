"""Choosing the rows an eviction pass writes to RocksDB (Numba).

The exact choice (``_kernels.lru_ticks`` + ``np.partition`` + ``select_lru``) reads every live row's
tick: O(rows in RAM) per pass, ~0.3 s for a RAM tier of 30M rows, under the table's exclusive lock.
``sample_lru`` reads O(k): it draws ``k * per_victim`` rows at random and evicts the k with the oldest
ticks among the live ones, the sampled LRU Redis uses (``maxmemory-samples``). A row among the oldest
``1 / per_victim`` of the tier is then very likely evicted first; a hot row (recent tick) practically
never is.

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

from ._kernels import F_FREE, L_META, M_FLAGS, M_TICK, S_NEXT, U64, splitmix64
from ._prefetch import prefetch_last

_AHEAD = 16


@njit(nogil=True, cache=True)
def sample_lru(arena_u, state, lay, k, per_victim, seed, out):
    """out[:n] = distinct live rows with the oldest ticks among ``k * per_victim`` rows drawn one per
    stratum of the arena rows handed out (free rows skipped). Returns n (<= k; smaller only when the
    draws found fewer than k live rows). out : int64[>= k]; seed : uint64.

    Draws are in increasing row order and prefetched ahead; the k oldest are found by a partition of
    the drawn ticks, not a sort.
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
    ticks = np.empty(m, np.uint32)
    c = 0
    for i in range(m):
        if i + _AHEAD < m:
            prefetch_last(arena_u, ids[i + _AHEAD])    # flags and tick are the record's last words
        r = ids[i]
        if arena_u[r, flags_w] & F_FREE:
            continue
        cand[c] = r
        ticks[c] = arena_u[r, tick_w]
        c += 1
    if c == 0:
        return 0
    kk = min(k, c)
    threshold = np.partition(ticks[:c], kk - 1)[kk - 1]
    n = 0
    for i in range(c):             # the ticks below the threshold (fewer than kk of them) ...
        if ticks[i] < threshold:
            out[n] = cand[i]
            n += 1
    for i in range(c):             # ... then ties at it until kk
        if n >= kk:
            break
        if ticks[i] == threshold:
            out[n] = cand[i]
            n += 1
    return n
