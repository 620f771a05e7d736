"""Criteo converter: known values, gzip, malformed lines, the canonical split, the generator."""
from __future__ import annotations

import gzip
import json
import logging
import threading

import numpy as np
import pyarrow as pa
import pytest

from streaming import keys
from streaming.criteo import (SPARSE_COLUMNS, arrow_is_current, convert_criteo, criteo_schema,
                              generate_criteo)
from streaming.criteo_synth import roc_auc
from streaming.errors import DataFormatError
from streaming.source import ArrowSource


def line(label="0", ints=None, cats=None):
    ints = ints if ints is not None else [""] * 13
    cats = cats if cats is not None else [""] * 26
    return "\t".join([label, *ints, *cats])


def good(i):
    return line(str(i % 2), [str(i)] * 13, [f"{i:08x}"] * 26)


def read_all(out_dir) -> pa.Table:
    return pa.Table.from_batches(list(ArrowSource(str(out_dir), batch_size=1 << 20, prefetch=0)))


def write(path, lines, *, gz=False):
    text = "\n".join(lines) + "\n"
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.nojit
def test_known_values(tmp_path):
    ints = ["5", "-1", "", "0", "123456789012", "1", "2", "3", "4", "5", "6", "7", "-3"]
    cats = ["05db9164", ""] + [f"{j:08x}" for j in range(24)]
    src = write(tmp_path / "a.txt", [line("1", ints, cats), line("0")])
    rep = convert_criteo(src, tmp_path / "out", progress=False)
    assert (rep.lines, rep.rows, rep.bad_rows) == (2, 2, 0)
    t = read_all(tmp_path / "out")
    assert t.schema.equals(criteo_schema())
    assert t.column("label").to_pylist() == [1.0, 0.0]
    dense = np.array(t.column("dense").to_pylist(), dtype=np.float32)
    want = np.log1p(np.maximum([5, -1, 0, 0, 123456789012, 1, 2, 3, 4, 5, 6, 7, -3], 0)).astype(np.float32)
    np.testing.assert_allclose(dense[0], want, rtol=1e-6)
    np.testing.assert_array_equal(dense[1], np.zeros(13, np.float32))
    assert t.column("C1")[0].as_py() == keys.hash_value(1, "05db9164")
    assert t.column("C2")[0].as_py() == keys.missing_key(2)
    assert t.column("C26")[0].as_py() == keys.hash_value(26, f"{23:08x}")
    for j, c in enumerate(SPARSE_COLUMNS, start=1):
        assert t.column(c)[1].as_py() == keys.missing_key(j)
    meta = json.loads((tmp_path / "out" / "_meta.json").read_text())
    assert meta["rows"] == 2 and meta["hash_version"] == keys.HASH_VERSION
    assert arrow_is_current(src, tmp_path / "out")
    assert not arrow_is_current(src, tmp_path / "out", split="train")
    src.write_text(src.read_text() + good(3) + "\n")
    assert not arrow_is_current(src, tmp_path / "out")


@pytest.mark.nojit
def test_gzip_input_and_fixed_batches(tmp_path):
    lines = [good(i) for i in range(25)]
    plain = convert_criteo(write(tmp_path / "a.txt", lines), tmp_path / "p", batch_size=4,
                           rows_per_file=8, progress=False)
    gz = convert_criteo(write(tmp_path / "a.txt.gz", lines, gz=True), tmp_path / "g", batch_size=4,
                        rows_per_file=8, progress=False)
    assert plain.files == gz.files == [f"part-{i:05d}.arrow" for i in range(4)]
    assert read_all(tmp_path / "p").equals(read_all(tmp_path / "g"))
    sizes = [b.num_rows for f in plain.files
             for b in pa.ipc.open_stream(pa.memory_map(str(tmp_path / "p" / f)))]
    assert sizes == [4, 4, 4, 4, 4, 4, 1]


@pytest.mark.nojit
@pytest.mark.parametrize("bad_line, field", [
    (line("0")[:-3], "fields"),                      # 39 fields
    (line("0") + "\textra", "fields"),               # 41 fields
    ("", "label"),                                   # empty line (= 40 empty fields to pyarrow)
    (line("0", ["1", "x2"] + [""] * 11), "I2"),     # non-integer
    (line("0", ["1", "-"] + [""] * 11), "I2"),      # a lone sign
    (line("0", cats=["zz"] + [""] * 25), "C1"),     # non-hex
    (line("0", ["9" * 400] + [""] * 12), "I1"),     # an integer beyond float64 (its log1p was inf)
    (line("2"), "label"),
    (line(""), "label"),
])
def test_malformed_lines_skip_and_raise(tmp_path, bad_line, field, caplog):
    lines = [good(i) for i in range(10)]
    lines[6] = bad_line
    src = write(tmp_path / "a.txt", lines)
    with pytest.raises(DataFormatError) as ei:
        convert_criteo(src, tmp_path / "o1", progress=False)
    assert (ei.value.line, ei.value.field) == (7, field)
    assert f"a.txt:7: field {field}" in str(ei.value)
    assert not [t for t in threading.enumerate() if t.name == "criteo-csv"]  # reader thread stopped
    with caplog.at_level(logging.WARNING):
        rep = convert_criteo(src, tmp_path / "o2", max_bad_rows=1, progress=False)
    assert (rep.lines, rep.rows, rep.bad_rows) == (10, 9, 1)
    assert (rep.bad_examples[0].line, rep.bad_examples[0].field) == (7, field)
    assert "a.txt:7" in caplog.text
    # the canonical split still counts the malformed line: lines 0-based 4 and 9 are test rows
    rep = convert_criteo(src, tmp_path / "o3", split="test", max_bad_rows=None, progress=False)
    assert read_all(tmp_path / "o3").column("label").to_pylist() == [0.0, 1.0]


@pytest.mark.nojit
def test_integers_beyond_float64_are_malformed_not_infinite(tmp_path):
    """A 309-digit integer overflowed float64: ``inf`` was written and only a later reader failed, naming
    its cache or temporary file instead of the text line."""
    src = write(tmp_path / "huge_int.txt", [good(0), good(1), line("0", ["9" * 400] + ["7"] * 12), good(3),
                                            line("1", ["9" * 300, "-" + "9" * 400] + ["7"] * 11)])
    with pytest.raises(DataFormatError) as ei:
        convert_criteo(src, tmp_path / "o", progress=False)
    assert str(ei.value).startswith(f"{src}:3: field I1: expected an integer below 1.8e308 (its log1p must be "
                                    f"finite), got a 400-digit integer (999999999999...)")
    rep = convert_criteo(src, tmp_path / "o", max_bad_rows=1, progress=False)
    assert (rep.lines, rep.rows, rep.bad_rows) == (5, 4, 1)
    dense = np.stack(read_all(tmp_path / "o").column("dense").to_numpy(zero_copy_only=False))
    assert np.isfinite(dense).all()
    assert dense[3, 0] == np.float32(np.log1p(float("9" * 300))) and dense[3, 1] == 0   # finite; negative -> 0


def test_line_numbers_across_blocks_and_files(tmp_path):
    lines = [good(i) for i in range(3000)]
    bad = {0: "x", 999: line("0", cats=["g"] * 26), 1000: "", 1001: "a\tb", 2999: line("7")}
    for i, v in bad.items():
        lines[i] = v
    src = write(tmp_path / "a.txt", lines)
    src2 = write(tmp_path / "b.txt.gz", [good(i) for i in range(7)] + ["q"], gz=True)
    rep = convert_criteo([src, src2], tmp_path / "o", max_bad_rows=100, block_size=4096,
                         split="test", progress=False)
    assert [(b.path.rsplit("/", 1)[-1], b.line) for b in rep.bad_examples] == \
        [("a.txt", i + 1) for i in sorted(bad)] + [("b.txt.gz", 8)]
    assert rep.lines == 3008 and rep.bad_rows == 6
    labels = read_all(tmp_path / "o").column("label").to_numpy()
    want = [i % 2 for i in range(3000) if i % 5 == 4 and i not in bad]
    want += [i % 2 for i in range(7) if (3000 + i) % 5 == 4]
    np.testing.assert_array_equal(labels, np.array(want, np.float32))
    with pytest.raises(DataFormatError, match="max_bad_rows=5"):
        convert_criteo([src, src2], tmp_path / "o", max_bad_rows=5, block_size=4096, progress=False)


def test_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        convert_criteo(tmp_path / "nope.txt", tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="split"):
        convert_criteo(tmp_path / "nope.txt", tmp_path / "o", split="dev", progress=False)


def test_canonical_split_on_shared_data(shared_data, tmp_path):
    src = shared_data / "criteo" / "train.txt"
    train = convert_criteo(src, tmp_path / "train", split="train", progress=False)
    test = convert_criteo(src, tmp_path / "test", split="test", progress=False)
    assert (train.lines, train.rows, test.rows, train.bad_rows) == (20609, 16488, 4121, 0)
    t = read_all(tmp_path / "test")
    assert t.num_rows == 4121
    ctr = float(np.mean(read_all(tmp_path / "train").column("label").to_numpy()))
    assert 0.2 < ctr < 0.26
    slots = keys.key_slots(t.column("C7").to_numpy())
    assert (slots == 7).all()


def test_generator_roundtrip_and_planted_auc(tmp_path):
    g = generate_criteo(tmp_path / "gen.txt.gz", 3000, seed=3)
    g2 = generate_criteo(tmp_path / "gen2.txt", 3000, seed=3)
    assert gzip.open(g.path).read() == open(g2.path, "rb").read()
    assert 0.18 < g.ctr < 0.32 and 0.7 < g.planted_auc < 0.95
    rep = convert_criteo(g.path, tmp_path / "o", progress=False)
    assert (rep.rows, rep.bad_rows) == (3000, 0)
    t = read_all(tmp_path / "o")
    assert t.column("label").to_numpy().sum() == round(g.ctr * 3000)
    # some categoricals and dense values are missing, as in the real data
    assert sum(int((t.column(c).to_numpy() == keys.missing_key(j)).sum())
               for j, c in enumerate(SPARSE_COLUMNS, start=1)) > 0


def test_roc_auc_reference():
    y = np.array([0, 0, 1, 1, 0, 1])
    s = np.array([0.1, 0.4, 0.35, 0.8, 0.4, 0.4])
    pairs = [(sp > sn) + 0.5 * (sp == sn) for sp in s[y == 1] for sn in s[y == 0]]
    assert roc_auc(y, s) == pytest.approx(np.mean(pairs))
