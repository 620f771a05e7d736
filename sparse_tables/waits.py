"""Waits by design inside a table, told to whoever watches the process for hangs.

A table's thread that waits out a RocksDB write stall (``spill.SpillStore._write``: up to
``STALL_TIMEOUT_S``, holding its shard's lock) is slow on purpose, not hung. A server that judges its own
requests (``engine.ps.watchdog``) registers here (``watch``) and is told when such a wait begins and
ends, so that the requests behind it are not taken for hangs. This package only announces: it imports
nothing of the engine, and with nobody watching a wait costs one list read.
"""
from __future__ import annotations

import threading

_watchers: list = []
_lock = threading.Lock()

__all__ = ["began", "ended", "unwatch", "watch"]


def watch(watcher) -> None:
    """Tell ``watcher`` of every wait from now on: ``watcher.wait_began() -> token`` when one begins,
    ``watcher.wait_ended(token)`` when it ends (any thread)."""
    with _lock:
        _watchers.append(watcher)


def unwatch(watcher) -> None:
    """Stop telling ``watcher`` (no error if it was not watching)."""
    with _lock:
        if watcher in _watchers:
            _watchers.remove(watcher)


def began() -> list:
    """A wait by design began on this thread; returns what ``ended`` needs."""
    return [(w, w.wait_began()) for w in list(_watchers)]


def ended(handles: list) -> None:
    """The wait ``began`` returned ``handles`` for ended."""
    for w, token in handles:
        w.wait_ended(token)
