"""The data clock: expiry measured in the time of the data trained, not the server's wall clock.

A sparse table stamps every pushed row with its clock (``last_seen``) and its expiry pass deletes rows
last pushed more than ``expire_after`` seconds before that clock's now (``SparseTable.shrink``). On the
wall clock (``server.expiry_clock: wall``, the default) that measures time since the push: an online job
stopped for a day expires at its resume rows a steady job would keep, and a catch-up over a week of old
hours expires nothing that is stale in the data. With ``server.expiry_clock: data`` the server's tables
read this clock instead, and the job moves it to the data time it trains (``ctr_online``: the end of
each hourly partition, before training it), as Paddle's accessor counts ``unseen_days`` in the job's
own shrink passes rather than in days of the calendar.

Rules (the server's, whatever a client sends):

- only the admin token moves it (the ``Clock`` request with a time is an admin request, as ``Shrink``
  is: the clock decides which rows the next expiry pass deletes); the online job's rank 0 moves it,
  before it tells the other workers which hour to train, so no push of an hour is stamped earlier;
- forward only: an advance to an earlier time leaves the clock as it is (so a retried or late advance
  changes nothing);
- never past the wall clock + ``MAX_AHEAD_S``: a later time (a producer's clock ahead, a bad partition
  name) is clamped there (WARNING), so rows are never stamped in a future the data has not reached;
- unset after the server starts, loads a checkpoint or is fenced with ``clear``: the job sets it again
  from the restored position. While it is unset, pushes stamp 0 and ``Shrink`` is refused (there is no
  data time to expire at).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable

from ..errors import ProtocolError
from .hosts import HostError

log = logging.getLogger(__name__)

__all__ = ["DataClock", "MAX_AHEAD_S", "clock_request"]

#: seconds the data clock may run ahead of the server's wall clock (an hour being published as it ends)
MAX_AHEAD_S = 3600.0


class DataClock:
    """A forward-only clock the job moves (see the module docstring); call it for seconds since the epoch.

    Parameters
    ----------
    wall : callable returning float seconds
        The bound it never passes (+ ``MAX_AHEAD_S``); default ``time.time``.
    """

    def __init__(self, wall: Callable[[], float] = time.time):
        self._wall = wall
        self._t: float | None = None
        self._lock = threading.Lock()

    def __call__(self) -> float:
        """Seconds since the epoch of the data trained (0.0 while unset)."""
        t = self._t
        return 0.0 if t is None else t

    @property
    def value(self) -> float | None:
        """The data time in seconds since the epoch, None while unset."""
        return self._t

    def advance(self, t: float) -> float:
        """Move the clock to ``t`` seconds since the epoch when that is later; returns the clock after.

        Raises
        ------
        ValueError
            ``t`` is not a finite number > 0.
        """
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"advance_to: a data time in seconds since the epoch (> 0), got {t!r}")
        limit = self._wall() + MAX_AHEAD_S
        if t > limit:
            log.warning("data clock: %.0f is %.0f s past this server's wall clock; clamped to wall clock + %.0f s",
                        t, t - limit + MAX_AHEAD_S, MAX_AHEAD_S)
            t = limit
        with self._lock:
            if self._t is None or t > self._t:
                self._t = float(t)
            return self._t

    def reset(self) -> None:
        """Unset it (after a load: the job sets it again from the restored position)."""
        with self._lock:
            self._t = None


def clock_request(clock: DataClock | None, req) -> dict:
    """The server's ``Clock`` request (ps.proto ``ClockRequest``) on its data clock (None: the server
    runs on the wall clock): ``advance_to`` > 0 moves it, 0 reads it. Returns the reply's JSON object.

    Raises
    ------
    HostError
        FAILED_PRECONDITION: an advance on a wall-clock server.
    ProtocolError
        ``advance_to`` is negative or not finite (nothing changed).
    """
    if req.advance_to:
        if clock is None:
            raise HostError("FAILED_PRECONDITION", "Clock: this server expires rows at its wall clock "
                            "(server.expiry_clock: wall); there is no data clock to advance")
        try:
            clock.advance(req.advance_to)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
    return {"expiry_clock": "wall" if clock is None else "data", "data_time": None if clock is None else clock.value}
