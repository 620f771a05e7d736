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
``max_bytes``, the oldest completed entries leave it, but their request ids are not forgotten: a
count-bounded record (``max_ids``) keeps every evicted id with its outcome when that is small (an
error, a count; a protobuf reply serialized, ~330 bytes of RSS an id in all: ~90 MB at 2^18 ids) and a
mark "applied, reply dropped" otherwise. A repeat of such an id is never applied
again: ``run`` calls ``replay()``, which answers from the current tables without changing them (the
server re-reads the rows or parameters a ``Step`` or a push with values would have returned; they may
include later updates, as an async reply may anyway). Entries in progress are never dropped. Stored
errors keep their message only (no traceback, so no request arrays stay alive). ``clear()`` empties
it (a ``Load`` replaces the tables every remembered reply was computed from). Used by
``engine.ps.server.PSServer.handle``.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from google.protobuf.message import Message

from . import codec

#: bytes charged per entry on top of its reply's arrays (id, bookkeeping), so a window of tiny replies
#: is bounded too: what a completed entry of a push's reply costs the server (measured: ~700 bytes of
#: RSS each, id, entry, the dict's slot and the reply message; 256 were charged, with a 1.2 KB Event
#: kept per entry: 64 MiB of window held ~500 MB)
ENTRY_OVERHEAD_BYTES = 640
#: an evicted reply up to this size stays in the id record (it costs no more than the id itself)
SMALL_REPLY_BYTES = 1024
#: the id record's mark for an applied request whose (large) reply was dropped
DROPPED = object()
#: a completed entry's ``done``: its own Event (1.2 KB, more than the rest of a small entry) goes once
#: set, and every completed entry shares this one
_DONE = threading.Event()
_DONE.set()


class _Packed:
    """A small protobuf reply in the id record, serialized: ~60 bytes instead of ~500 for the message
    object (the record holds up to ``max_ids``, 2^18, of them: ~190 MB became ~90 MB). A repeat gets a
    copy parsed from it."""

    __slots__ = ("cls", "data")

    def __init__(self, msg):
        self.cls, self.data = type(msg), msg.SerializeToString()

    def unpack(self):
        return self.cls.FromString(self.data)


class InProgress(Exception):
    """A retry waited ``wait_s`` seconds for the first attempt of its request id, which still runs."""


class Expired(Exception):
    """A repeat of a request that was applied, whose reply was dropped and cannot be replayed."""


_MISSING = object()


def _bare(e: BaseException) -> BaseException:
    """A copy of ``e`` (same type, message and attributes) without traceback or chained exceptions:
    a remembered error must not keep the frames (and with them the request's arrays) of the attempt
    that raised it alive. ``e`` itself propagates with its traceback."""
    cls = type(e)
    c = cls.__new__(cls, *e.args)       # no __init__: exception classes take different arguments
    c.args = e.args
    c.__dict__.update(e.__dict__)
    c.__traceback__ = None
    c.__context__ = c.__cause__ = None
    return c


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

    def __init__(self, max_bytes: int, wait_s: float = 60.0, max_ids: int = 1 << 18):
        self.max_bytes, self.wait_s, self.max_ids = int(max_bytes), float(wait_s), int(max_ids)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._evicted: OrderedDict[str, object] = OrderedDict()   # id -> small reply, error or DROPPED
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0            # requests answered from the window (retries not applied again)
        self.replays = 0         # of them, answered by replay() (their reply had been dropped)

    def run(self, request_id: str, fn, replay=None):
        """The outcome of ``fn()`` for ``request_id``, computed at most once while the id is in the
        window or its record: returns its reply or raises its error, for the first attempt and every
        repeat. A repeat whose reply was dropped gets ``replay()`` (read-only), or, without one,
        ``Expired``.

        Raises
        ------
        InProgress
            The first attempt is still running after ``wait_s`` seconds.
        Expired
            The request was applied, its reply dropped, and no ``replay`` was given.
        Exception
            Whatever ``fn`` raised (remembered and raised again for a repeat).
        """
        if self.max_bytes <= 0 or not request_id:
            return fn()
        with self._lock:
            entry = self._entries.get(request_id)
            first = entry is None
            old = self._evicted.get(request_id, _MISSING) if first else _MISSING
            if old is not _MISSING:
                self.hits += 1
            elif first:
                entry = self._entries[request_id] = _Entry()
                self._bytes += entry.nbytes
            else:
                self.hits += 1
        if old is not _MISSING:
            if old is DROPPED:
                if replay is None:
                    raise Expired(f"request {request_id} was applied; its reply left the reply window")
                with self._lock:
                    self.replays += 1
                return replay()
            if isinstance(old, BaseException):
                raise old
            return old.unpack() if isinstance(old, _Packed) else old
        if not first:
            if not entry.done.wait(self.wait_s):
                raise InProgress(f"request {request_id} is still being applied after {self.wait_s:g}s")
            if entry.error is not None:
                raise entry.error
            return entry.reply
        try:
            entry.reply = fn()
        except BaseException as e:
            entry.error = _bare(e)
            raise
        finally:
            extra = reply_bytes(entry.reply) if entry.reply is not None else 0
            with self._lock:
                entry.nbytes += extra
                if self._entries.get(request_id) is entry:
                    self._bytes += extra
                ev, entry.done = entry.done, _DONE     # a waiter reading ``done`` from now on finds it set
                ev.set()
                self._evict()
        return entry.reply

    def _evict(self) -> None:
        """Drop the oldest completed entries while over budget (caller holds the lock). Visits only the
        oldest entries, up to the ones it drops (copying every key first made each request of a full
        window cost O(entries): 0.4 ms at 7,000 entries, all requests waiting for the lock)."""
        over = self._bytes - self.max_bytes
        if over <= 0:
            return
        victims = []
        for rid, e in self._entries.items():        # oldest first; entries in progress stay
            if over <= 0:
                break
            if e.done.is_set():
                victims.append((rid, e))
                over -= e.nbytes
        for rid, e in victims:
            del self._entries[rid]
            self._bytes -= e.nbytes
            small = e.error is not None or e.nbytes <= ENTRY_OVERHEAD_BYTES + SMALL_REPLY_BYTES
            kept = (e.error if e.error is not None else e.reply) if small else DROPPED
            self._evicted[rid] = _Packed(kept) if isinstance(kept, Message) else kept
        while len(self._evicted) > self.max_ids:
            self._evicted.popitem(last=False)

    def clear(self) -> None:
        """Forget every completed entry (entries in progress stay until they finish)."""
        with self._lock:
            self._evicted.clear()
            for rid in [r for r, e in self._entries.items() if e.done.is_set()]:
                self._bytes -= self._entries.pop(rid).nbytes

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "evicted_ids": len(self._evicted), "hits": self.hits, "replays": self.replays}
