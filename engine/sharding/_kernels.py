"""Numba kernels of ``engine.sharding``: grouping positions by label (O(n), no sorting). They take
arrays and scalars only and release the GIL."""
from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def group(labels, n_groups, order, bounds):
    """Counting sort: positions of labels int32[n] grouped by label (stable) into order int64[n];
    group g is order[bounds[g]:bounds[g + 1]] (bounds int64[n_groups + 1])."""
    bounds[:] = 0
    for i in range(labels.shape[0]):
        bounds[labels[i] + 1] += 1
    for g in range(n_groups):
        bounds[g + 1] += bounds[g]
    fill = bounds[:-1].copy()
    for i in range(labels.shape[0]):
        g = labels[i]
        order[fill[g]] = i
        fill[g] += 1
