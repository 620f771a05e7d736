"""Flat dense-parameter layout and the fully connected ReLU tower shared by CTR-DNN and DeepFM.

All dense weights of a model live in ONE flat vector so the parameter server can hold them as one
dense table; each layer is a named, reshaped view into it. Weights are stored ``[in, out]`` so a
layer is ``h_out = relu(h_in @ W + b)`` on row-major ``[B, in]`` activations.

Example layout, ``MLPTower(in_dim=273, hidden=(400, 400))``::

    name         offset   shape
    fc0.weight   0        (273, 400)
    fc0.bias     109200   (400,)
    fc1.weight   109600   (400, 400)
    fc1.bias     269600   (400,)
    out.weight   270000   (400, 1)
    out.bias     270400   (1,)          size = 270401
"""
from __future__ import annotations

from math import prod, sqrt
from typing import Callable, Iterable, Sequence

import numpy as np

from ._kernels import bias_relu, relu_backward_bias


class DenseLayout:
    """Named views into one flat parameter vector.

    Parameters
    ----------
    entries : iterable of (str, tuple of int)
        ``(name, shape)`` in storage order; names must be unique.
    """

    def __init__(self, entries: Iterable[tuple[str, tuple[int, ...]]]):
        out: list[tuple[str, int, tuple[int, ...]]] = []
        offset = 0
        for name, shape in entries:
            shape = tuple(int(n) for n in shape)
            out.append((name, offset, shape))
            offset += prod(shape)
        names = [e[0] for e in out]
        if len(set(names)) != len(names):
            raise ValueError(f"layout names must be unique, got {names}")
        self.entries: tuple[tuple[str, int, tuple[int, ...]], ...] = tuple(out)
        self.size: int = offset

    def views(self, vec: np.ndarray) -> dict[str, np.ndarray]:
        """Views of ``vec`` (``float[size]``) reshaped per entry; writes go through to ``vec``."""
        return {name: vec[off:off + prod(shape)].reshape(shape) for name, off, shape in self.entries}

    def __repr__(self) -> str:
        rows = ", ".join(f"{n}@{o}{s}" for n, o, s in self.entries)
        return f"DenseLayout(size={self.size}: {rows})"


class MLPTower:
    """``in_dim -> hidden[0] -> ... -> hidden[-1] -> 1`` with ReLU after every hidden layer.

    The object holds only the shapes; parameters are views passed in by the model, and activation
    buffers come from the model's per-batch-size scratch.

    Parameters
    ----------
    in_dim : int
    hidden : sequence of int
        Hidden layer sizes; empty means a linear model ``x @ w + b``.
    """

    def __init__(self, in_dim: int, hidden: Sequence[int]):
        self.in_dim = int(in_dim)
        self.hidden = tuple(int(h) for h in hidden)

    def layout_entries(self) -> list[tuple[str, tuple[int, ...]]]:
        entries: list[tuple[str, tuple[int, ...]]] = []
        fan_in = self.in_dim
        for i, h in enumerate(self.hidden):
            entries += [(f"fc{i}.weight", (fan_in, h)), (f"fc{i}.bias", (h,))]
            fan_in = h
        entries += [("out.weight", (fan_in, 1)), ("out.bias", (1,))]
        return entries

    def init(self, p: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """Hidden weights He-normal (std ``sqrt(2/fan_in)``, suited to ReLU), output weight
        Glorot-uniform (limit ``sqrt(6/(fan_in+1))``), biases zero. Draws in layer order."""
        fan_in = self.in_dim
        for i, h in enumerate(self.hidden):
            p[f"fc{i}.weight"][...] = rng.normal(0.0, sqrt(2.0 / fan_in), size=(fan_in, h))
            p[f"fc{i}.bias"][...] = 0.0
            fan_in = h
        lim = sqrt(6.0 / (fan_in + 1))
        p["out.weight"][...] = rng.uniform(-lim, lim, size=(fan_in, 1))
        p["out.bias"][...] = 0.0

    def buffers(self, batch: int, dtype) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Activation buffers ``hs`` and gradient buffers ``ds``, one ``[B, h]`` pair per hidden
        layer."""
        hs = [np.empty((batch, h), dtype) for h in self.hidden]
        ds = [np.empty((batch, h), dtype) for h in self.hidden]
        return hs, ds

    def forward(self, x: np.ndarray, p: dict[str, np.ndarray], hs: list[np.ndarray],
                z: np.ndarray) -> None:
        """Write the tower's logit into ``z : float[B, 1]``; keep activations in ``hs``."""
        h = x
        for i, buf in enumerate(hs):
            np.matmul(h, p[f"fc{i}.weight"], out=buf)
            bias_relu(buf, p[f"fc{i}.bias"])
            h = buf
        np.matmul(h, p["out.weight"], out=z)
        z += p["out.bias"]

    def backward(self, g: np.ndarray, x: np.ndarray, p: dict[str, np.ndarray],
                 hs: list[np.ndarray], ds: list[np.ndarray], grads: dict[str, np.ndarray],
                 dx: np.ndarray | None, done: Callable[[tuple[str, ...]], None] | None = None) -> None:
        """Backward pass of :meth:`forward`.

        Parameters
        ----------
        g : float[B, 1]
            dL/dz.
        x : float[B, in_dim]
            Forward input.
        p, grads : dict of views
            Parameters and their gradients (overwritten), same names.
        hs, ds : lists of float[B, h]
            Forward activations; ``ds`` is overwritten with dL/d(pre-activation).
        dx : float[B, k] or None
            If given, receives dL/dx for the FIRST ``k`` input columns only (the embedding block;
            the dense features need no input gradient).
        done : callable or None
            Called with a layer's parameter names (``("fc1.weight", "fc1.bias")``) as soon as their
            gradients are final and this pass no longer reads those parameters, from the output layer
            down: a caller may all-reduce those gradients and update those parameters in place while
            the pass goes on (hybrid mode's overlap, PyTorch DDP's gradient buckets).
        """
        h_last = hs[-1] if hs else x
        np.matmul(h_last.T, g, out=grads["out.weight"])
        grads["out.bias"][0] = g.sum()
        n = len(hs)
        if n == 0:
            if dx is not None:
                np.multiply(g, p["out.weight"][:dx.shape[1]].T, out=dx)
            if done is not None:
                done(("out.weight", "out.bias"))
            return
        np.multiply(g, p["out.weight"].T, out=ds[-1])
        if done is not None:
            done(("out.weight", "out.bias"))
        for i in range(n - 1, -1, -1):
            relu_backward_bias(ds[i], hs[i], grads[f"fc{i}.bias"])
            inp = hs[i - 1] if i > 0 else x
            np.matmul(inp.T, ds[i], out=grads[f"fc{i}.weight"])
            w = p[f"fc{i}.weight"]
            if i > 0:
                np.matmul(ds[i], w.T, out=ds[i - 1])
            elif dx is not None:
                np.matmul(ds[0], w[:dx.shape[1]].T, out=dx)
            if done is not None:
                done((f"fc{i}.weight", f"fc{i}.bias"))
