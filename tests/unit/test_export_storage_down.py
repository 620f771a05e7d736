"""``engine export``, ``engine eval`` and ``engine predict`` when the storage does not answer through its
retries (``hdfs_io.StorageUnavailableError``): one line saying so, exit 1 ("other failures" in their
``--help``). Export and eval said ``not an exportable checkpoint: expected a checkpoint directory ...`` with exit 2, a verdict on
the URI the storage never gave (an S3 endpoint down, a DNS name that did not resolve); predict printed a
traceback."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoint import CheckpointManager
from engine.cli import main
from hdfs_io import StorageUnavailableError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def storage_down(monkeypatch):
    def resolve(self, target=None):
        raise StorageUnavailableError("stat s3://bucket/ckpt/job failed after 5 attempts (last error OSError: "
                                      "NETWORK_CONNECTION)", uri="s3://bucket/ckpt/job")
    monkeypatch.setattr(CheckpointManager, "resolve", resolve)


def test_export_says_the_storage_is_unavailable_and_exits_1(storage_down, tmp_path, capsys):
    assert main(["export", "s3://bucket/ckpt/job", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "engine export: checkpoint storage unavailable: stat s3://bucket/ckpt/job failed" in err, err
    assert "not an exportable checkpoint" not in err and not (tmp_path / "out").exists()


def test_eval_says_the_storage_is_unavailable_and_exits_1(storage_down, capsys):
    assert main(["eval", str(REPO / "configs" / "word2vec.yaml"), "--checkpoint", "s3://bucket/ckpt/job"]) == 1
    err = capsys.readouterr().err
    assert "engine eval: checkpoint storage unavailable: stat s3://bucket/ckpt/job failed" in err, err


def test_a_path_that_holds_no_checkpoint_is_still_bad_input(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "not an exportable checkpoint" in capsys.readouterr().err


def test_predict_says_the_storage_is_unavailable_and_exits_1(monkeypatch, tmp_path, capsys):
    import engine.export.predictor as predictor

    def load_bundle(uri, storage_options=None, *, max_batch=8192):
        raise StorageUnavailableError(f"stat {uri}/_SUCCESS failed after 5 attempts", uri=uri)
    monkeypatch.setattr(predictor, "load_bundle", load_bundle)
    data = tmp_path / "rows.txt"
    data.write_text("")
    assert main(["predict", "s3://bucket/bundle", str(data)]) == 1      # was a traceback
    err = capsys.readouterr().err
    assert "engine predict: storage unavailable: stat s3://bucket/bundle/_SUCCESS failed" in err, err
