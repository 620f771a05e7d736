"""Named failure points: places where a chaos test slows a real process down, so that it can kill it at
an exact instant (the way etcd's gofail and TiKV's fail-rs expose them).

``ENGINE_FAILPOINTS`` holds ``name=action`` pairs separated by ``;``, read once per process::

    ENGINE_FAILPOINTS="checkpoint.before_publish=sleep:1.5"

Actions: ``sleep:SECONDS`` (pause there at every hit), ``sleep:SECONDS@N`` (only at the point's N-th hit in
this process, counted from 1), several separated by ``,``::

    ENGINE_FAILPOINTS="worker.after_step=sleep:0.05,sleep:600@40"    # slow steps; the 40th step hangs

Unset, every point costs one dict lookup. Points:

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
``server.pull``, ``server.push``, ``server.step``
    ``PSServer`` handling a ``Pull``, ``Push`` or ``Step``, holding the tables' shared lock: a long sleep
    is a handler that never returns while the process and its health answers live (a deadlock, a kernel
    that never ends), which ``engine.ps.watchdog`` must find. A client retries a Pull that timed out,
    never a Push or a Step.
``server.before_ready``
    ``engine.roles.run_server``, listening, right before the ready file is written: a start-up held
    open, so that a chaos test can freeze a server that has no address for the launcher to poll yet.
``ctr.before_listing.rankN``
    ``CTRTrainer.run`` of worker N, before it lists its train files: a worker that lists later than its
    peers, so that a test can write the directory between their listings (``ctr_inputs.agree_on_files``).
``export.before_publish``
    ``ctr_online`` rank 0, right before ``export_bundle`` writes and publishes the serving bundle of the
    checkpoint just published (the publish happens inside ``export_bundle``, so the point precedes the
    whole call): a kill here leaves that checkpoint complete and its bundle absent.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

ENV = "ENGINE_FAILPOINTS"
_points: dict[str, list[tuple[float, int | None]]] | None = None
_hits: dict[str, int] = {}
_hits_lock = threading.Lock()
_suspended = 0      # suspended() blocks open: their hits are neither acted on nor counted


def _parse(text: str) -> dict[str, list[tuple[float, int | None]]]:
    """``"a=sleep:1;b=sleep:0.5,sleep:60@3"`` -> {"a": [(1.0, None)], "b": [(0.5, None), (60.0, 3)]}:
    (seconds, the hit it applies to, or None for every hit).

    Raises
    ------
    ValueError
        A pair is not ``name=sleep:SECONDS[@N][,...]`` (the pair is named).
    """
    out = {}
    for pair in filter(None, (p.strip() for p in text.split(";"))):
        name, _, actions = pair.partition("=")
        if not name.strip():
            raise ValueError(f"{ENV}: {pair!r} is not NAME=sleep:SECONDS")
        parsed = []
        for action in actions.split(","):
            kind, _, arg = action.strip().partition(":")
            if kind != "sleep":
                raise ValueError(f"{ENV}: {pair!r} is not NAME=sleep:SECONDS[@N]")
            seconds, _, at = arg.partition("@")
            try:
                parsed.append((float(seconds), int(at) if at else None))
            except ValueError:
                raise ValueError(f"{ENV}: {pair!r}: {arg!r} is not SECONDS or SECONDS@N (N a hit count)") from None
            if parsed[-1][1] is not None and parsed[-1][1] < 1:
                raise ValueError(f"{ENV}: {pair!r}: hits are counted from 1, got @{at}")
        out[name.strip()] = parsed
    return out


def hit(name: str) -> None:
    """Run the actions configured for point ``name`` at this hit, if any (none while ``suspended``)."""
    global _points
    if _points is None:
        _points = _parse(os.environ.get(ENV, ""))
    actions = _points.get(name)
    if actions is None or _suspended:
        return
    with _hits_lock:
        n = _hits[name] = _hits.get(name, 0) + 1
    for seconds, at in actions:
        if at is None or at == n:
            log.warning("failpoint %s: sleep %g s%s", name, seconds, f" (hit {n})" if at is not None else "")
            time.sleep(seconds)


@contextlib.contextmanager
def suspended():
    """No point acts, and no hit counts, inside this block, in any thread: the process's own preparation
    (``engine.ps.warmup`` runs requests through a throw-away server) is not the job a chaos test aims at."""
    global _suspended
    with _hits_lock:
        _suspended += 1
    try:
        yield
    finally:
        with _hits_lock:
            _suspended -= 1
