"""Which words the word2vec formats can hold, and ``engine export --format word2vec`` on the others.

The corpus tokenizer splits on ASCII whitespace only, so a vocabulary word may hold a non-ASCII space
("cat\\u00a0sat", U+00A0): the word2vec text and binary formats break only on ASCII space and newline
(gensim splits rows on them), so such a word is written as it is and read back unchanged (by our reader
and gensim's); that export ended in a traceback (exit 1). A word the format cannot hold (ASCII
whitespace, from a vocabulary not made by the tokenizer) is one CLI error line, exit 2.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from engine.cli import main
from models.errors import ModelInputError
from models.word2vec_io import load_word2vec_format, save_word2vec_format
from streaming.text import read_vocab, vocab_schema
from tests.unit.test_w2v_vocab_identity import _checkpoint, _convert

NBSP_WORDS = ["the", "cat\u00a0sat", "on\u2003mat", "x\u3000y", "a\x1cb", "caf\u00e9"]


@pytest.mark.parametrize("binary", [False, True])
def test_non_ascii_spaces_are_kept_and_read_back(tmp_path, binary):
    vecs = np.arange(len(NBSP_WORDS) * 3, dtype=np.float32).reshape(-1, 3) / 7
    path = tmp_path / "v"
    save_word2vec_format(path, NBSP_WORDS, vecs, binary=binary)
    words, got = load_word2vec_format(path, binary=binary)
    assert words == NBSP_WORDS
    np.testing.assert_array_equal(got, vecs)
    gensim = pytest.importorskip("gensim")
    kv = gensim.models.KeyedVectors.load_word2vec_format(str(path), binary=binary)
    assert kv.index_to_key == NBSP_WORDS
    np.testing.assert_allclose(kv.vectors, vecs, rtol=1e-6)


@pytest.mark.parametrize("word", ["", "a b", "a\tb", "a\nb", "a\rb", "a\vb", "a\fb"])
def test_ascii_whitespace_and_empty_words_are_refused(tmp_path, word):
    with pytest.raises(ModelInputError, match=r"cannot hold word 1 "):
        save_word2vec_format(tmp_path / "v", ["ok", word], np.zeros((2, 2), np.float32))
    assert not (tmp_path / "v").exists()


def test_a_text_file_of_short_numbers_is_read_as_text(tmp_path):
    """Format detection reads the first row up to its newline (it read 4 * dim bytes after the first
    word, which with dim 2 reached the next row's word and took this text file for binary); rows that
    end in a space (word2vec.c's text output) are text too."""
    (tmp_path / "v.txt").write_text("3 2\nthe 1 2\ncat 3 4\nsat 5 6\n")
    words, vecs = load_word2vec_format(tmp_path / "v.txt")
    assert words == ["the", "cat", "sat"] and vecs.tolist() == [[1, 2], [3, 4], [5, 6]]
    (tmp_path / "c.txt").write_text("2 2\nthe 1 2 \ncat 3 4 \n")
    assert load_word2vec_format(tmp_path / "c.txt")[0] == ["the", "cat"]
    save_word2vec_format(tmp_path / "v.bin", ["the", "cat"], np.ones((2, 2), np.float32), binary=True)
    assert load_word2vec_format(tmp_path / "v.bin")[1].tolist() == [[1, 1], [1, 1]]


@pytest.mark.parametrize("binary", [False, True])
def test_export_of_a_corpus_with_a_non_ascii_space_in_a_word(tmp_path, capsys, binary):
    arrow = tmp_path / "arrow"
    _convert(tmp_path, "the cat\u00a0sat on mat\n" * 10, arrow)
    words = read_vocab(arrow)[0]
    assert "cat\u00a0sat" in words                       # one token: U+00A0 is no separator
    uri = _checkpoint(arrow, tmp_path / "ckpt")
    out = tmp_path / "vectors"
    assert main(["export", uri, str(out), "--format", "word2vec", *(["--binary"] if binary else [])]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["words"] == len(words) and res["missing"] == 0
    gensim = pytest.importorskip("gensim")
    kv = gensim.models.KeyedVectors.load_word2vec_format(str(out), binary=binary)
    assert kv.index_to_key == words
    np.testing.assert_array_equal(kv["cat\u00a0sat"], words.index("cat\u00a0sat") + 1)


def test_export_of_a_word_the_format_cannot_hold_is_one_error_line(tmp_path, capsys):
    """A vocabulary not made by the tokenizer may hold ASCII whitespace: exit 2 and one line, no file."""
    arrow = tmp_path / "arrow"
    _convert(tmp_path, "the cat sat\n", arrow)
    table = pa.table({"word": ["the", "cat\tsat", "on"], "count": pa.array([3, 2, 1], pa.uint64())},
                     schema=vocab_schema())
    with pa.OSFile(str(arrow / "vocab.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    uri = _checkpoint(arrow, tmp_path / "ckpt")          # trained with this vocabulary (fingerprint matches)
    out = tmp_path / "vectors.txt"
    assert main(["export", uri, str(out), "--format", "word2vec"]) == 2
    captured = capsys.readouterr()
    err = [ln for ln in captured.err.strip().splitlines() if ln.startswith("engine export:")]
    assert err == ["engine export: words: the word2vec format cannot hold word 1 'cat\\tsat' (empty or "
                   "containing ASCII whitespace: space, \\t, \\n, \\r, \\v or \\f)"]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not out.exists()
