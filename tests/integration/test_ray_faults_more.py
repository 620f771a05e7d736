"""More faults under ``--launcher ray`` (``engine.launch.ray``), on a real one-node Ray cluster started
once for this module (Ray's ``ray.cluster_utils.Cluster``, as ``test_ray_launcher`` starts its two nodes;
its teardown ends every process of the cluster's session directory by pid, even when a test failed).
One node: the servers bind 127.0.0.1, so the small logreg demo runs without TLS.

- SIGTERM to the driver preempts the job (checkpoint, exit 75, resumable): ``ray.init`` replaced the
  launcher's SIGTERM handler with Ray's, which exited 15 with no checkpoint.
- A killed worker actor's lost examples are counted (``examples_replayed``): they read 0, because the
  reports were read after the actors were killed.
- A role's actor that does not answer in its start-up is a ``LaunchError`` of that role (the restart
  rule), not a ``GetTimeoutError`` traceback.
- A Ray address that is malformed or unreachable, and resources Ray cannot make a bundle of, end
  ``engine train`` with exit 2 and one line naming the key, at once: the driver hung forever in Ray's
  connection retries, or died with a traceback.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine import progress
from engine.preempt import EXIT_PREEMPTED
from hdfs_io import SUCCESS_NAME
from tests.integration.test_ray_launcher import (CLUSTERS, _end_ray, _published, _ray_start_report, _worker_actor,
                                                ray_roles, restore_env)
from tests.waiting import until

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "logreg_demo.yaml"
# ~280 steps per worker; every step pauses 20 ms: an attempt trains ~6 s, so a signal aimed at step 20 lands
# while the job trains
SMALL = ["cluster.warm_up=false", "model.examples_per_worker=3000", "cluster.workers=2", "model.epochs=6",
         "checkpoint.align_steps=8"]
PACED = "worker.after_step=sleep:0.02"


@pytest.fixture(scope="module")
def ray_one_node():
    """(address, session temp dir) of a one-node Ray cluster (1 CPU, no dashboard, a small object
    store); the role actors make their directories in ``{tmp}/actors``."""
    from ray.cluster_utils import Cluster
    tempfile.gettempdir()             # pytest's own temp dir is fixed now, before TMPDIR changes below
    old = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "TMPDIR")}
    cluster = tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")     # short: Ray's socket paths must stay short
        os.environ["RAY_TMPDIR"] = tmp
        os.environ["TMPDIR"] = os.path.join(tmp, "actors")
        os.mkdir(os.environ["TMPDIR"])
        try:
            cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=80 << 20,
                                                                        include_dashboard=False))
            cluster.wait_for_nodes()
        except Exception as e:          # Ray raises a bare Exception for a node that never registered
            raise RuntimeError(f"the test Ray cluster did not start: {e}\n{_ray_start_report(tmp)}") from e
        finally:
            if old["TMPDIR"] is None:   # only the node's processes take it
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = old["TMPDIR"]
        CLUSTERS.append(tmp)
        yield cluster.address, Path(tmp)
        CLUSTERS.remove(tmp)
    finally:
        try:
            if tmp is not None:
                _end_ray(cluster, tmp)
        finally:
            restore_env(old)


def demo_cmd(tmp: Path, tag: str, address: str, *sets: str) -> list[str]:
    base = [f"cluster.ray_address={address}", f"checkpoint.root={tmp / ('ckpt-' + tag)}", *SMALL, *sets]
    return [sys.executable, "-m", "engine", "train", str(DEMO), "--launcher", "ray", "--run-dir",
            str(tmp / f"run-{tag}"), *[a for s in base for a in ("--set", s)]]


def worker_step(session: Path, rank: int, since: float) -> int:
    """Worker ``rank``'s step in its newest progress report, written in its actor's directory on this
    machine's disk (0 before one exists); directories made before ``since`` (time.time()) are not this
    job's."""
    best = 0
    for f in glob.glob(str(session / "actors" / f"engine-ray-worker{rank}-*" / f"worker{rank}.progress")):
        try:
            if os.path.getmtime(os.path.dirname(f)) < since:
                continue
        except OSError:
            continue
        r = progress.read(Path(f))
        if r:
            best = max(best, int(r.get("step", 0)))
    return best


def finish(driver: subprocess.Popen, err, timeout: float) -> tuple[str, str]:
    """The driver's stdout and stderr once it ended (killed, with its process group, past ``timeout``)."""
    try:
        out, _ = driver.communicate(timeout=timeout)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(10)
        err.seek(0)
    return out or "", err.read()


def no_roles_left(timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while ray_roles() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not ray_roles()


@pytest.mark.long   # make test-long (~35 s): the launcher's SIGTERM preemption is test_preemption's; Ray's handler kept is this test's
@pytest.mark.slow
def test_sigterm_to_the_ray_driver_preempts_at_a_checkpoint_and_resume_finishes(ray_one_node, tmp_path):
    address, session = ray_one_node
    since = time.time()
    cmd = demo_cmd(tmp_path, "term", address)
    with open(tmp_path / "driver.err", "w+") as err:
        driver = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "ENGINE_FAILPOINTS": PACED},
                                  stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        try:
            until(lambda: driver.poll() is not None or worker_step(session, 1, since) >= 20, "worker 1 at step 20",
                  timeout_s=120, every_s=0.05)
            assert driver.poll() is None, "the job ended before the SIGTERM"
            driver.send_signal(signal.SIGTERM)
        finally:
            out, text = finish(driver, err, 120)
    assert driver.returncode == EXIT_PREEMPTED, text[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["preempted"] is True and final["checkpoint"], final
    assert Path(final["checkpoint"], SUCCESS_NAME).is_file()
    with open(Path(final["checkpoint"], "manifest.json")) as f:         # mid-run, not the end of training
        assert json.load(f)["sources"]["train"]["epoch"] < 5
    assert "preempted; resume with" in text and "Traceback" not in text, text[-3000:]
    assert no_roles_left()
    # --resume continues from there to the end (no pause: a few seconds of training)
    p = subprocess.run(demo_cmd(tmp_path, "term", address) + ["--resume"], cwd=REPO, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = json.loads(p.stdout.strip().splitlines()[-1])
    assert resumed["restarts"] == 0 and Path(resumed["checkpoint"], SUCCESS_NAME).is_file(), resumed
    assert no_roles_left()


@pytest.mark.slow
def test_sigterm_while_ray_places_the_roles_stops_the_job_resumable_at_once(ray_one_node, tmp_path):
    """No node offers the workers' resources (as after a lost node, none joined yet): the driver waits up to
    cluster.startup_timeout_s (120 s here) for the placement. A SIGTERM meanwhile (the driver's own VM
    preempted) stops it within a second, exit 75, one line saying how to resume, nothing left behind.
    Before, the driver waited out the placement first (two minutes of the preemption's grace), then
    started the roles."""
    address, _ = ray_one_node
    cmd = demo_cmd(tmp_path, "place", address, "cluster.worker_resources={lost_node: 1}",
                   "cluster.startup_timeout_s=120")
    with open(tmp_path / "driver.err", "w+") as err:
        driver = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                  start_new_session=True)
        try:
            until(lambda: driver.poll() is not None or "waiting up to" in Path(err.name).read_text(),
                  "the driver waiting for a node that offers lost_node", timeout_s=90, every_s=0.1)
            assert driver.poll() is None, Path(err.name).read_text()[-3000:]
            t0 = time.monotonic()
            driver.send_signal(signal.SIGTERM)
            out, text = finish(driver, err, 60)
            took = time.monotonic() - t0
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait(10)
    assert driver.returncode == EXIT_PREEMPTED, text[-3000:]
    assert took < 15, took
    assert "preempted while waiting for Ray to place the job's roles" in text, text[-3000:]
    assert "preempted; resume with" in text and "Traceback" not in text, text[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["preempted"] is True
    assert no_roles_left()


@pytest.mark.long   # make test-long (pyproject.toml): ~40 s; test_ray_launcher's killed-actor test (make test) runs the same recovery
@pytest.mark.slow
def test_a_killed_worker_actor_counts_the_examples_to_train_again(ray_one_node, tmp_path):
    """Worker 1's actor is killed (SIGKILL: its role dies with it) well past a published checkpoint
    (a checkpoint every 96 steps; the kill 24 steps and 2 s after the first: the launcher, which reads
    the reports every second, read both workers' after the checkpoint); the job restarts from that
    checkpoint and finishes, and its final line counts the examples the failed attempt trained after
    it (as the local launcher's does, test_chaos_offline: ``examples_replayed > 0``), the figure of the
    restart's own log line. Worker 1's count is the launcher's last read of it (its progress file was on
    its actor's node), worker 0's its final report, read before its actor was ended."""
    address, session = ray_one_node
    since = time.time()
    root = tmp_path / "ckpt-kill"
    cmd = demo_cmd(tmp_path, "kill", address, "checkpoint.delta_every=96steps")
    killed = None
    with open(tmp_path / "driver.err", "w+") as err:
        driver = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "ENGINE_FAILPOINTS": PACED},
                                  stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        try:
            until(lambda: driver.poll() is not None or _published(root), "a published checkpoint", timeout_s=120,
                  every_s=0.02)
            at, seen = worker_step(session, 1, since), time.monotonic()
            until(lambda: driver.poll() is not None or (worker_step(session, 1, since) >= at + 24
                                                        and time.monotonic() - seen >= 2.0),
                  "worker 1 past the checkpoint", timeout_s=60, every_s=0.02)
            killed = _worker_actor(1) if driver.poll() is None else None
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
        finally:
            out, text = finish(driver, err, 180)
    assert killed is not None, f"worker 1's actor was not found, or the job had ended\n{text[-3000:]}"
    assert driver.returncode == 0, text[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["restarts"] == 1 and "worker 1" in text, (final, text[-3000:])
    restart = re.search(r"restart 1/\d+ from (\S+) \((\d+) examples to train again\)", text)
    assert restart and "no checkpoint yet" not in restart.group(0), text[-3000:]
    assert final["examples_replayed"] > 0, (final, restart.group(0))
    assert final["examples_replayed"] == int(restart.group(2)), (final, restart.group(0))
    assert no_roles_left()


@pytest.mark.slow
def test_an_actor_that_does_not_answer_in_its_start_up_is_a_launch_error_of_its_role(ray_one_node, tmp_path):
    """The role's actor is created but does not answer within cluster.startup_timeout_s (here 1 ms: a
    new actor's process takes far longer to start): a LaunchError naming the role and rank, which the
    supervisor's restart rule handles; before, Ray's GetTimeoutError escaped as a traceback. (The other
    case, ``RayActorError``: the actor died in its start-up, takes the same path.)"""
    import ray

    from engine.config import load_config
    from engine.errors import LaunchError
    from engine.launch.ray import RayCluster
    address, _ = ray_one_node
    cfg = load_config(str(DEMO), ["cluster.launcher=ray", f"cluster.ray_address={address}", "cluster.servers=1",
                                  "cluster.workers=1", "cluster.warm_up=false"])
    handler = signal.getsignal(signal.SIGTERM)
    cluster = None
    try:
        cluster = RayCluster(cfg, tmp_path / "run")
        # ray.init kept this process's SIGTERM handler (the launcher's: preempt)
        assert signal.getsignal(signal.SIGTERM) is handler
        cluster.cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, startup_timeout_s=0.001))
        with pytest.raises(LaunchError) as e:
            cluster.start_servers()
        assert e.value.role == "server" and e.value.rank == 0, e.value
        assert "did not start within 0.001s (cluster.startup_timeout_s)" in str(e.value), e.value
    finally:
        try:
            if cluster is not None:
                cluster.shutdown()
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, handler)
    assert no_roles_left()


def _train(tmp_path: Path, *sets: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "engine", "train", str(DEMO), "--launcher", "ray", "--run-dir",
           str(tmp_path / "run"), *[a for s in ("cluster.warm_up=false", *sets) for a in ("--set", s)]]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _one_line(p: subprocess.CompletedProcess, *words: str) -> str:
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("engine train:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), p.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("address, why", [
    ("127.0.0.1:1", "Connection refused"),                  # nothing listens: Ray retried for ever
    ("no-such-host.invalid:6379", "no Ray cluster reachable"),  # unresolvable: the same
    ("foo", "expected HOST:PORT"),                          # malformed: Ray's ValueError traceback
])
def test_an_unreachable_or_malformed_ray_address_exits_2_at_once_naming_the_key(tmp_path, address, why):
    t0 = time.monotonic()
    p = _train(tmp_path, f"cluster.ray_address={address}")
    _one_line(p, "cluster.ray_address", repr(address), why)
    assert time.monotonic() - t0 < 60


def test_an_unreachable_ray_address_from_the_environment_names_ray_address(tmp_path):
    p = _train(tmp_path, env={"RAY_ADDRESS": "127.0.0.1:1"})
    line = _one_line(p, "RAY_ADDRESS", "Connection refused")
    assert "cluster.ray_address" not in line


@pytest.mark.parametrize("key, value, why", [
    ("server_resources", "{CPU: 0}", "at least one resource above 0"),     # Ray: "Bundles cannot be ... 0 values"
    ("worker_resources", "{CPU: 0, worker_node: 0}", "at least one resource above 0"),
    ("server_resources", "{CPU: 0.00001}", "below Ray's smallest quantity"),
])
def test_ray_resources_that_make_no_bundle_exit_2_before_ray_starts(tmp_path, key, value, why):
    p = _train(tmp_path, f"cluster.{key}={value}")
    _one_line(p, f"cluster.{key}", why)
    assert "Ray: started" not in p.stderr
