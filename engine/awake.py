"""The time this process was awake: a judge of other processes' silence must not count its own.

A supervisor that judges a role dead after ``client.dead_after_s`` of silence measures that silence on
its monotonic clock, which runs on while the supervisor itself does not: stopped (Ctrl-Z, SIGSTOP), its
container or cgroup frozen, its host starved or swapping. Before, a launcher stopped for longer than
``dead_after_s`` and continued found every server silent and every worker's beat old the moment it ran
again, before its polls and the workers' beats could catch up, and restarted a healthy job from its last
checkpoint. ``AwakeClock`` notices its own gaps (a ticker thread that did not run for ``stall_s``) and
``age`` leaves them out: silence is counted only while this process was there to hear.

Every time is ``time.monotonic()`` seconds, except ``now``'s: a clock of its own that runs only while
this process does, for a server's own leases and bounds (``engine.ps.barrier``, ``engine.ps.watchdog``).
One clock a process (``clock()``): a daemon thread ticking every ``TICK_S``; it remembers the last
``KEEP`` gaps.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

__all__ = ["AwakeClock", "clock", "TICK_S", "STALL_S"]

log = logging.getLogger(__name__)

#: seconds between the ticker's looks at the clock
TICK_S = 0.2
#: a gap between two looks longer than this (seconds) is time this process was not running
STALL_S = 1.0
#: a gap at least this long (seconds) is logged at WARNING, shorter ones at INFO
WARN_S = 5.0
#: gaps remembered (older ones no longer matter: an age spans at most a few ``dead_after_s``)
KEEP = 64


class AwakeClock:
    """Monotonic ages with the time this process did not run left out.

    Parameters
    ----------
    tick_s, stall_s : float, seconds
        How often the ticker looks; a gap longer than ``stall_s`` between its looks is a stall.
    start : bool
        Start the ticker thread (False: ``tick(now)`` is called by hand, for tests).
    """

    def __init__(self, tick_s: float = TICK_S, stall_s: float = STALL_S, *, start: bool = True):
        self.tick_s, self.stall_s = float(tick_s), float(stall_s)
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._slept = 0.0           # every stall recorded, seconds (``now``)
        self._now = 0.0             # ``now``'s last answer: it never goes back
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=KEEP)
        if start:
            threading.Thread(target=self._run, name="awake-clock", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            self.tick()

    def tick(self, now: float | None = None) -> None:
        """Look at the clock (the ticker does, every ``tick_s``): a gap since the last look longer than
        ``stall_s`` is recorded as a stall."""
        now = time.monotonic() if now is None else float(now)
        with self._lock:
            gap = now - self._last
            if gap > self.stall_s:
                self._stalls.append((self._last, now))
                self._slept += gap
                # a loaded machine starves the ticker for a second or two now and then (1.2 s in a CI run):
                # counted all the same, but said at WARNING only for a gap a stop or a freeze makes
                log.log(logging.WARNING if gap >= WARN_S else logging.INFO,
                        "this process did not run for %.1f s (stopped, frozen or starved): the silence of "
                        "the processes it watches, and a server's barrier leases and request bounds, do not "
                        "count that time", gap)
            self._last = max(self._last, now)

    def now(self, mono: float | None = None) -> float:
        """Seconds on a clock that runs only while this process does: ``time.monotonic()`` (or ``mono``)
        less every stall recorded and the one under way. It never goes back; after a stall it stands still
        for up to ``stall_s`` (the part of the gap before it counted as one). Compare its readings with
        each other only, never with ``time.monotonic()``."""
        mono = time.monotonic() if mono is None else float(mono)
        with self._lock:
            # a gap under way longer than stall_s is a stall from its start: this clock stopped at _last
            t = (mono if mono - self._last <= self.stall_s else self._last) - self._slept
            self._now = max(self._now, t)
            return self._now

    def asleep(self, since: float, now: float | None = None) -> float:
        """Seconds of ``[since, now]`` this process did not run: the stalls recorded, and the one under way
        (no look for longer than ``stall_s``: the ticker has not run since it resumed)."""
        now = time.monotonic() if now is None else float(now)
        with self._lock:
            spans = list(self._stalls)
            if now - self._last > self.stall_s:
                spans.append((self._last, now))
        return sum(max(0.0, min(end, now) - max(start, since)) for start, end in spans)

    def age(self, since: float, now: float | None = None) -> float:
        """Seconds from ``since`` to ``now`` (monotonic) that this process was awake for."""
        now = time.monotonic() if now is None else float(now)
        return max(0.0, now - since - self.asleep(since, now))

    def discount(self, report: dict | None, now: float) -> dict | None:
        """A progress report (``engine.progress``) whose monotonic times are moved later by the time this
        process slept since each, so ``progress.stalled(report, now, ...)`` judges ages while awake."""
        if report is None:
            return None
        out = {**report}
        for key in ("mono", "step_mono"):
            if key in out:
                t = float(out[key])
                out[key] = t + self.asleep(t, now)
        ph = out.get("phase")
        if ph and "started_mono" in ph:
            t = float(ph["started_mono"])
            out["phase"] = {**ph, "started_mono": t + self.asleep(t, now)}
        return out


_clock: AwakeClock | None = None
_clock_lock = threading.Lock()


def clock() -> AwakeClock:
    """This process's ``AwakeClock`` (started on first use)."""
    global _clock
    with _clock_lock:
        if _clock is None:
            _clock = AwakeClock()
        return _clock
