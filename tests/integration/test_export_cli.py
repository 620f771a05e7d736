"""``engine export`` from checkpoints written by an in-process PS cluster (base, then a delta export
of a delta checkpoint), and ``engine predict`` on Arrow and raw Criteo input: output contract (last
stdout line JSON), row order, AUC, exit code 2 on an unpublished bundle."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from engine.checkpoint import CheckpointManager
from engine.cli import main
from engine.config import DenseTableConfig
from engine.export import CheckpointSource, load_bundle, snapshot_cluster
from engine.ps import InProcessTransport, PSClient, PSServer
from models import build_model
from sparse_tables import TableConfig
from streaming.criteo import SPARSE_COLUMNS, convert_criteo, generate_criteo
from streaming.source import ArrowSource

SLOTS = list(SPARSE_COLUMNS)
CONFIG = {"model": {"kind": "deepfm", "slots": SLOTS, "dim": 4, "dense_dim": 13, "hidden": [8], "seed": 0,
                    "sparse_table": "embedding", "dense_table": "dense"}}


def _last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


@pytest.fixture
def cluster():
    m = build_model("deepfm", num_slots=26, dim=4, dense_dim=13, hidden=(8,))
    servers = [PSServer({"embedding": TableConfig(dim=m.sparse_width, optimizer="adagrad")},
                        {"dense": DenseTableConfig()}, index=i, num_servers=2, num_vshards=64, local_shards=2,
                        checkpoint_groups=4) for i in range(2)]
    client = PSClient(InProcessTransport(servers))
    client.init_dense("dense", m.get_dense())
    yield client, m
    client.close()


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    generate_criteo(d / "c.txt", rows=3000, seed=3)
    convert_criteo(d / "c.txt", d / "arrow", batch_size=700, progress=False)
    return d / "c.txt", d / "arrow"


def _data_keys(arrow_dir):
    rb = pa.Table.from_batches(list(ArrowSource(str(arrow_dir), batch_size=4096, prefetch=0).batches(0)))
    return np.unique(np.concatenate([rb.column(s).to_numpy() for s in SLOTS]))


def test_export_checkpoint_then_delta_and_predict(cluster, criteo, tmp_path, capsys):
    client, m = cluster
    text, arrow = criteo
    keys = _data_keys(arrow)
    rng = np.random.default_rng(0)
    client.push("embedding", keys, rng.normal(size=(len(keys), 5)).astype(np.float32),
                shows=np.ones(len(keys), np.float32))
    root = str(tmp_path / "ckpt")
    src = snapshot_cluster(client, root, "ctr", CONFIG)
    assert isinstance(src, CheckpointSource) and src.model_description()["model"]["kind"] == "deepfm"
    assert main(["export", f"{root}/ctr", str(tmp_path / "base")]) == 0
    res = _last_json(capsys)
    assert res["event"] == "export" and res["bundle"] == "full" and res["rows"] == len(keys)
    b = load_bundle(str(tmp_path / "base"))
    np.testing.assert_array_equal(b.lookup(keys), client.pull("embedding", keys))
    np.testing.assert_array_equal(b.model.get_dense(), client.pull_dense("dense"))
    assert b.meta["source"]["checkpoint"]["kind"] == "base"
    assert main(["export", f"{root}/ctr", str(tmp_path / "w2v"), "--format", "word2vec"]) == 2
    assert f"{root}/ctr is a deepfm checkpoint, not a word2vec one" in capsys.readouterr().err
    assert not (tmp_path / "w2v").exists()

    # an hour later: some rows change, a delta checkpoint, a delta export
    some = keys[::7]
    client.push("embedding", some, rng.normal(size=(len(some), 5)).astype(np.float32),
                shows=np.ones(len(some), np.float32))
    CheckpointManager(root, "ctr").save(client, "delta", config=CONFIG)
    assert main(["export", f"{root}/ctr", str(tmp_path / "d1"), "--delta", str(tmp_path / "base")]) == 0
    res = _last_json(capsys)
    assert res["bundle"] == "delta" and 0 < res["rows"] <= len(some)
    assert main(["export", f"{root}/ctr", str(tmp_path / "full")]) == 0
    capsys.readouterr()
    b.apply_delta(str(tmp_path / "d1"))
    full = load_bundle(str(tmp_path / "full"))
    for x, y in zip(b.state(), full.state()):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(b.lookup(keys), client.pull("embedding", keys))

    # engine predict on Arrow (with --out) and on raw Criteo text: same predictions, in row order
    out = tmp_path / "preds.arrow"
    assert main(["predict", str(tmp_path / "base"), str(arrow), "--delta", str(tmp_path / "d1"),
                 "--out", str(out), "--batch-size", "512"]) == 0
    res = _last_json(capsys)
    assert res["rows"] == 3000 and res["rows_per_s"] > 0 and 0 <= res["auc"] <= 1 and res["logloss"] > 0
    preds = ipc.open_file(str(out)).read_all().column("prob").to_numpy()
    expect = np.concatenate([full.predict(rb) for rb in ArrowSource(str(arrow), batch_size=999,
                                                                   prefetch=0).batches(0)])
    np.testing.assert_allclose(preds, expect, atol=1e-6)
    assert main(["predict", str(tmp_path / "full"), str(text)]) == 0
    res2 = _last_json(capsys)
    assert res2["rows"] == 3000 and res2["auc"] == pytest.approx(res["auc"], abs=1e-9)


def test_cli_errors_exit_2(tmp_path, capsys, criteo):
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "not an exportable checkpoint" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.json").write_text("{}")
    assert main(["predict", str(tmp_path / "b"), str(criteo[1])]) == 2
    assert "_SUCCESS" in capsys.readouterr().err
