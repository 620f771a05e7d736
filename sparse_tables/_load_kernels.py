"""Kernels of a load (``SparseTable.load_rows``): the keys' order and the records of a row batch (Numba).

``key_order``: whether a batch of keys is sorted and whether it holds duplicates, in one O(n) pass.

A load (``SparseTable.load_rows``) must know whether a batch repeats a key: then the RAM path applies
the rows in order (the last one wins) and the direct write to RocksDB is skipped. Keys from a checkpoint
never repeat, and rows a spilled table dumped from RocksDB come in key order. ``np.unique`` answered
both questions by sorting every batch (O(n log n), ~0.2 us a key: 18% of a base restore into a spilling
table); it answers them with one comparison per key when the keys are sorted and one hash
probe per key otherwise, and the table then skips the unique and, for sorted keys, the sort before the
RocksDB write.

``fill_records``: the record words of a row batch's columns in one pass over the rows (replacing a
zero-filled array and six strided column copies: ~2x faster).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._kernels import U64, fmix64

SORTED_UNIQUE = 0    # strictly increasing: unique and in key order
UNIQUE = 1           # every key once, not in key order
DUPLICATES = 2       # some key more than once

_SALT = U64(0x2545F4914F6CDD1D)


def key_order(keys: np.ndarray) -> int:
    """keys : uint64[n] (contiguous) -> ``SORTED_UNIQUE``, ``UNIQUE`` or ``DUPLICATES``.

    Sorted input costs one comparison a key and no memory; otherwise an open-addressing set of positions
    (int32[2^k >= 2n], 0: empty) finds a repeated key at its first repetition. Batches of 2^30 keys and
    more (positions past int32) are answered by ``np.unique``.
    """
    if len(keys) >= 1 << 30:
        if bool(np.all(keys[1:] > keys[:-1])):
            return SORTED_UNIQUE
        return UNIQUE if len(np.unique(keys)) == len(keys) else DUPLICATES
    return int(_key_order(keys))


@njit(nogil=True, cache=True)
def _key_order(keys):
    n = keys.shape[0]
    i = 1
    while i < n and keys[i - 1] < keys[i]:
        i += 1
    if i >= n:
        return SORTED_UNIQUE
    size = 16
    while size < 2 * n:
        size *= 2
    mask = U64(size - 1)
    slots = np.zeros(size, np.int32)      # position + 1 of the key held there
    for j in range(n):
        k = keys[j]
        s = fmix64(k ^ _SALT) & mask
        while True:
            p = slots[s]
            if p == 0:
                slots[s] = j + 1
                break
            if keys[p - 1] == k:
                return DUPLICATES
            s = (s + U64(1)) & mask
    return UNIQUE


@njit(nogil=True, cache=True)
def fill_records(rec, keys, values, state, show, click, seen, off_values, off_state, off_meta):
    """rec[i] = the record of row i (key words, values, state, show, click, last_seen; tick and flags 0).

    rec : uint32[m, stride] (written whole); keys : uint64[m]; values : uint32[m, dim] and
    state : uint32[m, state_width] (float32 bits); show, click, seen : uint32[m] (show and click as
    float32 bits); off_* : word offsets of the sections (``RowLayout``).
    """
    dim = values.shape[1]
    sw = state.shape[1]
    for i in range(rec.shape[0]):
        k = keys[i]
        rec[i, 0] = np.uint32(k & U64(0xFFFFFFFF))      # little-endian: the low word first
        rec[i, 1] = np.uint32(k >> U64(32))
        for j in range(dim):
            rec[i, off_values + j] = values[i, j]
        for j in range(sw):
            rec[i, off_state + j] = state[i, j]
        rec[i, off_meta] = show[i]
        rec[i, off_meta + 1] = click[i]
        rec[i, off_meta + 2] = seen[i]
        rec[i, off_meta + 3] = 0
        rec[i, off_meta + 4] = 0
