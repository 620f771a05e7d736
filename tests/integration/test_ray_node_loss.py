"""A whole Ray node lost in the middle of a job under ``--launcher ray`` (``engine.launch.ray``): its raylet
and every process on it die together (``Cluster.remove_node(node, allow_graceful=False)``: a preempted VM).

Each test starts its own two-node Ray cluster (``ray.cluster_utils.Cluster``, 1 CPU and a small object store
per node, no dashboard, as ``test_ray_launcher`` does), the head offering the custom resource of the roles
that stay and the other node that of the roles that are lost, and ends every process of its session
directory by pid, even when it failed. The job is ``test_ray_launcher``'s CTR-DNN sync job (2 servers, 2
workers, mutual TLS and tokens, a checkpoint every 8 aligned steps); the node is removed once the first
checkpoint is published. Every example must be trained once: the final checkpoint's show counts equal the
uninterrupted local run's (``loopback_reference``).

- A replacement node joins: the job restarts from the newest checkpoint on it and finishes (exit 0), every
  process of the lost node ended (its roles with their actors). The recovery worked before too; the
  failure said "was killed by signal 9", where it now names the lost node.
- No node replaces it: the job ends ``cluster.startup_timeout_s`` after the restart began, exit 69, with
  one line naming the role and the resource no node offers and the command that continues the job; that
  command, run while the node is still missing and given a node during its wait, finishes the job with
  its servers bound to their node's address. Before, the job ended with exit 1 and a line listing the
  cluster's resources, and a job started on one node bound its servers to loopback even when its roles
  were placed on a node that joined during the wait.
- The workers' node lost inside a checkpoint write (its coordinator held before the publish by a
  failpoint): the restart restores the checkpoint before it, and the job trains every example once.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine import job_checkpoints
from engine.config import load_config
from engine.errors import EXIT_NO_RESOURCES
from engine.launch.procs import parent_pid
from engine.launch.ray import _descendants
from hdfs_io import SUCCESS_NAME
from tests.integration.test_offline_resume import _state
from tests.integration.test_ray_faults_more import finish
from tests.integration.test_ray_launcher import CLUSTERS, _cmdline, _end_ray, _published, _ray_start_report, ray_cmd, \
    ray_roles, restore_env
from tests.waiting import until, until_while_running

pytestmark = [pytest.mark.slow, pytest.mark.long]     # make test-long: minutes each (two Ray clusters' worth)

REPO = Path(__file__).resolve().parents[2]
NODE = dict(num_cpus=1, object_store_memory=80 << 20, include_dashboard=False)
STEP_SLEEP = "worker.after_step=sleep:0.1"      # ~7 s of training: the node is lost while the job trains
GONE_S = 15.0       # how long the lost node's processes may take to end (its roles die with their actors)
RESOURCE = {"server": "ps_node", "worker": "worker_node"}       # what pins each role to its node


@contextlib.contextmanager
def ray_nodes(stays: str, lost: str):
    """(cluster, session dir) of a Ray cluster whose head offers the custom resource ``stays`` and whose
    other node (``cluster.lost``) offers ``lost``; ended, its processes killed by pid, on exit."""
    from ray.cluster_utils import Cluster
    tempfile.gettempdir()             # pytest's own temp dir is fixed now, before TMPDIR changes below
    old = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "TMPDIR")}
    cluster = None
    tmp = tempfile.mkdtemp(prefix="rn", dir="/tmp")     # short: Ray's socket paths must stay short
    try:
        os.environ["RAY_TMPDIR"] = tmp
        os.environ["TMPDIR"] = os.path.join(tmp, "actors")     # the actors' engine-ray-* dirs
        os.mkdir(os.environ["TMPDIR"])
        try:
            cluster = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {stays: 4}})
            cluster.lost = cluster.add_node(**NODE, resources={lost: 4})
            cluster.wait_for_nodes()
        except Exception as e:          # Ray raises a bare Exception for a node that never registered
            raise RuntimeError(f"the test Ray cluster did not start: {e}\n{_ray_start_report(tmp)}") from e
        CLUSTERS.append(tmp)
        yield cluster, tmp
    finally:
        if tmp in CLUSTERS:
            CLUSTERS.remove(tmp)
        try:
            _end_ray(cluster, tmp)
        finally:
            restore_env(old)


def add_node(cluster, tmp: str, resources: dict):
    """A node offering ``resources`` joins ``cluster`` (its actors' directories in the session's)."""
    os.environ["TMPDIR"] = os.path.join(tmp, "actors")
    try:
        node = cluster.add_node(**NODE, resources=resources)
        cluster.wait_for_nodes()
        return node
    finally:
        os.environ.pop("TMPDIR", None)


def node_processes(node) -> dict[int, str]:
    """Every process of a Ray node now: its raylet, what the raylet started (agents, actor workers, their
    role processes) and its other processes, pid -> command line."""
    raylet = node.all_processes["raylet"][0].process.pid
    pids = {raylet} | _descendants(raylet) | {p.process.pid for v in node.all_processes.values() for p in v}
    return {p: _cmdline(p) for p in pids}


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: it only waits for its parent to read it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def reference_shows(loopback_reference) -> float:
    """The show counts (summed) of the uninterrupted CTR-DNN sync job's final checkpoint."""
    _, config = loopback_reference
    uri, _ = job_checkpoints.newest(load_config(str(config)))
    return shows(uri)


def shows(checkpoint: str) -> float:
    return float(_state(checkpoint)[0][("embedding", "show")].sum())


def lose_node_mid_job(cluster, tmp_path: Path, driver: subprocess.Popen, err, when=None,
                      what: str = "a published checkpoint") -> tuple[dict[int, str], float]:
    """Once the job published a checkpoint (or ``when()`` holds: ``what``), remove ``cluster.lost`` at once
    (no graceful end); checks every process of it, its roles included, ends. -> (its processes, the
    monotonic time of the removal)."""
    def tail() -> str:
        err.seek(0)
        return err.read()[-4000:]
    until_while_running(driver, when or (lambda: _published(tmp_path / "ckpt-x")), what, tail, timeout_s=300)
    procs = node_processes(cluster.lost)
    roles = [p for p, c in procs.items() if "--role" in c]
    assert len(roles) == 2 and all(parent_pid(p) in procs for p in roles), (roles, ray_roles())
    cluster.remove_node(cluster.lost, allow_graceful=False)
    lost_at = time.monotonic()
    until(lambda: not any(running(p) for p in procs), "every process of the lost node ended", timeout_s=GONE_S,
          every_s=0.1)
    return procs, lost_at


def start(cmd: list[str], err, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=err,
                            text=True, start_new_session=True)


def no_roles_left(timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while ray_roles() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not ray_roles()


@pytest.mark.parametrize("lost", ["worker", "server"])
def test_a_lost_node_replaced_mid_job_restarts_on_the_new_node_and_trains_every_example_once(
        tmp_path, reference_shows, lost):
    stays = "server" if lost == "worker" else "worker"
    with ray_nodes(RESOURCE[stays], RESOURCE[lost]) as (cluster, tmp):
        old_id = cluster.lost.node_id
        cmd = ray_cmd(tmp_path, "x", cluster.address, cluster.head_node.node_ip_address, "checkpoint.align_steps=8",
                      "checkpoint.delta_every=8steps", "cluster.startup_timeout_s=120")
        with open(tmp_path / "driver.err", "w+") as err:
            driver = start(cmd, err, {"ENGINE_FAILPOINTS": STEP_SLEEP})
            try:
                lose_node_mid_job(cluster, tmp_path, driver, err)
                # the replacement joins once the job restarted (its new placement group waits for it)
                until_while_running(driver, lambda: "restart 1/" in (tmp_path / "driver.err").read_text(),
                                    "the restart", lambda: (tmp_path / "driver.err").read_text()[-4000:],
                                    timeout_s=120)
                new = add_node(cluster, tmp, {RESOURCE[lost]: 4})
            finally:
                out, text = finish(driver, err, 300)
        assert driver.returncode == 0, text[-4000:]
        final = json.loads(out.strip().splitlines()[-1])
        assert final["restarts"] == 1, (final, text[-4000:])
        failed = re.search(rf"{lost} \d failed \((.*?)\); restart 1/", text)
        assert failed and f"died with its Ray node {old_id[:12]}" in failed.group(1) \
            and "which was lost" in failed.group(1), text[-4000:]
        placed = re.findall(rf"{lost} (\d) runs on node (\w+)", text)
        assert [n for _, n in placed[-2:]] == [new.node_id] * 2, (placed, new.node_id)
        assert shows(final["checkpoint"]) == reference_shows
        assert "Traceback" not in text, text[-4000:]
        assert no_roles_left()


def complete_checkpoints(root: Path) -> list[str]:
    """The checkpoints under ``root`` that have their ``_SUCCESS`` file."""
    return sorted(str(p.parent) for p in root.rglob(SUCCESS_NAME))


def test_the_workers_node_lost_inside_a_checkpoint_write_restarts_from_the_checkpoint_before(
        tmp_path, reference_shows):
    """Worker 0 coordinates the checkpoints: its second publish is held (failpoint checkpoint.before_publish,
    8 s at its second hit: every server wrote its part files, the manifest and _SUCCESS are not written),
    and the workers' node is removed inside that hold. The restart restores the first checkpoint, not the
    half-written one, and the job, on a replacement node, trains every example once."""
    with ray_nodes("ps_node", "worker_node") as (cluster, tmp):
        cmd = ray_cmd(tmp_path, "x", cluster.address, cluster.head_node.node_ip_address, "checkpoint.align_steps=8",
                      "checkpoint.delta_every=8steps", "cluster.startup_timeout_s=120")
        log = tmp_path / "driver.err"
        with open(log, "w+") as err:
            driver = start(cmd, err, {"ENGINE_FAILPOINTS": f"{STEP_SLEEP};checkpoint.before_publish=sleep:8@2"})
            try:
                lose_node_mid_job(cluster, tmp_path, driver, err,
                                  lambda: "failpoint checkpoint.before_publish: sleep 8 s (hit 2)" in log.read_text(),
                                  "worker 0 inside its second checkpoint's publish")
                before = complete_checkpoints(tmp_path / "ckpt-x")
                until_while_running(driver, lambda: "restart 1/" in log.read_text(), "the restart",
                                    lambda: log.read_text()[-4000:], timeout_s=120)
                add_node(cluster, tmp, {"worker_node": 4})
            finally:
                out, text = finish(driver, err, 300)
        assert len(before) == 1, before         # the second one was still being written when the node went
        assert driver.returncode == 0, text[-4000:]
        final = json.loads(out.strip().splitlines()[-1])
        assert final["restarts"] == 1, (final, text[-4000:])
        restart = re.search(r"restart 1/\d+ from (\S+) ", text)
        assert restart and restart.group(1) == before[0], (before, text[-4000:])
        assert shows(final["checkpoint"]) == reference_shows
        assert "Traceback" not in text, text[-4000:]
        assert no_roles_left()


def test_a_lost_node_never_replaced_ends_with_one_line_and_exit_69_and_the_line_continues_the_job(
        tmp_path, reference_shows):
    timeout_s = 20
    with ray_nodes("ps_node", "worker_node") as (cluster, tmp):
        ip = cluster.head_node.node_ip_address
        cmd = ray_cmd(tmp_path, "x", cluster.address, ip, "checkpoint.align_steps=8",
                      "checkpoint.delta_every=8steps", f"cluster.startup_timeout_s={timeout_s}")
        with open(tmp_path / "driver.err", "w+") as err:
            driver = start(cmd, err, {"ENGINE_FAILPOINTS": STEP_SLEEP})
            try:
                _, lost_at = lose_node_mid_job(cluster, tmp_path, driver, err)
            finally:
                out, text = finish(driver, err, 300)
            ended_s = time.monotonic() - lost_at
        assert driver.returncode == EXIT_NO_RESOURCES, text[-4000:]
        # the loss is found within seconds (its raylet refuses connections), then the restart's placement
        # group waits cluster.startup_timeout_s for a node offering worker_node
        assert ended_s < timeout_s + 40, ended_s
        lines = [ln for ln in text.splitlines() if ln.startswith("engine train:")]
        assert len(lines) == 1, text[-4000:]
        line = lines[0]
        assert "no live Ray node offers worker_node: 1 for worker 0-1 (cluster.worker_resources" in line, line
        assert f"cluster.startup_timeout_s={timeout_s}s" in line and "continue with: engine train " in line, line
        assert "Traceback" not in text, text[-4000:]
        assert no_roles_left()
        # the line's command, started while the node is still missing: it waits, a node joins, it finishes
        resume = shlex.split(line.split("continue with: ", 1)[1])
        assert resume[:2] == ["engine", "train"] and "--resume" in resume, resume
        resume = [sys.executable, "-m", "engine", *resume[1:], "--set", "cluster.startup_timeout_s=120"]
        with open(tmp_path / "resume.err", "w+") as err:
            driver = start(resume, err)
            try:
                until_while_running(driver, lambda: "waiting up to" in (tmp_path / "resume.err").read_text(),
                                    "the resumed job waiting for a node", lambda: (tmp_path / "resume.err").read_text(),
                                    timeout_s=120)
                add_node(cluster, tmp, {"worker_node": 4})
            finally:
                out, text = finish(driver, err, 300)
        assert driver.returncode == 0, text[-4000:]
        final = json.loads(out.strip().splitlines()[-1])
        assert final["restarts"] == 0 and shows(final["checkpoint"]) == reference_shows, final
        # its roles span two nodes: its servers bind their node's address, which the workers reach
        listening = re.findall(r"server \d/2 listening on (\S+):\d+", text)
        assert listening and set(listening) == {ip}, (listening, text[-4000:])
        assert no_roles_left()
