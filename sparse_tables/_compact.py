"""Arena compaction (Numba): give the pages of free rows back when a memory budget shrinks the RAM tier.

Rows once handed out stay resident (their pages were written) even after eviction puts them on the free
list. When the budget (``budget.MemoryBudget``) lowers the RAM tier, ``compact_arena`` moves the live
rows at or above a target row into free rows below it, so everything from the target up is unused and
the table can return those pages to the OS (``madvise(MADV_DONTNEED)``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._kernels import EMPTY, F_FREE, L_META, L_STRIDE, LOW32, M_FLAGS, NO_ROW, S_FREE_HEAD, S_NEXT, \
    S_NFREE, S_NRAM, U64, index_hash, row_key


@njit(nogil=True, cache=True)
def compact_arena(index, arena_u, state, lay, target):
    """Move every live row at or above row ``target`` into a free row below it and repoint its index
    slot; rebuild the free list from the free rows below ``target`` and set ``S_NEXT = target``.

    Requires live rows (``state[S_NRAM]``) <= target <= ``state[S_NEXT]``; returns the rows moved,
    or -1 (nothing changed) when the requirement does not hold. Lock held exclusively by the caller.
    """
    n_next = state[S_NEXT]
    if state[S_NRAM] > target or target > n_next:
        return -1
    flags_w = lay[L_META] + M_FLAGS
    stride = lay[L_STRIDE]
    mask = U64(index.shape[0] - 1)
    dst = 0
    moved = 0
    for r in range(target, n_next):
        if arena_u[r, flags_w] & F_FREE:
            continue
        while not (arena_u[dst, flags_w] & F_FREE):
            dst += 1              # < target: below it there are at least as many free rows as live above
        key = row_key(arena_u, r)
        h = index_hash(key)
        j = h & mask
        while True:               # the key's slot (present: it is a live row)
            s = index[j]
            if s != EMPTY and np.int64(s & LOW32) == r:
                index[j] = (s & ~LOW32) | U64(dst)
                break
            j = (j + U64(1)) & mask
        for w in range(stride):
            arena_u[dst, w] = arena_u[r, w]
        dst += 1
        moved += 1
    head = -1
    nfree = 0
    for r in range(target - 1, -1, -1):
        if arena_u[r, flags_w] & F_FREE:
            arena_u[r, 0] = NO_ROW if head < 0 else np.uint32(head)
            head = r
            nfree += 1
    state[S_FREE_HEAD] = head
    state[S_NFREE] = nfree
    state[S_NEXT] = target
    return moved
