"""The serving predictor's kernels against obviously correct numpy: the key index, the fused
lookup + pooling of one-key-per-cell inputs (float32 and float16 rows), float16 decoding, and the
pooled-input forward pass of the models."""
from __future__ import annotations

import numpy as np
import pytest

from engine.export import _kernels as K
from models import build_model

pytestmark = pytest.mark.nojit


def _index(keys):
    slots = K.new_index(len(keys))
    assert K.build_index(keys, slots) == -1
    return slots


def _naive_pool(keys, num_slots, table_keys, values):
    """out[b, s*w:(s+1)*w] = row of keys[b*S+s] (zeros if absent), by a dict."""
    pos = {int(k): i for i, k in enumerate(table_keys)}
    w = values.shape[1]
    B = len(keys) // num_slots
    out = np.zeros((B, num_slots * w), np.float32)
    for i, k in enumerate(keys):
        r = pos.get(int(k))
        if r is not None:
            b, s = divmod(i, num_slots)
            out[b, s * w:(s + 1) * w] = values[r].astype(np.float32)
    return out


@pytest.mark.parametrize("half", [False, True])
def test_lookup_pool_fixed_matches_naive(half):
    rng = np.random.default_rng(3)
    table_keys = np.unique(rng.integers(0, 2**62, 5200).astype(np.uint64))[:5000]
    rng.shuffle(table_keys)
    values = rng.normal(size=(5000, 4)).astype(np.float16 if half else np.float32)
    S, B = 3, 1500   # 4500 occurrences: more than one block of FIXED_BLOCK, not a multiple of S
    known = table_keys[rng.integers(0, 5000, B * S)]
    unknown = rng.integers(0, 2**62, B * S).astype(np.uint64) | np.uint64(1 << 63)
    keys = np.where(rng.random(B * S) < 0.2, unknown, known)
    slots = _index(table_keys)
    out = np.full((B, S * 4 + 2), 7.0, np.float32)       # extra columns must stay untouched
    raw = values.view(np.uint16) if half else values
    table = K.half_table() if half else np.empty(0, np.float32)
    hits = K.lookup_pool_fixed(keys, S, slots, raw, table, out, np.empty(B * S, np.int64))
    np.testing.assert_array_equal(out[:, :S * 4], _naive_pool(keys, S, table_keys, values))
    assert np.all(out[:, S * 4:] == 7.0)
    assert hits == int(np.isin(keys, table_keys).sum())


def test_lookup_gather_and_find_rows_match_naive():
    rng = np.random.default_rng(4)
    table_keys = rng.choice(2**40, 3000, replace=False).astype(np.uint64)
    values = rng.normal(size=(3000, 3)).astype(np.float32)
    slots = _index(table_keys)
    keys = np.concatenate([table_keys[::7], np.arange(2**41, 2**41 + 50, dtype=np.uint64)])
    out = np.empty((len(keys), 3), np.float32)
    assert K.lookup_gather(keys, slots, values, out) == len(table_keys[::7])
    np.testing.assert_array_equal(out, _naive_pool(keys, 1, table_keys, values))
    rows = np.empty(len(keys), np.int64)
    K.find_rows(keys, slots, rows)
    np.testing.assert_array_equal(rows[:len(table_keys[::7])], np.arange(0, 3000, 7))
    assert np.all(rows[len(table_keys[::7]):] == -1)


def test_build_index_reports_duplicate_key():
    keys = np.array([5, 9, 5], np.uint64)
    assert K.build_index(keys, K.new_index(3)) == 2


def test_half_table_every_pattern():
    want = np.array([float(np.uint16(b).view(np.float16)) for b in range(1 << 16)], np.float32)
    got = K.half_table()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # signed zeros too


@pytest.mark.parametrize("kind", ["ctr_dnn", "deepfm"])
def test_predict_pooled_equals_predict(kind):
    """One key per cell: pooling = the rows themselves, so both entry points compute the same."""
    m = build_model(kind, num_slots=4, dim=3, dense_dim=2, hidden=(8, 5), seed=1)
    rng = np.random.default_rng(5)
    B, S, w = 6, 4, m.sparse_width
    emb = rng.normal(size=(B * S, w)).astype(np.float32)
    cells = np.arange(B * S, dtype=np.int32)
    dense = rng.random((B, 2), dtype=np.float32)
    want = m.predict(emb, cells, cells, dense)
    pooled = emb.reshape(B, S * w)
    np.testing.assert_array_equal(m.predict_pooled(pooled.copy(), dense), want)
    buf = m.pooled_input(B)                  # the in-place buffer gives the same result
    buf[...] = pooled
    np.testing.assert_array_equal(m.predict_pooled(buf, dense), want)


def test_predict_pooled_rejects_bad_shapes():
    from models import ModelInputError
    m = build_model("ctr_dnn", num_slots=2, dim=3, dense_dim=1, hidden=(4,))
    with pytest.raises(ModelInputError, match="pooled: expected float32\\[2, 6\\]"):
        m.predict_pooled(np.zeros((2, 5), np.float32), np.zeros((2, 1), np.float32))
    with pytest.raises(ModelInputError, match="dense_x"):
        m.predict_pooled(np.zeros((2, 6), np.float32), np.zeros((2, 2), np.float32))
