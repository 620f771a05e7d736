"""``engine eval`` beyond word2vec (``test_w2v_engine_train.py`` covers it): a CTR checkpoint scored on
the test split through an exported bundle gives the AUC the training job computed on the servers, and bad
input exits 2 with one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _engine(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "engine", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_ctr_eval_matches_the_training_jobs_test_auc(tmp_path):
    sets = ["model.data.source=generated", "model.data.generated_rows=4000",
            f"model.data.cache_dir={tmp_path / 'cache'}", f"model.metrics_dir={tmp_path / 'metrics'}",
            f"observability.tensorboard_dir={tmp_path / 'tb'}",
            f"checkpoint.root={tmp_path / 'ckpt'}", "model.hidden=[16]"]
    sets = [a for s in sets for a in ("--set", s)]
    proc = _engine("train", REPO / "configs" / "ctr.yaml", "--run-dir", tmp_path / "run", *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    proc = _engine("eval", REPO / "configs" / "ctr.yaml", "--checkpoint", final["checkpoint"], *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["event"] == "eval" and out["model"] == "ctr_dnn" and out["rows"] == 800
    # the job's AUC comes from 2^16-bucket histograms merged on the servers, ours from exact scores
    assert out["auc"] == pytest.approx(final["test_auc"], abs=2e-3)
    assert out["logloss"] == pytest.approx(final["test_logloss"], abs=2e-3)


def test_eval_bad_input_exits_2(tmp_path):
    proc = _engine("eval", REPO / "configs" / "word2vec.yaml", "--checkpoint", tmp_path / "nothing")
    assert proc.returncode == 2 and "not an exportable checkpoint" in proc.stderr
    assert proc.stdout == ""
    proc = _engine("eval", REPO / "configs" / "logreg_demo.yaml", "--checkpoint", tmp_path)
    assert proc.returncode == 2 and "model.kind must be word2vec, ctr_dnn or deepfm" in proc.stderr
