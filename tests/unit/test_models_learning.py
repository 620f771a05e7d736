"""Tiny learning tests: on logistic data with a planted model, CTR-DNN and DeepFM trained with Adam
on the dense parameters and plain SGD on the pulled embedding rows reduce the held-out loss."""
from __future__ import annotations

import numpy as np
import pytest

from models import SGD, Adam, build_model

S, VOCAB, DENSE = 4, 15, 3


def planted_data(n, rng, w_key, w_dense, bias):
    keys = rng.integers(0, VOCAB, size=(n, S)) + np.arange(S) * VOCAB   # slot-separated keys
    dense_x = rng.normal(size=(n, DENSE)).astype(np.float32)
    logit = w_key[keys].sum(axis=1) + dense_x @ w_dense + bias
    labels = (rng.uniform(size=n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return keys, dense_x, labels


class RowStore:
    """Stand-in for the parameter server: a dict of rows created on first pull."""

    def __init__(self, width, seed):
        self.width, self.seed, self.rows = width, seed, {}

    def pull(self, keys):
        out = np.empty((len(keys), self.width), np.float32)
        for i, k in enumerate(keys):
            if k not in self.rows:
                r = np.random.default_rng([self.seed, int(k)]).normal(0, 0.05, self.width)
                self.rows[k] = r.astype(np.float32)
            out[i] = self.rows[k]
        return out

    def push_sgd(self, keys, grads, lr):
        for k, g in zip(keys, grads):
            self.rows[k] -= lr * g


def batch_arrays(keys):
    uniq, inv = np.unique(keys.ravel(), return_inverse=True)
    rows = inv.astype(np.int32)
    segments = np.arange(keys.size, dtype=np.int32)   # one key per (example, slot) cell
    return uniq, rows, segments


def eval_loss(model, store, keys, dense_x, labels):
    uniq, rows, segs = batch_arrays(keys)
    return model.forward_backward(store.pull(uniq), rows, segs, dense_x, labels).loss


@pytest.mark.parametrize("kind", ["ctr_dnn", "deepfm"])
def test_loss_decreases_towards_planted_model(kind):
    rng = np.random.default_rng(0)
    w_key = rng.normal(0, 1.0, size=S * VOCAB)
    w_dense = np.array([0.8, -0.5, 0.3])
    bias = -0.3
    train = planted_data(4000, rng, w_key, w_dense, bias)
    test = planted_data(2000, rng, w_key, w_dense, bias)

    tk, tx, ty = test
    z = w_key[tk].sum(axis=1) + tx @ w_dense + bias
    planted_loss = float(np.mean(np.logaddexp(0, z) - ty * z))

    model = build_model(kind, num_slots=S, dim=4, dense_dim=DENSE, hidden=(16, 8), seed=1)
    store = RowStore(model.sparse_width, seed=2)
    opt = Adam(model.dense_size, lr=3e-3)
    before = eval_loss(model, store, *test)
    keys, dense_x, labels = train
    bsz = 50
    for _epoch in range(4):
        for lo in range(0, len(labels), bsz):
            sl = slice(lo, lo + bsz)
            uniq, rows, segs = batch_arrays(keys[sl])
            res = model.forward_backward(store.pull(uniq), rows, segs, dense_x[sl], labels[sl])
            opt.step(model.dense_params, res.grad_dense)
            # the mean-loss gradient is scaled by the batch size, as a show-scaled server would
            store.push_sgd(uniq, res.grad_emb * bsz, lr=0.05)
    after = eval_loss(model, store, *test)
    assert after < before - 0.1, (before, after)
    assert after < planted_loss + 0.08, (after, planted_loss)


def test_sgd_optimizer_on_dense_params_learns_too():
    rng = np.random.default_rng(3)
    w_key = rng.normal(0, 1.0, size=S * VOCAB)
    keys, dense_x, labels = planted_data(2000, rng, w_key, np.array([1.0, 0, 0]), 0.0)
    model = build_model("ctr_dnn", num_slots=S, dim=4, dense_dim=DENSE, hidden=(8,), seed=0)
    store = RowStore(model.sparse_width, seed=0)
    opt = SGD(model.dense_size, lr=0.1)
    before = eval_loss(model, store, keys, dense_x, labels)
    for _epoch in range(3):
        for lo in range(0, 2000, 100):
            sl = slice(lo, lo + 100)
            uniq, rows, segs = batch_arrays(keys[sl])
            res = model.forward_backward(store.pull(uniq), rows, segs, dense_x[sl], labels[sl])
            opt.step(model.dense_params, res.grad_dense)
            store.push_sgd(uniq, res.grad_emb * 100, lr=0.05)
    assert eval_loss(model, store, keys, dense_x, labels) < before - 0.05
