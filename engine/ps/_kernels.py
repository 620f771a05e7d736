"""Numba kernels of the PS client and server: O(n) dedup, segment sums and grouping (no per-key
Python work, no sorting). All take arrays and scalars only and release the GIL."""
from __future__ import annotations

import numpy as np
from numba import njit

from ..sharding._kernels import group  # noqa: F401  (grouping by label; shared with engine.checkpoint)

_MUL = np.uint64(0x9E3779B97F4A7C15)
_S32 = np.uint64(32)


@njit(cache=True, nogil=True)
def dedup(keys, uniq, inverse):
    """First-occurrence dedup with an open-addressing table.

    keys : uint64[n]; fills uniq : uint64[n] (first n_unique entries, in first-occurrence order) and
    inverse : int64[n] (keys[i] == uniq[inverse[i]]). Returns n_unique.
    """
    n = keys.shape[0]
    cap = 16
    while cap < 2 * n:
        cap *= 2
    mask = np.uint64(cap - 1)
    slots = np.full(cap, -1, np.int64)
    nu = 0
    for i in range(n):
        k = keys[i]
        h = k * _MUL
        s = (h ^ (h >> _S32)) & mask
        while True:
            j = slots[s]
            if j < 0:
                slots[s] = nu
                uniq[nu] = k
                inverse[i] = nu
                nu += 1
                break
            if uniq[j] == k:
                inverse[i] = j
                break
            s = (s + np.uint64(1)) & mask
    return nu


@njit(cache=True, nogil=True)
def segment_sum_2d(values, inverse, out):
    """out[inverse[i]] += values[i] for values float32[n, d], out float32[m, d] (zeroed here)."""
    out[:] = 0
    for i in range(values.shape[0]):
        r = inverse[i]
        for j in range(values.shape[1]):
            out[r, j] += values[i, j]


@njit(cache=True, nogil=True)
def segment_sum_1d(values, inverse, out):
    out[:] = 0
    for i in range(values.shape[0]):
        out[inverse[i]] += values[i]


@njit(cache=True, nogil=True)
def take_1d(src, idx, out):
    """out[i] = src[idx[i]] (keys or counts of one request chunk / shard)."""
    for i in range(idx.shape[0]):
        out[i] = src[idx[i]]


@njit(cache=True, nogil=True)
def take_rows(src, idx, out):
    """out[i, :] = src[idx[i], :] for float32 rows (numpy's fancy indexing is ~5x slower on
    rows of 16-64 floats)."""
    d = src.shape[1]
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(d):
            out[i, j] = src[r, j]


@njit(cache=True, nogil=True)
def put_rows(src, idx, out):
    """out[idx[i], :] = src[i, :] (reassembly of a reply chunk into the caller's order)."""
    d = src.shape[1]
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(d):
            out[r, j] = src[i, j]


@njit(cache=True, nogil=True)
def first_non_finite(values):
    """Index of the first NaN or Inf of ``values : float32[n]`` (a flat view), or -1 when all are finite.
    One pass without the bool temporary of ``np.isfinite(values).all()`` (430k-float dense gradients
    arrive every step)."""
    for i in range(values.shape[0]):
        if not np.isfinite(values[i]):
            return i
    return -1


def all_finite(arr: np.ndarray) -> bool:
    """True when a float32 array (any shape, C-contiguous or not) holds no NaN or Inf."""
    return first_non_finite(np.ascontiguousarray(arr, np.float32).reshape(-1)) < 0
