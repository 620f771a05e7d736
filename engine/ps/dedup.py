"""Exactly-once writes: the server's window of recent replies, keyed by request id.

A client retries a request whose reply it did not get (UNAVAILABLE, a dropped connection) with the same
request id. When the first attempt was applied and only its reply was lost, applying the retry again
would count the update twice (SGD with lr 1: two pushes of g give -2g instead of -g). The server
therefore remembers, for every mutating request, its outcome (the reply, or the error it raised) and
answers a repeat of the id from memory without touching a table. A retry that arrives while the first
attempt still runs waits for it and gets its outcome.

Request ids carry the client's identity and a per-process incarnation (``PSClient`` makes them
``{name}@{incarnation}:{seq}[.{part}]``), so a restarted worker never collides with its former self.

The window is bounded in bytes (a ``Step`` reply can be 16 MiB): when the replies held exceed
``max_bytes``, the oldest completed entries are dropped. A retry comes within seconds of its first
attempt, so the window only has to cover the last few requests of every client; entries in progress
are never dropped. ``clear()`` empties it (a ``Load`` replaces the tables every remembered reply was
computed from). Used by ``engine.ps.server.PSServer.handle``.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from . import codec

#: bytes charged per entry on top of its reply's arrays (id, bookkeeping), so a window of tiny replies
#: is bounded too
ENTRY_OVERHEAD_BYTES = 256


class InProgress(Exception):
    """A retry waited ``wait_s`` seconds for the first attempt of its request id, which still runs."""


class _Entry:
    __slots__ = ("done", "reply", "error", "nbytes")

    def __init__(self):
        self.done = threading.Event()
        self.reply = None
        self.error: BaseException | None = None
        self.nbytes = ENTRY_OVERHEAD_BYTES


def reply_bytes(reply) -> int:
    """Bytes a reply holds: its arrays (``codec.Wire``) or its encoded size (a protobuf message)."""
    if isinstance(reply, codec.Wire):
        if reply.encoded is not None:
            return len(reply.encoded)
        return sum(int(a.nbytes) for a in reply.arrays.values()) + reply.msg.ByteSize()
    size = getattr(reply, "ByteSize", None)
    return size() if size is not None else 0


class ReplyWindow:
    """Recent (request id -> outcome) of mutating requests, bounded in bytes.

    Parameters
    ----------
    max_bytes : int, bytes
        Replies kept (plus ``ENTRY_OVERHEAD_BYTES`` each); 0 disables deduplication.
    wait_s : float, seconds
        Longest wait of a retry for its first attempt; then ``InProgress`` (the client retries later).
    """

    def __init__(self, max_bytes: int, wait_s: float = 60.0):
        self.max_bytes, self.wait_s = int(max_bytes), float(wait_s)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0            # requests answered from the window (retries not applied again)

    def run(self, request_id: str, fn):
        """The outcome of ``fn()`` for ``request_id``, computed at most once while the id is in the
        window: returns its reply or raises its error, for the first attempt and every repeat.

        Raises
        ------
        InProgress
            The first attempt is still running after ``wait_s`` seconds.
        Exception
            Whatever ``fn`` raised (remembered and raised again for a repeat).
        """
        if self.max_bytes <= 0 or not request_id:
            return fn()
        with self._lock:
            entry = self._entries.get(request_id)
            first = entry is None
            if first:
                entry = self._entries[request_id] = _Entry()
                self._bytes += entry.nbytes
            else:
                self.hits += 1
        if not first:
            if not entry.done.wait(self.wait_s):
                raise InProgress(f"request {request_id} is still being applied after {self.wait_s:g}s")
            if entry.error is not None:
                raise entry.error
            return entry.reply
        try:
            entry.reply = fn()
        except BaseException as e:
            entry.error = e
            raise
        finally:
            extra = reply_bytes(entry.reply) if entry.reply is not None else 0
            with self._lock:
                entry.nbytes += extra
                if self._entries.get(request_id) is entry:
                    self._bytes += extra
                entry.done.set()
                self._evict()
        return entry.reply

    def _evict(self) -> None:
        """Drop the oldest completed entries while over budget (caller holds the lock)."""
        if self._bytes <= self.max_bytes:
            return
        for rid in list(self._entries):
            if self._bytes <= self.max_bytes:
                break
            e = self._entries[rid]
            if e.done.is_set():
                del self._entries[rid]
                self._bytes -= e.nbytes

    def clear(self) -> None:
        """Forget every completed entry (entries in progress stay until they finish)."""
        with self._lock:
            for rid in [r for r, e in self._entries.items() if e.done.is_set()]:
                self._bytes -= self._entries.pop(rid).nbytes

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits}
