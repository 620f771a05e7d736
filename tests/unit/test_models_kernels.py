"""models._kernels against slow, obviously correct numpy references.

All tests here are small and marked ``nojit`` so they also run with NUMBA_DISABLE_JIT=1.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models import _kernels as K

pytestmark = pytest.mark.nojit


# ---------------------------------------------------------------- naive references
def naive_pool(emb, rows, segments, src_col, width, num_slots, batch):
    out = np.zeros((batch, num_slots * width), emb.dtype)
    for r, c in zip(rows, segments):
        b, s = divmod(int(c), num_slots)
        out[b, s * width:(s + 1) * width] += emb[r, src_col:src_col + width]
    return out


def naive_scatter(grad, rows, segments, src_col, width, num_slots, u, row_width, dst_col):
    ge = np.zeros((u, row_width), grad.dtype)
    for r, c in zip(rows, segments):
        b, s = divmod(int(c), num_slots)
        base = src_col + s * width
        ge[r, dst_col:dst_col + width] += grad[b, base:base + width]
    return ge


@st.composite
def sparse_batches(draw):
    batch = draw(st.integers(1, 4))
    num_slots = draw(st.integers(1, 3))
    u = draw(st.integers(1, 5))
    nnz = draw(st.integers(0, 12))
    rows = draw(st.lists(st.integers(0, u - 1), min_size=nnz, max_size=nnz))
    segs = draw(st.lists(st.integers(0, batch * num_slots - 1), min_size=nnz, max_size=nnz))
    seed = draw(st.integers(0, 2**31))
    return batch, num_slots, u, np.array(rows, np.int32), np.array(segs, np.int32), seed


# ---------------------------------------------------------------- pool / scatter
@settings(max_examples=60, deadline=None)
@given(sparse_batches(), st.integers(1, 3), st.integers(0, 2), st.integers(0, 2))
def test_pool_sum_matches_naive(sb, width, src_col, dst_col):
    batch, num_slots, u, rows, segs, seed = sb
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(u, src_col + width + 1)).astype(np.float32)
    out = np.full((batch, dst_col + num_slots * width + 2), 7.0, np.float32)
    assert K.pool_sum(emb, rows, segs, src_col, width, num_slots, out, dst_col) == -1
    want = naive_pool(emb, rows, segs, src_col, width, num_slots, batch)
    np.testing.assert_allclose(out[:, dst_col:dst_col + num_slots * width], want, rtol=1e-6,
                               atol=1e-6)
    # columns outside the pooled block are untouched
    assert np.all(out[:, :dst_col] == 7.0)
    assert np.all(out[:, dst_col + num_slots * width:] == 7.0)


@settings(max_examples=60, deadline=None)
@given(sparse_batches(), st.integers(1, 3), st.integers(0, 2), st.integers(0, 2))
def test_scatter_add_matches_naive(sb, width, src_col, dst_col):
    batch, num_slots, u, rows, segs, seed = sb
    rng = np.random.default_rng(seed)
    grad = rng.normal(size=(batch, src_col + num_slots * width)).astype(np.float64)
    row_width = dst_col + width + 1
    ge = np.zeros((u, row_width))
    assert K.scatter_add(grad, rows, segs, src_col, width, num_slots, ge, dst_col) == -1
    want = naive_scatter(grad, rows, segs, src_col, width, num_slots, u, row_width, dst_col)
    np.testing.assert_allclose(ge, want, rtol=1e-12, atol=1e-12)


def test_scatter_add_accumulates():
    grad = np.ones((1, 2))
    ge = np.full((1, 2), 5.0)
    K.scatter_add(grad, np.array([0, 0], np.int32), np.array([0, 0], np.int32), 0, 2, 1, ge, 0)
    np.testing.assert_array_equal(ge, [[7.0, 7.0]])


def test_pool_is_adjoint_of_scatter():
    # <pool(E), G> == <E, scatter(G)> for any E, G: the backward is the transpose of the forward.
    rng = np.random.default_rng(3)
    batch, num_slots, width, u = 3, 2, 3, 4
    rows = np.array([0, 1, 1, 3, 2, 0, 0], np.int32)
    segs = np.array([0, 0, 1, 2, 3, 5, 5], np.int32)
    emb = rng.normal(size=(u, width))
    grad = rng.normal(size=(batch, num_slots * width))
    out = np.empty((batch, num_slots * width))
    K.pool_sum(emb, rows, segs, 0, width, num_slots, out, 0)
    ge = np.zeros((u, width))
    K.scatter_add(grad, rows, segs, 0, width, num_slots, ge, 0)
    assert math.isclose(float((out * grad).sum()), float((emb * ge).sum()), rel_tol=1e-12)


@pytest.mark.parametrize("kernel", ["pool", "scatter"])
@pytest.mark.parametrize("rows,segs,bad", [
    ([0, 5], [0, 1], 1),      # row out of range
    ([0, -1], [0, 1], 1),     # negative row
    ([0, 1], [4, 1], 0),      # cell >= B*S
    ([0, 1], [0, -2], 1),     # negative cell
])
def test_out_of_range_index_is_reported(kernel, rows, segs, bad):
    rows = np.array(rows, np.int32)
    segs = np.array(segs, np.int32)
    emb = np.ones((2, 2), np.float32)
    buf = np.zeros((2, 4), np.float32)  # B=2, S=2, width 2
    if kernel == "pool":
        got = K.pool_sum(emb, rows, segs, 0, 2, 2, buf, 0)
    else:
        got = K.scatter_add(buf, rows, segs, 0, 2, 2, emb, 0)
    assert got == bad


# ---------------------------------------------------------------- elementwise kernels
def test_bias_relu_and_backward():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(4, 5))
    b = rng.normal(size=5)
    h = z.copy()
    K.bias_relu(h, b)
    np.testing.assert_allclose(h, np.maximum(z + b, 0))
    d = rng.normal(size=(4, 5))
    d0 = d.copy()
    gb = np.full(5, 99.0)
    K.relu_backward_bias(d, h, gb)
    want = d0 * (z + b > 0)
    np.testing.assert_allclose(d, want)
    np.testing.assert_allclose(gb, want.sum(axis=0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_xent_stable_and_correct(dtype):
    z = np.array([-1000.0, -30.0, -1.5, 0.0, 0.7, 30.0, 1000.0], dtype)
    y = np.array([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0], dtype)
    prob = np.empty_like(z)
    grad = np.empty_like(z)
    total = K.sigmoid_xent(z, y, 0.5, prob, grad)
    zz = z.astype(np.float64)
    p_ref = np.array([1 / (1 + math.exp(-v)) if v > -700 else 0.0 for v in zz])
    loss_ref = [max(v, 0) - v * t + math.log1p(math.exp(-abs(v))) for v, t in zip(zz, y)]
    np.testing.assert_allclose(prob, p_ref, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(grad, (p_ref - y) * 0.5, rtol=1e-6, atol=1e-7)
    assert math.isclose(total, sum(loss_ref), rel_tol=1e-6)
    assert np.all(np.isfinite(prob)) and math.isfinite(total)
    p2 = np.empty_like(z)
    K.sigmoid(z, p2)
    np.testing.assert_array_equal(p2, prob)


def test_sigmoid_xent_of_float32_arrays_computes_in_float64():
    """The docstring's promise for float32 inputs (the training dtype): every term in float64, rounded
    once when stored. With ``float(z[i])`` Numba kept float32 and the loss had float32 precision per
    example (7000.0 for z = 1e4 with the soft label 0.3 instead of 6999.99988...)."""
    z = np.array([-1e4, -100.0, -17.5, -3.25, 0.7, 5.0, 17.5, 100.0, 1e4], np.float32)
    y = np.array([0.3, 1.0, 0.0, 1.0, 0.0, 0.3, 1.0, 0.0, 0.3], np.float32)
    prob = np.empty_like(z)
    grad = np.empty_like(z)
    total = K.sigmoid_xent(z, y, 0.25, prob, grad)
    zz, yy = z.astype(np.float64), y.astype(np.float64)
    loss_ref = np.logaddexp(0.0, zz) - zz * yy           # float64 reference, exactly the float32 inputs
    p_ref = np.exp(-np.logaddexp(0.0, -zz))
    assert math.isclose(total, math.fsum(loss_ref), rel_tol=1e-13)
    np.testing.assert_allclose(prob, p_ref.astype(np.float32), rtol=1e-7, atol=0)
    np.testing.assert_allclose(grad, ((p_ref - yy) * 0.25).astype(np.float32), rtol=1e-7, atol=0)
    p2 = np.empty_like(z)
    K.sigmoid(z, p2)
    np.testing.assert_array_equal(p2, prob)


def test_fm_forward_backward_matches_naive():
    rng = np.random.default_rng(1)
    batch, num_slots, dim, col0 = 3, 4, 2, 1
    x = rng.normal(size=(batch, col0 + num_slots * dim + 2))
    sum_v = np.empty((batch, dim))
    out = np.empty(batch)
    K.fm_forward(x, num_slots, dim, col0, sum_v, out)
    v = x[:, col0:col0 + num_slots * dim].reshape(batch, num_slots, dim)
    pair = np.zeros(batch)
    for i in range(num_slots):
        for j in range(i + 1, num_slots):
            pair += (v[:, i] * v[:, j]).sum(axis=1)
    np.testing.assert_allclose(out, pair, rtol=1e-12)
    np.testing.assert_allclose(sum_v, v.sum(axis=1))
    g = rng.normal(size=batch)
    dx = np.ones((batch, num_slots * dim))
    K.fm_backward(g, x, num_slots, dim, col0, sum_v, dx)
    want = 1.0 + g[:, None, None] * (v.sum(axis=1, keepdims=True) - v)
    np.testing.assert_allclose(dx, want.reshape(batch, -1), rtol=1e-12)


def test_adam_and_sgd_kernels_match_naive():
    rng = np.random.default_rng(2)
    p = rng.normal(size=6).astype(np.float32)
    m = np.zeros(6, np.float32)
    v = np.zeros(6, np.float32)
    pr, mr, vr = p.astype(np.float64), np.zeros(6), np.zeros(6)
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    for t in range(1, 4):
        g = rng.normal(size=6).astype(np.float32)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        K.adam_update(p, g, m, v, lr / bc1, 1 / math.sqrt(bc2), b1, b2, eps)
        mr = b1 * mr + (1 - b1) * g
        vr = b2 * vr + (1 - b2) * g * g
        pr = pr - lr * (mr / bc1) / (np.sqrt(vr / bc2) + eps)
    np.testing.assert_allclose(p, pr, rtol=1e-5, atol=1e-6)
    g = np.ones(6, np.float32)
    before = p.copy()
    K.sgd_update(p, g, 0.25)
    np.testing.assert_allclose(p, before - 0.25)
