"""The client names a server keeps for ``Health`` (``writers``, ``clients``), bounded.

A name is a request id's part before ``@`` (``PSClient.name``: ``worker{rank}`` for a job's workers, the
launcher's ``launcher``, ``{host}/{pid}`` for any other process). A server kept every name it ever saw in
a generation (``clients``) or since its last load (``writers``): a server serving for months, read by
short-lived tools each with its own name, grew both sets, and every ``Health`` reply with them (23 bytes a
name: 3,000 tools made a 70 KB reply, a liveness probe's every second).

``RecentNames`` keeps at most ``cap`` names, the most recently seen (every request touches its sender's
name, so a job's running workers are never the ones dropped; a name is dropped only after ``cap`` other
names were seen since its last request). What a dropped name costs: a starting worker looks for its own
name to learn that an earlier incarnation of it took part (``engine.roles._took_part``); a dropped name
could hide that. So ``dropped`` counts the names dropped since the last ``clear()`` (a load, a fence), and
``Health`` reports it (``writers_dropped``, ``clients_dropped``): a starting worker that sees either above
0 cannot tell it did not take part and rolls the job back to its newest checkpoint, as for a restarted
worker (never training data twice; at worst one needless roll-back). Paddle's PS keeps no such table (its
workers are told their role by the launcher); this one is bounded the way ``dedup.ReplyWindow``'s id
record is (count-bounded, oldest out).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["MAX_NAMES", "RecentNames"]

#: the most names a server keeps in ``writers`` and in ``clients`` each (``PSServer.from_config`` keeps
#: at least 4 a worker: a job's own workers' names dropped would make every start roll back)
MAX_NAMES = 4096


class RecentNames:
    """A set of at most ``cap`` names (default ``MAX_NAMES``), the most recently added (``add`` of a
    present name refreshes it).

    ``dropped``: names dropped to stay within ``cap`` since the last ``clear()``.
    """

    def __init__(self, cap: int | None = None):
        cap = MAX_NAMES if cap is None else cap
        if cap < 1:
            raise ValueError(f"cap: at least 1 name, got {cap}")
        self.cap = int(cap)
        self.dropped = 0
        self._names: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        with self._lock:
            if name in self._names:
                self._names.move_to_end(name)
                return
            self._names[name] = None
            while len(self._names) > self.cap:
                self._names.popitem(last=False)
                self.dropped += 1

    def clear(self) -> None:
        with self._lock:
            self._names.clear()
            self.dropped = 0

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def sorted(self) -> list[str]:
        """The names kept, sorted (``Health``)."""
        with self._lock:
            return sorted(self._names)
