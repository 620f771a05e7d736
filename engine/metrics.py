"""Binary-classification metrics that merge exactly across workers: global AUC from bucketed
prediction histograms, logloss, predicted and actual CTR, COPC.

AUC follows Paddle's ``auc`` operator (and TensorFlow's ``tf.metrics.auc``): predictions fall into
``num_buckets`` equal-width buckets of [0, 1], positives and negatives are counted per bucket, and the
area under the ROC curve is integrated by the trapezoidal rule over bucket boundaries, so ties within
a bucket count one half. Histograms from several workers add up, so the global AUC is computed from
merged counts, never as an average of per-worker AUCs. With 2^20 buckets the result differs from the
exact rank-based AUC by less than 1e-4 on predictions spread over (0, 1) (``tests/unit/test_metrics.py``).
Predictions in one bucket, i.e. closer than 2^-20 = 9.5e-7, count as ties even when they differ: in
particular every ``p < 9.5e-7`` ties with every other such ``p``, and every ``p >= 1 - 9.5e-7``, so rows
whose logits are beyond about -13.9 and +13.9 lose their order. A model that saturates its sigmoid on many
rows reads a lower AUC than the exact one: logits of standard deviation 12 (28% of the rows beyond +-13.9)
gave 0.6779 against the exact 0.6802 (``test_saturated_predictions_tie_in_the_end_buckets``).

COPC (click over predicted click) = actual clicks / sum of predicted probabilities, 1.0 when calibrated.

Accuracy at the threshold 0.5 (predicted class 1 when ``p >= 0.5``) is exact, not an approximation:
with an even ``num_buckets`` 0.5 is a bucket edge, so every bucket lies wholly on one side of it and
the histogram counts the correct predictions exactly (see ``BinaryMetrics.accuracy``).

Per-group metrics (GAUC, the positive/negative order ratio) cannot come from these global histograms:
see ``engine.group_metrics``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._kernels import binary_metrics_update

LOG_EPS = 1e-7


class LabelError(ValueError):
    """A label ``BinaryMetrics`` cannot count: NaN (what a null label reads as) or outside [0, 1].

    Attributes
    ----------
    index : int
        0-based position of the first bad label in the batch passed to ``update``.
    value : float
        That label.
    """

    def __init__(self, index: int, value: float):
        self.index = int(index)
        self.value = float(value)
        got = "nan (a null label reads as NaN)" if value != value else repr(self.value)
        super().__init__(f"labels: expected a label in [0, 1], got {got} at index {self.index}")

    def __reduce__(self):   # picklable across processes with its two arguments
        return LabelError, (self.index, self.value)


@dataclass
class BinaryMetrics:
    """Mergeable accumulator of predictions and labels.

    Parameters
    ----------
    num_buckets : int
        Histogram resolution of predicted probabilities (default 2^20: 16 MiB of counters).
    """

    num_buckets: int = 1 << 20

    def __post_init__(self) -> None:
        self.pos = np.zeros(self.num_buckets, np.int64)
        self.neg = np.zeros(self.num_buckets, np.int64)
        self.count = 0
        self.loss_sum = 0.0
        self.pred_sum = 0.0
        self.label_sum = 0.0

    def update(self, probs: np.ndarray, labels: np.ndarray) -> None:
        """Add a batch. probs : float[B] in [0, 1]; labels : float[B] in [0, 1] (0/1 clicks; a soft label
        counts as positive above 0.5 and enters the logloss as it is). Nothing is added when it raises.

        Raises
        ------
        LabelError
            A label is NaN (a null label read with ``to_numpy``) or outside [0, 1]; names its index.
        ValueError
            Shapes differ, or a probability is outside [0, 1] or NaN.
        """
        probs = np.ascontiguousarray(probs).ravel()
        labels = np.ascontiguousarray(labels).ravel()
        if probs.dtype not in (np.float32, np.float64):
            probs = probs.astype(np.float64)
        if labels.dtype not in (np.float32, np.float64):
            labels = labels.astype(np.float64)
        if probs.shape != labels.shape:
            raise ValueError(f"probs and labels: expected equal lengths, got {len(probs)} and {len(labels)}")
        bad_label = ~((labels >= 0) & (labels <= 1))
        if bad_label.any():
            i = int(np.flatnonzero(bad_label)[0])
            raise LabelError(i, labels[i])
        bad, loss, psum, ysum = binary_metrics_update(probs, labels, self.pos, self.neg, LOG_EPS)
        if bad >= 0:
            raise ValueError(f"probs: expected probabilities in [0, 1], got {probs[bad]} at index {bad}")
        self.loss_sum += loss
        self.pred_sum += psum
        self.label_sum += ysum
        self.count += len(probs)

    def merge(self, other: "BinaryMetrics") -> "BinaryMetrics":
        """Add another accumulator's counts into this one (same num_buckets); returns self."""
        if other.num_buckets != self.num_buckets:
            raise ValueError(f"num_buckets: expected {self.num_buckets}, got {other.num_buckets}")
        self.pos += other.pos
        self.neg += other.neg
        self.count += other.count
        self.loss_sum += other.loss_sum
        self.pred_sum += other.pred_sum
        self.label_sum += other.label_sum
        return self

    def to_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole state, exactly, for shipping between processes: ``counts : int64[1 + 2 *
        num_buckets]`` (``[count, pos..., neg...]``) and ``sums : float64[3]`` (logloss, predicted and
        actual label sums). Integer counts never round (a float32 sum stops counting at 2^24 examples)."""
        counts = np.empty(1 + 2 * self.num_buckets, np.int64)
        counts[0] = self.count
        counts[1:1 + self.num_buckets] = self.pos
        counts[1 + self.num_buckets:] = self.neg
        return counts, np.array([self.loss_sum, self.pred_sum, self.label_sum], np.float64)

    @classmethod
    def from_parts(cls, counts: np.ndarray, sums: np.ndarray) -> "BinaryMetrics":
        """Inverse of ``to_parts``.

        Raises
        ------
        ValueError
            ``counts`` is not int64[1 + 2 * nb] or ``sums`` not float64[3].
        """
        if counts.dtype != np.int64 or counts.ndim != 1 or len(counts) < 3 or len(counts) % 2 != 1:
            raise ValueError(f"counts: expected int64[1 + 2 * num_buckets], got {counts.dtype}{list(counts.shape)}")
        if sums.shape != (3,):
            raise ValueError(f"sums: expected float64[3], got {sums.dtype}{list(sums.shape)}")
        nb = (len(counts) - 1) // 2
        m = cls(nb)
        m.count = int(counts[0])
        m.pos = counts[1:1 + nb].copy()
        m.neg = counts[1 + nb:].copy()
        m.loss_sum, m.pred_sum, m.label_sum = (float(x) for x in sums)
        return m

    def auc(self) -> float:
        """Area under the ROC curve; NaN when only one class has been seen."""
        pos = self.pos[::-1].astype(np.float64)  # from the highest score down
        neg = self.neg[::-1].astype(np.float64)
        tp, fp = pos.sum(), neg.sum()
        if tp == 0 or fp == 0:
            return float("nan")
        cum_pos_before = np.cumsum(pos) - pos
        # each negative in a bucket ranks below every positive of higher buckets and ties half of its own
        area = np.sum(neg * (cum_pos_before + 0.5 * pos))
        return float(area / (tp * fp))

    def accuracy(self) -> float:
        """Fraction of examples classified right at the threshold 0.5: predicted positive when
        ``p >= 0.5``, positive when ``label > 0.5`` (for 0/1 labels this is
        ``sklearn.metrics.accuracy_score(labels, probs >= 0.5)``). NaN when nothing has been seen or
        ``num_buckets`` is odd.

        Exact, because 0.5 is a bucket edge when ``nb = num_buckets`` is even: the bucket of ``p`` is
        ``min(floor(fl(p * nb)), nb - 1)`` (``fl``: float64 rounding; float32 inputs widen exactly), and
        ``p >= 0.5`` if and only if that bucket is ``>= nb / 2``. For ``p >= 0.5``, ``fl(p * nb) >= nb / 2``
        since rounding is monotone and ``nb / 2`` is a double. For ``p < 0.5``, ``p <= 0.5 - 2^-54``, so the
        exact product is at least ``(nb / 2) * 2^-53`` below ``nb / 2``: more than half a unit in the last
        place of the doubles just below ``nb / 2`` (or exact, when ``nb / 2`` is a power of two), so it
        rounds below ``nb / 2``. Hence ``accuracy = (positives in buckets >= nb/2 + negatives in buckets <
        nb/2) / count`` counts every example on its own side, whatever the resolution; it merges exactly
        across workers like the histograms. With an odd ``num_buckets`` the middle bucket straddles 0.5
        and NaN is returned rather than a rounded answer.
        """
        if self.count == 0 or self.num_buckets % 2:
            return float("nan")
        half = self.num_buckets // 2
        correct = int(self.pos[half:].sum()) + int(self.neg[:half].sum())
        return correct / self.count

    def summary(self) -> dict:
        """``auc``, ``logloss``, ``pred_ctr``, ``actual_ctr``, ``copc``, ``accuracy`` (at 0.5, exact),
        ``count``. With nothing seen (``count`` 0) every mean is NaN, not 0 (a logloss of 0 is a perfect
        score; ``engine eval`` of an empty test split printed it)."""
        n = self.count if self.count > 0 else float("nan")
        return {"auc": self.auc(), "logloss": self.loss_sum / n, "pred_ctr": self.pred_sum / n,
                "actual_ctr": self.label_sum / n,
                "copc": self.label_sum / self.pred_sum if self.pred_sum > 0 else float("nan"),
                "accuracy": self.accuracy(), "count": self.count}
