"""The optimizers against float64 references written from their sources, not from the code.

``tests/naive.py`` mirrors the kernels' float32 rounding step by step; here each rule is the formula of
its source, computed in float64, and the table runs through its public ``push`` (gradient divided by the
pushed show count, lazy: only the pushed rows step). The two Adams are pinned to their (different)
epsilon placements, which the README's "Optimizers" paragraph describes.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from models.optim import Adam
from sparse_tables import SparseTable, TableConfig


def reference_step(cfg: TableConfig, w, st, g, t):
    """One update of row ``w`` (float64[dim]) with state ``st`` and gradient ``g``; ``t``: the row's step."""
    lr, eps = cfg.learning_rate, cfg.epsilon
    if cfg.optimizer == "sgd":
        w = w - lr * g
    elif cfg.optimizer == "adagrad":        # FBGEMM/TorchRec ROWWISE_ADAGRAD
        st["a"] = st["a"] + np.mean(g * g)
        w = w - lr * g / (math.sqrt(st["a"]) + eps)
    elif cfg.optimizer == "std_adagrad":    # Duchi, Hazan & Singer 2011, diagonal
        st["a"] = st["a"] + g * g
        w = w - lr * g / (np.sqrt(st["a"]) + eps)
    elif cfg.optimizer == "adam":           # Kingma & Ba, end of section 2 (epsilon hat); Paddle SparseAdamSGDRule
        b1, b2 = cfg.beta1, cfg.beta2
        st["m"] = b1 * st["m"] + (1 - b1) * g
        st["v"] = b2 * st["v"] + (1 - b2) * g * g
        w = w - lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * st["m"] / (np.sqrt(st["v"]) + eps)
    elif cfg.optimizer == "ftrl":           # McMahan et al. 2013, Algorithm 1 (alpha = lr)
        a, beta, l1, l2 = lr, cfg.ftrl_beta, cfg.ftrl_l1, cfg.ftrl_l2
        sigma = (np.sqrt(st["n"] + g * g) - np.sqrt(st["n"])) / a
        st["z"] = st["z"] + g - sigma * w
        st["n"] = st["n"] + g * g
        w = np.where(np.abs(st["z"]) <= l1, 0.0,
                     -(st["z"] - np.sign(st["z"]) * l1) / ((beta + np.sqrt(st["n"])) / a + l2))
    return np.clip(w, cfg.min_bound, cfg.max_bound)


@pytest.mark.parametrize("optimizer,init_acc", [("sgd", 0.0), ("adagrad", 0.0), ("adagrad", 0.1),
                                                ("std_adagrad", 0.0), ("std_adagrad", 0.1), ("adam", 0.0),
                                                ("ftrl", 0.0)])
def test_sparse_rules_follow_their_sources(optimizer, init_acc):
    dim = 5
    cfg = TableConfig(dim=dim, optimizer=optimizer, learning_rate=0.05, initial_accumulator=init_acc,
                      epsilon=1e-6, ftrl_l1=0.01, ftrl_l2=0.1, min_bound=-1.0, max_bound=1.0, init_range=0.05)
    table = SparseTable(cfg)
    keys = np.arange(1, 9, dtype=np.uint64)
    w = table.pull(keys, init_missing=True).astype(np.float64)
    state = [dict(a=init_acc if optimizer == "adagrad" else np.full(dim, init_acc), m=np.zeros(dim),
                  v=np.zeros(dim), z=np.zeros(dim), n=np.zeros(dim)) for _ in keys]
    steps = np.zeros(len(keys), np.int64)
    rng = np.random.default_rng(0)
    for _ in range(30):
        pushed = np.flatnonzero(rng.random(len(keys)) < 0.6)         # lazy: the other rows do not step
        if not len(pushed):
            continue
        scale = 10.0 ** rng.uniform(-4, 0, (len(pushed), 1))          # gradients from 1e-4 to 1
        grads = (rng.standard_normal((len(pushed), dim)) * scale).astype(np.float32)
        shows = rng.integers(1, 5, len(pushed)).astype(np.float32)
        table.push(keys[pushed], grads, shows=shows, clicks=np.zeros(len(pushed), np.float32))
        for j, i in enumerate(pushed):
            steps[i] += 1
            w[i] = reference_step(cfg, w[i], state[i], grads[j].astype(np.float64) / float(shows[j]), steps[i])
        got = table.pull(keys[pushed]).astype(np.float64)
        # float32 storage of values and state: the beta powers' rounding moves Adam's step by ~1e-5 of lr
        np.testing.assert_allclose(got, w[pushed], rtol=0, atol=1e-6 if optimizer == "adam" else 5e-8)
        w[pushed] = got                                               # no drift of float32 rounding


def test_sparse_and_dense_adam_place_epsilon_as_their_sources_do():
    """Same hyper-parameters, same gradients, an epsilon large enough to matter: the sparse row follows the
    epsilon-hat form (Paddle's SparseAdamSGDRule, PyTorch's SparseAdam), the dense vector PyTorch's Adam
    (Kingma & Ba, Algorithm 1); the two differ (README "Optimizers")."""
    lr, b1, b2, eps, dim = 0.01, 0.9, 0.999, 1e-3, 4
    rng = np.random.default_rng(1)
    grads = (rng.standard_normal((5, dim)) * 1e-3).astype(np.float32)
    table = SparseTable(TableConfig(dim=dim, optimizer="adam", learning_rate=lr, beta1=b1, beta2=b2,
                                    epsilon=eps, initializer="zeros"))
    dense = Adam(dim, lr=lr, beta1=b1, beta2=b2, eps=eps)
    params = np.zeros(dim, np.float32)
    key = np.array([7], np.uint64)
    m = v = np.zeros(dim)
    hat = alg1 = np.zeros(dim)
    for t, g in enumerate(grads.astype(np.float64), start=1):
        table.push(key, grads[t - 1:t])
        dense.step(params, grads[t - 1])
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        hat = hat - lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(v) + eps)
        alg1 = alg1 - lr / (1 - b1 ** t) * m / (np.sqrt(v / (1 - b2 ** t)) + eps)
    np.testing.assert_allclose(table.pull(key)[0], hat, rtol=1e-4)
    np.testing.assert_allclose(params, alg1, rtol=1e-4)
    assert np.abs(hat - alg1).min() > 0.1 * np.abs(alg1).min()      # a real difference, not rounding
