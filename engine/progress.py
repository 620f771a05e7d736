"""A worker's liveness and progress, as its supervisor sees them: one small JSON file per worker. A
server reports too, until it is ready (``engine.roles.run_server``: it has no address to poll before),
only its beat and its start-up phase; after that its supervisor polls its ``Health``.

A worker that a launcher supervises (``ENGINE_PROGRESS_FILE`` set) reports:

- ``beat``: wall-clock seconds, rewritten every ``interval_s`` by a background thread. A frozen or dead
  process (SIGSTOP, a dead host) stops beating.
- ``step``: its training steps; the training loop must move it. A live process whose loop is stuck (a
  hang) beats but does not step.
- ``phase``: an operation announced as long, with a deadline of its own (a checkpoint write, an
  evaluation, a barrier): ``{"name", "started", "deadline_s"}``, or null while training.
- ``examples``: training examples of this process (this attempt), and ``marks``: the examples count
  at named points (``mark("0:256")`` at an aligned checkpoint meeting), so a supervisor that rolls the
  job back to a checkpoint knows how many examples were trained twice; ``last_mark``: the newest one.
- ``where``: where in the data the loop is, as the program tells (``where(epoch=1)``; an online job's
  last committed partition is its ``last_mark``), for ``engine status``, which also derives steps/s
  and examples/s from two reads of ``step`` and ``examples``.

The supervisor's rule (``stalled``): dead when the beat is older than ``dead_after_s``; hung when, in
training, the step has not moved for ``dead_after_s``, or an announced phase outlived its deadline.
Ages are measured on the writer's monotonic clock (``mono``, ``step_mono``, a phase's
``started_mono``: ``time.monotonic()``, one clock for every process of a host), so a step of the wall
clock (NTP, an operator) reads as no hang and hides none; a report read on another host (a Ray actor's
node) is moved into the reader's clock by ``rebase``. The wall-clock times stay for people
(``engine status``).

File format (written atomically: a temporary file renamed over the old one)::

    {"pid": 4242, "beat": 1764061200.5, "mono": 81200.5, "step": 1200, "step_time": 1764061200.1,
     "step_mono": 81200.1, "examples": 153600, "marks": {"0:0": 0, "0:256": 32768}, "last_mark": "0:256",
     "where": {"epoch": 0}, "phase": null}

Without ``ENGINE_PROGRESS_FILE`` (role mode under another scheduler) nothing is written; a role-mode
worker with a health port (``engine.liveness``) keeps the same report in memory and answers its
scheduler's liveness probe by the same rule.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "ENGINE_PROGRESS_FILE"
#: the most ``marks`` a report keeps, the newest: an online job marks every hourly partition, so a
#: worker running for a year rewrote 8,760 of them (~300 KB) every half second. A roll-back goes to one
#: of the job's retained checkpoints, far newer than the 1,024th mark back; a mark no longer kept only
#: makes the supervisor count every example of this attempt as trained again (``lost_examples``)
MAX_MARKS = 1024


class Progress:
    """This process's progress report.

    Parameters
    ----------
    path : str or None
        The JSON file (None: report nothing).
    interval_s : float, seconds
        How often the beat (and any change) is written.
    startup_s : float, seconds, optional
        Until the first ``step``, the process is in a ``start-up`` phase with this deadline (warm-up,
        data preparation, restore of its position), counted from the start or from the end of the
        last phase announced inside it (a wait for the servers, a roll-back), whichever is later.
    """

    def __init__(self, path: str | None, interval_s: float = 0.5, startup_s: float | None = None):
        self.path = Path(path) if path else None
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        now, mono = time.time(), time.monotonic()
        self._state = {"pid": os.getpid(), "beat": now, "mono": mono, "step": 0, "step_base": 0, "step_time": now,
                       "step_mono": mono, "examples": 0, "marks": {}, "last_mark": None, "where": {},
                       "phase": None}
        self._phases: list[dict] = []
        self._startup = None
        if startup_s is not None:
            self._startup = {"name": "start-up", "started": now, "started_mono": mono,
                             "deadline_s": float(startup_s)}
            self._phases.append(self._startup)
            self._state["phase"] = self._startup
        self._stop = threading.Event()
        self._thread = None
        if self.path is not None:
            self._write()
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()

    def step(self, examples: int = 0) -> None:
        """One training step done, with ``examples`` training examples."""
        with self._lock:
            st = self._state
            if self._startup is not None:
                self._phases.remove(self._startup)
                self._startup = None
                st["phase"] = self._phases[-1] if self._phases else None
            st["step"] += 1
            st["examples"] += int(examples)
            st["step_time"], st["step_mono"] = time.time(), time.monotonic()

    def base(self, step: int) -> None:
        """The job's step this process started from (a resumed checkpoint's): ``engine status`` shows
        ``step_base + step``, the job's step; ``step`` stays this process's count (liveness, rates)."""
        with self._lock:
            self._state["step_base"] = int(step)

    def moved(self) -> None:
        """The loop made progress that is not a training step (it skips the batches a resumed position
        already trained): a stall is measured from now, and so is the start-up's deadline."""
        with self._lock:
            self._resumed()

    def _resumed(self) -> None:
        """The loop goes on from now (under ``_lock``): the start-up's deadline, which counts outside
        announced phases, and a stall are measured from here."""
        now, mono = time.time(), time.monotonic()
        if self._startup is not None:
            self._startup["started"], self._startup["started_mono"] = now, mono
        self._state["step_time"], self._state["step_mono"] = now, mono

    def report(self) -> dict:
        """A copy of the report as it stands (the beat is now: whoever asks, this process answers)."""
        with self._lock:
            return copy.deepcopy({**self._state, "beat": time.time(), "mono": time.monotonic()})

    def mark(self, name: str) -> None:
        """Remember the examples count at point ``name`` (e.g. a checkpoint's data position); the newest
        ``MAX_MARKS`` are kept (see there)."""
        with self._lock:
            marks = self._state["marks"]
            marks.pop(name, None)          # marked again: the newest
            marks[name] = self._state["examples"]
            while len(marks) > MAX_MARKS:
                del marks[next(iter(marks))]
            self._state["last_mark"] = name
        if self.path is not None:      # at once: the process may be killed before the next beat
            self._write()

    def where(self, **position) -> None:
        """Where in the data the loop is now (``epoch=1``, ``partition="2026112614"``): JSON values,
        replacing what was set before; shown by ``engine status``."""
        with self._lock:
            self._state["where"] = dict(position)

    @contextlib.contextmanager
    def phase(self, name: str, deadline_s: float):
        """Announce a long operation of at most ``deadline_s`` seconds; nested phases stack (the
        innermost is reported)."""
        entry = {"name": name, "started": time.time(), "started_mono": time.monotonic(),
                 "deadline_s": float(deadline_s)}
        with self._lock:
            self._phases.append(entry)
            self._state["phase"] = entry
        try:
            yield
        finally:
            with self._lock:
                self._phases.remove(entry)
                self._state["phase"] = self._phases[-1] if self._phases else None
                self._resumed()

    def _write(self) -> None:
        # one writer at a time (the beat thread and a mark share the tmp file): the state is serialized
        # and published in the same order, so an older report never replaces a newer one
        with self._write_lock:
            with self._lock:
                self._state["beat"], self._state["mono"] = time.time(), time.monotonic()
                text = json.dumps(self._state)
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                tmp.write_text(text)
                tmp.replace(self.path)
            except OSError as e:   # a full disk must not kill training; the supervisor sees no beat
                log.warning("progress file %s: %s", self.path, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
            self._write()


_current = Progress(None)


def current() -> Progress:
    """This process's reporter (a no-op one unless ``install`` was called)."""
    return _current


def install(path: str | None = None, startup_s: float | None = None, *, in_memory: bool = False) -> Progress:
    """Start reporting to ``path`` (default: ``$ENGINE_PROGRESS_FILE``), in a start-up phase of
    ``startup_s`` seconds until the first step; with no file, ``in_memory`` keeps the report in this
    process only (for ``engine.liveness``); returns the reporter."""
    global _current
    path = path if path is not None else os.environ.get(ENV)
    if path or in_memory:
        _current = Progress(path or None, startup_s=startup_s)
    return _current


def read(path: str | os.PathLike) -> dict | None:
    """A progress file's content, or None when it does not exist yet or is unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def stalled(report: dict | None, now: float, dead_after_s: float, started: float) -> str | None:
    """Why a worker with ``report`` counts as dead at ``now``, or None if alive. ``now`` and ``started``
    are this host's monotonic seconds (``time.monotonic()``), the clock of the report's ``mono``,
    ``step_mono`` and phases' ``started_mono`` (``rebase`` a report read on another host).

    ``started``: when the process was started (a worker with no report yet is given ``dead_after_s``
    after it, on top of its start-up; the caller adds the start-up allowance)."""
    if report is None:
        return f"no progress report {now - started:.0f}s after start" if now - started > dead_after_s else None
    beat_age = now - float(report.get("mono", 0))
    if beat_age > dead_after_s:
        return f"no heartbeat for {beat_age:.0f}s (stopped or frozen process)"
    ph = report.get("phase")
    if ph:
        age = now - float(ph["started_mono"])
        if age > float(ph["deadline_s"]):
            return f"{ph['name']!r} has run {age:.0f}s, past its {float(ph['deadline_s']):g}s deadline"
        return None
    idle = now - float(report.get("step_mono", now))
    if idle > dead_after_s:
        return f"no training step for {idle:.0f}s at step {report.get('step')} (a hang)"
    return None


def rebase(report: dict | None, offset_s: float) -> dict | None:
    """``report`` with its monotonic times moved by ``offset_s`` seconds (None stays None): a report read
    on another host (its reader's node clock minus this host's at the read: ``offset_s`` = this host's
    ``time.monotonic()`` at the answer minus the node's at the read) compares with this host's clock."""
    if report is None:
        return None
    out = {**report}
    for key in ("mono", "step_mono"):
        if key in out:
            out[key] = float(out[key]) + offset_s
    if out.get("phase"):
        out["phase"] = {**out["phase"], "started_mono": float(out["phase"]["started_mono"]) + offset_s}
    return out
