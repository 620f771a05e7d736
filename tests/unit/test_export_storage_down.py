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
    assert "engine predict: bundle storage unavailable: stat s3://bucket/bundle/_SUCCESS failed" in err, err


def test_export_names_the_output_store_when_that_is_the_one_that_failed(tmp_path, monkeypatch, capsys):
    """A real checkpoint on local disk, the bundle to an ``hdfs://`` store whose client cannot load here
    (no JVM: ``StorageUnavailableError`` naming the namenode at once): the line names the output store.
    Before, it said "checkpoint storage unavailable", sending the operator to a store that was fine."""
    import numpy as np

    from engine.config import DenseTableConfig
    from engine.export import snapshot_cluster
    from engine.ps import InProcessTransport, PSClient, PSServer
    from models import build_model
    from sparse_tables import TableConfig
    from streaming.criteo import SPARSE_COLUMNS

    for var in ("JAVA_HOME", "ARROW_LIBHDFS_DIR", "HADOOP_HOME"):     # no JVM, wherever this runs
        monkeypatch.setenv(var, str(tmp_path / "none"))
    m = build_model("ctr_dnn", num_slots=len(SPARSE_COLUMNS), dim=4, dense_dim=13, hidden=(4,))
    server = PSServer({"embedding": TableConfig(dim=m.sparse_width, optimizer="adagrad")},
                      {"dense": DenseTableConfig()}, index=0, num_servers=1, num_vshards=16, local_shards=1)
    client = PSClient(InProcessTransport([server]))
    try:
        client.init_dense("dense", m.get_dense())
        keys = np.arange(1, 21, dtype=np.uint64)
        client.push("embedding", keys, np.ones((20, m.sparse_width), np.float32), shows=np.ones(20, np.float32))
        config = {"model": {"kind": "ctr_dnn", "slots": list(SPARSE_COLUMNS), "dim": 4, "dense_dim": 13, "hidden": [4],
                            "seed": 0, "sparse_table": "embedding", "dense_table": "dense"}}
        snapshot_cluster(client, str(tmp_path / "ckpt"), "ctr", config)
    finally:
        client.close()
    out = "hdfs://nn.invalid:8020/bundles/ctr"
    assert main(["export", str(tmp_path / "ckpt" / "ctr"), out]) == 1
    err = capsys.readouterr().err
    assert f"engine export: output storage unavailable (writing {out}): cannot open HDFS for" in err, err
    assert "checkpoint storage unavailable" not in err, err
