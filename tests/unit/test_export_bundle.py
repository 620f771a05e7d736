"""Bundle format: layout and model.json, min_show filtering, float16 size, deltas applied in order equal
the full export (exported and loaded), order and publish checks, the checkpoint-backed and PS-save
sources."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

import hdfs_io
from engine.export import (BundleError, ExportError, RowBatchSource, TableSource, describe_model,
                           export_bundle, load_bundle, open_bundle)
from models import build_model
from sparse_tables import SparseTable, TableConfig

SLOTS = ["C1", "C2", "C3"]


def _model(kind="ctr_dnn"):
    return build_model(kind, num_slots=3, dim=4, dense_dim=2, hidden=(8,), seed=1)


def _rows(keys, vals, show=None):
    cols = [pa.array(keys, pa.uint64()),
            pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1), pa.float32()), vals.shape[1])]
    names = ["key", "values"]
    if show is not None:
        cols.append(pa.array(show, pa.float32()))
        names.append("show")
    return pa.RecordBatch.from_arrays(cols, names=names)


def _source(model, keys, vals, show=None, dense=None):
    return RowBatchSource(describe_model(model, SLOTS), model.get_dense() if dense is None else dense,
                          [_rows(keys, vals, show)], "memory://test")


def _state(keys, vals, dtype=np.float32):
    o = np.argsort(keys)
    return keys[o], vals[o].astype(dtype)


@pytest.fixture
def rows():
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64))
    return keys, rng.normal(size=(len(keys), 4)).astype(np.float32), rng.integers(0, 20, len(keys)).astype(np.float32)


def test_layout_and_model_json(rows, tmp_path):
    keys, vals, show = rows
    m = _model()
    meta = export_bundle(_source(m, keys, vals, show), str(tmp_path / "b"), groups=4)
    names = sorted(p.relative_to(tmp_path / "b").as_posix() for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert names == ["_SUCCESS", "dense.npz", "embeddings/group-00000-of-00004.arrow",
                     "embeddings/group-00001-of-00004.arrow", "embeddings/group-00002-of-00004.arrow",
                     "embeddings/group-00003-of-00004.arrow", "manifest.json", "model.json"]
    on_disk = json.loads((tmp_path / "b" / "model.json").read_text())
    assert on_disk["bundle"] == "full" and on_disk["model"]["kind"] == "ctr_dnn"
    assert on_disk["hashing"]["hash_version"] == 1 and on_disk["input"]["slots"] == SLOTS
    assert on_disk["embedding"]["rows"] == len(keys) == sum(f["rows"] for f in meta["embedding"]["files"])
    assert [e["name"] for e in on_disk["dense"]["layout"]] == [n for n, _, _ in m.dense_layout.entries]
    info = open_bundle(str(tmp_path / "b"))
    from engine.ps.routing import vshard_of
    for g in range(4):
        k, v = info.read_group(g)
        assert (np.diff(k.astype(np.float64)) >= 0).all() and np.all(k[1:] > k[:-1])    # sorted by key
        assert (vshard_of(k, 1024) * 4 // 1024 == g).all()
        t = info.read_table(f"embeddings/group-{g:05d}-of-00004.arrow")
        assert t.schema.names == ["key", "values"]                # no optimizer state, no counters
    np.testing.assert_array_equal(info.read_dense(), m.get_dense())
    b = load_bundle(str(tmp_path / "b"))
    got_k, got_v = b.state()
    exp_k, exp_v = _state(keys, vals)
    np.testing.assert_array_equal(got_k, exp_k)
    np.testing.assert_array_equal(got_v, exp_v)


def test_min_show_drops_rows_and_unknown_keys_read_zeros(rows, tmp_path):
    keys, vals, show = rows
    export_bundle(_source(_model(), keys, vals, show), str(tmp_path / "b"), min_show=5)
    b = load_bundle(str(tmp_path / "b"))
    kept = show >= 5
    assert len(b) == kept.sum() and 0 < kept.sum() < len(keys)
    np.testing.assert_array_equal(b.lookup(keys[kept]), vals[kept])
    np.testing.assert_array_equal(b.lookup(keys[~kept]), 0)
    assert b.meta["embedding"]["min_show"] == 5
    with pytest.raises(ExportError, match="'show'"):
        export_bundle(_source(_model(), keys, vals), str(tmp_path / "c"), min_show=5)


@pytest.mark.parametrize("min_show", [float("nan"), float("inf"), -1.0])
def test_a_min_show_that_is_not_a_finite_count_is_refused(rows, tmp_path, min_show):
    """``engine export --min-show nan`` kept every row and ``inf`` published a bundle of 0 rows, both exit 0."""
    keys, vals, show = rows
    with pytest.raises(ExportError, match=r"^min_show: expected a finite number >= 0 \(rows shown fewer times are "
                                          rf"dropped\), got {min_show}$"):
        export_bundle(_source(_model(), keys, vals, show), str(tmp_path / "b"), min_show=min_show)
    assert not (tmp_path / "b").exists()


def test_float16_halves_the_embeddings(rows, tmp_path):
    keys, vals, _ = rows
    m = _model()
    export_bundle(_source(m, keys, vals), str(tmp_path / "f32"))
    export_bundle(_source(m, keys, vals), str(tmp_path / "f16"), dtype="float16")
    a, b = open_bundle(str(tmp_path / "f32")), open_bundle(str(tmp_path / "f16"))
    nbytes = lambda info: sum(info.read_table(f["name"]).column("values").nbytes   # noqa: E731
                              for f in info.meta["embedding"]["files"])
    assert nbytes(b) * 2 == nbytes(a)
    size = lambda d: sum(p.stat().st_size for p in (tmp_path / d / "embeddings").iterdir())  # noqa: E731
    assert size("f16") < 0.75 * size("f32")          # keys (8 bytes) stay; (8 + 2*4) / (8 + 4*4) = 0.67
    loaded = load_bundle(str(tmp_path / "f16"))
    assert loaded.values.dtype == np.float16
    np.testing.assert_allclose(loaded.lookup(keys), vals, atol=2e-3, rtol=1e-3)


def _table_batches(t):
    return list(t.rows())


def test_deltas_applied_in_order_equal_the_full_export(tmp_path):
    """A real sparse table changes between exports (pushes, new keys, deletes, rows crossing
    min_show); base + delta1 + delta2 == the full export of the final state, loaded either way."""
    m = _model("deepfm")
    rng = np.random.default_rng(5)
    table = SparseTable(TableConfig(dim=m.sparse_width, optimizer="adagrad", learning_rate=0.1))
    universe = np.unique(rng.integers(1, 2**63, 4000, dtype=np.uint64))

    def step(n):
        k = np.unique(rng.choice(universe, n))
        table.push(k, rng.normal(size=(len(k), m.sparse_width)).astype(np.float32),
                   shows=np.full(len(k), 1, np.float32))

    desc = describe_model(m, SLOTS)

    def src(dense):
        return TableSource(desc, dense, [table])

    step(2000)
    step(2000)
    d0 = m.get_dense()
    export_bundle(src(d0), str(tmp_path / "base"), min_show=2, dtype="float16", groups=8)
    step(300)
    table.delete(universe[:50])
    d1 = d0 + 1
    m1 = export_bundle(src(d1), str(tmp_path / "d1"), since=str(tmp_path / "base"))
    assert m1["bundle"] == "delta" and m1["sequence"] == 1 and m1["embedding"]["dtype"] == "float16"
    assert 0 < m1["embedding"]["rows"] < len(table)
    assert m1["embedding"]["deleted"] > 0
    step(300)
    table.delete(universe[100:120])
    d2 = d1 * 2
    m2 = export_bundle(src(d2), str(tmp_path / "d2"), since=str(tmp_path / "d1"))
    assert m2["sequence"] == 2 and [c["uri"] for c in m2["chain"]] == [str(tmp_path / "base"), str(tmp_path / "d1")]
    export_bundle(src(d2), str(tmp_path / "full"), min_show=2, dtype="float16", groups=8)
    full = load_bundle(str(tmp_path / "full"))
    patched = load_bundle(str(tmp_path / "base"))
    patched.apply_delta(str(tmp_path / "d1"))
    patched.apply_delta(str(tmp_path / "d2"))
    chained = load_bundle(str(tmp_path / "d2"))            # a delta URI loads its chain
    for b in (patched, chained):
        k, v = b.state()
        fk, fv = full.state()
        np.testing.assert_array_equal(k, fk)
        np.testing.assert_array_equal(v.view(np.uint16), fv.view(np.uint16))
        np.testing.assert_array_equal(b.model.get_dense(), d2.astype(np.float32))
    # a delta of nothing is empty
    m3 = export_bundle(src(d2), str(tmp_path / "d3"), since=str(tmp_path / "d2"))
    assert m3["embedding"]["rows"] == 0 and m3["embedding"]["deleted"] == 0
    # order is enforced, and options of the base are kept
    stale = load_bundle(str(tmp_path / "base"))
    with pytest.raises(BundleError, match="apply deltas in order"):
        stale.apply_delta(str(tmp_path / "d2"))
    with pytest.raises(BundleError, match="not a delta"):
        stale.apply_delta(str(tmp_path / "full"))
    with pytest.raises(ExportError, match="dtype"):
        export_bundle(src(d2), str(tmp_path / "d4"), since=str(tmp_path / "d2"), dtype="float32")


def test_unpublished_bundle_is_not_loadable(rows, tmp_path):
    keys, vals, _ = rows
    export_bundle(_source(_model(), keys, vals), str(tmp_path / "b"))
    (tmp_path / "b" / "_SUCCESS").unlink()
    with pytest.raises(hdfs_io.NotPublishedError, match=r"_SUCCESS") as e:
        load_bundle(str(tmp_path / "b"))
    assert str(tmp_path / "b" / "_SUCCESS") in str(e.value)
    with pytest.raises(FileExistsError):
        (tmp_path / "b" / "_SUCCESS").touch()
        export_bundle(_source(_model(), keys, vals), str(tmp_path / "b"))


def test_bad_sources_are_named(rows, tmp_path):
    keys, vals, _ = rows
    m = _model()
    with pytest.raises(ExportError, match="'values'.*sparse_width 4"):
        export_bundle(_source(m, keys, vals[:, :3].copy()), str(tmp_path / "a"))
    with pytest.raises(ExportError, match="dense: expected float32"):
        export_bundle(_source(m, keys, vals, dense=np.zeros(3, np.float32)), str(tmp_path / "b"))
    dup = np.concatenate([keys[:5], keys[:5]])
    with pytest.raises(ExportError, match="more than once"):
        export_bundle(_source(m, dup, np.zeros((10, 4), np.float32)), str(tmp_path / "c"))
    with pytest.raises(ExportError, match="slots"):
        describe_model(m, ["C1"])
    export_bundle(_source(m, keys, vals), str(tmp_path / "ok"))
    b = load_bundle(str(tmp_path / "ok"))
    with pytest.raises(BundleError, match="missing slot column 'C2'"):
        b.predict(pa.RecordBatch.from_pydict({"C1": pa.array([1], pa.uint64())}))
    bad_hash = pa.RecordBatch.from_pydict({s: pa.array([1], pa.uint64()) for s in SLOTS}).replace_schema_metadata(
        {"hash_version": "99"})
    with pytest.raises(BundleError, match="hash_version 99"):
        b.predict(bad_hash)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", ["ctr_dnn", "deepfm"])
def test_one_key_per_cell_fast_path_equals_general_path(rows, tmp_path, kind, dtype):
    """uint64 slot columns without nulls take the fused lookup + pooling path; the same keys as
    one-element lists take the general gather + pool path: identical probabilities, unknown keys too."""
    keys, _, _ = rows
    m = _model(kind)
    rng = np.random.default_rng(9)
    vals = rng.normal(size=(len(keys), m.sparse_width)).astype(np.float32)
    export_bundle(_source(m, keys, vals), str(tmp_path / "b"), dtype=dtype)
    b = load_bundle(str(tmp_path / "b"), max_batch=64)                  # several chunks per batch
    n = 300
    pick = keys[rng.integers(0, len(keys), (n, 3))]
    pick[rng.random((n, 3)) < 0.1] = 12345                              # unknown to the bundle
    dense = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 2).astype(np.float32)), 2)
    flat = pa.RecordBatch.from_arrays([pa.array(pick[:, j]) for j in range(3)] + [dense],
                                      names=SLOTS + ["dense"])
    lists = pa.RecordBatch.from_arrays(
        [pa.array([[int(k)] for k in pick[:, j]], pa.list_(pa.uint64())) for j in range(3)] + [dense],
        names=SLOTS + ["dense"])
    fast, general = b.predict(flat), b.predict(lists)
    np.testing.assert_array_equal(fast, general)
    emb = b.lookup(pick.reshape(-1))                                    # and both are the model's forward
    cells = np.arange(n * 3, dtype=np.int32)
    # one 300-row forward against the bundle's 64-row chunks: BLAS may sum a product in another order
    # for another row count (numpy 2.4's OpenBLAS: 4 of 300 differ by 1 ulp), so not bit for bit
    np.testing.assert_allclose(fast, b.model.predict(emb, cells, cells, b._dense_of(flat, n)), rtol=1e-6, atol=1e-7)
