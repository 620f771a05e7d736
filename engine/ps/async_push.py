"""The async push queue of ``PSClient.push_async`` (Paddle's async communicator): a background sender
takes queued pushes from a bounded queue, merges everything queued for a table (duplicate keys summed
by the push itself) and sends one push per table.

Failures are not lost: the first failed send is kept and re-raised by the next ``put`` or ``flush``;
pushes queued after it are dropped (the job fails anyway) and ``flush`` says so by raising.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np

from ..errors import PSTimeoutError
from ._arrays import concat_pushes

log = logging.getLogger(__name__)


class AsyncPusher:
    """Background sender over ``push(table, keys, grads, shows=, clicks=)``.

    Parameters
    ----------
    push : callable
        The synchronous push (``PSClient.push``).
    capacity : int
        Queued pushes before ``put`` blocks.
    timeout_s : float, seconds
        Longest ``put`` wait on a full queue, and of ``close``.
    """

    def __init__(self, push, capacity: int, timeout_s: float):
        self._push, self.timeout_s = push, float(timeout_s)
        self._queue: queue.Queue = queue.Queue(capacity)
        self._error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name="ps-async-push", daemon=True)
        self._sender.start()

    def put(self, table: str, keys: np.ndarray, grads: np.ndarray, shows, clicks) -> None:
        """Queue copies of the arrays (validated by the caller).

        Raises
        ------
        PSTimeoutError
            The queue stayed full for ``timeout_s``.
        """
        item = (table, keys.copy(), grads.copy(), None if shows is None else shows.copy(),
                None if clicks is None else clicks.copy())
        try:
            self._queue.put(item, timeout=self.timeout_s)
        except queue.Full:
            raise PSTimeoutError("DEADLINE_EXCEEDED", f"async push queue stayed full for {self.timeout_s}s") from None

    def _send_loop(self) -> None:
        q = self._queue
        while True:
            first = q.get()
            if first is None:
                q.task_done()
                return
            items = [first]
            while True:   # merge whatever else is queued
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                items.append(nxt)
            stop = items[-1] is None
            if stop:
                items.pop()
            try:
                for table in dict.fromkeys(it[0] for it in items):
                    keys, grads, shows, clicks = concat_pushes([it[1:] for it in items if it[0] == table])
                    if self._error is None:
                        self._push(table, keys, grads, shows=shows, clicks=clicks)
            except BaseException as e:  # noqa: BLE001 - surfaced by flush()/put()
                log.error("async push failed: %s", e)
                self._error = e
            finally:
                for _ in range(len(items) + (1 if stop else 0)):
                    q.task_done()
            if stop:
                return

    def flush(self, limit_s: float) -> None:
        """Wait until every queued push was sent; re-raise a failed send.

        Raises
        ------
        PSTimeoutError
            The queue did not drain within ``limit_s`` seconds.
        """
        deadline = time.monotonic() + limit_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise PSTimeoutError("DEADLINE_EXCEEDED", f"flush: queued pushes not sent within {limit_s}s")
            time.sleep(0.001)
        self.raise_error()

    def raise_error(self) -> None:
        """Re-raise (once) the error of a failed background send."""
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self) -> None:
        """Stop the sender after what is queued (call ``flush`` first to see errors)."""
        self._queue.put(None, timeout=self.timeout_s)
        self._sender.join(timeout=self.timeout_s)
