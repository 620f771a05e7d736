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


M_ARENA_MAX = -8
BUDGET_ARENAS = 2
BUDGET_TRIM_THRESHOLD = 64 << 20


def tune(budgeted: bool = False) -> bool:
    """Apply the settings once per process; True when they are in effect.

    ``budgeted``: a server with a table under ``memory_bytes``. Its RSS must stay within the budget
    plus a constant, so malloc gets at most ``BUDGET_ARENAS`` arenas (glibc's default is 8 per core,
    one per thread that allocates: the RPC and pull threads) and keeps at most 64 MiB of freed memory
    mapped per arena: at most 128 MiB retained instead of 256 MiB times the arenas. Measured
    (``bench/scale_bench.py --quick``, 1 GB budget): the server's largest RSS fell from 2.1x to 1.6x
    the budget with arenas bounded, the rest being the process's own baseline.

    Call it before the process starts threads (``engine.roles.run_server`` does, first thing): glibc
    fixes its arena limit the first time a thread needs a ninth arena (8 is ``arena_test``), and a later
    ``M_ARENA_MAX`` changes nothing. Called only from ``serve``, after the warm-up and RocksDB's
    background threads, it left a 100M-key server with 16 arenas and ~0.7 GB of free fragments in them.
    ``heap_stats()["arenas"]`` shows what took effect.
    """
    global _done
    if budgeted and os.environ.get("ENGINE_PS_MALLOC_TUNE", "1") != "0":
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            ok = (bool(mallopt(M_ARENA_MAX, BUDGET_ARENAS)) and bool(mallopt(M_TRIM_THRESHOLD, BUDGET_TRIM_THRESHOLD))
                  and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)))
            _done = _done or ok
            return ok
        except (OSError, AttributeError):
            return False
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


def heap_stats() -> dict | None:
    """glibc's own account of this process's malloc heap (``malloc_info``), or None off glibc.

    Returns ``{"arenas": int, "heap_bytes": int, "free_bytes": int, "in_use_bytes": int,
    "mmap_bytes": int}``: the arenas malloc made (main included), the bytes its heaps hold from the
    kernel (``system current``; resident or not), the free chunks inside them (fragments a trim cannot
    give back unless whole pages are free), heap minus free, and the bytes of chunks served by their
    own ``mmap`` (requests over the mmap threshold). The RSS a server has beyond its table's parts is
    mostly this heap: RocksDB's block cache and memtables, request buffers and their fragments.
    Takes each arena's lock briefly; for ``Stats`` and metrics scrapes, not the hot path.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not fp:
        return None
    try:
        rc = libc.malloc_info(0, fp)
    finally:
        libc.fclose(fp)                 # flushes: buf and size are valid after it
    try:
        xml = ctypes.string_at(buf, size.value).decode("ascii", "replace")
    finally:
        libc.free(ctypes.cast(buf, ctypes.c_void_p))
    if rc != 0:
        return None
    return _parse_malloc_info(xml)


def _parse_malloc_info(xml: str) -> dict | None:
    """The totals of glibc's ``malloc_info`` XML (its last ``<total>``/``<system>`` elements are the
    process's; per-heap ones come first, inside ``<heap>``)."""
    import xml.etree.ElementTree as ET
    try:
        root = ET.fromstring(xml)
    except ET.ParseError:
        return None
    totals = {t.get("type"): int(t.get("size", 0)) for t in root.findall("total")}
    system = {t.get("type"): int(t.get("size", 0)) for t in root.findall("system")}
    heap = system.get("current", 0)
    free = totals.get("fast", 0) + totals.get("rest", 0)
    return {"arenas": len(root.findall("heap")), "heap_bytes": heap, "free_bytes": free,
            "in_use_bytes": max(0, heap - free), "mmap_bytes": totals.get("mmap", 0)}


def _malloc_trim():
    """glibc's ``malloc_trim`` (argument: bytes to keep at the heap's top), None off glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


def trim_now() -> None:
    """One ``malloc_trim(0)``: free pages inside the heap go back to the OS (before a baseline reading)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


TRIM_INTERVAL_S = 2.0
_trimmer = None


def start_trimming(interval_s: float = TRIM_INTERVAL_S):
    """A daemon thread that calls glibc's ``malloc_trim(0)`` every ``interval_s`` seconds, for budgeted
    servers: it returns free pages inside the heap to the OS, which the trim threshold alone does not
    (it only shrinks the heap's top; holes left by freed request and eviction buffers stay resident).
    Returns the thread, or None off glibc or with ``ENGINE_PS_MALLOC_TUNE=0``."""
    import threading
    global _trimmer
    if os.environ.get("ENGINE_PS_MALLOC_TUNE", "1") == "0":
        return None
    if _trimmer is not None:            # one per process, however many servers it runs
        return _trimmer
    trim = _malloc_trim()
    if trim is None:
        return None
    stop = threading.Event()

    def loop():
        while not stop.wait(interval_s):
            trim(0)
    t = threading.Thread(target=loop, name="malloc-trim", daemon=True)
    t.stop = stop
    t.start()
    _trimmer = t
    return t

