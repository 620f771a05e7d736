"""Serving bundles predict what the trainer predicts: CTR-DNN and DeepFM trained in-process on
generated Criteo rows, exported (float32 / float16), loaded with ``load_bundle`` and scored on the test
split; the ONNX dense tower run by onnxruntime on the same pooled inputs."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from engine.export import export_bundle, load_bundle
from engine.metrics import BinaryMetrics
from streaming.source import ArrowSource
from tests.unit.export_trainer import Trainer, arrays, make_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("criteo"))


@pytest.fixture(scope="module", params=["ctr_dnn", "deepfm"])
def trained(request, data):
    tr = Trainer(request.param)
    tr.train(data[1], epochs=1)
    return tr


def _test_batches(path):
    return list(ArrowSource(path, batch_size=512, prefetch=0).batches(0))


def _scores(batches, fn):
    preds, labels = [], []
    for rb in batches:
        preds.append(fn(rb))
        labels.append(arrays(rb)[0])
    return np.concatenate(preds), np.concatenate(labels)


def _auc(p, y):
    m = BinaryMetrics()
    m.update(p, y)
    return m.auc()


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 1e-2)])
def test_bundle_predictions_equal_trainer_forward(trained, data, tmp_path, dtype, tol):
    export_bundle(trained.source(), str(tmp_path / "b"), dtype=dtype)
    bundle = load_bundle(str(tmp_path / "b"))
    batches = _test_batches(data[2])
    ours, y = _scores(batches, bundle.predict)
    ref, _ = _scores(batches, trained.predict)
    assert len(ours) == len(ref) > 1000
    assert np.abs(ours - ref).max() <= tol
    auc_ours, auc_ref = _auc(ours, y), _auc(ref, y)
    assert auc_ref > 0.58                    # the trainer learned something: the check is not vacuous
    if dtype == "float32":
        assert abs(auc_ours - auc_ref) <= 1e-4
    print(f"parity {trained.model.kind} {dtype}: max|diff| {np.abs(ours - ref).max():.2e}, "
          f"AUC {auc_ours:.6f} vs {auc_ref:.6f}")


def test_onnx_equals_our_forward(trained, data, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from engine.export.onnx_export import ONNX_FILE, export_onnx
    meta = export_onnx(trained.source(), str(tmp_path / "o"))
    assert ONNX_FILE in meta["extra_files"]
    bundle = load_bundle(str(tmp_path / "o"))
    sess = ort.InferenceSession((tmp_path / "o" / ONNX_FILE).read_bytes())
    for rb in _test_batches(data[2])[:3]:
        pooled, dense = bundle.pooled(rb)
        assert pooled.shape == (rb.num_rows, 26 * trained.model.sparse_width)
        got = sess.run(["prob"], {"pooled": pooled, "dense": dense})[0]
        np.testing.assert_allclose(got, trained.predict(rb), rtol=0, atol=1e-5)


def test_predict_handles_list_string_and_null_slots(trained, tmp_path):
    """Multi-valued (list<uint64>) slots sum their rows, raw strings are hashed as the converter
    hashes them (a null or empty string is the slot's missing key, as engine convert writes an empty
    field and training reads raw strings), null keys and lists and unknown keys add zeros."""
    from streaming import keys as K
    export_bundle(trained.source(), str(tmp_path / "b"))
    bundle = load_bundle(str(tmp_path / "b"))
    known = np.sort(next(trained.table.rows()).column("key").to_numpy())[:4]
    n = 3
    cols = {"dense": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(n * 13, np.float32)), 13)}
    for j, s in enumerate(bundle.slots):
        cols[s] = pa.array([K.missing_key(j + 1)] * n, pa.uint64())
    cols["C1"] = pa.array([[int(known[0]), int(known[1])], [], None], pa.list_(pa.uint64()))
    cols["C2"] = pa.array(["68fd1e64", None, ""], pa.string())
    rb = pa.RecordBatch.from_pydict(cols)
    got = bundle.predict(rb)
    # the same by hand: pooled rows through the model
    keys, cells, dense = bundle.inputs(rb)
    expect_c2 = K.hash_array(2, pa.array(["68fd1e64"]))[0]
    assert expect_c2 in keys[cells == 1]
    assert keys[cells == 26 + 1].tolist() == keys[cells == 52 + 1].tolist() == [K.missing_key(2)]
    assert (cells == 0).sum() == 2 and (cells % 26 == 0).sum() == 2
    emb = bundle.lookup(keys)
    ref = trained.model.predict(emb, np.arange(len(keys), dtype=np.int32), cells, dense)
    np.testing.assert_allclose(got, ref, atol=1e-6)


def test_predict_takes_dictionary_encoded_and_view_strings_as_the_strings_they_hold(trained, tmp_path):
    """A raw string slot written dictionary-encoded (pandas categoricals in Parquet) or as string views
    scores as the plain strings do, as training reads them (``streaming.keys.is_raw_strings``)."""
    from streaming import keys as K
    export_bundle(trained.source(), str(tmp_path / "b"))
    bundle = load_bundle(str(tmp_path / "b"))
    n = 4
    cols = {"dense": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(n * 13, np.float32)), 13)}
    for j, s in enumerate(bundle.slots):
        cols[s] = pa.array([K.missing_key(j + 1)] * n, pa.uint64())
    plain = pa.array(["68fd1e64", None, "", "68fd1e64"], pa.string())
    want = None
    for c2 in (plain, plain.dictionary_encode(), plain.cast(pa.string_view())):
        rb = pa.RecordBatch.from_pydict({**cols, "C2": c2})
        assert bundle.check_values(rb) is None
        got = bundle.predict(rb)
        want = got if want is None else want
        np.testing.assert_array_equal(got, want)
