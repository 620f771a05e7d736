"""The Ray launcher on a real two-node Ray cluster (Ray's own ``ray.cluster_utils.Cluster``, started
once for the session, sized for a 2-core machine: 1 CPU per node, no dashboard, a small object store).
The nodes offer distinct custom resources, ``ps_node`` and ``worker_node``, which pin the servers to one
and the workers to the other. Nodes bind the machine's address, not loopback, so the servers run with
mutual TLS and tokens. The teardown ends every process the session's Ray started, by pid, and removes its
directory (where the role actors' own directories are made too), even when a test failed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from engine.launch.procs import parent_pid
from engine.security import certs
from hdfs_io import SUCCESS_NAME
from tests.waiting import until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
AUC_TOLERANCE = 0.002


def _pids_using(path: str) -> list[int]:
    """Processes whose command line names ``path`` (Ray's processes name their session directory)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if path.encode() in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


RAY_START_ATTEMPTS = 2      # a node that does not register within Ray's own 30 s gets one more try


def _end_ray(cluster, tmp: str) -> None:
    """Shut ``cluster`` down (None: its start failed), end every process of its session directory
    ``tmp`` by pid (Ray's agents may outlive the shutdown) and remove ``tmp``."""
    try:
        if cluster is not None:
            cluster.shutdown()
    finally:
        for _ in range(20):
            pids = _pids_using(tmp)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        shutil.rmtree(tmp, ignore_errors=True)


def _ray_start_report(tmp: str) -> str:
    """What a failed start left: each live process of the session (pid, state, name) and the last lines
    of each raylet's logs, or the note that no raylet wrote one."""
    lines = []
    for pid in _pids_using(tmp):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        lines.append(f"  pid {pid} {stat[stat.rindex(')') + 2]} {stat[stat.index('(') + 1:stat.rindex(')')]}")
    logs = sorted(f for f in Path(tmp).glob("ray/session_latest/logs/raylet*") if f.suffix in (".out", ".err"))
    for f in logs:
        lines += [f"  {f.name}: {t[:300]}" for t in f.read_text(errors="replace").splitlines()[-3:]]
    if not logs:
        lines.append("  no raylet wrote a log")
    return "\n".join(lines)


@pytest.fixture(scope="session")
def ray_cluster():
    """(address, head node, worker node, session temp dir) of a 2-node Ray cluster.

    Ray gives a node 30 s (its own constant) to register with the GCS; on this loaded 2-core machine a
    raylet once never wrote a line in that time. Such a start is retried once in a new session
    directory, and a start that fails twice fails the tests with what each attempt left (processes, log
    tails). Every attempt's processes and directory are removed."""
    from ray.cluster_utils import Cluster
    tempfile.gettempdir()             # pytest's own temp dir is fixed now, before TMPDIR changes below
    old = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "TMPDIR")}
    reports = []
    cluster = tmp = None
    try:
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")     # short: Ray's socket paths must stay short
            os.environ["RAY_TMPDIR"] = tmp
            # the nodes' processes, and so the role actors, make their temp dirs (engine-ray-*) in the
            # session directory: a killed actor's, which it cannot remove, goes with the session
            os.environ["TMPDIR"] = os.path.join(tmp, "actors")
            os.mkdir(os.environ["TMPDIR"])
            try:
                common = dict(num_cpus=1, object_store_memory=80 << 20, include_dashboard=False)
                cluster = Cluster(initialize_head=True, head_node_args={**common, "resources": {"ps_node": 4}})
                worker = cluster.add_node(**common, resources={"worker_node": 4})
                cluster.wait_for_nodes()
                break
            except Exception as e:          # Ray raises a bare Exception for a node that never registered
                try:
                    report = _ray_start_report(tmp)
                except Exception as r:      # noqa: BLE001 - the start's own error matters more
                    report = f"  (no report: {r})"
                reports.append(f"attempt {attempt}: {type(e).__name__}: {e}\n{report}")
                try:
                    _end_ray(cluster, tmp)
                except Exception as r:      # noqa: BLE001 - its processes were killed by pid all the same
                    reports.append(f"  (shutdown of attempt {attempt} failed: {r})")
                cluster = tmp = None
                if attempt == RAY_START_ATTEMPTS:
                    raise RuntimeError("the test Ray cluster did not start:\n" + "\n".join(reports)) from e
            finally:
                if old["TMPDIR"] is None:       # only the nodes' processes take it
                    os.environ.pop("TMPDIR", None)
                else:
                    os.environ["TMPDIR"] = old["TMPDIR"]
        if reports:
            warnings.warn("the test Ray cluster started on a retry:\n" + "\n".join(reports))
        CLUSTERS.append(tmp)
        yield cluster.address, cluster.head_node, worker, tmp
        CLUSTERS.remove(tmp)
    finally:
        try:
            if tmp is not None:
                _end_ray(cluster, tmp)
        finally:
            restore_env(old)


def restore_env(old: dict) -> None:
    """Put back the environment variables ``old`` saved (``{name: value or None}``; None: it was unset)."""
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def secured_sets(tmp: Path, node_ip: str) -> list[str]:
    d = tmp / "creds"
    if not d.exists():
        certs.write_cluster_credentials(d, [node_ip])
    return [f"security.tls.cert={d / 'server.pem'}", f"security.tls.key={d / 'server.key'}",
            f"security.tls.ca={d / 'ca.pem'}", f"security.tls.client_cert={d / 'client.pem'}",
            f"security.tls.client_key={d / 'client.key'}", f"security.token_file={d / 'token'}",
            f"security.admin_token_file={d / 'admin_token'}"]


def ray_cmd(tmp: Path, tag: str, address: str, node_ip: str, *sets: str) -> list[str]:
    base = ["mode=sync", "cluster.servers=2", "cluster.workers=2", f"cluster.ray_address={address}",
            "cluster.server_resources={ps_node: 1}", "cluster.worker_resources={worker_node: 1}",
            f"checkpoint.root={tmp / ('ckpt-' + tag)}", "checkpoint.shared=true",
            f"model.data.cache_dir={tmp / 'cache'}", f"model.metrics_dir={tmp / 'metrics'}",
            f"observability.tensorboard_dir={tmp / 'tb'}",
            *secured_sets(tmp, node_ip), *sets]
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--launcher", "ray",
            "--run-dir", str(tmp / f"run-{tag}"), *[a for s in base for a in ("--set", s)]]


@pytest.mark.long   # make test-long (pyproject.toml): the killed-actor test runs a CTR job on these Ray nodes too
def test_sync_ctr_on_two_ray_nodes_matches_the_local_launcher(ray_cluster, tmp_path, loopback_reference):
    address, head, worker, _ = ray_cluster
    reference, _ = loopback_reference
    p = subprocess.run(ray_cmd(tmp_path, "ray", address, head.node_ip_address), cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    final = json.loads(p.stdout.strip().splitlines()[-1])
    assert final["event"] == "final" and final["restarts"] == 0
    assert abs(final["test_auc"] - reference["test"]["auc"]) <= AUC_TOLERANCE, (final, reference["test"])
    placed = dict(re.findall(r"(server \d|worker \d) runs on node (\w+)", p.stderr))
    assert placed == {"server 0": head.node_id, "server 1": head.node_id,
                      "worker 0": worker.node_id, "worker 1": worker.node_id}, placed
    assert re.search(r"\(worker0 pid=\d+\).*worker0 INFO", p.stderr)          # role logs reach the driver
    assert Path(final["checkpoint"], "_SUCCESS").exists()
    assert not ray_roles()


#: the session directories of the test Ray clusters this process has running, newest last (their
#: fixtures push and pop them): role processes are looked for below the newest only, so the roles of a
#: Ray test of another module running beside this one (pytest -n) are neither counted nor signalled
CLUSTERS: list[str] = []


def ray_roles() -> list[int]:
    """Role processes started by the actors of this process's current test Ray cluster (their config lies
    in an actor's ``engine-ray-*`` directory below its session directory); one test of this process runs
    at a time, so any left after a test are that test's."""
    here = CLUSTERS[-1] if CLUSTERS else ""
    return [pid for pid in _pids_using("--role") if "engine-ray-" in (c := _cmdline(pid)) and here in c]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _worker_role(rank: int) -> int | None:
    """The pid of worker ``rank``'s role process, which a Ray actor started (read from this machine's
    /proc, where both nodes run, not from the driver's forwarded logs, which lag)."""
    return next((pid for pid in ray_roles() if f"--role worker --rank {rank} " in _cmdline(pid) + " "), None)


def _worker_actor(rank: int) -> int | None:
    """The pid of the Ray actor running worker ``rank``: the parent of its role process."""
    pid = _worker_role(rank)
    try:
        return None if pid is None else parent_pid(pid)
    except (OSError, ValueError, IndexError):
        return None


def _published(root: Path) -> bool:
    """Whether a checkpoint under ``root`` has its ``_SUCCESS`` file (a directory renamed or removed
    during the walk is skipped)."""
    return any(SUCCESS_NAME in files for _, _, files in os.walk(root))


def _signal_worker_actor(tmp_path: Path, cmd: list[str], env: dict, root: Path, sig: int,
                         timeout_s: float, find=_worker_actor) -> tuple[int, str, str, int | None]:
    """Run the driver ``cmd``; once its run published a checkpoint under ``root`` (its _SUCCESS file,
    seen at once on this machine's disk), send ``sig`` to worker 1's actor (``find``: or another process
    of worker 1, by its rank). -> (driver's exit code, its stdout, its stderr, the pid signalled or None
    when it was not found or the job had ended). A stopped process is continued at the end, should it
    outlive the restart."""
    sent = None
    with open(tmp_path / "driver.err", "w+") as err:
        driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            until(lambda: driver.poll() is not None or _published(root), "a published checkpoint",
                  timeout_s=300, every_s=0.02)
            sent = find(1) if driver.poll() is None else None
            if sent is not None:
                os.kill(sent, sig)
            out, _ = driver.communicate(timeout=timeout_s)
        finally:
            if sent is not None and sig == signal.SIGSTOP:
                try:
                    os.kill(sent, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            if driver.poll() is None:
                driver.kill()
                driver.wait(10)
            err.seek(0)
            text = err.read()
    return driver.returncode, out, text, sent


def test_a_killed_worker_actor_is_recovered_from_the_newest_checkpoint(ray_cluster, tmp_path):
    address, head, _, _ = ray_cluster
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.05"}   # ~3 s of training
    cmd = ray_cmd(tmp_path, "kill", address, head.node_ip_address, "checkpoint.align_steps=8",
                  "checkpoint.delta_every=8steps", "observability.prometheus_port=0")
    # its own process: its role dies with it
    code, out, text, killed = _signal_worker_actor(tmp_path, cmd, env, tmp_path / "ckpt-kill", signal.SIGKILL, 300)
    lines = text.splitlines(keepends=True)
    assert code == 0, "".join(lines[-80:])
    assert killed is not None, f"worker 1's actor was not found, or the job had ended: {ray_roles()}\n" \
                               + "".join(lines[-60:])
    final = json.loads(out.strip().splitlines()[-1])
    err = "".join(lines)
    assert final["restarts"] == 1 and "worker 1" in err and "restart 1/" in err, err[-3000:]
    assert final["test_auc"] > 0.7, final
    assert not ray_roles()
    # every role's /metrics URL, written on its node, reached the driver's Prometheus target file (logged as
    # written; emptied once the attempt's roles were gone: nothing left to scrape)
    target_file = tmp_path / "run-kill" / "restart-1" / "prometheus.json"
    (announced,) = [ln for ln in lines if f"Prometheus metrics (file_sd targets in {target_file}): " in ln]
    assert re.findall(r"(server|worker) (\d) http", announced) == [
        ("server", "0"), ("server", "1"), ("worker", "0"), ("worker", "1")], announced
    assert json.loads(target_file.read_text()) == []


def test_a_local_root_on_several_nodes_must_be_declared_shared(ray_cluster, tmp_path):
    address, head, _, _ = ray_cluster
    cmd = ray_cmd(tmp_path, "noshare", address, head.node_ip_address, "checkpoint.shared=false")
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "checkpoint.root" in p.stderr and "checkpoint.shared: true" in p.stderr and "2 nodes" in p.stderr


def test_without_ray_the_launcher_says_how_to_install_it(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from engine.cli import main; "
            f"sys.exit(main(['train', {str(REPO / 'configs/ctr.yaml')!r}, '--launcher', 'ray', '--run-dir', "
            f"{str(tmp_path / 'run')!r}, '--set', 'model.data.cache_dir={tmp_path / 'cache'}']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "pip install 'sparse-engine[ray]'" in p.stderr


@pytest.mark.long   # make test-long (see pyproject.toml): the killed-actor test tears the roles down too
def test_ctrl_c_on_the_driver_stops_every_role(ray_cluster, tmp_path):
    address, head, _, _ = ray_cluster
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.2"}      # a run of ~13 s
    driver = subprocess.Popen(ray_cmd(tmp_path, "int", address, head.node_ip_address), cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in driver.stderr:
            lines.append(line)
            if "(worker1 pid=" in line:                   # both workers run: interrupt the driver
                driver.send_signal(signal.SIGINT)
                break
        rest, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 130, "".join(lines[-40:])
    deadline = time.monotonic() + 30
    while ray_roles() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_roles()


@pytest.mark.long   # make test-long (see pyproject.toml): ~30 s of an actor call's timeout; the killed-actor test
# covers the restart itself
def test_a_stalled_worker_actor_reads_as_no_heartbeat_and_the_job_restarts(ray_cluster, tmp_path):
    """Worker 1's actor is frozen (SIGSTOP; its role process trains on): every call to it times out
    (``CALL_TIMEOUT_S``). The launcher keeps the role's last progress report, whose beat ages, and
    declares it hung with "no heartbeat", naming the actor as the one silent process (worker 0's actor,
    on the same node, answers), then restarts the job, which completes. Before, a timed-out read counted
    as no report at all and the reason said the worker never reported; the node was not named."""
    address, head, worker, _ = ray_cluster
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.2"}      # a run of ~13 s
    cmd = ray_cmd(tmp_path, "stall", address, head.node_ip_address, "checkpoint.align_steps=8",
                  "checkpoint.delta_every=8steps", "client.dead_after_s=6")
    code, out, text, stopped = _signal_worker_actor(tmp_path, cmd, env, tmp_path / "ckpt-stall", signal.SIGSTOP,
                                                    400)
    assert stopped is not None, text[-3000:]
    assert code == 0, text[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["restarts"] == 1, (final, text[-3000:])
    assert "worker 1" in text and "no heartbeat for" in text and "no progress report" not in text, text[-3000:]
    # the actor alone is silent: worker 0's actor, on the same node, answers (not a frozen node)
    failed = re.search(r"worker 1 failed \((.*)\); restart 1/", text)
    assert failed and "its Ray actor answers no call for" in failed.group(1) \
        and f"while the job's other actors on its Ray node {worker.node_id[:12]}" in failed.group(1), \
        text[-3000:]
    deadline = time.monotonic() + 30
    while ray_roles() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_roles()


@pytest.mark.long   # make test-long (see pyproject.toml): the frozen-actor test covers the same restart
def test_a_frozen_worker_role_under_an_answering_actor_is_declared_dead_and_the_job_restarts(ray_cluster, tmp_path):
    """Worker 1's role process is frozen (SIGSTOP) while its actor answers every call: the role's progress
    report, read by the actor on the role's node, stops beating, and the launcher declares the worker
    dead ("no heartbeat") after client.dead_after_s, tears the frozen role down and restarts the job,
    which completes, with no role process left."""
    address, head, _, _ = ray_cluster
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.2"}      # a run of ~13 s
    cmd = ray_cmd(tmp_path, "frozen", address, head.node_ip_address, "checkpoint.align_steps=8",
                  "checkpoint.delta_every=8steps", "client.dead_after_s=6")
    code, out, text, stopped = _signal_worker_actor(tmp_path, cmd, env, tmp_path / "ckpt-frozen", signal.SIGSTOP,
                                                    300, find=_worker_role)
    assert stopped is not None, text[-3000:]
    assert code == 0, text[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["restarts"] == 1, (final, text[-3000:])
    assert "worker 1" in text and "no heartbeat for" in text, text[-3000:]
    deadline = time.monotonic() + 30
    while ray_roles() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_roles()
