"""Criteo-format synthetic data from a planted logistic model (for runs without the real data, benchmarks
and statistical tests).

The model: for row ``r``::

    logit = bias + Σ_j beta_j · log1p(max(I_j, 0)) + Σ_s w_s(v_s)      label ~ Bernoulli(sigmoid(logit))

* ``v_s`` is the categorical value of slot ``s``: a Zipf(``zipf_a``)-distributed rank in
  ``[0, vocab_s)``, missing with probability ``missing_s``; its text is 8 hex digits of a bijective
  32-bit mix of (slot, rank), so distinct ranks give distinct strings.
* ``w_s(rank) = sigma_s · N(0, 1)`` drawn as a pure function of (seed, slot, rank) (no table, so 1M-value
  vocabularies cost nothing); a missing value has weight 0.
* ``I_j = floor(exp(N(mu_j, 1.2))) - 1`` (a few negatives in I2 to exercise clamping), missing with
  probability ``missing_j``.
* ``bias`` is calibrated on a pilot sample so the mean click rate is about ``ctr``.

Everything is a deterministic function of ``seed`` (and ``chunk_rows``).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

__all__ = ["generate_criteo", "GeneratedCriteo", "CRITEO_VOCAB_SIZES", "roc_auc"]

log = logging.getLogger(__name__)

#: per-slot cardinalities of the Criteo Kaggle set, capped at 1M by ``generate_criteo``
CRITEO_VOCAB_SIZES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
                      27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclasses.dataclass(frozen=True)
class GeneratedCriteo:
    """What ``generate_criteo`` wrote.

    Attributes
    ----------
    path : str
    rows : int
    seed : int
    ctr : float
        Click rate of the generated labels.
    planted_auc : float
        AUC of the planted model's own probabilities against the generated labels (all rows): the ceiling
        a learner can approach.
    planted_auc_test : float
        The same on the canonical test rows (``i % 5 == 4``).
    """

    path: str
    rows: int
    seed: int
    ctr: float
    planted_auc: float
    planted_auc_test: float


def roc_auc(labels, scores) -> float:
    """Exact ROC AUC (ties get half credit).

    Parameters
    ----------
    labels : array of 0/1, shape (n,)
    scores : float[n]

    Returns
    -------
    float (nan if only one class is present)
    """
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), np.float64)
    # average ranks over ties
    start = np.r_[0, np.flatnonzero(np.diff(s)) + 1]
    end = np.r_[start[1:], len(s)]
    avg = (start + end + 1) / 2.0
    ranks[order] = np.repeat(avg, end - start)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, vectorized: uint64[n] → uint64[n]."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


def _value_weights(seed: int, slot: int, ranks: np.ndarray) -> np.ndarray:
    """Standard normal weight of each (seed, slot, rank), a pure function: float64[n]."""
    base = np.uint64((seed * 1000003 + slot * 7919) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        h1 = _splitmix(ranks.astype(np.uint64) * np.uint64(2) + base)
        h2 = _splitmix(h1 ^ np.uint64(0x632BE59BD9B4E019))
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    u2 = (h2 >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _hex_values(slot: int, ranks: np.ndarray) -> np.ndarray:
    """8-hex-digit strings ``S8[n]`` of a bijective 32-bit mix of (slot, rank)."""
    with np.errstate(over="ignore"):
        v = (ranks.astype(np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)
        v ^= np.uint64((slot * 0x85EBCA6B) & 0xFFFFFFFF)
    shifts = np.arange(28, -4, -4, dtype=np.uint64)
    digits = ((v[:, None] >> shifts) & np.uint64(0xF)).astype(np.uint8)
    chars = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)[digits]
    return np.ascontiguousarray(chars).view("S8").ravel()


class _Model:
    def __init__(self, seed: int, vocab_sizes, zipf_a: float):
        rng = np.random.default_rng([seed, 0])
        self.seed = seed
        self.vocab = [int(min(v, 1_000_000)) for v in vocab_sizes]
        self.sigma = rng.uniform(0.05, 0.5, len(self.vocab))
        self.missing_s = np.where(rng.random(len(self.vocab)) < 0.3, rng.uniform(0.05, 0.45,
                                                                                 len(self.vocab)), 0.0)
        self.mu = rng.uniform(0.0, 4.0, 13)
        self.beta = rng.normal(0.0, 0.15, 13)
        self.missing_d = np.where(rng.random(13) < 0.5, rng.uniform(0.02, 0.45, 13), 0.0)
        self.cdf = []
        for v in self.vocab:
            w = 1.0 / np.arange(1, v + 1, dtype=np.float64) ** zipf_a
            c = np.cumsum(w)
            self.cdf.append(c / c[-1])
        self.bias = 0.0

    def sample(self, rng, n: int):
        """Dense ints (int64[13, n]), their masks, categorical ranks (int64[26, n]), masks, logits."""
        dense = np.floor(np.exp(rng.normal(self.mu[:, None], 1.2, (13, n)))).astype(np.int64) - 1
        dense[1] -= (rng.random(n) < 0.02) * rng.integers(1, 4, n)
        dmiss = rng.random((13, n)) < self.missing_d[:, None]
        logit = np.full(n, self.bias)
        logit += (self.beta[:, None] * np.log1p(np.maximum(dense, 0)) * ~dmiss).sum(axis=0)
        ranks = np.empty((len(self.vocab), n), np.int64)
        smiss = rng.random((len(self.vocab), n)) < self.missing_s[:, None]
        for s in range(len(self.vocab)):
            ranks[s] = np.minimum(np.searchsorted(self.cdf[s], rng.random(n)), self.vocab[s] - 1)
            w = self.sigma[s] * _value_weights(self.seed, s + 1, ranks[s])
            logit += np.where(smiss[s], 0.0, w)
        return dense, dmiss, ranks, smiss, logit

    def calibrate(self, ctr: float):
        dense, dmiss, ranks, smiss, logit = self.sample(np.random.default_rng([self.seed, 1]), 20000)
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(logit + mid)))) < ctr:
                lo = mid
            else:
                hi = mid
        self.bias = (lo + hi) / 2


def generate_criteo(path, rows: int, seed: int, *, ctr: float = 0.25, vocab_sizes=CRITEO_VOCAB_SIZES,
                    zipf_a: float = 1.1, chunk_rows: int = 100_000) -> GeneratedCriteo:
    """Write a Criteo ``train.txt``-layout file drawn from a planted logistic model (module docstring).

    Parameters
    ----------
    path : str or PathLike
        Output file; gzip-compressed when it ends in ``.gz``.
    rows : int
    seed : int
        Everything (model and rows) is a deterministic function of it.
    ctr : float
        Target mean click rate.
    vocab_sizes : sequence of 26 ints
        Distinct values per slot (capped at 1,000,000).
    zipf_a : float
        Zipf exponent of the categorical value frequencies.
    chunk_rows : int
        Rows generated and written at a time (memory is O(chunk_rows) plus 12 bytes per row for the AUC).

    Returns
    -------
    GeneratedCriteo

    Raises
    ------
    ValueError
        On bad arguments.
    """
    if rows < 0 or chunk_rows < 1:
        raise ValueError(f"rows must be >= 0 and chunk_rows >= 1, got {rows}, {chunk_rows}")
    if len(vocab_sizes) != 26 or min(vocab_sizes) < 1:
        raise ValueError(f"vocab_sizes must be 26 positive ints, got {vocab_sizes!r}")
    if not 0.0 < ctr < 1.0:
        raise ValueError(f"ctr must be in (0, 1), got {ctr}")
    path = os.fspath(path)
    model = _Model(seed, vocab_sizes, zipf_a)
    model.calibrate(ctr)
    rng = np.random.default_rng([seed, 2])
    probs = np.empty(rows, np.float64)
    labels = np.empty(rows, np.int8)
    names = ["label"] + [f"I{j}" for j in range(1, 14)] + [f"C{j}" for j in range(1, 27)]
    opts = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    sink = pa.OSFile(path, "wb")
    out = pa.CompressedOutputStream(sink, "gzip") if path.endswith(".gz") else sink
    try:
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            dense, dmiss, ranks, smiss, logit = model.sample(rng, n)
            p = 1.0 / (1.0 + np.exp(-logit))
            y = (rng.random(n) < p).astype(np.int8)
            probs[start:start + n], labels[start:start + n] = p, y
            cols = [pa.array(y)]
            cols += [pa.array(dense[j], mask=dmiss[j]) for j in range(13)]
            cols += [pa.array(_hex_values(s + 1, ranks[s]), type=pa.binary(), mask=smiss[s]).cast(pa.string())
                     for s in range(26)]
            pacsv.write_csv(pa.table(cols, names=names), out, write_options=opts)
    finally:
        out.close()
        if out is not sink:
            sink.close()
    test = np.arange(rows) % 5 == 4
    result = GeneratedCriteo(path=path, rows=rows, seed=seed,
                             ctr=float(labels.mean()) if rows else float("nan"),
                             planted_auc=roc_auc(labels, probs) if rows else float("nan"),
                             planted_auc_test=roc_auc(labels[test], probs[test]) if rows else float("nan"))
    log.info("generated %d Criteo-format rows in %s (seed %d, ctr %.3f, planted AUC %.4f)", rows, path,
             seed, result.ctr, result.planted_auc)
    return result
