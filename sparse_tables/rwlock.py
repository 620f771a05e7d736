"""A writer-preferring readers-writer lock: many pulls at once, one writer alone."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from time import monotonic as _now   # bound here: a test that patches time.monotonic does not feed it


class RWLock:
    """Shared/exclusive lock. A waiting writer blocks new readers, so writers do not starve."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self):
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            self._release_shared()

    @contextmanager
    def exclusive(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()

    @contextmanager
    def try_shared(self, timeout_s: float = 0.0):
        """Hold the lock shared if no writer holds or awaits it within ``timeout_s`` seconds (0: no
        wait). Yields True when held (released on exit), False when not (nothing held). Never raises.
        For readers that must never wait behind a writer (``SparseTable.stats``)."""
        deadline = _now() + max(0.0, float(timeout_s))
        got = False
        with self._cond:
            while True:
                if not (self._writer or self._writers_waiting):
                    self._readers += 1
                    got = True
                    break
                left = deadline - _now()
                if left <= 0:
                    break
                self._cond.wait(left)
        try:
            yield got
        finally:
            if got:
                self._release_shared()

    def _release_shared(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()
