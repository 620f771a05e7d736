"""The memory governor of a budgeted server: its RSS held to its baseline plus its tables' budgets.

``memory_bytes`` bounds the parts a table counts (RAM rows, index, RocksDB's cache and memtables, Bloom
filters, dirty keys). What the process holds beyond them and beyond its own baseline (Python, numpy,
Numba and gRPC before any table) shows only in RSS: malloc's fragments and retained free pages, request
and reply buffers, RocksDB's memory outside its cache, transient arrays of eviction passes. At 100M keys
and a 4 GB budget that was 0.2-0.5 GB, and RSS reached 1.14-1.25 times the budget.

Every ``interval_s`` the governor reads RSS and computes ``unaccounted = RSS - baseline - counted
parts`` (summed over the budgeted tables; ``MemoryBudget.counted_bytes``). Its high-water mark over the
last ``window_s`` seconds, split among the tables in proportion to their budgets, becomes each budget's
reserve when larger than the fixed one (``MemoryBudget.set_unaccounted``): the RAM tier gives up rows
(evicting to RocksDB, compacting its arena and returning the pages) until parts plus what RSS shows
beyond them fit the budget again. The high-water mark over minutes rather than the last sample keeps the
room for transients that come back (an eviction pass, a save) instead of letting the RAM tier grow
into it between them. This is the correction ClickHouse applies to its memory tracker from RSS.

The baseline is RSS after the kernel warm-up (and a ``malloc_trim``) and before the tables are made
(``engine.roles``): the "documented constant" a budgeted server's RSS has beyond ``memory_bytes``
(~0.28 GB here). Dense tables' blocks are counted as parts too (``other_bytes``).

Fault behaviour: RSS unreadable (not Linux): the governor does nothing and says so once. A budget
smaller than what RSS shows beyond the parts leaves the RAM tier at its floor (1,024 rows per shard);
the governor never evicts by itself, it only lowers the caps the next push or pull obeys.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
WINDOW_S = 600.0


def rss_bytes() -> int | None:
    """This process's resident set in bytes (``/proc/self/statm``), None where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryGovernor:
    """Feeds RSS beyond a server's counted parts back into its tables' budgets (module docstring).

    Parameters
    ----------
    budgets : callable returning a list of sparse_tables.budget.MemoryBudget
        The server's budgets now (asked every step: a base load swaps shards, keeping the budget).
    baseline_bytes : int
        RSS of the process before any table (bytes).
    interval_s, window_s : float
        Seconds between steps; seconds the high-water mark looks back.
    rss : callable returning int or None
        RSS in bytes (default ``rss_bytes``).
    other_bytes : callable returning int
        Bytes of the server's state outside any budget that the governor must not read as overhead
        (its dense tables' blocks). A server with unbudgeted sparse tables gets no governor
        (``engine.roles``): their growth would read as overhead and starve the budgeted ones.
    """

    def __init__(self, budgets, baseline_bytes: int, interval_s: float = INTERVAL_S,
                 window_s: float = WINDOW_S, rss=rss_bytes, clock=time.monotonic, other_bytes=lambda: 0):
        self._budgets, self.baseline_bytes, self._other = budgets, int(baseline_bytes), other_bytes
        self.interval_s, self.window_s = interval_s, window_s
        self._rss, self._clock = rss, clock
        self._samples: collections.deque = collections.deque()     # (time, unaccounted bytes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last = {"baseline_bytes": self.baseline_bytes, "rss_bytes": 0, "counted_bytes": 0,
                      "unaccounted_bytes": 0, "high_water_bytes": 0}

    def step(self) -> dict | None:
        """One reading: RSS, the parts, the unaccounted rest and its high-water mark, pushed into the
        budgets. Returns the figures (``stats``), None without budgets or RSS."""
        budgets = list({id(b): b for b in self._budgets() if b is not None}.values())
        rss = self._rss()
        if not budgets or rss is None:
            return None
        counted = sum(b.counted_bytes() for b in budgets) + int(self._other())
        unaccounted = max(0, rss - self.baseline_bytes - counted)
        now = self._clock()
        self._samples.append((now, unaccounted))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        high = max(v for _, v in self._samples)
        total = sum(b.budget_bytes for b in budgets)
        for b in budgets:
            b.set_unaccounted(high * b.budget_bytes // total)
        out = {"baseline_bytes": self.baseline_bytes, "rss_bytes": rss, "counted_bytes": counted,
               "unaccounted_bytes": unaccounted, "high_water_bytes": high}
        with self._lock:
            self._last = out
        return out

    def stats(self) -> dict:
        """The last step's figures (bytes): baseline, rss, counted, unaccounted, high_water."""
        with self._lock:
            return dict(self._last)

    def start(self) -> "MemoryGovernor":
        if self._rss() is None:
            log.warning("memory governor: this platform does not report RSS; the tables' budgets keep "
                        "their fixed reserve")
            return self

        def loop():
            while not self._stop.wait(self.interval_s):
                try:
                    self.step()
                except Exception:  # noqa: BLE001 - a governor must not take the server down
                    log.exception("memory governor step failed; retrying")
        self._thread = threading.Thread(target=loop, name="memory-governor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
