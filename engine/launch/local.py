"""The local launcher behind ``engine train CONFIG.yaml``: servers and workers as child processes.
(Which processes run is this module's business; what state a restarted cluster resumes from is the
supervisor's, ``engine.launch.supervisor``.)

``LocalCluster`` writes the resolved config to its run directory (mode 0600; inline storage secrets
travel in the children's environment instead, see ``engine.config.dump_config``), starts
``cluster.servers`` server processes (``python -m engine train RESOLVED.yaml --role server --rank i
--port 0 --ready-file ..``),
waits until each wrote its ``host:port`` (a free port it bound itself), starts ``cluster.workers``
worker processes with ``ENGINE_SERVERS`` set, waits for them, then stops the servers.

Failure handling: the launcher polls its children every 0.1 s; if any of them exits unexpectedly the
others are stopped (SIGTERM to their process groups, SIGKILL after a grace period) and ``LaunchError``
names the role, rank, exit code and the last lines of its log. Ctrl-C stops everything. Children die
with the launcher even when it is killed (see ``engine.roles.guard_parent``). Every wait has a timeout.

Hangs count as deaths (``client.dead_after_s``, default 30 s): a server that answers no ``Health``
call for that long (SIGSTOP, a dead host, a cut network), and a worker whose progress report
(``engine.progress``) shows no heartbeat or no training step for that long outside a phase it
announced as long (a checkpoint, an evaluation, a barrier, start-up), whose own deadline applies.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import preempt, progress
from ..config import SECRET_ENV, EngineConfig, dump_config, secret_env
from ..connect import connect
from ..errors import LaunchError, RemoteError
from ..observability import prometheus
from ..ps import ps_pb2 as pb
from ..ps.transport import GrpcTransport
from ..security.credentials import client_security, withheld_vars
from .. import awake

log = logging.getLogger(__name__)

POLL_S = 0.1
ENDPOINTS_FILE = "endpoints.json"   # in the run directory once the servers are ready (engine status)
LATEST = "latest"                   # {cluster.run_root}/latest -> the newest run directory
TAIL_LINES = 15
HANG_CHECK_S = 1.0     # how often progress reports and server liveness are looked at


class ServerWatch:
    """Polls every server's ``Health`` from one thread per server and remembers the last answer, so
    a silent server (SIGSTOP, a dead host, a cut network) is noticed after ``dead_after_s`` seconds
    whatever the workers are doing, and a stuck one (alive, answering, but a request hung past
    ``client.timeout_s``: ``engine.ps.watchdog``) or a failed one (a spill store that stopped writing
    for good: ``PSServer.spill_failed``) as soon as it says so. Each poll has a deadline of
    ``min(5, dead_after_s / 2)`` seconds. Silence is counted only while this process ran
    (``engine.awake``): a launcher stopped or frozen itself does not take the servers for silent
    when it runs again."""

    def __init__(self, endpoints: list[str], dead_after_s: float, every_s: float = 1.0, security=None,
                 clock: awake.AwakeClock | None = None):
        self.dead_after_s = float(dead_after_s)
        self.awake = clock or awake.clock()
        self._transport = GrpcTransport(endpoints, retries=0, security=security, dead_after_s=dead_after_s)
        self._last_ok = [time.monotonic()] * len(endpoints)
        self._stuck: list[str | None] = [None] * len(endpoints)     # each server's last ``stuck``
        self._failed: list[str | None] = [None] * len(endpoints)    # ... and ``failed``
        self._errors: list[str | None] = [None] * len(endpoints)    # each server's last failed poll
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._poll, args=(i, every_s), daemon=True,
                                          name=f"watch-server-{i}") for i in range(len(endpoints))]
        for t in self._threads:
            t.start()

    def _poll(self, i: int, every_s: float) -> None:
        timeout = min(5.0, self.dead_after_s / 2)
        while not self._stop.wait(every_s):
            try:
                r = self._transport.call(i, "Health", pb.Empty(request_id=f"watch-{i}"), timeout)
                self._last_ok[i] = time.monotonic()
            except Exception as e:  # noqa: BLE001 - silence is what is measured
                log.debug("server %d: Health: %s", i, e)
                self._errors[i] = (f"{e.code}: {e.message}" if isinstance(e, RemoteError)
                                   else f"{type(e).__name__}: {e}")
                continue
            try:
                health = json.loads(r.json)
                self._stuck[i], self._failed[i] = health.get("stuck"), health.get("failed")
            except (ValueError, AttributeError) as e:   # an answer, but not a Health of ours
                log.debug("server %d: Health: unreadable answer: %s", i, e)

    def stuck(self) -> list[tuple[int, str]]:
        """[(server rank, why)] for servers whose last ``Health`` said they are stuck."""
        return [(i, why) for i, why in enumerate(self._stuck) if why]

    def failed(self) -> list[tuple[int, str]]:
        """[(server rank, why)] for servers whose last ``Health`` said a spill store failed."""
        return [(i, why) for i, why in enumerate(self._failed) if why]

    def silent(self) -> list[tuple[int, float]]:
        """[(server rank, seconds since its last answer)] for servers silent past ``dead_after_s``
        (seconds this process was awake: ``engine.awake``)."""
        now = time.monotonic()
        ages = [(i, self.awake.age(t, now)) for i, t in enumerate(self._last_ok)]
        return [(i, age) for i, age in ages if age > self.dead_after_s]

    def silent_reason(self, rank: int, silent_s: float) -> str:
        """Why server ``rank``, silent for ``silent_s`` seconds, is given up, for the failure's line. The
        launcher cannot tell a hung server from one it alone cannot reach (a network failure between its
        host and the server's, the workers' paths intact), so the line names both, with the last poll's
        error; before, it said "hung" of a live server the workers still reached."""
        return (f"answered no Health call from the launcher's host for {silent_s:.0f}s (client.dead_after_s="
                f"{self.dead_after_s:g}; last error: {(self._errors[rank] or 'none')[-200:]}): hung, its host down, "
                f"or the network between the launcher's host and it failed")

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._transport.close()


@dataclass
class Child:
    role: str
    rank: int
    proc: subprocess.Popen
    log_path: Path
    result_path: Path | None = None
    ready_path: Path | None = None
    progress_path: Path | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"

    def tail(self, n: int = TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        if not lines:       # an MPI rank that failed before it wrote a line: hydra's log says why
            from .mpi import MPIEXEC_LOG
            world = self.log_path.parent / MPIEXEC_LOG
            try:
                said = world.read_text(errors="replace").splitlines() if self.role == "worker" else []
            except OSError:
                said = []
            if said:
                return f"(nothing in {self.log_path.name}; the end of {world}:)\n" + "\n".join(said[-n:])
        return "\n".join(lines[-n:]) or ("(empty log)" if self.log_path.exists() else "(no log)")

    def how(self, code: int) -> str:
        """How it ended, for the failure's line: killed by a signal (``code`` < 0) or its exit code."""
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    # what the launcher reads of a child; a child elsewhere (``engine.launch.ray.RayChild``) answers
    # the same questions through its actor
    def ready(self) -> str | None:
        """The ``host:port`` a server wrote once listening, or None."""
        if self.ready_path is None or not self.ready_path.is_file():
            return None
        return self.ready_path.read_text().strip() or None

    def result(self) -> dict | None:
        """A worker's JSON result, or None (none written, or unreadable)."""
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, ValueError, AttributeError):
            return None

    def report(self) -> dict | None:
        """A worker's last progress report (``engine.progress``), or None."""
        return progress.read(self.progress_path) if self.progress_path else None

    def signal_group(self, sig: int) -> None:
        """``sig`` to the child's process group (it and anything it started)."""
        _signal_group(self.proc, sig)


class LocalCluster:
    """Servers and workers of one run on this machine.

    Parameters
    ----------
    cfg : EngineConfig
    run_dir : str or Path, optional
        Where the resolved config, ready files, results, progress files, per-process logs and
        ``endpoints.json`` go (default: a new ``new_run_dir``).
    python : str
        Interpreter for the children (default: this one).
    """

    def __init__(self, cfg: EngineConfig, run_dir: str | Path | None = None, python: str = sys.executable,
                 allow_load: tuple[str, ...] = (), stopping=None):
        self.cfg = cfg
        self.stopping = stopping or (lambda: False)     # the supervisor's stop flag (a preemption), for waits
        self.allow_load = tuple(allow_load)     # further roots clients may load from (--resume URI)
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.run_dir / "config.yaml"
        self._secret_env: dict[str, str] = {}
        if cfg.cluster.stop_servers_at_end:
            log.info("cluster.stop_servers_at_end is for role mode; this launcher stops the servers itself")
        self.write_config(cfg)
        self.python = python
        self.servers: list[Child] = []
        self.workers: list[Child] = []
        self.endpoints: list[str] = []
        self.watch: ServerWatch | None = None
        self.preempt_deadline: float | None = None     # monotonic; set by ``preempt``
        self._preempted: set[int] = set()               # worker ranks sent SIGTERM
        self.restarts = 0                 # the supervisor's count so far (engine_restarts_total)
        # observability.prometheus_port: URLs logged + prometheus.json (nothing to announce when it is off)
        self._metrics_announced = cfg.observability.prometheus_port is None
        self.abandoned: list[threading.Thread] = []     # calls a failure left running (``supervised``)

    def write_config(self, cfg: EngineConfig) -> None:
        """Write ``cfg`` as the children's config file (mode 0600, no inline storage secrets: those
        go into the environment of every child started afterwards, see ``engine.config.dump_config``).
        ``cluster.stop_servers_at_end`` is written false: a launcher stops its servers itself, and a
        server that worker 0 stopped before the launcher saw every worker end was a failure to it (a
        restart, each attempt again, until ``cluster.max_restarts`` ended the job)."""
        if cfg.cluster.stop_servers_at_end:
            cfg = replace(cfg, cluster=replace(cfg.cluster, stop_servers_at_end=False))
        self.cfg = cfg
        dump_config(cfg, self.config_path)
        self._secret_env = secret_env(cfg)

    # ------------------------------------------------------------------ processes
    def role_command(self, role: str, rank: int, extra: list[str]) -> list[str]:
        """The command line of one role's process."""
        return [self.python, "-m", "engine", "train", str(self.config_path), "--role", role,
                "--rank", str(rank), *extra]

    def child_env(self, env: dict, withheld: tuple[str, ...] = ()) -> dict:
        """The environment a child gets: this one without inline secrets, then the config's secrets
        (``secret_env``) and ``env``; without the variables ``withheld`` names (``withheld_env``)."""
        inherited = {k: v for k, v in os.environ.items() if k not in SECRET_ENV.values()}
        full = {**inherited, "PYTHONUNBUFFERED": "1", **self._secret_env, **env}
        return {k: v for k, v in full.items() if k not in withheld}

    def withheld_env(self, role: str, rank: int) -> tuple[str, ...]:
        """The variables of ``child_env`` that the process of ``role`` and ``rank`` does not get: the
        admin token's (``security.admin_token_env``) unless it holds that token, as the servers and
        worker rank 0 do (``engine.security.credentials.withheld_vars``)."""
        return withheld_vars(self.cfg.security, role, rank)

    def role_env(self, role: str, rank: int) -> dict:
        """What one role's process adds to ``child_env``: its Prometheus port and the restarts so far."""
        return prometheus.child_env(self.cfg, role, rank, self.run_dir, self.restarts)

    def metrics_files(self) -> None:
        """Bring the roles' /metrics URL files into ``run_dir`` (local roles write them there)."""

    def worker_files(self, rank: int) -> tuple[Path, Path]:
        """Worker ``rank``'s result and progress files, removed if an earlier attempt left them."""
        result = self.run_dir / f"worker-{rank}.result.json"
        prog = self.run_dir / f"worker-{rank}.progress.json"
        for f in (result, prog):
            f.unlink(missing_ok=True)
        return result, prog

    def _spawn(self, role: str, rank: int, extra: list[str], env: dict) -> Child:
        log_path = self.run_dir / f"{role}-{rank}.log"
        cmd = self.role_command(role, rank, extra)
        full_env = self.child_env({"ENGINE_PARENT_PID": str(os.getpid()), **self.role_env(role, rank), **env},
                                  self.withheld_env(role, rank))
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True)
        log.debug("started %s %d: pid %d", role, rank, proc.pid)
        return Child(role, rank, proc, log_path)

    def start_servers(self) -> list[str]:
        """Start the servers and wait until each reports its address. Returns ``host:port`` per rank.

        A server beats (``engine.progress``) until it is ready, so one that freezes in its start-up
        (SIGSTOP, a dead host) is found after ``client.dead_after_s``, not ``cluster.startup_timeout_s``.

        Raises
        ------
        LaunchError
            A server exited, stopped beating for ``client.dead_after_s``, or was not ready within
            ``cluster.startup_timeout_s``.
        """
        for r in range(self.cfg.cluster.servers):
            ready = self.run_dir / f"server-{r}.ready"
            prog = self.run_dir / f"server-{r}.progress.json"     # beats until ready (engine.progress)
            for path in (ready, prog):
                path.unlink(missing_ok=True)
            extra = [a for uri in self.allow_load for a in ("--allow-load", uri)]
            child = self._spawn("server", r, ["--port", "0", "--ready-file", str(ready), *extra],
                                {progress.ENV: str(prog)})
            child.ready_path, child.progress_path = ready, prog
            self.servers.append(child)
        deadline = time.monotonic() + self.cfg.cluster.startup_timeout_s
        endpoints: list[str | None] = [None] * len(self.servers)
        next_hang_check = time.monotonic() + HANG_CHECK_S
        while None in endpoints:
            for i, s in enumerate(self.servers):
                if endpoints[i] is None:
                    endpoints[i] = s.ready()
            self._check_alive(self.servers)
            if time.monotonic() >= next_hang_check:    # a server frozen in its start-up stops beating
                self._check_stalled([s for s, e in zip(self.servers, endpoints) if e is None], "before it was ready")
                next_hang_check = time.monotonic() + HANG_CHECK_S
            if time.monotonic() > deadline:
                late = [s.name for s, e in zip(self.servers, endpoints) if e is None]
                raise LaunchError(f"{', '.join(late)} not ready within {self.cfg.cluster.startup_timeout_s}s")
            if None in endpoints:
                time.sleep(POLL_S)
        self.endpoints = [e for e in endpoints if e]
        log.info("servers ready: %s", ",".join(self.endpoints))
        write_endpoints(self.run_dir, self.endpoints, self.cfg)
        self.watch = ServerWatch(self.endpoints, self.cfg.client.dead_after_s,
                                 security=client_security(self.cfg.security, admin=True))
        return self.endpoints

    def start_workers(self) -> None:
        env = {"ENGINE_SERVERS": ",".join(self.endpoints), "ENGINE_NUM_WORKERS": str(self.cfg.cluster.workers)}
        if self.cfg.mode == "hybrid":          # one mpiexec world: rank r = worker r (engine.launch.mpi)
            from .mpi import start_world
            self.workers.extend(start_world(self, env, child=Child))
            return
        for r in range(self.cfg.cluster.workers):
            result, prog = self.worker_files(r)
            child = self._spawn("worker", r, ["--result-file", str(result)], {**env, progress.ENV: str(prog)})
            child.result_path, child.progress_path = result, prog
            self.workers.append(child)

    def _check_alive(self, children: list[Child], *, finished_ok: bool = False) -> None:
        # the first to end is named when its process tells (an MPI world's ranks: the others were
        # killed by mpiexec after it); plain processes keep their order
        for c in sorted(children, key=lambda c: getattr(c.proc, "ended_at", None) or math.inf):
            code = c.proc.poll()
            if code is None or (finished_ok and code in (0, preempt.EXIT_PREEMPTED)):
                continue
            how = c.how(code)
            raise LaunchError(f"{c.name} (pid {c.proc.pid}) {how}; last lines of {c.log_path}:\n{c.tail()}",
                              role=c.role, rank=c.rank, exit_code=code, reason=how, log_tail=c.tail())

    def _check_hangs(self) -> None:
        """Raise LaunchError for a server silent for ``dead_after_s``, stuck or failed, or a stalled worker."""
        if self.watch is not None:
            hung = [(rank, self.watch.silent_reason(rank, silent)) for rank, silent in self.watch.silent()]
            hung += [(rank, f"hung: stuck: {why}") for rank, why in self.watch.stuck()]
            hung += [(rank, f"not live: {why}") for rank, why in self.watch.failed()]
            for rank, reason in hung[:1]:
                c = self.servers[rank]
                raise LaunchError(f"{c.name} (pid {c.proc.pid}) {reason}; last lines of {c.log_path}:\n{c.tail()}",
                                  role=c.role, rank=c.rank, exit_code=None, reason=reason, log_tail=c.tail())
        self._check_stalled([c for c in self.workers if c.role == "worker"])

    def _check_stalled(self, children: list[Child], when: str = "") -> None:
        """Raise LaunchError for the first running child whose progress report (``engine.progress``)
        says it is dead or hung: a worker, or a server before it is ready (it has no address to poll)."""
        dead_after = self.cfg.client.dead_after_s
        now = time.monotonic()          # the reports' clock (engine.progress): a wall-clock step is no hang
        clock = awake.clock()           # ages while this launcher ran: its own stop or freeze is no hang
        reports = {id(c): clock.discount(c.report(), now) for c in children if c.proc.poll() is None}
        for c in children:
            if id(c) not in reports:
                continue
            start = c.started + self.cfg.cluster.startup_timeout_s
            why = progress.stalled(reports[id(c)], now, dead_after, start + clock.asleep(start, now))
            if why:
                c, why = self._frozen_peer(children, reports, now, c, why)
                reason = f"hung{' ' + when if when else ''}: {why} (client.dead_after_s={dead_after:g})"
                raise LaunchError(f"{c.name} (pid {c.proc.pid}) {reason}; last lines of {c.log_path}:\n{c.tail()}",
                                  role=c.role, rank=c.rank, exit_code=None, reason=reason, log_tail=c.tail())

    @staticmethod
    def _frozen_peer(children: list[Child], reports: dict, now: float, c: Child, why: str) -> tuple[Child, str]:
        """(the child to blame, why): a worker that beats but has not stepped is most often waiting for a
        peer (a barrier, an all-reduce) that stopped beating (SIGSTOP, frozen) a moment before the limit
        caught it too; that peer is named, not the rank found first (the hybrid audit: worker 1 stopped,
        worker 0 reported hung)."""
        if not why.startswith("no training step"):
            return c, why
        ages = {id(o): now - float(r.get("mono", now)) for o in children
                if (r := reports.get(id(o))) is not None}
        peer = max((o for o in children if id(o) in ages), key=lambda o: ages[id(o)], default=None)
        if peer is None or peer is c or ages[id(peer)] < max(2.0, ages.get(id(c), 0.0) + 2.0):
            return c, why
        return peer, (f"no heartbeat for {ages[id(peer)]:.0f}s (stopped or frozen process; {c.name} waits: "
                      f"{why})")

    def supervised(self, what: str, fn):
        """Run ``fn()``, one of the launcher's own calls to the servers (a restore, the final checkpoint),
        on a thread while the servers are watched as :meth:`wait_workers` watches them, so a server that
        dies, or stays silent for ``client.dead_after_s``, ends the attempt within that bound (a
        restart) rather than after the call's own deadline (an hour for a ``Load`` or a ``Save``).
        Returns what ``fn`` returns.

        Raises
        ------
        LaunchError
            A server died or hung during the call (also when the call failed because of it: a server
            seen dead within ``GRACE_S`` of the call's error explains it).
        Exception
            Whatever ``fn`` raised while every server stayed up (a damaged checkpoint, say).
        """
        box: dict = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the launcher's thread below
                box["error"] = e
        t = threading.Thread(target=run, name=f"launcher-{what}", daemon=True)
        t.start()
        self.abandoned.append(t)                # until it ends: joined after the servers are stopped
        next_hang_check = time.monotonic() + HANG_CHECK_S
        while True:
            t.join(POLL_S)
            if not t.is_alive():                # a call that ended is judged by its own outcome
                break
            self._check_alive(self.servers)
            if time.monotonic() >= next_hang_check:
                self._check_hangs()
                next_hang_check = time.monotonic() + HANG_CHECK_S
        self.abandoned.remove(t)
        if "error" in box:
            # the call fails as soon as a killed server's connection drops; its exit is seen a moment later
            grace = time.monotonic() + self.GRACE_S
            while time.monotonic() < grace:
                self._check_alive(self.servers)
                time.sleep(POLL_S)
            raise box["error"]
        return box.get("value")

    GRACE_S = 1.0      # seconds a failed launcher call waits to see whether a server died under it

    def preempt(self) -> None:
        """Forward a preemption (SIGTERM) to every worker; they checkpoint at their next meeting and
        exit ``EXIT_PREEMPTED``. ``wait_workers`` gives up after ``cluster.preempt_timeout_s``."""
        if self.preempt_deadline is None:
            self.preempt_deadline = time.monotonic() + self.cfg.cluster.preempt_timeout_s
        for w in self.workers:
            if w.proc.poll() is None and w.rank not in self._preempted:
                self._preempted.add(w.rank)
                try:
                    w.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def worker_reports(self) -> list[dict | None]:
        """Each worker's last progress report (``engine.progress``), None where there is none."""
        return [w.report() for w in self.workers]

    def wait_workers(self, timeout: float | None = None) -> list[dict]:
        """Wait for every worker to exit 0 (servers must stay up meanwhile); returns their results.

        Raises
        ------
        LaunchError
            A worker or server died, or ``timeout`` seconds passed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        next_hang_check = 0.0
        while any(w.proc.poll() is None for w in self.workers):
            self._check_alive(self.workers, finished_ok=True)
            self._check_alive(self.servers)
            if self.preempt_deadline is not None and time.monotonic() > self.preempt_deadline:
                raise LaunchError(f"preempted: the workers did not reach a checkpoint within "
                                  f"cluster.preempt_timeout_s={self.cfg.cluster.preempt_timeout_s:g}",
                                  reason="preempt timeout")
            if time.monotonic() >= next_hang_check:
                self._check_hangs()
                if not self._metrics_announced:
                    self.metrics_files()
                    self._metrics_announced = prometheus.announce(self.cfg, self.run_dir, self.servers + self.workers)
                next_hang_check = time.monotonic() + HANG_CHECK_S
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"workers did not finish within {timeout}s")
            time.sleep(POLL_S)
        self._check_alive(self.workers, finished_ok=True)
        results = []
        for w in self.workers:
            r = w.result()
            results.append(r if r is not None else {"rank": w.rank, "result": None})
        return results

    def stop_servers(self) -> None:
        """Ask the servers to stop (Stop RPC), then terminate whatever is left."""
        if self.watch is not None:
            self.watch.close()
        if self.endpoints:
            try:
                with connect(self.cfg, self.endpoints, name="launcher", admin=True, timeout_s=5.0,
                             retries=0) as c:
                    c.stop()
            except Exception as e:  # noqa: BLE001 - best effort; terminate() below is the backstop
                log.info("stop RPC failed: %s", e)
        self._terminate(self.servers, grace=self.cfg.cluster.stop_timeout_s)

    def shutdown(self) -> None:
        """Stop every child still running: SIGKILL to its process group (a stopped process too). A
        child's SIGTERM means preemption (``engine.preempt``), which is not what ends an attempt: what
        an ended attempt trained is rolled back to a checkpoint anyway. Idempotent."""
        if self.watch is not None:
            self.watch.close()
        self._terminate(self.workers + self.servers, grace=0.0)
        prometheus.withdraw(self.cfg, self.run_dir)     # no role of this attempt is left to scrape

    @staticmethod
    def _terminate(children: list[Child], grace: float) -> None:
        alive = [c for c in children if c.proc.poll() is None]
        for c in alive:
            c.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in alive:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in children:
            if c.proc.poll() is None:
                c.signal_group(signal.SIGKILL)
            try:
                c.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) did not exit after SIGKILL", c.name, c.proc.pid)
            c.signal_group(signal.SIGKILL)   # any grandchildren left in its group

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.servers + self.workers]

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.join_abandoned()

    ABANDONED_JOIN_S = 60.0   # seconds to wait for a call a failure left running, once the servers are gone

    def join_abandoned(self) -> None:
        """Wait (up to ``ABANDONED_JOIN_S``) for the calls a failed attempt left running: a restore, a
        checkpoint save. With the servers stopped their RPCs fail fast; a save whose every part was
        already written may still publish, and it must do so before the next attempt looks for the
        newest checkpoint, not while that attempt restores (a base's retention could prune the chain
        being loaded)."""
        deadline = time.monotonic() + self.ABANDONED_JOIN_S
        for t in self.abandoned:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("the launcher's %s call is still running %gs after its attempt ended; the next "
                            "attempt goes on without it", t.name, self.ABANDONED_JOIN_S)
        self.abandoned = [t for t in self.abandoned if t.is_alive()]


def new_run_dir(cfg: EngineConfig) -> Path:
    """A new run directory ``{cluster.run_root}/{job}-{YYYYmmdd-HHMMSS}-{pid}`` (the time in UTC, whatever
    ``TZ`` says; job: ``checkpoint.job`` or ``model.kind``; ``-2``, ``-3`` ... appended if taken, e.g. a restart in the same second), and
    ``{run_root}/latest`` re-pointed at it (a relative symlink, replaced atomically).

    Raises
    ------
    LaunchError
        ``cluster.run_root`` cannot be created or written.
    """
    root = Path(cfg.cluster.run_root).resolve()
    name = f"{cfg.checkpoint.job or cfg.model.kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            path = root / (name if n == 1 else f"{name}-{n}")
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        tmp = root / f".{LATEST}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.name)
        os.replace(tmp, root / LATEST)
    except OSError as e:
        raise LaunchError(f"cluster.run_root: cannot make a run directory under {root}: {e}") from None
    return path


def write_endpoints(run_dir: Path, endpoints: list[str], cfg: EngineConfig) -> None:
    """``run_dir/endpoints.json``: the servers' ``host:port`` in rank order, the worker count and the
    launcher's pid (written atomically), for ``engine status RUN_DIR``."""
    data = {"endpoints": list(endpoints), "workers": cfg.cluster.workers, "launcher_pid": os.getpid(),
            "time": time.time()}
    tmp = run_dir / f".{ENDPOINTS_FILE}.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, run_dir / ENDPOINTS_FILE)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
