"""Numba kernels of the serving predictor: an open-addressing hash index over a bundle's keys, and the
fused lookup + gather that turns key occurrences into embedding rows.

Index layout (linear probing, capacity a power of two, load factor <= 0.7)::

    slots : uint64[cap, 2]    slots[h, 0] = key, slots[h, 1] = its row in the bundle's values array,
                              EMPTY (2^64 - 1) in column 1 = empty slot
    home(key) = fmix64(key ^ SALT) & (cap - 1); probe home, home + 1, ... (mod cap)

Key and row share one 16-byte slot, so a probe that hits costs one cache line, not two. The salt keeps
the index independent of ``engine.ps.routing.mix64`` (which picked the vshard, hence the file the key
came from), so keys of one file still spread over the whole index.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from sparse_tables.kernels import prefetch

_SALT = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)


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


def new_index(n: int) -> np.ndarray:
    """An empty index for ``n`` keys: uint64[index_capacity(n), 2], every slot EMPTY."""
    return np.full((index_capacity(n), 2), EMPTY, np.uint64)


@njit(cache=True, nogil=True)
def build_index(keys, slots):
    """Insert ``keys[i] -> i`` for every i.

    Parameters
    ----------
    keys : uint64[n]
    slots : uint64[cap, 2]
        From :func:`new_index` (all EMPTY on entry).

    Returns
    -------
    int
        -1, or the first row whose key was already inserted (duplicate key; the index is then partial).
    """
    mask = np.uint64(len(slots) - 1)
    for i in range(len(keys)):
        k = keys[i]
        h = _fmix64(k) & mask
        while True:
            if slots[h, 1] == EMPTY:
                slots[h, 0] = k
                slots[h, 1] = np.uint64(i)
                break
            if slots[h, 0] == k:
                return i
            h = (h + np.uint64(1)) & mask
    return -1


@njit(cache=True, nogil=True, inline="always")
def _probe(k, h, slots, mask):
    """Row of key ``k`` starting at slot ``h``, -1 when absent."""
    while True:
        r = slots[h, 1]
        if r == EMPTY:
            return np.int64(-1)
        if slots[h, 0] == k:
            return np.int64(r)
        h = (h + np.uint64(1)) & mask


@njit(cache=True, nogil=True)
def find_rows(keys, slots, out):
    """Row of each key, -1 when absent. keys : uint64[n] -> out : int64[n]."""
    mask = np.uint64(len(slots) - 1)
    for i in range(len(keys)):
        out[i] = _probe(keys[i], _fmix64(keys[i]) & mask, slots, mask)


@njit(cache=True, nogil=True, parallel=True)
def lookup_gather(keys, slots, values, out):
    """``out[i] = values[row(keys[i])]``, zeros where the key is unknown (as training's inference pull).

    Parameters
    ----------
    keys : uint64[n]
        Key occurrences.
    slots : uint64[cap, 2]
        The index (module docstring).
    values : T[N, w]
        The bundle's embedding rows; ``T`` is float32 or uint16 (float16 bits, converted by the caller).
    out : T[n, w]
        Overwritten. Each ``i`` writes only ``out[i]`` (no races).

    Returns
    -------
    int
        Number of occurrences found in the bundle.
    """
    mask = np.uint64(len(slots) - 1)
    w = values.shape[1]
    hits = 0
    for i in prange(len(keys)):
        r = _probe(keys[i], _fmix64(keys[i]) & mask, slots, mask)
        if r >= 0:
            for c in range(w):
                out[i, c] = values[r, c]
            hits += 1
        else:
            for c in range(w):
                out[i, c] = 0
    return hits


def half_table() -> np.ndarray:
    """float32[65536]: the value of every float16 bit pattern (exact), indexed by its uint16 bits."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# keys per block of the fixed-cell lookup: the block's index lines, then its rows, are requested
# before any is read, so their memory latencies overlap (see sparse_tables._kernels.prefetch_homes)
FIXED_BLOCK = 2048


@njit(cache=True, nogil=True, parallel=True)
def lookup_pool_fixed(keys, num_slots, slots, values, half_values, out, rows_scratch):
    """Fused lookup + pooling for inputs with exactly one key per (example, slot) cell (Criteo's shape).

    ``out[b, s*w + c] = values[row(keys[b*S + s]), c]`` as float32, zeros where the key is unknown (as the
    trainer's inference pull). Equal to :func:`lookup_gather` followed by ``models`` ``pool_sum`` with
    ``cells = arange(B*S)``, without materializing the ``[B*S, w]`` gathered rows.

    Parameters
    ----------
    keys : uint64[B*S]
        One key per cell, example-major (``keys[b*S + s]``).
    num_slots : int
        ``S``.
    slots : uint64[cap, 2]
        The index (module docstring).
    values : float32[N, w] or uint16[N, w]
        The bundle's rows; uint16 holds float16 bits.
    half_values : float32[65536] or float32[0]
        For uint16 ``values``: :func:`half_table` (float16 bits -> float32, exact); else empty.
    out : float32[B, >= S*w]
        Written in columns ``0 .. S*w - 1`` (may be a strided view, e.g. the model's input buffer).
    rows_scratch : int64[B*S]
        Overwritten (row of each key occurrence, -1 if unknown).

    Returns
    -------
    int
        Occurrences found in the bundle.

    Notes
    -----
    Parallel over blocks of ``FIXED_BLOCK`` occurrences; each block writes only its own cells' output
    columns and its own slice of ``rows_scratch`` (no races). Per block: hash and prefetch every home slot,
    then probe and prefetch every found row, then copy.
    """
    S = num_slots
    w = values.shape[1]
    n = len(keys)
    flat = keys
    mask = np.uint64(len(slots) - 1)
    nblocks = (n + FIXED_BLOCK - 1) // FIXED_BLOCK
    hits = 0
    for blk in prange(nblocks):
        lo = blk * FIXED_BLOCK
        hi = min(n, lo + FIXED_BLOCK)
        for i in range(lo, hi):
            h = _fmix64(flat[i]) & mask
            rows_scratch[i] = np.int64(h)
            prefetch(slots, h)
        found = 0
        for i in range(lo, hi):
            r = _probe(flat[i], np.uint64(rows_scratch[i]), slots, mask)
            rows_scratch[i] = r
            if r >= 0:
                prefetch(values, r)
                found += 1
        hits += found
        for i in range(lo, hi):
            b = i // S
            c0 = (i - b * S) * w
            r = rows_scratch[i]
            if r >= 0:
                if len(half_values):
                    for c in range(w):
                        out[b, c0 + c] = half_values[np.int64(values[r, c])]  # (types for float32 too)
                else:
                    for c in range(w):
                        out[b, c0 + c] = values[r, c]
            else:
                for c in range(w):
                    out[b, c0 + c] = 0.0
    return hits
