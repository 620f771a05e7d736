"""Bundles on every storage backend (local, moto S3): export, load, predict, delta, and the
unpublished-bundle error naming the marker's URI."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import hdfs_io
from engine.export import RowBatchSource, describe_model, export_bundle, load_bundle
from models import build_model

SLOTS = ["C1", "C2"]


def _src(keys, vals, dense):
    m = build_model("ctr_dnn", num_slots=2, dim=3, dense_dim=1, hidden=(4,))
    rb = pa.RecordBatch.from_arrays(
        [pa.array(keys, pa.uint64()), pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1)), 3)],
        names=["key", "values"])
    return RowBatchSource(describe_model(m, SLOTS), dense, [rb], "memory://contract")


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path), None
    return request.getfixturevalue("s3_root_uri"), request.getfixturevalue("s3_storage_options")


def test_round_trip_and_delta(root):
    uri, opts = root
    rng = np.random.default_rng(1)
    keys = np.arange(1, 501, dtype=np.uint64) * np.uint64(7919)
    vals = rng.normal(size=(500, 3)).astype(np.float32)
    dense = build_model("ctr_dnn", num_slots=2, dim=3, dense_dim=1, hidden=(4,)).get_dense()
    export_bundle(_src(keys, vals, dense), f"{uri}/base", groups=4, storage_options=opts)
    b = load_bundle(f"{uri}/base", storage_options=opts)
    np.testing.assert_array_equal(b.lookup(keys), vals)
    batch = pa.RecordBatch.from_pydict({"C1": pa.array(keys[:10]), "C2": pa.array(keys[10:20]),
                                        "dense": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(10, np.float32)), 1)})
    assert b.predict(batch).shape == (10,)
    vals2 = vals.copy()
    vals2[:50] += 1
    keys2, vals2 = keys[20:], vals2[20:]                      # 20 keys gone, 30 changed
    meta = export_bundle(_src(keys2, vals2, dense), f"{uri}/d1", since=f"{uri}/base", storage_options=opts)
    assert meta["embedding"]["rows"] == 30 and meta["embedding"]["deleted"] == 20
    b.apply_delta(f"{uri}/d1", storage_options=opts)
    k, v = b.state()
    o = np.argsort(keys2)
    np.testing.assert_array_equal(k, keys2[o])
    np.testing.assert_array_equal(v, vals2[o])
    st = hdfs_io.Storage.from_uri(uri, storage_options=opts)
    st.delete("d1/_SUCCESS")
    with pytest.raises(hdfs_io.NotPublishedError, match="d1/_SUCCESS"):
        load_bundle(f"{uri}/d1", storage_options=opts)
