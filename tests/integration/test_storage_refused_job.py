"""A job whose checkpoint disk is read-only (a real tmpfs mounted ``ro``: root only, skipped elsewhere)
ends at its first checkpoint with exit 74 and one line that names the file and the errno and says how to
continue, without a restart: a restart would train again since the last checkpoint and fail at the same
save. Before, it restarted ``cluster.max_restarts`` times (each attempt training again), then exited 1
listing every attempt, without a resume line (README "When the checkpoint storage fails")."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import EXIT_STORAGE_REFUSED

REPO = Path(__file__).resolve().parents[2]


def test_a_read_only_checkpoint_disk_ends_the_job_at_once_with_one_resumable_line(tmp_path, tmpfs):
    disk = tmpfs("ckpt", 1 << 20, read_only=True)
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/logreg_demo.yaml"),
           "--run-dir", str(tmp_path / "run"), "--set", "cluster.warm_up=false", "--set", "cluster.workers=1",
           "--set", "cluster.servers=1", "--set", "model.examples_per_worker=640", "--set", "model.epochs=1",
           "--set", f"checkpoint.root={disk}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_STORAGE_REFUSED, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("engine train:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "restart 1/" not in r.stderr, r.stderr[-3000:]
    line = lines[0]
    assert line.startswith("engine train: checkpoint storage failed: worker 0: "), line
    assert f"{disk}/logreg/" in line and "[permanent storage failure: EROFS]" in line, line
    assert line.endswith(f"continue with: engine train {REPO / 'configs/logreg_demo.yaml'} --set cluster.warm_up=false "
                         f"--set cluster.workers=1 --set cluster.servers=1 --set model.examples_per_worker=640 "
                         f"--set model.epochs=1 --set checkpoint.root={disk} --resume"), line


@pytest.mark.long       # make test-long: ~40 s (MPI world, CTR kernels)
def test_a_hybrid_world_ends_with_74_through_mpiexec(tmp_path, tmpfs):
    """Hybrid workers are ranks of one mpiexec world (engine.launch.mpi): the rank that meets the read-only
    disk aborts the world with 74 (MPI_Abort), and the launcher must still see 74 (from MPICH's abort line
    in the rank's log), not mpiexec's code, and end at once without a restart."""
    disk = tmpfs("ckpt", 1 << 20, read_only=True)
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"),
           "--run-dir", str(tmp_path / "run"), "--set", "mode=hybrid", "--set", "model.dense_merge_steps=1",
           "--set", "cluster.workers=2", "--set", "model.data.source=generated",
           "--set", "model.data.generated_rows=2000", "--set", f"model.data.cache_dir={tmp_path / 'cache'}",
           "--set", f"model.metrics_dir={tmp_path / 'metrics'}", "--set", "model.epochs=1",
           "--set", f"observability.tensorboard_dir={tmp_path / 'tb'}",
           "--set", "model.hidden=[16]", "--set", f"checkpoint.root={disk}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == EXIT_STORAGE_REFUSED, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("engine train:")]
    assert len(lines) == 1 and "restart 1/" not in r.stderr, r.stderr[-3000:]
    assert lines[0].startswith("engine train: checkpoint storage failed: worker 0: "), lines[0]
    assert "[permanent storage failure: EROFS]" in lines[0] and lines[0].endswith("--resume"), lines[0]
    # rank 0 aborted the world with its code (engine.allreduce.end_world), which MPICH's line in its log names
    log = (tmp_path / "run" / "worker-0.log").read_text()
    assert f"application called MPI_Abort(MPI_COMM_WORLD, {EXIT_STORAGE_REFUSED})" in log, log[-2000:]


def test_a_checkpoint_bucket_refusing_the_credentials_ends_the_job_at_once_with_74(tmp_path):
    """S3's AccessDenied (moto checking credentials: INITIAL_NO_AUTH_ACTION_COUNT=0) carries no errno, and
    hdfs_io.permanent_failure did not know it: the job ended with exit 1 and 'once the storage answers, run
    it again', which a scheduler restarts into the same refusal. Now it is a permanent failure (EACCES):
    exit 74, one line, no restart."""
    import os
    import signal
    import time

    from tests.integration.test_remote_inputs_train import _free_port, _moto
    port = _free_port()
    moto = _moto(port, tmp_path / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/logreg_demo.yaml"),
               "--run-dir", str(tmp_path / "run"), "--set", "cluster.warm_up=false", "--set", "cluster.workers=1",
               "--set", "cluster.servers=1", "--set", "model.examples_per_worker=640", "--set", "model.epochs=1",
               "--set", "checkpoint.root=s3://ckpt/root", "--set", f"storage.endpoint=127.0.0.1:{port}",
               "--set", "storage.scheme=http", "--set", "storage.region=us-east-1",
               "--set", "storage.access_key=testing", "--set", "storage.secret_key=testing"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
        took = time.monotonic() - t0
    finally:
        os.killpg(moto.pid, signal.SIGKILL)
        moto.wait(10)
    assert r.returncode == EXIT_STORAGE_REFUSED, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("engine train:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr and "restart 1/" not in r.stderr, r.stderr[-3000:]
    assert "ACCESS_DENIED" in lines[0] and "[permanent storage failure: EACCES]" in lines[0], lines[0]
    assert took < 60
