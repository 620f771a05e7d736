"""Preemption (issue 16): SIGTERM to the launcher, or to one worker, makes the job write a checkpoint at
its next meeting and exit with EXIT_PREEMPTED (75); ``engine train --resume`` continues from exactly
there: a sync job of one worker ends bit-identical to an uninterrupted run, and two async workers train
every example exactly once (the servers' show counts)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from engine.launch.procs import processes_of as leftovers
from engine.launch.procs import role_pid
from engine.preempt import EXIT_PREEMPTED
from tests.integration.test_chaos_offline import REPO, ROWS, SLOTS, args, run, wait_for
from tests.integration.test_offline_resume import _state, assert_same_model

pytestmark = pytest.mark.slow


def sigterm_when(tmp, tag: str, sets, ready, victim, env=None) -> tuple[int, str, str, float]:
    """Start the job; once ``ready(run_dir)`` returned, SIGTERM the pid ``victim(proc, run_dir)`` names;
    returns (exit code, stdout, stderr, seconds from the signal to the job's end). The job is killed
    if anything fails."""
    proc = subprocess.Popen(args(tmp, tag, *sets), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    run_dir = tmp / f"run-{tag}"
    try:
        ready(run_dir)
        pid = victim(proc, run_dir)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def preempted_run(tmp, tag: str, victim, *sets: str) -> dict:
    """Start the job, SIGTERM ``victim`` ("launcher" or a worker rank) at step 10 of worker 0; returns
    the final line of the preempted job."""
    run_dir = tmp / f"run-{tag}"
    code, out, err, took = sigterm_when(
        tmp, tag, sets, lambda d: wait_for(d / "worker-0.progress.json", lambda r: r["step"] >= 10, "step 10"),
        lambda proc, d: (proc.pid if victim == "launcher" else role_pid(d, "server", 0) if victim == "server"
                         else role_pid(d, "worker", victim)))
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert "preempted; resume with" in err and took < 60
    assert "--set model.data.source=generated" in err.split("resume with")[-1]   # the job's overrides too
    assert not leftovers(run_dir)
    final = json.loads(out.strip().splitlines()[-1])
    assert final["preempted"] is True and final["checkpoint"], final
    return final


def resumed_run(tmp, tag: str, uri: str, *sets: str) -> dict:
    return run(args(tmp, tag, *sets) + ["--resume", uri])


# small batches: the job runs a few seconds, so the SIGTERM lands mid-run
SLOW = ("model.batch_size=16", "checkpoint.delta_every=64steps")


def test_sigterm_to_the_launcher_checkpoints_and_resume_is_bit_identical(tmp_path):
    sets = ("mode=sync", "cluster.workers=1", "model.pipeline=sequential", *SLOW)
    full = run(args(tmp_path, "full", *sets))
    stopped = preempted_run(tmp_path, "job", "launcher", *sets)
    # the checkpoint of the preemption is mid-run: not the end of training
    with open(os.path.join(stopped["checkpoint"], "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["sources"]["train"]["epoch"] < 3
    final = resumed_run(tmp_path, "job", stopped["checkpoint"], *sets)
    assert_same_model(full["checkpoint"], final["checkpoint"])


@pytest.mark.long   # make test-long (~45 s): the meeting is the launcher SIGTERM test's above; one pod's SIGTERM is test_k8s_pods'
def test_sigterm_to_one_worker_stops_every_worker_at_one_checkpoint(tmp_path):
    sets = ("mode=async", "cluster.workers=2", *SLOW)
    stopped = preempted_run(tmp_path, "job", 1, *sets)
    final = resumed_run(tmp_path, "job", stopped["checkpoint"], *sets)
    sparse, _ = _state(final["checkpoint"])
    train_rows = sum(1 for i in range(ROWS) if i % 5 != 4)
    assert float(sparse[("embedding", "show")].sum()) == 3 * train_rows * SLOTS


@pytest.mark.long   # make test-long (see pyproject.toml): the same meeting as SIGTERM to one worker
def test_sigterm_to_a_server_checkpoints_at_the_next_meeting(tmp_path):
    """A server told to stop (as Kubernetes does before it kills a pod) keeps serving and says so in
    Health; rank 0 checkpoints at its next meeting and every worker stops there with exit 75."""
    sets = ("mode=sync", "cluster.workers=1", "model.pipeline=sequential", *SLOW)
    stopped = preempted_run(tmp_path, "job", "server", *sets)
    with open(os.path.join(stopped["checkpoint"], "manifest.json")) as f:
        assert json.load(f)["sources"]["train"]["epoch"] < 3
    assert resumed_run(tmp_path, "job", stopped["checkpoint"], *sets)["checkpoint"]


def test_a_preemption_no_meeting_can_answer_stops_at_the_last_checkpoint_after_the_timeout(tmp_path):
    """SIGTERM to the launcher while both workers hang (the failpoint ``worker.after_step`` holds their
    12th step 600 s), so no checkpoint meeting comes: after ``cluster.preempt_timeout_s`` (3 s) the
    launcher stops the attempt, restarts nothing, and exits 75 naming the job's last complete
    checkpoint (step 8: ``checkpoint.align_steps``) as the one to resume, with no process left."""
    sets = ("mode=async", "cluster.workers=2", "cluster.preempt_timeout_s=3", "model.batch_size=16")
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:600@12"}
    run_dir = tmp_path / "run-job"

    def both_hang(d):           # their reports stop at step 12
        for w in range(2):
            wait_for(d / f"worker-{w}.progress.json", lambda r: r["step"] >= 12, f"worker {w} at step 12")
    code, out, err, took = sigterm_when(tmp_path, "job", sets, both_hang, lambda proc, d: proc.pid, env=env)
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert "preempted before a checkpoint meeting: preempt timeout" in err, err[-3000:]
    assert "restart 1/" not in err and 3 <= took < 30, (took, err[-3000:])
    final = json.loads(out.strip().splitlines()[-1])
    assert final["preempted"] is True, final
    with open(os.path.join(final["checkpoint"], "manifest.json")) as f:
        manifest = json.load(f)
    assert os.path.exists(os.path.join(final["checkpoint"], "_SUCCESS"))
    assert manifest["sources"]["train"]["epoch"] == 0 and manifest["sources"]["train"]["batch"] == 8, manifest
    assert not leftovers(run_dir)
