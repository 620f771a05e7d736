"""The recovery rule: one job, run until it finishes, restarted whole from the newest complete checkpoint
of its own when any role dies or hangs.

``run_job`` is what ``engine train CONFIG`` runs. One attempt starts the servers, restores a checkpoint
when there is one to resume from, starts the workers, and waits for them (``engine.launch.local``; a
death or a hang is a ``LaunchError`` naming the role and rank). When an attempt fails, every process
of it is stopped and the next attempt restores the newest complete checkpoint the job wrote
(``checkpoint.root``/``checkpoint.job``; a damaged one falls back to the previous complete one the job
wrote, then to the one it started from, naming what it skipped), so servers restore their vshards (onto
any server count) and workers resume at the data position that checkpoint records. With none written
yet, it restores what the first attempt resumed from (``--resume``), else starts again from the
beginning: never a checkpoint of the job root that predates the job (``job_checkpoints.recovery_target``),
so a deliberate ``--resume`` of an older checkpoint is not undone by a crash, and a job started afresh
never restores an earlier run's model. After ``cluster.max_restarts`` restarts within
``cluster.restart_window_s`` seconds the next failure ends the job with every failure listed (role,
rank, exit, last log lines).

The final JSON line gains ``restarts`` and ``examples_replayed``: the examples trained by failed
attempts after the checkpoint the next attempt resumed from (work that was lost and done again). A
worker's progress report (``engine.progress``) counts its examples and marks the count at each
aligned checkpoint position (``"epoch:batch"``, online ``"partition:NAME"``); the lost examples of
a worker are its count at the failure minus its mark at the resumed checkpoint's position (all of
them when there is no such mark: the attempt's whole work was lost).

Only *who* restarts is local here: *what* state a restart resumes from is
``job_checkpoints.recovery_target``, the same for any launcher (``engine/launch/`` holds one per
scheduler over this rule).
"""
from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .. import job_checkpoints as ckpt_job
from ..config import EngineConfig
from ..errors import EXIT_STORAGE_REFUSED, REFUSED_ENDS, LaunchError, PlacementError, StoppedWhilePlacing
from ..modes import LOCKSTEP_MODES
from .local import LocalCluster

log = logging.getLogger(__name__)


#: failures older than ``cluster.restart_window_s`` kept for the message of a job that gives up (the
#: newest; each holds its log's last lines): a job restarted once an hour for a month kept all 720
MAX_OLDER_FAILURES = 20


@dataclass
class Failure:
    """One failed attempt: which role, what happened, its last log lines."""

    attempt: int
    role: str
    rank: int
    exit_code: int | None
    reason: str
    log_tail: str
    at: float                      # time.monotonic() of the failure

    def describe(self) -> str:
        who = f"{self.role} {self.rank}" if self.role else "the launcher"
        return f"attempt {self.attempt}: {who}: {self.reason}\n    " + "\n    ".join(
            (self.log_tail or "(no log)").splitlines()[-8:])


def _refused(e: LaunchError) -> OSError:
    """The ``hdfs_io.StorageUnavailableError`` a launcher ends on when a role exited
    ``EXIT_STORAGE_REFUSED``: the storage's error from the role's own line (``engine train: checkpoint
    storage failed: ...``), marked permanent (``hdfs_io.permanent_failure``), so ``engine train`` ends at
    once with its resumable line instead of restarting the job into the same failed save."""
    from hdfs_io import PERMANENT_MARKER, StorageUnavailableError
    prefix = "engine train: checkpoint storage failed: "
    lines = [ln.strip() for ln in (e.log_tail or "").splitlines() if prefix in ln]
    error = lines[-1].split(prefix, 1)[1].split("; " + REFUSED_ENDS, 1)[0] if lines else e.reason
    err = StorageUnavailableError(f"{e.role} {e.rank}: {error}")
    if PERMANENT_MARKER not in error:           # the role's line was not in its log's tail
        err.refused = f"{e.role} {e.rank}'s log names it"
    return err


def position_key(manifest: dict) -> str | None:
    """The progress mark of a checkpoint's data position: ``"epoch:batch"`` (offline), or
    ``"partition:NAME"`` (online: the last partition consumed); None without one."""
    train = (manifest.get("sources") or {}).get("train") or {}
    if "epoch" in train and "batch" in train:
        return f"{int(train['epoch'])}:{int(train['batch'])}"
    if train.get("partition"):
        return f"partition:{train['partition']}"
    return None


def lost_examples(reports: list[dict | None], key: str | None, *, lockstep: bool = False) -> int:
    """Examples the workers trained after the position ``key`` (see the module docstring).

    ``lockstep`` (sync, hybrid: ``engine.modes.LOCKSTEP_MODES``): every worker trained as many steps as the
    furthest one, whose count stands for all (``reports``: one per worker, None for none). A report is
    written every half second, so a worker killed with its peers (an MPI world's abort) may have
    reported fewer steps than it ran: the sum undercounted (the hybrid audit: 128 for 256)."""
    lost = []
    for r in reports:
        if not isinstance(r, dict):     # no report (None), or none readable from a lost worker
            continue
        examples = int(r.get("examples", 0))
        mark = (r.get("marks") or {}).get(key) if key else None
        lost.append(examples - int(mark) if mark is not None else examples)
    if lockstep and lost:
        return max(lost) * len(reports)
    return sum(lost)


class Supervisor:
    """Runs attempts of one job until it finishes or fails too often.

    Parameters
    ----------
    cfg : EngineConfig
    program : module
        The worker program (``engine.programs.load_program``), already ``prepare``d.
    run_dir : str or Path, optional
        Attempt 0 runs here, attempt k in ``run_dir/restart-k``.
    resume : str or None
        The first attempt's ``--resume`` (None: no restore; "": the newest checkpoint; else a URI).
    resume_fallback : bool
    """

    def __init__(self, cfg: EngineConfig, program, run_dir=None, *, resume: str | None = None,
                 resume_fallback: bool = False):
        self.cfg, self.program, self.run_dir = cfg, program, run_dir
        self.resume, self.fallback = resume, resume_fallback
        self.requested = resume
        # the recovery rule's lineage: checkpoints named above the floor were written by this job; the
        # origin is what its first attempt restored ("" nothing, None: its restore has not completed)
        self.floor, self.floor_known = None, True
        try:
            self.floor = ckpt_job.newest_name(cfg)
        except Exception as e:  # noqa: BLE001 - the store may answer again: read once more before training
            log.warning("cannot list the job's checkpoints (%s); reading them again before the workers start", e)
            self.floor_known = False
        self.origin: str | None = None
        # the job root of an explicit --resume URI (its chain's base and deltas lie below it)
        self.first_resume = ckpt_job.manager_for(cfg, resume)[0].uri if resume else ""
        self.failures: list[Failure] = []   # the failures within the window, and the newest older ones
        self.failed = 0                     # every failure of the job
        self.restarts = 0
        self.examples_replayed = 0
        self.checkpoint: str | None = None
        self.preempt_requested = False
        self.preempted = False
        self._cluster: LocalCluster | None = None
        if cfg.cluster.launcher == "ray":      # the same rule over Ray actors (engine.launch.ray)
            from .ray import RayCluster, require_ray
            require_ray()
            self.cluster_class = RayCluster
        else:
            self.cluster_class = LocalCluster

    def preempt(self, *_) -> None:
        """SIGTERM to the launcher: the running attempt's workers checkpoint at their next meeting and
        stop (``engine.preempt``); no restart follows."""
        if not self.preempt_requested:
            log.warning("SIGTERM: preempting the job (a checkpoint at the next meeting, within "
                        "cluster.preempt_timeout_s=%g s)", self.cfg.cluster.preempt_timeout_s)
        self.preempt_requested = True
        if self._cluster is not None:
            self._cluster.preempt()

    def run(self) -> list[dict]:
        """Run attempts until one finishes; returns its workers' results.

        Raises
        ------
        LaunchError
            More than ``cluster.max_restarts`` failures within ``cluster.restart_window_s`` (the
            message lists every failure), or a failure before any worker started that a restart
            cannot mend (a server that cannot start).
        PlacementError
            The Ray launcher could not place an attempt's roles within ``cluster.startup_timeout_s`` (no
            live node offers a role's resources); its ``resume`` says what the job continues from.
        hdfs_io.StorageUnavailableError
            A role exited ``EXIT_STORAGE_REFUSED``: its checkpoint storage refuses writes for good
            (read-only, access refused, full); not restarted (``_refused``).
        """
        attempt = 0
        while True:
            run_dir = (self.run_dir if attempt == 0 or self.run_dir is None
                       else Path(self.run_dir) / f"restart-{attempt}")
            # the operator's --resume URI may lie outside checkpoint.root: its servers may load from it
            try:
                cluster = self._cluster = self.cluster_class(
                    self.cfg, run_dir, allow_load=(self.first_resume,) if self.first_resume else (),
                    stopping=lambda: self.preempt_requested)
            except PlacementError as e:     # no node offers a role's resources (a lost node not replaced)
                e.resume = self.resume      # what this attempt would have restored: a later run does
                raise
            except StoppedWhilePlacing as e:    # SIGTERM while Ray placed the roles: nothing started to wait for
                log.warning("%s: the job stops resumable, nothing of this attempt started", e)
                self._stopped_preempted()
                return []
            if self.run_dir is None:    # a new run dir of its own: the restarts go below it, where the
                self.run_dir = cluster.run_dir      # launcher's log and engine status find them
            cluster.restarts = self.restarts     # the children's engine_restarts_total (engine.observability)
            try:
                with cluster:
                    return self._attempt(cluster)
            except LaunchError as e:
                if self.preempt_requested:          # stopped on purpose: resumable, not restarted
                    log.warning("preempted before a checkpoint meeting: %s", e.reason)
                    self._stopped_preempted()
                    return []
                self._failed(attempt, e, cluster)
            finally:
                self._cluster = None
            attempt += 1

    def _stopped_preempted(self) -> None:
        self.preempted = True
        target = ckpt_job.recovery_target(self.cfg, self.floor, self.origin)
        self.checkpoint = target[0] if target else None

    def _failed(self, attempt: int, e: LaunchError, cluster: LocalCluster) -> None:
        f = Failure(attempt, e.role, e.rank, e.exit_code, e.reason, e.log_tail, time.monotonic())
        self.failures.append(f)
        self.failed += 1
        c = self.cfg.cluster
        recent = [x for x in self.failures if f.at - x.at <= c.restart_window_s]
        older = self.failures[:len(self.failures) - len(recent)]
        # a job that runs for months keeps the failures that count and the newest older ones only
        self.failures = older[len(older) - min(len(older), MAX_OLDER_FAILURES):] + recent
        if e.exit_code == EXIT_STORAGE_REFUSED:      # the checkpoint storage refuses writes for good
            raise _refused(e)
        usage = e.exit_code == 2          # a config or usage error: a restart fails the same way
        if len(recent) > c.max_restarts or usage:
            why = (f"{e.role} {e.rank} exited with code 2 (a config or usage error)" if usage else
                   f"{len(recent)} failures within cluster.restart_window_s={c.restart_window_s:g}s, "
                   f"cluster.max_restarts={c.max_restarts}")
            unlisted = self.failed - len(self.failures)
            raise LaunchError(f"giving up after {self.failed} failure(s) ({why}):\n"
                              + (f"({unlisted} older failure(s) not listed)\n" if unlisted else "")
                              + "\n".join(x.describe() for x in self.failures),
                              role=e.role, rank=e.rank, exit_code=e.exit_code, reason=e.reason,
                              log_tail=e.log_tail) from None
        target = ckpt_job.recovery_target(self.cfg, self.floor, self.origin)
        lost = lost_examples(cluster.worker_reports(), position_key(target[1]) if target else None,
                             lockstep=self.cfg.mode in LOCKSTEP_MODES)
        self.examples_replayed += lost
        self.restarts += 1
        if target is not None:
            self.resume = target[0]
        elif self.origin is None:         # the first restore did not complete: the same request again
            self.resume = self.requested
        else:
            self.resume = None
        self.fallback = True
        log.warning("%s failed (%s); restart %d/%d from %s (%d examples to train again)",
                    f"{e.role} {e.rank}" if e.role else "the job", e.reason, self.restarts, c.max_restarts,
                    target[0] if target else ("the beginning (no checkpoint yet)" if self.resume is None
                                              else f"--resume {self.resume or '(the newest)'} again"), lost)

    def _floor_before_training(self) -> None:
        """The job root could not be listed when the job started: list it now, while nothing of this job
        is written yet (its workers write its checkpoints), so the floor still tells the job's own
        checkpoints from an earlier run's. Without it a restart would restore the root's newest checkpoint,
        an earlier run's model, as the job's own.

        Raises
        ------
        hdfs_io.StorageError
            Still unreadable (after ``hdfs_io``'s retries): the job ends before its workers start, nothing
            trained (the message says so; ``nothing_trained`` is set).
        """
        try:
            self.floor = ckpt_job.newest_name(self.cfg)
        except OSError as e:
            from hdfs_io import StorageUnavailableError
            err = StorageUnavailableError(
                f"the job's checkpoints cannot be listed before its workers start, so a restart could not tell "
                f"them from an earlier run's; nothing was trained ({type(e).__name__}: {e})",
                uri=getattr(e, "uri", None))
            err.nothing_trained = True
            raise err from e
        self.floor_known = True
        log.info("the job's checkpoints listed: its own are named above %s", self.floor or "nothing (none yet)")

    def _attempt(self, cluster: LocalCluster) -> list[dict]:
        cfg, program = self.cfg, self.program
        own_checkpoints = getattr(program, "WRITES_CHECKPOINTS", False)
        state = {"cfg": cfg, "periodic": None}
        log.info("run directory: %s", cluster.run_dir)
        cluster.start_servers()
        try:
            if self.resume is not None:
                # supervised: a server that dies or hangs inside the restore is a failure like any other
                # a restart's restore of a checkpoint the job wrote keeps to the job's own, then its origin
                restart = self.origin is not None and self.resume != self.origin
                state["cfg"] = cluster.supervised("restore", lambda: ckpt_job.resume(
                    cfg, cluster.endpoints, self.resume or None, fallback=self.fallback,
                    floor=self.floor if restart else None, origin=self.origin if restart else None))
                cluster.write_config(state["cfg"])
            if self.origin is None:
                self.origin = state["cfg"].checkpoint.restored or ""
            if not self.floor_known:
                self._floor_before_training()
            if state["cfg"].checkpoint.enabled and not own_checkpoints:
                state["periodic"] = ckpt_job.Periodic(state["cfg"], cluster.endpoints)
            cluster.start_workers()
            if self.preempt_requested:
                cluster.preempt()
            results = cluster.wait_workers()
        except BaseException:
            # a failed attempt does not wait here for a scheduled save in progress: it may be stuck on the
            # very server that failed; the cluster joins it once its servers are stopped (join_abandoned)
            if state["periodic"] is not None:
                state["periodic"].stop(wait=False)
                cluster.abandoned.append(state["periodic"].thread)
            raise
        if state["periodic"] is not None:       # a save in progress ends, watched like the final one
            cluster.supervised("scheduled checkpoint", state["periodic"].stop)
        if any(r.get("preempted") for r in results):
            self._stopped_preempted()
            cluster.stop_servers()
            return results
        if own_checkpoints:
            self.checkpoint = next((r.get("checkpoint") for r in results if r.get("rank") == 0), None)
        else:
            mgr = state["periodic"].mgr if state["periodic"] is not None else None
            step = max([r.get("steps", 0) for r in results] + [0])
            self.checkpoint = cluster.supervised("final checkpoint", lambda: ckpt_job.final(
                state["cfg"], cluster.endpoints, step=step, mgr=mgr))
        cluster.stop_servers()
        return results


def run_job(cfg: EngineConfig, program, run_dir=None, *, resume: str | None = None,
            resume_fallback: bool = False) -> dict:
    """Run the job under supervision; returns the final JSON object (the program's ``final`` or the
    default one) with ``checkpoint``, ``restarts`` and ``examples_replayed``.

    Raises
    ------
    LaunchError
        The job failed more often than ``cluster.max_restarts`` allows (every failure is listed).
    ConfigError
        The servers would listen off loopback without TLS and tokens (``engine.security.listen``).
    """
    from ..security.listen import check_listen
    check_listen(cfg.cluster.host, cfg.security)      # before any process starts: exit 2 with the keys
    sup = Supervisor(cfg, program, run_dir, resume=resume, resume_fallback=resume_fallback)
    previous = signal.signal(signal.SIGTERM, sup.preempt)
    try:
        with (program.follow(cfg) if hasattr(program, "follow") else contextlib.nullcontext()):
            results = sup.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if sup.preempted:
        return {"event": "final", "model": cfg.model.kind, "mode": cfg.mode, "preempted": True,
                "checkpoint": sup.checkpoint, "restarts": sup.restarts,
                "examples_replayed": sup.examples_replayed}
    if hasattr(program, "final"):
        final = program.final(cfg, results)
    else:
        final = {"event": "final", "model": cfg.model.kind, "mode": cfg.mode, "workers": results}
    final["checkpoint"] = sup.checkpoint
    final["restarts"] = sup.restarts
    final["examples_replayed"] = sup.examples_replayed
    return final
