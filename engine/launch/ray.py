"""The Ray launcher behind ``engine train CONFIG --launcher ray`` (``cluster.launcher: ray``).

Every role is a Ray actor (``RoleActor``) that starts the same process the local launcher would
(``python -m engine train CONFIG --role R --rank N``) on its own node, as its child, and answers for
it: its exit code, signals, its ready endpoint, its result and its progress report (``engine.progress``)
travel through Ray calls, not files, so nodes need no shared directory for them. The child dies with its
actor (``engine.roles.guard_parent``), so killing an actor's process kills its role; its log lines reach
the driver through Ray's log forwarding, prefixed with the role and rank (``(server0 pid=..)``).

Placement: one placement group (strategy SPREAD) with one bundle per role, servers first; each bundle
holds ``cluster.server_resources`` or ``cluster.worker_resources`` (Ray resources, custom ones pin roles
to the nodes that offer them; default a token 0.01 CPU so roles are not held back by Ray's CPU count).
A server binds ``cluster.host`` when the Ray cluster is this one machine (one live node, this one, holding
every bundle once placed), else its node's address (then the security rules of ``engine.security.listen``
apply: TLS and tokens, or ``insecure: true``).

A lost node (its raylet and every actor on it gone: a preempted VM) ends its roles' actors; the role is
failed with "died with its Ray node ID (ADDRESS), which was lost: WHY" (Ray's reason, or its raylet
refusing connections), and the job restarts. A silent node (frozen, vanished: calls to its actors time
out) fails its role naming it, and the next attempt waits for Ray to find it dead (``ray_silent``).
Each attempt makes a new placement group (the last one's is removed), which waits up to
``cluster.startup_timeout_s`` for nodes offering every role's resources (a replacement joining meanwhile
is used), saying which role's resources no live node offers; past that, ``PlacementError`` (``engine
train`` exits 69 with one line and the command that continues the job from its checkpoints).

Supervision is the local launcher's (``engine.launch.supervisor``): ``RayCluster`` is a ``LocalCluster``
whose children are actors, so a dead actor, a dead role, a hang or a preemption is handled by the same
rule (restart the whole job from ``job_checkpoints.recovery_target``, ``cluster.max_restarts``). With more
than one node, a local ``checkpoint.root`` must be declared ``checkpoint.shared: true`` (a path every node
mounts); otherwise checkpoints go to S3 or HDFS.

Joining: ``cluster.ray_address`` (or ``RAY_ADDRESS``) must accept a TCP connection first; a malformed or
unreachable address, or a cluster Ray cannot join, is a ConfigError naming the key (``engine train``
exits 2 at once, where Ray's own client retried for many minutes). ``ray.init`` installs Ray's SIGTERM
handler (it exits); the launcher's own (preempt the job: a checkpoint, exit 75) is put back after it.

Ray is an optional extra: ``pip install 'sparse-engine[ray]'``.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .. import progress
from ..config import EngineConfig
from ..errors import ConfigError, LaunchError, PlacementError, StoppedWhilePlacing
from ..observability.prometheus import FILE_ENV as METRICS_FILE_ENV
from ..observability.prometheus import PORT_ENV as METRICS_PORT_ENV
from ..observability.prometheus import RESTARTS_ENV
from .local import Child, LocalCluster
from .procs import parent_pid
from .ray_actors import ACTOR_DIED, CALL_TIMEOUT_S, STALLED_TIMEOUT_S, _ActorProc
from .ray_nodes import check_resources, check_shared_checkpoints, unoffered
from .ray_silent import remember, silent_cause, wait_silent_nodes

log = logging.getLogger(__name__)

INSTALL = "pip install 'sparse-engine[ray]'   (or: pip install 'ray>=2.50')"
_TIMED_OUT = object()       # a read of a role's file whose actor did not answer in time
#: the longest a driver waits for a TCP connection to the Ray cluster's address before ``ray.init``
CONNECT_CHECK_S = 30.0
#: Ray Client's default port (``ray://HOST`` without one)
RAY_CLIENT_PORT = 10001
#: seconds between looks at what the placement group waits for (the first look logs what no node offers)
PLACEMENT_CHECK_S = 5.0
#: seconds between two looks at the supervisor's stop flag (a SIGTERM) while the placement waits
STOP_CHECK_S = 0.5


def require_ray():
    """The ``ray`` module.

    Raises
    ------
    ConfigError
        Ray is not installed (the message says how to install it; the CLI exits 2).
    """
    try:
        import ray
    except ImportError:
        raise ConfigError(f"cluster.launcher: ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


class RoleActor:
    """A Ray actor that runs one role as its child process (see the module docstring). Its methods are
    small and quick; ``__repr__`` is the role and rank, which Ray puts before each forwarded log line."""

    def __init__(self, label: str):
        self.label = label
        self.dir = Path(tempfile.mkdtemp(prefix=f"engine-ray-{label}-"))
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / f"{label}.log"
        self.files: dict[str, Path] = {}

    def __repr__(self) -> str:
        return self.label

    def node(self) -> tuple[str, str]:
        """(node id, node address) of this actor."""
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def start(self, config_text: str, argv: list[str], env: dict, files: list[str], unset: tuple = ()) -> int:
        """Write the config, start ``engine train`` with ``argv`` (after the config path) and ``files``
        (``ready``, ``result``, ``progress``) placed in this actor's directory; returns the child's pid.
        The child's environment is this actor's with ``env`` added and the variables ``unset`` names
        taken out (the admin token's for a role that does not hold it: a local Ray's actors inherit
        the driver's environment)."""
        cfg = self.dir / "config.yaml"
        fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(config_text)
        self.files = {k: self.dir / f"{self.label}.{k}" for k in files}
        extra = [a for k, flag in (("ready", "--ready-file"), ("result", "--result-file")) if k in self.files
                 for a in (flag, str(self.files[k]))]
        child_env = {k: v for k, v in {**os.environ, **env}.items() if k not in unset}
        child_env.update({"ENGINE_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1"})
        if "progress" in self.files:
            child_env[progress.ENV] = str(self.files["progress"])
        if "metrics" in self.files:     # the role writes its /metrics URL here (engine.observability)
            child_env[METRICS_FILE_ENV] = str(self.files["metrics"])
        self.proc = subprocess.Popen([sys.executable, "-m", "engine", "train", str(cfg), *argv, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=child_env, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True, name="log-pump").start()
        return self.proc.pid

    def _pump(self) -> None:
        """The child's output into its log file and to this actor's stderr, which Ray forwards to the
        driver's stderr (the driver's stdout stays the job's own: its final JSON line last)."""
        with open(self.log_path, "ab") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                sys.stderr.write(line.decode(errors="replace"))
                sys.stderr.flush()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int, group: bool) -> None:
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def read(self, kind: str):
        """``ready``: the endpoint or None; ``result``: the JSON result or None; ``progress``: the
        last report or None; ``metrics``: the role's /metrics URL or None."""
        path = self.files.get(kind)
        if path is None:
            return None
        if kind == "progress":      # with this node's monotonic clock at the read (RayChild.report)
            report = progress.read(path)
            return None if report is None else {**report, "read_mono": time.monotonic()}
        try:
            text = path.read_text()
        except OSError:
            return None
        return text.strip() if kind in ("ready", "metrics") else json.loads(text)

    def cleanup(self) -> None:
        """Remove this actor's directory when its role ended well (exit 0 or 75, or it was stopped by
        the launcher); otherwise keep the log, whose path is in the driver's messages, and remove the
        rest (the config and the exchange files)."""
        code = self.proc.poll() if self.proc is not None else 0
        if code in (0, 75, -signal.SIGTERM, -signal.SIGKILL) or code is None:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        for path in [self.dir / "config.yaml", *self.files.values()]:
            try:
                path.unlink()
            except OSError:
                pass

    def tail(self, n: int) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:]) or "(empty log)"


class RayChild(Child):
    """A role run by a ``RoleActor`` (see ``engine.launch.local.Child``)."""

    actor = None
    _last_report: dict | None = None

    def ready(self) -> str | None:
        return self._read("ready")

    def result(self) -> dict | None:
        return self._read("result")

    def report(self) -> dict | None:
        """The role's progress report, its monotonic times moved into this process's clock (the actor
        reads the file on the role's node, with that node's clock). When its actor does not answer in
        time, the last report read: its beat ages, so a stalled actor reads as "no heartbeat for N s",
        as a frozen local process does, not as a worker that never reported (which a missing report
        would say). Once the role ended or its actor is gone (died, or killed by ``RayCluster.shutdown``,
        which reads every report first), also the last report read: the supervisor counts a failed
        attempt's lost examples (``examples_replayed``) from it after the attempt was torn down, where a
        local role's progress file is still on disk."""
        value = self._read("progress", on_timeout=_TIMED_OUT)
        if value is _TIMED_OUT or (value is None and self._ended()):
            return self._last_report
        if value is not None:      # its node's monotonic clock -> the driver's (engine.progress.rebase)
            read_mono = value.pop("read_mono", None)
            if read_mono is not None:
                value = progress.rebase(value, time.monotonic() - float(read_mono))
        self._last_report = value
        return value

    def how(self, code: int) -> str:
        """Its actor's death when Ray reported one (``death_cause``: its node lost, or its own process),
        else as a local child's."""
        if code == ACTOR_DIED and self.proc.death:
            return self.proc.death
        return super().how(code)

    def _ended(self) -> bool:
        """Its actor is gone or its role exited (nothing newer can be read of it)."""
        return self.proc.actor_dead or self.proc._code is not None

    def _read(self, kind: str, on_timeout=None):
        self.proc.poll()
        if self.proc.actor_dead:
            return None
        value = self.proc._get(lambda: self.actor.read.remote(kind), on_timeout=on_timeout)
        # the actor may die between the poll and the read: _get then answers ACTOR_DIED, not a file's
        # content (a string or a dict)
        return None if isinstance(value, int) else value

    def tail(self, n: int = 15) -> str:
        self.proc.poll()
        if self.proc.actor_dead:
            return "(its Ray actor died; the log was on its node: " + str(self.log_path) + ")"
        text = self.proc._get(lambda: self.actor.tail.remote(n))
        if isinstance(text, int):       # ACTOR_DIED: it died since the poll
            return "(its Ray actor died; the log was on its node: " + str(self.log_path) + ")"
        return text or "(no log)"

    def signal_group(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc._get(lambda: self.actor.signal.remote(sig, True), queue=True)


#: set by the launcher for each role, never forwarded from the driver
_PER_ROLE = {"ENGINE_ROLE", "ENGINE_RANK", "ENGINE_SERVERS", "ENGINE_NUM_WORKERS", "ENGINE_PARENT_PID", progress.ENV,
             METRICS_FILE_ENV, METRICS_PORT_ENV, RESTARTS_ENV}


def forwarded_env() -> dict[str, str]:
    """What of the driver's environment the roles get on their nodes: the ``ENGINE_*`` settings
    (failpoints, storage secrets, ...) and the standard storage variables (``AWS_*``, ``HADOOP_*``); a
    Ray node's own environment supplies the rest."""
    return {k: v for k, v in os.environ.items()
            if (k.startswith(("ENGINE_", "AWS_", "HADOOP_")) or k in ("CLASSPATH", "ARROW_LIBHDFS_DIR"))
            and k not in _PER_ROLE}


def ray_endpoint(address: str, key: str) -> tuple[str, int] | None:
    """(host, port) a driver connects to for the Ray ``address`` (``HOST:PORT``, ``[IPv6]:PORT``,
    ``ray://HOST[:PORT]``); None for ``auto`` and ``local``, which Ray resolves on this machine.

    Raises
    ------
    ConfigError
        Not one of those forms (naming ``key``: ``cluster.ray_address`` or ``RAY_ADDRESS``).
    """
    if address in ("auto", "local"):
        return None
    malformed = ConfigError(f"{key}={address!r}: expected HOST:PORT (the Ray head's GCS address, port 6379 by "
                            f"default) or ray://HOST[:PORT] (Ray Client)")
    rest, default_port = address, None
    if "://" in address:
        scheme, rest = address.split("://", 1)
        if scheme != "ray":
            raise malformed
        default_port = RAY_CLIENT_PORT
    rest = rest.rstrip("/")
    if rest.startswith("["):                            # [IPv6]:PORT
        host, _, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, sep, port = rest.rpartition(":")
        if not sep:
            host, port = rest, ""
    port = port or (str(default_port) if default_port else "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise malformed
    return host, int(port)


def _connect(ray, cfg: EngineConfig) -> None:
    """Join ``cluster.ray_address`` (or the cluster ``RAY_ADDRESS`` names), else start a local Ray for
    this process (stopped at exit).

    The address must accept a TCP connection within ``cluster.startup_timeout_s`` (at most
    ``CONNECT_CHECK_S``) first: Ray's own client retries an unreachable one for many minutes, deaf to
    SIGTERM. ``ray.init`` replaces the SIGTERM handler (``run_job``'s: preempt the job) with one that
    exits; the handlers of SIGTERM and SIGINT are put back once it returns.

    Raises
    ------
    ConfigError
        The address is malformed, unreachable, or Ray refuses to join it (an authenticated cluster, a
        version mismatch, ...): the key (``cluster.ray_address`` or ``RAY_ADDRESS``) and the cause are
        named; ``engine train`` exits 2.
    """
    if ray.is_initialized():
        return
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS") or None
    key = "cluster.ray_address" if cfg.cluster.ray_address else "RAY_ADDRESS"
    if address is not None:
        endpoint = ray_endpoint(address, key)
        if endpoint is not None and endpoint[0] in ("localhost", "127.0.0.1", "::1"):
            try:        # as Ray does: this machine's address, which a local Ray's GCS listens on
                endpoint = (ray.util.get_node_ip_address(), endpoint[1])
            except Exception:  # noqa: BLE001 - no address found: loopback is what is left to try
                pass
        if endpoint is not None:
            timeout = min(cfg.cluster.startup_timeout_s, CONNECT_CHECK_S)
            try:
                socket.create_connection(endpoint, timeout=timeout).close()
            except OSError as e:
                why = (f"no answer within {timeout:g} s" if isinstance(e, TimeoutError)
                       else e.strerror or str(e) or type(e).__name__)
                empty = "leave it empty" if key == "cluster.ray_address" else "unset it"
                raise ConfigError(f"{key}={address!r}: no Ray cluster reachable there ({why}); start one "
                                  f"(`ray start --head`), fix the address, or {empty} to start a local Ray "
                                  f"for the job") from None
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")      # plain "(worker1 pid=..)" prefixes in log files
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        ray.init(address=address, log_to_driver=True, include_dashboard=False, configure_logging=False)
    except (ValueError, ConnectionError, RuntimeError) as e:
        if address is None:
            raise
        raise ConfigError(f"{key}={address!r}: cannot join the Ray cluster: {e}") from None
    finally:
        for sig, handler in handlers.items():     # Ray's own SIGTERM handler exits: ours preempts
            if handler is not None:
                signal.signal(sig, handler)
    if address is None:         # ours: stopped at exit with everything it started (agents included)
        atexit.register(_stop_local_ray, ray, _descendants(os.getpid()))
    log.info("Ray: %s, %d node(s)", "started a local instance" if address is None else f"joined {address}",
             len([n for n in ray.nodes() if n.get("Alive")]))


def _descendants(root: int) -> set[int]:
    """Pids of every process below ``root`` now (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return set()
    for d in names:
        if d.isdigit():
            try:
                ppid = parent_pid(int(d))
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _stop_local_ray(ray, started: set[int]) -> None:
    """Shut down the local Ray this process started, then SIGKILL whatever of it is left: Ray's per-node
    agents outlive ``ray.shutdown`` and would be orphaned. ``started``: this process's descendants right
    after ``ray.init`` (the GCS, the raylet and their agents)."""
    started = started | _descendants(os.getpid())
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - going away anyway
        pass
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class RayCluster(LocalCluster):
    """Servers and workers of one attempt as Ray actors (see the module docstring). Same interface as
    ``LocalCluster``; ``run_dir`` on the driver keeps the resolved config.

    Raises
    ------
    ConfigError
        Ray is missing, the Ray address is malformed or unreachable (``_connect``), a role's resources
        make no valid Ray bundle (``check_resources``), or the checkpoint rule
        (``check_shared_checkpoints``) is broken, before or after placement (roles placed on several
        nodes: the listener rule too).
    PlacementError
        The placement group cannot be placed within ``cluster.startup_timeout_s`` (``_wait_placed``).
    """

    def __init__(self, cfg: EngineConfig, run_dir=None, python: str = sys.executable, allow_load=(), stopping=None):
        self.ray = require_ray()
        check_resources(cfg)
        super().__init__(cfg, run_dir, python, allow_load, stopping=stopping)
        _connect(self.ray, cfg)
        self.pg = None
        self.one_machine = True
        self._where(self._live_nodes(), None)      # before placement: a config error exits 2 at once
        from ray.util.placement_group import placement_group
        c = cfg.cluster
        bundles = ([dict(c.server_resources) or {"CPU": 0.01}] * c.servers
                   + [dict(c.worker_resources) or {"CPU": 0.01}] * c.workers)
        deadline = time.monotonic() + c.startup_timeout_s
        # a node the last attempt found silent: never place on it while Ray still lists it alive
        wait_silent_nodes(self.ray, deadline, self.stopping, c.startup_timeout_s)
        self.pg = placement_group(bundles, strategy="SPREAD")
        try:
            self._wait_placed(bundles, deadline)
            # where the bundles went: a node that joined during the wait (a replacement) counts
            placed = self.ray.util.placement_group_table(self.pg).get("bundles_to_node_id") or {}
            self._where(self._live_nodes(), set(placed.values()))
        except BaseException:
            try:
                self.ray.util.remove_placement_group(self.pg)
            except Exception as e:  # noqa: BLE001 - the placement's own error is the one to report
                log.warning("could not remove the placement group after a failed placement: %s: %s",
                            type(e).__name__, e)
            self.pg = None
            raise
        self.actors: list = []
        self.silent_nodes: dict[str, float] = {}    # shared by this attempt's actors (``_ActorProc``)

    def _live_nodes(self) -> dict[str, dict]:
        """The Ray cluster's live nodes by node id (``ray.nodes()``: a node lost a moment ago may be
        listed alive until Ray's health checks find it dead)."""
        nodes = {n.get("NodeID"): n for n in self.ray.nodes() if n.get("Alive")}
        self._nodes = nodes
        return nodes

    def _where(self, nodes: dict[str, dict], placed: set[str] | None) -> None:
        """Set ``one_machine`` (servers bind ``cluster.host``) and check the rules of several nodes,
        from the live ``nodes`` and, once the group is placed, the nodes holding its bundles
        (``placed``): one machine is one live node, this one, holding every bundle. Decided again
        after placement: a job started on one node whose roles were placed on a node that joined
        during the wait (the replacement of a lost node) bound its servers to loopback, out of the
        reach of roles on other machines.

        Raises
        ------
        ConfigError
            ``check_shared_checkpoints``, or the listener rule (TLS and tokens, or ``insecure: true``)
            for servers that bind their nodes' addresses.
        """
        here = self.ray.util.get_node_ip_address()
        check_shared_checkpoints(self.cfg, max(len(nodes), len(placed or ())))
        alone = len(nodes) == 1 and next(iter(nodes.values())).get("NodeManagerAddress") == here
        one = self.one_machine and alone and (placed is None or placed <= set(nodes))
        if self.one_machine and not one:    # servers bind their nodes' addresses: the listener rule applies
            from ..security.listen import check_listen
            check_listen("0.0.0.0", self.cfg.security, what="the Ray launcher's servers (on several nodes)",
                         key="their nodes' addresses")
        self.one_machine = one

    def _wait_placed(self, bundles: list[dict], deadline: float) -> None:
        """Wait until ``deadline`` (monotonic: ``cluster.startup_timeout_s`` after the attempt began to
        place its roles) for the placement group. When a role's resources are
        offered by no live node (its node was lost, none joined yet), says so once, after
        ``PLACEMENT_CHECK_S``, and goes on waiting for a node that offers them.

        Raises
        ------
        PlacementError
            Not placed in time: one line naming each role whose resources no live node offers (which
            resource, how much), or the resources taken when every one exists.
        StoppedWhilePlacing
            ``self.stopping()`` became true (the driver was preempted: SIGTERM) while waiting, checked every
            ``STOP_CHECK_S``: nothing of this attempt started, so there is nothing to wait for.
        """
        c = self.cfg.cluster
        needs = [("server", c.servers, bundles[0] if c.servers else {}),
                 ("worker", c.workers, bundles[-1] if c.workers else {})]
        ready_ref = self.pg.ready()
        said = False
        checked = time.monotonic()
        while True:
            left = deadline - time.monotonic()
            ready, _ = self.ray.wait([ready_ref], timeout=max(0.0, min(left, STOP_CHECK_S)))
            if ready:
                return
            if self.stopping():
                raise StoppedWhilePlacing("preempted while waiting for Ray to place the job's roles")
            if time.monotonic() < min(deadline, checked + PLACEMENT_CHECK_S):
                continue
            checked = time.monotonic()
            missing = unoffered(needs, list(self._live_nodes().values()))
            if time.monotonic() >= deadline:
                if missing:
                    why = "; ".join(missing)
                else:
                    keys = sorted({k for _, n, r in needs if n for k in r})
                    free = self.ray.available_resources()
                    free = {k: free.get(k, 0.0) for k in keys}
                    why = (f"the live nodes offer {', '.join(keys)}, but not free for every role: available "
                           f"{free} (taken by other work?)")
                raise PlacementError(f"Ray could not place the job's roles within cluster.startup_timeout_s="
                                     f"{c.startup_timeout_s:g}s: {why}", reason="placement", exit_code=None)
            if missing and not said:
                log.warning("%s: waiting up to %.0f s more (cluster.startup_timeout_s) for a Ray node that does",
                            "; ".join(missing), deadline - time.monotonic())
                said = True

    def _spawn(self, role: str, rank: int, extra: list[str], env: dict) -> Child:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        c = self.cfg.cluster
        resources = dict(c.server_resources if role == "server" else c.worker_resources) or {"CPU": 0.01}
        index = rank if role == "server" else c.servers + rank
        actor_cls = self.ray.remote(RoleActor)
        actor = actor_cls.options(
            num_cpus=resources.pop("CPU", 0), resources=resources, max_restarts=0, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
        ).remote(f"{role}{rank}")
        self.actors.append(actor)
        files, argv, skip = [], ["--role", role, "--rank", str(rank)], False
        for i, a in enumerate(extra):          # the actor places these files in its own directory
            if skip:
                skip = False
                continue
            if a in ("--ready-file", "--result-file"):
                files.append("ready" if a == "--ready-file" else "result")
                skip = True
                continue
            argv.append(a)
        if progress.ENV in env:
            files.append("progress")
            env = {k: v for k, v in env.items() if k != progress.ENV}
        # its metrics port and restarts (as the local launcher gives them); the file it writes its URL to
        # is on its node, read back through the actor (metrics_files)
        metrics_env = self.role_env(role, rank)
        if metrics_env.pop(METRICS_FILE_ENV, None) is not None:
            files.append("metrics")
        node_id, node_ip = self._start_call(role, rank, "start", actor.node.remote(), c.startup_timeout_s)
        node = getattr(self, "_nodes", {}).get(node_id) or self._live_nodes().get(node_id) or {}
        log.info("%s %d runs on node %s (%s)", role, rank, node_id, node_ip)
        if role == "server":
            argv += ["--host", c.host if self.one_machine else node_ip]
        withheld = self.withheld_env(role, rank)
        full_env = {k: v for k, v in {**forwarded_env(), **self._secret_env, **metrics_env, **env}.items()
                    if k not in withheld}
        pid = self._start_call(role, rank, "start its process",
                               actor.start.remote(self.config_path.read_text(), argv, full_env, files, withheld),
                               c.startup_timeout_s)
        log_path = self._start_call(role, rank, "name its log",
                                    actor.__ray_call__.remote(lambda a: str(a.log_path)), CALL_TIMEOUT_S)
        proc = _ActorProc(self.ray, actor, pid, (node_id, node_ip, int(node.get("NodeManagerPort") or 0)),
                          self.silent_nodes)
        child = RayChild(role, rank, proc, Path(f"{node_ip}:{log_path}"))
        child.actor = actor
        return child

    def _check_hangs(self) -> None:
        """``LocalCluster._check_hangs``; a role found hung whose actor answers no call is failed naming its
        Ray node, and whether the job's other actors there answer (``ray_silent.silent_cause``)."""
        try:
            super()._check_hangs()
        except LaunchError as e:
            c = next((c for c in [*self.servers, *self.workers] if (c.role, c.rank) == (e.role, e.rank)), None)
            proc = getattr(c, "proc", None)
            if not isinstance(proc, _ActorProc) or not proc.stalled or proc.node is None:
                raise
            mates = self._on_node(proc.node[0])
            silent_s = time.monotonic() - (proc.stalled_since or time.monotonic())
            reason = f"{e.reason}; " + silent_cause(self.ray, proc.node[:2], silent_s, [o.name for o in mates],
                                                    all(o.proc.stalled for o in mates))
            raise LaunchError(f"{c.name} (pid {proc.pid}) {reason}; last lines of {c.log_path}:\n{e.log_tail}",
                              role=e.role, rank=e.rank, exit_code=e.exit_code, reason=reason,
                              log_tail=e.log_tail) from None

    def _on_node(self, node_id: str) -> list:
        """This attempt's roles whose actors run on the Ray node ``node_id``."""
        return [o for o in [*self.servers, *self.workers]
                if isinstance(o.proc, _ActorProc) and o.proc.node and o.proc.node[0] == node_id]

    def _start_call(self, role: str, rank: int, what: str, ref, timeout: float):
        """The answer of a call to a new role's actor.

        Raises
        ------
        LaunchError
            The actor died (its node or process was lost: exit ``ACTOR_DIED``) or did not answer within
            ``timeout`` seconds: a failure of the attempt, handled by the restart rule.
        """
        try:
            return self.ray.get(ref, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            reason = (f"its Ray actor did not {what} within {timeout:g}s"
                      + (" (cluster.startup_timeout_s)" if timeout == self.cfg.cluster.startup_timeout_s else ""))
            code = None
        except self.ray.exceptions.RayActorError as e:
            cause = (str(e).splitlines() or [type(e).__name__])[0]
            reason = f"its Ray actor died before it could {what}: {cause}"
            code = ACTOR_DIED
        raise LaunchError(f"{role} {rank}: {reason}", role=role, rank=rank, exit_code=code, reason=reason,
                          log_tail="(no log: its Ray actor did not answer)")

    def metrics_files(self) -> None:
        """Copy each role's /metrics URL, written on its node, into the driver's run directory, where
        ``prometheus.announce`` reads them for ``prometheus.json``. A role whose URL was copied is not
        asked again (this runs every hang check until every URL is in)."""
        for c in [*self.servers, *self.workers]:
            copied = self.run_dir / f"{c.role}-{c.rank}.metrics"
            if copied.is_file() and copied.stat().st_size:
                continue
            url = c._read("metrics")
            if url:
                copied.write_text(url + "\n")

    def shutdown(self) -> None:
        """Stop every role (through its actor), read the workers' last progress reports (kept by each
        ``RayChild`` for the supervisor's ``examples_replayed``), then end the actors and the placement
        group. Idempotent.

        A node every actor of this attempt on it left unanswered (frozen, vanished) is remembered: the next
        attempt waits for Ray to find it dead before it places its roles (``ray_silent``); its roles are
        not signalled (no call reaches them: each step of the teardown logged them as not exiting)."""
        for node_id, since in self.silent_nodes.items():
            mates = self._on_node(node_id)
            if mates and all(o.proc.stalled and not o.proc.actor_dead for o in mates):
                remember(node_id, mates[0].proc.node[1], since)
                for o in mates:
                    o.proc.actor_dead = True
        super().shutdown()
        for w in self.workers:
            if isinstance(w, RayChild) and not w.proc.actor_dead:
                try:
                    w.report()
                except Exception:  # noqa: BLE001 - the last report read before stays
                    pass
        # a stalled actor answers no cleanup either: then wait no longer than for any call to it
        stalled = any(getattr(c.proc, "stalled", False) for c in [*self.servers, *self.workers])
        try:
            self.ray.wait([a.cleanup.remote() for a in self.actors], num_returns=len(self.actors),
                          timeout=STALLED_TIMEOUT_S if stalled else CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - dead actors keep their files; the role is gone anyway
            pass
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        for c in [*self.servers, *self.workers]:
            if isinstance(c.proc, _ActorProc):    # killed above: never called again (reads keep what they had)
                c.proc.actor_dead = True
        self.actors = []
        if self.pg is not None:
            try:
                self.ray.util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                pass
            self.pg = None
