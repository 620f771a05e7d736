"""Failures that lose nothing: ``--format word2vec`` writes a temporary beside OUT and renames it over
(an existing OUT needs ``overwrite``; a kill leaves the old file whole), ``Bundle.apply_delta`` reads the
whole delta before changing anything (a damaged delta leaves the bundle as it was and can be applied once
repaired), and bundle retention leaves an incomplete bundle written to within ``INCOMPLETE_GRACE_S``
alone (an export in flight)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import hdfs_io
from engine.export import RowBatchSource, describe_model, export_bundle, load_bundle
from engine.export.retention import prune_bundles
from engine.export.w2v import export_word2vec
from models import build_model
from tests.unit.test_export_w2v import _src, _vocab
from tests.waiting import killed_after_first_line

REPO = Path(__file__).resolve().parents[2]
SLOTS = ["C1", "C2", "C3"]
MODEL = build_model("ctr_dnn", num_slots=3, dim=4, dense_dim=2, hidden=(8,), seed=1)


def test_word2vec_needs_overwrite_and_never_replaces_a_directory(tmp_path):
    vocab = _vocab(tmp_path / "vocab.arrow", ["the", "of", "and", "cat"])
    out = tmp_path / "vectors.txt"
    out.write_text("PRECIOUS existing file\n")
    src = _src([2, 0, 1], np.ones((3, 3), np.float32))
    with pytest.raises(FileExistsError) as e:
        export_word2vec(src, str(out), vocab=str(vocab))
    assert e.value.filename == str(out) and out.read_text() == "PRECIOUS existing file\n"
    from engine.export import ExportError
    (tmp_path / "adir").mkdir()
    with pytest.raises(ExportError, match="exists and is a directory"):
        export_word2vec(src, str(tmp_path / "adir"), vocab=str(vocab), overwrite=True)
    res = export_word2vec(src, str(out), vocab=str(vocab), overwrite=True)
    assert res["words"] == 4 and out.read_text().splitlines()[0] == "4 3"
    assert sorted(os.listdir(tmp_path)) == ["adir", "vectors.txt", "vocab.arrow"]     # no temporary left


def test_word2vec_killed_mid_write_leaves_the_old_file_whole(tmp_path):
    vocab = _vocab(tmp_path / "vocab.arrow", ["the", "of", "and", "cat"])
    out = tmp_path / "vectors.txt"
    out.write_text("PRECIOUS existing file\n")
    code = ("import sys, time, numpy as np\nimport hdfs_io.checksum as C\norig = C.ChecksumWriter.write\n"
            "def slow(self, b):\n    print('writing', flush=True)\n    time.sleep(60)\n    return orig(self, b)\n"
            "C.ChecksumWriter.write = slow\nfrom tests.unit.test_export_w2v import _src\n"
            "from engine.export.w2v import export_word2vec\n"
            f"export_word2vec(_src([2, 0, 1], np.ones((3, 3), np.float32)), {str(out)!r}, vocab={str(vocab)!r}, "
            "overwrite=True)\n")
    assert killed_after_first_line(code, REPO) == "writing"
    assert out.read_text() == "PRECIOUS existing file\n"            # not truncated: written elsewhere
    left = [n for n in os.listdir(tmp_path) if n.startswith(".vectors.txt.tmp-")]
    assert len(left) == 1
    export_word2vec(_src([2, 0, 1], np.ones((3, 3), np.float32)), str(out), vocab=str(vocab), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["vectors.txt", "vocab.arrow"]          # the dead one's removed
    assert out.read_text().splitlines()[0] == "4 3"


def _export(out: Path, step: int, since: Path | None = None, dense=None) -> dict:
    keys = np.arange(1, 401, dtype=np.uint64) + (50 if step else 0)
    vals = np.full((400, 4), float(step), np.float32)
    rows = pa.RecordBatch.from_arrays(
        [pa.array(keys), pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1)), 4)], names=["key", "values"])
    d = MODEL.get_dense() + step if dense is None else dense
    return export_bundle(RowBatchSource(describe_model(MODEL, SLOTS), d, [rows], "memory://t"), str(out),
                         groups=4, since=None if since is None else str(since))


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


def test_a_failed_apply_delta_leaves_the_bundle_as_it_was(tmp_path):
    """Before, the rows were replaced before ``dense.npz`` was read: a damaged one left new rows behind the
    old index (wrong lookups) and the retry, once repaired, ended in IndexError."""
    damaged = "dense.npz"
    _export(tmp_path / "b0", 0)
    _export(tmp_path / "d1", 1, since=tmp_path / "b0")
    ref = load_bundle(str(tmp_path / "d1"))                  # the chain b0 -> d1, intact
    shutil.copytree(tmp_path / "d1", tmp_path / "bad")
    good = (tmp_path / "bad" / damaged).read_bytes()
    _flip(tmp_path / "bad" / damaged)
    b = load_bundle(str(tmp_path / "b0"))
    keys0, vals0 = (a.copy() for a in b.state())
    dense0, id0, probe = b.model.get_dense().copy(), b.export_id, np.arange(0, 500, dtype=np.uint64)
    looked0 = b.lookup(probe)
    with pytest.raises(hdfs_io.CheckpointCorruptError, match="crc32"):
        b.apply_delta(str(tmp_path / "bad"))
    k, v = b.state()
    np.testing.assert_array_equal(k, keys0)
    np.testing.assert_array_equal(v, vals0)
    np.testing.assert_array_equal(b.lookup(probe), looked0)                # index and rows agree
    np.testing.assert_array_equal(b.model.get_dense(), dense0)
    assert b.export_id == id0 and b.uri == ref.meta["chain"][0]["uri"]
    (tmp_path / "bad" / damaged).write_bytes(good)                        # repaired: applying it again works
    b.apply_delta(str(tmp_path / "bad"))
    for x, y in zip(b.state(), ref.state()):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(b.lookup(probe), ref.lookup(probe))
    np.testing.assert_array_equal(b.model.get_dense(), ref.model.get_dense())


def test_retention_leaves_an_incomplete_bundle_being_written_alone(tmp_path):
    root = tmp_path / "exports"
    _export(root / "20240101" / "0100-base", 0)
    inflight = root / "20240101" / "0200-delta"             # an export still writing (no _SUCCESS yet)
    (inflight / "embeddings").mkdir(parents=True)
    (inflight / "embeddings" / "group-00000-of-00004.arrow").write_bytes(b"being written")
    _export(root / "20240101" / "0300-base", 1)
    assert prune_bundles(str(root), 2) == []
    assert (inflight / "embeddings" / "group-00000-of-00004.arrow").exists()
    old = time.time() - 3600                                 # an hour without a write: a killed export's
    for p in [inflight, *inflight.rglob("*")]:
        os.utime(p, (old, old))
    assert prune_bundles(str(root), 2) == ["20240101/0200-delta"]
    (inflight / "dense.npz").parent.mkdir(parents=True)     # with no grace, a fresh one goes at once
    (inflight / "dense.npz").write_bytes(b"")
    assert prune_bundles(str(root), 2, incomplete_grace_s=0) == ["20240101/0200-delta"]
