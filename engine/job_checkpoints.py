"""Checkpoints of an ``engine train`` job, seen from the launcher (the coordinator of a local job).
It composes the checkpoint package with a PS client, so it lives above both (``engine.checkpoint``
never imports ``engine.ps``).

* ``--resume [URI]``: after the servers are up and before any worker starts, ``resume`` loads the
  newest complete checkpoint under ``checkpoint.root/job`` (or the one URI names) onto every server,
  and records its name in ``checkpoint.restored`` so the workers (which get the updated config) know
  what was restored: its step, source positions and consumed partitions.
* while a job trains, ``Periodic`` writes a delta every ``checkpoint.delta_every`` of training time
  (elapsed, on the monotonic clock) and a base every ``checkpoint.base_every``, from a background thread of the launcher (each
  server snapshots its shards consistently while pushes go on);
* at the end of a finite job, ``final`` writes one more checkpoint (a delta on top of the restored one,
  else a base) unless the program writes its own (``WRITES_CHECKPOINTS = True``, e.g. online jobs).

URI forms accepted by ``--resume``: a checkpoint directory (``s3://b/ckpt/ctr/20240101/0100-delta``)
or a job root (``s3://b/ckpt/ctr``: its newest complete checkpoint); no URI: the config's root and job.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

from .checkpoint.coordinator import CheckpointManager, CheckpointNotFoundError
from .checkpoint.manifest import parse_name, ref_of_uri
from .checkpoint.schedule import Schedule
from .errors import ConfigError, RestoreMismatchError
from .connect import connect

__all__ = ["job_name", "manager_for", "job_manager", "newest_name", "check_resume_id", "resumed_since",
           "recovery_target", "resume", "final", "Periodic"]

log = logging.getLogger(__name__)


def job_name(cfg) -> str:
    return cfg.checkpoint.job or (cfg.model.kind if cfg.model is not None else "job")


def manager_for(cfg, uri: str | None = None) -> tuple[CheckpointManager, str | None]:
    """(manager, target name or None for the newest) for the config's root or a ``--resume`` URI.

    Raises
    ------
    ConfigError
        Neither a URI nor ``checkpoint.root`` is given.
    """
    ck = cfg.checkpoint
    opts = cfg.storage.options()
    if uri:
        parts = uri.rstrip("/").split("/")
        ref = ref_of_uri(uri)
        if len(parts) >= 4 and ref is not None:
            return (CheckpointManager("/".join(parts[:-3]) or "/", parts[-3], keep_bases=ck.keep_bases,
                                      storage_options=opts), "/".join(parts[-2:]))
        return CheckpointManager("/".join(parts[:-1]) or "/", parts[-1], keep_bases=ck.keep_bases,
                                 storage_options=opts), None
    if not ck.root:
        raise ConfigError("checkpoint.root: empty; set it (or pass --resume URI) to resume from a checkpoint")
    return CheckpointManager(ck.root, job_name(cfg), keep_bases=ck.keep_bases, storage_options=opts), None


def newest(cfg) -> tuple[str, dict] | None:
    """(URI, manifest) of the job's newest complete checkpoint under ``checkpoint.root``/``job``; None
    without one or without ``checkpoint.root``."""
    if not cfg.checkpoint.enabled:
        return None
    mgr = job_manager(cfg)
    try:
        name = mgr.resolve(None)
    except CheckpointNotFoundError:
        return None
    return mgr.uri_of(name), mgr.manifest(name)


def newest_name(cfg) -> str | None:
    """The name (``YYYYMMDD/HHMM-kind[.N]``) of the job's newest complete checkpoint under
    ``checkpoint.root``/``job``: "" when it has none, None when checkpoints are off. Taken when a job (or
    a role-mode server) starts, it is the job's *floor*: names under a job root only grow
    (``CheckpointManager`` names each checkpoint after the newest), so every checkpoint named above it
    was written since, by this job (``recovery_target``)."""
    if not cfg.checkpoint.enabled:
        return None
    ref = job_manager(cfg).latest()
    return ref.name if ref is not None else ""


def above_floor(name: str, floor: str | None) -> bool:
    """Whether checkpoint ``name`` was written after the floor ``floor`` was taken (``newest_name``;
    None: no floor is known, every checkpoint counts)."""
    if not floor:
        return True
    a, b = parse_name(name), parse_name(floor)
    return a is None or b is None or a > b


def recovery_target(cfg, floor: str | None, origin: str | None = None) -> tuple[str, dict] | None:
    """(URI, manifest) of the checkpoint a restarted job restores: the job's newest complete checkpoint
    when it lies above ``floor`` (this job wrote it), else ``origin`` (the checkpoint the job started
    from: its first ``--resume``, possibly under another root), else None (start again from the
    beginning). Never a checkpoint the job did not write or start from: after ``--resume`` of an older
    checkpoint (an operator's deliberate roll-back), the newer ones it rolled back from are left alone,
    and a job started afresh beside an earlier run's checkpoints never restores them. An ``origin``
    whose manifest cannot be read comes with an empty manifest (its restore names the damage)."""
    mgr = job_manager(cfg) if cfg.checkpoint.enabled else None
    latest = mgr.latest() if mgr is not None else None
    if latest is not None and above_floor(latest.name, floor):     # its manifest read only when it counts
        return mgr.uri_of(latest.name), mgr.manifest(latest.name)
    if origin:
        mgr, name = manager_for(cfg, origin)
        try:
            return origin, mgr.manifest(mgr.resolve(name))
        except (CheckpointNotFoundError, OSError, ValueError) as e:   # the restore will name what is wrong
            log.warning("the checkpoint this job started from, %s, cannot be read now: %s", origin, e)
            return origin, {}
    return None


#: what a ``--resume-id`` may be (it is a pod argument and a manifest value)
RESUME_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_resume_id(resume: str | None, resume_id: str | None) -> None:
    """Refuse a ``--resume-id`` without ``--resume URI`` or that ``RESUME_ID`` does not match.

    Raises
    ------
    ConfigError
        Either; the message names the flag.
    """
    if resume_id is None:
        return
    if not resume:
        raise ConfigError("--resume-id: only with --resume URI")
    if not RESUME_ID.fullmatch(resume_id):
        raise ConfigError(f"--resume-id: 1-64 letters, digits, '.', '_' or '-', got {resume_id!r}")


def resumed_since(cfg, resume_id: str, uri: str) -> tuple[str, str] | None:
    """(URI of the job's newest complete checkpoint, fallback floor) when that checkpoint was written by
    servers started with ``--resume uri --resume-id resume_id`` (its manifest's ``resumed_with``), else
    None (restore ``uri`` itself). The floor is the name of the newest checkpoint before that resume's
    unbroken run of checkpoints ("" when the run reaches the oldest): a fallback from a damaged one
    keeps to the run, never to checkpoints the operator rolled back from (``CheckpointManager.restore``).

    ``engine k8s --resume URI`` renders every server with ``--resume URI --resume-id ID`` for the job's
    whole life. A server pod replaced after the job wrote checkpoints from that resume on must not load
    URI again: with every server replaced at once (a node drain, a whole-job preemption) all of them
    would agree on URI and the job would silently lose what it trained since. Only the newest
    checkpoint counts: one from an older render with the same id and URI, under newer checkpoints of
    another render, is not this resume's (rendering ``--resume URI`` again is a new roll-back then). A
    manifest that is damaged is judged by its neighbours (logged); the restore names the damage.

    Raises
    ------
    OSError
        The storage cannot be read (``hdfs_io.StorageError`` after its retries): no guess is made.
    """
    if not cfg.checkpoint.enabled:
        return None
    from hdfs_io import CheckpointCorruptError, NotPublishedError
    mgr = job_manager(cfg)
    refs = mgr.list()
    mark = {"id": str(resume_id), "uri": str(uri)}
    recorded = False        # the newest readable manifest records the mark
    floor = ""
    for i in range(len(refs) - 1, -1, -1):
        try:
            m = mgr.manifest(refs[i].name)
        except (CheckpointCorruptError, NotPublishedError) as e:     # damage only: an outage raises
            log.warning("--resume-id %s: the manifest of %s cannot be read (%s); judged by its neighbours",
                        resume_id, mgr.uri_of(refs[i].name), e)
            continue
        if mark not in (m.get("resumed_with") or []):
            floor = refs[i].name
            break
        recorded = True
    if not recorded:
        return None
    return mgr.uri_of(refs[-1].name), floor


def _client(cfg, endpoints):
    return connect(cfg, endpoints, name="launcher", admin=True)


def resume(cfg, endpoints: list[str], uri: str | None, *, fallback: bool = False, floor: str | None = None,
           origin: str | None = None):
    """Restore onto the servers at ``endpoints``; returns the config with ``checkpoint.restored`` set.

    A restart's restore (``recovery_target``) passes the job's ``floor`` and ``origin``: a damaged
    checkpoint falls back only to older ones the job wrote, then to ``origin`` (what it started from),
    never to a checkpoint from before the job.

    Raises
    ------
    CheckpointNotFoundError, hdfs_io.CheckpointCorruptError
        Nothing to restore / damaged (the message names the file).
    ConfigError
        The checkpoint does not fit the config's tables (a server's ``RestoreMismatchError``: a table
        missing or renamed, another dim or optimizer; nothing loaded): a restart would fail the same way.
    """
    from hdfs_io import CheckpointCorruptError

    mgr, target = manager_for(cfg, uri)
    with _client(cfg, endpoints) as client:
        client.wait_ready(cfg.cluster.startup_timeout_s)
        try:
            manifest = mgr.restore(client, target, fallback=fallback or cfg.checkpoint.fallback, floor=floor)
        except RestoreMismatchError as e:
            raise ConfigError(f"cannot resume: {e.message}; change the config or resume another checkpoint") from None
        except CheckpointCorruptError as e:
            if not origin or origin == uri:
                raise
            log.warning("every checkpoint this job wrote is damaged (%s); falling back to %s, the one it "
                        "started from", e, origin)
            mgr, target = manager_for(cfg, origin)
            manifest = mgr.restore(client, target)
    restored = mgr.uri_of(manifest["name"])
    log.info("resumed from %s (step %s)", restored, manifest.get("step"))
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, restored=restored))


def job_manager(cfg) -> CheckpointManager:
    """The manager of the config's root/job, continuing the chain of a restored checkpoint there."""
    mgr, _ = manager_for(cfg)
    restored = cfg.checkpoint.restored
    if restored and restored.startswith(mgr.uri.rstrip("/") + "/"):
        mgr.head = restored[len(mgr.uri.rstrip("/")) + 1:]
    return mgr


class Periodic:
    """Background checkpoints of a running job on the schedule of ``checkpoint``: its periods are measured
    on the launcher's monotonic clock (a step of the wall clock, NTP or an operator's ``date -s``, neither
    stops nor hastens them); the wall clock (UTC) only names each checkpoint.

    Parameters
    ----------
    cfg : EngineConfig
    endpoints : list of str
    poll_s : float, seconds
        How often the schedule is checked.
    """

    def __init__(self, cfg, endpoints: list[str], *, poll_s: float = 5.0):
        self.cfg, self.endpoints = cfg, endpoints
        self.mgr = job_manager(cfg)
        self.schedule = Schedule(cfg.checkpoint, start_s=time.monotonic())
        self.written: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(poll_s,), name="checkpoint-schedule", daemon=True)
        self.thread.start()

    def _run(self, poll_s: float) -> None:
        client = None
        try:
            while not self._stop.wait(poll_s):
                mono = time.monotonic()      # the periods: a step of the wall clock moves no checkpoint
                kind = self.schedule.due(mono)
                if kind is None:
                    continue
                client = client or _client(self.cfg, self.endpoints)
                try:
                    m = self.mgr.save(client, kind, when=time.time(), config=self.cfg.to_dict())
                    self.written.append(self.mgr.uri_of(m["name"]))
                except Exception as e:  # noqa: BLE001 - training goes on; the next checkpoint is a base
                    log.error("scheduled %s checkpoint failed: %s", kind, e)
                self.schedule.done(kind, mono)
        finally:
            if client is not None:
                client.close()

    def stop(self, wait: bool = True) -> CheckpointManager:
        """Stop the thread; returns the manager (its head continues). ``wait``: wait for a save in
        progress (the default, at a job's end); False when the attempt failed, so a save stuck on a dead
        or frozen server (its deadline is an hour) does not hold the restart; the thread is a daemon and
        its save fails when the attempt's servers are stopped (``LocalCluster.join_abandoned`` waits for it)."""
        self._stop.set()
        if wait:
            self.thread.join()
        return self.mgr


def final(cfg, endpoints: list[str], *, step: int = 0, extra: dict | None = None,
          mgr: CheckpointManager | None = None) -> str | None:
    """Write the end-of-job checkpoint; returns its URI (None when checkpoints are off)."""
    ck = cfg.checkpoint
    if not ck.enabled or not ck.final:
        return None
    mgr = mgr or job_manager(cfg)
    with _client(cfg, endpoints) as client:
        manifest = mgr.save(client, "delta" if mgr.head else "base", step=step, config=cfg.to_dict(),
                            extra=extra or {})
    return mgr.uri_of(manifest["name"])
