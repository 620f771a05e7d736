"""CTR-DNN as in PaddleRec's ``rank/dnn``.

::

    slot 0 keys ─sum─▶ v_0 ┐
    ...                    ├─ concat ─▶ [B, S*dim + dense_dim] ─▶ fc 400 ReLU ─▶ fc 400 ReLU
    slot S-1 keys ─sum─▶ v_S-1 ┘                                 ─▶ fc 400 ReLU ─▶ fc 1 = logit
    dense_x ───────────────┘

Loss: sigmoid cross-entropy on the logit, mean over the batch. Sparse row width = ``dim``.
"""
from __future__ import annotations

import numpy as np

from ._base import CTRModelBase, _Scratch


class CTRDNN(CTRModelBase):
    """CTR-DNN: sum-pooled slot embeddings + dense features → ReLU MLP → logit.

    Parameters
    ----------
    num_slots : int
        Sparse slots ``S`` (26 for Criteo).
    dim : int
        Embedding dimension; the PS table row width (:attr:`sparse_width`) is ``dim``.
    dense_dim : int
        Dense features per example (13 for Criteo); may be 0.
    hidden : sequence of int
        Hidden layer sizes, default ``(400, 400, 400)``.
    seed : int
        Seed of the dense initialization: hidden weights He-normal (std ``sqrt(2/fan_in)``),
        output weight Glorot-uniform, biases zero. Same seed, same parameters.
    dtype : numpy dtype
        ``float32`` (training); ``float64`` exists for finite-difference gradient checks.

    Raises
    ------
    ModelConfigError
        On a non-positive size or a bad dtype.

    Examples
    --------
    Two examples, two slots, dim 2; example 1 has no key in slot 1:

    >>> import numpy as np
    >>> m = CTRDNN(num_slots=2, dim=2, dense_dim=1, hidden=(4,))
    >>> emb = np.ones((2, 2), np.float32)                 # 2 unique keys
    >>> rows = np.array([0, 1, 1], np.int32)
    >>> segments = np.array([0, 1, 2], np.int32)          # cells (0,0), (0,1), (1,0)
    >>> dense_x = np.zeros((2, 1), np.float32)
    >>> r = m.forward_backward(emb, rows, segments, dense_x, np.array([1, 0], np.float32))
    >>> r.probs.shape, r.grad_emb.shape, r.grad_dense.shape == (m.dense_size,)
    ((2,), (2, 2), True)
    """

    kind = "ctr_dnn"

    @property
    def sparse_width(self) -> int:
        """Row width of the PS table: ``dim``."""
        return self.dim

    def _layout_entries(self):
        return self.tower.layout_entries()

    def _init_dense(self, p, rng) -> None:
        self.tower.init(p, rng)

    def _forward(self, s: _Scratch, emb, rows, segments, dense_x) -> None:
        batch = dense_x.shape[0]
        self._pool(emb, rows, segments, 0, self.dim, s.x0, 0, batch)
        s.x0[:, self.emb_cols:] = dense_x
        self.tower.forward(s.x0, self._p, s.hs, s.z)

    def _pooled_buffer(self, s: _Scratch):
        return s.x0[:, :self.emb_cols]

    def _forward_pooled(self, s: _Scratch, pooled, dense_x) -> None:
        emb_block = s.x0[:, :self.emb_cols]
        if not np.shares_memory(pooled, emb_block):
            emb_block[...] = pooled
        s.x0[:, self.emb_cols:] = dense_x
        self.tower.forward(s.x0, self._p, s.hs, s.z)

    def _backward(self, s: _Scratch, emb, rows, segments, dense_x, grad_emb, g, done=None) -> None:
        self.tower.backward(s.g, s.x0, self._p, s.hs, s.ds, g, s.dx, done)
        self._scatter(s.dx, rows, segments, 0, self.dim, grad_emb, 0)


__all__ = ["CTRDNN"]
