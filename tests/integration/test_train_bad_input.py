"""``engine train`` on Arrow files holding a value the model cannot train on: one error line naming the
file, the row and the column, exit code 2, and no restart (a restart reads the same row again).

The NaN sits deep in the second train file, which worker 1 reads: the launcher's look at every train value
before any process starts finds it, as it finds the null label. Before, that look read the labels only,
so the NaN ended the job in the middle of its epoch, found by worker 1, after checkpoints were written on
the file as it was: repaired, the file no longer matched their positions, ``--resume`` was refused, and
the job could only start afresh (reproduced 2026-11-30)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from streaming.criteo import SPARSE_COLUMNS, criteo_schema

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, n: int, seed: int, *, nan_at: int | None = None, null_label_at: int | None = None):
    rng = np.random.default_rng(seed)
    schema = criteo_schema()
    labels = (rng.random(n) < 0.3).astype(np.float32)
    dense = rng.random((n, 13), np.float32)
    if nan_at is not None:
        dense[nan_at, 5] = np.nan
    label = pa.array(labels, mask=np.arange(n) == null_label_at if null_label_at is not None else None)
    cols = [label, pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), 13)]
    cols += [pa.array(rng.integers(1, 50, n, dtype=np.uint64) + (np.uint64(j) << np.uint64(56)))
             for j in range(1, len(SPARSE_COLUMNS) + 1)]
    loose = pa.schema([f.with_nullable(True) for f in schema], metadata=schema.metadata)
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, loose) as w:
        w.write_batch(pa.RecordBatch.from_arrays(cols, schema=loose))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["dense", "label"])
def test_an_unusable_value_ends_the_job_with_one_line_naming_it_and_exit_2(where, tmp_path):
    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir()
    test.mkdir()
    _write(train / "part-00000.arrow", 600, 1)
    _write(train / "part-00001.arrow", 600, 2, nan_at=437 if where == "dense" else None,
           null_label_at=437 if where == "label" else None)
    _write(test / "part-00000.arrow", 200, 3)
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp_path / "run"),
           "--set", "model.data.source=arrow", "--set", f"model.data.train_path={train}",
           "--set", f"model.data.test_path={test}", "--set", f"model.metrics_dir={tmp_path / 'metrics'}",
           "--set", f"observability.tensorboard_dir={tmp_path / 'tb'}",
           "--set", f"checkpoint.root={tmp_path / 'ckpt'}", "--set", "model.hidden=[16]",
           "--set", "cluster.startup_timeout_s=60"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    bad = f"{train / 'part-00001.arrow'}: row 438: field "
    bad += "dense: expected a finite number at position 5, got nan" if where == "dense" else \
        "label: expected a label, got null"
    assert bad in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())   # nothing started
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_a_diverging_model_ends_the_job_with_one_line_naming_the_learning_rates_and_exit_2(tmp_path):
    """A learning rate the model diverges with: every restart would diverge again, so the worker stops at
    the first non-finite loss or sparse gradient, before pushing it, with exit 2 (before: the servers
    refused the gradients, a traceback, exit 1 and ``max_restarts`` restarts)."""
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp_path / "run"),
           "--set", "model.data.source=generated", "--set", "model.data.generated_rows=3000",
           "--set", f"model.data.cache_dir={tmp_path / 'cache'}", "--set", f"model.metrics_dir={tmp_path / 'metrics'}",
           "--set", f"observability.tensorboard_dir={tmp_path / 'tb'}",
           "--set", f"checkpoint.root={tmp_path / 'ckpt'}", "--set", "model.hidden=[16]", "--set", "model.epochs=1",
           "--set", "tables.dense.dense.learning_rate=1e30"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = next((ln for ln in proc.stderr.splitlines() if "training diverged: worker " in ln), None)
    assert line is not None, proc.stderr[-3000:]
    assert "tables.dense.dense.learning_rate=1e+30" in line and "tables.sparse.embedding.learning_rate=" in line, line
    assert "giving up after 1 failure(s)" in proc.stderr and "exited with code 2" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "restart-1").exists()
