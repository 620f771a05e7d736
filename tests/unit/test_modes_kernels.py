"""GEO replica kernels against numpy: changed rows and their scaled deltas, and the row refresh."""
from __future__ import annotations

import numpy as np
import pytest

from engine.modes._kernels import replica_deltas, set_replica_rows

pytestmark = pytest.mark.nojit


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_replica_deltas_match_numpy(scale):
    rng = np.random.default_rng(0)
    synced = rng.normal(size=(300, 7)).astype(np.float32)
    local = synced.copy()
    touched = rng.choice(300, 40, replace=False)
    local[touched, rng.integers(0, 7, 40)] += rng.normal(size=40).astype(np.float32)
    local[5, 3] = np.nan                                          # NaN differs from everything
    changed = np.empty(300, np.int64)
    deltas = np.empty_like(local)
    n = replica_deltas(local, synced, np.float32(scale), changed, deltas)
    want = np.flatnonzero((local != synced).any(axis=1))
    np.testing.assert_array_equal(changed[:n], want)
    ref = local[want] - synced[want]
    if scale != 1:
        ref *= np.float32(scale)
    np.testing.assert_array_equal(deltas[:n], ref)


def test_set_replica_rows_writes_both_copies():
    local = np.zeros((10, 3), np.float32)
    synced = np.ones((10, 3), np.float32)
    rows = np.array([7, 2], np.int64)
    vals = np.arange(6, dtype=np.float32).reshape(2, 3)
    set_replica_rows(local, synced, rows, vals)
    for a in (local, synced):
        np.testing.assert_array_equal(a[[7, 2]], vals)
    assert (local[[0, 1, 3, 4, 5, 6, 8, 9]] == 0).all() and (synced[[0, 1, 3, 4, 5, 6, 8, 9]] == 1).all()
