"""``engine predict`` and ``engine eval`` on bad input: a clear one-line error naming the file, the row
and the column, exit 2, and an earlier ``--out`` file left as it was (no partial file beside it).

One small CTR-DNN (slots C1..C3, 13 dense features) is trained into an in-process PS cluster's tables by
hand, checkpointed (``snapshot_cluster``) and exported once per module; the inputs are Arrow files
written here: a good one and copies with one bad value (a null, NaN or infinite dense value, a null
label, a label of 7), truncated, empty or non-Arrow files, malformed Criteo text."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from engine.cli import main
from engine.config import DenseTableConfig
from engine.export import load_bundle, snapshot_cluster
from engine.ps import InProcessTransport, PSClient, PSServer
from models import build_model
from sparse_tables import TableConfig
from streaming import keys as K
from streaming.criteo import generate_criteo

REPO = Path(__file__).resolve().parents[2]
SLOTS = ["C1", "C2", "C3"]
N = 600              # rows of the good file, in record batches of 200
CONFIG = {"model": {"kind": "ctr_dnn", "slots": SLOTS, "dim": 4, "dense_dim": 13, "hidden": [8], "seed": 0,
                    "sparse_table": "embedding", "dense_table": "dense"}}


def _table(rows=N, seed=0, labels=True) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols = {}
    if labels:
        cols["label"] = pa.array((rng.random(rows) < 0.3).astype(np.float32))
    cols["dense"] = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * 13).astype(np.float32)), 13)
    for j, s in enumerate(SLOTS):
        cols[s] = pa.array(K.make_keys(j + 1, rng.integers(0, 50, rows)))
    return pa.table(cols)


def _write(path: Path, table: pa.Table, *, file_format=False) -> Path:
    with pa.OSFile(str(path), "wb") as f:
        w = ipc.new_file(f, table.schema) if file_format else ipc.new_stream(f, table.schema)
        w.write_table(table, max_chunksize=200)
        w.close()
    return path


def _with(table: pa.Table, name: str, row: int, value) -> pa.Table:
    """``table`` with row ``row`` of column ``name`` replaced by ``value`` (None for null)."""
    vals = table.column(name).to_pylist()
    vals[row] = value
    return table.set_column(table.schema.get_field_index(name), name, pa.array(vals, table.schema.field(name).type))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(bundle dir, checkpoint job root, good Arrow file, data dir)``."""
    d = tmp_path_factory.mktemp("predict_bad")
    m = build_model("ctr_dnn", num_slots=3, dim=4, dense_dim=13, hidden=(8,), seed=0)
    servers = [PSServer({"embedding": TableConfig(dim=m.sparse_width, optimizer="adagrad")},
                        {"dense": DenseTableConfig()}, index=0, num_servers=1, num_vshards=64, local_shards=1,
                        checkpoint_groups=2)]
    client = PSClient(InProcessTransport(servers))
    try:
        client.init_dense("dense", m.get_dense())
        good = _table()
        keys = np.unique(np.concatenate([good.column(s).to_numpy() for s in SLOTS]))
        client.push("embedding", keys, np.random.default_rng(1).normal(size=(len(keys), 4)).astype(np.float32),
                    shows=np.ones(len(keys), np.float32))
        snapshot_cluster(client, str(d / "ckpt"), "ctr", CONFIG)
    finally:
        client.close()
    assert main(["export", str(d / "ckpt" / "ctr"), str(d / "bundle")]) == 0
    return d / "bundle", d / "ckpt" / "ctr", _write(d / "good.arrow", good), d


def _predict(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["predict", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("engine ")]
    assert lines and "Traceback" not in err, err
    return lines[-1]


@pytest.mark.parametrize("column,row,value,expect", [
    ("dense", 450, None, "expected a list of 13 numbers, got null"),
    ("dense", 450, [0.5] * 5 + [float("nan")] + [0.5] * 7, "expected a finite number at position 5, got nan"),
    ("dense", 450, [0.5] * 12 + [float("inf")], "expected a finite number at position 12, got inf"),
    ("dense", 450, [0.5] * 3 + [None] + [0.5] * 9, "expected a number at position 3, got null"),
    ("label", 450, None, "expected a label, got null"),
    ("label", 450, 7.0, "expected a label in [0, 1], got 7.0"),
])
def test_bad_value_names_file_row_column_and_keeps_earlier_predictions(setup, tmp_path, capsys, column, row,
                                                                      value, expect):
    bundle, _, good, _ = setup
    out = tmp_path / "preds.arrow"
    assert _predict(capsys, bundle, good, "--out", out, "--batch-size", 128)[0] == 0
    before = out.read_bytes()
    bad = _write(tmp_path / "bad.arrow", _with(_table(), column, row, value))
    rc, stdout, err = _predict(capsys, bundle, bad, "--out", out, "--batch-size", 128)
    assert rc == 2 and stdout == ""
    line = _one_line_error(err)
    assert line == f"engine predict: {bad}: row {row + 1}: field {column}: {expect}"
    assert out.read_bytes() == before                        # earlier predictions untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.arrow", "preds.arrow"]   # no temporary left


def test_no_earlier_file_means_no_file_and_success_writes_every_row(setup, tmp_path, capsys):
    bundle, _, good, _ = setup
    out = tmp_path / "preds.arrow"
    bad = _write(tmp_path / "bad.arrow", _with(_table(labels=False), "dense", 0, None))   # the first batch fails
    assert _predict(capsys, bundle, bad, "--out", out)[0] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.arrow"]
    rc, stdout, _ = _predict(capsys, bundle, good, "--out", out, "--batch-size", 128)
    assert rc == 0 and json.loads(stdout.splitlines()[-1])["rows"] == N
    got = ipc.open_file(str(out)).read_all().column("prob").to_numpy()
    b = load_bundle(str(bundle))
    np.testing.assert_allclose(got, b.predict(_table()), atol=1e-6)
    assert _predict(capsys, bundle, good, "--out", tmp_path)[0] == 2        # a directory is not replaced
    assert tmp_path.is_dir()


def test_unreadable_files_name_file_and_batch(setup, tmp_path, capsys):
    bundle, _, good, _ = setup
    data = good.read_bytes()
    cases = {
        "empty.arrow": (b"", "row 1: field <file header>: expected an Arrow IPC file or stream, got an empty "
                             "file (0 bytes)"),
        "garbage.arrow": (b"this is not arrow at all\n" * 20, "row 1: field <file header>: expected an Arrow "
                                                               "IPC file or stream, got bytes pyarrow cannot read"),
        "cut.arrow": (data[:len(data) * 3 // 4], "row 401: field <record batch 2>: expected a complete record "
                                                 "batch, got one pyarrow cannot read"),
        "bad.parquet": (b"PAR1" + b"\0" * 64, "row 1: field <file header>: expected a Parquet file"),
    }
    file_fmt = _write(tmp_path / "f.arrow", _table(), file_format=True).read_bytes()
    cases["cutfile.arrow"] = (file_fmt[:len(file_fmt) - 100], "row 1: field <file header>: expected an Arrow IPC")
    for name, (content, expect) in cases.items():
        p = tmp_path / name
        p.write_bytes(content)
        rc, stdout, err = _predict(capsys, bundle, p)
        assert rc == 2 and stdout == "", (name, err)
        assert _one_line_error(err).startswith(f"engine predict: {p}: {expect}"), (name, err)


def test_a_directory_is_read_for_the_bundles_columns_only(setup, tmp_path, capsys):
    """The first file's whole schema was imposed on the others: a column only it has (``foo``, never read
    by the bundle) made the second file "missing" it."""
    bundle, _, _, _ = setup
    d = tmp_path / "d"
    d.mkdir()
    first = _table(seed=1)
    _write(d / "a.arrow", first.append_column("foo", pa.array(np.arange(N, dtype=np.int64))))
    _write(d / "b.arrow", _table(seed=2).select(["C3", "dense", "label", "C1", "C2"]))   # other column order
    rc, stdout, err = _predict(capsys, bundle, d, "--batch-size", 128)
    assert rc == 0, err
    res = json.loads(stdout.splitlines()[-1])
    assert res["rows"] == 2 * N and res["auc"] is not None
    b = load_bundle(str(bundle))
    both = pa.concat_tables([_table(seed=1), _table(seed=2)])
    from engine.metrics import BinaryMetrics
    m = BinaryMetrics()
    m.update(b.predict(both), both.column("label").to_numpy())
    assert res["auc"] == pytest.approx(m.summary()["auc"], abs=1e-12)


def test_a_later_file_of_another_hash_version_is_named(setup, tmp_path, capsys):
    """The first file's schema metadata was imposed on every batch, so a later file's hash_version was
    never seen: its keys were looked up as if hashed by the bundle's version."""
    bundle, _, _, _ = setup
    t = _table(seed=1)
    _write(tmp_path / "a.arrow", t.replace_schema_metadata({"hash_version": str(K.HASH_VERSION)}))
    _write(tmp_path / "b.arrow", t.replace_schema_metadata({"hash_version": str(K.HASH_VERSION + 1)}))
    rc, stdout, err = _predict(capsys, bundle, tmp_path)
    assert rc == 2 and stdout == ""
    assert _one_line_error(err).startswith(f"engine predict: {tmp_path / 'b.arrow'}: input keys use hash_version "
                                           f"{K.HASH_VERSION + 1}, bundle ")


@pytest.mark.parametrize("labelled_first", [True, False])
def test_a_directory_mixing_labelled_and_unlabelled_files_is_refused(setup, tmp_path, capsys, labelled_first):
    """Unlabelled first: the later file's labels were dropped and the run ended 0 without metrics;
    labelled first: a "missing column" error. Now one line naming a file of each kind, before any row is
    scored: metrics over part of the rows would pass for metrics over all of them."""
    bundle, _, _, _ = setup
    names = ("a.arrow", "b.arrow") if labelled_first else ("b.arrow", "a.arrow")
    _write(tmp_path / names[0], _table(seed=1))
    _write(tmp_path / names[1], _table(seed=2, labels=False))
    rc, stdout, err = _predict(capsys, bundle, tmp_path)
    assert rc == 2 and stdout == ""
    assert _one_line_error(err) == (
        f"engine predict: {tmp_path}: 1 of its 2 files has a 'label' column (e.g. {tmp_path / names[0]}) and the "
        f"others do not (e.g. {tmp_path / names[1]}): the metrics would cover only part of the rows; score the "
        f"labelled and the unlabelled files separately, or give every file its 'label' column")


def test_a_stream_cut_at_a_batch_boundary_is_refused(setup, tmp_path, capsys):
    """A stream whose writer was killed between two batches was scored as a shorter file (400 of 600
    rows, exit 0)."""
    bundle, _, good, _ = setup
    with pa.OSFile(str(good)) as f:
        r = ipc.open_stream(f)
        r.read_next_batch()
        r.read_next_batch()
        end = f.tell()
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(good.read_bytes()[:end])
    rc, stdout, err = _predict(capsys, bundle, cut)
    assert rc == 2 and stdout == ""
    assert _one_line_error(err).startswith(
        f"engine predict: {cut}: row 401: field <record batch 2>: expected another record batch or the Arrow "
        f"IPC end-of-stream marker after 400 rows in 2 complete record batches, got the end of the input")


def test_null_slot_values_and_list_elements_are_no_key(setup):
    """Documented: a null key, a null list and a null element of a list mean no key (zeros pooled). A
    null element used to become a garbage key (float NaN cast to uint64) and round every other key of
    the column to float64; now the example scores as without it, and keys above 2**53 survive."""
    bundle = load_bundle(str(setup[0]))
    t = _table(rows=4, labels=False)
    big = int(K.make_keys(40, [123456789])[0])          # > 2**53: float64 would round it
    c1 = t.column("C1").to_pylist()
    lists = pa.array([[c1[0], None], [None], None, [big, c1[3]]], pa.list_(pa.uint64()))
    plain = pa.array([[c1[0]], [], [], [big, c1[3]]], pa.list_(pa.uint64()))
    nulls = pa.array([c1[0], None, None, c1[3]], pa.uint64())
    with_lists = t.set_column(t.schema.get_field_index("C1"), "C1", lists)
    keys, cells, _ = bundle.inputs(with_lists.combine_chunks().to_batches()[0])
    assert big in keys.tolist() and (keys[cells % 3 == 0] < 2**63).all()
    got = bundle.predict(with_lists)
    np.testing.assert_array_equal(got, bundle.predict(t.set_column(t.schema.get_field_index("C1"), "C1", plain)))
    np.testing.assert_array_equal(got[:3], bundle.predict(t.set_column(t.schema.get_field_index("C1"), "C1",
                                                                       nulls))[:3])


def test_criteo_text_fails_on_first_malformed_line_unless_allowed(setup, tmp_path, capsys, caplog):
    bundle = setup[0]
    text = tmp_path / "c.txt"
    generate_criteo(text, rows=50, seed=2)
    lines = text.read_text().splitlines(keepends=True)
    f = lines[9].split("\t")
    f[3] = "1.5"                                          # I3 of line 10
    lines[9] = "\t".join(f)
    text.write_text("".join(lines))
    out = tmp_path / "p.arrow"
    rc, stdout, err = _predict(capsys, bundle, text, "--out", out)
    assert rc == 2 and not out.exists()
    assert _one_line_error(err).startswith(f"engine predict: {text}:10: field I3: expected an integer, got '1.5'")
    rc, stdout, err = _predict(capsys, bundle, text, "--out", out, "--max-bad-rows", 1)
    res = json.loads(stdout.splitlines()[-1])
    assert rc == 0 and res["rows"] == 49 and res["skipped_lines"] == 1
    assert any("predictions no longer line up" in r.getMessage() for r in caplog.records
               if r.levelname == "WARNING" and r.name == "engine.export")
    assert len(ipc.open_file(str(out)).read_all()) == 49


def test_criteo_text_that_cannot_be_read_is_one_line(setup, tmp_path, capsys):
    """A line that is not UTF-8 (or a truncated gzip) raised ConvertError, which predict did not catch: a
    traceback, exit 1."""
    bundle = setup[0]
    text = tmp_path / "c.txt"
    generate_criteo(text, rows=5, seed=2)
    text.write_bytes(text.read_bytes() + b"\xff\xfe garbage\n")
    out = tmp_path / "p.arrow"
    rc, _, err = _predict(capsys, bundle, text, "--out", out)
    assert rc == 2 and not out.exists()
    assert _one_line_error(err) == (f"engine predict: {text}: line 6: not UTF-8 text (a binary file?), and 1 "
                                    f"tab-separated fields where 40 are expected")
    gz = tmp_path / "t.txt.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00garbage")
    rc, _, err = _predict(capsys, bundle, gz)
    assert rc == 2 and "truncated gzip data" in _one_line_error(err)


def test_bundle_of_another_hash_version_is_refused_at_load(setup, tmp_path, capsys):
    from engine.export import RowBatchSource, describe_model, export_bundle
    m = build_model("ctr_dnn", num_slots=3, dim=4, dense_dim=13, hidden=(8,), seed=0)
    rows = pa.RecordBatch.from_arrays(
        [pa.array([1, 2], pa.uint64()), pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8, np.float32)), 4)],
        names=["key", "values"])
    export_bundle(RowBatchSource(describe_model(m, SLOTS, hash_version=K.HASH_VERSION + 1), m.get_dense(), [rows],
                                 "memory://test"), str(tmp_path / "b"))
    rc, _, err = _predict(capsys, tmp_path / "b", setup[2])
    assert rc == 2
    assert (f"the bundle was written with hash_version {K.HASH_VERSION + 1} and this engine hashes with version "
            f"{K.HASH_VERSION}") in _one_line_error(err)


def test_export_over_a_published_bundle_names_the_cli_flag(setup, capsys):
    bundle, ckpt, _, _ = setup
    assert main(["export", str(ckpt), str(bundle)]) == 2
    assert _one_line_error(capsys.readouterr().err) == (f"engine export: {bundle}: already published; pass "
                                                        f"--overwrite to replace it")


def eval_config_text(d: Path, train_path, test_path, kind: str = "ctr_dnn", hidden: str = "[8]") -> str:
    """The YAML of an ``engine eval`` config of a ``kind`` model (slots C1-C3, dim 4, ``hidden`` layers)
    scoring ``test_path``: checkpoints under ``d/ckpt`` (job ``ctr``), metrics in ``d/metrics``, no
    TensorBoard. Tests prepend what else they need (a storage section)."""
    return f"""
mode: async
cluster: {{servers: 1, workers: 1}}
checkpoint: {{root: {d / 'ckpt'}, job: ctr}}
observability: {{tensorboard: false}}
tables:
  sparse:
    embedding: {{dim: 4, optimizer: adagrad, learning_rate: 0.05}}
  dense:
    dense: {{optimizer: adam, learning_rate: 0.001}}
model:
  kind: {kind}
  slots: [C1, C2, C3]
  dim: 4
  hidden: {hidden}
  metrics_dir: {d / 'metrics'}
  data:
    source: arrow
    train_path: {train_path}
    test_path: {test_path}
"""


def _eval_config(d: Path, test_path: Path, kind: str = "ctr_dnn", hidden: str = "[8]") -> Path:
    """An ``engine eval`` config of a ``kind`` model with ``hidden`` layers scoring ``test_path``."""
    cfg = d / f"eval-{test_path.stem}-{kind}-{len(hidden)}.yaml"
    cfg.write_text(eval_config_text(d, test_path, test_path, kind, hidden))
    return cfg


def test_eval_of_a_ctr_config_refuses_a_vocab_in_one_line(setup, tmp_path, capsys):
    """``--vocab`` names a word2vec model's vocabulary: with a CTR config it is refused before anything is
    read, exit 2, naming the model kind."""
    _, ckpt, good, _ = setup
    code = main(["eval", str(_eval_config(tmp_path, good)), "--checkpoint", str(ckpt), "--vocab", str(good)])
    cap = capsys.readouterr()
    assert code == 2 and cap.out == ""
    assert _one_line_error(cap.err) == ("engine eval: --vocab names a word2vec model's vocabulary; model.kind is "
                                        "'ctr_dnn'")


def test_eval_refuses_null_label_and_truncated_file(setup, tmp_path, capsys):
    _, ckpt, good, d = setup
    assert main(["eval", str(_eval_config(tmp_path, good)), "--checkpoint", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["rows"] == N
    bad = _write(tmp_path / "nolabel.arrow", _with(_table(), "label", 321, None))
    assert main(["eval", str(_eval_config(tmp_path, bad)), "--checkpoint", str(ckpt)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert _one_line_error(cap.err) == f"engine eval: {bad}: row 322: field label: expected a label, got null"
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(good.read_bytes()[:-500])
    assert main(["eval", str(_eval_config(tmp_path, cut)), "--checkpoint", str(ckpt)]) == 2
    assert _one_line_error(capsys.readouterr().err).startswith(f"engine eval: {cut}: row 401: field <record batch 2>")


def test_real_process_exit_2_one_line_and_old_file_kept(setup, tmp_path):
    bundle, _, good, _ = setup
    out = tmp_path / "preds.arrow"
    out.write_bytes(b"earlier predictions")
    bad = _write(tmp_path / "bad.arrow", _with(_table(labels=False), "dense", 599, [float("nan")] * 13))
    res = subprocess.run([sys.executable, "-m", "engine", "predict", str(bundle), str(bad), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (f"engine predict: {bad}: row 600: field dense: expected a "
                                                  f"finite number at position 0, got nan")
    assert out.read_bytes() == b"earlier predictions"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.arrow", "preds.arrow"]


def test_partial_predictions_of_a_killed_run_are_removed_by_the_next(setup, tmp_path, capsys):
    """``engine predict`` killed with SIGKILL runs no handler: its temporary stays beside ``--out``. The
    next run for that ``--out`` on this host removes it (its process is gone)."""
    from tests.waiting import killed_after_first_line
    bundle, _, good, _ = setup
    out = tmp_path / "preds.arrow"
    code = ("import time, numpy as np\nfrom engine.export.cli import _PredictionsFile\n"
            f"f = _PredictionsFile({str(out)!r})\nf.write(np.zeros(8, np.float32))\nprint(f.tmp, flush=True)\n"
            "time.sleep(60)\n")
    tmp = killed_after_first_line(code, REPO)
    assert tmp and sorted(p.name for p in tmp_path.iterdir()) == [tmp]
    rc, stdout, _ = _predict(capsys, bundle, good, "--out", out)
    assert rc == 0 and json.loads(stdout.splitlines()[-1])["rows"] == N
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.arrow"]

