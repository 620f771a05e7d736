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
from engine.programs.ctr_data import expected_schema, make_source, prepare_data
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

