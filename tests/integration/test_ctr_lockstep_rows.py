"""A lockstep job (sync, hybrid) trains every train row once an epoch, on files of unequal size.

Before, 3 files of 800 rows for 2 workers gave worker 0 two files and worker 1 one; every worker ran
the smallest shard's full batches, and the job trained 1,536 of the 2,400 rows an epoch (sync; 1,696 in
hybrid), the same 864 left out of every epoch, exit 0 and no warning. Now the rows are split evenly
(``ctr_data.make_source``) and a lockstep epoch ends with the smallest shard's last, partial batch.
Real jobs: ``engine train`` with a server and two workers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from streaming.criteo import SPARSE_COLUMNS, criteo_schema

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cols = [pa.array((rng.random(n) < 0.3).astype(np.float32)),
            pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 13, np.float32)), 13)]
    cols += [pa.array(rng.integers(1, 50, n, dtype=np.uint64) + (np.uint64(j) << np.uint64(56)))
             for j in range(1, len(SPARSE_COLUMNS) + 1)]
    schema = criteo_schema()
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, schema) as w:
        w.write_table(pa.Table.from_arrays(cols, schema=schema), max_chunksize=512)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    "sync",
    # make test-long (pyproject.toml): the sync job above covers the split and the partial last step;
    # hybrid's lockstep steps are the same count (Mode.steps_per_epoch), its job ~15 s more
    pytest.param("hybrid", marks=pytest.mark.long)])
def test_a_lockstep_job_trains_every_row_of_unequal_shards(mode, tmp_path):
    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir()
    test.mkdir()
    for i in range(3):
        _write(train / f"part-{i:05d}.arrow", 800, i)
    _write(test / "part-00000.arrow", 200, 9)
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp_path / "run"),
           "--set", f"mode={mode}", "--set", "model.data.source=arrow", "--set", f"model.data.train_path={train}",
           "--set", f"model.data.test_path={test}", "--set", f"model.metrics_file={metrics}",
           "--set", f"observability.tensorboard_dir={tmp_path / 'tb'}",
           "--set", f"checkpoint.root={tmp_path / 'ckpt'}", "--set", "model.hidden=[16]", "--set", "model.epochs=2",
           "--set", "model.eval_every_epoch=false", "--set", "cluster.startup_timeout_s=60"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["examples"] for e in events if e["event"] == "final"] == [2 * 2400]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["rows_left_out_per_epoch"] == 0
    assert " left out of every epoch" not in proc.stderr
