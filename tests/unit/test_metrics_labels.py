"""``BinaryMetrics.update`` refuses labels it cannot count (NaN, which is what a null label reads as, and
values outside [0, 1]) with a ``LabelError`` naming the index, adds nothing then, and still accepts 0/1
clicks of any numeric dtype and soft labels in [0, 1]."""
from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest

from engine.metrics import BinaryMetrics, LabelError


@pytest.mark.parametrize("bad,shown", [(np.nan, "nan (a null label reads as NaN)"), (7.0, "7.0"), (-1.0, "-1.0"),
                                       (np.inf, "inf")])
def test_bad_label_raises_naming_index_and_adds_nothing(bad, shown):
    m = BinaryMetrics(64)
    m.update(np.array([0.2, 0.9], np.float32), np.array([0.0, 1.0], np.float32))
    before = (m.count, m.loss_sum, m.pos.copy(), m.neg.copy())
    labels = np.array([1.0, 0.0, bad, np.nan], np.float64)
    with pytest.raises(LabelError) as ei:
        m.update(np.array([0.1, 0.2, 0.3, 0.4]), labels)
    assert isinstance(ei.value, ValueError)
    assert ei.value.index == 2 and str(ei.value) == f"labels: expected a label in [0, 1], got {shown} at index 2"
    assert (m.count, m.loss_sum) == before[:2]
    np.testing.assert_array_equal(m.pos, before[2])
    np.testing.assert_array_equal(m.neg, before[3])


def test_null_label_read_from_arrow_is_refused():
    labels = pa.array([0.0, None, 1.0], pa.float32()).to_numpy(zero_copy_only=False)
    with pytest.raises(LabelError, match="at index 1"):
        BinaryMetrics(64).update(np.array([0.5, 0.5, 0.5]), labels)


def test_label_error_pickles():
    e = pickle.loads(pickle.dumps(LabelError(5, 7.0)))
    assert isinstance(e, LabelError) and e.index == 5 and e.value == 7.0 and "got 7.0 at index 5" in str(e)


def test_integer_bool_and_soft_labels_are_accepted():
    m = BinaryMetrics(64)
    m.update(np.array([0.2, 0.8]), np.array([0, 1], np.int64))
    m.update(np.array([0.2, 0.8]), np.array([False, True]))
    m.update(np.array([0.2, 0.8]), np.array([0.25, 1.0], np.float32))
    assert m.count == 6 and m.summary()["auc"] == 1.0


def test_bad_probability_still_a_plain_value_error():
    with pytest.raises(ValueError, match="probs: expected probabilities") as ei:
        BinaryMetrics(64).update(np.array([0.5, np.nan]), np.array([0.0, 1.0]))
    assert not isinstance(ei.value, LabelError)
