"""word2vec text/binary formats (round trip, read by gensim) and the evaluation protocols on toy data."""
from __future__ import annotations

import numpy as np
import pytest

from models.errors import ModelInputError
from models.word2vec_eval import evaluate_analogies, evaluate_word_pairs, rankdata, spearman
from models.word2vec_io import load_word2vec_format, save_word2vec_format

WORDS = ["the", "of", "king", "queen", "man", "woman", "paris", "france", "zebra"]


def vecs(seed=0, dim=7):
    return np.random.default_rng(seed).normal(size=(len(WORDS), dim)).astype(np.float32)


@pytest.mark.parametrize("binary", [False, True])
def test_round_trip(tmp_path, binary):
    v = vecs()
    v[0, 0] = 1e-30
    v[1, 1] = -123456.789
    save_word2vec_format(tmp_path / "v", ["é"] + WORDS[1:], v, binary=binary)
    for detect in (binary, None):
        words, got = load_word2vec_format(tmp_path / "v", binary=detect)
        assert words == ["é"] + WORDS[1:]
        np.testing.assert_array_equal(got, v)  # %.9g is exact for float32


@pytest.mark.parametrize("binary", [False, True])
def test_gensim_reads_our_files(tmp_path, binary):
    gensim = pytest.importorskip("gensim")
    v = vecs()
    save_word2vec_format(tmp_path / "v", WORDS, v, binary=binary)
    kv = gensim.models.KeyedVectors.load_word2vec_format(str(tmp_path / "v"), binary=binary)
    assert list(kv.index_to_key) == WORDS
    np.testing.assert_array_equal(kv.vectors, v)
    kv.save_word2vec_format(str(tmp_path / "g"), binary=binary)
    words, got = load_word2vec_format(tmp_path / "g", binary=binary)
    assert words == WORDS
    np.testing.assert_array_equal(got, v)


def test_io_errors(tmp_path):
    with pytest.raises(ModelInputError, match="whitespace"):
        save_word2vec_format(tmp_path / "v", ["a b"], np.zeros((1, 2)))
    with pytest.raises(ModelInputError, match="shape"):
        save_word2vec_format(tmp_path / "v", ["a"], np.zeros((2, 2)))
    (tmp_path / "bad").write_text("x y\n")
    with pytest.raises(ModelInputError, match="header"):
        load_word2vec_format(tmp_path / "bad")
    (tmp_path / "short").write_text("2 2\na 1 2\nb 1\n")
    with pytest.raises(ModelInputError, match="row 1"):
        load_word2vec_format(tmp_path / "short", binary=False)


def test_rankdata_and_spearman_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = rng.integers(0, 6, 40).astype(float)  # many ties
        y = x + rng.normal(size=40)
        np.testing.assert_allclose(rankdata(x), stats.rankdata(x))
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)


def test_spearman_by_hand():
    assert rankdata([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))


def analogy_vectors():
    """2-d vectors where king - man + woman = queen and paris - ... is off."""
    v = {"the": [0.1, 0.1, 1.0], "of": [0.1, -0.1, 1.0], "king": [1, 1, 0], "queen": [1, -1, 0],
         "man": [0.2, 1, 0], "woman": [0.2, -1, 0], "paris": [-1, 0.3, 0.2], "france": [-1, 0.2, 0.25],
         "zebra": [0.9, -0.2, 0]}
    return np.array([v[w] for w in WORDS], np.float32)


def test_analogies_protocol(tmp_path):
    q = tmp_path / "q.txt"
    q.write_text(": royal\n"
                 "man king woman queen\n"   # correct
                 "MAN WOMAN king queen\n"   # upper case: same question shape, king + woman - man → queen
                 "man king woman unicorn\n"  # OOV → skipped
                 "bad line\n"               # invalid
                 ": places\n"
                 "man woman king zebra\n")  # queen would be nearest? not a/b/c → queen ≠ zebra
    r = evaluate_analogies(WORDS, analogy_vectors(), q)
    assert r["evaluated"] == 3 and r["skipped"] == 1 and r["invalid"] == 1
    assert [s["section"] for s in r["sections"]] == ["royal", "places"]
    assert r["sections"][0]["correct"] == 2 and r["sections"][1]["correct"] == 0
    assert r["accuracy"] == pytest.approx(2 / 3)
    r2 = evaluate_analogies(WORDS, analogy_vectors(), q, restrict_vocab=4)  # man/woman not in the top 4
    assert r2["evaluated"] == 0 and r2["skipped"] == 4 and r2["accuracy"] == 0.0
    (tmp_path / "nohdr.txt").write_text("a b c d\n")
    with pytest.raises(ModelInputError, match="section"):
        evaluate_analogies(WORDS, analogy_vectors(), tmp_path / "nohdr.txt")


def test_analogies_agree_with_gensim_on_random_vectors(tmp_path):
    gensim = pytest.importorskip("gensim")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    v = rng.normal(size=(300, 10)).astype(np.float32)
    lines = [": s1"] + [" ".join(rng.choice(words + ["oov"], 4, replace=False)) for _ in range(150)]
    lines += [": s2"] + [" ".join(rng.choice(words, 4, replace=False)) for _ in range(150)]
    (tmp_path / "q.txt").write_text("\n".join(lines) + "\n")
    kv = gensim.models.KeyedVectors(10)
    kv.add_vectors(words, v)
    score, sections = kv.evaluate_word_analogies(str(tmp_path / "q.txt"), restrict_vocab=250)
    ours = evaluate_analogies(words, v, tmp_path / "q.txt", restrict_vocab=250)
    assert ours["correct"] == len(sections[-1]["correct"])
    assert ours["evaluated"] == len(sections[-1]["correct"]) + len(sections[-1]["incorrect"])
    assert ours["accuracy"] == pytest.approx(score)
    for s, g in zip(ours["sections"], sections[:-1]):
        assert s["correct"] == len(g["correct"])


def test_word_pairs(tmp_path):
    p = tmp_path / "pairs.tsv"
    p.write_text("# comment\nking\tqueen\t8\nman\twoman\t7\nKING\tZEBRA\t5\nparis\tthe\t1\n"
                 "unicorn\tking\t3\nbad\tline\n")
    r = evaluate_word_pairs(WORDS, analogy_vectors(), p)
    assert r["pairs"] == 4 and r["skipped"] == 1 and r["invalid"] == 1
    u = analogy_vectors() / np.linalg.norm(analogy_vectors(), axis=1, keepdims=True)
    ix = {w: i for i, w in enumerate(WORDS)}
    model = [float(u[ix[a]] @ u[ix[b]]) for a, b in
             [("king", "queen"), ("man", "woman"), ("king", "zebra"), ("paris", "the")]]
    assert r["spearman"] == pytest.approx(spearman([8, 7, 5, 1], model))
    gensim = pytest.importorskip("gensim")
    kv = gensim.models.KeyedVectors(3)
    kv.add_vectors(WORDS, analogy_vectors())
    _, g_spear, g_oov = kv.evaluate_word_pairs(str(p))
    assert r["spearman"] == pytest.approx(g_spear.statistic, abs=1e-6)
    (tmp_path / "none.tsv").write_text("x\ty\t1\n")
    with pytest.raises(ModelInputError, match="no pair"):
        evaluate_word_pairs(WORDS, analogy_vectors(), tmp_path / "none.tsv")
