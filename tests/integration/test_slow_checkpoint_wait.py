"""A checkpoint save that takes longer than the servers' cap on one barrier (``server.max_barrier_wait_s``,
600 s by default; 2 s here) must not end the attempt: the other workers wait for rank 0's save as long as
its phase may last (an hour), arriving again each time a server's cap runs out.

Before, worker 1 left the meeting after the cap with "barrier '...-done': only 1 of 2 callers arrived
within 600s" while rank 0 still wrote: a store that answered slowly for ten minutes (or a big base on a
slow store) restarted the job and lost the save, and every attempt met the same save. The save is held
open here by the failpoint ``checkpoint.before_publish`` (4 s, at its first hit in each process)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_a_save_longer_than_the_servers_barrier_cap_keeps_the_attempt(tmp_path):
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/logreg_demo.yaml"),
           "--run-dir", str(tmp_path / "run"), "--set", "cluster.warm_up=false", "--set", "cluster.workers=2",
           "--set", "cluster.servers=1", "--set", "model.examples_per_worker=1280", "--set", "model.epochs=1",
           "--set", f"checkpoint.root={tmp_path / 'ckpt'}", "--set", "checkpoint.align_steps=10",
           "--set", "checkpoint.delta_every=10steps", "--set", "server.max_barrier_wait_s=2",
           "--set", "cluster.max_restarts=0"]
    env = {**os.environ, "ENGINE_FAILPOINTS": "checkpoint.before_publish=sleep:4@1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["restarts"] == 0, err[-3000:]
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "logreg")
    assert final["checkpoint"] == mgr.uri_of(mgr.latest().name)
    assert len(mgr.list()) >= 2      # the held save was published, and the job went on to checkpoint again
