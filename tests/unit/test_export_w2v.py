"""``--format word2vec``: a table keyed by ``make_keys(slot, word_id)`` written in vocabulary order,
read back by the word2vec reader; rows missing from the table are zero vectors, ids outside the
vocabulary are refused."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from engine.export import ExportError, RowBatchSource
from engine.export.w2v import export_word2vec
from models.word2vec_io import load_word2vec_format
from streaming.keys import make_keys
from streaming.text import vocab_schema

DESC = {"model": {"kind": "word2vec", "num_slots": 1, "dim": 3, "dense_dim": 0, "hidden": []},
        "hash_version": 1, "num_vshards": 1024}


def _vocab(path, words):
    t = pa.table({"word": words, "count": pa.array(range(len(words), 0, -1), pa.uint64())}, schema=vocab_schema())
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t)
    return path


def _src(ids, vecs):
    rb = pa.RecordBatch.from_arrays([pa.array(make_keys(7, np.asarray(ids))),
                                     pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), 3)],
                                    names=["key", "values"])
    return RowBatchSource(DESC, np.zeros(0, np.float32), [rb], "memory://w2v")


@pytest.mark.parametrize("binary", [False, True])
def test_word2vec_round_trip(tmp_path, binary):
    words = ["the", "of", "and", "cat"]
    vocab = _vocab(tmp_path / "vocab.arrow", words)
    vecs = np.arange(9, dtype=np.float32).reshape(3, 3) / 7
    res = export_word2vec(_src([2, 0, 1], vecs), str(tmp_path / "vec.txt"), vocab=str(vocab), binary=binary)
    assert res == {"words": 4, "dim": 3, "missing": 1}
    got_words, got = load_word2vec_format(tmp_path / "vec.txt", binary=binary)
    assert got_words == words
    np.testing.assert_array_equal(got[[2, 0, 1]], vecs)
    np.testing.assert_array_equal(got[3], 0)
    with pytest.raises(ExportError, match="outside the vocabulary"):
        export_word2vec(_src([9], vecs[:1]), str(tmp_path / "bad.txt"), vocab=str(vocab))
