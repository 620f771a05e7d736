"""What the reply window (``engine.ps.dedup.ReplyWindow``) costs a server that runs for days: once full,
a request costs what it did while the window filled (each request copied every key: O(entries) under
the lock all mutating requests share), and a completed entry holds no more memory than it is charged
(each kept its own 1.2 KB Event, charged 256 bytes: the default 64 MiB window held ~500 MB)."""
from __future__ import annotations

import time
import tracemalloc

import pytest

from engine.ps import ps_pb2 as pb
from engine.ps.dedup import ENTRY_OVERHEAD_BYTES, ReplyWindow


def _run(w: ReplyWindow, first: int, n: int) -> float:
    """Seconds for ``n`` requests of small replies, ids ``first..``."""
    t = time.perf_counter()
    for i in range(first, first + n):
        rid = f"worker{i % 8}@1732950000123456789-abcdef12:{i}"
        w.run(rid, lambda: pb.Empty(request_id=rid))
    return time.perf_counter() - t


def test_a_full_window_costs_a_request_what_an_empty_one_did():
    entries = 20_000
    w = ReplyWindow(max_bytes=entries * (ENTRY_OVERHEAD_BYTES + 60), max_ids=1000)
    filling = min(_run(w, k * 1000, 1000) for k in range(3))
    _run(w, 3000, entries)                                   # full: every request now evicts one
    assert w.stats()["evicted_ids"] > 0 and w.stats()["entries"] > entries // 2, w.stats()
    full = min(_run(w, 100_000 + k * 1000, 1000) for k in range(3))
    assert full < 4 * filling, (full, filling)               # copying every key: ~20x at 20,000 entries


def test_a_completed_entry_holds_less_memory_than_it_is_charged():
    n = 5000
    w = ReplyWindow(max_bytes=1 << 30)
    replies = [pb.Empty(request_id=f"r{i}") for i in range(n)]    # allocated before: not the window's
    tracemalloc.start()
    try:
        for i in range(n):
            w.run(f"worker0@1732950000123456789-abcdef12:{i}", lambda i=i: replies[i])
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert w.stats()["entries"] == n
    assert held / n < ENTRY_OVERHEAD_BYTES, held / n


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_the_id_record_holds_small_replies_serialized_and_a_repeat_gets_the_same_reply():
    """An evicted id keeps its small reply for a repeat; the reply message object cost ~730 bytes of RSS
    an id with its key (2^18 ids: ~190 MB beside the window's budget), serialized ~330."""
    n = 100_000
    w = ReplyWindow(max_bytes=1000 * (ENTRY_OVERHEAD_BYTES + 100), max_ids=n + 10_000)
    _run(w, 0, 2000)                                         # full: every request now moves one to the record
    before = _rss()
    _run(w, 2000, n)
    per_id = (_rss() - before) / n
    assert w.stats()["evicted_ids"] > n, w.stats()
    assert per_id < 500, per_id
    rid = "worker0@1732950000123456789-abcdef12:0"           # evicted long ago: answered, not applied
    again = w.run(rid, lambda: pytest.fail("a repeat was applied again"))
    assert again == pb.Empty(request_id=rid) and w.stats()["hits"] == 1
