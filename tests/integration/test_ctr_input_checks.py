"""CTR jobs and their input, end to end (``engine train`` of configs/ctr.yaml, 1 server + 1 worker, on
generated Criteo-format rows): an evaluation that fails after training loses no training, and raw string
slot columns train a model that ``engine predict`` scores alike."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.checkpoint import CheckpointManager
from streaming.criteo import SLOT_IDS, convert_criteo, generate_criteo

REPO = Path(__file__).resolve().parents[2]
SLOTS = ["C1", "C2", "C3"]


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """1500 generated lines: the text and its Arrow splits."""
    d = tmp_path_factory.mktemp("criteo")
    generate_criteo(d / "rows.txt", 1500, 5)
    for split in ("train", "test"):
        convert_criteo([d / "rows.txt"], d / split, split=split, batch_size=200)
    return d


def _cmd(tmp: Path, train, test, tag: str, *sets: str) -> list[str]:
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"),
            "--run-dir", str(tmp / f"run-{tag}"),
            "--set", "model.data.source=arrow", "--set", f"model.data.train_path={train}",
            "--set", f"model.data.test_path={test}", "--set", f"model.slots=[{', '.join(SLOTS)}]",
            "--set", "model.hidden=[16]", "--set", "cluster.workers=1", "--set", "observability.tensorboard=false",
            "--set", f"model.metrics_dir={tmp / 'metrics'}", "--set", f"checkpoint.root={tmp / 'ckpt'}",
            "--set", "model.eval_every_epoch=false", *[a for s in sets for a in ("--set", s)]]


def _write(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=200)


def _read(d: Path) -> pa.Table:
    return pa.concat_tables(pa.ipc.open_stream(str(f)).read_all() for f in sorted(d.glob("*.arrow")))


@pytest.mark.long   # ~20 s, two jobs; make test checks the test split in the launcher (unit/test_ctr_data_prepare)
@pytest.mark.slow
def test_a_final_evaluation_that_fails_keeps_the_trained_model_and_resume_only_evaluates(criteo, tmp_path):
    """The test split turns bad after the launcher checked it (a NaN label written while the job trains):
    the final evaluation fails with one line naming the file, the row and the column (exit 2, no restart),
    and the final checkpoint, written before it, holds the whole training; ``--resume`` with the test
    split repaired evaluates only. Before, the final checkpoint came after the evaluation and was lost."""
    test = tmp_path / "test"
    shutil.copytree(criteo / "test", test)
    good = _read(test)
    labels = good.column("label").to_numpy().copy()
    labels[9] = np.nan
    bad = good.set_column(0, "label", pa.array(labels, pa.float32()))
    env = dict(os.environ, ENGINE_FAILPOINTS="worker.after_step=sleep:4@1")   # time to spoil the test split
    proc = subprocess.Popen(_cmd(tmp_path, criteo / "train", test, "a"), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "metrics").glob("*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.2)          # the start event: the launcher's checks passed
        for f in test.glob("*.arrow"):
            f.unlink()
        _write(test / "part-00000.arrow", bad)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err[-3000:]
    assert "giving up after 1 failure(s) (worker 0 exited with code 2 (a config or usage error))" in err
    assert err.strip().splitlines()[-1].strip() == (f"engine train: bad input data: {test / 'part-00000.arrow'}: "
                                                    f"row 10: field label: expected a label in [0, 1], got nan")
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "ctr_dnn")
    (only,) = mgr.list()
    assert mgr.manifest(only.name)["sources"]["train"]["epoch"] == 1        # the end of the 1 epoch trained

    _write(test / "part-00000.arrow", good)
    proc = subprocess.run(_cmd(tmp_path, criteo / "train", test, "b") + ["--resume"], cwd=REPO,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in Path(final["metrics_file"]).read_text().splitlines()]
    assert not [e for e in events if e["event"] == "train"]                 # nothing trained again
    (ev,) = [e for e in events if e["event"] == "eval"]
    assert ev["count"] == good.num_rows and final["test_logloss"] == ev["logloss"] > 0


@pytest.mark.long   # ~20 s: a job, an export, a prediction; make test reads string slots (unit/test_ctr_data_prepare)
@pytest.mark.slow
def test_a_model_trained_on_raw_string_slots_predicts_alike_through_engine_predict(criteo, tmp_path):
    """DESIGN: slot columns may hold raw strings the reader hashes. ``engine train`` refused them; now it
    hashes them as ``engine predict`` does, so the bundle of the final checkpoint scores the raw test
    split with the logloss the trainer's final evaluation reported (the same predictions)."""
    lines = (criteo / "rows.txt").read_text().splitlines()
    for split, keep in (("train", lambda i: i % 5 != 4), ("test", lambda i: i % 5 == 4)):
        t = _read(criteo / split)
        rows = [line.split("\t") for i, line in enumerate(lines) if keep(i)]
        for name in SLOTS:
            t = t.set_column(t.schema.get_field_index(name), name, pa.array([r[13 + SLOT_IDS[name]] for r in rows]))
        _write(tmp_path / "raw" / split / "part-00000.arrow", t.select(["label", "dense", *SLOTS]))
    proc = subprocess.run(_cmd(tmp_path, tmp_path / "raw" / "train", tmp_path / "raw" / "test", "s"), cwd=REPO,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    engine = [sys.executable, "-m", "engine"]
    p = subprocess.run(engine + ["export", final["checkpoint"], str(tmp_path / "bundle")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run(engine + ["predict", str(tmp_path / "bundle"), str(tmp_path / "raw" / "test")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    pred = json.loads(p.stdout.strip().splitlines()[-1])
    assert pred["rows"] == _read(criteo / "test").num_rows
    assert pred["logloss"] == pytest.approx(final["test_logloss"], abs=1e-5)
    assert pred["auc"] == pytest.approx(final["test_auc"], abs=2e-3)     # the trainer's AUC: a histogram's


@pytest.mark.long   # ~25 s, three jobs; make test: changed files of real checkpoints (unit/test_ctr_resume_files)
@pytest.mark.slow
def test_a_resume_inside_an_epoch_onto_changed_train_files_exits_2(criteo, tmp_path):
    """A file added to the train directory (sorting first) after a checkpoint at epoch 0 batch 4: the
    resume exits 2 naming the file, before it skipped and repeated rows with exit 0; with the files put
    back it resumes at batch 4."""
    train = tmp_path / "train"
    shutil.copytree(criteo / "train", train)
    sets = ["model.shuffle_buffer=0", "checkpoint.align_steps=2", "checkpoint.delta_every=0.001s"]
    proc = subprocess.run(_cmd(tmp_path, train, criteo / "test", "a", *sets), cwd=REPO, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "ctr_dnn")
    (mid,) = [r.name for r in mgr.list() if mgr.manifest(r.name)["sources"]["train"]["batch"] == 4]
    uri = mgr.uri_of(mid)
    shutil.copy(criteo / "test" / "part-00000.arrow", train / "part-0.arrow")
    proc = subprocess.run(_cmd(tmp_path, train, criteo / "test", "b", *sets) + ["--resume", uri], cwd=REPO,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 2, proc.stderr[-3000:]
    size = (train / "part-0.arrow").stat().st_size
    assert proc.stderr.strip().splitlines()[-1].strip().startswith(
        f"engine train: config error: model.data.train_path: {train} holds other files than checkpoint {uri} was "
        f"trained on (part-0.arrow added ({size} bytes)): its position, epoch 0 batch 4, would skip"), proc.stderr
    (train / "part-0.arrow").unlink()
    proc = subprocess.run(_cmd(tmp_path, train, criteo / "test", "c", *sets) + ["--resume", uri], cwd=REPO,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming at epoch 0, batch 4 (checkpoint {uri})" in (tmp_path / "run-c" / "worker-0.log").read_text()
