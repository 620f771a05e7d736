"""``--resume`` of a checkpoint that does not fit the config's tables (another dim, a renamed table) is a
config error: one line naming the table and both shapes, exit 2 (a scheduler does not restart it:
``engine k8s``'s FailJob on 2), whether the launcher restores it or a role-mode server does. Before, the
launcher and the server both died with a ``RequestRejectedError`` / ``RuntimeError`` traceback and exit 1,
which a scheduler restarts to fail the same way (found by the compatibility audit).

The checkpoint is written by in-process servers of the shipped config; the resumes are real processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from engine.checkpoint import CheckpointManager
from engine.config import load_config
from engine.ps import InProcessTransport, PSClient, PSServer
from tests.integration.test_role_resume import free_ports

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "ctr.yaml"
SMALLER = ["--set", "model.dim=8", "--set", "tables.sparse.embedding.dim=8"]


def _checkpoint(tmp_path: Path) -> str:
    """A base of the shipped config's tables (dim 10): a few rows and the dense tower's table."""
    cfg = load_config(CONFIG, [f"checkpoint.root={tmp_path / 'ckpt'}"])
    srv = PSServer.from_config(cfg, 0)
    client = PSClient(InProcessTransport([srv]))
    try:
        client.push("embedding", np.arange(1, 9, dtype=np.uint64), np.ones((8, 10), np.float32))
        client.init_dense("dense", np.zeros(16, np.float32))
        m = CheckpointManager(str(tmp_path / "ckpt"), "ctr_dnn").save(client, "base", when=0.0)
    finally:
        client.close()
        srv.close()
    return str(tmp_path / "ckpt" / "ctr_dnn" / m["name"])


def _one_line_exit_2(proc: subprocess.CompletedProcess, uri: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "config error: cannot resume:" in last and "checkpoint does not fit: sparse table 'embedding'" in last
    assert f"checkpoint {uri} has dim/optimizer (10, 'adagrad'), this server's table has (8, 'adagrad')" in last
    return last


def test_the_launcher_refuses_a_checkpoint_of_another_dim_in_one_line_exit_2(tmp_path):
    uri = _checkpoint(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "engine", "train", str(CONFIG), "--run-dir", str(tmp_path / "run"),
                           "--set", f"checkpoint.root={tmp_path / 'ckpt'}", *SMALLER, "--resume", uri,
                           "--set", f"model.data.cache_dir={tmp_path / 'cache'}",
                           "--set", f"model.metrics_dir={tmp_path / 'metrics'}",
                           "--set", f"observability.tensorboard_dir={tmp_path / 'tb'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    _one_line_exit_2(proc, uri)
    assert "restart" not in proc.stderr                 # not retried: a restart fails the same way


def test_a_role_mode_server_refuses_it_in_one_line_exit_2(tmp_path):
    uri = _checkpoint(tmp_path)
    (port,) = free_ports(1)
    proc = subprocess.run([sys.executable, "-m", "engine", "train", str(CONFIG), *SMALLER,
                           "--set", f"checkpoint.root={tmp_path / 'ckpt'}", "--role", "server", "--rank", "0",
                           "--port", str(port), "--resume", uri],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ENGINE_SERVERS": f"127.0.0.1:{port}"})
    _one_line_exit_2(proc, uri)
