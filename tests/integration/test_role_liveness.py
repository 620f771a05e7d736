"""Role mode under a scheduler's liveness probe (Kubernetes without a launcher): a worker whose loop hangs
(a real process; the failpoint ``worker.after_step=sleep:600@N`` stops it at its N-th step while it
stays alive), or a role frozen with SIGSTOP, is found by the probe on its health port (``--health-port``:
``engine.liveness`` for a worker, the server's own), restarted, and the job recovers by the recovery rule
and trains every example exactly once (the servers' show counts in the final checkpoint).

``tests.pods.Pod`` stands for the Job controller and the kubelet, nothing else: it starts a role, probes
its health port as a liveness probe does, restarts it when the probe fails, and starts it again after
any exit but 0 and 2. Before ``engine.liveness``,
a hung role-mode worker held its peer at the next checkpoint meeting until the barrier timed out, and
then again after each of its restarts, for as long as it stayed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from engine.checkpoint import CheckpointManager
from tests.integration.test_chaos_offline import REPO, args, run
from tests.integration.test_role_resume import assert_every_example_once, free_ports, role_cmd, role_env
from tests.pods import Pod
from tests.waiting import until

pytestmark = pytest.mark.slow


# a fault of each kind: the role it strikes, and how; "hang" is the failpoint, armed at the role's first start
FAULTS = {"worker-hang": ("worker", 1, "hang"),
          "server-hang": pytest.param(("server", 1, "hang"), marks=pytest.mark.long),
          "worker-frozen": pytest.param(("worker", 1, signal.SIGSTOP), marks=pytest.mark.long),
          "server-frozen": pytest.param(("server", 1, signal.SIGSTOP), marks=pytest.mark.long)}


@pytest.mark.parametrize("fault", list(FAULTS.values()), ids=list(FAULTS))
def test_a_hung_or_frozen_role_is_restarted_by_its_liveness_probe_and_the_job_counts_every_example_once(
        tmp_path, fault):
    """Async CTR-DNN, 2 servers and 2 workers started with ``--role`` and ``--health-port``. After the
    job's first checkpoint, worker 1's loop hangs (``worker-hang``: it stays alive, its heartbeat is
    fine, its steps stop), or a role is frozen (SIGSTOP). The probe restarts it; the job finishes by
    itself, and the servers' show counts equal the epochs' examples. A hung worker says why in its log
    (``liveness NOT_SERVING: no training step for ...``)."""
    role, rank, how = fault
    sets = ("mode=async", "cluster.workers=2", "model.blas_threads=1")
    run(args(tmp_path, "full", *sets))       # the config, its data converted to Arrow, as role mode needs
    ports, health_ports = free_ports(2), free_ports(4)
    base = {**role_env(ports, workers=2), "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.1"}
    # the hang, in the role's first start only: worker 1's 12th step (after the first checkpoint, at 8),
    # or server 1's 30th Step (after it too: a handler that never returns, as a deadlock's)
    hang = {**base, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.1" + (
        ",sleep:600@12" if role == "worker" else ";server.step=sleep:600@30")}
    fast = ("--set", "client.dead_after_s=5")       # every role: the same keepalive on both ends
    if fault == ("server", 1, "hang"):              # a stuck server is found after client.timeout_s
        fast += ("--set", "client.timeout_s=5")
    result = tmp_path / "role-result.json"
    pods = [Pod(role_cmd(tmp_path, "role", "server", r, "--port", str(ports[r]), "--health-port",
                         str(health_ports[r]), "--resume", *fast),
                (lambda n: hang if n == 0 else base) if (how == "hang" and (role, rank) == ("server", r))
                else (lambda n: base), tmp_path / f"server-{r}.log", health_ports[r]) for r in range(2)]
    pods += [Pod(role_cmd(tmp_path, "role", "worker", r, "--health-port", str(health_ports[2 + r]), *fast,
                          *(("--result-file", str(result)) if r == 0 else ())),
                 (lambda n: hang if n == 0 else base) if (how == "hang" and (role, rank) == ("worker", r))
                 else (lambda n: base),
                 tmp_path / f"worker-{r}.log", health_ports[2 + r]) for r in range(2)]
    target = pods[rank if role == "server" else 2 + rank]
    try:
        mgr = CheckpointManager(str(tmp_path / "ckpt-role"), "ctr_dnn")
        until(lambda: len(mgr.list()) >= 1 or any(p.codes for p in pods), "a checkpoint", timeout_s=180,
              every_s=0.05)
        assert not any(p.codes for p in pods), [p.codes for p in pods]
        if how != "hang":
            assert target.signal(how)
        for p in pods[2:]:
            p.thread.join(300)
        assert all(p.done and p.codes[-1] == 0 for p in pods[2:]), [p.codes for p in pods]
        assert len(target.restarted) == 1 and target.codes[0] == -signal.SIGKILL, (target.restarted, target.codes)
        assert "liveness probe" in target.restarted[0]
        others = [p for p in pods if p is not target]
        assert not any(p.restarted for p in others), [p.restarted for p in others]
    finally:
        for p in pods:
            p.stop()
    if fault == ("server", 1, "hang"):
        log1 = (tmp_path / "server-1.log").read_text()
        assert "failpoint server.step: sleep 600 s (hit 30)" in log1, log1[-3000:]
        assert "server 1: stuck: " in log1 and "health port NOT_SERVING" in log1, log1[-3000:]
        # a worker whose call to the stuck server ran past its deadline exits 76 (not counted), in one line
        assert {c for p in pods[2:] for c in p.codes} <= {0, 76}, [p.codes for p in pods]
        for w in range(2):
            assert "Traceback" not in (tmp_path / f"worker-{w}.log").read_text()
    elif how == "hang":
        log1 = (tmp_path / "worker-1.log").read_text()
        assert "liveness NOT_SERVING: no training step for" in log1, log1[-3000:]
        assert "failpoint worker.after_step: sleep 600 s (hit 12)" in log1
    assert_every_example_once(result)


def test_a_worker_whose_servers_never_answer_exits_1_with_one_line(tmp_path):
    """No server at ``ENGINE_SERVERS`` within ``cluster.startup_timeout_s`` (a server frozen in its start,
    a wrong address): the worker exits 1, which a Job's backoffLimit counts (a wrong address never
    heals), with one line naming the wait, where it printed a traceback."""
    port = free_ports(1)[0]                       # nothing listens there
    env = {**os.environ, "ENGINE_SERVERS": f"127.0.0.1:{port}", "ENGINE_NUM_WORKERS": "1"}
    p = subprocess.run([sys.executable, "-m", "engine", "train", str(REPO / "configs" / "logreg_demo.yaml"),
                        "--role", "worker", "--rank", "0", "--set", "cluster.startup_timeout_s=3",
                        "--set", "cluster.servers=1", "--set", f"checkpoint.root={tmp_path / 'ckpt'}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("engine train: failed:")]
    assert len(line) == 1 and line[0].startswith(
        f"engine train: failed: worker 0: UNAVAILABLE from 127.0.0.1:{port}: servers not ready within 3s: "
        "last error: UNAVAILABLE: "
    ) and "(cluster.startup_timeout_s); it does not answer from this host now (127.0.0.1:" in line[0], \
        p.stderr[-3000:]        # ... and the servers asked again (engine.ps.reach): the one server is silent
