"""A server's own view of whether it is stuck: the requests it is handling and for how long.

A server process that lives but whose handling hangs (a deadlock, a kernel that never returns, a storage
call without a bound) still answers the health port and ``Health`` from threads of their own, so before
this neither a liveness probe (Kubernetes) nor the local launcher's watch (``ServerWatch``) saw anything
wrong: every worker's call to it timed out, each worker exited for its restart (``ShardUnavailableError``,
exit 76), found the same server again, and so on until the job's restart budget ran out.

The rule (``RequestWatchdog.stuck``), two kinds of request:

- **phases** (``Load``, ``Fence``, ``Save``, ``Shrink``, and a sync barrier's apply of the held updates)
  legitimately run long (a restore, a checkpoint write, an expiry pass over 10^8 keys: tens of seconds)
  and hold locks other requests wait behind. A phase *runs* from when it holds its lock (``running``)
  and is stuck after ``phase_bound_s``, the longest a client waits for one (``PSClient.save`` / ``load``
  / ``shrink``: 3600 s);
- **everything else** (pulls, pushes, dense steps, barriers, metrics, Stats) is stuck after
  ``request_bound_s`` (``client.timeout_s``: the deadline of a client's attempt) of its own time in
  flight. Its own time leaves out every moment a phase ran, or a table waited out a RocksDB write stall
  (``sparse_tables.waits``), up to ``EXCUSE_CAP_S`` (300 s) of each such phase or wait: the request
  may have waited behind it. The cap keeps a phase that is itself blocked (a checkpoint waiting for the
  lock of a shard whose pull hangs) from hiding the hang for the phase's hour; the longest single
  lock-holding pass measured here, an expiry pass over a 25M-row shard, took 22 s. A phase still
  waiting for its lock counts as such a request: a Load that waits for a hung pull to release the
  tables is stuck with it.

Every time is the server's awake time (``engine.awake``, ``PSServer`` passes its clock): a request in
flight while the server was stopped or frozen (SIGSTOP, a frozen cgroup, a swapping host) did not hang;
on its monotonic clock, a freeze longer than ``request_bound_s`` made every request it was handling "stuck"
the moment it ran again, until that request returned (milliseconds, in which a ``Health`` answer ends
a local launcher's attempt).

A stuck server says so in ``Health`` (``stuck``: why), which the local launcher's watch treats as a
silent server (it restarts the attempt), and its plaintext health port answers NOT_SERVING, which a
liveness probe turns into a restart (``engine.roles.run_server``). The restarted server comes back by
the recovery rule like any other.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time

#: requests that run long by design and hold locks the others wait behind
PHASES = frozenset({"Load", "Fence", "Save", "Shrink"})
#: the longest a client waits for a phase (``PSClient.save`` / ``load`` / ``shrink``' default), seconds
PHASE_BOUND_S = 3600.0
#: the most of other requests' time one phase or one write stall excuses (seconds)
EXCUSE_CAP_S = 300.0

__all__ = ["EXCUSE_CAP_S", "PHASES", "PHASE_BOUND_S", "RequestWatchdog"]


class RequestWatchdog:
    """The requests in flight in one server, for ``stuck``. ``enter`` when a request arrives, ``running``
    when a phase holds its lock, ``exit`` when it is answered or failed; ``wait_began`` / ``wait_ended``
    around a wait by design that is no request (a write stall: ``sparse_tables.waits``). Any thread:
    a request's arrival and end are one dict store or delete each, atomic under the GIL; phases and
    waits take a lock, and ``stuck`` reads copies.

    Parameters
    ----------
    request_bound_s : float, seconds, > 0
        A request other than a phase is stuck after this much of its own time (``client.timeout_s``).
    phase_bound_s : float, seconds, > 0
        A running phase is stuck after this.
    excuse_cap_s : float, seconds, > 0
        The most of other requests' time one phase or wait excuses.
    clock : callable returning float seconds, optional
        Monotonic time (default ``time.monotonic``; tests pass their own).

    Raises
    ------
    ValueError
        A bound is not positive.
    """

    def __init__(self, request_bound_s: float, phase_bound_s: float = PHASE_BOUND_S,
                 excuse_cap_s: float = EXCUSE_CAP_S, clock=time.monotonic):
        if not (request_bound_s > 0 and phase_bound_s > 0 and excuse_cap_s > 0):
            raise ValueError(f"bounds must be > 0 seconds, got request_bound_s={request_bound_s!r}, "
                             f"phase_bound_s={phase_bound_s!r}, excuse_cap_s={excuse_cap_s!r}")
        self.request_bound_s, self.phase_bound_s = float(request_bound_s), float(phase_bound_s)
        self.excuse_cap_s = float(excuse_cap_s)
        self.clock = clock
        self._requests: dict[int, tuple[float, str, str]] = {}    # token -> (arrived, method, request id)
        self._running: dict[int, float] = {}        # phase or wait token -> since when it excuses
        self._ended: collections.deque = collections.deque(maxlen=256)   # (from, to) of ended ones
        self._tokens = itertools.count()
        self._lock = threading.Lock()               # _running and _ended

    def enter(self, method: str, request_id: str = "-") -> int:
        """A request of ``method`` arrived; returns its token."""
        token = next(self._tokens)
        self._requests[token] = (self.clock(), method, request_id)
        return token

    def running(self, token: int) -> None:
        """The phase of ``token`` holds its lock: from now on it is judged by ``phase_bound_s``, and the
        time it runs (its first ``excuse_cap_s``) does not count against any other request."""
        with self._lock:
            self._running.setdefault(token, self.clock())

    def exit(self, token: int) -> None:
        """The request of ``token`` was answered or failed."""
        if token in self._running:
            self.wait_ended(token)
        self._requests.pop(token, None)

    def wait_began(self) -> int:
        """A wait by design that is no request began (a table waiting out a RocksDB write stall): its time
        (its first ``excuse_cap_s``) does not count against any request. Returns its token."""
        token = next(self._tokens)
        with self._lock:
            self._running[token] = self.clock()
        return token

    def wait_ended(self, token: int) -> None:
        """The wait (or phase) of ``token`` ended."""
        with self._lock:
            since = self._running.pop(token, None)
            if since is not None:
                self._ended.append((since, self.clock()))

    def _look(self) -> tuple[str | None, float]:
        """(why this server is stuck or None, the largest own time of a request that is not a running
        phase, 0.0 when there is none): one pass over the requests for ``stuck``, ``oldest_s``, ``state``."""
        with self._lock:
            now = self.clock()
            running = self._running.copy()
            spans = [(a, min(b, a + self.excuse_cap_s)) for a, b in self._ended]
        spans += [(a, min(now, a + self.excuse_cap_s)) for a in running.values()]
        spans.sort()
        merged: list[list[float]] = []              # their union, in order
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            elif b > a:
                merged.append([a, b])
        requests = self._requests.copy()
        own = []                                    # (own time, arrived, method, request id)
        for token, (arrived, method, rid) in requests.items():
            if token not in running:
                excused = sum(max(0.0, min(b, now) - max(a, arrived)) for a, b in merged)
                own.append(((now - arrived) - excused, arrived, method, rid))
        oldest = max([t for t, *_ in own] or [0.0])
        for token, since in sorted(running.items(), key=lambda kv: kv[1]):
            if token in requests and now - since > self.phase_bound_s:
                method, rid = requests[token][1:]
                return (f"{method} request {rid} running for {now - since:.0f}s, beyond the "
                        f"{self.phase_bound_s:g}s a client waits for it"), oldest
        late = [(arrived, method, rid) for t, arrived, method, rid in own if t > self.request_bound_s]
        if not late:
            return None, oldest
        arrived, method, rid = min(late)
        return (f"{method} request {rid} in flight for {now - arrived:.1f}s (checkpoints, restores, expiry passes "
                f"and write stalls meanwhile not counted), beyond client.timeout_s = {self.request_bound_s:g}s"), oldest

    def stuck(self) -> str | None:
        """Why this server is stuck (``Pull request worker1@77 in flight for 64.2s (...), beyond
        client.timeout_s = 60s``), or None. The oldest offending request is named."""
        return self._look()[0]

    def in_flight(self) -> int:
        """Requests being handled now."""
        return len(self._requests)

    def oldest_s(self) -> float:
        """The largest own time in flight (seconds) of a request that is not a running phase (the rule's
        count: excused time left out); 0.0 when there is none. ``stuck`` past ``request_bound_s``."""
        return self._look()[1]

    def state(self) -> dict:
        """``{"stuck": why or None, "requests_in_flight": n, "oldest_request_s": seconds}`` from one look
        (``Stats``, the Prometheus gauges)."""
        why, oldest = self._look()
        return {"stuck": why, "requests_in_flight": self.in_flight(), "oldest_request_s": oldest}
