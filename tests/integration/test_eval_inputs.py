"""``engine eval``'s test split, on S3 (moto's server as a process of its own, its request log read) and on
local disk: listed once, then read as listed and checked (``ctr_data.prepare_listed``), as a trainer reads
its listing; a file written again after the check is refused with eval's own words, not a training job's.

Before, eval listed the test split three times (the check's listing, its look for files left unread, the
reader's), and the reader's own listing read a file written again after the check as the check never saw
it (exit 0); a changed file's message gave a training job's advice (its row split, ``--resume``).

One tiny CTR-DNN checkpoint per module (an in-process PS cluster, ``snapshot_cluster``), on local disk."""
from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pytest

from engine.cli import main
from engine.cli.eval import EVAL_CHANGED
from engine.config import DenseTableConfig
from engine.export import snapshot_cluster
from engine.ps import InProcessTransport, PSClient, PSServer
from models import build_model
from sparse_tables import TableConfig
from streaming import keys as K
from streaming.source import list_files
from tests.integration.test_predict_bad_input import eval_config_text
from tests.integration.test_remote_inputs_train import _free_port, _moto

SLOTS = ["C1", "C2", "C3"]
N = 300                 # rows of each test file
CONFIG = {"model": {"kind": "ctr_dnn", "slots": SLOTS, "dim": 4, "dense_dim": 13, "hidden": [8], "seed": 0,
                    "sparse_table": "embedding", "dense_table": "dense"}}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _stream(seed: int, label: float | None = None) -> bytes:
    rng = np.random.default_rng(seed)
    y = (rng.random(N) < 0.3).astype(np.float32) if label is None else np.full(N, label, np.float32)
    cols = {"label": pa.array(y),
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(N * 13).astype(np.float32)), 13)}
    for j, s in enumerate(SLOTS):
        cols[s] = pa.array(K.make_keys(j + 1, rng.integers(0, 50, N)))
    t = pa.table(cols)
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, t.schema) as w:
        w.write_table(t, max_chunksize=100)
    return sink.getvalue().to_pybytes()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(module dir, checkpoint job root, moto port, moto log)``; bucket ``evals`` made."""
    d = tmp_path_factory.mktemp("eval_inputs")
    m = build_model("ctr_dnn", num_slots=3, dim=4, dense_dim=13, hidden=(8,), seed=0)
    servers = [PSServer({"embedding": TableConfig(dim=m.sparse_width, optimizer="adagrad")},
                        {"dense": DenseTableConfig()}, index=0, num_servers=1, num_vshards=16, local_shards=1,
                        checkpoint_groups=1)]
    client = PSClient(InProcessTransport(servers))
    try:
        client.init_dense("dense", m.get_dense())
        keys = np.concatenate([K.make_keys(j + 1, np.arange(50)) for j in range(len(SLOTS))])
        client.push("embedding", keys, np.random.default_rng(1).normal(size=(len(keys), 4)).astype(np.float32),
                    shows=np.ones(len(keys), np.float32))
        snapshot_cluster(client, str(d / "ckpt"), "ctr", CONFIG)
    finally:
        client.close()
    port = _free_port()
    moto = _moto(port, d / "moto.log")
    try:
        _fs(port).create_dir("evals")
        yield d, d / "ckpt" / "ctr", port, d / "moto.log"
    finally:
        os.killpg(moto.pid, signal.SIGKILL)
        moto.wait(10)


def _fs(port: int) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                             endpoint_override=f"127.0.0.1:{port}", allow_bucket_creation=True)


def _put(port: int, key: str, data: bytes) -> None:
    with _fs(port).open_output_stream(key) as f:
        f.write(data)


def _config(d: Path, port: int, train: str, test: str) -> Path:
    cfg = d / f"eval-{uuid.uuid4().hex[:8]}.yaml"
    cfg.write_text(f"storage: {{endpoint: '127.0.0.1:{port}', scheme: http, region: us-east-1, access_key: testing, "
                   f"secret_key: testing}}\n" + eval_config_text(d, train, test))
    return cfg


def _logged(log: Path, port: int) -> list[str]:
    """The request lines moto logged so far: werkzeug's line of a request comes after its reply, so a marker
    request is made and its line awaited first (at most 5 s)."""
    mark = f"evals/mark-{uuid.uuid4().hex}"
    _fs(port).get_file_info(mark)
    for _ in range(50):
        lines = [_ANSI.sub("", line) for line in log.read_text(errors="replace").splitlines()]
        if any(mark in line for line in lines):
            return lines
        time.sleep(0.1)
    raise AssertionError(f"moto logged no line of {mark} within 5 s")


def _lists(log: Path, prefix: str, port: int) -> int:
    """LIST requests (ListObjectsV2) of keys under ``prefix`` moto logged so far."""
    pat = re.compile(rf"list-type=2&.*prefix={re.escape(prefix)}/?[ &]")
    return sum(1 for line in _logged(log, port) if pat.search(line))


def _touching(log: Path, prefix: str, port: int) -> int:
    """Requests of any kind (LIST, HEAD, GET, PUT) moto logged so far naming ``prefix`` (``run/train``: ``run``
    a random hex name) in the path or in a LIST's prefix, escaped or not."""
    return sum(1 for line in _logged(log, port) if prefix in unquote(line))


def _last(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_eval_lists_its_test_split_on_s3_once(setup, tmp_path, capsys):
    """As many LIST requests of the test split as one ``list_files`` of it makes (before: three times as many:
    the check, its look for unread names, the reader)."""
    d, ckpt, port, log = setup
    run = uuid.uuid4().hex[:8]
    for i in range(2):
        _put(port, f"evals/{run}/test/part-{i}.arrows", _stream(i))
    _put(port, f"evals/{run}/train/part-0.arrows", _stream(5))
    test = f"s3://evals/{run}/test"
    before = _lists(log, f"{run}/test", port)
    list_files(test, storage_options=_opts(port))
    one = _lists(log, f"{run}/test", port) - before
    assert one >= 1
    before = _lists(log, f"{run}/test", port)
    assert main(["eval", str(_config(tmp_path, port, f"s3://evals/{run}/train", test)), "--checkpoint",
                 str(ckpt)]) == 0, capsys.readouterr().err[-3000:]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 2 * N
    assert _lists(log, f"{run}/test", port) - before == one


@pytest.mark.parametrize("train", ["missing", "not arrow"])
def test_eval_never_lists_checks_or_reads_the_train_split_on_s3(setup, tmp_path, capsys, train):
    """``model.data.train_path`` names a prefix holding nothing, or a file that is not Arrow: eval scores the
    test split (exit 0) and sends no request naming the train prefix. Before, it listed the train split and
    read each file's schema, and refused (exit 2) a train split it never reads."""
    d, ckpt, port, log = setup
    run = uuid.uuid4().hex[:8]
    _put(port, f"evals/{run}/test/part-0.arrows", _stream(0))
    if train == "not arrow":
        _put(port, f"evals/{run}/train/part-0.arrows", b"not an Arrow stream" * 10)
    before = _touching(log, f"{run}/train", port)
    assert train == "missing" or before >= 1           # the pattern sees the PUT: it would see a LIST or a GET
    rc = main(["eval", str(_config(tmp_path, port, f"s3://evals/{run}/train", f"s3://evals/{run}/test")),
               "--checkpoint", str(ckpt)])
    assert rc == 0, capsys.readouterr().err[-3000:]
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["rows"] == N and out["test_path"] == f"s3://evals/{run}/test"
    assert _touching(log, f"{run}/train", port) == before


def test_eval_of_a_config_whose_train_path_does_not_exist_scores_its_test_split(setup, tmp_path, capsys):
    """On local disk: a ``model.data.train_path`` directory that does not exist. Before: "engine eval:
    model.data.train_path: ...", exit 2, for a split eval never reads."""
    d, ckpt, port, _ = setup
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "part-0.arrows").write_bytes(_stream(3))
    rc = main(["eval", str(_config(tmp_path, port, str(tmp_path / "nowhere" / "train"), str(tmp_path / "test"))),
               "--checkpoint", str(ckpt)])
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == N
    assert not (tmp_path / "nowhere").exists()


def _opts(port: int):
    import hdfs_io
    return hdfs_io.StorageOptions(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                                  access_key="testing", secret_key="testing")


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_test_file_written_again_after_evals_check_is_refused_in_evals_words(setup, tmp_path, monkeypatch,
                                                                               capsys, where):
    """The test file is written again (other labels, the same size) once the check read it, before the
    read: refused at its first batch, naming the file, exit 2, with what it means for eval. Before, the
    reader listed the split again and scored the new version, unchecked (exit 0)."""
    import engine.export.bundle as bundle_mod
    d, ckpt, port, _ = setup
    run = uuid.uuid4().hex[:8]
    old, new = _stream(0, 0.0), _stream(0, 1.0)
    assert len(old) == len(new)
    if where == "s3":
        _put(port, f"evals/{run}/test/part-0.arrows", old)
        test = f"s3://evals/{run}/test"

        def rewrite():
            _put(port, f"evals/{run}/test/part-0.arrows", new)
    else:
        (tmp_path / "test").mkdir()
        path = tmp_path / "test" / "part-0.arrows"
        path.write_bytes(old)
        test = str(tmp_path / "test")

        def rewrite():
            with open(path, "r+b") as f:        # in place: the same inode, the same size
                f.write(new)
            os.utime(path, ns=(1, 1))           # and surely another modification time
    real = bundle_mod.export_bundle

    def export_then_rewrite(*a, **kw):          # after the check, before the read
        out = real(*a, **kw)
        rewrite()
        return out
    monkeypatch.setattr(bundle_mod, "export_bundle", export_then_rewrite)
    assert main(["eval", str(_config(tmp_path, port, test, test)), "--checkpoint", str(ckpt)]) == 2
    last = _last(capsys)
    name = f"{test}/part-0.arrows"
    assert last.startswith(f"engine eval: {name}: row 1: field <record batch 0>: expected the ") \
        and last.endswith(EVAL_CHANGED), last
    assert "resume" not in last
