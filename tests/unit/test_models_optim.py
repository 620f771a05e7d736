"""models.optim: Adam and SGD over a flat float32 vector."""
from __future__ import annotations

import numpy as np
import pytest

from models import SGD, Adam, ModelConfigError, ModelInputError


def reference_adam(p, grads, lr, b1, b2, eps):
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def test_adam_matches_reference():
    rng = np.random.default_rng(0)
    p = rng.normal(size=50).astype(np.float32)
    grads = [rng.normal(size=50).astype(np.float32) for _ in range(5)]
    want = reference_adam(p, grads, 0.01, 0.9, 0.99, 1e-6)
    opt = Adam(50, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6)
    for g in grads:
        opt.step(p, g)
    assert opt.t == 5
    np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-6)


def test_adam_state_roundtrip():
    rng = np.random.default_rng(1)
    p1 = rng.normal(size=8).astype(np.float32)
    p2 = p1.copy()
    a, b = Adam(8, lr=0.1), Adam(8, lr=0.1)
    g = rng.normal(size=8).astype(np.float32)
    a.step(p1, g)
    b.load_state_dict(a.state_dict())
    p2[:] = p1
    a.step(p1, g)
    b.step(p2, g)
    np.testing.assert_array_equal(p1, p2)


def test_sgd_step():
    p = np.ones(4, np.float32)
    SGD(4, lr=0.5).step(p, np.arange(4, dtype=np.float32))
    np.testing.assert_allclose(p, [1.0, 0.5, 0.0, -0.5])


def test_optimizer_errors():
    opt = Adam(4)
    with pytest.raises(ModelInputError, match=r"params: expected float32\[4\], got float64\[4\]"):
        opt.step(np.zeros(4), np.zeros(4, np.float32))
    with pytest.raises(ModelInputError, match=r"grad: expected float32\[4\], got float32\[3\]"):
        SGD(4).step(np.zeros(4, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ModelConfigError, match="lr"):
        Adam(4, lr=0)
    with pytest.raises(ModelConfigError, match="beta2"):
        Adam(4, beta2=1.0)
    with pytest.raises(ModelInputError, match="state\\['t'\\]"):
        opt.load_state_dict({"m": np.zeros(4, np.float32), "v": np.zeros(4, np.float32), "t": -1})


@pytest.mark.parametrize("make", [lambda n: Adam(n, lr=3e-3), lambda n: SGD(n, lr=0.1)])
def test_ranges_of_one_step_give_the_bits_of_the_whole_step(make):
    """``begin_step`` + ``step_range`` over pieces covering [0, P), in any order (hybrid mode steps
    each layer when its all-reduce arrives) = ``step``, to the last bit, over several steps."""
    n = 1000
    rng = np.random.default_rng(4)
    whole, parts = make(n), make(n)
    p1 = rng.normal(size=n).astype(np.float32)
    p2 = p1.copy()
    for t in range(3):
        g = rng.normal(size=n).astype(np.float32)
        whole.step(p1, g)
        c = parts.begin_step()
        for lo, hi in [(700, 1000), (3, 700), (0, 3)]:
            parts.step_range(p2, g, lo, hi, c)
        assert np.array_equal(p1.view(np.uint32), p2.view(np.uint32)), t
    with pytest.raises(ModelInputError, match="range"):
        parts.step_range(p2, g, 5, n + 1, parts.begin_step())


def test_adam_kernel_gives_the_bits_of_float32_elementwise_arithmetic():
    """The fused kernel (vectorized: packed sqrt and division) computes each element exactly as numpy's
    float32 operations do one at a time, in the same order, with no fused multiply-add and no
    reciprocal approximation: the bits hybrid mode's workers and the servers' dense table must share.
    1003 elements: the vector body and a remainder."""
    from models._kernels import adam_update
    rng = np.random.default_rng(7)
    n = 1003
    p = rng.normal(size=n).astype(np.float32)
    m = (rng.normal(size=n) * 1e-2).astype(np.float32)
    v = (rng.random(n) * 1e-3).astype(np.float32)
    v[:5] = 0.0                                  # sqrt(0): the denominator is eps alone
    g = (rng.normal(size=n) * 1e-1).astype(np.float32)
    lr, b1, b2, eps, t = 1e-3, 0.9, 0.999, 1e-8, 3
    step_size, inv_sqrt_bc2 = lr / (1 - b1**t), 1 / np.sqrt(1 - b2**t)
    f = np.float32
    want_m = f(b1) * m + f(1 - b1) * g
    want_v = f(b2) * v + f(1 - b2) * g * g
    want_p = p - f(step_size) * want_m / (np.sqrt(want_v) * f(inv_sqrt_bc2) + f(eps))
    adam_update(p, g, m, v, step_size, inv_sqrt_bc2, b1, b2, eps)
    for got, want in ((m, want_m), (v, want_v), (p, want_p)):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
