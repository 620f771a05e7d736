"""The compactions that follow bulk loads, one store at a time in a process.

A base restore loads each shard's RocksDB with auto compaction off (``SpillStore.bulk``): its rows land
in level 0 as many overlapping files, each spanning the whole key range (hashed keys). The catch-up
compaction that follows moves a shard's level 0 into the base level as one compaction: RocksDB's
leveled picker takes every level-0 file that is not being compacted (they all overlap), and a
compaction deletes its inputs only when it ends, so while it runs the shard's rows are on disk twice.
When every shard of a server caught up at once, as RocksDB's shared background threads let them (3
compaction threads here), a server's disk held up to ``1 + k / shards`` times its rows with ``k``
merging at once: scale_bench,
100M keys, 4 shards, leveled: 11.8 GB for 73.4M rows on disk (8.5 GB), 1.39x, the largest of the run
and what ``engine plan`` sized disk by. Taken one at a time, the peak is at most one shard's rows over
the live bytes, ``1 + 1 / shards``: the same bench after this change held 9.1 GB (1.02x) in the traffic
after the restore and 8.4 GB (0.98x) in the chain restore, against 11.8 and 11.5 GB before; its largest
figure was then the base save's, 1.13x (bench/results/scale_catch_up_100m_2026-11-28.jsonl).

``CatchUpQueue`` is that order: a store whose load ended with level 0 over its slowdown trigger is
submitted; one daemon thread resumes the stores' compaction in submission order, each once the one
before it has caught up (``SpillStore.catch_up_poll`` says when), and exits when the queue is empty.
A store waiting its turn keeps compaction off and its raised level-0 triggers: its reads probe every
level-0 file's filter meanwhile (pinned in the block cache), and a store that piles up level 0 to the
raised slowdown trigger turns compaction back on by itself (``SpillStore._write``). None waits with
compaction off for longer than ``spill.BULK_SETTLE_S`` after its load ended, however many stores are
ahead of it (``catch_up_poll`` settles a late one at once, and the next one starts). A store is cancelled (``cancel``) when a new load starts or it closes; cancelling the
store being caught up waits until the thread has let go of it.
"""
from __future__ import annotations

import collections
import logging
import threading

log = logging.getLogger(__name__)

POLL_S = 0.5           # how often the thread asks the store being caught up whether it is done


class CatchUpQueue:
    """Stores whose bulk load ended with compaction off, caught up one at a time (module docstring).

    A store here offers ``catch_up_start()`` (compaction on), ``catch_up_poll() -> bool`` (True:
    caught up, its write-stall triggers are back) and ``catch_up_failed(exc)`` (either of those raised:
    the store records and logs it; the queue goes on with the next store). All are called from this
    queue's thread, under the queue's lock, so ``cancel`` never returns while one runs.
    """

    def __init__(self, poll_s: float = POLL_S):
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: collections.deque = collections.deque()
        self._current = None
        self._thread: threading.Thread | None = None

    def submit(self, store) -> None:
        """Queue ``store`` (it is caught up after every store submitted before it)."""
        with self._lock:
            if store is self._current or store in self._waiting:
                return
            self._waiting.append(store)
            if self._thread is None:
                self._start_thread()

    def _start_thread(self) -> None:
        """The queue's thread (lock held)."""
        self._thread = threading.Thread(target=self._run, name="spill-catch-up", daemon=True)
        self._thread.start()

    def cancel(self, store) -> None:
        """Take ``store`` out (waiting, or being caught up: the thread lets go of it and moves on)."""
        with self._lock:
            if store is self._current:
                self._current = None
                self._wake.set()
            elif store in self._waiting:
                self._waiting.remove(store)

    def queued(self, store) -> bool:
        """True while ``store`` waits or is being caught up."""
        with self._lock:
            return store is self._current or store in self._waiting

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        finally:
            with self._lock:               # also when a turn raised: the next submit starts a thread
                self._thread = None
                self._current = None
                if self._waiting:
                    self._start_thread()

    def _turn(self) -> bool:
        """Catch the next store up; False when none waits (the thread ends)."""
        with self._lock:
            if not self._waiting:
                return False
            store = self._current = self._waiting.popleft()
            self._wake.clear()
            try:
                store.catch_up_start()
            except Exception as e:   # SpillError: the store keeps it and says so; the next one goes on
                store.catch_up_failed(e)
                self._current = None
                return True
        while True:
            self._wake.wait(self.poll_s)
            with self._lock:
                if self._current is not store:         # cancelled
                    return True
                try:
                    done = store.catch_up_poll()
                except Exception as e:
                    store.catch_up_failed(e)
                    done = True
                if done:
                    self._current = None
                    return True


CATCH_UP = CatchUpQueue()
