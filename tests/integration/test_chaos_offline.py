"""Chaos, offline (issue 16): CTR-DNN on generated rows, 2 servers, checkpoints at aligned points; K = 3
``kill -9`` at moments drawn from a seed: a server, a worker, and a server while rank 0 writes a
checkpoint (the failpoint ``checkpoint.before_publish`` holds the write open so the kill lands inside
it). The job finishes by itself with ``restarts == 3``, and

- sync, 1 worker: the final model (every row with its optimizer state and counters, every dense
  parameter) is bit-identical to an uninterrupted run;
- async, 2 workers (``show_click_decay`` 1, no shrink, so show counts are exact): every training example
  counted exactly once, proven by the servers' show counts (each example adds one show to each of its
  26 keys), and the held-out AUC within the spread of uninterrupted runs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine import progress
from engine.launch.procs import processes_of as leftovers
from engine.launch.procs import role_pid
from tests.integration.test_offline_resume import _state, assert_same_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ROWS = 3000                    # generated rows; the canonical split keeps 4/5 for training
SLOTS = 26
# Uninterrupted async runs of this setting without checkpoints (2 workers, model.seed 0, 1, 2;
# 2026-11-25) gave test AUC 0.6588, 0.6596, 0.6754; a recovered run must land inside that spread widened
# by its own width on each side (async training with 2 workers is not deterministic either).
AUC_SPREAD = (0.6588, 0.6754)


def args(tmp: Path, tag: str, *sets: str, cache: str = "cache") -> list[str]:
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"),
            "--run-dir", str(tmp / f"run-{tag}"),
            "--set", "model.data.source=generated", "--set", f"model.data.generated_rows={ROWS}",
            "--set", f"model.data.cache_dir={tmp / cache}", "--set", f"model.metrics_dir={tmp / 'metrics'}",
            "--set", f"observability.tensorboard_dir={tmp / 'tb'}",
            "--set", f"checkpoint.root={tmp / ('ckpt-' + tag)}", "--set", "model.hidden=[16]",
            "--set", "model.epochs=3", "--set", "checkpoint.align_steps=8", "--set", "checkpoint.delta_every=8steps",
            "--set", "cluster.servers=2", "--set", "cluster.warm_up=false",
            *[a for s in sets for a in ("--set", s)]]


def run(cmd: list[str], env=None) -> dict:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def wait_for(path: Path, ok, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = progress.read(path)
        if r is not None and ok(r):
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} never happened: {progress.read(path)}")


def chaos(tmp: Path, tag: str, seed: int, *sets: str) -> tuple[dict, str]:
    """Run the job and kill -9 three roles at seeded moments, one per attempt; returns (final, stderr)."""
    rng = np.random.default_rng(seed)
    env = {**os.environ, "ENGINE_FAILPOINTS": "checkpoint.before_publish=sleep:1.5"}
    proc = subprocess.Popen(args(tmp, tag, *sets), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    run_dir = tmp / f"run-{tag}"
    plan = [("server", int(rng.integers(0, 2)), "step", int(rng.integers(4, 14))),
            ("worker", 0, "step", int(rng.integers(4, 14))),
            ("server", int(rng.integers(0, 2)), "checkpoint", 0)]
    try:
        for attempt, (role, rank, when, at) in enumerate(plan):
            d = run_dir if attempt == 0 else run_dir / f"restart-{attempt}"
            report = d / "worker-0.progress.json"
            if when == "step":
                wait_for(report, lambda r: r["step"] >= at, f"attempt {attempt}: step {at}")
            else:           # rank 0 is inside a checkpoint write (held open by the failpoint)
                wait_for(report, lambda r: (r.get("phase") or {}).get("name", "").startswith("checkpoint"),
                         f"attempt {attempt}: a checkpoint write")
            os.kill(role_pid(d, role, rank), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-4000:]
    assert not leftovers(run_dir)
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.long   # make test-long (see pyproject.toml): bit-identical resume is also test_offline_resume's
def test_sync_one_worker_recovers_to_the_bit_identical_model(tmp_path):
    # 2 epochs (the shared args say 3): seed 7's kills land in epoch 0 (steps 4-13, then the next checkpoint
    # write), so the recovered job still trains on through an epoch boundary before the models are compared
    sets = ("mode=sync", "cluster.workers=1", "model.pipeline=sequential", "model.epochs=2")
    # the uninterrupted run goes on beside the chaos run (its own data cache, run dir and checkpoint root;
    # sync training with one worker is deterministic, so sharing the cores cannot change its model)
    ref_out, ref_err = tmp_path / "full.stdout", tmp_path / "full.stderr"
    with open(ref_out, "w") as o, open(ref_err, "w") as e:
        reference = subprocess.Popen(args(tmp_path, "full", *sets, cache="cache-full"), cwd=REPO, stdout=o, stderr=e,
                                     start_new_session=True)
    try:
        final, err = chaos(tmp_path, "chaos", 7, *sets)
        assert reference.wait(timeout=300) == 0, ref_err.read_text()[-3000:]
    finally:
        if reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
            reference.wait(10)
    full = json.loads(ref_out.read_text().strip().splitlines()[-1])
    assert final["restarts"] == 3, err[-3000:]
    assert final["examples_replayed"] > 0
    assert_same_model(full["checkpoint"], final["checkpoint"])
    assert final["test_auc"] == full["test_auc"]


def test_async_two_workers_count_every_example_once(tmp_path):
    final, err = chaos(tmp_path, "chaos", 11, "mode=async", "cluster.workers=2")
    assert final["restarts"] == 3, err[-3000:]
    sparse, _ = _state(final["checkpoint"])
    shows = sparse[("embedding", "show")]
    train_rows = sum(1 for i in range(ROWS) if i % 5 != 4)
    # 3 epochs, 26 keys per example, one show each: more would be an example counted twice, less a lost one
    assert float(shows.sum()) == 3 * train_rows * SLOTS
    lo, hi = AUC_SPREAD
    width = hi - lo
    assert lo - width <= final["test_auc"] <= hi + width, final["test_auc"]


# Uninterrupted GEO runs of this setting (2 workers, model.seed 0, 1, 2; 2026-11-29): test AUC 0.6413,
# 0.6501, 0.6814
GEO_AUC_SPREAD = (0.6413, 0.6814)


@pytest.mark.long   # make test-long: GEO's recovery, which only bench/chaos_soak.py ran before
def test_geo_two_workers_recover_from_three_kills(tmp_path):
    """GEO (each worker trains a local copy and sends its deltas every ``k_steps``): three kills, and the
    job finishes by itself, every example counted once and the held-out AUC within the spread of
    uninterrupted runs. A delta carries the shows behind it (before 2026-11-30 it carried none, and the
    servers' show counts proved nothing in GEO)."""
    final, err = chaos(tmp_path, "chaos", 11, "mode=geo", "cluster.workers=2")
    assert final["restarts"] == 3 and final["examples_replayed"] > 0, err[-3000:]
    sparse, _ = _state(final["checkpoint"])
    train_rows = sum(1 for i in range(ROWS) if i % 5 != 4)
    assert float(sparse[("embedding", "show")].sum()) == 3 * train_rows * SLOTS
    lo, hi = GEO_AUC_SPREAD
    width = hi - lo
    assert lo - width <= final["test_auc"] <= hi + width, final["test_auc"]
