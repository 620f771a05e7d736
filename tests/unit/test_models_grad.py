"""CTR-DNN and DeepFM: forward against a naive reference, backward against finite differences,
float32 against float64, input errors and the dense-parameter API."""
from __future__ import annotations

import re

import numpy as np
import pytest

from models import CTRDNN, DeepFM, ModelConfigError, ModelInputError, build_model

KINDS = ["ctr_dnn", "deepfm"]
S, DIM, DENSE, HIDDEN = 3, 4, 2, (8, 6)

# B=5 examples, S=3 slots, 7 unique rows (row 6 is unused, its gradient must be zero).
# Duplicate keys across examples (rows 0, 1, 3), a multi-valued cell (ex0 slot1 = {1, 2}),
# one key twice in a cell (ex2 slot2 = {3, 3}) and empty cells (ex1 slot2, ex4 slot1).
CELLS = {
    (0, 0): [0], (0, 1): [1, 2], (0, 2): [3],
    (1, 0): [0], (1, 1): [4], (1, 2): [],
    (2, 0): [5], (2, 1): [1], (2, 2): [3, 3],
    (3, 0): [0], (3, 1): [2], (3, 2): [5],
    (4, 0): [1], (4, 1): [], (4, 2): [4],
}
U, B = 7, 5


def sparse_index():
    rows, segs = [], []
    for (b, s), keys in CELLS.items():
        for k in keys:
            rows.append(k)
            segs.append(b * S + s)
    return np.array(rows, np.int32), np.array(segs, np.int32)


def make_batch(model, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    emb = rng.normal(0, 0.5, size=(U, model.sparse_width)).astype(dtype)
    rows, segs = sparse_index()
    dense_x = rng.normal(size=(B, DENSE)).astype(dtype)
    labels = np.array([1, 0, 0, 1, 1], dtype)
    return emb, rows, segs, dense_x, labels


def small(kind, dtype=np.float64, seed=1, **kw):
    args = dict(num_slots=S, dim=DIM, dense_dim=DENSE, hidden=HIDDEN, seed=seed, dtype=dtype)
    args.update(kw)
    m = build_model(kind, **args)
    if kind == "deepfm":  # non-zero linear part so its gradient path is exercised
        p = m.get_dense()
        v = m.dense_views()
        p[: v["linear.weight"].size + 1] = np.linspace(-0.3, 0.4, v["linear.weight"].size + 1)
        m.set_dense(p)
    return m


# ---------------------------------------------------------------- naive forward reference
def naive_logits(model, emb, dense_x):
    p = model.dense_views()
    off = 1 if model.kind == "deepfm" else 0
    out = np.zeros(B)
    for b in range(B):
        v = np.zeros((S, model.dim))
        w1 = np.zeros(S)
        for s in range(S):
            for k in CELLS[(b, s)]:
                v[s] += emb[k, off:off + model.dim]
                if off:
                    w1[s] += emb[k, 0]
        h = np.concatenate([v.ravel(), dense_x[b]])
        for i in range(len(model.hidden)):
            h = np.maximum(h @ p[f"fc{i}.weight"] + p[f"fc{i}.bias"], 0)
        z = float(h @ p["out.weight"][:, 0] + p["out.bias"][0])
        if off:
            z += w1.sum() + dense_x[b] @ p["linear.weight"] + p["linear.bias"][0]
            for i in range(S):
                for j in range(i + 1, S):
                    z += v[i] @ v[j]
        out[b] = z
    return out


@pytest.mark.nojit
@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_naive(kind):
    m = small(kind)
    emb, rows, segs, dense_x, labels = make_batch(m)
    z = m.logits(emb, rows, segs, dense_x)
    np.testing.assert_allclose(z, naive_logits(m, emb, dense_x), rtol=1e-12, atol=1e-12)
    probs = m.predict(emb, rows, segs, dense_x)
    np.testing.assert_allclose(probs, 1 / (1 + np.exp(-z)), rtol=1e-12)
    r = m.forward_backward(emb, rows, segs, dense_x, labels)
    np.testing.assert_allclose(r.probs, probs, rtol=1e-12)
    ref_loss = np.mean(np.logaddexp(0, z) - labels * z)
    assert r.loss == pytest.approx(ref_loss, rel=1e-12)


# ---------------------------------------------------------------- finite differences
def fd_check(m, emb, rows, segs, dense_x, labels, eps=1e-6):
    r = m.forward_backward(emb, rows, segs, dense_x, labels)

    def loss_at():
        return m.forward_backward(emb, rows, segs, dense_x, labels).loss

    num_emb = np.zeros_like(emb)
    for idx in np.ndindex(*emb.shape):
        old = emb[idx]
        emb[idx] = old + eps
        lp = loss_at()
        emb[idx] = old - eps
        lm = loss_at()
        emb[idx] = old
        num_emb[idx] = (lp - lm) / (2 * eps)
    np.testing.assert_allclose(r.grad_emb, num_emb, rtol=1e-5, atol=1e-8)

    base = m.get_dense()
    num_dense = np.zeros_like(base)
    for i in range(base.size):
        p = base.copy()
        p[i] += eps
        m.set_dense(p)
        lp = loss_at()
        p[i] -= 2 * eps
        m.set_dense(p)
        lm = loss_at()
        num_dense[i] = (lp - lm) / (2 * eps)
    m.set_dense(base)
    np.testing.assert_allclose(r.grad_dense, num_dense, rtol=1e-5, atol=1e-8)
    return r


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden", [pytest.param(HIDDEN, marks=pytest.mark.nojit), (5,), ()])
def test_gradients_match_finite_differences(kind, hidden):
    m = small(kind, hidden=hidden)
    emb, rows, segs, dense_x, labels = make_batch(m, seed=len(hidden))
    r = fd_check(m, emb, rows, segs, dense_x, labels)
    assert np.all(r.grad_emb[6] == 0)                    # unused row
    assert np.abs(r.grad_emb[:6]).sum(axis=1).min() > 0  # every used row gets a gradient


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_with_soft_labels_and_no_dense(kind):
    m = small(kind, dense_dim=0)
    rng = np.random.default_rng(5)
    emb = rng.normal(0, 0.5, size=(U, m.sparse_width))
    rows, segs = sparse_index()
    fd_check(m, emb, rows, segs, np.zeros((B, 0)), rng.uniform(size=B))


def test_deepfm_first_order_gradient_is_dlogit_per_occurrence():
    m = small("deepfm")
    emb, rows, segs, dense_x, labels = make_batch(m)
    r = m.forward_backward(emb, rows, segs, dense_x, labels)
    dz = (r.probs - labels) / B
    want = np.zeros(U)
    np.add.at(want, rows, dz[segs // S])
    np.testing.assert_allclose(r.grad_emb[:, 0], want, rtol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_matches_float64(kind):
    m64 = small(kind)
    m32 = small(kind, dtype=np.float32)
    m32.set_dense(m64.get_dense())
    emb, rows, segs, dense_x, labels = make_batch(m64)
    r64 = m64.forward_backward(emb, rows, segs, dense_x, labels)
    r32 = m32.forward_backward(emb.astype(np.float32), rows, segs, dense_x.astype(np.float32),
                               labels.astype(np.float32))
    for a in (r32.probs, r32.grad_emb, r32.grad_dense):
        assert a.dtype == np.float32
    assert r32.loss == pytest.approx(r64.loss, rel=1e-5)
    np.testing.assert_allclose(r32.probs, r64.probs, rtol=1e-5)
    np.testing.assert_allclose(r32.grad_emb, r64.grad_emb, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(r32.grad_dense, r64.grad_dense, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_size_change_reuses_nothing_stale(kind):
    m = small(kind)
    emb, rows, segs, dense_x, labels = make_batch(m)
    r1 = m.forward_backward(emb, rows, segs, dense_x, labels)
    # a 2-example batch made of the first two examples, then the full batch again
    keep = segs < 2 * S
    r2 = m.forward_backward(emb, rows[keep], segs[keep], dense_x[:2], labels[:2])
    np.testing.assert_allclose(r2.probs, r1.probs[:2], rtol=1e-12)
    r3 = m.forward_backward(emb, rows, segs, dense_x, labels)
    np.testing.assert_array_equal(r3.grad_dense, r1.grad_dense)
    np.testing.assert_array_equal(r3.grad_emb, r1.grad_emb)
    assert r3.probs is not r1.probs


# ---------------------------------------------------------------- dense parameter API
@pytest.mark.parametrize("kind", KINDS)
def test_dense_api_and_deterministic_init(kind):
    a = build_model(kind, num_slots=26, dim=10, dense_dim=13, hidden=(400, 400, 400), seed=7)
    b = build_model(kind, num_slots=26, dim=10, dense_dim=13, hidden=(400, 400, 400), seed=7)
    c = build_model(kind, num_slots=26, dim=10, dense_dim=13, hidden=(400, 400, 400), seed=8)
    np.testing.assert_array_equal(a.get_dense(), b.get_dense())
    assert not np.array_equal(a.get_dense(), c.get_dense())
    v = a.get_dense()
    assert v.dtype == np.float32 and v.shape == (a.dense_size,)
    n_tower = 273 * 400 + 400 + 2 * (400 * 400 + 400) + 401
    assert a.dense_size == n_tower + (14 if kind == "deepfm" else 0)
    assert a.sparse_width == (11 if kind == "deepfm" else 10)
    w0 = a.dense_views()["fc0.weight"]
    assert w0.shape == (273, 400)
    assert abs(w0.std() - np.sqrt(2 / 273)) < 0.01      # He-normal
    v[:] = 0.5
    assert not np.any(a.get_dense() == 0.5)             # get_dense is a copy
    a.set_dense(v)
    assert np.all(a.dense_views()["fc1.bias"] == 0.5)   # views see set_dense
    assert a.dense_params.base is None or a.dense_params.size == a.dense_size
    rebuilt = build_model(**a.config())
    np.testing.assert_array_equal(rebuilt.get_dense(), b.get_dense())


# ---------------------------------------------------------------- input errors
@pytest.mark.parametrize("kind", KINDS)
def test_input_errors_name_the_argument(kind):
    m = small(kind, dtype=np.float32)
    emb, rows, segs, dense_x, labels = (a.astype(np.float32) if a.dtype.kind == "f" else a
                                        for a in make_batch(m))
    cases = [
        ((emb.astype(np.float64), rows, segs, dense_x, labels), "emb: expected float32"),
        ((emb[:, :-1], rows, segs, dense_x, labels), "emb: expected"),
        ((emb, rows.astype(np.int64), segs, dense_x, labels), "rows: expected int32[nnz], got int64"),
        ((emb, rows, segs[:-1], dense_x, labels), "segments: expected int32"),
        ((emb, rows, segs, dense_x[:, :1], labels), "dense_x: expected float32"),
        ((emb, rows, segs, dense_x[:0], labels[:0]), "dense_x: expected"),
        ((emb, rows, segs, dense_x, labels[:3]), "labels: expected float32[5]"),
        ((emb, rows, segs, dense_x, labels + 1), "labels: expected values in [0, 1], got 2"),
        ((emb[:4], rows, segs, dense_x, labels), "expected an index in [0, 4)"),
        ((emb, rows, segs + 3, dense_x, labels), "expected a cell id in [0, 15)"),
        ((emb, rows, segs, [[0.0, 0.0]] * 5, labels), "dense_x: expected float32[B, 2]"),
    ]
    for args, msg in cases:
        with pytest.raises(ModelInputError, match=re.escape(msg)):
            m.forward_backward(*args)
    with pytest.raises(ValueError, match="rows"):
        m.predict(emb, rows.astype(np.int64), segs, dense_x)
    with pytest.raises(ModelInputError, match="vec: expected"):
        m.set_dense(np.zeros(3, np.float32))


def test_config_errors():
    with pytest.raises(ModelConfigError, match="kind: expected one of"):
        build_model("lr")
    with pytest.raises(ModelConfigError, match="dim: expected an int > 0, got 0"):
        CTRDNN(dim=0)
    with pytest.raises(ModelConfigError, match=r"hidden\[1\]"):
        DeepFM(hidden=(4, -1))
    with pytest.raises(ModelConfigError, match="dtype"):
        CTRDNN(dtype=np.int32)
    with pytest.raises(ModelConfigError, match="dtype"):
        CTRDNN(dtype="no-such-type")
    with pytest.raises(ModelConfigError, match="unexpected keyword"):
        build_model("ctr_dnn", embedding_dim=3)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_without_any_key(kind):
    m = small(kind, dtype=np.float32)
    emb = np.zeros((0, m.sparse_width), np.float32)
    none = np.zeros(0, np.int32)
    dense_x = np.ones((3, DENSE), np.float32)
    r = m.forward_backward(emb, none, none, dense_x, np.array([0, 1, 1], np.float32))
    assert r.grad_emb.shape == (0, m.sparse_width)
    assert np.all(np.isfinite(r.grad_dense)) and np.isfinite(r.loss)
    np.testing.assert_allclose(r.probs, r.probs[0])  # identical inputs, identical outputs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden", [HIDDEN, (5,), ()])
def test_on_grad_reports_final_ranges_whose_parameters_the_pass_no_longer_reads(kind, hidden):
    """``forward_backward``'s ``on_grad`` (hybrid mode's overlap): the ranges are disjoint and cover
    ``[0, P)``; each is final when reported (equal to the returned gradient); and overwriting the
    parameters of a reported range with NaN inside the callback, as an in-place optimizer step would
    change them, leaves every gradient and the loss exactly as a pass without the callback."""
    m = small(kind, hidden=hidden)
    batch = make_batch(m, seed=3)
    clean = m.forward_backward(*batch)
    before = m.get_dense()
    seen = []

    def on_grad(grad, lo, hi):
        seen.append((lo, hi, grad[lo:hi].copy()))
        m.dense_params[lo:hi] = np.nan

    r = m.forward_backward(*batch, on_grad=on_grad)
    spans = sorted((lo, hi) for lo, hi, _ in seen)
    assert spans[0][0] == 0 and spans[-1][1] == m.dense_size
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and all(lo < hi for lo, hi in spans)
    for lo, hi, at_call in seen:
        assert np.array_equal(at_call, r.grad_dense[lo:hi])
    assert np.array_equal(r.grad_dense, clean.grad_dense) and np.array_equal(r.grad_emb, clean.grad_emb)
    assert r.loss == clean.loss and np.array_equal(r.probs, clean.probs)
    assert np.isnan(m.dense_params).all() and not np.isnan(before).any()
    if hidden:      # layer by layer, from the output layer down (the tower's own ranges)
        assert len(seen) >= len(hidden) + 1 and seen[0][1] == m.dense_size
