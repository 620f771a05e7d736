"""The job survives failures (real processes on 127.0.0.1): a role killed with SIGKILL or frozen with
SIGSTOP is noticed, every process of the attempt is stopped, and the job restarts by itself; more
failures than ``cluster.max_restarts`` end it with every failure listed. Each test bounds its waits
and leaves no process behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import progress
from engine.launch.procs import processes_of as leftovers
from engine.launch.procs import role_pid
from tests.waiting import until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "logreg_demo.yaml"
FAST = ["--set", "cluster.warm_up=false", "--set", "model.examples_per_worker=3000", "--set", "cluster.workers=2",
        "--set", "model.epochs=6"]
# every step pauses 20 ms (failpoint worker.after_step): an attempt lasts ~6 s, so a kill aimed at step 20
# always lands while the job trains, however loaded the machine (unpaused, the job took under a second and a
# SIGSTOP could arrive after it had finished)
PACED = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.02"}


def engine(*args, run_dir: Path, env: dict = PACED) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine", "train", str(DEMO), "--run-dir", str(run_dir),
                             *FAST, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=env, start_new_session=True)


def wait_steps(path: Path, steps: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = progress.read(path)
        if r and r.get("step", 0) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached step {steps}: {progress.read(path)}")


def frozen_run(proc: subprocess.Popen, ready, run_dir: Path, role: str, rank: int,
               timeout: float) -> tuple[float, str, str]:
    """Once ``ready()`` returns, SIGSTOP that role of the job's first attempt; returns the seconds until
    the restart began and the job's stdout and stderr (the job is killed if anything fails)."""
    try:
        ready()
        os.kill(role_pid(run_dir, role, rank), signal.SIGSTOP)
        t0 = time.monotonic()
        until(lambda: (run_dir / "restart-1").exists(), "the restart", timeout_s=timeout, every_s=0.05)
        detected = time.monotonic() - t0
        return (detected, *finish(proc, 180))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def worker1_killed_at(proc: subprocess.Popen, run_dir: Path, steps: int) -> tuple[str, str]:
    """SIGKILL worker 1 of the job's first attempt once it trained ``steps`` steps; returns the job's
    stdout and stderr once it ended (the job is killed if anything fails)."""
    try:
        wait_steps(run_dir / "worker-1.progress.json", steps)
        os.kill(role_pid(run_dir, "worker", 1), signal.SIGKILL)
        return finish(proc, 180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_stop_servers_at_end_is_left_to_role_mode_under_the_launcher(tmp_path):
    """``cluster.stop_servers_at_end`` (role mode: worker 0 stops the servers) under the launcher: the
    launcher stops them itself. Before, worker 0 stopped them first, the launcher took a server's exit
    0 for a failure and restarted the job, every attempt the same way, until ``cluster.max_restarts``
    ended it."""
    proc = engine("--set", "cluster.stop_servers_at_end=true", run_dir=tmp_path, env=os.environ)
    out, err = finish(proc, 180)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["restarts"] == 0, err[-3000:]
    assert "cluster.stop_servers_at_end is for role mode" in err
    assert not leftovers(tmp_path)


@pytest.mark.long   # make test-long (see pyproject.toml): test_chaos_offline kills workers and the job finishes
def test_a_killed_worker_restarts_the_job_which_finishes(tmp_path):
    proc = engine(run_dir=tmp_path)
    out, err = worker1_killed_at(proc, tmp_path, 20)
    assert proc.returncode == 0, err[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    # no checkpoint.root: the restart begins again from the first example, and the failed attempt's
    # examples (at least worker 1's 20 steps of 64) were trained twice
    assert final["restarts"] == 1 and final["examples_replayed"] >= 20 * 64, final
    assert "worker 1" in err and "killed by signal 9" in err and "restart 1/3" in err
    assert (tmp_path / "restart-1").is_dir()
    assert not leftovers(tmp_path)


def test_a_frozen_server_is_declared_dead_and_the_job_recovers(tmp_path):
    dead_after = 6.0      # the health watch asks every 1 s: two slow replies under load are no death
    proc = engine("--set", f"client.dead_after_s={dead_after}", run_dir=tmp_path)
    detected, out, err = frozen_run(proc, lambda: wait_steps(tmp_path / "worker-0.progress.json", 20),
                                    tmp_path, "server", 1, dead_after + 60)
    assert proc.returncode == 0, err[-3000:]
    # the restart began after the stopped server's processes were killed (up to a few seconds more, and
    # more on a loaded machine); the message below is what tells the Health verdict from a worker that
    # the stopped server left without steps (which progress would also declare hung)
    assert detected < dead_after + 20, f"recovery began {detected:.1f}s after SIGSTOP"
    assert "server 1" in err and "answered no Health call from the launcher" in err, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["restarts"] == 1
    assert not leftovers(tmp_path)


@pytest.mark.long   # make test-long (~30 s): a frozen server declared dead after dead_after_s is the test above's
def test_a_server_frozen_in_its_start_up_is_declared_dead_after_dead_after_s(tmp_path):
    """Before its ready file a server has no address to poll: it beats instead (engine.progress), so one
    frozen there is declared dead after client.dead_after_s, not after cluster.startup_timeout_s (120 s).
    The failpoint server.before_ready holds every start-up open for 6 s so that the SIGSTOP lands in it."""
    dead_after = 6.0      # the health watch asks every 1 s: two slow replies under load are no death
    env = {**PACED, "ENGINE_FAILPOINTS": PACED["ENGINE_FAILPOINTS"] + ";server.before_ready=sleep:6"}
    proc = engine("--set", f"client.dead_after_s={dead_after}", run_dir=tmp_path, env=env)
    detected, out, err = frozen_run(proc, lambda: wait_log(tmp_path / "server-0.log", "failpoint server.before_ready"),
                                    tmp_path, "server", 0, dead_after + 60)
    assert proc.returncode == 0, err[-3000:]
    assert detected < dead_after + 20, f"recovery began {detected:.1f}s after SIGSTOP"
    assert "server 0 failed (hung before it was ready: no heartbeat" in err, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["restarts"] == 1
    assert not leftovers(tmp_path)


def test_more_failures_than_max_restarts_end_the_job_with_every_failure_listed(tmp_path):
    proc = engine("--set", "cluster.max_restarts=1", "--set", "model.epochs=50", run_dir=tmp_path)
    try:
        wait_steps(tmp_path / "worker-0.progress.json", 10)
        os.kill(role_pid(tmp_path, "worker", 0), signal.SIGKILL)
        wait_steps(tmp_path / "restart-1" / "worker-1.progress.json", 10)
        os.kill(role_pid(tmp_path / "restart-1", "server", 0), signal.SIGKILL)
        out, err = finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "giving up after 2 failure(s)" in err and "cluster.max_restarts=1" in err, err[-3000:]
    assert "attempt 0: worker 0: was killed by signal 9" in err
    assert "attempt 1: server 0: was killed by signal 9" in err
    assert not leftovers(tmp_path)


def test_a_worker_whose_loop_hangs_is_declared_dead_and_the_job_recovers(tmp_path):
    """A live process with a stuck loop: its heartbeat goes on but its step counter stops (the failpoint
    worker.after_step sleeps after the first step). It is declared dead after client.dead_after_s, the
    attempt restarts, hangs again, and with cluster.max_restarts=1 the job ends naming both hangs."""
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:600"}
    proc = subprocess.Popen([sys.executable, "-m", "engine", "train", str(DEMO), "--run-dir", str(tmp_path), *FAST,
                             "--set", "client.dead_after_s=6", "--set", "cluster.max_restarts=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    try:
        out, err = finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # every attempt hangs the same way (the failpoint holds in each): two hangs end the job, both named
    assert proc.returncode == 1, err[-3000:]
    assert err.count("hung: no training step for") >= 2 and "giving up after 2 failure(s)" in err, err[-3000:]
    assert not leftovers(tmp_path)


def test_a_server_whose_request_hangs_is_declared_stuck_and_the_attempt_restarts(tmp_path):
    """A live server whose handling hangs (the failpoint server.pull holds its 15th Pull 600 s, as a
    deadlock would): it still answers Health, but says it is ``stuck`` once that Pull is in flight past
    client.timeout_s (engine.ps.watchdog), and the launcher ends the attempt at once (before, only the
    worker's own call ended it, after client.timeout_s x (retries + 1) of a retried Pull: 18 s here).
    Every attempt hangs the same way, so with cluster.max_restarts=1 the job ends naming both."""
    env = {**PACED, "ENGINE_FAILPOINTS": PACED["ENGINE_FAILPOINTS"] + ";server.pull=sleep:600@15"}
    t0 = time.monotonic()
    proc = engine("--set", "client.timeout_s=3", "--set", "cluster.max_restarts=1", run_dir=tmp_path, env=env)
    out, err = finish(proc, 180)
    took = time.monotonic() - t0
    assert proc.returncode == 1, err[-3000:]
    assert "giving up after 2 failure(s)" in err, err[-3000:]
    assert len(re.findall(r"attempt [01]: server [01]: hung: stuck: Pull request ", err)) == 2, err[-3000:]
    assert "beyond client.timeout_s = 3s" in err, err[-3000:]
    # each attempt ends seconds after its hang, not after the workers' calls give up (3 s x 6 tries each)
    assert "ShardUnavailableError" not in err, err[-3000:]
    assert took < 120, took
    assert not leftovers(tmp_path)


def wait_log(path: Path, text: str, timeout: float = 60.0) -> None:
    until(lambda: path.exists() and text in path.read_text(errors="replace"), f"{path} saying {text!r}",
          timeout, every_s=0.05)


def test_a_server_that_hangs_or_dies_inside_the_restore_is_a_failure_like_any_other(tmp_path):
    """The launcher's own calls (the restore of a restart, the final checkpoint) are watched as the
    training is: a server frozen inside its Load is declared dead after client.dead_after_s (not after
    the Load's hour-long deadline), and one killed inside it restarts the job (not a launcher crash).
    The failpoint server.load holds every restore open for 4 s so that the faults land inside it."""
    dead_after = 6.0      # the health watch asks every 1 s: two slow replies under load are no death
    env = {**PACED, "ENGINE_FAILPOINTS": PACED["ENGINE_FAILPOINTS"] + ";server.load=sleep:4"}
    proc = engine("--set", f"checkpoint.root={tmp_path / 'ckpt'}", "--set", "checkpoint.align_steps=10",
                  "--set", "checkpoint.delta_every=10steps", "--set", f"client.dead_after_s={dead_after}",
                  "--set", "cluster.max_restarts=5", run_dir=tmp_path, env=env)
    try:
        wait_steps(tmp_path / "worker-0.progress.json", 25)        # a checkpoint stands at step 20
        os.kill(role_pid(tmp_path, "server", 0), signal.SIGKILL)
        wait_log(tmp_path / "restart-1" / "server-1.log", "failpoint server.load")
        os.kill(role_pid(tmp_path / "restart-1", "server", 1), signal.SIGSTOP)
        t0 = time.monotonic()
        wait_log(tmp_path / "restart-2" / "server-0.log", "failpoint server.load", timeout=dead_after + 40)
        detected = time.monotonic() - t0
        os.kill(role_pid(tmp_path / "restart-2", "server", 0), signal.SIGKILL)
        out, err = finish(proc, 180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert detected < dead_after + 30, f"the frozen restore was abandoned {detected:.1f}s after SIGSTOP"
    assert "restart 2/5" in err and "server 1 failed (answered no Health call from the launcher" in err, err[-3000:]
    assert "restart 3/5" in err and "server 0 failed (was killed by signal 9)" in err, err[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["restarts"] == 3, (final, err[-3000:])
    assert not leftovers(tmp_path)


@pytest.mark.long   # make test-long: the restore-fault test above runs restores of 4 s in make test
def test_a_restore_longer_than_dead_after_s_is_no_hang(tmp_path):
    """A restart's restore that takes longer than client.dead_after_s (the failpoint server.load holds
    every Load 10 s, against 6 s): the servers answer Health meanwhile and the Load is a phase for their
    watchdogs, so nothing is declared hung or stuck, and the job restarts once and finishes. Production
    restores take minutes against the default 30 s."""
    dead_after = 6.0
    env = {**PACED, "ENGINE_FAILPOINTS": PACED["ENGINE_FAILPOINTS"] + ";server.load=sleep:10"}
    proc = engine("--set", f"checkpoint.root={tmp_path / 'ckpt'}", "--set", "checkpoint.align_steps=10",
                  "--set", "checkpoint.delta_every=10steps", "--set", f"client.dead_after_s={dead_after}",
                  "--set", "client.timeout_s=5", run_dir=tmp_path, env=env)
    out, err = worker1_killed_at(proc, tmp_path, 25)          # a checkpoint stands at step 20
    assert proc.returncode == 0, err[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["restarts"] == 1, (final, err[-3000:])
    assert "worker 1 failed (was killed by signal 9); restart 1/3 from " in err, err[-3000:]
    assert "hung" not in err, err[-3000:]
    assert "failpoint server.load: sleep 10 s" in (tmp_path / "restart-1" / "server-0.log").read_text()
    assert not leftovers(tmp_path)


@pytest.mark.long   # make test-long (46 s of CI): the rule itself is tests/unit/test_recovery_target.py's
def test_a_restart_after_resume_of_an_older_checkpoint_restores_that_one_not_the_newer(tmp_path):
    """An operator rolls the job back (``--resume`` of an older checkpoint than the job's newest); a
    worker dies before the job writes a checkpoint of its own. The restart restores the checkpoint the
    job started from: before, it restored the job root's newest, the very state the operator had rolled
    back from, and trained on from it (``job_checkpoints.recovery_target``)."""
    root = tmp_path / "ckpt"
    sets = ["--set", f"checkpoint.root={root}"]
    for i, extra in enumerate((["--set", "model.epochs=1"], ["--set", "model.epochs=2", "--resume"])):
        first = engine(*sets, *extra, run_dir=tmp_path / f"before-{i}", env=dict(os.environ))   # unpaced
        out, err = finish(first, 120)
        assert first.returncode == 0, err[-3000:]
    old, abandoned = [str(p.parent) for p in sorted(root.glob("*/*/*/_SUCCESS"))]     # steps 46 and 92
    run = tmp_path / "run"
    proc = engine(*sets, "--set", "model.epochs=3", "--resume", old, run_dir=run)
    out, err = worker1_killed_at(proc, run, 66)
    assert proc.returncode == 0, err[-3000:]
    assert f"restart 1/3 from {old} " in err, err[-3000:]
    assert err.count(f"resumed from {old} ") == 2 and f"resumed from {abandoned}" not in err, err[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["restarts"] == 1
    manifest = json.loads((Path(final["checkpoint"]) / "manifest.json").read_text())
    assert manifest["parent"] == old.split("/logreg/", 1)[1]       # the job's chain goes on from the old one
    assert not leftovers(run)


def test_a_failed_attempt_does_not_wait_for_a_scheduled_save_stuck_on_a_frozen_server(tmp_path):
    """The launcher's wall-clock checkpoint thread (job_checkpoints.Periodic, for programs that do not
    write their own) may be inside a save when the attempt fails, stuck on the frozen server that failed
    it: ``stop(wait=False)`` returns at once, and the save ends unpublished once the server is gone."""
    from engine.config import load_config
    from engine.connect import connect
    from engine.job_checkpoints import Periodic, job_manager
    from tests.integration.test_role_resume import free_ports
    port = free_ports(1)[0]
    sets = [f"checkpoint.root={tmp_path / 'ckpt'}", "checkpoint.delta_every=1s", "checkpoint.base_every=1s"]
    cfg = load_config(DEMO, sets)
    server = subprocess.Popen([sys.executable, "-m", "engine", "train", str(DEMO), *[a for s in sets for a in ("--set", s)],
                               "--set", "cluster.warm_up=false", "--role", "server", "--rank", "0", "--port", str(port)],
                              cwd=REPO, env={**os.environ, "ENGINE_SERVERS": f"127.0.0.1:{port}", "ENGINE_NUM_WORKERS": "1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with connect(cfg, [f"127.0.0.1:{port}"], name="test", admin=True) as c:
            c.wait_ready(60)
        os.kill(server.pid, signal.SIGSTOP)            # frozen before the first save falls due (1 s)
        periodic = Periodic(cfg, [f"127.0.0.1:{port}"], poll_s=0.1)
        time.sleep(4.0)                                 # the save is due after 1 s: it is now waiting on the server
        t0 = time.monotonic()
        periodic.stop(wait=False)
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.5)     # a thread between saves sees the stop flag within poll_s (0.1 s) and ends
        assert periodic.thread.is_alive()              # still inside the save, as the failed attempt leaves it
        os.killpg(server.pid, signal.SIGKILL)          # the attempt's servers stop: the save fails
        periodic.thread.join(30)
        assert not periodic.thread.is_alive()
        assert job_manager(cfg).list() == []
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
