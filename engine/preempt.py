"""Preemption: SIGTERM means "checkpoint at the next step boundary, then stop, resumably".

Kubernetes (and most schedulers) send SIGTERM before they kill a process. Any role may get it:

- the launcher forwards it to its workers and gives the job ``cluster.preempt_timeout_s`` seconds;
- a worker records the request and tells the others through the servers (a metric accumulator,
  ``REQUESTS``) before its next checkpoint meeting;
- a server keeps serving, answers ``"preempting": true`` in ``Health``, and stops at a Stop request or
  after ``cluster.preempt_timeout_s``.

At the next aligned meeting (every ``checkpoint.align_steps`` steps of an offline job, after each
partition of an online one) rank 0 sees any request (``decide``), writes a checkpoint whether one is due
or not, and publishes the decision for that meeting (``publish``); after the meeting's last barrier every
worker reads it (``decided``) and ends with ``Preempted``: exit code ``EXIT_PREEMPTED`` (75, sysexits'
EX_TEMPFAIL: "try again later"). ``engine train CONFIG --resume`` continues exactly there. Every worker
reads the same decision after the same barrier, so all stop at the same position.

Without ``checkpoint.root`` there is nothing to save: the job is stopped when the timeout passes.
"""
from __future__ import annotations

import logging
import signal
import threading

import numpy as np

log = logging.getLogger(__name__)

#: the exit code of a preempted role or job: it stopped at a checkpoint and ``--resume`` continues it
EXIT_PREEMPTED = 75
#: the servers' metric accumulator counting workers that were asked to stop
REQUESTS = "preempt-requests"

_requested = threading.Event()
_announced = threading.Event()


class Preempted(Exception):
    """This worker stopped at a checkpoint after a preemption request (exit ``EXIT_PREEMPTED``)."""


def request(*_) -> None:
    """Record a preemption request (the SIGTERM handler)."""
    if not _requested.is_set():
        log.warning("preemption requested: stopping at the next checkpoint meeting")
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def install_handler() -> None:
    """Make SIGTERM a preemption request for this process (from the main thread)."""
    signal.signal(signal.SIGTERM, request)


def announce(client) -> None:
    """Tell the other workers, once, that this one was asked to stop (before a meeting's barrier)."""
    if _requested.is_set() and not _announced.is_set():
        client.add_metric(REQUESTS, np.ones(1, np.int64), np.zeros(1, np.float64))
        _announced.set()


def decide(client) -> bool:
    """Rank 0, inside a meeting: whether any worker or server was asked to stop."""
    counts, _ = client.read_metric(REQUESTS)
    if len(counts) and counts.sum() > 0:
        return True
    return any(h.get("preempting") for h in client.health())


def _point(name: str) -> str:
    return f"preempt-at-{name}"


def publish(client, name: str) -> None:
    """Rank 0: the job stops at meeting ``name`` (after its checkpoint)."""
    client.add_metric(_point(name), np.ones(1, np.int64), np.zeros(1, np.float64))


def decided(client, name: str) -> bool:
    """After meeting ``name``'s last barrier: whether rank 0 decided to stop there."""
    counts, _ = client.read_metric(_point(name))
    return bool(len(counts))
