"""A role-mode worker's liveness, for a scheduler without a launcher (Kubernetes' liveness probe).

The local launcher finds a frozen or hung worker from its progress file (``engine.progress``); a worker
started with ``--role worker`` under another scheduler has no launcher to read that file, and before this
a worker whose loop hung (a stuck read, a deadlock) or whose process froze held its peers at their next
barrier until they timed out, again after each of their restarts, for as long as it stayed.

With ``--health-port N`` the worker serves the standard gRPC health checking protocol on N (plaintext,
nothing else: ``engine.ps.health.HealthPort``, as the servers do) and answers by the launcher's rule
(``progress.stalled`` over the report this process keeps in memory):

- SERVING while it trains (a step within ``client.dead_after_s``), inside an announced phase within its
  deadline (a checkpoint, an evaluation, a barrier), or in its start-up (``cluster.startup_timeout_s``
  until the first step: connecting, agreeing with the servers, restoring its data position);
- NOT_SERVING once the loop stalls past that (logged once, with the reason): the probe fails and the
  kubelet kills the container (``engine k8s``: SIGTERM, SIGKILL 10 s later; with ``restartPolicy:
  Never`` the pod fails and the Job controller replaces it), and the new worker joins by the recovery
  rule (it finds its name among the servers' writers and fences them, or as rank 0 rolls the job back);
- no answer at all when the process is frozen (SIGSTOP, a host swapping to death): the probe times out,
  with the same outcome; continued, it counts no stall over the time it was frozen (``engine.awake``);
- SERVING while it waits inside a call to a server within that call's bound (``engine.ps.inflight``):
  a server that froze or whose host was lost holds every worker's calls, and the worker finds it
  itself (``ShardUnavailableError``: it exits 76, which Kubernetes' podFailurePolicy does not count),
  where a liveness restart would have counted the server's failure against each worker. After a call
  of a second or more, the loop's stall is measured from the call's end.

A worker stalled in one step is killed after ``client.dead_after_s`` plus the probe's period times its
failure threshold (``engine k8s`` renders 10 s × 3) plus the probe's grace (10 s): about 70 s at the
default ``dead_after_s``.
"""
from __future__ import annotations

import logging
import threading
import time

from . import awake, progress

log = logging.getLogger(__name__)

CHECK_S = 1.0          # how often the report is looked at


class WorkerLiveness:
    """Serve ``reporter``'s liveness on ``host:port`` (0: a free port; ``.port`` is the bound one).

    Parameters
    ----------
    reporter : engine.progress.Progress
        This process's report, in memory (``progress.install(in_memory=True)``).
    dead_after_s : float, seconds
        A step, or a phase's end, later than this is a stall (``client.dead_after_s``).
    name : str
        How the log names this process (``worker 1``).
    in_flight : engine.ps.inflight.InFlight, optional
        The worker's calls to its servers (``PSClient.in_flight``).

    Raises
    ------
    RuntimeError
        The address could not be bound.
    """

    def __init__(self, reporter: progress.Progress, host: str, port: int, dead_after_s: float, name: str,
                 in_flight=None):
        from .ps.health import HealthPort
        self.reporter, self.dead_after_s, self.name = reporter, float(dead_after_s), name
        self.in_flight = in_flight
        self.started = time.monotonic()
        self.probe = HealthPort(host, port, services=("",))     # the overall status: it serves no PS
        self.port = self.probe.port
        self.why: str | None = None
        self.waiting: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.check()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._thread.start()

    def check(self) -> str | None:
        """Look at the report now: set SERVING or NOT_SERVING; returns why it is stalled, or None."""
        with self._lock:           # the watch thread and a caller: one transition, said once
            return self._check()

    def _check(self) -> str | None:
        report = self.reporter.report()
        if self.in_flight is not None:      # the loop resumes when a long call returns
            report["step_mono"] = max(float(report["step_mono"]), self.in_flight.long_call_ended)
        # ages while this process ran: stopped or frozen and continued (SIGSTOP, a frozen cgroup), it
        # looked here before its loop could step again and called itself hung (engine.awake)
        now = time.monotonic()
        clock = awake.clock()
        why = progress.stalled(clock.discount(report, now), now, self.dead_after_s,
                               self.started + clock.asleep(self.started, now))
        waiting = self.in_flight.waiting() if why and self.in_flight is not None else None
        if waiting:
            if waiting != self.waiting:
                log.debug("%s: stalled (%s), but waiting inside a bounded call: %s", self.name, why, waiting)
            why = None
        self.waiting = waiting
        if why and not self.why:
            log.error("%s: liveness NOT_SERVING: %s (client.dead_after_s=%g); a liveness probe restarts this "
                      "process, and restarted it rejoins the job by the recovery rule", self.name, why,
                      self.dead_after_s)
        elif self.why and not why:
            log.warning("%s: liveness SERVING again (it moved after: %s)", self.name, self.why)
        self.why = why
        self.probe.set(why is None)
        return why

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            self.check()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * CHECK_S)
        self.probe.close()
