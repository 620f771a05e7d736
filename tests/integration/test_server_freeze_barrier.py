"""A parameter server frozen (SIGSTOP: a frozen cgroup, a host swapping) for longer than a barrier lease
while the workers wait at the sync step's barrier, then continued: the job finishes by itself, without
a restart, and trains what an unfrozen job trains.

The server drops an arrival not polled for ``engine.ps.barrier.Barriers.lease_s`` (30 s) as a dead
caller. Measured on its monotonic clock, which runs on while the server does not, every arrival looked
unpolled for longer than the lease the moment it ran again, and was withdrawn: the job still counted
right (its callers poll, and a poll arrives again under the same token), but the server's log said so,
and with calls that die in the freeze (``client.timeout_s`` 20 s) its watchdog logged the barrier poll
it was handling at the stop "stuck" (its health port NOT_SERVING for 0.5 s). Now both run on its awake
time (``engine.awake``), and the server logs its stop instead. Real processes: CTR-DNN in sync mode, one
server and three workers (``client.dead_after_s`` 120 s, so that neither the launcher nor the workers'
keepalive gives the frozen server up: the default 30 s restarts the attempt instead, by design). Worker
2 is stopped first, so workers 0 and 1 wait at a barrier that cannot open; then the server is stopped
for 40 s, and continued a moment after worker 2.

The counts an unfrozen run gives (the same job without the freeze, 2026-12-01): 7 steps and 800 examples
a worker, 2,400 in all, one show per example on each of its 26 keys in the final checkpoint, and one
dense Adam update per step (``t`` 7): a barrier that opened without a worker's push, or twice in a step,
would split a step's pushes over two updates, and a push lost or applied twice would change the shows.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from engine.launch.procs import processes_of as leftovers
from engine.launch.procs import role_pid
from tests.integration.test_supervision import wait_steps

pytestmark = [pytest.mark.slow, pytest.mark.long]      # ~90 s: a 40 s freeze in a 40 s job

REPO = Path(__file__).resolve().parents[2]
ROWS, SLOTS, WORKERS, BATCH = 3000, 26, 3, 128
TRAIN_ROWS = sum(1 for i in range(ROWS) if i % 5 != 4)      # the canonical split keeps 4/5 for training
STEPS = -(-TRAIN_ROWS // WORKERS // BATCH)                  # 800 rows a worker: 6 full batches and one of 32
FREEZE_S = 40.0                                             # beyond the 30 s lease


def _cmd(tmp: Path, *sets: str) -> list[str]:
    sets = ("mode=sync", "cluster.servers=1", f"cluster.workers={WORKERS}", "model.data.source=generated",
            f"model.data.generated_rows={ROWS}", f"model.data.cache_dir={tmp / 'cache'}",
            f"model.metrics_dir={tmp / 'metrics'}", f"checkpoint.root={tmp / 'ckpt'}",
            f"observability.tensorboard_dir={tmp / 'tb'}", f"cluster.run_root={tmp / 'runs'}",
            "model.hidden=[16]", "model.epochs=1", f"model.batch_size={BATCH}", "model.blas_threads=1",
            "model.eval_every_epoch=false", "client.dead_after_s=120",
            # two RPC threads: one poll may linger on the server (engine.ps.grpc_service), so the other
            # waiter's arrival is polled only by calls that run after the freeze, and is withdrawn
            "cluster.server_threads=2", *sets)
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp / "run"),
            *[a for s in sets for a in ("--set", s)]]


def _dense_updates(ckpt: str) -> list[int]:
    """Adam's step count ``t`` of every block of the dense table in checkpoint ``ckpt``."""
    out = []
    for part in sorted(Path(ckpt, "dense", "dense").glob("*.arrow")):
        with pa.OSFile(str(part)) as f:
            out += pa.ipc.open_file(f).read_all().column("t").to_pylist()
    return out


def _shows(ckpt: str) -> float:
    """Sum of the ``show`` counter over every row of the sparse table in checkpoint ``ckpt``."""
    total = 0.0
    for part in sorted(Path(ckpt, "sparse", "embedding").glob("*.arrow")):
        with pa.OSFile(str(part)) as f:
            total += float(pc.sum(pa.ipc.open_file(f).read_all().column("show")).as_py() or 0)
    return total


@pytest.mark.parametrize("timeout_s", [60, 20], ids=["calls-outlive-freeze", "calls-die-in-freeze"])
def test_a_server_frozen_past_the_barrier_lease_while_workers_wait_lets_the_job_finish_with_every_count_right(
        tmp_path, timeout_s):
    """``calls-outlive-freeze``: the default client.timeout_s (60 s), so the workers' pushes and pulls in
    flight outlive the freeze (their barrier polls, 30 s at most, do not). ``calls-die-in-freeze``:
    client.timeout_s 20 s, so every call in flight dies in the freeze, and the request the server was
    handling at the stop is older than the bound of its judge of a stuck request (``engine.ps.watchdog``,
    client.timeout_s) on its monotonic clock, though not on its awake time."""
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.5"}   # 5 steps outlast the freeze's set-up
    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(tmp_path, f"client.timeout_s={timeout_s}"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    stopped: list[int] = []
    try:
        wait_steps(run / "worker-0.progress.json", 2, timeout=180)
        worker2, server = role_pid(run, "worker", 2), role_pid(run, "server", 0)
        os.kill(worker2, signal.SIGSTOP)
        stopped.append(worker2)
        time.sleep(2.0)                 # workers 0 and 1 arrive at a barrier worker 2 cannot reach
        os.kill(server, signal.SIGSTOP)
        stopped.append(server)
        time.sleep(FREEZE_S)
        os.kill(worker2, signal.SIGCONT)    # its push and arrival wait in the server's socket with the polls
        time.sleep(0.2)
        os.kill(server, signal.SIGCONT)
        stopped.clear()
        out, err = proc.communicate(timeout=240)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-4000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["restarts"] == 0, err[-4000:]
    results = [json.loads((run / f"worker-{r}.result.json").read_text()) for r in range(WORKERS)]
    assert [(r["steps"], r["examples"]) for r in results] == [(STEPS, TRAIN_ROWS // WORKERS)] * WORKERS, results
    assert _dense_updates(final["checkpoint"]) == [STEPS], "the sync barrier opened other than once per step"
    assert _shows(final["checkpoint"]) == TRAIN_ROWS * SLOTS, "a push lost or applied twice"
    # the server saw its stop (engine.awake), and its leases left that time out: before, the first poll
    # after the freeze withdrew the arrivals made before it ("barrier 'sync:step': withdrew 1 arrival(s)
    # not polled for 30s (up to 40.2s ...), 1 of 3 left"), and their callers' next polls counted them again
    log0 = (run / "server-0.log").read_text()
    assert "this process did not run for 4" in log0, log0[-3000:]
    assert "withdrew" not in log0, log0[-3000:]
    # nor did its watchdog take a request it was handling when stopped for stuck: before, with calls that
    # die in the freeze, "server 0: stuck: Barrier request worker0@... in flight for 40.4s ..., beyond
    # client.timeout_s = 20s" (ERROR; NOT_SERVING on a health port until its next look, 0.5 s later)
    assert "server 0: stuck:" not in log0, log0[-3000:]
    assert not leftovers(run)
