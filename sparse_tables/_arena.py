"""Big arrays of a table (arena, index) in their own anonymous mappings, and giving pages back."""
from __future__ import annotations

import mmap

import numpy as np

PAGE = mmap.PAGESIZE


def big_array(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array; from 1 MiB up, backed by its own anonymous mmap, so pages never
    written cost no RAM and a replaced array (after growth) goes back to the OS at once instead of
    lingering in the malloc heap. Transparent huge pages are requested."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes < (1 << 20):
        return np.empty(shape, dtype)
    # MAP_PRIVATE: mmap's default MAP_SHARED anonymous memory is shmem, which transparent huge pages
    # skip (shmem_enabled is usually "never"); the table measured 1.9x slower pushes that way
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # random row access is TLB-bound with 4 KiB pages (numpy does the same for large arrays)
        buf.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def release_from(arr: np.ndarray, start_byte: int) -> int:
    """Give the pages of ``arr`` from ``start_byte`` (rounded up to a page) to its end back to the OS
    (``MADV_DONTNEED``: they read as zeros if touched again). Only for arrays from ``big_array`` that
    own a mapping; returns the bytes released (0 for a small, heap-backed array)."""
    base = arr
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if base is None or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    start = -(-int(start_byte) // PAGE) * PAGE
    length = len(base) - start
    if length <= 0:
        return 0
    base.madvise(mmap.MADV_DONTNEED, start, length)
    return length


def pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())
