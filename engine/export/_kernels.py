"""Numba kernels of the serving predictor: an open-addressing hash index over a bundle's keys, and the
fused lookup + gather that turns key occurrences into embedding rows.

Index layout (linear probing, capacity a power of two, load factor <= 0.7)::

    slot_keys : uint64[cap]   key stored in the slot (meaningless where slot_rows == -1)
    slot_rows : int64[cap]    row of the key in the bundle's values array, -1 = empty slot
    home(key) = fmix64(key ^ SALT) & (cap - 1); probe home, home + 1, ... (mod cap)

The salt keeps the index independent of ``engine.ps.routing.mix64`` (which picked the vshard, hence
the file the key came from), so keys of one file still spread over the whole index.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

_SALT = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


@njit(cache=True, nogil=True, inline="always")
def _fmix64(k):
    k = k ^ _SALT
    k ^= k >> _S33
    k *= _M1
    k ^= k >> _S33
    k *= _M2
    k ^= k >> _S33
    return k


def index_capacity(n: int) -> int:
    """Smallest power of two >= max(16, n / 0.7)."""
    need = max(16, int(np.ceil(n / 0.7)))
    return 1 << (need - 1).bit_length()


@njit(cache=True, nogil=True)
def build_index(keys, slot_keys, slot_rows):
    """Insert ``keys[i] -> i`` for every i.

    Parameters
    ----------
    keys : uint64[n]
    slot_keys : uint64[cap]
        Overwritten.
    slot_rows : int64[cap]
        Must be all -1 on entry.

    Returns
    -------
    int
        -1, or the first row whose key was already inserted (duplicate key; the index is then partial).
    """
    mask = np.uint64(len(slot_rows) - 1)
    for i in range(len(keys)):
        k = keys[i]
        h = _fmix64(k) & mask
        while True:
            r = slot_rows[h]
            if r < 0:
                slot_keys[h] = k
                slot_rows[h] = i
                break
            if slot_keys[h] == k:
                return i
            h = (h + np.uint64(1)) & mask
    return -1


@njit(cache=True, nogil=True)
def _find(k, slot_keys, slot_rows, mask):
    h = _fmix64(k) & mask
    while True:
        r = slot_rows[h]
        if r < 0 or slot_keys[h] == k:
            return r
        h = (h + np.uint64(1)) & mask


@njit(cache=True, nogil=True)
def find_rows(keys, slot_keys, slot_rows, out):
    """Row of each key, -1 when absent. keys : uint64[n] -> out : int64[n]."""
    mask = np.uint64(len(slot_rows) - 1)
    for i in range(len(keys)):
        out[i] = _find(keys[i], slot_keys, slot_rows, mask)


@njit(cache=True, nogil=True, parallel=True)
def lookup_gather(keys, slot_keys, slot_rows, values, out):
    """``out[i] = values[row(keys[i])]``, zeros where the key is unknown (as training's inference pull).

    Parameters
    ----------
    keys : uint64[n]
        Key occurrences.
    slot_keys, slot_rows : the index (module docstring).
    values : T[N, w]
        The bundle's embedding rows; ``T`` is float32 or uint16 (float16 bits, converted by the caller).
    out : T[n, w]
        Overwritten. Each ``i`` writes only ``out[i]`` (no races).

    Returns
    -------
    int
        Number of occurrences found in the bundle.
    """
    mask = np.uint64(len(slot_rows) - 1)
    w = values.shape[1]
    hits = 0
    for i in prange(len(keys)):
        r = _find(keys[i], slot_keys, slot_rows, mask)
        if r >= 0:
            for c in range(w):
                out[i, c] = values[r, c]
            hits += 1
        else:
            for c in range(w):
                out[i, c] = 0
    return hits
