"""Role mode (``--role server``, as Kubernetes or Slurm start a job) when the checkpoint root cannot be
listed at a server's start: the server does not serve without its floor (the job's newest checkpoint at
its start, ``checkpoint_floor`` in ``Health``), it exits 1 with one line naming itself and the root, and
its scheduler starts it again.

Before, it served with no floor, and worker rank 0's roll-back before the job's first checkpoint took
the root's newest checkpoint, an earlier run's model, for the job's own (reproduced with S3 down at the
servers' start, back before the worker trained, the worker killed before the job's first checkpoint:
"rolling every server back to s3://.../2309-base", the earlier run's, and "resuming at epoch 1").
A child of a launcher still serves (its launcher keeps the job's floor, ``engine.launch.supervisor``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.test_role_resume import free_ports

REPO = Path(__file__).resolve().parents[2]


def _server(tmp_path: Path, root: str, env: dict) -> tuple[subprocess.Popen, Path]:
    (port,) = free_ports(1)
    ready = tmp_path / "server.ready"
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/logreg_demo.yaml"),
           "--set", "cluster.warm_up=false", "--set", "cluster.servers=1", "--set", f"checkpoint.root={root}",
           "--role", "server", "--rank", "0", "--port", str(port), "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, ready


def _wait(proc: subprocess.Popen, ready: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=10)
    return err


def test_a_role_mode_server_that_cannot_list_the_checkpoint_root_does_not_serve_without_its_floor(tmp_path):
    blocker = tmp_path / "not-a-directory"          # a root that cannot be listed, at once (root may read
    blocker.write_text("x")                         # any mode bits; S3 down is the same after hdfs_io's retries)
    proc, ready = _server(tmp_path, str(blocker), {})
    try:
        _wait(proc, ready)
        served = ready.exists()
    finally:
        err = _stop(proc)
    assert not served and proc.returncode == 1, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("engine train:")]
    assert len(line) == 1 and "Traceback" not in err, err[-3000:]
    assert (f"checkpoint storage failed: server 0: the job's checkpoints under {blocker}/logreg cannot be listed"
            in line[0]) and "its scheduler restarts this role" in line[0], line


def test_a_launchers_server_still_serves_its_launcher_keeps_the_floor(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    proc, ready = _server(tmp_path, str(blocker), {"ENGINE_PARENT_PID": str(os.getpid())})
    try:
        _wait(proc, ready)
        served = ready.exists()
    finally:
        err = _stop(proc)
    assert served, err[-3000:]
    assert "its launcher keeps the job's floor" in err, err[-3000:]
