"""SGNS kernels against a slow, obviously-correct reference written from gensim's word2vec_inner.pyx.

The small tests are ``nojit``: they also pass with ``NUMBA_DISABLE_JIT=1``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from models import _w2v_kernels as K
from models.errors import ModelConfigError, ModelInputError
from models.word2vec import SkipGramNS, Vocab, Word2VecParams, new_state

MASK48 = (1 << 48) - 1


class NaiveLCG:
    """gensim's ``random_int32``: value ``next >> 16``, then ``next = (next * 25214903917 + 11) mod 2**48``."""

    def __init__(self, state: int):
        self.s = state

    def __call__(self) -> int:
        r = self.s >> 16
        self.s = (self.s * 25214903917 + 11) & MASK48
        return r


def naive_prepare(docs, sample_int, cum_table, window, negative, do_sample, state):
    rng = NaiveLCG(state)
    sents = []
    for doc in docs:
        sents.append([w for w in doc if not (do_sample and sample_int[w] < rng())])
    reduced = [[rng() % window for _ in s] for s in sents]
    negs = []
    for s, red in zip(sents, reduced):
        for i in range(len(s)):
            lo, hi = max(0, i - window + red[i]), min(len(s), i + window + 1 - red[i])
            for j in range(lo, hi):
                if j != i:
                    for _ in range(negative):
                        x = rng() % int(cum_table[-1])
                        negs.append(int(np.searchsorted(cum_table, x, side="left")))
    return sents, reduced, negs, rng.s


def naive_sigmoid(x):
    return float(K.EXP_TABLE[int((float(x) + 6.0) * 83)])


def naive_train(sents, reduced, negs, syn0, syn1neg, window, negative, alpha, alpha_end=None):
    """gensim ``train_batch_sg`` → ``w2v_fast_sentence_sg_neg`` in float32 numpy, one pair at a time; the
    rate moves linearly from ``alpha`` at the batch's first effective word towards ``alpha_end``
    (default: constant)."""
    syn0, syn1neg = syn0.copy(), syn1neg.copy()
    m = sum(len(s) for s in sents)
    step = ((alpha if alpha_end is None else alpha_end) - alpha) / max(m, 1)
    cursor, loss, word = 0, 0.0, 0
    for s, red in zip(sents, reduced):
        for i in range(len(s)):
            rate = np.float32(alpha + step * word)
            word += 1
            lo, hi = max(0, i - window + red[i]), min(len(s), i + window + 1 - red[i])
            for j in range(lo, hi):
                if j == i:
                    continue
                l1 = s[j]
                work = np.zeros(syn0.shape[1], np.float32)
                targets = [(s[i], 1.0)]
                for _ in range(negative):
                    t = negs[cursor]
                    cursor += 1
                    if t != s[i]:
                        targets.append((t, 0.0))
                for t, label in targets:
                    f_dot = np.float32(np.dot(syn0[l1].astype(np.float64), syn1neg[t].astype(np.float64)))
                    if f_dot <= -6 or f_dot >= 6:
                        continue
                    g = np.float32((np.float32(label) - np.float32(naive_sigmoid(f_dot))) * rate)
                    x = f_dot if label == 1.0 else -f_dot
                    if -6 < x < 6:
                        loss -= float(K.LOG_TABLE[int((float(x) + 6.0) * 83)])
                    work += g * syn1neg[t]
                    syn1neg[t] += g * syn0[l1]
                syn0[l1] += work
    return syn0, syn1neg, loss


def toy(V=20, dim=8, seed=3, window=3, negative=3, sample=0.05):
    rng = np.random.default_rng(seed)
    counts = np.sort(rng.integers(1, 200, V))[::-1].copy()
    vocab = Vocab([f"w{i}" for i in range(V)], counts)
    params = Word2VecParams(dim=dim, window=window, negative=negative, sample=sample, seed=seed)
    sg = SkipGramNS(vocab, params)
    lengths = [7, 1, 0, 12, 5]
    p = counts / counts.sum()
    docs = [list(rng.choice(V, n, p=p)) for n in lengths]
    tokens = np.array([w for d in docs for w in d], np.uint32)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    return sg, docs, tokens, offsets


@pytest.mark.nojit
@pytest.mark.parametrize("sample", [0.0, 0.05])
def test_prepare_matches_naive(sample):
    sg, docs, tokens, offsets = toy(sample=sample)
    state = new_state(7, 1)
    s0 = int(state[0])
    batch = sg.prepare(tokens, offsets, state)
    sents, reduced, negs, s_end = naive_prepare(docs, sg.sample_int, sg.cum_table, 3, 3, sample > 0, s0)
    assert batch.words.tolist() == [w for s in sents for w in s]
    assert np.diff(batch.sent_offsets).tolist() == [len(s) for s in sents]
    assert batch.reduced.tolist() == [b for r in reduced for b in r]
    assert batch.negs.tolist() == negs
    assert int(state[0]) == s_end
    assert batch.raw_words == len(tokens)
    if sample == 0:
        assert batch.effective_words == len(tokens)


@pytest.mark.nojit
def test_train_matches_naive():
    sg, docs, tokens, offsets = toy()
    rng = np.random.default_rng(0)
    V, dim = len(sg.vocab), sg.params.dim
    syn0 = sg.init_input_vectors(np.arange(V)) * 50  # larger than the init so dots are not tiny
    syn1 = rng.normal(0, 0.3, (V, dim)).astype(np.float32)
    batch = sg.prepare(tokens, offsets, new_state(11))
    sents = [batch.words[a:b].tolist() for a, b in zip(batch.sent_offsets[:-1], batch.sent_offsets[1:])]
    red = [batch.reduced[a:b].tolist() for a, b in zip(batch.sent_offsets[:-1], batch.sent_offsets[1:])]
    ref0, ref1, ref_loss = naive_train(sents, red, batch.negs.tolist(), syn0, syn1, 3, 3, 0.025)
    a0, a1 = syn0.copy(), syn1.copy()
    st = sg.train(batch, batch.words, batch.words, batch.negs, a0, a1, 0.025)
    np.testing.assert_allclose(a0, ref0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a1, ref1, rtol=1e-5, atol=1e-6)
    assert st.loss == pytest.approx(ref_loss, rel=1e-5)
    assert st.pairs == len(batch.negs) // 3
    assert not np.array_equal(a0, syn0) and not np.array_equal(a1, syn1)


@pytest.mark.nojit
def test_alpha_interpolates_across_batch():
    """The rate moves linearly from alpha_start at the batch's first effective word towards alpha_end
    (the reference, word by word); alpha_start == alpha_end is gensim's constant rate; a zero rate
    changes nothing."""
    sg, docs, tokens, offsets = toy()
    V, dim = len(sg.vocab), sg.params.dim
    syn0 = sg.init_input_vectors(np.arange(V)) * 50
    syn1 = np.full((V, dim), 0.1, np.float32)
    batch = sg.prepare(tokens, offsets, new_state(2))
    a0, a1 = syn0.copy(), syn1.copy()
    sg.train(batch, batch.words, batch.words, batch.negs, a0, a1, 0.0, 0.0)
    assert np.array_equal(a0, syn0) and np.array_equal(a1, syn1)
    sents = [batch.words[a:b].tolist() for a, b in zip(batch.sent_offsets[:-1], batch.sent_offsets[1:])]
    red = [batch.reduced[a:b].tolist() for a, b in zip(batch.sent_offsets[:-1], batch.sent_offsets[1:])]
    ref0, ref1, _ = naive_train(sents, red, batch.negs.tolist(), syn0, syn1, 3, 3, 0.05, 0.001)
    sg.train(batch, batch.words, batch.words, batch.negs, a0, a1, 0.05, 0.001)
    np.testing.assert_allclose(a0, ref0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a1, ref1, rtol=1e-5, atol=1e-6)
    const0, _, _ = naive_train(sents, red, batch.negs.tolist(), syn0, syn1, 3, 3, 0.05)
    assert np.abs(const0 - ref0).max() > 1e-3          # the decay matters at this size: not vacuous


@pytest.mark.nojit
def test_remap_and_local_training_equal_global():
    """What a PS worker does (pull unique rows, train on local ids, write back) equals training the whole
    tables."""
    sg, docs, tokens, offsets = toy(sample=0.0)
    V, dim = len(sg.vocab), sg.params.dim
    rng = np.random.default_rng(5)
    syn0 = rng.normal(0, 0.2, (V, dim)).astype(np.float32)
    syn1 = rng.normal(0, 0.2, (V, dim)).astype(np.float32)
    batch = sg.prepare(tokens, offsets, new_state(3))
    scratch = sg.new_scratch()
    loc = sg.remap(batch, scratch)
    assert np.all(scratch == -1)
    assert len(np.unique(loc.in_ids)) == len(loc.in_ids) and len(np.unique(loc.out_ids)) == len(loc.out_ids)
    assert np.array_equal(loc.out_ids[:len(loc.in_ids)], loc.in_ids)
    assert np.array_equal(loc.in_ids[loc.words_in], batch.words)
    assert np.array_equal(loc.out_ids[loc.words_out], batch.words)
    assert np.array_equal(loc.out_ids[loc.negs_out], batch.negs)
    assert set(loc.in_ids.tolist()) == set(batch.words.tolist())
    assert set(loc.out_ids.tolist()) == set(batch.words.tolist()) | set(batch.negs.tolist())

    g0, g1 = syn0.copy(), syn1.copy()
    st_g = sg.train(batch, batch.words, batch.words, batch.negs, g0, g1, 0.05)
    l0, l1 = syn0[loc.in_ids].copy(), syn1[loc.out_ids].copy()
    st_l = sg.train(batch, loc.words_in, loc.words_out, loc.negs_out, l0, l1, 0.05)
    w0, w1 = syn0.copy(), syn1.copy()
    w0[loc.in_ids] = l0
    w1[loc.out_ids] = l1
    np.testing.assert_array_equal(w0, g0)
    np.testing.assert_array_equal(w1, g1)
    assert st_l == st_g


@pytest.mark.nojit
def test_lcg_is_gensims():
    state = np.array([123456789], np.uint64)
    ref = NaiveLCG(123456789)
    for _ in range(50):
        assert int(K.lcg_next(state)) == ref()


@pytest.mark.nojit
def test_sigmoid_tables():
    x = (np.arange(1000) / 1000 * 2 - 1) * 6
    np.testing.assert_allclose(K.EXP_TABLE, 1 / (1 + np.exp(-x)), rtol=1e-6)
    np.testing.assert_allclose(K.LOG_TABLE, np.log(K.EXP_TABLE), rtol=1e-6)


@pytest.mark.nojit
def test_init_rows_range_and_pure():
    sg, *_ = toy(dim=16)
    ids = np.array([5, 0, 19, 5], np.uint64)
    v = sg.init_input_vectors(ids)
    assert v.dtype == np.float32 and v.shape == (4, 16)
    assert np.all(v >= -0.5 / 16) and np.all(v < 0.5 / 16)
    np.testing.assert_array_equal(v[0], v[3])
    np.testing.assert_array_equal(sg.init_input_vectors(np.array([19], np.uint64))[0], v[2])
    assert not np.array_equal(v[0], v[1])


def test_init_rows_uniform():
    sg, *_ = toy(dim=100)
    v = sg.init_input_vectors(np.arange(2000)) * 100  # uniform on [-0.5, 0.5)
    assert abs(float(v.mean())) < 0.005
    assert float(v.var()) == pytest.approx(1 / 12, rel=0.02)


def test_new_state_streams_differ():
    a, b, c = new_state(1, 0, 0), new_state(1, 0, 1), new_state(2, 0, 0)
    assert a.dtype == np.uint64 and a.shape == (1,) and int(a[0]) < 2**48
    assert len({int(a[0]), int(b[0]), int(c[0])}) == 3
    assert int(new_state(1, 0, 0)[0]) == int(a[0])


@pytest.mark.nojit
def test_prepare_rejects_bad_input():
    sg, docs, tokens, offsets = toy()
    with pytest.raises(ModelInputError, match="tokens"):
        sg.prepare(tokens.astype(np.int64), offsets, new_state(1))
    with pytest.raises(ModelInputError, match="ids <"):
        sg.prepare(np.array([0, 99], np.uint32), np.array([0, 2]), new_state(1))
    with pytest.raises(ModelInputError, match="offsets"):
        sg.prepare(tokens, offsets[:-1], new_state(1))
    batch = sg.prepare(tokens, offsets, new_state(1))
    with pytest.raises(ModelInputError, match="syn0"):
        sg.train(batch, batch.words, batch.words, batch.negs, np.zeros((20, 8)), np.zeros((20, 8), np.float32), 0.1)
    with pytest.raises(ModelConfigError, match="window"):
        Word2VecParams(window=0)


@pytest.mark.nojit
def test_negative_draws_follow_unigram_075():
    counts = np.array([1000, 300, 100, 30, 10, 3, 1])
    vocab = Vocab([f"w{i}" for i in range(len(counts))], counts)
    sg = SkipGramNS(vocab, Word2VecParams(dim=4, window=1, negative=50, sample=0))
    tokens = np.zeros(2001, np.uint32)
    batch = sg.prepare(tokens, np.array([0, len(tokens)]), new_state(9))
    freq = np.bincount(batch.negs, minlength=len(counts)) / len(batch.negs)
    p = counts ** 0.75 / (counts ** 0.75).sum()
    n = len(batch.negs)
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n) + 1e-9)
    assert batch.reduced.max() == 0  # window 1 → b always 0
    assert math.isclose(len(batch.negs), (2 * 2001 - 2) * 50)


def test_reference_trainer_deterministic_with_one_thread():
    from models.word2vec_reference import TokenCorpus, train_reference

    sg, docs, tokens, offsets = toy()
    rng = np.random.default_rng(1)
    lens = rng.integers(0, 40, 300)
    toks = rng.integers(0, len(sg.vocab), int(lens.sum())).astype(np.uint32)
    corpus = TokenCorpus(toks, np.r_[0, np.cumsum(lens)].astype(np.int64), lens + 1)
    params = Word2VecParams(dim=8, window=3, negative=2, sample=0.05, epochs=2, batch_words=500, seed=4)
    a = train_reference(corpus, sg.vocab, params, threads=1)
    b = train_reference(corpus, sg.vocab, params, threads=1)
    np.testing.assert_array_equal(a.syn0, b.syn0)
    np.testing.assert_array_equal(a.syn1neg, b.syn1neg)
    assert a.stats == b.stats and a.stats.raw_words == 2 * corpus.raw_words
    c = train_reference(corpus, sg.vocab, params, threads=2)
    assert c.stats.raw_words == a.stats.raw_words and c.stats.effective_words == a.stats.effective_words
    assert np.all(np.isfinite(c.syn0))
