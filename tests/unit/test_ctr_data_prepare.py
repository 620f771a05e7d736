"""The launcher's data checks of the CTR programs (``ctr_data.prepare_data``, ``ctr.prepare``) on real
files: what a user set is what an error names, and every input is checked before any process starts."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.errors import ConfigError
from engine.program_configs import DataConfig
from engine.programs.ctr_data import expected_schema, make_source, prepare_data, prepare_listed
from streaming import keys
from streaming.criteo import SLOT_IDS, convert_criteo, generate_criteo
from streaming.errors import DataFormatError, SchemaError

REPO = Path(__file__).resolve().parents[2]

SLOTS = ["C1", "C2"]
SCHEMA = expected_schema(SLOTS, 13)


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """A 40-line Criteo file and its two Arrow splits."""
    d = tmp_path_factory.mktemp("criteo")
    generate_criteo(d / "rows.txt", 40, 1)
    convert_criteo([d / "rows.txt"], d / "train", split="train", batch_size=8)
    convert_criteo([d / "rows.txt"], d / "test", split="test", batch_size=8)
    return d


@pytest.mark.parametrize("key", ["train_path", "test_path"])
def test_stdin_as_a_split_is_a_config_error_naming_the_key(criteo, key):
    """'-' (stdin) was resolved to ./- and ended in a launcher traceback, exit 1."""
    paths = {"train_path": str(criteo / "train"), "test_path": str(criteo / "test"), key: "-"}
    with pytest.raises(ConfigError, match=rf"^model\.data\.{key}: '-' \(stdin\) cannot be a split of a CTR job"):
        prepare_data(DataConfig(source="arrow", **paths), SCHEMA)


def test_a_criteo_file_without_test_rows_names_the_file_not_the_cache(tmp_path):
    """4 lines give no test row (line i is a test row when i % 5 == 4): the error named
    model.data.test_path and a directory under the cache, neither of which the user set."""
    text = tmp_path / "four.txt"
    generate_criteo(text, 4, 1)
    cfg = DataConfig(source="criteo", criteo_path=str(text), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as e:
        prepare_data(cfg, SCHEMA)
    assert str(e.value).startswith(f"model.data.criteo_path: {text} has no test row (the canonical split makes "
                                   f"line i a test row when i % 5 == 4"), str(e.value)
    assert "cache" not in str(e.value) and "test_path" not in str(e.value)
    generate_criteo(text, 5, 1)                                    # one test row: accepted
    out = prepare_data(cfg, SCHEMA)
    assert out.source == "arrow" and out.test_path.startswith(str(tmp_path / "cache"))


def test_a_split_not_asked_for_is_neither_converted_listed_nor_checked(criteo, tmp_path):
    """``prepare_listed(..., splits=("test",))``, as ``engine eval`` asks: a Criteo file's test split alone is
    converted (no train directory in the cache), and an Arrow train path that does not exist refuses nothing
    and is kept as configured; asked for both, as ``engine train`` does, it is refused as before."""
    cfg = DataConfig(source="criteo", criteo_path=str(criteo / "rows.txt"), cache_dir=str(tmp_path / "cache"))
    out, listed = prepare_listed(cfg, SCHEMA, splits=("test",))
    assert list(listed) == ["test"] and Path(out.test_path).name == "test" and out.train_path == cfg.train_path
    assert sorted(p.name for p in Path(out.test_path).parent.iterdir()) == ["test"]
    assert sum(1 for _ in make_source(listed["test"][0], batch_size=64, schema=SCHEMA, rank=0, num_workers=1,
                                      prefetch=0).batches(0)) >= 1
    arrow = DataConfig(source="arrow", train_path=str(tmp_path / "nowhere"), test_path=str(criteo / "test"))
    out, listed = prepare_listed(arrow, SCHEMA, splits=("test",))
    assert list(listed) == ["test"] and out.train_path == str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"^model\.data\.train_path: "):
        prepare_listed(arrow, SCHEMA)


def _write(path, table, chunk=8):
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=chunk)


def _read(d):
    return pa.concat_tables(pa.ipc.open_stream(str(f)).read_all() for f in sorted(d.glob("*.arrow")))


def test_every_inputs_schema_is_checked_not_the_first_only(criteo, tmp_path):
    """The second file of a split lacks C2: only the first was checked, so the launcher started the job."""
    t = _read(criteo / "test")
    _write(tmp_path / "test" / "part-0.arrow", t)
    _write(tmp_path / "test" / "part-1.arrow", t.drop_columns(["C2"]))
    cfg = DataConfig(source="arrow", train_path=str(criteo / "train"), test_path=str(tmp_path / "test"))
    with pytest.raises(SchemaError) as e:
        prepare_data(cfg, SCHEMA)
    assert str(e.value).startswith(f"column 'C2': expected uint64, but the column is missing (file "
                                   f"{tmp_path / 'test' / 'part-1.arrow'}")


def test_a_train_file_cut_between_two_record_batches_is_refused_before_any_process_starts(criteo, tmp_path):
    """The second file of the train split lost its last record batches and its end-of-stream marker (its
    writer killed between two batches): the launcher names it; read, it was a complete, shorter file."""
    t = _read(criteo / "train")
    _write(tmp_path / "train" / "part-0.arrow", t)
    cut = tmp_path / "train" / "part-1.arrow"
    _write(cut, t.slice(0, 32))
    with open(cut, "r+b") as f:       # drop the 8-byte marker: the file ends right after batch 3
        f.truncate(os.path.getsize(cut) - 8)
    cfg = DataConfig(source="arrow", train_path=str(tmp_path / "train"), test_path=str(criteo / "test"))
    with pytest.raises(DataFormatError) as e:
        prepare_data(cfg, SCHEMA)
    assert str(cut) in str(e.value) and "end-of-stream marker" in str(e.value)


def _strings(table, text_rows):
    """``table`` with C1 and C2 as the raw Criteo strings they were hashed from."""
    for name in SLOTS:
        j = SLOT_IDS[name]
        table = table.set_column(table.schema.get_field_index(name), name,
                                 pa.array([r.split("\t")[13 + j] for r in text_rows]))
    return table


def test_raw_string_slots_are_hashed_as_engine_predict_hashes_them(criteo, tmp_path):
    """DESIGN: a slot column may hold raw strings that the reader hashes; engine train refused them
    (SchemaError) while engine predict took them. Read as training reads them, they are the keys
    ``engine convert`` writes and ``keys.hash_array(slot id, ..., empty_is_missing=True)`` gives, the
    function and slot ids the predictor hashes a bundle's raw string column with."""
    lines = (criteo / "rows.txt").read_text().splitlines()
    train_lines = [line for i, line in enumerate(lines) if i % 5 != 4]
    converted = _read(criteo / "train")
    raw = _strings(converted, train_lines)
    assert raw.schema.field("C1").type == pa.string() and "" in raw.column("C2").to_pylist()   # missing values
    _write(tmp_path / "train" / "part-0.arrow", raw)
    cfg = DataConfig(source="arrow", train_path=str(tmp_path / "train"), test_path=str(criteo / "test"))
    prepare_data(cfg, SCHEMA)                                     # the schema check takes strings
    src = make_source(str(tmp_path / "train"), batch_size=16, schema=SCHEMA, rank=0, num_workers=1, prefetch=0)
    got = pa.Table.from_batches(list(src.batches(0)))
    for name in SLOTS:
        assert got.column(name).type == pa.uint64()
        np.testing.assert_array_equal(got.column(name).to_numpy(), converted.column(name).to_numpy())
        np.testing.assert_array_equal(
            got.column(name).to_numpy(), keys.hash_array(SLOT_IDS[name], raw.column(name), empty_is_missing=True))


def _prepare(tmp_path, train, test, monkeypatch, *sets):
    """``engine.programs.ctr.prepare`` (the launcher's hook, before any process starts) of ctr.yaml."""
    from engine.config import load_config
    from engine.programs import ctr
    for var in ctr.BLAS_ENV:                   # prepare sets them for the children: not in this process
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    cfg = load_config(REPO / "configs" / "ctr.yaml", [
        "model.data.source=arrow", f"model.data.train_path={train}", f"model.data.test_path={test}",
        "model.slots=[C1, C2]", f"model.metrics_dir={tmp_path / 'metrics'}", f"checkpoint.root={tmp_path / 'ckpt'}",
        *sets])
    return ctr.prepare(cfg)


def _bad_test_split(criteo, tmp_path, case):
    """The test split with a user id column and one bad value at row 7 of its second file (1-based)."""
    t = _read(criteo / "test")
    n = t.num_rows
    users = pa.array(np.arange(n) % 3, pa.int64())
    where = np.arange(n) == 6
    if case == "null-int-group":
        users = pa.array(np.arange(n) % 3, pa.int64(), mask=where)
    elif case == "null-string-group":
        users = pa.array([None if w else f"u{i % 3}" for i, w in enumerate(where)], pa.string())
    elif case == "nan-label":
        t = t.set_column(0, "label", pa.array(np.where(where, np.nan, t.column("label").to_numpy()), pa.float32()))
    elif case == "nan-dense":
        d = t.column("dense").combine_chunks().values.to_numpy().reshape(n, 13).copy()
        d[6, 3] = np.nan
        t = t.set_column(1, t.schema.field("dense"), pa.FixedSizeListArray.from_arrays(pa.array(d.ravel()), 13))
    elif case == "null-key":
        t = t.set_column(t.schema.get_field_index("C1"), "C1",
                         pa.array(t.column("C1").to_numpy(), pa.uint64(), mask=where))
    t = t.append_column("user", users)
    d = tmp_path / "test"
    clean = pa.array([f"u{i % 3}" for i in range(n)]) if case == "null-string-group" else pa.array(np.arange(n) % 3)
    _write(d / "part-0.arrow", _read(criteo / "test").append_column("user", clean))
    _write(d / "part-1.arrow", t, chunk=4)
    return d


@pytest.mark.parametrize("case, column, reason", [
    ("nan-label", "label", "expected a label in [0, 1], got nan"),
    ("nan-dense", "dense", "expected a finite number at position 3, got nan"),
    ("null-key", "C1", "expected a key, got null"),
    ("null-int-group", "user", "expected a group id (model.data.group_column), got null"),
    ("null-string-group", "user", "expected a group id (model.data.group_column), got null"),
])
def test_the_launcher_checks_every_value_of_the_test_split_before_any_process_starts(
        criteo, tmp_path, monkeypatch, case, column, reason):
    """Bad test values were found after training (a NaN dense value was even scored, exit 0; a null group
    id a ValueError naming the directory, exit 1 and restarted); the launcher read the train labels only."""
    test = _bad_test_split(criteo, tmp_path, case)
    with pytest.raises(DataFormatError) as e:
        _prepare(tmp_path, criteo / "train", test, monkeypatch, "model.data.group_column=user")
    assert str(e.value).startswith(f"{test / 'part-1.arrow'}: row 7: field {column}: {reason}"), str(e.value)
    if case.endswith("group"):
        return
    with pytest.raises(DataFormatError, match=rf"part-1.arrow: row 7: field {column}"):   # without grouping
        _prepare(tmp_path, criteo / "train", test, monkeypatch)


def test_a_clean_test_split_passes_the_launchers_check(criteo, tmp_path, monkeypatch, caplog):
    test = _bad_test_split(criteo, tmp_path, "none")
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr"):
        cfg = _prepare(tmp_path, criteo / "train", test, monkeypatch, "model.data.group_column=user")
    rows = 2 * _read(criteo / "test").num_rows
    assert cfg.model.params.data.test_path == str(test)
    assert any(f"test split {test}: {rows} rows (values checked)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("form", ["dictionary", "string_view", "large_string"])
def test_raw_string_slots_in_other_arrow_forms_give_the_same_keys(form, criteo, tmp_path):
    """pandas writes a categorical column to Parquet as dictionary-encoded strings, newer writers
    string views: the same strings, so the same keys. Before, both were refused ('expected uint64, got
    dictionary<values=string, ...>'), and the message did not say raw strings were taken."""
    import pyarrow.parquet as pq
    lines = (criteo / "rows.txt").read_text().splitlines()
    converted = _read(criteo / "train")
    raw = _strings(converted, [line for i, line in enumerate(lines) if i % 5 != 4])
    cast = {"dictionary": lambda c: c.dictionary_encode(), "string_view": lambda c: c.cast(pa.string_view()),
            "large_string": lambda c: c.cast(pa.large_string())}[form]
    for name in SLOTS:
        raw = raw.set_column(raw.schema.get_field_index(name), name, cast(raw.column(name)))
    (tmp_path / "train").mkdir()
    if form == "string_view":
        _write(tmp_path / "train" / "part-0.arrow", raw)
    else:
        pq.write_table(raw, str(tmp_path / "train" / "part-0.parquet"))
    prepare_data(DataConfig(source="arrow", train_path=str(tmp_path / "train"), test_path=str(criteo / "test")),
                 SCHEMA)
    src = make_source(str(tmp_path / "train"), batch_size=16, schema=SCHEMA, rank=0, num_workers=1, prefetch=0)
    got = pa.Table.from_batches(list(src.batches(0)))
    for name in SLOTS:
        np.testing.assert_array_equal(got.column(name).to_numpy(), converted.column(name).to_numpy())


def test_a_slot_of_another_type_is_refused_saying_what_a_slot_takes(criteo, tmp_path):
    """int64 ids (Spark has no uint64) are neither keys nor strings: one line naming the file and the
    column, and what the column may hold; never silently re-read as other keys."""
    t = _read(criteo / "train")
    t = t.set_column(t.schema.get_field_index("C1"), "C1", t.column("C1").cast(pa.int64(), safe=False))
    _write(tmp_path / "train" / "part-0.arrow", t)
    with pytest.raises(SchemaError) as e:
        prepare_data(DataConfig(source="arrow", train_path=str(tmp_path / "train"), test_path=str(criteo / "test")),
                     SCHEMA)
    assert str(e.value) == (f"column 'C1': expected uint64 keys or raw strings (string, large_string, binary, "
                            f"large_binary, their views, or dictionary-encoded), got int64 (file "
                            f"{tmp_path / 'train' / 'part-0.arrow'})")


@pytest.mark.parametrize("label_type", [pa.int64(), pa.bool_(), pa.float64(), pa.int8()])
def test_labels_and_dense_values_of_other_numeric_types_are_read_as_float32(label_type, criteo, tmp_path):
    """Spark and pandas write 0/1 clicks as int64 (or bool) and features as double: read as the float32
    the models compute in, the same values (before: 'expected float, got int64', and the user had to
    rewrite every file). A double beyond float32's range is an infinity there, refused naming its row."""
    t = _read(criteo / "train")
    want_labels, want_dense = t.column("label").to_numpy(), t.column("dense").combine_chunks().flatten().to_numpy()
    t = t.set_column(0, "label", t.column("label").cast(label_type))
    dense = pa.FixedSizeListArray.from_arrays(pa.array(want_dense.astype(np.float64)), 13)
    t = t.set_column(t.schema.get_field_index("dense"), "dense", dense)
    _write(tmp_path / "train" / "part-0.arrow", t)
    cfg = DataConfig(source="arrow", train_path=str(tmp_path / "train"), test_path=str(criteo / "test"))
    prepare_data(cfg, SCHEMA)
    src = make_source(str(tmp_path / "train"), batch_size=16, schema=SCHEMA, rank=0, num_workers=1, prefetch=0)
    got = pa.Table.from_batches(list(src.batches(0)))
    assert got.schema.field("label").type == pa.float32()
    np.testing.assert_array_equal(got.column("label").to_numpy(), want_labels)
    np.testing.assert_array_equal(got.column("dense").combine_chunks().flatten().to_numpy(), want_dense)
    big = want_dense.astype(np.float64)
    big[5 * 13 + 2] = 1e300
    _write(tmp_path / "train" / "part-0.arrow", t.set_column(t.schema.get_field_index("dense"), "dense",
                                                             pa.FixedSizeListArray.from_arrays(pa.array(big), 13)))
    src = make_source(str(tmp_path / "train"), batch_size=16, schema=SCHEMA, rank=0, num_workers=1, prefetch=0)
    with pytest.raises(DataFormatError, match=r"part-0.arrow: row 6: field dense: expected a finite number at "
                                              r"position 2, got inf"):
        list(src.batches(0))


def test_files_a_directory_holds_but_are_not_read_are_named(criteo, tmp_path, caplog):
    """``part-00001`` (Hadoop's names have no suffix) and ``part-00002.ARROW`` are Arrow files the reader
    leaves out for their names: before, the job trained on the rest without a word. Markers and
    temporary files (``_SUCCESS``, ``.part-0.crc``) are left out silently, as they should be."""
    t = _read(criteo / "train")
    train = tmp_path / "train"
    for name in ("part-00000.arrow", "part-00001", "part-00002.ARROW", "_SUCCESS", ".part-00000.arrow.crc"):
        _write(train / name, t)
    cfg = DataConfig(source="arrow", train_path=str(train), test_path=str(criteo / "test"))
    with caplog.at_level(logging.WARNING, logger="engine.programs.ctr_data"):
        prepare_data(cfg, SCHEMA)
    assert [r.getMessage() for r in caplog.records] == [
        f"model.data.train_path: 2 file(s) of {train} are not read, their names lacking a data suffix (.arrow "
        f".arrows .ipc .feather .parquet .pq; names starting with _ or . are skipped as markers and temporary "
        f"files): part-00001, part-00002.ARROW"]
