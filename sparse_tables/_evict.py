"""Choosing the rows an eviction pass writes to RocksDB (Numba).

The exact choice (``_kernels.lru_ticks`` + ``np.partition`` + ``select_lru``) reads every live row's
tick: O(rows in RAM) per pass, ~0.3 s for a RAM tier of 30M rows, under the table's exclusive lock.
``sample_lru`` reads O(k): it draws ``k * per_victim`` live rows at random and evicts the k with the
oldest ticks among them, the sampled LRU Redis uses (``maxmemory-samples``). A row among the oldest
``1 / per_victim`` of the tier is then very likely evicted first; a hot row (recent tick) practically
never is.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._kernels import F_FREE, L_META, M_FLAGS, M_TICK, S_NEXT, U64, splitmix64
from ._prefetch import prefetch_last

F_TAKEN = np.uint32(16)   # transient: a row already chosen in this call (never left set)
_AHEAD = 16


@njit(nogil=True, cache=True)
def sample_lru(arena_u, state, lay, k, per_victim, seed, out):
    """out[:n] = distinct live rows with the oldest ticks among ``k * per_victim`` rows drawn at random
    (uniformly over the arena rows handed out, free rows skipped). Returns n (<= k; smaller only when
    the draws found fewer distinct live rows). out : int64[>= k]; seed : uint64.

    The draws are generated first and their records prefetched ahead (random reads overlap); the k
    oldest are found by a partition of the drawn ticks, not a sort, and a row drawn twice is taken
    once (a transient flag bit marks the taken rows and is cleared before returning).
    """
    n_next = state[S_NEXT]
    if n_next == 0 or k <= 0:
        return 0
    flags_w = lay[L_META] + M_FLAGS
    tick_w = lay[L_META] + M_TICK
    m = min(n_next, k * per_victim)
    ids = np.empty(m, np.int64)
    x = U64(seed)
    for i in range(m):
        x = splitmix64(x)
        ids[i] = np.int64(x % U64(n_next))
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
    for ties in range(2):          # the ticks below the threshold first, then ties at it
        for i in range(c):
            if n >= kk:
                break
            t = ticks[i]
            if (t < threshold) if ties == 0 else (t == threshold):
                r = cand[i]
                if arena_u[r, flags_w] & F_TAKEN:
                    continue
                arena_u[r, flags_w] |= F_TAKEN
                out[n] = r
                n += 1
    if n < kk:                     # rows drawn twice left the oldest kk short: go on in tick order
        order = np.argsort(ticks[:c])
        for i in range(c):
            if n >= kk:
                break
            r = cand[order[i]]
            if arena_u[r, flags_w] & F_TAKEN:
                continue
            arena_u[r, flags_w] |= F_TAKEN
            out[n] = r
            n += 1
    for i in range(n):
        arena_u[out[i], flags_w] &= ~F_TAKEN
    return n
