"""Per-group metrics (GAUC, positive/negative order ratio) and the exact accuracy at 0.5, each against
scikit-learn or a brute-force pair count on the same predictions; merging across simulated workers
partitioned by ``owner_of``."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, roc_auc_score

from engine.group_metrics import (COUNT_FIELDS, OWNER_SALT, SUM_FIELDS, GroupMetrics, group_stats,
                                  owned_mask, owner_of)
from engine.metrics import BinaryMetrics


# ---------------------------------------------------------------- naive references
M64 = (1 << 64) - 1


def naive_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def naive_groups(probs, labels, groups) -> dict:
    """Per group: rows, AUC by sklearn (None for one class) and (right, wrong, tied) by brute force."""
    out = {}
    for g in np.unique(groups):
        m = groups == g
        p, y = np.asarray(probs[m], np.float64), labels[m]
        pos, neg = p[y == 1], p[y == 0]
        d = np.subtract.outer(pos, neg)
        auc = roc_auc_score(y, p) if len(pos) and len(neg) else None
        out[int(g)] = dict(rows=int(m.sum()), auc=auc, right=int((d > 0).sum()), wrong=int((d < 0).sum()),
                           tied=int((d == 0).sum()))
    return out


def naive_summary(probs, labels, groups) -> dict:
    per = naive_groups(probs, labels, groups).values()
    used = [s for s in per if s["auc"] is not None]
    right, wrong = sum(s["right"] for s in per), sum(s["wrong"] for s in per)
    return {"gauc": sum(s["rows"] * s["auc"] for s in used) / sum(s["rows"] for s in used),
            "uauc": np.mean([s["auc"] for s in used]), "gauc_groups": len(used),
            "gauc_impressions": sum(s["rows"] for s in used), "groups": len(per),
            "pos_neg_order_ratio": right / wrong, "pairs_right": right, "pairs_wrong": wrong,
            "pairs_tied": sum(s["tied"] for s in per)}


def random_set(seed: int, n_groups: int = 60, max_rows: int = 40, levels: int = 8):
    """Groups of 1..max_rows rows; predictions on ``levels`` values so ties are frequent."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_rows + 1, n_groups)
    ids = np.unique(rng.integers(-10**12, 10**12, n_groups))                # negative ids too
    sizes = sizes[:len(ids)]
    groups = np.repeat(ids, sizes).astype(np.int64)
    n = len(groups)
    probs = (rng.integers(0, levels, n) / levels).astype(np.float32)
    labels = (rng.random(n) < rng.uniform(0.05, 0.6, len(ids)).repeat(sizes)).astype(np.float32)
    perm = rng.permutation(n)                      # groups interleaved, as a data file would have them
    return probs[perm], labels[perm], groups[perm]


def check_summary(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, int):
            assert got[k] == v, k
        else:
            assert got[k] == pytest.approx(v, abs=1e-6), k


# ---------------------------------------------------------------- exact per-group metrics
def test_per_group_auc_and_pairs_match_sklearn_and_brute_force_with_ties():
    probs, labels, groups = random_set(0)
    st = group_stats(probs, labels, groups)
    naive = naive_groups(probs, labels, groups)
    assert sorted(st.groups.tolist()) == st.groups.tolist()
    assert {int(g) for g in st.groups.view(np.int64)} == set(naive)
    assert st.pairs_tied.sum() > 0, "the data set must contain ties"
    for i, g in enumerate(st.groups.view(np.int64)):
        want = naive[int(g)]
        assert st.rows[i] == want["rows"]
        assert (st.pairs_right[i], st.pairs_wrong[i], st.pairs_tied[i]) == (want["right"], want["wrong"],
                                                                             want["tied"])
        neg = st.rows[i] - st.positives[i]
        assert st.pairs_right[i] + st.pairs_wrong[i] + st.pairs_tied[i] == st.positives[i] * neg
        if want["auc"] is None:
            assert np.isnan(st.auc[i])
        else:
            assert st.auc[i] == pytest.approx(want["auc"], abs=1e-6)


def test_gauc_and_order_ratio_match_reference_and_batches_may_split_groups():
    probs, labels, groups = random_set(1)
    whole = GroupMetrics()
    whole.update(probs, labels, groups)
    want = naive_summary(probs, labels, groups)
    got = whole.summary()
    check_summary(got, want)
    assert got["rows"] == len(probs)
    batched = GroupMetrics()                       # a group's rows arrive in several batches
    for lo in range(0, len(probs), 37):
        batched.update(probs[lo:lo + 37], labels[lo:lo + 37], groups[lo:lo + 37])
    c1, s1 = whole.to_parts()
    c2, s2 = batched.to_parts()
    assert c1.tolist() == c2.tolist()
    np.testing.assert_allclose(s2, s1, rtol=1e-12)


def test_worked_example_of_the_docstring():
    m = GroupMetrics()
    m.update(np.array([0.9, 0.2, 0.2, 0.4, 0.6, 0.3]), np.array([1, 0, 1, 0, 1, 1]), np.array([7, 7, 7, 7, 9, 9]))
    counts, sums = m.to_parts()
    assert dict(zip(COUNT_FIELDS, counts.tolist())) == dict(rows=6, groups=2, groups_used=1, impressions_used=4,
                                                            pairs_right=2, pairs_wrong=1, pairs_tied=1)
    assert sums.tolist() == [2.5, 0.625] and len(SUM_FIELDS) == 2
    s = m.summary()
    assert (s["gauc"], s["uauc"], s["pos_neg_order_ratio"]) == (0.625, 0.625, 2.0)


def test_planted_per_group_signal_gauc_differs_from_global_auc():
    """Predictions = a per-group offset + a within-group signal. The offsets are unrelated to the groups'
    click rates, so they scramble the global ranking (low global AUC) while every group's own ranking
    stays good (high GAUC)."""
    rng = np.random.default_rng(7)
    n_groups, rows = 400, 30
    groups = np.repeat(rng.integers(0, 2**63, n_groups, dtype=np.int64), rows)
    x = rng.standard_normal(n_groups * rows)
    base = np.repeat(rng.normal(-1.0, 1.0, n_groups), rows)        # each group's click rate
    offset = np.repeat(rng.normal(0.0, 3.0, n_groups), rows)       # the model's per-group bias
    labels = (rng.random(len(x)) < 1 / (1 + np.exp(-(base + 2.0 * x)))).astype(np.int64)
    probs = 1 / (1 + np.exp(-(offset + 2.0 * x)))
    m = GroupMetrics()
    m.update(probs, labels, groups)
    s = m.summary()
    check_summary(s, naive_summary(probs, labels, groups))
    global_auc = roc_auc_score(labels, probs)
    assert s["gauc"] > 0.8 and global_auc < 0.7 and s["gauc"] - global_auc > 0.15, (s["gauc"], global_auc)
    # the same predictions without the offsets: GAUC unchanged (within-group order is the same)
    m2 = GroupMetrics()
    m2.update(1 / (1 + np.exp(-2.0 * x)), labels, groups)
    assert m2.summary()["gauc"] == pytest.approx(s["gauc"], abs=1e-12)
    assert roc_auc_score(labels, x) > global_auc + 0.1


# ---------------------------------------------------------------- across workers
def test_three_workers_partitioned_by_owner_merge_to_the_single_process_result():
    probs, labels, groups = random_set(2, n_groups=120)
    whole = GroupMetrics()
    whole.update(probs, labels, groups)
    workers = []
    for rank in range(3):
        w = GroupMetrics(rank=rank, num_workers=3)
        mask = owned_mask(groups, rank, 3)
        assert 0 < mask.sum() < len(groups)
        for lo in range(0, int(mask.sum()), 50):            # in eval batches
            w.update(probs[mask][lo:lo + 50], labels[mask][lo:lo + 50], groups[mask][lo:lo + 50])
        workers.append(w)
    want_c, want_s = whole.to_parts()
    for perm in itertools.permutations(range(3)):
        # as the servers do: add the shipped parts (int64 counts, float64 sums)
        counts = sum(workers[i].to_parts()[0] for i in perm)
        sums = np.zeros(len(SUM_FIELDS))
        for i in perm:
            sums = sums + workers[i].to_parts()[1]
        assert counts.dtype == np.int64 and counts.tolist() == want_c.tolist()
        np.testing.assert_allclose(sums, want_s, rtol=1e-12, atol=0)
        merged = GroupMetrics.from_parts(*workers[perm[0]].to_parts())
        merged.merge(workers[perm[1]]).merge(GroupMetrics.from_parts(*workers[perm[2]].to_parts()))
        assert merged.to_parts()[0].tolist() == want_c.tolist()
        got = merged.summary()
        for k, v in whole.summary().items():
            assert got[k] == pytest.approx(v, rel=1e-12), k


def test_owner_of_is_fixed_balanced_and_refuses_foreign_rows():
    ids = np.arange(-5000, 5000, dtype=np.int64)
    own = owner_of(ids, 4)
    assert own.dtype == np.int64 and own.min() >= 0 and own.max() < 4
    assert np.bincount(own, minlength=4).min() > 2300                  # about 2500 each
    assert owner_of(ids.view(np.uint64), 4).tolist() == own.tolist()   # same bits, same owner
    assert owner_of(ids.astype(np.int32), 4).tolist() == own.tolist()
    # the partition is a fixed pure function: the SplitMix64 finalizer of the salted id, with Python ints
    for g in [0, 1, 2, 3, 2**40, -1, -(2**63)]:
        assert owner_of(np.array([g], np.int64), 7)[0] == naive_mix64((g % 2**64) ^ int(OWNER_SALT)) % 7
    assert (owner_of(ids, 1) == 0).all()
    w = GroupMetrics(rank=0, num_workers=4)
    with pytest.raises(ValueError, match="groups: row 0 has group .* of worker [123], not of this worker 0"):
        w.update(np.array([0.5]), np.array([1]), ids[own != 0][:1])
    with pytest.raises(ValueError, match="num_workers"):
        owner_of(ids, 0)
    with pytest.raises(ValueError, match="rank"):
        owned_mask(ids, 4, 4)
    with pytest.raises(ValueError, match="rank and num_workers"):
        GroupMetrics(rank=1)


# ---------------------------------------------------------------- edge cases
def test_single_class_groups_are_skipped_and_nothing_usable_gives_nan():
    m = GroupMetrics()
    m.update(np.array([0.1, 0.9, 0.3, 0.4, 0.8]), np.array([0, 1, 1, 1, 1]), np.array([1, 1, 2, 2, 2]))
    s = m.summary()
    assert (s["groups"], s["gauc_groups"], s["gauc_impressions"], s["rows"]) == (2, 1, 2, 5)
    assert s["gauc"] == 1.0 and s["uauc"] == 1.0
    assert s["pos_neg_order_ratio"] == float("inf")          # one right pair, no wrong one

    only_one_class = GroupMetrics()
    only_one_class.update(np.array([0.2, 0.7, 0.4]), np.array([1, 1, 0]), np.array([5, 5, 6]))
    s = only_one_class.summary()
    assert s["gauc_groups"] == 0 and s["groups"] == 2
    assert np.isnan(s["gauc"]) and np.isnan(s["uauc"]) and np.isnan(s["pos_neg_order_ratio"])

    empty = GroupMetrics().summary()
    assert empty["rows"] == 0 and np.isnan(empty["gauc"])
    counts, sums = GroupMetrics().to_parts()
    assert counts.dtype == np.int64 and counts.tolist() == [0] * len(COUNT_FIELDS) and sums.tolist() == [0.0, 0.0]

    all_tied = GroupMetrics()
    all_tied.update(np.full(4, 0.5, np.float32), np.array([1, 0, 1, 0]), np.zeros(4, np.int64))
    s = all_tied.summary()
    assert s["gauc"] == 0.5 and s["pairs_tied"] == 4 and np.isnan(s["pos_neg_order_ratio"])


@pytest.mark.parametrize("probs, labels, groups, match", [
    ([0.1, 0.2], [0, 1], [1], "probs, labels, groups: expected equal lengths"),
    ([0.1, np.nan], [0, 1], [1, 1], "probs: expected finite numbers, got nan at index 1"),
    ([0.1, np.inf], [0, 1], [1, 1], "probs: expected finite"),
    ([0.1, 0.2], [0, 0.5], [1, 1], "labels: expected 0 or 1, got 0.5 at index 1"),
    ([0.1, 0.2], [0, 2], [1, 1], "labels: expected 0 or 1"),
    ([0.1, 0.2], [0, np.nan], [1, 1], "labels: expected 0 or 1"),
    ([0.1, 0.2], [0, 1], [1.0, 2.0], "groups: expected integer group ids, got float64"),
    (["a", "b"], [0, 1], [1, 2], "probs: expected a float array"),
])
def test_bad_input_raises_naming_the_argument(probs, labels, groups, match):
    with pytest.raises(ValueError, match=match):
        GroupMetrics().update(np.array(probs), np.array(labels), np.array(groups))


def test_from_parts_checks_the_layout():
    with pytest.raises(ValueError, match=r"counts: expected int64\[7\]"):
        GroupMetrics.from_parts(np.zeros(6, np.int64), np.zeros(2))
    with pytest.raises(ValueError, match=r"sums: expected float64\[2\]"):
        GroupMetrics.from_parts(np.zeros(7, np.int64), np.zeros(3))
    with pytest.raises(ValueError, match="non-negative"):
        GroupMetrics.from_parts(-np.ones(7, np.int64), np.zeros(2))


# ---------------------------------------------------------------- accuracy at 0.5 (engine.metrics)
@pytest.mark.parametrize("num_buckets", [1 << 20, 1 << 16, 1000, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accuracy_at_half_is_exact_against_sklearn(num_buckets, dtype):
    rng = np.random.default_rng(3)
    edge = [0.5, np.nextafter(dtype(0.5), dtype(0)), np.nextafter(dtype(0.5), dtype(1)), 0.0, 1.0]
    probs = np.concatenate([rng.random(3000), np.repeat(edge, 40)]).astype(dtype)
    labels = (rng.random(len(probs)) < 0.4).astype(np.float32)
    want = accuracy_score(labels, probs >= 0.5)
    parts = [BinaryMetrics(num_buckets) for _ in range(3)]
    for i, m in enumerate(parts):
        m.update(probs[i::3], labels[i::3])
    merged = BinaryMetrics.from_parts(*parts[0].to_parts()).merge(parts[1]).merge(parts[2])
    assert merged.accuracy() == pytest.approx(want, abs=1e-12)
    assert merged.summary()["accuracy"] == merged.accuracy()
    only_half = BinaryMetrics(num_buckets)             # p == 0.5 exactly is predicted positive
    only_half.update(np.full(4, 0.5, dtype), np.array([1, 1, 1, 0], np.float32))
    assert only_half.accuracy() == 0.75


def test_accuracy_is_nan_when_half_is_not_a_bucket_edge_or_nothing_was_seen():
    odd = BinaryMetrics(15)
    odd.update(np.array([0.2, 0.8]), np.array([0, 1]))
    assert np.isnan(odd.accuracy())
    assert np.isnan(BinaryMetrics(16).accuracy())
