"""glibc malloc settings for processes that move multi-megabyte messages (PS servers and clients).

By default glibc serves allocations above a dynamic threshold (128 KiB and up) with fresh ``mmap``
and gives freed memory back to the kernel, so every 3-6 MB pull reply (the numpy result, the bytes
handed to gRPC, gRPC's own slices) is page-faulted in again: ~4,900 minor faults and ~10 ms of
kernel time per 100k-key pull on the server, as much as the table lookup itself. ``tune()`` raises
the mmap threshold to 32 MiB (glibc's maximum) and the trim threshold to 256 MiB, so those buffers
are reused from the heap. The cost is that up to 256 MiB of freed memory per arena may stay mapped.

Set ``ENGINE_PS_MALLOC_TUNE=0`` to leave malloc alone. No-op off glibc.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
_done = False


def tune() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _done
    if _done:
        return True
    if os.environ.get("ENGINE_PS_MALLOC_TUNE", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.debug("mallopt refused the PS malloc settings")
    _done = ok
    return ok
