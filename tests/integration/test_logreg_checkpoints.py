"""logreg records its data position in its checkpoints and writes them itself (also in role mode, where
no launcher runs a schedule): a sync job of one worker resumed from a mid-run checkpoint ends with the
same weights as an uninterrupted one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint import CheckpointManager
from tests.integration.test_role_resume import free_ports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SETS = ["--set", "mode=sync", "--set", "cluster.workers=1", "--set", "cluster.warm_up=false",
        "--set", "model.examples_per_worker=2000", "--set", "model.epochs=2", "--set", "checkpoint.align_steps=10",
        "--set", "checkpoint.delta_every=10steps"]


def train(tmp: Path, tag: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/logreg_demo.yaml"), "--run-dir",
           str(tmp / f"run-{tag}"), "--set", f"checkpoint.root={tmp / 'ckpt'}", *SETS, *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.long   # make test-long (see pyproject.toml): test_offline_resume resumes CTR jobs bit-identically
def test_a_resumed_logreg_job_ends_with_the_uninterrupted_weights(tmp_path):
    full = train(tmp_path, "full")
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "logreg")
    chain = [mgr.manifest(r.name) for r in mgr.list()]
    positions = [(m["sources"]["train"]["epoch"], m["sources"]["train"]["batch"]) for m in chain]
    assert positions[0] == (0, 10) and positions[-1] == (2, 0), positions
    mid = next(m for m in chain if (m["sources"]["train"]["epoch"], m["sources"]["train"]["batch"]) == (1, 20))
    resumed = train(tmp_path, "resumed", "--resume", mgr.uri_of(mid["name"]))
    a, b = full["workers"][0], resumed["workers"][0]
    assert b["steps"] < a["steps"]                          # only what remained was trained
    assert (a["weight_rmse"], a["bias_error"]) == (b["weight_rmse"], b["bias_error"])


def test_role_mode_logreg_writes_its_checkpoints(tmp_path):
    ports = free_ports(2)
    env = {**os.environ, "ENGINE_SERVERS": ",".join(f"127.0.0.1:{p}" for p in ports), "ENGINE_NUM_WORKERS": "1"}
    base = [sys.executable, "-m", "engine", "train", str(REPO / "configs/logreg_demo.yaml"),
            "--set", f"checkpoint.root={tmp_path / 'ckpt'}", *SETS]
    servers = [subprocess.Popen(base + ["--role", "server", "--rank", str(r), "--port", str(ports[r])], cwd=REPO,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
               for r in range(2)]
    try:
        worker = subprocess.run(base + ["--role", "worker", "--rank", "0"], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=180)
    finally:
        for s in servers:
            if s.poll() is None:
                os.killpg(s.pid, signal.SIGKILL)
            s.wait(10)
    assert worker.returncode == 0, worker.stderr[-3000:]
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "logreg")
    positions = [(m["sources"]["train"]["epoch"], m["sources"]["train"]["batch"])
                 for m in (mgr.manifest(r.name) for r in mgr.list())]
    assert positions[0] == (0, 10) and positions[-1] == (2, 0) and len(positions) >= 5, positions
