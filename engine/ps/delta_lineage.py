"""What a server's changes are counted from: the checkpoint a delta saved now would continue.

A delta holds the rows a shard changed since its dirty state was last cleared (``dirty_dump``), and
every Save clears it. So a server's dirty state continues exactly one checkpoint: the one it last
wrote its parts of, or last loaded. A delta whose manifest names another parent would be published
without the rows that went into the checkpoint the server really continues, and its chain would
restore a table that never existed. That happens when two coordinators save on the same servers: a
zombie rank 0 whose Save ran (parts written, dirty state cleared) while a new coordinator took over,
or a save that failed on some servers after the others cleared theirs.

So every delta Save names its parent (``ps.proto``: ``PathRequest.parent``) and a server refuses it
(FAILED_PRECONDITION "delta parent mismatch", nothing written, nothing cleared) unless its state
continues that parent; the coordinator then writes a base (``engine.checkpoint.CheckpointManager``).
The rule is the server's, so it holds whichever process coordinates and however many do.

``DeltaLineage`` keeps that one fact per server:

- a fresh server, a clearing Fence, a failed Save or a failed Load: none (only a base is accepted);
- a Save whose parts all were written: that checkpoint (published or not: its dirty state is gone);
- a Load: that checkpoint (``Load`` replaces or advances the tables and clears the dirty state).

A Fence that keeps the tables keeps the lineage: the tables still descend from it.

Locations are compared as written by the coordinator, normalized (``key``): a local path made absolute,
``file://`` dropped, trailing ``/`` dropped.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from ..errors import DeltaParentError
from .hosts import HostError

__all__ = ["DeltaLineage", "key"]


def key(uri: str) -> str:
    """``uri`` normalized for comparison: ``file://`` dropped, a local path made absolute and normal,
    a trailing ``/`` dropped (``s3://b/ckpt/job/20240101/0100-base``, ``/abs/ckpt/...``)."""
    u = uri.strip()
    if u.startswith("file://"):
        u = u[len("file://"):]
    if "://" not in u:
        return os.path.normpath(os.path.abspath(u))
    return u.rstrip("/")


class DeltaLineage:
    """The checkpoint one server's dirty state continues (module docstring).

    Parameters
    ----------
    server : int
        The server's index, for messages.
    """

    def __init__(self, server: int = 0):
        self.server = server
        self._from: str | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def saving(self, kind: str, uri: str, parent: str) -> Iterator[None]:
        """Around one Save of checkpoint ``uri`` (``kind`` "base" or "delta"; ``parent``: the delta's
        parent location as the coordinator names it, "" for a base). Saves run one at a time.

        Raises
        ------
        HostError
            FAILED_PRECONDITION "delta parent mismatch" for a delta whose parent is not what this
            server's state continues; raised before anything is written or cleared.
        """
        with self._lock:
            if kind == "delta":
                want = key(parent) if parent else None
                if want is None or want != self._from:
                    have = self._from or ("nothing: it started, was emptied, or a save or load failed "
                                          "on it since")
                    raise HostError("FAILED_PRECONDITION", (
                        f"{DeltaParentError.MARKER}: server {self.server}: delta {uri} names parent {parent or '(none)'}, "
                        f"but this server's changes are counted from {have} (another coordinator saved "
                        f"or loaded since, or this server restarted); nothing was written or cleared: "
                        f"write a base"))
            self._from = None           # a failure half-way leaves shards cleared: only a base after it
            yield
            self._from = key(uri)

    def loaded(self, uri: str | None) -> None:
        """After a Load of ``uri`` (None: a Load that failed, or a clearing Fence)."""
        with self._lock:
            self._from = key(uri) if uri else None
