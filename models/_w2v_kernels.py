"""Numba kernels of skip-gram with negative sampling (SGNS), split so a parameter-server worker can pull
exactly the rows a batch needs before it trains:

1. ``prepare_sg_batch`` (global word ids): frequent-word subsampling, the reduced window of every kept word
   and the negatives of every (center, context) pair, all drawn from one explicit random state;
2. ``remap_sg_batch``: the unique word ids whose input rows (``syn0``) and output rows (``syn1neg``) the
   batch touches, and the batch re-expressed in positions of those lists (local ids);
3. ``train_sg_batch`` (local row ids): the SGD updates, Hogwild-style in place.

What step 3 computes is gensim's ``train_batch_sg`` → ``w2v_fast_sentence_sg_neg`` (gensim 4.4,
``gensim/models/word2vec_inner.pyx``), itself word2vec.c (Mikolov et al. 2013):

* for center word ``i`` of a sentence and each context ``j`` with ``|j - i| <= window - b_i`` (``b_i``
  uniform in ``[0, window)``), the INPUT vector of the context word, ``syn0[w_j]``, is trained to predict the
  OUTPUT vector of the center, ``syn1neg[w_i]`` (label 1), and of ``negative`` words drawn from the
  unigram^0.75 table (label 0; a draw equal to the center is skipped, its draw still consumed);
* ``f = sigmoid(syn0[w_j] · syn1neg[t])`` through gensim's table (``EXP_TABLE_SIZE = 1000``,
  ``MAX_EXP = 6``, looked up at ``int((x + 6) * 83)``); when ``|x| >= 6`` the target is skipped entirely
  (no update, no loss), exactly as gensim and word2vec.c do;
* ``g = (label - f) * alpha``; ``work += g * syn1neg[t]``; ``syn1neg[t] += g * syn0[w_j]``; after all
  targets ``syn0[w_j] += work``;
* loss (gensim's ``compute_loss``): ``-log sigmoid(±x)`` from the log table, same skips.

Random numbers: gensim's 48-bit LCG (``next = (next * 25214903917 + 11) mod 2**48``, the value used is
``next >> 16``), carried in a ``uint64[1]`` state array. Subsampling keeps word ``w`` when
``sample_int[w] >= rand32`` (gensim), the reduced window is ``rand32 % window`` (word2vec.c; gensim draws
it from numpy), a negative is ``bisect_left(cum_table, rand32 % cum_table[-1])``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from sparse_tables.kernels import splitmix64  # one SplitMix64 for the whole code base (public module)

__all__ = ["make_guide", "draw_negative", "GUIDE_SHIFT", "EXP_TABLE", "LOG_TABLE", "MAX_EXP", "EXP_TABLE_SIZE", "lcg_next", "prepare_sg_batch",
           "remap_sg_batch", "train_sg_batch", "init_input_rows", "splitmix64"]

EXP_TABLE_SIZE = 1000
MAX_EXP = 6
#: integer ``EXP_TABLE_SIZE / MAX_EXP / 2`` as gensim's generated C computes it
_EXP_SCALE = (EXP_TABLE_SIZE // MAX_EXP) // 2


def _tables():
    i = np.arange(EXP_TABLE_SIZE, dtype=np.float32)
    e = np.exp(((i / np.float32(EXP_TABLE_SIZE)) * 2 - 1) * MAX_EXP).astype(np.float32)
    sig = (e / (e + np.float32(1.0))).astype(np.float32)
    return sig, np.log(sig).astype(np.float32)


#: sigmoid table, ``float32[1000]``: ``EXP_TABLE[i] = sigmoid((i / 1000 * 2 - 1) * 6)`` (gensim ``init()``)
#: and ``log`` of it
EXP_TABLE, LOG_TABLE = _tables()

_LCG_MUL = np.uint64(25214903917)
_LCG_ADD = np.uint64(11)
_LCG_MASK = np.uint64((1 << 48) - 1)
_U16 = np.uint64(16)


@njit(cache=True, nogil=True, inline="always")
def lcg_next(state):
    """One draw of gensim's LCG: returns ``state[0] >> 16`` (``< 2**32``) and advances ``state[0]``.

    Parameters
    ----------
    state : uint64[1]
    """
    s = state[0]
    state[0] = (s * _LCG_MUL + _LCG_ADD) & _LCG_MASK
    return s >> _U16


@njit(cache=True, nogil=True, inline="always")
def _bisect_left(a, x, lo, hi):
    while hi > lo:
        mid = (lo + hi) >> 1
        if np.uint64(a[mid]) >= x:
            hi = mid
        else:
            lo = mid + 1
    return lo


GUIDE_SHIFT = 15


def make_guide(cum_table, shift=GUIDE_SHIFT):
    """Bucket index of ``cum_table`` so a negative draw bisects a few entries instead of all ``V``.

    ``guide[k] = bisect_left(cum_table, k << shift)``; a value ``x`` in bucket ``k = x >> shift`` has its
    insertion point in ``[guide[k], guide[k + 1]]``. The draw is exactly ``bisect_left(cum_table, x)``.

    Returns
    -------
    guide : int64[K + 2]
    """
    top = int(cum_table[-1]) if len(cum_table) else 1
    edges = np.arange((top >> shift) + 2, dtype=np.int64) << shift
    return np.searchsorted(cum_table.astype(np.int64), edges, side="left").astype(np.int64)


@njit(cache=True, nogil=True, inline="always")
def draw_negative(cum_table, guide, shift, x):
    """``bisect_left(cum_table, x)`` through the guide table (``make_guide``)."""
    k = x >> np.uint64(shift)
    return _bisect_left(cum_table, x, guide[k], guide[k + 1])


@njit(cache=True, nogil=True)
def prepare_sg_batch(tokens, offsets, sample_int, cum_table, guide, guide_shift, window, negative,
                     do_sample, state):
    """Subsample a batch of documents, draw reduced windows and the negatives of every pair.

    Parameters
    ----------
    tokens : uint32[n]
        Word ids of all documents back to back (global ids, ``< len(sample_int)``).
    offsets : int64[d + 1]
        Document ``s`` is ``tokens[offsets[s]:offsets[s + 1]]``.
    sample_int : uint32[V]
        Keep thresholds (``Vocab.sample_ints``); word ``w`` is kept when ``sample_int[w] >= rand32``.
    cum_table : uint32[V]
        Cumulative unigram^0.75 table (``Vocab.cum_table``).
    guide : int64[K + 2]
        ``make_guide(cum_table, guide_shift)``.
    guide_shift : int
    window : int >= 1
    negative : int >= 0
    do_sample : bool
        False when ``sample == 0`` (no draws at all, as gensim).
    state : uint64[1]
        LCG state, advanced in place.

    Returns
    -------
    words : uint32[m]
        Kept word ids ("effective words").
    sent_offsets : int64[d + 1]
        Sentence ``s`` is ``words[sent_offsets[s]:sent_offsets[s + 1]]``.
    reduced : int32[m]
        ``b_i`` in ``[0, window)``; the context of ``i`` is ``|j - i| <= window - b_i`` within the sentence.
    negs : uint32[p * negative]
        Negatives of the ``p`` (center, context) pairs in training order (centers ascending, then contexts
        ascending), ``negative`` per pair.
    """
    n_docs = offsets.shape[0] - 1
    words = np.empty(tokens.shape[0], np.uint32)
    sent_offsets = np.empty(n_docs + 1, np.int64)
    sent_offsets[0] = 0
    m = 0
    for s in range(n_docs):
        for t in range(offsets[s], offsets[s + 1]):
            w = tokens[t]
            if do_sample and np.uint64(sample_int[w]) < lcg_next(state):
                continue
            words[m] = w
            m += 1
        sent_offsets[s + 1] = m
    reduced = np.empty(m, np.int32)
    n_pairs = 0
    for s in range(n_docs):
        start = sent_offsets[s]
        end = sent_offsets[s + 1]
        for i in range(start, end):
            b = np.int32(lcg_next(state) % np.uint64(window))
            reduced[i] = b
            j0 = max(start, i - window + b)
            j1 = min(end, i + window + 1 - b)
            n_pairs += j1 - j0 - 1
    negs = np.empty(n_pairs * negative, np.uint32)
    top = np.uint64(cum_table[cum_table.shape[0] - 1]) if cum_table.shape[0] > 0 else np.uint64(1)
    for k in range(n_pairs * negative):
        negs[k] = draw_negative(cum_table, guide, guide_shift, lcg_next(state) % top)
    return words[:m].copy(), sent_offsets, reduced, negs


@njit(cache=True, nogil=True)
def remap_sg_batch(words, negs, mark):
    """Unique rows a batch touches, and the batch in local ids (positions in those unique lists).

    Parameters
    ----------
    words : uint32[m]
        Effective words (``prepare_sg_batch``).
    negs : uint32[q]
        Negatives.
    mark : int32[V]
        Scratch, all ``-1`` on entry and on return (one per worker thread; ``V`` = vocabulary size).

    Returns
    -------
    in_ids : uint32[u]
        Word ids whose input vectors (``syn0``) the batch reads and writes, first-seen order.
    out_ids : uint32[v]
        Word ids whose output vectors (``syn1neg``) it reads and writes: ``in_ids`` first
        (``out_ids[:u] == in_ids``, so ``words_in == words_out``), then the other negatives.
    words_in : int32[m]
        ``in_ids[words_in[i]] == words[i]``.
    words_out : int32[m]
        ``out_ids[words_out[i]] == words[i]``.
    negs_out : int32[q]
        ``out_ids[negs_out[k]] == negs[k]``.
    """
    m = words.shape[0]
    q = negs.shape[0]
    words_in = np.empty(m, np.int32)
    words_out = np.empty(m, np.int32)
    negs_out = np.empty(q, np.int32)
    uniq = np.empty(m + q, np.uint32)
    u = 0
    for i in range(m):
        w = words[i]
        if mark[w] < 0:
            mark[w] = u
            uniq[u] = w
            u += 1
        words_in[i] = mark[w]
        words_out[i] = mark[w]
    in_ids = uniq[:u].copy()
    v = u
    for k in range(q):
        w = negs[k]
        if mark[w] < 0:
            mark[w] = v
            uniq[v] = w
            v += 1
        negs_out[k] = mark[w]
    for k in range(v):
        mark[uniq[k]] = -1
    return in_ids, uniq[:v].copy(), words_in, words_out, negs_out


@njit(cache=True, nogil=True, fastmath=True)
def train_sg_batch(words_in, words_out, sent_offsets, reduced, negs, syn0, syn1neg, window, negative,
                   alpha_start, alpha_end, exp_table, log_table, compute_loss, work):
    """SGNS updates of one prepared batch, in place (gensim ``train_batch_sg`` with ``negative > 0``).

    Hogwild: rows are updated without locks; two threads running this on the same arrays may race on a
    shared row (as gensim's workers do), which SGD tolerates.

    Parameters
    ----------
    words_in : int32[m]
        Row of ``syn0`` of every effective word.
    words_out : int32[m]
        Row of ``syn1neg`` of every effective word.
    sent_offsets : int64[d + 1]
    reduced : int32[m]
    negs : int32[p * negative]
        Rows of ``syn1neg`` of the pre-drawn negatives (``prepare_sg_batch`` order, remapped). Two
        positions name the same word iff they hold the same row, so the "negative == center" skip works on
        local rows.
    syn0 : float32[n_in, dim]
        Input vectors, updated in place.
    syn1neg : float32[n_out, dim]
        Output vectors, updated in place.
    window, negative : int
    alpha_start, alpha_end : float
        Learning rate at the first and after the last effective word; it moves linearly in between
        (equal values = gensim's constant rate per job).
    exp_table, log_table : float32[1000]
        ``EXP_TABLE``, ``LOG_TABLE``.
    compute_loss : bool
    work : float32[dim]
        Scratch.

    Returns
    -------
    pairs : int
        (center, context) pairs trained.
    loss : float
        Sum of ``-log sigmoid`` terms (0 unless ``compute_loss``).
    """
    m = words_in.shape[0]
    dim = syn0.shape[1]
    loss = 0.0
    cursor = 0
    pairs = 0
    da = (alpha_end - alpha_start) / max(m, 1)
    for s in range(sent_offsets.shape[0] - 1):
        start = sent_offsets[s]
        end = sent_offsets[s + 1]
        for i in range(start, end):
            alpha = np.float32(alpha_start + da * i)
            b = reduced[i]
            j0 = max(start, i - window + b)
            j1 = min(end, i + window + 1 - b)
            center = words_out[i]
            for j in range(j0, j1):
                if j == i:
                    continue
                pairs += 1
                l1 = words_in[j]
                for k in range(dim):
                    work[k] = np.float32(0.0)
                for d in range(negative + 1):
                    if d == 0:
                        target = center
                        label = np.float32(1.0)
                    else:
                        target = negs[cursor]
                        cursor += 1
                        if target == center:
                            continue
                        label = np.float32(0.0)
                    f_dot = np.float32(0.0)
                    for k in range(dim):
                        f_dot += syn0[l1, k] * syn1neg[target, k]
                    if f_dot <= -MAX_EXP or f_dot >= MAX_EXP:
                        continue
                    f = exp_table[int((np.float64(f_dot) + MAX_EXP) * _EXP_SCALE)]
                    g = (label - f) * alpha
                    if compute_loss:
                        x = f_dot if d == 0 else -f_dot
                        if -MAX_EXP < x < MAX_EXP:
                            loss -= log_table[int((np.float64(x) + MAX_EXP) * _EXP_SCALE)]
                    for k in range(dim):
                        work[k] += g * syn1neg[target, k]
                    for k in range(dim):
                        syn1neg[target, k] += g * syn0[l1, k]
                for k in range(dim):
                    syn0[l1, k] += work[k]
    return pairs, loss


@njit(cache=True, nogil=True)
def init_input_rows(ids, seed, out):
    """Initial input vectors: uniform in ``[-0.5 / dim, 0.5 / dim)`` (word2vec.c), a pure function of
    ``(seed, word id)`` so a row is the same whichever worker or process creates it.

    Parameters
    ----------
    ids : uint64[n]
        Word ids (or any keys).
    seed : int
    out : float32[n, dim]
        Written in place.
    """
    dim = out.shape[1]
    scale = 1.0 / dim
    base = splitmix64(np.uint64(seed))
    for r in range(ids.shape[0]):
        h = splitmix64(base ^ splitmix64(np.uint64(ids[r])))
        for k in range(dim):
            z = splitmix64(h + np.uint64(k))
            u = np.float64(z >> np.uint64(40)) * (1.0 / 16777216.0)  # 24 bits → [0, 1)
            out[r, k] = np.float32((u - 0.5) * scale)
    return out

