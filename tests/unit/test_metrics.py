"""Bucketed AUC against the exact rank-based AUC (Mann-Whitney U with average ranks), and merging."""
from __future__ import annotations

import numpy as np
import pytest

from engine.metrics import BinaryMetrics


def exact_auc(probs, labels) -> float:
    order = np.argsort(probs, kind="mergesort")
    ranks = np.empty(len(probs))
    sorted_p = probs[order]
    i = 0
    while i < len(probs):  # average ranks over ties
        j = i
        while j + 1 < len(probs) and sorted_p[j + 1] == sorted_p[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def test_bucketed_auc_matches_exact_auc():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20_000)
    labels = (rng.random(20_000) < 1 / (1 + np.exp(-2 * x))).astype(np.float32)
    probs = 1 / (1 + np.exp(-x))
    m = BinaryMetrics()
    m.update(probs, labels)
    assert m.auc() == pytest.approx(exact_auc(probs, labels), abs=1e-4)
    s = m.summary()
    assert s["count"] == 20_000 and s["copc"] == pytest.approx(labels.sum() / probs.sum())
    p = np.clip(probs, 1e-7, 1 - 1e-7)
    assert s["logloss"] == pytest.approx(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def test_ties_count_half_and_degenerate_cases():
    m = BinaryMetrics(16)
    m.update(np.array([0.5, 0.5, 0.5, 0.5]), np.array([1, 0, 1, 0]))
    assert m.auc() == pytest.approx(0.5)
    one_class = BinaryMetrics(16)
    one_class.update(np.array([0.2, 0.9]), np.array([1, 1]))
    assert np.isnan(one_class.auc())
    with pytest.raises(ValueError, match="probabilities in"):
        m.update(np.array([1.5]), np.array([1]))


def test_merged_workers_equal_one_accumulator():
    rng = np.random.default_rng(1)
    probs, labels = rng.random(9000), (rng.random(9000) < 0.3).astype(np.float64)
    whole = BinaryMetrics(4096)
    whole.update(probs, labels)
    parts = [BinaryMetrics(4096) for _ in range(3)]
    for i, p in enumerate(parts):
        p.update(probs[i::3], labels[i::3])
    merged = BinaryMetrics.from_parts(*parts[0].to_parts())
    merged.merge(parts[1]).merge(BinaryMetrics.from_parts(*parts[2].to_parts()))
    assert merged.auc() == pytest.approx(whole.auc(), abs=1e-12)
    got, want = merged.summary(), whole.summary()      # every figure: auc, logloss, pred/actual ctr, copc, ...
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-12) for k in want), (got, want)
    assert want["actual_ctr"] > 0.25 and want["pred_ctr"] > 0.45                     # not vacuous
    # the mean of per-worker AUCs is not the global AUC in general; merging must not do that
    assert merged.count == whole.count


def test_saturated_predictions_tie_in_the_end_buckets():
    """The module docstring's limit of the bucketed AUC: predictions closer than 2^-20 tie, so a model whose
    sigmoid saturates (|logit| > ~13.9) on many rows reads a lower AUC than the exact one; the bucketed AUC
    is exactly the rank AUC of the bucket indices."""
    rng = np.random.default_rng(0)
    labels = (rng.random(20_000) < 0.3).astype(np.float64)
    z = rng.normal(0.0, 12.0, 20_000) + 8.0 * labels
    probs = (1 / (1 + np.exp(-z))).astype(np.float32)           # the models' dtype
    m = BinaryMetrics()
    m.update(probs, labels)
    exact = exact_auc(probs.astype(np.float64), labels)
    buckets = np.minimum((probs.astype(np.float64) * m.num_buckets).astype(np.int64), m.num_buckets - 1)
    assert m.auc() == pytest.approx(exact_auc(buckets, labels), abs=1e-12)
    assert round(m.auc(), 4) == 0.6779 and round(exact, 4) == 0.6802   # 28% of the rows beyond +-13.9


def test_nothing_seen_gives_nan_means_not_zero():
    s = BinaryMetrics(16).summary()
    assert s["count"] == 0
    for key in ("auc", "logloss", "pred_ctr", "actual_ctr", "copc", "accuracy"):
        assert np.isnan(s[key]), key
