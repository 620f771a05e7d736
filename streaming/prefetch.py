"""A background thread that reads an iterable ahead of its consumer (``prefetch``): the sources' record
batches (``streaming.source.ArrowSource``), the Criteo conversion's parsed chunks (``streaming.criteo``)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Iterator

log = logging.getLogger(__name__)


def prefetch(iterable, depth: int, *, name: str = "prefetch", join_timeout_s: float = 30.0) -> Iterator:
    """Iterate ``iterable`` on a background thread, at most ``depth`` items ahead of the consumer.

    The producer blocks when the queue is full (the reader waits when the consumer falls behind); an
    exception raised by the producer is re-raised in the consumer; closing the returned generator (or
    dropping it) stops the producer and joins the thread.

    Parameters
    ----------
    iterable : iterable
    depth : int
        Queue size, >= 1.
    name : str
        Thread name.
    join_timeout_s : float, seconds
        How long closing waits for the producer to stop (it is a daemon thread past that).
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run():
        try:
            for item in iterable:
                if not put((True, item)):
                    return
            put((True, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put((False, exc))
        finally:
            close = getattr(iterable, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()
        deadline = time.monotonic() + join_timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                pass
        if thread.is_alive():
            log.warning("prefetch thread %s did not stop within %.0f s (blocked in a read?); leaving it "
                        "as a daemon thread", name, join_timeout_s)
