"""Running one role in this process: a parameter server or a worker.

Used by the launcher's children and by multi-host schedulers (Kubernetes, Slurm, mpirun)::

    engine train CONFIG.yaml --role server --rank 0 [--port 50051] [--ready-file F]
    ENGINE_SERVERS=h0:50051,h1:50051 ENGINE_NUM_WORKERS=4 engine train CONFIG.yaml --role worker --rank 2

Server endpoints come from ``cluster.endpoints`` or ``ENGINE_SERVERS`` (which wins); the number of
workers from ``ENGINE_NUM_WORKERS`` or ``cluster.workers``; ``ENGINE_ROLE`` and ``ENGINE_RANK`` stand
in for ``--role``/``--rank``. A child of the local launcher (``ENGINE_PARENT_PID`` set) dies with it:
PR_SET_PDEATHSIG on Linux plus a watchdog thread polling the parent pid.

The config file the launcher writes holds no inline storage secret; a role takes each empty
``storage.access_key`` / ``storage.secret_key`` from ``ENGINE_STORAGE_ACCESS_KEY`` /
``ENGINE_STORAGE_SECRET_KEY``, which the launcher sets for its children (``engine.config.restore_secrets``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import failpoints, preempt, progress
from .config import EngineConfig, restore_secrets
from .connect import connect
from .errors import (BarrierTimeoutError, CheckpointStorageError, ConfigError, GenerationChangedError, LaunchError,
                     PSTimeoutError, RestoreMismatchError, ShardUnavailableError)
from .launch.procs import die_with_parent

log = logging.getLogger(__name__)


#: a worker's exit code when the servers' state changed under it (a generation mismatch) or it lost a server
#: (unreachable past client.dead_after_s and the retries): restart it
EXIT_ROLLBACK = 76
#: rank 0's roll-back of every server, as a liveness phase: a Load's own deadline (``PSClient.load``)
ROLLBACK_DEADLINE_S = 3600.0
#: roll-backs rank 0 makes at one start (again when the servers move and disagree after one)
MAX_ROLLBACKS = 5


@dataclass
class WorkerContext:
    """What a worker program gets: the config, its rank, the PS client and the training mode."""

    config: EngineConfig
    rank: int
    num_workers: int
    client: object   # engine.ps.PSClient
    mode: object     # engine.modes.Mode


def server_endpoints(cfg: EngineConfig) -> list[str]:
    """``ENGINE_SERVERS`` (comma-separated host:port) or ``cluster.endpoints``.

    Raises
    ------
    ConfigError
        Neither is set, an endpoint is not host:port, or the count differs from cluster.servers.
    """
    env = os.environ.get("ENGINE_SERVERS", "")
    eps = [e.strip() for e in env.split(",") if e.strip()] if env else list(cfg.cluster.endpoints)
    if not eps:
        raise ConfigError("no server endpoints: set ENGINE_SERVERS=host:port,... or cluster.endpoints")
    if env:                                 # the config checked cluster.endpoints
        from .config import check_endpoint
        for e in eps:
            check_endpoint(e, "ENGINE_SERVERS")
    if len(eps) != cfg.cluster.servers:     # the servers route vshards by cluster.servers (the config
        raise ConfigError(                  # checks cluster.endpoints against it; this, the variable)
            f"ENGINE_SERVERS lists {len(eps)} servers but cluster.servers is {cfg.cluster.servers}: give "
            f"every server and worker a config with cluster.servers: {len(eps)}")
    return eps


def num_workers(cfg: EngineConfig) -> int:
    raw = os.environ.get("ENGINE_NUM_WORKERS")
    if raw is None:
        return cfg.cluster.workers
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"ENGINE_NUM_WORKERS must be an int >= 1, got {raw!r}")
    return n


def guard_parent() -> None:
    """Exit when the launcher that started this process goes away (no orphans)."""
    raw = os.environ.get("ENGINE_PARENT_PID")
    if not raw:
        return
    parent = int(raw)
    if not die_with_parent(parent):
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the watchdog thread")

    def watch() -> None:
        while True:
            threading.Event().wait(1.0)
            if os.getppid() != parent:
                os._exit(3)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class _OneServer:
    """``engine.checkpoint.Cluster`` over one in-process server: ``CheckpointManager.restore`` loads
    a checkpoint chain into this server only (each server of a role-mode job restores its own vshards)."""

    def __init__(self, core):
        self.core, self.num_servers = core, core.num_servers

    def load(self, uri: str, chain_end: str = "") -> int:
        from .ps import ps_pb2 as pb
        from .ps.server import ServerError
        try:
            # the operator's own --resume URI: trusted, may lie outside checkpoint.root
            return self.core.handle("Load", pb.PathRequest(request_id=f"resume:{uri}", path=uri, chain_end=chain_end),
                                    trusted=True).count
        except ServerError as e:
            if e.code == "FAILED_PRECONDITION" and RestoreMismatchError.MARKER in str(e):
                # the operator's config and checkpoint disagree: a restart fails the same way (exit 2)
                raise ConfigError(f"cannot resume: {e}; change the config or resume another checkpoint") from None
            if e.code == "FAILED_PRECONDITION" and CheckpointStorageError.MARKER in str(e):
                # its storage failed (down through the retries, read-only, refused): engine train's one line,
                # exit 1 for its scheduler, or 74 when the storage refuses for good; before, a traceback
                raise CheckpointStorageError(e.code, str(e), f"server {self.core.index}") from None
            raise RuntimeError(str(e)) from None

    def save(self, uri: str, parent: str = "") -> int:    # not used by a restore
        raise RuntimeError("a role-mode server restores only")


def run_server(cfg: EngineConfig, rank: int, *, host: str | None = None, port: int | None = None,
               ready_file: str | None = None, resume: str | None = None, resume_fallback: bool = False,
               allow_load: list[str] | None = None, health_port: int | None = None,
               resume_id: str | None = None) -> int:
    """Serve until a Stop RPC or SIGINT. Writes ``host:port`` to ready_file once listening.

    SIGTERM is a preemption (``engine.preempt``): the server keeps serving, says ``preempting`` in
    ``Health`` (so rank 0 checkpoints at its next meeting), and stops at a Stop RPC or after
    ``cluster.preempt_timeout_s``; it then returns ``EXIT_PREEMPTED``.

    ``resume`` (``--resume [URI]`` under ``--role server``; "" = the job's newest complete checkpoint):
    before it listens, the server loads its own vshards of that checkpoint's chain (a damaged one falls
    back to the previous complete one with ``resume_fallback`` or ``checkpoint.fallback``) and reports
    it as ``restored`` in ``Health``; workers started with the servers resume at its data position.
    ``--resume`` without a URI when the job has no complete checkpoint yet starts empty (a scheduler
    can pass it at every start); a named URI must exist. ``resume_id`` (``--resume-id``, which ``engine
    k8s --resume URI`` renders beside the URI): every checkpoint this server saves records the pair,
    and a server started with it restores the job's newest checkpoint when that one records the pair,
    instead of the URI (``job_checkpoints.resumed_since``): a replaced pod, whose arguments are the
    same for the job's whole life, does not take the job back to the URI once the job wrote a
    checkpoint since.

    Before any restore the server takes the job's *floor* (``_floor``: its newest checkpoint now), and a
    server started by a scheduler does not serve while the root cannot be listed (StorageUnavailableError,
    exit 1: its scheduler restarts it).

    ``Save`` and ``Load`` from clients are confined to ``checkpoint.root`` (``engine.security.confine``);
    ``health_port`` (``--health-port``, default ``cluster.health_port``; -1 off): the plaintext gRPC
    health checking port (``engine.ps.health``): SERVING while the server serves; NOT_SERVING while it
    preempts, or while it is stuck (a request hung past ``client.timeout_s``, ``engine.ps.watchdog``:
    logged once) or a shard's spill store failed for good (``PSServer.spill_failed``: a full disk;
    logged once); its service ``liveness`` NOT_SERVING only while stuck or failed, so a liveness probe
    restarts a stuck or failed server but not a preempting one. ``allow_load`` (``--allow-load URI``) names further roots
    this server's operator lets clients load from (the launcher's ``--resume URI`` outside the root). Off loopback the server refuses to start
    without TLS and tokens (``engine.security.listen``): ConfigError."""
    from .ps import _malloc, governor
    from .ps.grpc_service import method_paths, serve
    from .ps.server import PSServer

    # before any thread: glibc latches its arena limit when a thread first needs a ninth arena
    budgeted = any(t.memory_bytes for t in cfg.sparse_tables.values())
    _malloc.tune(budgeted=budgeted)
    # a supervising launcher has no address to poll before the ready file: it watches beats till then
    reporter = progress.install(startup_s=cfg.cluster.startup_timeout_s)
    cfg = restore_secrets(cfg)
    if not 0 <= rank < cfg.cluster.servers:
        raise ConfigError(f"--rank must be in [0, cluster.servers={cfg.cluster.servers}), got {rank}")
    from .job_checkpoints import check_resume_id
    check_resume_id(resume, resume_id)
    if port is None and cfg.cluster.endpoints:
        port = int(cfg.cluster.endpoints[rank].rsplit(":", 1)[1])
    host = host or cfg.cluster.host
    from .security.credentials import server_security
    from .security.listen import check_listen
    check_listen(host, cfg.security, key="--host" if host != cfg.cluster.host else "cluster.host")
    security = server_security(cfg.security)
    if cfg.cluster.warm_up:        # before listening: no request of the job compiles a kernel
        from .ps.warmup import warm_up
        warm_up(cfg.sparse_tables, cfg.dense_tables, local_shards=cfg.cluster.local_shards)
    _malloc.trim_now()                          # the warm-up's freed heap is not the process's own
    baseline = governor.rss_bytes()             # the process before any table: RSS's constant beyond budgets
    core = PSServer.from_config(cfg, rank)
    # every way out closes what was opened (an error in the restore or the bind as well as a Stop): the
    # spill stores above all, which the role's end no longer leaves to the garbage collector
    # (engine.cli.train._end_role_process)
    metrics = server = probe = None
    try:
        unbudgeted = sorted(n for n, t in cfg.sparse_tables.items() if not t.memory_bytes)
        if budgeted and not unbudgeted:         # RSS beyond the parts: the tables' reserve (start() says so
            core.governor = governor.MemoryGovernor(   # and does nothing where RSS cannot be read)
                lambda: [h.budget for h in core.sparse.values()], baseline or 0,
                other_bytes=lambda: sum(h.nbytes for h in core.dense.values())).start()
        elif budgeted:
            log.warning("server %d: no memory governor: sparse table(s) %s have no memory_bytes, and their RAM "
                        "would read as the budgeted tables' overhead; the budgets keep their fixed reserve",
                        rank, unbudgeted)
        core.load_roots.extend(allow_load or ())
        # before the restore (hours at scale): it is watched while it runs, and a taken port fails now
        from .observability import prometheus
        metrics = prometheus.start(cfg, "server", rank, host)      # observability.prometheus_port; None: off
        if metrics is not None:
            metrics.watch_server(core)
        from . import job_checkpoints
        # before the restore: a worker rolling the job back never picks a checkpoint from before it
        core.checkpoint_floor = _floor(cfg, rank)
        if resume is not None:
            from .checkpoint import CheckpointNotFoundError
            fallback = resume_fallback or cfg.checkpoint.fallback
            since = resume_id is not None and _restored_since(cfg, core, rank, resume, resume_id, fallback)
            if not since:
                if resume and resume_id is None:
                    log.warning("server %d: --resume %s without --resume-id: started again later with these "
                                "arguments (a replaced pod), this server loads %s again, whatever the job wrote "
                                "since (engine k8s adds --resume-id)", rank, resume, resume)
                mgr, target = job_checkpoints.manager_for(cfg, resume or None)
                try:
                    m = mgr.restore(_OneServer(core), target, fallback=fallback)
                    log.info("server %d: restored %s", rank, mgr.uri_of(m["name"]))
                except CheckpointNotFoundError:
                    if resume:            # a URI the operator named must exist
                        raise
                    # "--resume" alone (a scheduler passes it at every start): no checkpoint yet, a new job
                    log.warning("server %d: --resume: the job has no complete checkpoint yet; starting empty", rank)
        server, bound = serve(core, host, port or 0, cfg.cluster.server_threads,
                              max_concurrent_rpcs=cfg.server.max_concurrent_rpcs, security=security,
                              dead_after_s=cfg.client.dead_after_s,
                              interceptors=[metrics.interceptor(method_paths())] if metrics is not None else ())
        health_port = cfg.cluster.health_port if health_port is None else health_port
        if health_port >= 0:        # the plaintext health port: grpc.health.v1 only (engine.ps.health)
            from .ps.health import LIVENESS, HealthPort
            probe = HealthPort(host, health_port, live_services=(LIVENESS,))
            probe.set(True)
        deadline = [float("inf")]

        def preempted(*_) -> None:
            if not core.preempting:
                log.warning("server %d: SIGTERM: preempting; serving until the job's checkpoint and Stop, at most "
                            "%g s", rank, cfg.cluster.preempt_timeout_s)
                core.preempting = True
                deadline[0] = time.monotonic() + cfg.cluster.preempt_timeout_s
        signal.signal(signal.SIGTERM, preempted)
        signal.signal(signal.SIGINT, lambda *_: core.stopped.set())
        failpoints.hit("server.before_ready")
        if ready_file:
            tmp = Path(ready_file + ".tmp")
            tmp.write_text(f"{host}:{bound}\n")
            tmp.replace(ready_file)
        reporter.close()            # from now on the launcher polls Health (ServerWatch)
        stuck = failed = None
        while not core.stopped.wait(0.5):
            # a request that hangs (engine.ps.watchdog): NOT_SERVING, so a liveness probe restarts it
            now_stuck = core.watchdog.stuck()
            if now_stuck and not stuck:
                log.error("server %d: stuck: %s%s", rank, now_stuck,
                          "; health port NOT_SERVING: a liveness probe restarts this server" if probe else "")
            elif stuck and not now_stuck:
                log.warning("server %d: no longer stuck (it moved after: %s)", rank, stuck)
            stuck = now_stuck
            # a spill store that stopped writing for good (a full disk): not live until a restart
            now_failed = core.spill_failed()
            if now_failed and now_failed != failed:
                log.error("server %d: not live: %s%s", rank, now_failed, "; health port NOT_SERVING: a liveness "
                          "probe restarts this server" if probe else "")
            failed = now_failed
            if probe is not None:       # readiness: not preempting, stuck or failed; liveness: not stuck or failed
                probe.set(not core.preempting and not stuck and not failed, live=not stuck and not failed)
            if time.monotonic() > deadline[0]:
                log.warning("server %d: preempt_timeout_s passed; stopping", rank)
                break
        log.info("server %d stopping", rank)
    finally:
        if probe is not None:
            probe.close()
        if server is not None:
            server.stop(grace=2.0).wait(cfg.cluster.stop_timeout_s)
        core.close()
        if metrics is not None:
            metrics.close()          # a last push to the Pushgateway
    return preempt.EXIT_PREEMPTED if core.preempting else 0


def _floor(cfg: EngineConfig, rank: int) -> str | None:
    """Server ``rank``'s ``checkpoint_floor``: the name of the job's newest complete checkpoint when it
    starts ("" none; None: checkpoints off), so a roll-back by worker rank 0 (``_rollback_target``) never
    takes an earlier run's checkpoint under the same root for the job's own.

    A child of a launcher (``ENGINE_PARENT_PID``) that cannot list the root logs it and reports None: the
    launcher keeps the job's floor itself (``engine.launch.supervisor``). A role started by a scheduler
    has no one else to keep it, so it does not serve without it.

    Raises
    ------
    hdfs_io.StorageUnavailableError
        Role mode: the root cannot be listed (after ``hdfs_io``'s retries), naming the server, the root
        and the storage's error. Before, the server served with no floor, and a roll-back before the
        job's first checkpoint restored an earlier run's newest checkpoint as the job's own.
    """
    from . import job_checkpoints
    try:
        return job_checkpoints.newest_name(cfg)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreachable store, or a root that is no directory
        if os.environ.get("ENGINE_PARENT_PID"):
            log.warning("server %d: cannot list the job's checkpoints (%s); its launcher keeps the job's floor",
                        rank, e)
            return None
        from hdfs_io import StorageUnavailableError
        root = f"{cfg.checkpoint.root.rstrip('/')}/{job_checkpoints.job_name(cfg)}"
        raise StorageUnavailableError(
            f"server {rank}: the job's checkpoints under {root} cannot be listed at its start, so a roll-back "
            f"could not tell them from an earlier run's; the server does not serve without that floor "
            f"({type(e).__name__}: {e})", uri=root) from e


def _reach(client, cfg: EngineConfig, lost: str) -> str:
    """Where a failure to reach server ``lost`` (its endpoint) lies, seen from this host now: every
    server asked once (``engine.ps.reach``, within ``min(5, client.dead_after_s / 2)`` seconds), so the
    line names this host's own network when no server answers, or the path to ``lost`` alone when the
    others do (an asymmetric partition: that server may be alive and serving the other roles)."""
    from .ps import reach
    try:
        return reach.describe(client.transport.endpoints, lost,
                              reach.probe(client.transport, min(5.0, cfg.client.dead_after_s / 2)))
    except Exception as e:  # noqa: BLE001 - a diagnosis must not hide the failure it explains
        return f"the servers could not be asked again ({type(e).__name__}: {e})"


def _took_part(health: dict, name: str) -> bool:
    """A server's ``Health`` names worker ``name`` among its ``writers`` (since its last load) or its
    ``clients`` (data requests in its present generation): an earlier incarnation of it took part. Or
    the server dropped names from either (``writers_dropped``, ``clients_dropped``: more names than it
    keeps, ``engine.ps.names``): ``name`` may have been one of them, so it may have taken part."""
    return (name in health.get("writers", ()) or name in health.get("clients", ())
            or bool(health.get("writers_dropped")) or bool(health.get("clients_dropped")))


def _restored_since(cfg: EngineConfig, core, rank: int, uri: str, resume_id: str, fallback: bool) -> bool:
    """``--resume URI --resume-id ID``: mark ``core`` so its part reports carry the pair, and when the job's
    newest checkpoint records it (``job_checkpoints.resumed_since``) restore that one (falling back, if
    allowed, only within the checkpoints since that resume) -> True; False: restore URI itself (none
    written since, or none of them could be restored: logged)."""
    from . import job_checkpoints
    from hdfs_io import CheckpointCorruptError
    core.resumed_with = {"id": resume_id, "uri": uri}
    found = job_checkpoints.resumed_since(cfg, resume_id, uri)
    if found is None:
        return False
    since, floor = found
    log.warning("server %d: the job has written checkpoints since --resume %s (--resume-id %s): restoring the "
                "newest of them, %s, not the URI again", rank, uri, resume_id, since)
    mgr, target = job_checkpoints.manager_for(cfg, since)
    try:
        m = mgr.restore(_OneServer(core), target, fallback=fallback, floor=floor or None)
    except CheckpointCorruptError as e:
        log.warning("server %d: no checkpoint written since --resume %s could be restored (%s); restoring %s "
                    "itself", rank, uri, e, uri)
        return False
    log.info("server %d: restored %s", rank, mgr.uri_of(m["name"]))
    return True


def _agreed(health: list[dict], name: str) -> tuple[bool, str | None]:
    """(the servers hold one state that the starting worker ``name`` (``worker{rank}``) can train from,
    the checkpoint it was restored from or None): all restored the same checkpoint, or none restored
    one and all are fresh (a new job); and no earlier incarnation of this worker wrote since
    (``writers``) or sent a data request in the servers' present generation (``clients``).

    A worker whose name is among the writers was restarted: the servers hold what it trained since,
    which it would train again. One among the clients was restarted within the running attempt: the
    others may be past the start's barriers, or a barrier counted its dead self's arrival, so it
    cannot join. Servers in use that restored nothing hold what workers trained since the last
    checkpoint, which a starting (so restarted) worker cannot continue exactly either. Either way: not
    agreed, roll back (or fence)."""
    restored = {h.get("restored") for h in health}
    fresh = {bool(h.get("fresh")) for h in health}
    if any(_took_part(h, name) for h in health):
        return False, None
    if len(restored) == 1 and restored != {None}:
        return True, restored.pop()
    if restored == {None} and fresh == {True}:
        return True, None
    return False, None


class NotAgreedError(RuntimeError):
    """The servers did not agree on one state within ``cluster.startup_timeout_s`` though they moved
    meanwhile (a roll-back or a restart under way): exit ``EXIT_ROLLBACK`` to be restarted and wait
    again. When nothing moved, ``LaunchError`` instead (exit 1, which a scheduler counts)."""


def _rollback_target(cfg: EngineConfig, health: list[dict]) -> tuple[str | None, str | None]:
    """(URI of the checkpoint rank 0 rolls the servers back to, the floor its fallback keeps above):
    the job's newest complete checkpoint when it lies above the servers' lowest ``checkpoint_floor``
    (written since the earliest of them started: by this job), else the newest of the checkpoints they
    report having restored, restoring (a chain half loaded) or been fenced from (what the job started
    from; no floor); None when there is neither. So an operator's ``--resume`` of an older checkpoint is
    not undone by a roll-back to the newer ones it abandoned. Servers that do not report a floor (older
    versions) let every checkpoint of the job count."""
    from . import job_checkpoints
    from .checkpoint import CheckpointRef, ref_of_uri

    def ref(name: str) -> CheckpointRef:          # "" (no checkpoint) and foreign names sort first
        return ref_of_uri(name) or CheckpointRef("", "", -1, "")

    floors = [h.get("checkpoint_floor") for h in health]
    floor = None if any(f is None for f in floors) else min(floors, key=ref)
    found = job_checkpoints.recovery_target(cfg, floor)
    if found is not None:
        return found[0], floor
    reported = [u for h in health for u in (h.get("restored"), h.get("restoring"), h.get("fenced_from")) if u]
    return max(reported, key=ref, default=None), None


def _roll_back(cfg: EngineConfig, client, health: list[dict]) -> None:
    """Rank 0: roll every server back to ``_rollback_target``, or, with none (no checkpoint yet), empty
    them (``PSClient.fence(clear=True)``) so the job starts again from its beginning, as the launcher
    restarts such a job with fresh servers. A clear that a server refuses because it moved on meanwhile
    (another worker's fence) is decided again on fresh ``Health``, at most ``MAX_ROLLBACKS`` times (then
    the wait for agreement times out and the worker exits ``EXIT_ROLLBACK``)."""
    from . import job_checkpoints

    for _ in range(MAX_ROLLBACKS):
        target, floor = _rollback_target(cfg, health)
        states = [(h.get("restored"), "fresh" if h.get("fresh") else "in use") for h in health]
        if target is not None:
            log.warning("the servers hold different states %s, or this worker's earlier self took part since: "
                        "rolling every server back to %s", states, target)
            mgr, ckpt = job_checkpoints.manager_for(cfg, target)
            with progress.current().phase(f"roll-back to {target}", ROLLBACK_DEADLINE_S):
                mgr.restore(client, ckpt, fallback=cfg.checkpoint.fallback, floor=floor)
            return
        cleared = client.fence([int(h.get("generation", 0)) for h in health],
                               "worker 0 rolls the job back to its beginning (no checkpoint yet)", clear=True)
        log.warning("the servers hold different states %s, or this worker's earlier self took part since, and "
                    "the job has no checkpoint yet: emptied %d of %d server(s); the job starts again from its "
                    "beginning", states, sum(cleared), len(cleared))
        if all(cleared):
            return
        health = client.health()


def _count_rollbacks(health: list[dict]) -> None:
    """Role mode: add the job's roll-backs so far to this worker's ``engine_restarts_total``: the most any
    server counted (``rollbacks`` in ``Health``; a server restarted since counts from 0 again). No
    supervisor counts restarts here (``ENGINE_RESTARTS``, the local launcher's, is then 0): a scheduler
    (the kubelet, a Job controller) restarts the pods, and every such restart is a roll-back of the
    servers to the job's newest checkpoint (``_roll_back``)."""
    from .observability import prometheus
    m = prometheus.current()
    n = max((int(h.get("rollbacks") or 0) for h in health), default=0)
    if m is not None and n > 0:
        m.restarts.inc(n)


def _restored_by_servers(cfg: EngineConfig, client, rank: int, workers: int = 1) -> EngineConfig:
    """Role mode: agree with the servers on one state before training (the recovery rule without a
    launcher), and resume at its data position.

    The servers agree when they restored the same checkpoint (``--role server --resume``, or rank 0's
    roll-back) and this worker did not write since, or none of them did and all are fresh (a new job).
    Otherwise this worker restarted (a preemption, a crash: the servers are in use and hold what was
    trained since the last checkpoint) or some servers restarted while others kept training:

    - rank 0 loads the newest checkpoint of the job's own (``_rollback_target``) onto every server, or
      with none empties them (``_roll_back``: the job starts again from its beginning), which rolls them
      all back (and clears what they held for the replaced state: a preemption request, metric sums)
      and ends the running workers' attempt: their next request meets a new generation and they exit
      ``EXIT_ROLLBACK`` for their scheduler;
    - another rank fences the servers its earlier self wrote to or sent a request in the present
      generation (``PSClient.fence``): the workers still running exit the same way, rank 0 among them,
      and restarted, rank 0 rolls every server back. Without the fence a worker replaced alone would wait
      for an agreement that never comes while the others train on. A server it is not named on is left
      alone: it may be one rank 0 has just rolled back, and a fence there undid the roll-back of a job
      whose workers were all restarted at once (a preemption). Named on none, it waits for rank 0.

    The other ranks wait until the servers agree; so does rank 0 after its roll-back, and it rolls back
    again (at most ``MAX_ROLLBACKS`` times, each with a fresh ``cluster.startup_timeout_s``) while they
    disagree, which after its roll-back means they moved since (a server restarted). The agreed
    checkpoint becomes this worker's
    ``checkpoint.restored``. When every server is fresh (a new job), the workers meet at a start barrier
    before any of them writes, so a worker that starts late (Ray or a scheduler start them one by one)
    never mistakes servers its peers already wrote to for a restarted server.

    Raises
    ------
    NotAgreedError
        They did not agree within ``cluster.startup_timeout_s``, but moved meanwhile.
    LaunchError
        They did not agree within it and nothing changed on them (worker 0 is not running).
    """
    from . import job_checkpoints

    if cfg.checkpoint.restored:
        return cfg
    name = f"worker{rank}"
    health = client.health()
    ok, uri = _agreed(health, name)
    if not ok and rank == 0:
        _roll_back(cfg, client, health)
    elif not ok:
        # only the servers this worker's earlier self took part in: a server it is not named on holds
        # nothing of its, and may be one rank 0 has just rolled back (a fence there, read half-way
        # through rank 0's roll-back, would undo it); a fence of a server that loaded since this worker
        # looked is refused (its generation moved)
        mine = [s for s, h in enumerate(health) if _took_part(h, name)]
        if mine:
            fenced = client.fence([int(h.get("generation", 0)) for h in health],
                                  f"worker {rank} restarted while the servers hold what was trained since "
                                  f"{health[0].get('restored') or 'the job started'}", servers=mine)
            log.warning("worker %d: the servers hold state of an attempt this worker cannot join (%s); fenced "
                        "%d of %d server(s): the running workers exit %d, and worker 0, restarted, rolls every "
                        "server back to the job's newest checkpoint (or its beginning)", rank,
                        [(h.get("restored"), sorted(h.get("writers", ()))) for h in health], sum(fenced),
                        len(fenced), EXIT_ROLLBACK)
        else:
            log.warning("worker %d: the servers hold different states %s: waiting for worker 0 to roll them "
                        "back", rank, [h.get("restored") for h in health])
    deadline = time.monotonic() + cfg.cluster.startup_timeout_s
    waited_at = [h.get("generation") for h in client.health()] if not ok else []
    rolled_back = 1 if not ok and rank == 0 else 0
    # the phase's deadline covers every wait: each roll-back again gives the wait a fresh one
    with progress.current().phase("waiting for the servers to agree",
                                  (MAX_ROLLBACKS + 1) * cfg.cluster.startup_timeout_s):
        while not ok:
            if time.monotonic() > deadline:
                moved = [h.get("generation") for h in health] != waited_at
                msg = (f"the servers did not agree on one state within cluster.startup_timeout_s="
                       f"{cfg.cluster.startup_timeout_s:g}s: {[h.get('restored') for h in health]}")
                if not moved:       # nobody rolled back, nor restarted: exit 1, which a scheduler counts
                    raise LaunchError(msg + "; nothing changed on the servers meanwhile (is worker 0 running?)")
                raise NotAgreedError(msg)
            time.sleep(0.5)
            health = client.health()
            ok, uri = _agreed(health, name)
            if not ok and rank == 0 and rolled_back < MAX_ROLLBACKS:
                # after rank 0's roll-back the servers agree unless they moved since (a server restarted
                # during it); nobody but rank 0 rolls back, so it does so again
                log.warning("worker 0: the servers disagree after the roll-back %s: rolling back again",
                            [(h.get("restored"), h.get("fenced")) for h in health])
                _roll_back(cfg, client, health)
                rolled_back += 1
                health = client.health()         # decided on what the roll-back left, not before it
                ok, uri = _agreed(health, name)
                waited_at = [h.get("generation") for h in health]
                deadline = time.monotonic() + cfg.cluster.startup_timeout_s
    client.pin_generations(health)      # the state agreed on: a load or fence after it is refused
    _count_rollbacks(health)
    if uri is None:
        if all(h.get("fresh") for h in health) and workers > 1:
            # a fresh job: nobody writes before every worker has looked, or a late worker would see some
            # servers in use and others still fresh and take it for a restarted server
            with progress.current().phase("start barrier", cfg.cluster.startup_timeout_s):
                client.barrier("engine-start", workers, timeout=cfg.cluster.startup_timeout_s)
        return cfg
    log.info("the servers restored %s: resuming at its data position", uri)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, restored=uri))


def _end_job(client, rank: int, workers: int, timeout: float) -> None:
    """The job-end protocol (``cluster.stop_servers_at_end``): every worker that finished meets the
    others at a last barrier; then each other worker says once that it saw the release and leaves, and
    rank 0, which holds the admin token, waits for all of them before it stops every server (they exit
    0), so no worker is still polling a server that stops. A worker that failed never arrives, so the
    servers outlive a failed job for its restart."""
    _end_job_barriers(client, rank, workers, timeout, "engine-job-end")
    if rank != 0:
        return
    log.info("worker 0: the job ended; stopping the servers")
    client.stop()


def _end_preempted(client, rank: int, workers: int, timeout: float) -> None:
    """The job-end protocol after a preemption checkpoint (``cluster.stop_servers_at_end``): the workers
    meet as at a normal end, then rank 0 stops the servers that are preempting themselves (SIGTERM: they
    say so in ``Health``), which then exit 75 at once instead of serving an ended job until
    ``cluster.preempt_timeout_s``; servers that were not preempted keep serving for the replacement
    workers. Best effort: a worker that does not arrive, or a server gone, leaves the servers to their
    timeout (logged), never an error of this worker."""
    try:
        _end_job_barriers(client, rank, workers, timeout, "engine-preempted")
        if rank != 0:
            return
        preempting = [s for s, h in enumerate(client.health()) if h.get("preempting")]
        if preempting:
            log.info("worker 0: the job checkpointed for a preemption; stopping the preempting servers %s",
                     preempting)
            client.stop(preempting)
    except Exception as e:      # noqa: BLE001 - the checkpoint is written; the servers time out instead
        log.warning("worker %d: after the preemption checkpoint: %s; the preempting servers stop after "
                    "cluster.preempt_timeout_s", rank, e)


def _end_job_barriers(client, rank: int, workers: int, timeout: float, name: str) -> None:
    """Every worker meets at barrier ``name``; the others then say they saw its release and leave, and
    rank 0 waits for all of them (so no worker still polls a server rank 0 then stops).

    A worker whose "seen" arrival finds the servers gone leaves as one that finished: rank 0 stops them
    only once every arrival was counted, so its arrival landed and only the reply was lost (its retry
    reached a stopping server); and a server lost after the release loses nothing of a job whose every
    worker has finished. Before, that worker exited 76 (roll back) after the job's end, and a scheduler
    restarted it against servers that were gone. Likewise rank 0 ends the job when a worker does not say
    so within ``timeout`` (it died after the release): before, it exited 1 with the job finished."""
    with progress.current().phase(f"barrier {name}", 2 * timeout):
        client.barrier(name, workers, timeout=timeout)
        if rank != 0:
            try:
                client.arrive(f"{name}-seen", workers, timeout=timeout)
            except (ShardUnavailableError, PSTimeoutError) as e:
                log.info("worker %d: the servers stopped before the answer to its last arrival came (%s); "
                         "every worker had finished", rank, e)
            return
        try:
            client.barrier(f"{name}-seen", workers, timeout=timeout)
        except BarrierTimeoutError as e:
            # every worker reached the job's end (the barrier above opened); one that did not say so
            # since died or lost its connection: rank 0 still ends the job (before: it exited 1 after
            # the timeout, a finished job counted as a failure, and its servers kept running)
            log.warning("worker 0: not every worker said it saw the job's end (%s); every worker had "
                        "finished: ending the job all the same", e.message)


def run_worker(cfg: EngineConfig, rank: int, *, result_file: str | None = None, host: str | None = None,
               health_port: int | None = None) -> dict:
    """Connect to the servers, build the mode, run the ``model.kind`` program; returns its summary.

    ``health_port`` (``--health-port``; None or -1: off, 0: a free port): serve this worker's liveness
    there, plaintext gRPC health checking on ``host`` (default ``cluster.host``), for a scheduler's
    liveness probe (``engine.liveness``).

    Raises
    ------
    RuntimeError
        The health port could not be bound.
    """
    from .modes import make_mode
    from .programs import load_program

    if cfg.model is None:
        raise ConfigError("model: missing; set model.kind to a worker program (e.g. logreg)")
    cfg = restore_secrets(cfg)
    workers = num_workers(cfg)
    if not 0 <= rank < workers:
        raise ConfigError(f"--rank must be in [0, {workers}) workers, got {rank}")
    program = load_program(cfg.model.kind)
    # a supervising launcher watches this file: beats, steps, announced long phases (engine.progress);
    # with a health port, the same report in memory answers a scheduler's liveness probe
    watched = health_port is not None and health_port >= 0
    reporter = progress.install(startup_s=cfg.cluster.startup_timeout_s, in_memory=watched)
    from .observability import prometheus
    metrics = prometheus.start(cfg, "worker", rank)     # observability.prometheus_port; None: off
    from .security.credentials import holds_admin_token   # the rule the launchers give the token by
    client = connect(cfg, server_endpoints(cfg), name=f"worker{rank}", admin=holds_admin_token("worker", rank),
                     async_queue=cfg.client.async_queue)
    liveness = None
    try:
        if watched:
            from .liveness import WorkerLiveness
            liveness = WorkerLiveness(reporter, host or cfg.cluster.host, health_port, cfg.client.dead_after_s,
                                      f"worker {rank}", in_flight=client.in_flight)
        with reporter.phase("waiting for the servers", cfg.cluster.startup_timeout_s):
            try:
                client.wait_ready(cfg.cluster.startup_timeout_s)
            except (ShardUnavailableError, PSTimeoutError) as e:   # one line, exit 1 (counted: a wrong
                raise LaunchError(                                  # address never heals)
                    f"worker {rank}: {e} (cluster.startup_timeout_s); "
                    f"{_reach(client, cfg, e.endpoint)}") from None
        try:
            cfg = _restored_by_servers(cfg, client, rank, workers)
            mode = make_mode(cfg, client, rank=rank, num_workers=workers)
            if cfg.cluster.warm_up:    # the client's kernels (the servers' ones load from the cache they wrote)
                from .ps.warmup import warm_up
                warm_up(cfg.sparse_tables, cfg.dense_tables, local_shards=cfg.cluster.local_shards)
                mode.warm_up(c.dim for c in cfg.sparse_tables.values())
            result = program.run(WorkerContext(cfg, rank, workers, client, mode))
            if cfg.cluster.stop_servers_at_end:
                _end_job(client, rank, workers, cfg.client.barrier_timeout_s)
        except preempt.Preempted as e:
            log.warning("worker %d: %s", rank, e)
            result = {"rank": rank, "preempted": True, "reason": str(e)}
            if cfg.cluster.stop_servers_at_end:
                _end_preempted(client, rank, workers, min(cfg.client.barrier_timeout_s, cfg.cluster.preempt_timeout_s))
        except GenerationChangedError as e:
            log.error("worker %d: a server restarted, loaded a checkpoint or was fenced under this worker (%s); "
                      "exiting with code %d: restarted, the workers roll every server back to one checkpoint "
                      "and resume there", rank, e.message, EXIT_ROLLBACK)
            result = {"rank": rank, "rollback": True, "reason": e.message}
        except ShardUnavailableError as e:
            # a server silent past client.dead_after_s and the retries (a lost host: engine.ps.keepalive):
            # its replacement restores a checkpoint, so this worker's state is gone with it either way.
            # Across hosts the cause may lie elsewhere (this host's own link, or only the path to that
            # server): the servers are asked again, and the line says which (engine.ps.reach)
            where = _reach(client, cfg, e.endpoint)
            log.error("worker %d: server %s is unreachable (%s); %s; exiting with code %d: restarted, the workers "
                      "roll every server back to one checkpoint and resume there (a replacement server must "
                      "answer within cluster.startup_timeout_s)", rank, e.endpoint, e.message, where, EXIT_ROLLBACK)
            result = {"rank": rank, "rollback": True,
                      "reason": f"server {e.endpoint} unreachable: {e.message}; {where}"}
        except BarrierTimeoutError:
            raise           # a peer that never came, or a wrong world size: exit 1, counted
        except PSTimeoutError as e:
            # a server that stays connected but does not answer (stuck: engine.ps.watchdog, and its liveness
            # probe restarts it): no fault of this worker's, so exit 76, which a scheduler does not count
            # (before: a traceback, and exit 1, which it counted)
            log.error("worker %d: no answer in time from %s (%s); exiting with code %d: restarted, the workers "
                      "roll every server back to one checkpoint and resume there", rank, e.endpoint or "the servers",
                      e.message, EXIT_ROLLBACK)
            result = {"rank": rank, "rollback": True, "reason": f"no answer in time from {e.endpoint}: {e.message}"}
        except NotAgreedError as e:
            log.error("worker %d: %s; exiting with code %d to be restarted and wait again", rank, e, EXIT_ROLLBACK)
            result = {"rank": rank, "rollback": True, "reason": str(e)}
    finally:
        client.close()
        reporter.close()
        # closed here, the port is refused for the ~0.05 s the process takes to end after this (its final
        # collection skipped: engine.cli.train._end_role_process); left open, a probe that reached it
        # during the interpreter's shutdown killed gRPC's server thread with a traceback (its thread pool
        # refuses new work then)
        if liveness is not None:
            liveness.close()
        if metrics is not None:
            metrics.close()
    if result_file:
        tmp = Path(result_file + ".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(result_file)
    return result
