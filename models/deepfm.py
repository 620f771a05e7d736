"""DeepFM: first-order + factorization machine + DNN, summed into one logit.

Each sparse key has ONE PS row of width ``dim + 1`` (as Paddle's CtrCommonAccessor packs
``embed_w`` and ``embedx_w``)::

    column   0        1 ... dim
             w (1st)  v (embedding)

For example ``b`` with sum-pooled slot values ``w[b, s]`` and ``v[b, s, :]``::

    logit[b] = sum_s w[b, s] + dense_x[b] @ linear.weight + linear.bias          (first order)
             + 0.5 * sum_d ((sum_s v[b, s, d])**2 - sum_s v[b, s, d]**2)         (FM, 2nd order)
             + MLP(concat(v[b, 0, :], ..., v[b, S-1, :], dense_x[b]))             (deep part)

The MLP is the CTR-DNN tower. Loss: sigmoid cross-entropy, mean over the batch.
"""
from __future__ import annotations

import numpy as np

from ._base import CTRModelBase, _Scratch
from ._kernels import fm_backward, fm_forward


class DeepFM(CTRModelBase):
    """DeepFM over sum-pooled slots and dense features.

    Parameters
    ----------
    num_slots : int
        Sparse slots ``S``.
    dim : int
        FM/DNN embedding dimension; the PS row width (:attr:`sparse_width`) is ``dim + 1``
        (column 0 = first-order weight, columns 1..dim = embedding).
    dense_dim : int
        Dense features per example; they feed the first-order linear term and the DNN.
    hidden : sequence of int
        DNN hidden layer sizes, default ``(400, 400, 400)``.
    seed : int
        Seed of the dense initialization (as CTR-DNN; ``linear.weight``/``linear.bias`` start at 0).
    dtype : numpy dtype
        ``float32`` (training); ``float64`` for finite-difference gradient checks.

    Raises
    ------
    ModelConfigError
        On a non-positive size or a bad dtype.

    Notes
    -----
    Dense layout: ``linear.weight : [dense_dim]``, ``linear.bias : [1]``, then the tower
    (``fc0.weight`` ... ``out.bias``). ``linear.bias`` and ``out.bias`` have identical gradients;
    both are kept so the first-order part reads like the FM formula.
    """

    kind = "deepfm"

    @property
    def sparse_width(self) -> int:
        """Row width of the PS table: ``dim + 1``."""
        return self.dim + 1

    def _layout_entries(self):
        return [("linear.weight", (self.dense_dim,)), ("linear.bias", (1,))] \
            + self.tower.layout_entries()

    def _init_dense(self, p, rng) -> None:
        p["linear.weight"][...] = 0.0
        p["linear.bias"][...] = 0.0
        self.tower.init(p, rng)

    def _alloc_extra(self, s: _Scratch, batch: int) -> None:
        s.first = np.empty((batch, self.num_slots), self.dtype)
        s.g_first = np.empty((batch, self.num_slots), self.dtype)
        s.sum_v = np.empty((batch, self.dim), self.dtype)
        s.fm = np.empty(batch, self.dtype)
        s.lin = np.empty((batch, 1), self.dtype)
        s.pooled = np.empty((batch, self.num_slots * (self.dim + 1)), self.dtype)

    def _forward(self, s: _Scratch, emb, rows, segments, dense_x) -> None:
        batch = dense_x.shape[0]
        self._pool(emb, rows, segments, 1, self.dim, s.x0, 0, batch)
        s.x0[:, self.emb_cols:] = dense_x
        self._pool(emb, rows, segments, 0, 1, s.first, 0, batch)
        self._head(s, dense_x)

    def _pooled_buffer(self, s: _Scratch):
        return s.pooled

    def _forward_pooled(self, s: _Scratch, pooled, dense_x) -> None:
        batch, S, w = dense_x.shape[0], self.num_slots, self.dim + 1
        p3 = pooled.reshape(batch, S, w)
        s.first[...] = p3[:, :, 0]
        s.x0[:, :self.emb_cols] = p3[:, :, 1:].reshape(batch, S * self.dim)
        s.x0[:, self.emb_cols:] = dense_x
        self._head(s, dense_x)

    def _head(self, s: _Scratch, dense_x) -> None:
        """Logits into ``s.z`` from the pooled embeddings in ``s.x0`` and first-order sums in ``s.first``."""
        self.tower.forward(s.x0, self._p, s.hs, s.z)
        fm_forward(s.x0, self.num_slots, self.dim, 0, s.sum_v, s.fm)
        p = self._p
        np.matmul(dense_x, p["linear.weight"][:, None], out=s.lin)
        z = s.z[:, 0]
        z += s.lin[:, 0]
        z += s.fm
        z += s.first.sum(axis=1)
        z += p["linear.bias"][0]

    def _backward(self, s: _Scratch, emb, rows, segments, dense_x, grad_emb, g, done=None) -> None:
        gz = s.g[:, 0]
        self.tower.backward(s.g, s.x0, self._p, s.hs, s.ds, g, s.dx, done)
        fm_backward(gz, s.x0, self.num_slots, self.dim, 0, s.sum_v, s.dx)
        np.matmul(dense_x.T, gz, out=g["linear.weight"])
        g["linear.bias"][0] = gz.sum()
        if done is not None:
            done(("linear.weight", "linear.bias"))
        s.g_first[...] = s.g
        self._scatter(s.g_first, rows, segments, 0, 1, grad_emb, 0)
        self._scatter(s.dx, rows, segments, 0, self.dim, grad_emb, 1)


__all__ = ["DeepFM"]
