"""Exact per-group ranking metrics that merge across workers: GAUC and the positive/negative order ratio.

When the evaluation data has a grouping column (a user id, a query id, ...), two metrics look inside
each group instead of at the whole set:

* **GAUC**, the impression-weighted mean of per-group AUCs; groups with a single class have no AUC and
  are skipped (their impressions are not in the denominator)::

      GAUC = sum_g n_g * AUC_g / sum_g n_g        over groups g with both classes, n_g = rows of g

  This is XDL's definition (``xdl/core/ops/gauc_calc_op.cc`` adds ``auc * (end - begin)`` and
  ``pv_num += end - begin`` per group, skipping single-class groups; ``gauc_op.cc`` divides) and Paddle's
  ``wuauc`` (``paddle/fluid/framework/fleet/metrics.cc``, ``BasicAucCalculator::computeWuAuc``, which
  also reports the unweighted mean ``uauc`` given here as ``uauc``). It is the "GAUC" of the DIN paper.
* **The positive/negative order ratio** (Paddle's ``pnpair`` evaluator): over every pair of rows of the
  same group with different labels, a pair is *right* when the positive row scores higher, *wrong* when
  it scores lower, and *tied* (Paddle: "neutral"/"special") when the scores are equal::

      pos_neg_order_ratio = sum_g right_g / sum_g wrong_g

  Tied pairs are counted in neither, as in Paddle's reference (``PnpairEvaluator::stat`` in
  ``paddle/gserver/evaluators/Evaluator.cpp``: equal outputs go to ``spe``; ``py_pnpair_op`` in
  ``test_positive_negative_pair_op.py``: ``s1 == s2`` goes to ``neu``); they are reported as
  ``pairs_tied``. (The C++ kernel of the fluid ``positive_negative_pair`` op adds a tied pair to both
  neutral and negative, contradicting its own reference test; we follow the reference.) With no wrong
  pair the ratio is ``inf`` (Paddle's evaluator divides by 1 instead), and NaN with no right pair
  either. Rows are unweighted here (Paddle's optional row weights average to 1 per pair).

Per group, ``AUC_g = (right_g + tied_g / 2) / (pos_g * neg_g)``: the Mann-Whitney U with ties counted
one half, i.e. average ranks, equal to ``sklearn.metrics.roc_auc_score`` on the group's rows (XDL's and
Paddle's kernels break ties by sort order instead; on tie-free predictions all agree). Every pair is
exactly one of right, wrong or tied: ``right_g + wrong_g + tied_g == pos_g * neg_g``.

These metrics cannot come from the global prediction histograms of ``engine.metrics.BinaryMetrics``;
they are computed exactly, by sorting within each group. Distributed, each group must be evaluated
whole by one worker: rows are partitioned by ``owner_of(group, num_workers)``, a fixed hash of the group
id; then every worker's parts are sums over its own groups and the global metrics are sums of parts
(``PSClient.add_metric``), never averages of per-worker values::

    worker w:   m = GroupMetrics(rank=w, num_workers=W)
                for probs, labels, groups in its eval batches (rows with owner_of(groups, W) == w):
                    m.update(probs, labels, groups)
                client.add_metric(name, *m.to_parts())          # int64 counts, float64 sums
    rank 0:     GroupMetrics.from_parts(*client.read_metric(name)).summary()

Parts layout (``to_parts``): ``counts : int64[7]`` = ``COUNT_FIELDS``, ``sums : float64[2]`` =
``SUM_FIELDS``. Worked example, one worker, two groups (7 and 9)::

    probs  = [0.9, 0.2, 0.2, 0.4, 0.6, 0.3]
    labels = [1,   0,   1,   0,   1,   1  ]
    groups = [7,   7,   7,   7,   9,   9  ]
    group 7: pos 2 (0.9, 0.2), neg 2 (0.2, 0.4): right 2 (0.9>0.2, 0.9>0.4), wrong 1 (0.2<0.4),
             tied 1 (0.2=0.2); AUC = (2 + 0.5) / 4 = 0.625, 4 rows
    group 9: positives only: skipped
    counts = [6 rows, 2 groups, 1 group used, 4 impressions used, 2 right, 1 wrong, 1 tied]
    sums   = [4 * 0.625, 0.625]  ->  gauc 0.625, uauc 0.625, pos_neg_order_ratio 2.0
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sharding import mix64

#: names of ``to_parts()[0]`` (int64, exact under any number of rows)
COUNT_FIELDS = ("rows", "groups", "groups_used", "impressions_used", "pairs_right", "pairs_wrong", "pairs_tied")
#: names of ``to_parts()[1]`` (float64): sum over used groups of ``n_g * AUC_g`` and of ``AUC_g``
SUM_FIELDS = ("impressions_x_auc", "auc_sum")

#: XOR-ed into group ids before hashing, so the eval partition is not aligned with the PS key routing
#: (``vshard = mix64(key) % num_vshards``) when group ids are also sparse keys
OWNER_SALT = np.uint64(0x5D0B1E5C6A3F9E27)


def _group_ids(groups, name: str = "groups") -> np.ndarray:
    """Integer group ids of any width -> uint64[n] (same 64 bits for int64 and uint64 inputs)."""
    g = np.asarray(groups)
    if g.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integer group ids, got {g.dtype} (hash string ids to uint64 "
                         f"first, as sparse feature values are)")
    g = np.ascontiguousarray(g.ravel())
    if g.dtype == np.uint64:
        return g
    return g.astype(np.int64).view(np.uint64)


def _check_num_workers(num_workers) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 1:
        raise ValueError(f"num_workers: expected an int >= 1, got {num_workers!r}")


def owner_of(groups: np.ndarray, num_workers: int) -> np.ndarray:
    """The worker that evaluates each group: ``mix64(group ^ OWNER_SALT) % num_workers``.

    A pure, fixed function (``mix64`` is ``engine.sharding.mix64``, the SplitMix64 finalizer), so every
    worker agrees on it without talking; all rows of a group go to one worker.

    Parameters
    ----------
    groups : int64[n] or uint64[n] (any integer dtype)
        Group ids; an int64 id and the uint64 with the same bits have the same owner.
    num_workers : int, >= 1

    Returns
    -------
    int64[n] in [0, num_workers)

    Raises
    ------
    ValueError
        Non-integer ``groups`` or ``num_workers < 1``.
    """
    _check_num_workers(num_workers)
    g = _group_ids(groups)
    return (mix64(g ^ OWNER_SALT) % np.uint64(num_workers)).astype(np.int64)


def owned_mask(groups: np.ndarray, rank: int, num_workers: int) -> np.ndarray:
    """bool[n]: rows whose group worker ``rank`` evaluates (``owner_of(groups, num_workers) == rank``).

    Raises
    ------
    ValueError
        ``rank`` not in [0, num_workers), or as ``owner_of``.
    """
    _check_num_workers(num_workers)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_workers:
        raise ValueError(f"rank: expected an int in [0, {num_workers}), got {rank!r}")
    return owner_of(groups, num_workers) == rank


def _check_inputs(probs, labels, groups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validated copies-or-views: float64[n], bool[n], uint64[n]."""
    p = np.asarray(probs)
    if p.dtype.kind not in "fiu":
        raise ValueError(f"probs: expected a float array, got {p.dtype}")
    p = np.ascontiguousarray(p.ravel(), dtype=np.float64)   # float32 widens exactly: ties are kept
    y = np.asarray(labels).ravel()
    if y.dtype.kind not in "fiub":
        raise ValueError(f"labels: expected 0/1 numbers, got {y.dtype}")
    g = _group_ids(groups)
    if not len(p) == len(y) == len(g):
        raise ValueError(f"probs, labels, groups: expected equal lengths, got {len(p)}, {len(y)} and {len(g)}")
    bad = np.flatnonzero(~np.isfinite(p))
    if len(bad):
        raise ValueError(f"probs: expected finite numbers, got {p[bad[0]]} at index {bad[0]}")
    if y.dtype.kind != "b":
        bad = np.flatnonzero((y != 0) & (y != 1))
        if len(bad):
            raise ValueError(f"labels: expected 0 or 1, got {y[bad[0]]} at index {bad[0]}")
        y = y == 1
    return p, np.ascontiguousarray(y), g


@dataclass(frozen=True)
class GroupStats:
    """Exact statistics of every group, groups in ascending uint64 order (``g`` groups).

    Attributes
    ----------
    groups : uint64[g]
        Group ids (int64 ids appear as their uint64 bits).
    rows, positives : int64[g]
        Rows (impressions) and positive rows per group; negatives = rows - positives.
    pairs_right, pairs_wrong, pairs_tied : int64[g]
        (positive, negative) pairs with the positive scored higher / lower / equal; they sum to
        ``positives * negatives``.
    auc : float64[g]
        ``(pairs_right + pairs_tied / 2) / (positives * negatives)``; NaN for a single-class group.
    """

    groups: np.ndarray
    rows: np.ndarray
    positives: np.ndarray
    pairs_right: np.ndarray
    pairs_wrong: np.ndarray
    pairs_tied: np.ndarray
    auc: np.ndarray

    @property
    def used(self) -> np.ndarray:
        """bool[g]: groups with both classes (the ones GAUC averages)."""
        return (self.positives > 0) & (self.positives < self.rows)

    def parts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(counts int64[7], sums float64[2])`` of these groups (layout: ``COUNT_FIELDS``, ``SUM_FIELDS``)."""
        used = self.used
        auc = self.auc[used]
        counts = np.array([self.rows.sum(), len(self.groups), used.sum(), self.rows[used].sum(),
                           self.pairs_right.sum(), self.pairs_wrong.sum(), self.pairs_tied.sum()], np.int64)
        sums = np.array([np.sum(self.rows[used] * auc), np.sum(auc)], np.float64)
        return counts, sums


def group_stats(probs: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> GroupStats:
    """Per-group AUC and pair counts, exactly, by one sort over (group, score).

    Vectorized, no Python loop per row or group: one sort by (group, score) puts each group's rows
    together in ascending score; runs of equal (group, score) are the ties. For a run with ``p``
    positives and ``q`` negatives, ``p * (negatives of the same group in earlier runs)`` pairs are right
    and ``p * q`` tied; the rest of the group's ``pos * neg`` pairs are wrong. O(n log n); about 0.25 s
    per million rows on one core.

    Parameters
    ----------
    probs : float32[n] or float64[n]
        Predicted probabilities (any finite scores: only their order within a group matters).
    labels : {0, 1}[n], any numeric or bool dtype
    groups : int64[n] or uint64[n] (any integer dtype)

    Returns
    -------
    GroupStats

    Raises
    ------
    ValueError
        Lengths differ, a probability is NaN or infinite, a label is not 0 or 1, or groups are not
        integers; the message names the argument.
    """
    p, y, g = _check_inputs(probs, labels, groups)
    n = len(p)
    if n == 0:
        z = np.zeros(0, np.int64)
        return GroupStats(np.zeros(0, np.uint64), z, z, z, z, z, np.zeros(0, np.float64))
    order = np.argsort(p)                       # by score, then stably by group (= np.lexsort((p, g)),
    order = order[np.argsort(g[order], kind="stable")]      # about 1.5x faster)
    gs, ps, ys = g[order], p[order], y[order].astype(np.int64)
    new_group = np.empty(n, bool)
    new_group[0] = True
    np.not_equal(gs[1:], gs[:-1], out=new_group[1:])
    new_run = new_group.copy()
    new_run[1:] |= ps[1:] != ps[:-1]
    group_starts = np.flatnonzero(new_group)
    run_starts = np.flatnonzero(new_run)
    run_pos = np.add.reduceat(ys, run_starts)
    run_neg = np.diff(np.append(run_starts, n)) - run_pos
    first_run = np.flatnonzero(new_group[run_starts])        # index of each group's first run
    run_group = np.cumsum(new_group[run_starts]) - 1          # group index of each run
    neg_before = np.cumsum(run_neg) - run_neg                 # negatives in earlier runs, all groups
    neg_before -= neg_before[first_run][run_group]            # ... of the same group only
    right = np.add.reduceat(run_pos * neg_before, first_run)
    tied = np.add.reduceat(run_pos * run_neg, first_run)
    rows = np.diff(np.append(group_starts, n))
    pos = np.add.reduceat(ys, group_starts)
    pairs = pos * (rows - pos)
    wrong = pairs - right - tied
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = np.where(pairs > 0, (right + 0.5 * tied) / pairs, np.nan)
    return GroupStats(gs[group_starts], rows, pos, right, wrong, tied, auc)


class GroupMetrics:
    """Mergeable accumulator of GAUC and the positive/negative order ratio (module docstring).

    ``update`` buffers the rows (a group's rows may arrive in several batches); the statistics are
    computed when asked for (``to_parts``, ``summary``, ``stats``) and cached until the next update.
    Memory: 17 bytes per buffered row, plus a sort's scratch when computing. ``merge`` and
    ``from_parts`` carry only the summed parts, which is all that crosses processes.

    Parameters
    ----------
    rank, num_workers : int, optional
        Both or neither. When given, ``update`` refuses rows whose group another worker owns
        (``owner_of``), because a group split between workers would be counted twice with wrong AUCs.

    Raises
    ------
    ValueError
        Only one of ``rank`` and ``num_workers``, or ``rank`` out of range.
    """

    def __init__(self, rank: int | None = None, num_workers: int | None = None):
        if (rank is None) != (num_workers is None):
            raise ValueError(f"rank and num_workers: give both or neither, got {rank!r} and {num_workers!r}")
        if num_workers is not None:
            owned_mask(np.zeros(0, np.uint64), rank, num_workers)   # validates both
        self.rank, self.num_workers = rank, num_workers
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._counts = np.zeros(len(COUNT_FIELDS), np.int64)     # merged parts of other accumulators
        self._sums = np.zeros(len(SUM_FIELDS), np.float64)
        self._stats: GroupStats | None = None

    def update(self, probs: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> None:
        """Add a batch of rows.

        Parameters
        ----------
        probs : float32[B] or float64[B]
        labels : {0, 1}[B]
        groups : int64[B] or uint64[B]

        Raises
        ------
        ValueError
            As ``group_stats``; or a row's group is owned by another worker (with ``rank`` given).
        """
        p, y, g = _check_inputs(probs, labels, groups)
        if self.num_workers is not None and len(g):
            bad = np.flatnonzero(owner_of(g, self.num_workers) != self.rank)
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"groups: row {i} has group {g[i]} of worker "
                                 f"{int(owner_of(g[i:i + 1], self.num_workers)[0])}, not of this worker "
                                 f"{self.rank}; select each worker's rows with owned_mask(groups, rank, "
                                 f"{self.num_workers})")
        self._chunks.append((p.copy(), y.copy(), g.copy()))
        self._stats = None

    def stats(self) -> GroupStats:
        """Per-group statistics of the rows given to ``update`` (not of merged parts)."""
        if self._stats is None:
            if self._chunks:
                p, y, g = (np.concatenate(a) for a in zip(*self._chunks))
            else:
                p, y, g = np.zeros(0), np.zeros(0, bool), np.zeros(0, np.uint64)
            self._stats = group_stats(p, y, g)
        return self._stats

    def to_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(counts int64[7], sums float64[2])`` (``COUNT_FIELDS``, ``SUM_FIELDS``): this accumulator's
        rows plus everything merged into it, ready for ``PSClient.add_metric``."""
        counts, sums = self.stats().parts()
        return counts + self._counts, sums + self._sums

    @classmethod
    def from_parts(cls, counts: np.ndarray, sums: np.ndarray) -> "GroupMetrics":
        """Inverse of ``to_parts`` (e.g. of the servers' summed accumulator).

        Raises
        ------
        ValueError
            ``counts`` is not int64[7], ``sums`` not float64[2], or a count is negative.
        """
        counts, sums = np.asarray(counts), np.asarray(sums)
        if counts.dtype != np.int64 or counts.shape != (len(COUNT_FIELDS),):
            raise ValueError(f"counts: expected int64[{len(COUNT_FIELDS)}] ({', '.join(COUNT_FIELDS)}), got "
                             f"{counts.dtype}{list(counts.shape)}")
        if sums.dtype != np.float64 or sums.shape != (len(SUM_FIELDS),):
            raise ValueError(f"sums: expected float64[{len(SUM_FIELDS)}] ({', '.join(SUM_FIELDS)}), got "
                             f"{sums.dtype}{list(sums.shape)}")
        if (counts < 0).any():
            raise ValueError(f"counts: expected non-negative counts, got {counts.tolist()}")
        m = cls()
        m._counts, m._sums = counts.copy(), sums.copy()
        return m

    def merge(self, other: "GroupMetrics") -> "GroupMetrics":
        """Add another accumulator's parts into this one; returns self. The two must have seen
        disjoint groups (different workers under ``owner_of``): a group split between them would
        be counted twice, each half with its own AUC."""
        counts, sums = other.to_parts()
        self._counts = self._counts + counts
        self._sums = self._sums + sums
        return self

    def reset(self) -> None:
        """Forget all rows and merged parts."""
        self.__init__(self.rank, self.num_workers)

    def summary(self) -> dict:
        """The metrics of everything seen and merged.

        Returns
        -------
        dict
            ``gauc`` (NaN without a group having both classes), ``uauc`` (unweighted mean of the group
            AUCs, NaN likewise), ``gauc_groups`` (groups used), ``gauc_impressions`` (their rows),
            ``groups``, ``rows``, ``pos_neg_order_ratio`` (``inf`` when no pair is wrong, NaN when no
            pair is right or wrong), ``pairs_right``, ``pairs_wrong``, ``pairs_tied``. NaN and inf
            become null in the metrics file (``engine.programs.ctr_report``).
        """
        counts, sums = self.to_parts()
        c = dict(zip(COUNT_FIELDS, (int(x) for x in counts)))
        used, imps = c["groups_used"], c["impressions_used"]
        right, wrong = c["pairs_right"], c["pairs_wrong"]
        if wrong > 0:
            ratio = right / wrong
        else:
            ratio = float("inf") if right > 0 else float("nan")
        return {"gauc": float(sums[0]) / imps if imps else float("nan"),
                "uauc": float(sums[1]) / used if used else float("nan"),
                "gauc_groups": used, "gauc_impressions": imps, "groups": c["groups"], "rows": c["rows"],
                "pos_neg_order_ratio": ratio, "pairs_right": right, "pairs_wrong": wrong,
                "pairs_tied": c["pairs_tied"]}
