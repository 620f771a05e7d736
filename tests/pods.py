"""A pod's life for role-mode tests and the role chaos soak: what a Kubernetes Job controller and the
kubelet do for one role, on a local process, and nothing else.

``Pod`` starts a role and starts it again after any exit but 0 and 2 (a config error), at most
``restarts`` times. Given a health port it also probes it as a kubelet does: after a first SERVING (the
startup probe's work; ``startup_s`` without one restarts it), every ``period_s`` with a ``timeout_s``
deadline, and ``failures`` failures in a row (NOT_SERVING or no answer) restart it: SIGTERM, then
SIGKILL after ``grace_s``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def health(port: int, timeout_s: float) -> str:
    """The overall status on ``127.0.0.1:port``, or the error's code name and details (no answer)."""
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except grpc.RpcError as e:
        return f"{e.code().name} ({(e.details() or '')[:120]})"


class Pod:
    """One role under a Job controller and a kubelet (module docstring). ``env_of(start)``: the
    environment of its ``start``-th start (0 first); ``port``: its health port (None: not probed);
    ``codes``: its exit codes; ``restarted``: why the probe restarted it, once per restart; ``proc``:
    the running process."""

    def __init__(self, cmd: list[str], env_of: Callable[[int], dict], log: Path, port: int | None = None, *,
                 restarts: int = 3,
                 period_s: float = 1.0, timeout_s: float = 3.0, failures: int = 3, grace_s: float = 2.0,
                 startup_s: float = 120.0):
        # timeout_s: a kubelet's default is 1 s, but on a loaded 2-core test machine a live role's gRPC
        # thread can wait that long for a core three times in a row; a hung role answers NOT_SERVING at
        # once and is found as fast (3 x period_s), a frozen one after 3 x (period_s + timeout_s) = 12 s
        self.cmd, self.env_of, self.log, self.port, self.restarts = cmd, env_of, log, port, restarts
        self.period_s, self.timeout_s, self.failures, self.grace_s = period_s, timeout_s, failures, grace_s
        self.startup_s = startup_s
        self.codes: list[int] = []
        self.restarted: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.stopped = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            with self.lock, open(self.log, "a") as log:
                if self.stopped:
                    return
                log.write(f"=== start {len(self.codes)} at {time.time():.3f}\n")
                log.flush()
                self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env_of(len(self.codes)),
                                             stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
            self._probe(self.proc)
            self.codes.append(self.proc.wait())
            if self.codes[-1] in (0, 2) or len(self.codes) > self.restarts:
                return
            time.sleep(0.2)                  # the controller's back-off, short

    def _probe(self, proc: subprocess.Popen) -> None:
        if self.port is None:               # no probe: the controller only
            return
        started, failed, t0 = False, 0, time.monotonic()
        while proc.poll() is None and not self.stopped:
            time.sleep(self.period_s)
            status = health(self.port, self.timeout_s)
            if status == "SERVING":
                started, failed = True, 0
                continue
            if not started:                  # the startup probe's budget
                if time.monotonic() - t0 > self.startup_s:
                    self._restart(proc, f"startup probe: {status} for {self.startup_s:g}s")
                    return
                continue
            failed += 1
            if failed >= self.failures:
                self._restart(proc, f"liveness probe: {status} {failed} times in a row")
                return

    def _restart(self, proc: subprocess.Popen, why: str) -> None:
        """The kubelet's container restart: SIGTERM, SIGKILL after the grace period."""
        self.restarted.append(why)
        with open(self.log, "a") as log:
            log.write(f"=== {why}: restarting at {time.time():.3f}\n")
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the running process's group; False when none runs."""
        with self.lock:
            p = self.proc
            if p is None or p.poll() is not None:
                return False
            os.killpg(p.pid, sig)
            return True

    def stop(self) -> None:
        self.stopped = True
        self.signal(signal.SIGKILL)
        self.thread.join(30)
