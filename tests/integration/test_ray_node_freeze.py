"""A Ray node that vanishes or hangs in the middle of a job under ``--launcher ray`` (``engine.launch.ray``):
every process of the node is frozen (SIGSTOP: its raylet, its agents, its actors' workers and their role
processes), as a machine that stopped answering without closing a connection. Unlike a node killed
(``test_ray_node_loss``), nothing refuses a connection: its raylet's port still accepts TCP connections (the
kernel answers for a stopped process), every call to its actors times out, and Ray finds the node dead
only through its own health checks.

Each test starts its own two-node Ray cluster (``test_ray_node_loss.ray_nodes``) and the CTR-DNN sync job of
``test_ray_launcher`` (2 servers, 2 workers, TLS and tokens, a checkpoint every 8 aligned steps); the node is
frozen once the first checkpoint is published. Every process the test stopped is killed and continued in its
teardown, before the cluster is shut down, even when it failed.

- The workers' or the servers' node frozen, a replacement joining: the job names the node within NOTICED_S
  (32 s measured; before, 63-65 s: every actor on the node took its own 30 s call timeout in turn, then 1 s
  a call), waits for Ray to find it dead before placing the restart (before, the servers' case exited 69:
  a placement begun on the frozen node, still listed alive, never completed), restarts on the replacement
  and trains every example once. Continued, the frozen node's role processes end by themselves (Ray's
  own processes there may not: once two idle ``ray::RoleActor`` processes still ran 60 s later).
- No replacement, cluster.startup_timeout_s shorter than Ray takes to find the node dead: exit 69 with one
  line naming the node Ray still lists alive (53 s after the freeze, measured).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from engine.errors import EXIT_NO_RESOURCES
from tests.integration.test_ray_faults_more import finish
from tests.integration.test_ray_launcher import _cmdline, _published, ray_cmd, ray_roles
from tests.integration.test_ray_node_loss import NODE, RESOURCE, STEP_SLEEP, node_processes, ray_nodes, \
    reference_shows, running, shows, start  # noqa: F401 - reference_shows is a fixture
from tests.waiting import until, until_while_running

pytestmark = [pytest.mark.slow, pytest.mark.long]     # make test-long: minutes each


@contextlib.contextmanager
def frozen(node):
    """Yield a function that SIGSTOPs every process of the Ray ``node`` (its raylet first) and returns
    their pids; on exit every process it stopped is sent SIGKILL, then SIGCONT, before the cluster's own
    teardown (which would wait on stopped processes)."""
    stopped: list[int] = []

    def freeze() -> list[int]:
        raylet = node.all_processes["raylet"][0].process.pid
        for _ in range(5):      # a process started while the others were being stopped: once more
            todo = sorted(p for p in node_processes(node) if p not in stopped and running(p))
            todo.sort(key=lambda p: p != raylet)
            if not todo:
                break
            for p in todo:
                try:
                    os.kill(p, signal.SIGSTOP)
                    stopped.append(p)
                except ProcessLookupError:
                    pass
        return list(stopped)
    try:
        yield freeze
    finally:
        for p in stopped:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass


def no_roles_left(stopped: list[int], timeout_s: float = 30.0) -> bool:
    """No role process of the test's cluster runs but those of the frozen node (``stopped``)."""
    deadline = time.monotonic() + timeout_s
    while set(ray_roles()) - set(stopped) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not set(ray_roles()) - set(stopped)


def replace(cluster, tmp: str, resources: dict):
    """A node offering ``resources`` joins ``cluster`` (``add_node`` waits for it alone: the frozen node may
    still be listed alive, or be dead, which ``Cluster.wait_for_nodes`` would count)."""
    os.environ["TMPDIR"] = os.path.join(tmp, "actors")
    try:
        return cluster.add_node(**NODE, resources=resources)
    finally:
        os.environ.pop("TMPDIR", None)


def freeze_mid_job(freeze, tmp_path: Path, driver, log: Path) -> tuple[list[int], float]:
    until_while_running(driver, lambda: _published(tmp_path / "ckpt-x"), "a published checkpoint",
                        lambda: log.read_text()[-4000:], timeout_s=300)
    stopped = freeze()
    return stopped, time.monotonic()


#: the longest from the freeze to the restart's line: the first call to a frozen actor times out after
#: CALL_TIMEOUT_S (30 s) and a role's silence counts from client.dead_after_s (30 s, the default), both from
#: the freeze; then the failed attempt's teardown. Before, each actor on the node took its own 30 s in turn
#: and every later call 1 s: 63-65 s
NOTICED_S = 50.0
#: the longest a frozen node's role processes take to end once continued (its raylet learns it was found dead)
CAME_BACK_S = 30.0


def failure_line(text: str) -> str:
    m = re.search(r"(?m)^.*WARNING engine.launch.supervisor: (.* failed \(.*\); restart 1/.*)$", text)
    assert m, text[-4000:]
    return m.group(1)


@pytest.mark.parametrize("lost", ["worker", "server"])
def test_a_frozen_node_is_named_within_a_bound_and_the_job_restarts_on_a_replacement(tmp_path, reference_shows,
                                                                                     lost):
    """The lost roles' node frozen after the first checkpoint: within NOTICED_S the job fails that node's
    role naming the node and saying it answers no call, waits for Ray to find the node dead (a placement
    begun on it while Ray lists it alive never completes: before, the servers' case exited 69 after
    cluster.startup_timeout_s saying the resources were taken), restarts on the replacement, and trains
    every example once. Continued at the end, the frozen node's role processes end by themselves."""
    stays = "server" if lost == "worker" else "worker"
    with ray_nodes(RESOURCE[stays], RESOURCE[lost]) as (cluster, tmp), frozen(cluster.lost) as freeze:
        old_id = cluster.lost.node_id
        cmd = ray_cmd(tmp_path, "x", cluster.address, cluster.head_node.node_ip_address, "checkpoint.align_steps=8",
                      "checkpoint.delta_every=8steps", "cluster.startup_timeout_s=120")
        log = tmp_path / "driver.err"
        with open(log, "w+") as err:
            driver = start(cmd, err, {"ENGINE_FAILPOINTS": STEP_SLEEP})
            try:
                stopped, at = freeze_mid_job(freeze, tmp_path, driver, log)
                until_while_running(driver, lambda: "restart 1/" in log.read_text(), "the restart",
                                    lambda: log.read_text()[-4000:], timeout_s=300)
                noticed = time.monotonic() - at
                new = replace(cluster, tmp, {RESOURCE[lost]: 4})
            finally:
                out, text = finish(driver, err, 400)
        assert driver.returncode == 0, text[-4000:]
        line = failure_line(text)
        assert re.match(rf"{lost} \d failed", line), line
        assert f"its Ray node {old_id[:12]} (" in line and "answers no call" in line, line
        assert noticed < NOTICED_S, (noticed, line)
        final = json.loads(out.strip().splitlines()[-1])
        assert final["restarts"] == 1, (final, text[-4000:])
        placed = re.findall(rf"{lost} (\d) runs on node (\w+)", text)
        assert [n for _, n in placed[-2:]] == [new.node_id] * 2, (placed, new.node_id)
        assert shows(final["checkpoint"]) == reference_shows
        assert "Traceback" not in text, text[-4000:]
        assert no_roles_left(stopped)
        # the machine comes back: its raylet, found dead meanwhile, ends, and the roles it ran end with their
        # actors (none trains on beside the restarted job); Ray's own processes are the teardown's
        roles = [p for p in stopped if "--role" in _cmdline(p)]
        assert len(roles) == 2, {p: _cmdline(p)[:200] for p in stopped}
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(AssertionError):
            until(lambda: not any(running(p) for p in roles), "", timeout_s=CAME_BACK_S, every_s=0.1)
        left = {p: _cmdline(p)[:200] for p in roles if running(p)}
        assert not left, f"role processes of the continued node still running after {CAME_BACK_S:g} s: {left}"


def test_a_frozen_node_ray_still_lists_alive_past_the_placement_timeout_ends_with_exit_69_naming_it(
        tmp_path, reference_shows):
    """The workers' node frozen, no replacement, cluster.startup_timeout_s=20: shorter than Ray takes to
    find the node dead (~65 s after the freeze, Ray's default health checks) once the job noticed it
    (~32 s). The job ends with exit 69 and one line naming the node still listed alive and the command
    that continues the job, within NOTICED_S + 20 s + a margin of the freeze. Before, the restart's
    placement group was begun on the frozen node and the job exited 69 saying the resources were not
    free for every role (taken by other work?)."""
    timeout_s = 20
    with ray_nodes("ps_node", "worker_node") as (cluster, tmp), frozen(cluster.lost) as freeze:
        old_id = cluster.lost.node_id
        cmd = ray_cmd(tmp_path, "x", cluster.address, cluster.head_node.node_ip_address, "checkpoint.align_steps=8",
                      "checkpoint.delta_every=8steps", f"cluster.startup_timeout_s={timeout_s}")
        log = tmp_path / "driver.err"
        with open(log, "w+") as err:
            driver = start(cmd, err, {"ENGINE_FAILPOINTS": STEP_SLEEP})
            try:
                stopped, at = freeze_mid_job(freeze, tmp_path, driver, log)
            finally:
                out, text = finish(driver, err, 300)
            ended_s = time.monotonic() - at
        assert driver.returncode == EXIT_NO_RESOURCES, text[-4000:]
        assert ended_s < NOTICED_S + timeout_s + 15, ended_s
        assert f"its Ray node {old_id[:12]} (" in failure_line(text)
        lines = [ln for ln in text.splitlines() if ln.startswith("engine train:")]
        assert len(lines) == 1, text[-4000:]
        assert f"Ray still lists node {old_id[:12]} (" in lines[0] and "answers no call" in lines[0], lines[0]
        assert f"cluster.startup_timeout_s={timeout_s}s" in lines[0] and "continue with: engine train " in lines[0]
        assert "Traceback" not in text, text[-4000:]
        assert no_roles_left(stopped)
