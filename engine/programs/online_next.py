"""Which hourly partition the online job trains next: rank 0 decides, every other worker follows.

Each worker lists the partition root on its own, so before this module an hour published between two
workers' listings was trained by one and skipped (as missing) by another; both then waited at different
barriers until ``barrier_timeout_s`` and the job restarted. Now only rank 0 applies
``streaming.hourly.HourlySource``'s rules (time order, missing and late hours, ``wait_for_missing_s``,
republishes, ``until``) and the run's ``max_partitions``, and publishes each decision on the servers; the
other workers wait for it and open the partition it names, waiting for their own listing to show it
complete when it does not yet (an object store's listing may lag).

A decision is a metric accumulator (``PSClient.add_metric``) named after the partition consumed before it
(``online-next:{after}``), holding ``counts = [hour, 1]`` where ``hour`` is the chosen partition's start
in hours since the Unix epoch, or ``END`` (no further partition: ``until`` or ``max_partitions``
reached) or ``PREEMPT`` (a preemption request arrived while the job waited: it stops at the checkpoint of
``after``). Counts, not a single value: a decision added twice by a retried request reads ``[2*hour, 2]``,
still the same hour. The servers drop every accumulator when their generation moves (a load or a fence,
``PSServer._drop_transient``), so a restarted cluster decides afresh from its restored position, and a
decision can never be read by an attempt it was not made for.

Faults: rank 0 dies while the others wait: their next request meets a new generation (the supervisor's
fence or load) and they exit to be restarted, as at a barrier. A follower whose listing never shows the
decided partition complete (``follow_timeout_s``, REPUBLISH_WAIT_S by default) raises
``hdfs_io.NotPublishedError`` naming it, and the attempt restarts.

Preemption while idle: rank 0 checks ``engine.preempt.decide`` every ``PREEMPT_POLL_S`` seconds while
it waits for the next hour (a server fenced, restored or lost meanwhile ends the wait with that error,
so a restart is not held up until the next hour comes); a follower asked to stop announces it (``preempt.announce``) while it waits.
Every worker then ends with ``preempt.Preempted`` at once, instead of after ``cluster.preempt_timeout_s``:
nothing was trained since the last partition's checkpoint.
"""
from __future__ import annotations

import datetime as _dt
import logging
import threading
import time
from typing import Iterator

import numpy as np

import hdfs_io
from streaming.hourly import REPUBLISH_WAIT_S, HourlySource, Partition, partition_name, partition_time

from .. import preempt

log = logging.getLogger(__name__)

__all__ = ["NextPartition", "END", "PREEMPT", "PREEMPT_POLL_S"]

#: decision: no further partition (``until`` or ``max_partitions`` reached, or the source ended)
END = -1
#: decision: stop at the checkpoint of the partition before (a preemption request while waiting)
PREEMPT = -2
#: seconds between rank 0's checks for a preemption request while it waits for the next hour
PREEMPT_POLL_S = 1.0
#: longest pause in seconds between a follower's reads of a decision not yet made
FOLLOW_POLL_MAX_S = 1.0
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def channel(after: str | None) -> str:
    """The accumulator holding the decision of the partition after ``after`` (None: the first)."""
    return f"online-next:{after or 'start'}"


def _hour(name: str) -> int:
    return int(partition_time(name).timestamp()) // 3600


def _name(hour: int) -> str:
    return partition_name(_EPOCH + _dt.timedelta(hours=hour))


class NextPartition:
    """The sequence of partitions every worker of an online job trains, the same on every rank.

    Parameters
    ----------
    client : engine.ps.PSClient
        Carries the decisions (metric accumulators on the servers).
    source : HourlySource
        This worker's view of the partition root (rank 0 lists it; the others open what rank 0 chose).
    rank : int
        0 decides; the others follow. A job of one worker does not publish anything.
    num_workers : int
    until : datetime, optional
        Rank 0: no partition starting at or after it (``model.until``).
    max_partitions : int
        Rank 0: END after this many partitions in ``done`` (0: no limit).
    follow_timeout_s : float, seconds
        A follower's wait for its listing to show a decided partition complete.
    on_chosen : callable(Partition), optional
        Rank 0 calls it with each partition it chose, before it tells the others (the online job moves
        the servers' data clock there, so no worker pushes rows of that hour before the clock says so).
    """

    def __init__(self, client, source: HourlySource, *, rank: int, num_workers: int, until=None,
                 max_partitions: int = 0, follow_timeout_s: float = REPUBLISH_WAIT_S, on_chosen=None):
        self.client, self.source, self.rank, self.num_workers = client, source, rank, num_workers
        self.until, self.max_partitions, self.follow_timeout_s = until, max_partitions, follow_timeout_s
        self.on_chosen = on_chosen
        self.preempted = False        # the last ``next`` ended because of a preemption request
        self._parts: Iterator[Partition] | None = None
        self._decided: str | None = None    # rank 0: the channel of the last decision published
        self._watch_error: BaseException | None = None

    # rank 0 ---------------------------------------------------------------------------------------------
    def _decide(self, after: str | None, done: list[str]) -> Partition | None:
        if self.max_partitions and len(done) >= self.max_partitions:
            return None
        self._watch_error = None
        if self._parts is None:
            self._parts = self.source.partitions(after=after, until=self.until)
        stop_watch = threading.Event()

        def watch() -> None:      # a preemption request anywhere ends the wait
            while not stop_watch.wait(PREEMPT_POLL_S):
                try:
                    if preempt.requested() or preempt.decide(self.client):
                        self.preempted = True
                        self.source.stop.set()
                        return
                except BaseException as e:  # noqa: BLE001 - a fenced or lost server: the wait ends with it
                    self._watch_error = e
                    self.source.stop.set()
                    return
        watcher = threading.Thread(target=watch, name="online-preempt-watch", daemon=True)
        watcher.start()
        try:
            part = next(self._parts, None)
        finally:
            stop_watch.set()
            watcher.join()
        if self._watch_error is not None:       # the servers moved on (fenced, restored) or went away
            raise self._watch_error
        if part is not None and self.preempted:     # chosen as the stop was requested: not trained
            part = None
        return part

    def _publish(self, after: str | None, value: int) -> None:
        self.client.add_metric(channel(after), np.array([value, 1], np.int64), np.zeros(0, np.float64))

    # followers ------------------------------------------------------------------------------------------
    def _follow(self, after: str | None) -> int:
        pause = 0.05
        while True:
            counts, _ = self.client.read_metric(channel(after))
            if len(counts) == 2 and counts[1] > 0:
                return int(counts[0] // counts[1])
            preempt.announce(self.client)       # asked to stop while waiting: rank 0 sees it here
            time.sleep(pause)
            pause = min(pause * 2, FOLLOW_POLL_MAX_S)

    def _open(self, name: str) -> Partition:
        deadline = time.monotonic() + self.follow_timeout_s
        while True:
            part = self.source.open_if_complete(name)
            if part is not None:
                return part
            if time.monotonic() > deadline:
                uri = self.source.storage.uri_of(name)
                raise hdfs_io.NotPublishedError(
                    f"rank 0 chose hourly partition {name} but it is not complete here ({uri}) after "
                    f"{self.follow_timeout_s:g} s", uri=uri)
            time.sleep(min(self.source.poll_interval_s, 0.5))

    def retire(self) -> None:
        """Rank 0, once every worker has read the last decision (after the next barrier they all meet):
        remove its accumulator, so a job that runs for months holds one, not one per hour."""
        if self._decided is not None:
            self.client.reset_metric(self._decided)
            self._decided = None

    # both -----------------------------------------------------------------------------------------------
    def next(self, after: str | None, done: list[str]) -> Partition | None:
        """The partition to train after ``after`` (the last consumed, None before the first), or None:
        no further partition, or a preemption request (``preempted`` set; raise ``Preempted``).

        ``done``: the partitions this run consumed so far (rank 0 applies ``max_partitions`` to it).

        Raises
        ------
        hdfs_io.CheckpointCorruptError
            The partition's files do not match its manifest (``HourlySource.open``).
        hdfs_io.NotPublishedError
            A follower's listing does not show the decided partition complete within ``follow_timeout_s``.
        engine.errors.RemoteError
            Rank 0: the preemption check met a server that was fenced, restored or lost while it waited.
        """
        self.preempted = False
        if self.rank == 0:
            part = self._decide(after, done)
            if part is not None and self.on_chosen is not None:
                self.on_chosen(part)
            if self.num_workers > 1:
                self._publish(after, _hour(part.name) if part is not None else PREEMPT if self.preempted else END)
                self._decided = channel(after)
            return part
        hour = self._follow(after)
        if hour == PREEMPT:
            self.preempted = True
            return None
        if hour == END:
            return None
        return self._open(_name(hour))
