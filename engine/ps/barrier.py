"""Barriers whose waiting costs no server thread: arrive, then poll.

A caller arrives at barrier ``name`` with a token (its request id) and gets an answer at once; until
the reply says ``released`` it sends the same request again (a poll). The token makes an arrival
idempotent: a retried or repeated arrival is never counted twice. The last of ``world`` arrivals opens
the barrier (after running ``on_open``, e.g. the sync-mode apply) and bumps its generation; every
token of that generation is then answered ``released``.

A gRPC server has a fixed pool of RPC threads (``cluster.server_threads``). Today's waiters each held
one until the barrier opened, so with more callers than threads nobody else could arrive. Here a poll
may linger on the server for at most ``linger_s`` (to release a waiter the moment the barrier opens,
as a blocking barrier would), and only while fewer than ``max_lingering`` calls linger: the rest are
answered at once and poll again after a short back-off. With ``max_lingering`` at most half the RPC
threads, arrivals and other requests always find a free thread.

Bounds: a waiter's arrival is withdrawn after ``min(timeout_s, max_wait_s)`` seconds (its next poll
fails DEADLINE_EXCEEDED), an arrival not polled for ``lease_s`` seconds (a dead caller) is dropped, and
a barrier nobody waits at for ``prune_after_s`` seconds is forgotten (names with a tag per evaluation
or partition would otherwise pile up in a job that runs for weeks). The forgetting runs every 1024
calls and at least once a minute, and drops the arrivals nobody polls any more first (an arrival never
polled again kept its barrier for ever). A name has at most ``MAX_NAME_CHARS`` characters, and a server
holds at most ``MAX_BARRIERS`` barriers. When they are all held, the ones nobody waits at that were
last used ``lease_s`` ago are forgotten at once (the online job uses four per hourly partition: catching
up on more than 1,024 small hours within ``prune_after_s`` was refused, and the job restarted); a
caller released by one of them polls again within ``lease_s`` or is counted gone anyway. Only a new
barrier beyond ``MAX_BARRIERS`` all used within ``lease_s`` is refused (FAILED_PRECONDITION).

Every one of these times runs on the server's awake time (``engine.awake``), not its monotonic clock:
a server stopped or frozen (SIGSTOP, a frozen cgroup, a swapping host) past ``lease_s`` while callers
waited found, the moment it ran again, every arrival unpolled for longer than the lease and withdrew it
before the callers' polls could land. A caller that polls arrives again under the same token, so the
sync barriers still counted right (the real job of tests/integration/test_server_freeze_barrier.py);
but an arrival nobody polls (``PSClient.arrive``: the workers' "seen" at the job's end) was lost, and
its meeting waited out its timeout.

Generations: ``reset(generation)`` (a restore or a fence of the server) forgets every barrier and
records the server's new generation; an arrival that names another one (``arrive(generation=...)``) is
refused ABORTED under the same lock. The server checks a request's generation before it calls
``arrive``, but a reset could land between that check and the arrival: with 20 workers polling, a
fence left up to 17 arrivals of the ended attempt counted in the next attempt's barrier of that name,
which then opened before all of its own callers came.

``on_open`` (the sync-mode apply) runs outside the lock that every barrier of the server shares, so
a slow apply delays only its own barrier. If it fails, the barrier's waiters are all answered ABORTED
with its error (nobody is left waiting for an opening that will not come).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from .. import awake

log = logging.getLogger(__name__)


#: the longest barrier name
MAX_NAME_CHARS = 256
#: the most barriers a server holds at once (a job uses a handful, plus one per evaluation or partition
#: for ``prune_after_s``)
MAX_BARRIERS = 4096
#: longest time between two passes that forget idle barriers, seconds
PRUNE_EVERY_S = 60.0


class BarrierError(Exception):
    """``code`` is a gRPC status code name (INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNAVAILABLE)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class BarrierReply:
    generation: int
    released: bool
    arrived: int
    waited: bool = False


@dataclass
class _State:
    world: int
    generation: int = 0
    arrived: dict = field(default_factory=dict)     # token -> [first arrival, last poll] (Barriers' clock, s)
    released: dict = field(default_factory=dict)    # token -> generation it was released at
    failed: dict = field(default_factory=dict)      # token -> message: the apply at the opening failed
    opening: bool = False                           # the last arrival is running on_open
    touched: float = 0.0                            # last arrival or opening (Barriers' clock, s)


class Barriers:
    """Every named barrier of one server.

    Parameters
    ----------
    max_wait_s : float, seconds
        Cap of any caller-given timeout (``server.max_barrier_wait_s``).
    linger_s : float, seconds
        Longest time one poll waits on the server for the release.
    max_lingering : int
        Polls allowed to linger at once (``0``: every poll is answered at once).
    lease_s : float, seconds
        An arrival not polled for this long is withdrawn (its caller is gone).
    generation : int
        The server's generation (0: none); ``reset`` sets a new one.
    clock : callable returning float seconds, optional
        The clock of every lease, timeout and idle time here: by default this process's awake time
        (``engine.awake.clock().now``), so a server stopped or frozen does not count that time against
        its callers; tests pass their own.
    """

    def __init__(self, *, max_wait_s: float = 600.0, linger_s: float = 0.5, max_lingering: int = 1 << 30,
                 lease_s: float = 30.0, prune_after_s: float = 600.0, generation: int = 0, clock=None):
        self.max_wait_s, self.linger_s = float(max_wait_s), float(linger_s)
        self.generation = int(generation)       # the server's, set by reset(): arrivals naming another are refused
        self.max_lingering, self.lease_s = int(max_lingering), float(lease_s)
        self.prune_after_s = float(prune_after_s)
        self._cond = threading.Condition()
        self._states: dict[str, _State] = {}
        self._lingering = 0
        self._stopped = False
        self._calls = 0
        self._clock = clock or awake.clock().now
        self._pruned = self._clock()

    @property
    def lingering(self) -> int:
        """Polls lingering on the server now (each holds an RPC thread until it is answered)."""
        with self._cond:
            return self._lingering

    def arrive(self, name: str, token: str, world: int, timeout_s: float, on_open=None,
               generation: int = 0) -> BarrierReply:
        """Arrive at (or poll) barrier ``name`` as ``token``. ``on_open()`` runs once, under the
        barrier's lock, when the last arrival opens it (before anyone is released). ``generation``: the
        server generation the caller expects (0: any); another than ``self.generation`` is refused.

        Raises
        ------
        BarrierError
            INVALID_ARGUMENT (world < 1, no token, a name over ``MAX_NAME_CHARS``, or a world that differs
            from the other callers'), DEADLINE_EXCEEDED (not everybody arrived within the capped timeout;
            the arrival is withdrawn), UNAVAILABLE (the server is stopping), ABORTED (``on_open`` failed),
            FAILED_PRECONDITION (a new barrier beyond ``MAX_BARRIERS``), ABORTED "generation mismatch"
            (the caller expects a generation the server left: nothing counted).
        """
        if world < 1:
            raise BarrierError("INVALID_ARGUMENT", f"world must be >= 1, got {world}")
        if len(name) > MAX_NAME_CHARS:
            raise BarrierError("INVALID_ARGUMENT", f"name: a barrier's name has at most {MAX_NAME_CHARS} "
                               f"characters, got {len(name)}")
        if not token:
            raise BarrierError("INVALID_ARGUMENT", f"barrier {name!r}: a request id is required (it is "
                               f"the arrival's token)")
        limit = min(timeout_s if timeout_s > 0 else self.max_wait_s, self.max_wait_s)
        with self._cond:
            if self._stopped:
                raise BarrierError("UNAVAILABLE", f"barrier {name!r}: server is stopping")
            if generation and self.generation and generation != self.generation:
                raise BarrierError("ABORTED", f"barrier {name!r}: generation mismatch: the request expects "
                                   f"generation {generation}, this server is at {self.generation} (it loaded a "
                                   f"checkpoint or was fenced since); the arrival was not counted")
            self._calls += 1
            now = self._clock()
            if self._calls % 1024 == 0 or now - self._pruned > PRUNE_EVERY_S:
                self._prune(now)
            st = self._states.get(name)
            if st is None:
                if len(self._states) >= MAX_BARRIERS:     # full: forget the idle ones a lease ago too
                    self._prune(now, idle_s=min(self.lease_s, self.prune_after_s))
                if len(self._states) >= MAX_BARRIERS:
                    raise BarrierError("FAILED_PRECONDITION", f"barrier {name[:200]!r}: this server holds "
                                       f"{len(self._states)} barriers, the most it keeps (engine.ps.barrier."
                                       f"MAX_BARRIERS), each used within the last {self.lease_s:g}s or "
                                       f"waited at")
                st = self._states[name] = _State(world, touched=now)
            if token in st.released:
                return BarrierReply(st.released[token], True, st.world)
            if token in st.failed:
                raise BarrierError("ABORTED", st.failed[token])
            if st.world != world:
                if st.arrived:
                    raise BarrierError("INVALID_ARGUMENT", f"barrier {name!r}: world {world} differs from "
                                       f"the {st.world} other callers use")
                st.world = world
            st.touched = now
            if not st.opening:
                self._drop_stale(name, st, now)
            times = st.arrived.get(token)
            opener = False
            if times is None:
                times = st.arrived[token] = [now, now]
                if len(st.arrived) >= st.world and not st.opening:
                    st.opening = opener = True
            times[1] = now
            if not opener:
                return self._wait(st, name, token, limit)
        return self._open(st, name, on_open)

    def _drop_stale(self, name: str, st: _State, now: float) -> None:
        stale = [(now - last, t) for t, (_, last) in st.arrived.items() if now - last > self.lease_s]
        for _, tok in stale:
            del st.arrived[tok]
        if stale:
            log.info("barrier %r: withdrew %d arrival(s) not polled for %gs (up to %.1fs; their callers are "
                     "counted gone, and counted again if they poll again), %d of %d left", name[:200],
                     len(stale), self.lease_s, max(stale)[0], len(st.arrived), st.world)

    def _prune(self, now: float, idle_s: float | None = None) -> None:
        """Drop the arrivals not polled for ``lease_s`` (their callers are gone), then forget barriers
        nobody waits at that were last used ``idle_s`` ago (default ``prune_after_s``; caller holds the
        lock)."""
        self._pruned = now
        idle_s = self.prune_after_s if idle_s is None else idle_s
        for name, st in self._states.items():
            if not st.opening:
                self._drop_stale(name, st, now)
        for name in [n for n, st in self._states.items()
                     if not st.arrived and not st.opening and now - st.touched > idle_s]:
            del self._states[name]

    def _open(self, st: _State, name: str, on_open) -> BarrierReply:
        """The last arrival: run ``on_open`` outside the lock, then release everybody (or, if it
        failed, answer everybody ABORTED with its error)."""
        try:
            if on_open is not None:
                on_open()
        except Exception as e:  # noqa: BLE001 - every waiter must learn of it
            msg = f"barrier {name!r}: the apply at the last arrival failed: {e}"
            with self._cond:
                st.opening = False
                st.failed = dict.fromkeys(st.arrived, msg)
                st.arrived = {}
                st.touched = self._clock()
                self._cond.notify_all()
            raise BarrierError("ABORTED", msg) from e
        with self._cond:
            st.opening = False
            st.touched = self._clock()
            return self._release(st)

    def _release(self, st: _State) -> BarrierReply:
        gen = st.generation
        # keep only this generation's tokens: a caller released at g cannot arrive at g + 1 before it
        # saw its release, so older tokens are never polled again
        st.released = dict.fromkeys(st.arrived, gen)
        st.arrived, st.failed = {}, {}
        st.generation += 1
        self._cond.notify_all()
        return BarrierReply(gen, True, st.world)

    def _wait(self, st: _State, name: str, token: str, limit: float) -> BarrierReply:
        """Linger for the release if allowed (caller holds the lock); enforce the caller's deadline."""
        gen = st.generation
        waited = False
        if self._lingering < self.max_lingering and self.linger_s > 0:
            self._lingering += 1
            try:
                waited = True
                self._cond.wait_for(lambda: token in st.released or token in st.failed or self._stopped
                                    or token not in st.arrived, self.linger_s)
            finally:
                self._lingering -= 1
        if token in st.released:
            return BarrierReply(st.released[token], True, st.world, waited)
        if token in st.failed:
            raise BarrierError("ABORTED", st.failed[token])
        if self._stopped:
            raise BarrierError("UNAVAILABLE", f"barrier {name!r}: server is stopping")
        times = st.arrived.get(token)
        if times is None:
            raise BarrierError("DEADLINE_EXCEEDED", f"barrier {name!r}: this arrival was withdrawn (not "
                               f"polled for {self.lease_s:g}s); arrive again")
        now = self._clock()
        times[1] = now
        if now - times[0] > limit and not st.opening:
            del st.arrived[token]
            raise BarrierError("DEADLINE_EXCEEDED", f"barrier {name!r}: only {len(st.arrived) + 1} of "
                               f"{st.world} callers arrived within {limit:g}s")
        return BarrierReply(gen, False, len(st.arrived), waited)

    def stop(self) -> None:
        """Fail every waiting and later call with UNAVAILABLE."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def reset(self, generation: int = 0) -> None:
        """Forget every barrier (a restore starts a new round of meetings: an arrival of a caller that
        died before it would otherwise count toward the next one) and serve ``generation`` from now on
        (0: keep the current one): callers of the old state are refused under this lock, so none of
        their arrivals lands in the new state after it was cleared."""
        with self._cond:
            if generation:
                self.generation = int(generation)
            self._states.clear()
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return {n: {"world": s.world, "generation": s.generation, "arrived": len(s.arrived)}
                    for n, s in self._states.items()}
