"""Named failure points: places where a chaos test slows a real process down, so that it can kill it at
an exact instant (the way etcd's gofail and TiKV's fail-rs expose them).

``ENGINE_FAILPOINTS`` holds ``name=action`` pairs separated by ``;``, read once per process::

    ENGINE_FAILPOINTS="checkpoint.before_publish=sleep:1.5"

Actions: ``sleep:SECONDS`` (pause there). Unset, every point costs one dict lookup. Points:

``worker.after_step``
    ``Mode.end_step``: a worker finished a step and reported it (a long sleep here is a training loop
    that hangs while the process stays alive: its heartbeat goes on, its step counter stops).

``checkpoint.before_publish``
    ``CheckpointManager.save``: every server wrote its part files, the manifest and ``_SUCCESS`` are
    not written yet (a kill here must leave the previous checkpoint the newest complete one).
``server.shrink``
    ``PSServer.Shrink``, before the expiry pass: a pass that takes longer than a client's per-call
    ``timeout_s``, as one over 10^8 keys does (47-89 s on one server here).
``server.load``
    ``PSServer.Load``, before the checkpoint is read: a restore held open, so that a chaos test can
    kill or freeze a server inside it.
``server.before_ready``
    ``engine.roles.run_server``, listening, right before the ready file is written: a start-up held
    open, so that a chaos test can freeze a server that has no address for the launcher to poll yet.
``export.before_publish``
    ``ctr_online`` rank 0, right before ``export_bundle`` writes and publishes the serving bundle of the
    checkpoint just published (the publish happens inside ``export_bundle``, so the point precedes the
    whole call): a kill here leaves that checkpoint complete and its bundle absent.
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

ENV = "ENGINE_FAILPOINTS"
_points: dict[str, tuple[str, float]] | None = None


def _parse(text: str) -> dict[str, tuple[str, float]]:
    """``"a=sleep:1;b=sleep:0.5"`` -> {"a": ("sleep", 1.0), ...}.

    Raises
    ------
    ValueError
        A pair is not ``name=sleep:SECONDS`` (the pair is named).
    """
    out = {}
    for pair in filter(None, (p.strip() for p in text.split(";"))):
        name, _, action = pair.partition("=")
        kind, _, arg = action.partition(":")
        if not name or kind != "sleep":
            raise ValueError(f"{ENV}: {pair!r} is not NAME=sleep:SECONDS")
        try:
            out[name.strip()] = (kind, float(arg))
        except ValueError:
            raise ValueError(f"{ENV}: {pair!r}: {arg!r} is not a number of seconds") from None
    return out


def hit(name: str) -> None:
    """Run the action configured for point ``name``, if any."""
    global _points
    if _points is None:
        _points = _parse(os.environ.get(ENV, ""))
    action = _points.get(name)
    if action is not None:
        log.warning("failpoint %s: %s %g s", name, *action)
        time.sleep(action[1])
