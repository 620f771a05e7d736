"""Role mode (``--role``, as Kubernetes or Slurm start a job): servers started with ``--resume URI``
restore their own vshards of that checkpoint before they listen and report it in ``Health``; a worker
started beside them resumes at its data position. A sync job of one worker resumed this way from a
mid-run checkpoint ends bit-identical to an uninterrupted run, and servers that restored different
checkpoints are refused with a message that says what to do."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint import CheckpointManager
from engine.programs.ctr import BLAS_ENV
from tests.integration.test_chaos_offline import REPO, ROWS, SLOTS, args, run
from tests.integration.test_offline_resume import _state, assert_same_model
from tests.pods import Pod
from tests.waiting import until

pytestmark = pytest.mark.slow

# model.blas_threads=1: the full run's launcher gives its children one BLAS thread on any machine (auto
# would give cores // processes), which role_env gives the roles this file starts by hand
SETS = ("mode=sync", "cluster.workers=1", "model.pipeline=sequential", "model.blas_threads=1")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def role_env(ports: list[int], workers: int = 1) -> dict:
    """The environment of the roles started by hand: the servers' endpoints, one worker, and the BLAS
    threads the full run's launcher gave its children (one, unless this environment sets them, as
    there). OpenBLAS's float32 products round differently with another thread count (with its default
    of one thread per core, ~1/3 of the tower's outputs differ by an ulp), so without them a role-mode
    run would not reproduce the launcher's bit for bit."""
    return {**{var: "1" for var in BLAS_ENV}, **os.environ,
            "ENGINE_SERVERS": ",".join(f"127.0.0.1:{p}" for p in ports), "ENGINE_NUM_WORKERS": str(workers)}


def role_cmd(tmp, tag: str, role: str, rank: int, *extra: str) -> list[str]:
    """The full run's resolved config (its data converted to Arrow, as role mode needs), checkpoints
    under a root of this job's own."""
    return [sys.executable, "-m", "engine", "train", str(tmp / "run-full" / "config.yaml"),
            "--set", f"checkpoint.root={tmp / ('ckpt-' + tag)}", "--role", role, "--rank", str(rank), *extra]


def role_job(tmp, tag: str, resumes: list[str]) -> tuple[int, dict | None, str]:
    """Two servers (server r with ``--resume resumes[r]``) and one worker, as a scheduler starts them;
    returns (worker exit code, its result, its stderr)."""
    ports = free_ports(2)
    env = role_env(ports)
    servers = [subprocess.Popen(role_cmd(tmp, tag, "server", r, "--port", str(ports[r]), "--resume", resumes[r]),
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True) for r in range(2)]
    result = tmp / f"{tag}-result.json"
    try:
        worker = subprocess.run(role_cmd(tmp, tag, "worker", 0, "--result-file", str(result)), cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=180)
    finally:
        for s in servers:
            if s.poll() is None:
                os.killpg(s.pid, signal.SIGKILL)
            s.wait(10)
    return worker.returncode, json.loads(result.read_text()) if result.exists() else None, worker.stderr


@pytest.mark.long   # make test-long (see pyproject.toml): the last test restarts a role-mode server with --resume and
# ends bit-identical too, its worker resuming at its data position
def test_role_mode_servers_resume_and_the_worker_continues_bit_identically(tmp_path):
    full = run(args(tmp_path, "full", *SETS))
    mgr = CheckpointManager(str(tmp_path / "ckpt-full"), "ctr_dnn")
    mid = next(m for m in (mgr.manifest(r.name) for r in mgr.list())
               if m["sources"]["train"]["epoch"] == 1 and m["sources"]["train"]["batch"] == 8)
    uri = mgr.uri_of(mid["name"])
    code, result, err = role_job(tmp_path, "role", [uri, uri])
    assert code == 0, err[-3000:]
    assert "the servers restored" in err and "resuming at epoch 1, batch 8" in err, err[-3000:]
    assert_same_model(full["checkpoint"], result["checkpoint"])


@pytest.mark.long   # make test-long (see pyproject.toml): the roll-back to one checkpoint is also the next test's
def test_servers_that_restored_different_checkpoints_are_rolled_back_to_the_newer(tmp_path):
    """One server restored an older checkpoint than the other (as when one server of a running job was
    restarted with --resume): rank 0 loads the newer onto every server and the job continues from it,
    ending bit-identical."""
    full = run(args(tmp_path, "full", *SETS))
    mgr = CheckpointManager(str(tmp_path / "ckpt-full"), "ctr_dnn")
    names = [r.name for r in mgr.list()]
    code, result, err = role_job(tmp_path, "mixed", [mgr.uri_of(names[1]), mgr.uri_of(names[2])])
    assert code == 0, err[-3000:]
    assert "rolling every server back to " + mgr.uri_of(names[2]) in err, err[-3000:]
    assert_same_model(full["checkpoint"], result["checkpoint"])


def test_one_server_restarted_under_a_running_worker_rolls_the_job_back_to_one_checkpoint(tmp_path):
    """The recovery rule without a launcher: server 1 of a running role-mode job dies and its scheduler
    restarts it with --resume. The worker's next request meets a new generation: it is refused (nothing
    applied) and the worker exits 76; restarted, rank 0 rolls every server back to the checkpoint server
    1 restored and the job ends bit-identical to an uninterrupted run."""
    from engine.roles import EXIT_ROLLBACK
    slow = ("model.batch_size=16", "checkpoint.delta_every=64steps")
    full = run(args(tmp_path, "full", *SETS, *slow))
    ports = free_ports(2)
    env = role_env(ports)

    def server(r: int, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(role_cmd(tmp_path, "role", "server", r, "--port", str(ports[r]), *extra), cwd=REPO,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    result = tmp_path / "role-result.json"
    worker_cmd = role_cmd(tmp_path, "role", "worker", 0, "--result-file", str(result))
    procs = [server(0), server(1)]
    try:
        worker = subprocess.Popen(worker_cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        procs.append(worker)
        mgr = CheckpointManager(str(tmp_path / "ckpt-role"), "ctr_dnn")
        deadline = time.monotonic() + 120
        while len(mgr.list()) < 3:
            assert worker.poll() is None and time.monotonic() < deadline, "the job wrote no checkpoints"
            time.sleep(0.05)
        os.killpg(worker.pid, signal.SIGSTOP)            # hold the worker between two requests
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait(10)
        procs[1] = server(1, "--resume")                # its scheduler restarts it from the newest checkpoint
        from engine.ps import PSClient
        with PSClient([f"127.0.0.1:{ports[1]}"], name="probe") as probe:
            probe.wait_ready(60)
            restored = probe.health()[0]["restored"]
        os.killpg(worker.pid, signal.SIGCONT)
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == EXIT_ROLLBACK, err[-3000:]
        assert "generation mismatch" in err
        again = subprocess.run(worker_cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"rolling every server back to {restored}" in again.stderr, again.stderr[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    assert_same_model(full["checkpoint"], json.loads(result.read_text())["checkpoint"])


@pytest.mark.long   # make test-long (~55 s): servers replaced with --resume are test_k8s_pods' preempted-job test's
def test_every_server_replaced_with_its_resume_uri_restores_the_newest_checkpoint_written_since(tmp_path):
    """``engine k8s --resume URI`` keeps ``--resume URI --resume-id ID`` in the servers' arguments for the
    job's whole life. Here the job warm-starts from another job's checkpoint and writes its own; then
    every server dies at once (a node drain) and both are started again with the same arguments. They
    must restore the job's newest checkpoint, which records ID, not URI: before, both loaded URI again,
    the restarted worker found them agreed on it, and everything trained since was silently lost. The
    job then ends bit-identical to an uninterrupted run."""
    from engine.ps import PSClient
    from engine.roles import EXIT_ROLLBACK
    slow = ("model.batch_size=16", "checkpoint.delta_every=64steps")
    full = run(args(tmp_path, "full", *SETS, *slow))
    source = CheckpointManager(str(tmp_path / "ckpt-full"), "ctr_dnn")
    uri = source.uri_of(source.list()[1].name)          # a warm start from the full run's second checkpoint
    ports = free_ports(2)
    env = role_env(ports)

    def server(r: int, start: int) -> subprocess.Popen:
        with open(tmp_path / f"server-{r}.{start}.log", "wb") as log:
            return subprocess.Popen(role_cmd(tmp_path, "role", "server", r, "--port", str(ports[r]), "--resume",
                                             uri, "--resume-id", "drain-test"), cwd=REPO, env=env,
                                    stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    result = tmp_path / "role-result.json"
    worker_cmd = role_cmd(tmp_path, "role", "worker", 0, "--result-file", str(result))
    procs = [server(0, 0), server(1, 0)]
    try:
        worker = subprocess.Popen(worker_cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        procs.append(worker)
        mgr = CheckpointManager(str(tmp_path / "ckpt-role"), "ctr_dnn")
        until(lambda: len(mgr.list()) >= 2 or worker.poll() is not None, "two checkpoints of the job",
              timeout_s=120, every_s=0.05)
        assert worker.poll() is None, worker.stderr.read()[-3000:]
        os.killpg(worker.pid, signal.SIGSTOP)            # hold the worker between two requests
        for r in (0, 1):                                 # every server at once
            os.killpg(procs[r].pid, signal.SIGKILL)
            procs[r].wait(10)
        newest = mgr.uri_of(mgr.latest().name)
        assert mgr.manifest(mgr.latest().name)["resumed_with"] == [{"id": "drain-test", "uri": uri}]
        procs[0], procs[1] = server(0, 1), server(1, 1)  # the same arguments: --resume URI --resume-id
        with PSClient([f"127.0.0.1:{p}" for p in ports], name="probe") as probe:
            probe.wait_ready(60)
            restored = [h["restored"] for h in probe.health()]
        assert restored == [newest, newest], (restored, newest, uri)
        os.killpg(worker.pid, signal.SIGCONT)
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == EXIT_ROLLBACK, err[-3000:]
        again = subprocess.run(worker_cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert again.returncode == 0, again.stderr[-3000:]
        position = mgr.manifest(newest.split("/ctr_dnn/", 1)[1])["sources"]["train"]
        assert f"resuming at epoch {position['epoch']}, batch {position['batch']}" in again.stderr, \
            again.stderr[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    for r in (0, 1):
        log = (tmp_path / f"server-{r}.1.log").read_text()
        assert f"restoring the newest of them, {newest}" in log, log[-2000:]
    assert_same_model(full["checkpoint"], json.loads(result.read_text())["checkpoint"])


def stop_all(schedulers: list, procs: list[subprocess.Popen]) -> None:
    """Stop the schedulers (and their roles), then kill what else the test started."""
    for w in schedulers:
        w.stop()
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def assert_every_example_once(result: Path) -> None:
    """3 epochs, 26 keys per example, one show each, in the final checkpoint's rows: more would be an
    example counted twice, less a lost one."""
    sparse, _ = _state(json.loads(result.read_text())["checkpoint"])
    train_rows = sum(1 for i in range(ROWS) if i % 5 != 4)
    assert float(sparse[("embedding", "show")].sum()) == 3 * train_rows * SLOTS


# "fresh" and "restored": make test-long (CI reached 17:18 of its 20 minutes on a loaded day, 2026-11-30);
# "no-checkpoint" keeps the fence, the roll-back and the count of every example in make test
@pytest.mark.parametrize("servers", [pytest.param("fresh", marks=pytest.mark.long),
                                     pytest.param("restored", marks=pytest.mark.long), "no-checkpoint"])
def test_a_worker_replaced_alone_fences_the_servers_and_the_job_rolls_back_counting_every_example_once(tmp_path,
                                                                                                    servers):
    """A scheduler replaces one crashed worker while the other trains on (Kubernetes replaces a failed
    pod of an Indexed Job alone). The replacement finds its own name among the servers' writers, so
    the servers hold what its former self trained: it fences them (a new generation, tables untouched),
    worker 0's next request is refused and it exits 76, and restarted, it rolls every server back to
    the newest checkpoint, where both resume. Every training example is counted exactly once: the
    servers' show counts (one per key of each example) equal the epochs' examples. Before the fence the
    replacement waited cluster.startup_timeout_s and exited 2 (a config error, which fails a Kubernetes
    Job at once) while worker 0 waited at its next checkpoint meeting for client.barrier_timeout_s.
    With servers that restored a checkpoint at their start (``--resume``), the replacement found them
    agreed on it and trained again what its former self had trained since. With no checkpoint written
    yet (``no-checkpoint``), rank 0 empties the servers (``Fence`` with ``clear``) and the job starts
    again from its beginning; before, rank 0 exited 2 (a config error) and the job was lost."""
    from engine.roles import EXIT_ROLLBACK
    sets = ("mode=async", "cluster.workers=2", "model.blas_threads=1")
    run(args(tmp_path, "full", *sets))          # the config, its data converted to Arrow, as role mode needs
    resume = ()
    if servers == "restored":                   # the full run's first checkpoint after a step: epoch 0, batch 8
        full = CheckpointManager(str(tmp_path / "ckpt-full"), "ctr_dnn")
        mid = next(m for m in (full.manifest(r.name) for r in full.list())
                   if m["sources"]["train"]["epoch"] == 0 and m["sources"]["train"]["batch"] == 8)
        resume = ("--resume", full.uri_of(mid["name"]))
    # no-checkpoint: none falls due before the job's final one
    never = ("--set", "checkpoint.delta_every=100000steps") if servers == "no-checkpoint" else ()
    ports = free_ports(2)
    # 0.1 s a step: the kill below lands with most of the training still ahead (a resumed job has 30 steps)
    env = {**role_env(ports, workers=2), "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.1"}
    procs = [subprocess.Popen(role_cmd(tmp_path, "role", "server", r, "--port", str(ports[r]), *resume, *never),
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
             for r in range(2)]
    result = tmp_path / "role-result.json"
    workers = [Pod(role_cmd(tmp_path, "role", "worker", r, *(("--result-file", str(result)) if r == 0 else ()),
                            *never), lambda n: env, tmp_path / f"worker-{r}.log") for r in range(2)]
    try:
        mgr = CheckpointManager(str(tmp_path / "ckpt-role"), "ctr_dnn")
        if never:
            from engine.ps import PSClient
            with PSClient([f"127.0.0.1:{p}" for p in ports], name="probe") as probe:
                probe.wait_ready(120)
                until(lambda: {"worker0", "worker1"} <= set(probe.health()[0]["writers"])
                      or any(w.codes for w in workers), "both workers writing", timeout_s=180, every_s=0.05)
            assert mgr.list() == []
        else:
            until(lambda: len(mgr.list()) >= 1 or any(w.codes for w in workers), "a checkpoint", timeout_s=180,
                  every_s=0.05)
        assert not any(w.codes for w in workers), [w.codes for w in workers]
        os.killpg(workers[1].proc.pid, signal.SIGKILL)
        for w in workers:
            w.thread.join(240)
        assert workers[1].codes == [-signal.SIGKILL, 0], workers[1].codes
        assert workers[0].codes == [EXIT_ROLLBACK, 0], workers[0].codes
        # one roll-back of the job (the replacement's fence, then rank 0's restore or clear), which each
        # server counts once (Health "rollbacks": engine_restarts_total in role mode, where no
        # supervisor counts restarts)
        from engine.ps import PSClient
        with PSClient([f"127.0.0.1:{p}" for p in ports], name="probe") as probe:
            assert [h["rollbacks"] for h in probe.health()] == [1, 1]
    finally:
        stop_all(workers, procs)
    log0, log1 = (tmp_path / "worker-0.log").read_text(), (tmp_path / "worker-1.log").read_text()
    assert "fenced 2 of 2 server(s)" in log1, log1[-3000:]
    assert "generation mismatch" in log0, log0[-3000:]
    assert ("the job starts again from its beginning" if never else "rolling every server back to") in log0, \
        log0[-3000:]
    assert_every_example_once(result)


@pytest.mark.long   # make test-long (~35 s): a replaced worker fencing the servers is the no-checkpoint test's above
def test_a_worker_restarted_while_it_waits_at_the_start_barrier_does_not_leave_its_dead_self_counted(tmp_path):
    """A fresh role-mode job: worker 1 starts first and waits at the start barrier for worker 0; it is
    killed there and its scheduler restarts it. Before, the restarted worker found the servers fresh
    and agreed, and the barrier counted its dead self's arrival (withdrawn only after 30 s unpolled): it
    opened for one of the two live workers and the other waited alone until its timeout, then failed
    over and over. Now the restarted worker finds its name among the servers' ``clients`` (a data
    request in the present generation) and fences them, and the job trains every example once."""
    sets = ("mode=async", "cluster.workers=2", "model.blas_threads=1")
    run(args(tmp_path, "full", *sets))
    ports = free_ports(2)
    env = {**role_env(ports, workers=2), "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.02"}
    procs = [subprocess.Popen(role_cmd(tmp_path, "role", "server", r, "--port", str(ports[r])), cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for r in range(2)]
    result = tmp_path / "role-result.json"
    workers = [Pod(role_cmd(tmp_path, "role", "worker", 1), lambda n: env, tmp_path / "worker-1.log")]
    try:
        from engine.ps import PSClient
        with PSClient([f"127.0.0.1:{p}" for p in ports], name="probe") as probe:
            probe.wait_ready(120)
            until(lambda: probe.stats()[0]["requests"]["Barrier"] >= 1 or workers[0].codes,
                  "worker 1 at the start barrier", timeout_s=120, every_s=0.05)
        assert not workers[0].codes, workers[0].codes
        os.killpg(workers[0].proc.pid, signal.SIGKILL)      # its scheduler starts it again at once
        workers.insert(0, Pod(role_cmd(tmp_path, "role", "worker", 0, "--result-file", str(result)), lambda n: env,
                              tmp_path / "worker-0.log"))
        for w in workers:
            w.thread.join(240)
        assert workers[1].codes == [-signal.SIGKILL, 0], workers[1].codes
        assert workers[0].codes in ([0], [76, 0]), workers[0].codes     # 76: fenced after it began
    finally:
        stop_all(workers, procs)
    # its dead self only arrived at the start barrier, on server 0: that server alone is fenced
    assert "fenced 1 of 2 server(s)" in (tmp_path / "worker-1.log").read_text()
    assert_every_example_once(result)
