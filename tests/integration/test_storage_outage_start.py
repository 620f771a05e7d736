"""A job started beside an earlier run's checkpoints while its S3 store does not answer (the moto server's
HTTP front stopped; its objects stay in the process, so it comes back with its data), the store back
before the workers start, and a worker killed before the job's first checkpoint: the restart begins
again from the beginning, never from the earlier run's model (README "When a process dies").

Before, the job's floor (the root's newest checkpoint when it started, ``recovery_target``) was left
unknown when the store did not answer at the start, and the restart restored the earlier run's newest
checkpoint as the job's own: it skipped the data that checkpoint's position records and trained on
another run's model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine import progress
from engine.launch.procs import role_pid
from tests.contract.storage_fixtures import MotoS3
from tests.waiting import until

REPO = Path(__file__).resolve().parents[2]


def _moto(port: int = 0):
    server_mod = pytest.importorskip("moto.server", reason="moto[server] not installed")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


@pytest.mark.long   # make test-long (~60 s, most of it hdfs_io's retries on the stopped store); the recovery
# rule's floor is make test's test_supervision (an older --resume kept through a crash)
def test_a_restart_never_restores_an_earlier_runs_checkpoint_after_the_store_was_down_at_the_start(tmp_path):
    server = _moto()
    host, port = server.get_host_and_port()
    s3 = MotoS3(host=host, port=int(port))
    s3.create_bucket("outage")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **s3.env(),
           "PYTHONPATH": str(REPO)}
    root = "s3://outage/ckpt"

    def cmd(tag: str, *more: str) -> list[str]:
        return [sys.executable, "-m", "engine", "train", str(REPO / "configs/logreg_demo.yaml"),
                "--run-dir", str(tmp_path / tag), "--set", "cluster.warm_up=false", "--set", "cluster.workers=2",
                "--set", "cluster.servers=1", "--set", "model.examples_per_worker=3000",
                "--set", f"checkpoint.root={root}", "--set", "checkpoint.align_steps=1000", *more]

    proc = None
    try:
        earlier = subprocess.run(cmd("earlier", "--set", "model.epochs=1"), cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=180)
        assert earlier.returncode == 0, earlier.stderr[-3000:]
        earlier_ckpt = json.loads(earlier.stdout.strip().splitlines()[-1])["checkpoint"]
        assert earlier_ckpt.startswith(root)

        server.stop()                                   # the store stops answering: connections refused
        err = tmp_path / "job.stderr"
        with open(err, "w") as e:
            proc = subprocess.Popen(cmd("job", "--set", "model.epochs=2"), cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=e, text=True, start_new_session=True,
                                    env={**env, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.05"})
        until(lambda: "cannot list the job's checkpoints" in err.read_text() or proc.poll() is not None,
              "the job's start-up look-up to fail", timeout_s=120, every_s=0.1)
        server = _moto(int(port))                       # back, with its objects
        until(lambda: (progress.read(tmp_path / "job" / "worker-1.progress.json") or {}).get("step", 0) >= 5
              or proc.poll() is not None, "worker 1's fifth step", timeout_s=120, every_s=0.05)
        os.kill(role_pid(tmp_path / "job", "worker", 1), signal.SIGKILL)     # before the job's first checkpoint
        out, _ = proc.communicate(timeout=240)
        text = err.read_text()
        assert proc.returncode == 0, text[-3000:]
        assert "restart 1/3 from the beginning (no checkpoint yet)" in text, text[-3000:]
        assert earlier_ckpt not in text.split("cannot list the job's checkpoints", 1)[1], text[-3000:]
        final = json.loads(out.strip().splitlines()[-1])
        assert final["restarts"] == 1 and final["checkpoint"] != earlier_ckpt
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        server.stop()
