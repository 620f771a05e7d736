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


@njit(nogil=True, cache=True)
def sample_lru(arena_u, state, lay, k, per_victim, seed, out):
    """out[:n] = distinct live rows with the oldest ticks among ~``k * per_victim`` drawn at random
    (uniformly over the arena rows handed out, free rows skipped). Returns n (<= k; smaller only when
    the draws found fewer distinct live rows). out : int64[>= k]; seed : uint64."""
    n_next = state[S_NEXT]
    if n_next == 0 or k <= 0:
        return 0
    moff = lay[L_META]
    m = min(n_next, k * per_victim)
    cand = np.empty(m, np.int64)
    x = U64(seed)
    c = 0
    for _ in range(4 * m):
        if c >= m:
            break
        x = splitmix64(x)
        r = np.int64(x % U64(n_next))
        if arena_u[r, moff + M_FLAGS] & F_FREE:
            continue
        cand[c] = r
        c += 1
    rows = np.unique(cand[:c])
    ticks = np.empty(rows.shape[0], np.uint32)
    for i in range(rows.shape[0]):
        ticks[i] = arena_u[rows[i], moff + M_TICK]
    order = np.argsort(ticks)
    n = min(k, rows.shape[0])
    for i in range(n):
        out[i] = rows[order[i]]
    return n
