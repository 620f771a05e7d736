"""Dense optimizers over one flat ``float32`` parameter vector.

The dense parameters of a model are one flat vector (see ``CTRModelBase.dense_params``); the
servers' dense table applies :class:`Adam` to it (async/sync modes), a hybrid worker applies it to
the all-reduced gradient, and a GEO worker to its local copy between syncs (``engine.modes.geo``: the
table's optimizer, built by ``engine.allreduce.make_optimizer``; its moments stay on the worker across
syncs and are not checkpointed). Both classes update ``params`` in place from a gradient of the same
layout and keep their state as flat vectors, so state can be checkpointed with the table.

Example::

    opt = Adam(model.dense_size, lr=1e-3)
    res = model.forward_backward(emb, rows, segments, dense_x, labels)
    opt.step(model.dense_params, res.grad_dense)
"""
from __future__ import annotations

import math

import numpy as np

from ._kernels import adam_update, sgd_update
from .errors import ModelConfigError, ModelInputError


def _check_vec(name: str, a, size: int) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (size,):
        got = f"{a.dtype}[{', '.join(map(str, a.shape))}]" if isinstance(a, np.ndarray) \
            else type(a).__name__
        raise ModelInputError(f"{name}: expected float32[{size}], got {got}")


def _check_step(params, grad, lo, hi, size: int) -> None:
    """``step_range``'s arguments: params and grad float32[size], 0 <= lo <= hi <= size."""
    if not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer)) and 0 <= lo <= hi <= size):
        raise ModelInputError(f"range: expected 0 <= lo <= hi <= {size}, got [{lo!r}, {hi!r})")
    _check_vec("params", params, size)
    _check_vec("grad", grad, size)


def _check_lr(lr) -> float:
    if not isinstance(lr, (int, float, np.floating)) or not (lr > 0 and math.isfinite(lr)):
        raise ModelConfigError(f"lr: expected a finite float > 0, got {lr!r}")
    return float(lr)


class SGD:
    """Plain SGD: ``params -= lr * grad``.

    Parameters
    ----------
    size : int
        Length ``P`` of the parameter vector.
    lr : float
        Learning rate, > 0.

    Raises
    ------
    ModelConfigError
        On ``size < 0`` or a non-positive ``lr``.
    """

    def __init__(self, size: int, lr: float = 0.01):
        if not isinstance(size, (int, np.integer)) or size < 0:
            raise ModelConfigError(f"size: expected an int >= 0, got {size!r}")
        self.size = int(size)
        self.lr = _check_lr(lr)

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        """Update ``params : float32[P]`` in place from ``grad : float32[P]``.

        Raises
        ------
        ModelInputError
            If either array is not ``float32[P]``.
        """
        self.step_range(params, grad, 0, self.size)

    def begin_step(self) -> None:
        """SGD keeps no step count: nothing to compute for :meth:`step_range`."""
        return None

    def step_range(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int, coeffs=None) -> None:
        """``params[lo:hi] -= lr * grad[lo:hi]`` in place; ``params``, ``grad`` : float32[P].

        Raises
        ------
        ModelInputError
            If either array is not ``float32[P]`` or the range is not within ``[0, P]``.
        """
        _check_step(params, grad, lo, hi, self.size)
        sgd_update(params[lo:hi], grad[lo:hi], self.lr)


class Adam:
    """Adam (Kingma & Ba), bias-corrected, PyTorch's formulation:
    ``params -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``.

    Parameters
    ----------
    size : int
        Length ``P`` of the parameter vector.
    lr : float
        Learning rate, > 0.
    beta1, beta2 : float
        Moment decay rates in [0, 1).
    eps : float
        Denominator term, > 0, added to the bias-corrected ``sqrt(v / (1 - beta2^t))`` (the paper's
        Algorithm 1, PyTorch's ``torch.optim.Adam``, Paddle's ``adam`` op). A sparse table's lazy Adam
        (``sparse_tables._optimizers``, Paddle's SparseAdamSGDRule) adds its ``epsilon`` to the
        uncorrected ``sqrt(v)`` instead (the paper's "epsilon hat"): the same configured value is not the
        same damping on both sides (there it acts as ``eps / sqrt(1 - beta2^t)`` here would).

    Attributes
    ----------
    m, v : float32[P]
        First and second moments.
    t : int
        Steps taken.

    Raises
    ------
    ModelConfigError
        On a bad hyper-parameter.
    """

    def __init__(self, size: int, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8):
        if not isinstance(size, (int, np.integer)) or size < 0:
            raise ModelConfigError(f"size: expected an int >= 0, got {size!r}")
        self.size = int(size)
        self.lr = _check_lr(lr)
        for name, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ModelConfigError(f"{name}: expected a float in [0, 1), got {b!r}")
        if not eps > 0:
            raise ModelConfigError(f"eps: expected a float > 0, got {eps!r}")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.m = np.zeros(self.size, np.float32)
        self.v = np.zeros(self.size, np.float32)
        self.t = 0

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        """Update ``params : float32[P]`` in place from ``grad : float32[P]``.

        Raises
        ------
        ModelInputError
            If either array is not ``float32[P]``.
        """
        _check_step(params, grad, 0, self.size, self.size)     # before t counts the step
        self.step_range(params, grad, 0, self.size, self.begin_step())

    def begin_step(self) -> tuple[float, float]:
        """Count one step (``t += 1``) and return its bias-corrected coefficients for
        :meth:`step_range`: ``(lr / (1 - beta1**t), 1 / sqrt(1 - beta2**t))``. ``step`` = ``begin_step``
        then ``step_range`` over ``[0, P)``; covering ``[0, P)`` with several ranges of one step gives
        the same bits (the update is elementwise)."""
        self.t += 1
        bc1 = 1.0 - self.beta1 ** self.t
        bc2 = 1.0 - self.beta2 ** self.t
        return self.lr / bc1, 1.0 / math.sqrt(bc2)

    def step_range(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int, coeffs) -> None:
        """Update ``params[lo:hi]`` (and ``m``, ``v`` there) in place from ``grad[lo:hi]``, with the
        ``coeffs`` of :meth:`begin_step`; ``params``, ``grad`` : float32[P]. Used to update a range of the
        parameters as soon as its gradient is known (hybrid mode's overlap with the backward pass).

        Raises
        ------
        ModelInputError
            If either array is not ``float32[P]`` or the range is not within ``[0, P]``.
        """
        _check_step(params, grad, lo, hi, self.size)
        adam_update(params[lo:hi], grad[lo:hi], self.m[lo:hi], self.v[lo:hi], coeffs[0], coeffs[1],
                    self.beta1, self.beta2, self.eps)

    def state_dict(self) -> dict:
        """Copies of ``m``, ``v`` and ``t`` (for checkpoints)."""
        return {"m": self.m.copy(), "v": self.v.copy(), "t": self.t}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`.

        Raises
        ------
        ModelInputError
            If ``m``/``v`` are not ``float32[P]`` or ``t`` is negative.
        """
        _check_vec("state['m']", state.get("m"), self.size)
        _check_vec("state['v']", state.get("v"), self.size)
        t = state.get("t")
        if not isinstance(t, (int, np.integer)) or t < 0:
            raise ModelInputError(f"state['t']: expected an int >= 0, got {t!r}")
        self.m[...] = state["m"]
        self.v[...] = state["v"]
        self.t = int(t)


__all__ = ["Adam", "SGD"]
