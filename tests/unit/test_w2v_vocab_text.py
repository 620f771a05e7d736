"""Vocabulary tables against gensim's formulas, and the text-corpus converter on small files."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pytest

from models.errors import ModelInputError
from models.word2vec import Vocab, batch_arrays
from models.word2vec_reference import TokenCorpus, _jobs, load_corpus
from streaming.text import (convert_text, corpus_files, read_vocab, text_arrow_is_current)

COUNTS = [5000, 1200, 800, 300, 77, 40, 12, 5, 3, 1]


def gensim_sample_int(counts, sample):
    """gensim 4.4 ``Word2Vec.prepare_vocab``, transcribed."""
    retain_total = sum(counts)
    if not sample:
        threshold_count = retain_total
    elif sample < 1.0:
        threshold_count = sample * retain_total
    else:
        threshold_count = int(sample * (3 + np.sqrt(5)) / 2)
    out = []
    for v in counts:
        p = (np.sqrt(v / threshold_count) + 1) * (threshold_count / v)
        out.append(np.uint32(min(p, 1.0) * (2**32 - 1)))
    return np.array(out, np.uint32)


def gensim_cum_table(counts, ns_exponent=0.75, domain=2**31 - 1):
    """gensim 4.4 ``Word2Vec.make_cum_table``, transcribed."""
    pow_total = 0.0
    for c in counts:
        pow_total += c ** float(ns_exponent)
    cum, out = 0.0, []
    for c in counts:
        cum += c ** float(ns_exponent)
        out.append(round(cum / pow_total * domain))
    return np.array(out, np.uint32)


@pytest.mark.parametrize("sample", [0, 1e-3, 0.05, 20])
def test_sample_int_matches_gensim_formula(sample):
    v = Vocab([f"w{i}" for i in range(len(COUNTS))], COUNTS)
    np.testing.assert_array_equal(v.sample_ints(sample), gensim_sample_int(COUNTS, sample))
    p = v.keep_probabilities(sample)
    assert np.all((p > 0) & (p <= 1))
    if sample:
        assert p[0] < 1.0 and p[-1] == 1.0


@pytest.mark.parametrize("exp", [0.75, 1.0, 0.0])
def test_cum_table_matches_gensim_formula(exp):
    v = Vocab([f"w{i}" for i in range(len(COUNTS))], COUNTS)
    t = v.cum_table(exp)
    np.testing.assert_array_equal(t, gensim_cum_table(COUNTS, exp))
    assert t[-1] == 2**31 - 1 and np.all(np.diff(t.astype(np.int64)) > 0)


def test_tables_match_gensim_itself():
    gensim = pytest.importorskip("gensim")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(len(COUNTS))]
    sents = [[w] * c for w, c in zip(words, COUNTS)]
    flat = [w for s in sents for w in s]
    rng.shuffle(flat)
    m = gensim.models.Word2Vec(vector_size=4, min_count=1, sample=1e-3, negative=5, workers=1)
    m.build_vocab([flat[i:i + 1000] for i in range(0, len(flat), 1000)])
    order = [m.wv.key_to_index[w] for w in words]
    v = Vocab(words, COUNTS)
    np.testing.assert_array_equal(v.sample_ints(1e-3), m.wv.expandos["sample_int"][order])
    np.testing.assert_array_equal(v.cum_table(), m.cum_table)  # distinct counts → same order


def test_jobs_like_gensim_producer():
    raw = np.array([4, 4, 3, 9, 1, 12, 2])
    b = _jobs(raw, 10)
    assert b.tolist() == [0, 2, 3, 5, 6, 7]  # [4,4] [3] [9,1] [12] [2]


def write(path, text, gz=False):
    data = text.encode()
    if gz:
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


TEXT = ("the cat sat on the mat\n"
        "\n"
        "  the dog\tsat  \n"
        "a b c d e f g h the the cat\n"
        "zzz yyy\n"
        "the cat")  # no final newline


def rows(out_dir):
    toks, raw = [], []
    for f in corpus_files(out_dir):
        with pa.memory_map(f) as mm:
            t = pa.ipc.open_stream(mm).read_all()
        toks += t.column("tokens").to_pylist()
        raw += t.column("raw_tokens").to_pylist()
    return toks, raw


@pytest.mark.nojit
@pytest.mark.parametrize("gz", [False, True])
def test_convert_small(tmp_path, gz):
    src = write(tmp_path / ("c.txt.gz" if gz else "c.txt"), TEXT, gz)
    rep = convert_text(src, tmp_path / "out", min_count=2, chunk_tokens=4, block_bytes=16)
    words, counts = read_vocab(tmp_path / "out")
    assert words == ["the", "cat", "sat"] and counts.tolist() == [6, 3, 2]
    ids = {w: i for i, w in enumerate(words)}
    toks, raw = rows(tmp_path / "out")
    expect_lines = [l.split() for l in TEXT.split("\n") if l.split()]
    exp_toks, exp_raw = [], []
    for line in expect_lines:
        for s in range(0, len(line), 4):
            chunk = line[s:s + 4]
            exp_toks.append([ids[w] for w in chunk if w in ids])
            exp_raw.append(len(chunk))
    assert toks == exp_toks and raw == exp_raw
    assert [] in toks  # a chunk with only OOV words is kept (empty)
    assert rep.total_tokens == sum(len(l) for l in expect_lines) == sum(raw)
    assert rep.retained_tokens == sum(counts) == sum(map(len, toks))
    assert rep.oov_tokens == rep.total_tokens - rep.retained_tokens
    assert rep.lines == 6 and rep.empty_lines == 1 and rep.rows == len(toks)
    assert rep.split_documents == 2 and rep.distinct_words == len(set(TEXT.split()))
    meta = json.loads((tmp_path / "out" / "_meta.json").read_text())
    assert meta["retained_tokens"] == rep.retained_tokens and meta["source"]["size"] == src.stat().st_size
    assert text_arrow_is_current(src, tmp_path / "out", min_count=2, chunk_tokens=4)
    assert not text_arrow_is_current(src, tmp_path / "out", min_count=3, chunk_tokens=4)
    c = load_corpus(tmp_path / "out")
    assert isinstance(c, TokenCorpus) and c.raw_words == rep.total_tokens
    assert [c.tokens[a:b].tolist() for a, b in zip(c.offsets[:-1], c.offsets[1:])] == exp_toks
    assert Vocab.from_arrow(tmp_path / "out").words == words


@pytest.mark.nojit
def test_convert_ties_max_vocab_and_staleness(tmp_path):
    src = write(tmp_path / "c.txt", "b a c b a c d\nd e\n")
    convert_text(src, tmp_path / "o", min_count=1, max_vocab=3, file_tokens=2, batch_tokens=1)
    words, counts = read_vocab(tmp_path / "o")
    assert words == ["a", "b", "c"] and counts.tolist() == [2, 2, 2]  # ties by word; "d" cut by max_vocab
    files = corpus_files(tmp_path / "o")
    assert len(files) >= 2
    toks, raw = rows(tmp_path / "o")
    assert toks == [[1, 0, 2, 1, 0, 2], []] and raw == [7, 2]
    assert text_arrow_is_current(src, tmp_path / "o", min_count=1, max_vocab=3)
    src.write_text("changed\n")
    assert not text_arrow_is_current(src, tmp_path / "o", min_count=1, max_vocab=3)


def test_convert_matches_python_split_on_long_lines(tmp_path):
    rng = np.random.default_rng(1)
    vocab = [f"w{i}" for i in range(50)]
    lines = [" ".join(rng.choice(vocab, n)) for n in (25_003, 3, 10_000, 0, 10_001)]
    src = write(tmp_path / "long.txt", "\n".join(lines) + "\n")
    rep = convert_text(src, tmp_path / "o", min_count=1, block_bytes=1 << 12)
    toks, raw = rows(tmp_path / "o")
    assert raw == [10_000, 10_000, 5_003, 3, 10_000, 10_000, 1]
    words, _ = read_vocab(tmp_path / "o")
    flat = [words[i] for t in toks for i in t]
    assert flat == " ".join(lines).split()
    assert rep.split_documents == 2 and rep.oov_tokens == 0


def test_convert_bad_args(tmp_path):
    src = write(tmp_path / "c.txt", "a\n")
    with pytest.raises(ValueError, match="chunk_tokens"):
        convert_text(src, tmp_path / "o", chunk_tokens=10_001)
    with pytest.raises(ValueError, match="min_count"):
        convert_text(src, tmp_path / "o", min_count=0)
    with pytest.raises(FileNotFoundError):
        convert_text(tmp_path / "missing.txt", tmp_path / "o")
    with pytest.raises(FileNotFoundError, match="convert_text"):
        corpus_files(tmp_path / "nothing")


def test_batch_arrays_from_sliced_record_batch():
    tokens = pa.array([[1, 2], [], [3, 4, 5], [6]], pa.list_(pa.uint32()))
    rb = pa.record_batch([tokens, pa.array([3, 1, 3, 1], pa.uint32())], names=["tokens", "raw_tokens"])
    t, offs, raw = batch_arrays(rb.slice(1, 2))
    assert t.dtype == np.uint32 and t.tolist() == [3, 4, 5]
    assert offs.tolist() == [0, 0, 3] and raw == 4
    with pytest.raises(ModelInputError, match="list<uint32>"):
        batch_arrays(pa.record_batch([pa.array([[1]], pa.list_(pa.int64()))], names=["tokens"]))


@pytest.mark.parametrize("gz", [False, True])
def test_a_token_that_is_not_utf8_is_named_with_its_line(tmp_path, gz):
    """The vocabulary is built over bytes, so the bad token is found there; its line is then looked up
    (it was reported as line 0, 'line unknown')."""
    from streaming.errors import DataFormatError
    text = b"good words here\nmore good words\n" * 3 + b"one bad \xff\xfe token\nend\n"
    path = tmp_path / ("c.txt.gz" if gz else "c.txt")
    path.write_bytes(gzip.compress(text) if gz else text)
    with pytest.raises(DataFormatError) as ei:
        convert_text(str(path), str(tmp_path / "out"), min_count=1)
    assert str(ei.value) == f"{path}:7: field token: expected UTF-8 text, got the bytes b'\\xff\\xfe'"
