"""Shared driver of the CTR models: argument checks, flat dense parameters, per-batch-size scratch
buffers, the loss, and the public ``forward_backward`` / ``logits`` / ``predict`` methods.

Subclasses (:class:`~models.ctr_dnn.CTRDNN`, :class:`~models.deepfm.DeepFM`) provide the layout of
their dense parameters and the model-specific forward and backward passes over arrays.
"""
from __future__ import annotations

import abc
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from typing import Any, Sequence

import numpy as np

from ._dense import DenseLayout, MLPTower
from ._kernels import pool_sum, scatter_add, sigmoid, sigmoid_xent
from .errors import ModelConfigError, ModelInputError

_MAX_SCRATCH = 4  # batch sizes whose buffers are kept (the last batch of an epoch is smaller)


@dataclass(frozen=True)
class StepResult:
    """What one ``forward_backward`` returns. All arrays are fresh (owned by the caller).

    Attributes
    ----------
    loss : float
        Mean logloss over the batch.
    probs : float32[B]
        Predicted click probabilities.
    grad_emb : float32[u, width]
        Gradient of the MEAN batch loss w.r.t. each unique pulled row, scatter-added over all
        occurrences of the key. Multiply by ``B`` for the gradient of the summed loss (what a
        show-count-scaled server optimizer may expect).
    grad_dense : float32[P]
        Gradient of the mean batch loss w.r.t. the flat dense parameters, same layout as
        ``get_dense()``.
    """

    loss: float
    probs: np.ndarray
    grad_emb: np.ndarray
    grad_dense: np.ndarray


class _RangeReporter:
    """``forward_backward``'s ``on_grad`` in terms of layout entry names: ``done(names)`` reports the
    flat range of those entries (one call per contiguous run); ``rest()`` reports what was not."""

    def __init__(self, layout, grad_dense: np.ndarray, on_grad):
        self.spans = {name: (off, off + prod(shape)) for name, off, shape in layout.entries}
        self.grad, self.on_grad = grad_dense, on_grad
        self.left = dict(self.spans)

    def __call__(self, names) -> None:
        spans = sorted(self.left.pop(n) for n in names if n in self.left)
        lo = hi = None
        for a, b in spans:
            if hi is not None and a != hi:
                self.on_grad(self.grad, lo, hi)
                lo = None
            lo, hi = (a if lo is None else lo), b
        if lo is not None:
            self.on_grad(self.grad, lo, hi)

    def rest(self) -> None:
        if self.left:
            self(tuple(self.left))


def _desc(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype}[{', '.join(str(n) for n in a.shape)}]"
    return type(a).__name__


def _pos_int(name: str, v: Any) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ModelConfigError(f"{name}: expected an int > 0, got {v!r}")
    return int(v)


class _Scratch:
    """Buffers for one batch size; attributes are added by the model."""


class CTRModelBase(abc.ABC):
    """Common part of CTR-DNN and DeepFM; not instantiated directly.

    An instance is not safe for concurrent calls (it reuses scratch buffers); use one instance per
    worker thread.
    """

    kind = ""

    def __init__(self, num_slots: int = 26, dim: int = 10, dense_dim: int = 13,
                 hidden: Sequence[int] = (400, 400, 400), seed: int = 0,
                 dtype: Any = np.float32):
        self.num_slots = _pos_int("num_slots", num_slots)
        self.dim = _pos_int("dim", dim)
        if isinstance(dense_dim, bool) or not isinstance(dense_dim, (int, np.integer)) \
                or dense_dim < 0:
            raise ModelConfigError(f"dense_dim: expected an int >= 0, got {dense_dim!r}")
        self.dense_dim = int(dense_dim)
        try:
            hid = tuple(hidden)
        except TypeError:
            raise ModelConfigError(f"hidden: expected a sequence of ints > 0, got {hidden!r}") \
                from None
        self.hidden = tuple(_pos_int(f"hidden[{i}]", h) for i, h in enumerate(hid))
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ModelConfigError(f"seed: expected an int >= 0, got {seed!r}")
        self.seed = int(seed)
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise ModelConfigError(f"dtype: expected float32 or float64, got {dtype!r}") from None
        if dt not in (np.float32, np.float64):
            raise ModelConfigError(f"dtype: expected float32 or float64, got {dt}")
        self.dtype = dt
        self.emb_cols = self.num_slots * self.dim
        self.tower = MLPTower(self.emb_cols + self.dense_dim, self.hidden)
        self.dense_layout = DenseLayout(self._layout_entries())
        self._params = np.zeros(self.dense_layout.size, dtype=self.dtype)
        self._p = self.dense_layout.views(self._params)
        self._init_dense(self._p, np.random.default_rng(self.seed))
        self._scratch: OrderedDict[int, _Scratch] = OrderedDict()

    # ----------------------------------------------------------------- subclass hooks
    @property
    @abc.abstractmethod
    def sparse_width(self) -> int:
        """Row width the PS sparse table must have for this model."""

    @abc.abstractmethod
    def _layout_entries(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every dense parameter, in the flat vector's order."""

    @abc.abstractmethod
    def _init_dense(self, p: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """Initialize the dense parameter views ``p`` in place."""

    def _alloc_extra(self, s: _Scratch, batch: int) -> None:
        pass

    @abc.abstractmethod
    def _forward(self, s: _Scratch, emb, rows, segments, dense_x) -> None:
        """Fill ``s.z : float[B, 1]`` with logits, keeping what backward needs in ``s``."""

    @abc.abstractmethod
    def _backward(self, s: _Scratch, emb, rows, segments, dense_x, grad_emb,
                  g: dict[str, np.ndarray], done=None) -> None:
        """With ``s.g : float[B, 1]`` = dL/dlogit, fill ``grad_emb`` (zeroed) and the gradient
        views ``g``; call ``done(names)`` (if given) as soon as the gradients of those dense entries
        are final and the pass no longer reads those parameters (``forward_backward``'s ``on_grad``)."""

    @abc.abstractmethod
    def _pooled_buffer(self, s: _Scratch) -> np.ndarray:
        """The float[B, S * sparse_width] buffer :meth:`pooled_input` hands out."""

    @abc.abstractmethod
    def _forward_pooled(self, s: _Scratch, pooled, dense_x) -> None:
        """:meth:`_forward` from already pooled rows (``pooled_input``'s layout)."""

    # ----------------------------------------------------------------- dense parameters
    @property
    def dense_size(self) -> int:
        """Number of dense parameters ``P``."""
        return self.dense_layout.size

    @property
    def dense_params(self) -> np.ndarray:
        """The LIVE flat parameter vector ``float32[P]`` (no copy), for in-place optimizers such
        as ``Adam.step(model.dense_params, grad)`` on a GEO worker."""
        return self._params

    def dense_views(self) -> dict[str, np.ndarray]:
        """Live named views (``"fc0.weight": float32[in, out]`` ...) into :attr:`dense_params`."""
        return dict(self._p)

    def get_dense(self) -> np.ndarray:
        """A copy of the flat dense parameters, ``float32[P]``."""
        return self._params.copy()

    def set_dense(self, vec: np.ndarray) -> None:
        """Overwrite the dense parameters.

        Parameters
        ----------
        vec : float[P]
            Any float dtype; converted to the model dtype.

        Raises
        ------
        ModelInputError
            If ``vec`` is not a 1-D float array of length ``P``.
        """
        if not isinstance(vec, np.ndarray) or vec.shape != (self.dense_size,) \
                or vec.dtype.kind != "f":
            raise ModelInputError(
                f"vec: expected {self.dtype}[{self.dense_size}], got {_desc(vec)}")
        np.copyto(self._params, vec, casting="same_kind")

    def config(self) -> dict[str, Any]:
        """Constructor arguments as plain JSON-able values (for checkpoint manifests and export
        bundles); ``build_model(**model.config())`` rebuilds the same model."""
        return {"kind": self.kind, "num_slots": self.num_slots, "dim": self.dim,
                "dense_dim": self.dense_dim, "hidden": list(self.hidden), "seed": self.seed,
                "dtype": str(self.dtype)}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_slots={self.num_slots}, dim={self.dim}, "
                f"dense_dim={self.dense_dim}, hidden={self.hidden}, P={self.dense_size})")

    # ----------------------------------------------------------------- checks and scratch
    def _check(self, emb, rows, segments, dense_x, labels=None) -> int:
        dt = self.dtype
        w = self.sparse_width
        if not isinstance(emb, np.ndarray) or emb.ndim != 2 or emb.dtype != dt \
                or emb.shape[1] != w:
            raise ModelInputError(f"emb: expected {dt}[u, {w}], got {_desc(emb)}")
        if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype != np.int32:
            raise ModelInputError(f"rows: expected int32[nnz], got {_desc(rows)}")
        if not isinstance(segments, np.ndarray) or segments.shape != rows.shape \
                or segments.dtype != np.int32:
            raise ModelInputError(
                f"segments: expected int32[{rows.shape[0]}] (same length as rows), "
                f"got {_desc(segments)}")
        if not isinstance(dense_x, np.ndarray) or dense_x.ndim != 2 or dense_x.dtype != dt \
                or dense_x.shape[1] != self.dense_dim or dense_x.shape[0] == 0:
            raise ModelInputError(
                f"dense_x: expected {dt}[B, {self.dense_dim}] with B >= 1, got {_desc(dense_x)}")
        batch = dense_x.shape[0]
        if labels is not None:
            if not isinstance(labels, np.ndarray) or labels.shape != (batch,) \
                    or labels.dtype != dt:
                raise ModelInputError(f"labels: expected {dt}[{batch}], got {_desc(labels)}")
            if not (np.all(labels >= 0) and np.all(labels <= 1)):
                bad = labels[~((labels >= 0) & (labels <= 1))][0]
                raise ModelInputError(f"labels: expected values in [0, 1], got {bad}")
        return batch

    def _index_error(self, i: int, rows, segments, u: int, batch: int) -> ModelInputError:
        if not 0 <= rows[i] < u:
            return ModelInputError(
                f"rows[{i}]: expected an index in [0, {u}) (rows of emb), got {rows[i]}")
        n = batch * self.num_slots
        return ModelInputError(
            f"segments[{i}]: expected a cell id in [0, {n}) (B*num_slots = {batch}*"
            f"{self.num_slots}), got {segments[i]}")

    def _buffers(self, batch: int) -> _Scratch:
        s = self._scratch.get(batch)
        if s is not None:
            self._scratch.move_to_end(batch)
            return s
        dt = self.dtype
        s = _Scratch()
        s.x0 = np.empty((batch, self.tower.in_dim), dt)
        s.hs, s.ds = self.tower.buffers(batch, dt)
        s.z = np.empty((batch, 1), dt)
        s.g = np.empty((batch, 1), dt)
        s.dx = np.empty((batch, self.emb_cols), dt)
        self._alloc_extra(s, batch)
        self._scratch[batch] = s
        while len(self._scratch) > _MAX_SCRATCH:
            self._scratch.popitem(last=False)
        return s

    # ----------------------------------------------------------------- public passes
    def forward_backward(self, emb: np.ndarray, rows: np.ndarray, segments: np.ndarray,
                         dense_x: np.ndarray, labels: np.ndarray, on_grad=None) -> StepResult:
        """Loss, probabilities and gradients of one batch.

        Parameters
        ----------
        emb : float32[u, sparse_width]
            The batch's unique pulled rows (one per unique key).
        rows : int32[nnz]
            Row of ``emb`` read by each key occurrence.
        segments : int32[nnz]
            Cell of each occurrence, ``example * num_slots + slot``; occurrences of one cell are
            summed, an empty cell pools to zeros.
        dense_x : float32[B, dense_dim]
            Dense features; ``B`` is the batch size.
        labels : float32[B]
            Click labels in [0, 1] (soft labels allowed).
        on_grad : callable or None
            ``on_grad(grad_dense, lo, hi)`` is called during the backward pass each time
            ``grad_dense[lo:hi]`` (float32[P], the vector this call returns) is final and the pass no
            longer reads ``dense_params[lo:hi]``: the caller may all-reduce that range and update those
            parameters in place while the pass goes on (hybrid mode overlaps its all-reduce with the
            backward pass, as PyTorch DDP's gradient buckets). The ranges are disjoint, come in the
            order the pass finishes them (the tower's output layer first), and together cover
            ``[0, P)`` by the time this call returns.

        Returns
        -------
        StepResult
            ``loss`` (mean logloss), ``probs : float32[B]``, ``grad_emb : float32[u, width]`` and
            ``grad_dense : float32[P]``, both gradients of the MEAN loss.

        Raises
        ------
        ModelInputError
            On a wrong dtype or shape, a label outside [0, 1], a row index outside ``[0, u)`` or a
            segment outside ``[0, B*num_slots)``.
        """
        batch = self._check(emb, rows, segments, dense_x, labels)
        s = self._buffers(batch)
        self._forward(s, emb, rows, segments, dense_x)
        probs = np.empty(batch, self.dtype)
        loss_sum = sigmoid_xent(s.z[:, 0], labels, 1.0 / batch, probs, s.g[:, 0])
        grad_emb = np.zeros(emb.shape, self.dtype)
        grad_dense = np.empty(self.dense_size, self.dtype)
        done = None if on_grad is None else _RangeReporter(self.dense_layout, grad_dense, on_grad)
        self._backward(s, emb, rows, segments, dense_x, grad_emb,
                       self.dense_layout.views(grad_dense), done)
        if done is not None:
            done.rest()
        return StepResult(loss=loss_sum / batch, probs=probs, grad_emb=grad_emb,
                          grad_dense=grad_dense)

    def logits(self, emb: np.ndarray, rows: np.ndarray, segments: np.ndarray,
               dense_x: np.ndarray) -> np.ndarray:
        """Logits of one batch, ``float32[B]``; arguments as in :meth:`forward_backward`.

        Raises
        ------
        ModelInputError
            As :meth:`forward_backward`.
        """
        batch = self._check(emb, rows, segments, dense_x)
        s = self._buffers(batch)
        self._forward(s, emb, rows, segments, dense_x)
        return s.z[:, 0].copy()

    def predict(self, emb: np.ndarray, rows: np.ndarray, segments: np.ndarray,
                dense_x: np.ndarray) -> np.ndarray:
        """Click probabilities of one batch, ``float32[B]``; arguments as in
        :meth:`forward_backward`. Unknown keys should be passed as zero rows.

        Raises
        ------
        ModelInputError
            As :meth:`forward_backward`.
        """
        batch = self._check(emb, rows, segments, dense_x)
        s = self._buffers(batch)
        self._forward(s, emb, rows, segments, dense_x)
        probs = np.empty(batch, self.dtype)
        sigmoid(s.z[:, 0], probs)
        return probs

    def pooled_input(self, batch: int) -> np.ndarray:
        """A buffer to fill with one batch's pooled slot rows for :meth:`predict_pooled`.

        Returns
        -------
        float[B, num_slots * sparse_width]
            Possibly a (strided) view of the model's scratch input: filling it in place saves a copy.
            Valid until the next call on this model with the same batch size.
        """
        return self._pooled_buffer(self._buffers(_pos_int("batch", batch)))

    def predict_pooled(self, pooled: np.ndarray, dense_x: np.ndarray) -> np.ndarray:
        """Click probabilities from already pooled slot rows, ``float32[B]``.

        The serving path (``engine.export``) pools while it looks keys up; this is :meth:`predict`
        after the pooling step, with the same arithmetic.

        Parameters
        ----------
        pooled : float[B, num_slots * sparse_width]
            ``pooled[b, s*w + c]`` = sum of column ``c`` of the rows of example ``b``'s keys in slot
            ``s`` (``w`` = :attr:`sparse_width`), the layout of the exported ONNX model's input; from
            :meth:`pooled_input` or any array of that shape.
        dense_x : float[B, dense_dim]

        Raises
        ------
        ModelInputError
            On a wrong dtype or shape.
        """
        dt = self.dtype
        if not isinstance(dense_x, np.ndarray) or dense_x.ndim != 2 or dense_x.dtype != dt \
                or dense_x.shape[1] != self.dense_dim or dense_x.shape[0] == 0:
            raise ModelInputError(
                f"dense_x: expected {dt}[B, {self.dense_dim}] with B >= 1, got {_desc(dense_x)}")
        batch = dense_x.shape[0]
        cols = self.num_slots * self.sparse_width
        if not isinstance(pooled, np.ndarray) or pooled.dtype != dt or pooled.shape != (batch, cols):
            raise ModelInputError(f"pooled: expected {dt}[{batch}, {cols}], got {_desc(pooled)}")
        s = self._buffers(batch)
        self._forward_pooled(s, pooled, dense_x)
        probs = np.empty(batch, dt)
        sigmoid(s.z[:, 0], probs)
        return probs

    # ----------------------------------------------------------------- helpers for subclasses
    def _pool(self, emb, rows, segments, src_col, width, out, dst_col, batch) -> None:
        bad = pool_sum(emb, rows, segments, src_col, width, self.num_slots, out, dst_col)
        if bad >= 0:
            raise self._index_error(bad, rows, segments, emb.shape[0], batch)

    def _scatter(self, grad, rows, segments, src_col, width, grad_emb, dst_col) -> None:
        bad = scatter_add(grad, rows, segments, src_col, width, self.num_slots, grad_emb, dst_col)
        if bad >= 0:
            raise self._index_error(bad, rows, segments, grad_emb.shape[0], grad.shape[0])
