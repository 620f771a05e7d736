"""A local train file written in place during an epoch, before the worker opened it, ends the job (a real
``engine train`` of configs/ctr.yaml, 1 server + 1 worker, one epoch, two train files): the worker reads each
file only as the version listed and checked at the epoch's start (``ArrowSource``'s ``versions``). Before,
``read_batches`` pinned the version its read began on, so the second file was read whole as the new version,
with the listed row counts and fingerprint, and the job ended with exit 0: rows of two versions in one epoch
(the next epoch's check would have refused the file, but there was none)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from streaming.criteo import convert_criteo, generate_criteo
from tests.integration.test_remote_inputs_train import _run_until

REPO = Path(__file__).resolve().parents[2]


def _stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=200)
    return sink.getvalue().to_pybytes()


@pytest.mark.long       # make test-long: ~20 s
def test_a_file_written_in_place_before_its_read_in_the_last_epoch_ends_the_job(tmp_path):
    generate_criteo(tmp_path / "rows.txt", 3000, 7)
    convert_criteo([tmp_path / "rows.txt"], tmp_path / "conv", split="train", batch_size=200)
    convert_criteo([tmp_path / "rows.txt"], tmp_path / "test", split="test", batch_size=200)
    t = pa.concat_tables(pa.ipc.open_stream(str(f)).read_all() for f in sorted((tmp_path / "conv").glob("*.arrow")))
    train = tmp_path / "train"
    train.mkdir()
    half = t.num_rows // 2
    parts = [t.slice(0, half), t.slice(half)]
    for i, part in enumerate(parts):
        (train / f"part-{i}.arrow").write_bytes(_stream(part))
    flipped = parts[1].set_column(0, "label", pa.array(1.0 - parts[1].column("label").to_numpy(), pa.float32()))
    new = _stream(flipped)
    assert len(new) == (train / "part-1.arrow").stat().st_size        # the same size: only the bytes differ
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp_path / "run"),
           *[a for s in ("model.data.source=arrow", f"model.data.train_path={train}",
                         f"model.data.test_path={tmp_path / 'test'}", "model.slots=[C1, C2, C3]", "model.hidden=[16]",
                         "cluster.workers=1", "observability.tensorboard=false", "model.epochs=1",
                         "model.batch_size=50", "model.shuffle_buffer=0", "model.prefetch=1",
                         "model.eval_every_epoch=false", f"model.metrics_dir={tmp_path / 'metrics'}",
                         f"checkpoint.root={tmp_path / 'ckpt'}", "cluster.max_restarts=0") for a in ("--set", s)]]
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:6@2"}   # held inside part-0

    def held() -> bool:             # worker 0 paused after its 2nd step, inside part-0
        return any("failpoint worker.after_step: sleep" in p.read_text()
                   for p in (tmp_path / "run").rglob("worker-0.log"))

    def rewrite() -> None:          # in place, as `dd conv=notrunc` or a writer reusing the name
        with open(train / "part-1.arrow", "r+b") as f:
            f.write(new)
    logs = _run_until(cmd, tmp_path, held, rewrite, env)    # exit 2; it was 0: part-1 trained as the new version
    assert f"engine train: bad input data: {train / 'part-1.arrow'}: row 1: field <record batch 0>: expected the " \
           f"file as the job listed it" in logs, logs[-3000:]
    assert np.isfinite(flipped.column("label").to_numpy()).all()
