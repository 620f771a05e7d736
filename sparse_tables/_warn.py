"""Rate-limited warnings shared by the shards of one table (a full table warns once per interval)."""
from __future__ import annotations

import math
import threading
import time


class WarnGate:
    """At most one warning per interval for one table name; counts what happened in between."""

    def __init__(self):
        self.lock = threading.Lock()
        self.last = -math.inf
        self.pending = 0

    def add(self, n: int, interval_s: float) -> int:
        """Count n events; returns the events to report now (0: stay quiet)."""
        now = time.monotonic()
        with self.lock:
            self.pending += n
            if now - self.last < interval_s:
                return 0
            self.last, out, self.pending = now, self.pending, 0
            return out


WARN_GATES: dict[str, WarnGate] = {}   # table name -> gate, shared by the shards of one table
WARN_GATES_LOCK = threading.Lock()
