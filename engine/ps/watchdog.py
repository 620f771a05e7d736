"""A server's own view of whether it is stuck: the requests it is handling and for how long.

A server process that lives but whose handling hangs (a deadlock, a kernel that never returns, a storage
call without a bound) still answers the health port and ``Health`` from threads of their own, so before
this neither a liveness probe (Kubernetes) nor the local launcher's watch (``ServerWatch``) saw anything
wrong: every worker's call to it timed out, each worker exited for its restart (``ShardUnavailableError``,
exit 76), found the same server again, and so on until the job's restart budget ran out.

The rule (``RequestWatchdog.stuck``), two kinds of request:

- **phases** (``Load``, ``Fence``, ``Save``, ``Shrink``) legitimately run long (a restore, a checkpoint
  write, an expiry pass over 10^8 keys: tens of seconds) and hold locks other requests wait behind. A
  phase *runs* from when it holds its lock (``running``) and is stuck after ``phase_bound_s``, the longest
  a client waits for one (``PSClient.save`` / ``load`` / ``shrink``: 3600 s);
- **everything else** (pulls, pushes, dense steps, barriers, metrics, Stats) is stuck after
  ``request_bound_s`` (``client.timeout_s``: the longest a client waits for one answer) of its own time
  in flight, which leaves out every moment a phase ran (it may have waited behind that phase's lock).
  A phase still waiting for its lock counts as such a request: a Load that waits for a hung pull to
  release the tables is stuck with it, and a checkpoint written meanwhile does not hide the hung pull.

A stuck server says so in ``Health`` (``stuck``: why), which the local launcher's watch treats as a
silent server (it restarts the attempt), and its plaintext health port answers NOT_SERVING, which a
liveness probe turns into a restart (``engine.roles.run_server``). The restarted server comes back by
the recovery rule like any other.
"""
from __future__ import annotations

import itertools
import threading
import time

#: requests that run long by design and hold locks the others wait behind
PHASES = frozenset({"Load", "Fence", "Save", "Shrink"})
#: the longest a client waits for a phase (``PSClient.save`` / ``load`` / ``shrink``' default), seconds
PHASE_BOUND_S = 3600.0

__all__ = ["PHASES", "PHASE_BOUND_S", "RequestWatchdog"]


class RequestWatchdog:
    """The requests in flight in one server, for ``stuck``. ``enter`` when a request arrives, ``running``
    when a phase holds its lock, ``exit`` when it is answered or failed (any thread: one dict store or
    delete each, atomic under the GIL, and ``stuck`` reads a copy; the phase clock has a lock, taken
    by data requests only to read it at arrival).

    Parameters
    ----------
    request_bound_s : float, seconds, > 0
        A request other than a phase is stuck after this (``client.timeout_s``).
    phase_bound_s : float, seconds, > 0
        A running phase is stuck after this.
    clock : callable returning float seconds, optional
        Monotonic time (default ``time.monotonic``; tests pass their own).

    Raises
    ------
    ValueError
        A bound is not positive.
    """

    def __init__(self, request_bound_s: float, phase_bound_s: float = PHASE_BOUND_S, clock=time.monotonic):
        if not (request_bound_s > 0 and phase_bound_s > 0):
            raise ValueError(f"bounds must be > 0 seconds, got request_bound_s={request_bound_s!r}, "
                             f"phase_bound_s={phase_bound_s!r}")
        self.request_bound_s, self.phase_bound_s = float(request_bound_s), float(phase_bound_s)
        self.clock = clock
        # token -> (arrived, phase time at arrival, method, request id)
        self._requests: dict[int, tuple[float, float, str, str]] = {}
        self._running: dict[int, float] = {}        # phase token -> when it took its lock
        self._tokens = itertools.count()
        self._lock = threading.Lock()               # the phase clock (phases are few: their calls only)
        self._phase_total = 0.0                     # seconds during which some phase ran, until _phase_since
        self._phase_since = 0.0                     # since when phases run (while _running is not empty)

    def _phase_time(self, now: float) -> float:
        """Seconds during which at least one phase ran, up to ``now`` (under ``_lock``)."""
        return self._phase_total + (now - self._phase_since if self._running else 0.0)

    def enter(self, method: str, request_id: str = "-") -> int:
        """A request of ``method`` arrived; returns its token."""
        token = next(self._tokens)
        now = self.clock()
        with self._lock:
            phase = self._phase_time(now)
        self._requests[token] = (now, phase, method, request_id)
        return token

    def running(self, token: int) -> None:
        """The phase of ``token`` holds its lock: from now on it is judged by ``phase_bound_s``, and the
        time it runs does not count against any other request."""
        with self._lock:
            now = self.clock()
            if not self._running:
                self._phase_since = now
            self._running[token] = now

    def exit(self, token: int) -> None:
        """The request of ``token`` was answered or failed."""
        if token in self._running:
            with self._lock:
                now = self.clock()
                if self._running.pop(token, None) is not None and not self._running:
                    self._phase_total += now - self._phase_since
        self._requests.pop(token, None)

    def stuck(self) -> str | None:
        """Why this server is stuck (``Pull request worker1@77 in flight for 64s, beyond client.timeout_s
        = 60s``), or None. The oldest offending request is named."""
        with self._lock:
            now = self.clock()
            phase = self._phase_time(now)
            running = self._running.copy()
        requests = self._requests.copy()
        if running:
            token, since = min(running.items(), key=lambda kv: kv[1])
            if now - since > self.phase_bound_s and token in requests:
                method, rid = requests[token][2:]
                return (f"{method} request {rid} running for {now - since:.0f}s, beyond the "
                        f"{self.phase_bound_s:g}s a client waits for it")
        late = [(arrived, method, rid) for token, (arrived, at, method, rid) in requests.items()
                if token not in running and (now - arrived) - (phase - at) > self.request_bound_s]
        if not late:
            return None
        arrived, method, rid = min(late)
        return (f"{method} request {rid} in flight for {now - arrived:.1f}s (not counting checkpoints, restores "
                f"and expiry passes meanwhile), beyond client.timeout_s = {self.request_bound_s:g}s")

    def in_flight(self) -> int:
        """Requests being handled now."""
        return len(self._requests)
