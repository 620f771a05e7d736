"""Per-row sparse optimizer rules (Numba), applied on the server to one row record at a time.

Each rule reads the row's values ``w = arena_f[r, voff:voff+dim]`` and optimizer state
``s = arena_f[r, soff:...]``, and a gradient ``g = grads[gi] * scale`` (scale is 1/show when the push
carried show counts). Arithmetic is float64, stored back as float32, except row-wise
Adagrad's per-dimension loops, which run in float32 (the hottest rule; vectorized at twice the width). After every update values are
clipped to ``[hp[HP_MIN], hp[HP_MAX]]`` (Paddle's weight_bounds).

sgd          w -= lr * g
adagrad      row-wise (FBGEMM/TorchRec ROWWISE_ADAGRAD): a += mean(g^2); w -= lr * g / (sqrt(a) + eps)
std_adagrad  per dimension (Duchi et al. 2011): a_j += g_j^2; w_j -= lr * g_j / (sqrt(a_j) + eps)
adam         lazy Adam (Kingma & Ba 2015, per-row step via beta powers as Paddle's SparseAdamSGDRule):
             p1 *= b1; p2 *= b2; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
             w -= lr * sqrt(1-p2) / (1-p1) * m / (sqrt(v) + eps)
ftrl         FTRL-Proximal (McMahan et al. 2013, Algorithm 1), alpha = lr:
             sigma = (sqrt(n + g^2) - sqrt(n)) / alpha; z += g - sigma w; n += g^2;
             w = 0 if |z| <= l1 else -(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2)
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._jit import borrowed

OPT_SGD = 0
OPT_ADAGRAD = 1
OPT_STD_ADAGRAD = 2
OPT_ADAM = 3
OPT_FTRL = 4

HP_LR = 0
HP_EPS = 1
HP_INIT_ACC = 2
HP_BETA1 = 3
HP_BETA2 = 4
HP_FTRL_BETA = 5
HP_L1 = 6
HP_L2 = 7
HP_MIN = 8
HP_MAX = 9
HP_SIZE = 10


@borrowed
def init_state(arena_f, r, soff, dim, opt, hp):
    """Optimizer state of a new row: accumulators at hp[HP_INIT_ACC], moments 0, beta powers 1."""
    if opt == OPT_ADAGRAD:
        arena_f[r, soff] = hp[HP_INIT_ACC]
    elif opt == OPT_STD_ADAGRAD:
        for j in range(dim):
            arena_f[r, soff + j] = hp[HP_INIT_ACC]
    elif opt == OPT_ADAM:
        for j in range(2 * dim):
            arena_f[r, soff + j] = 0.0
        arena_f[r, soff + 2 * dim] = 1.0
        arena_f[r, soff + 2 * dim + 1] = 1.0
    elif opt == OPT_FTRL:
        for j in range(2 * dim):
            arena_f[r, soff + j] = 0.0


@borrowed
def _clip(w, hp):
    if w < hp[HP_MIN]:
        return hp[HP_MIN]
    if w > hp[HP_MAX]:
        return hp[HP_MAX]
    return w


@borrowed
def apply_update(arena_f, r, voff, soff, dim, grads, gi, scale, opt, hp):
    """Apply one optimizer step to row r with gradient grads[gi] * scale."""
    lr = hp[HP_LR]
    eps = hp[HP_EPS]
    if opt == OPT_SGD:
        for j in range(dim):
            g = np.float64(grads[gi, j]) * scale
            arena_f[r, voff + j] = _clip(np.float64(arena_f[r, voff + j]) - lr * g, hp)
    elif opt == OPT_ADAGRAD:
        # the per-dimension loops run in float32 (vectorized, twice the SIMD width of float64);
        # the row's scalar accumulator and step size stay in float64
        s32 = np.float32(scale)
        gsq = np.float32(0.0)
        for j in range(dim):
            g = grads[gi, j] * s32
            gsq += g * g
        acc = np.float64(arena_f[r, soff]) + np.float64(gsq) / dim
        arena_f[r, soff] = acc
        mult = np.float32(lr / (np.sqrt(np.float64(arena_f[r, soff])) + eps)) * s32
        lo = np.float32(hp[HP_MIN])
        hi = np.float32(hp[HP_MAX])
        for j in range(dim):
            w = arena_f[r, voff + j] - mult * grads[gi, j]
            arena_f[r, voff + j] = min(max(w, lo), hi)
    elif opt == OPT_STD_ADAGRAD:
        for j in range(dim):
            g = np.float64(grads[gi, j]) * scale
            arena_f[r, soff + j] = np.float64(arena_f[r, soff + j]) + g * g
            a = np.float64(arena_f[r, soff + j])
            arena_f[r, voff + j] = _clip(np.float64(arena_f[r, voff + j]) - lr * g / (np.sqrt(a) + eps), hp)
    elif opt == OPT_ADAM:
        b1 = hp[HP_BETA1]
        b2 = hp[HP_BETA2]
        arena_f[r, soff + 2 * dim] = np.float64(arena_f[r, soff + 2 * dim]) * b1
        arena_f[r, soff + 2 * dim + 1] = np.float64(arena_f[r, soff + 2 * dim + 1]) * b2
        p1 = np.float64(arena_f[r, soff + 2 * dim])
        p2 = np.float64(arena_f[r, soff + 2 * dim + 1])
        step = lr * np.sqrt(1.0 - p2) / (1.0 - p1)
        for j in range(dim):
            g = np.float64(grads[gi, j]) * scale
            arena_f[r, soff + j] = b1 * np.float64(arena_f[r, soff + j]) + (1.0 - b1) * g
            arena_f[r, soff + dim + j] = b2 * np.float64(arena_f[r, soff + dim + j]) + (1.0 - b2) * g * g
            m = np.float64(arena_f[r, soff + j])
            v = np.float64(arena_f[r, soff + dim + j])
            arena_f[r, voff + j] = _clip(np.float64(arena_f[r, voff + j]) - step * m / (np.sqrt(v) + eps), hp)
    elif opt == OPT_FTRL:
        beta = hp[HP_FTRL_BETA]
        l1 = hp[HP_L1]
        l2 = hp[HP_L2]
        for j in range(dim):
            g = np.float64(grads[gi, j]) * scale
            w = np.float64(arena_f[r, voff + j])
            z = np.float64(arena_f[r, soff + j])
            n = np.float64(arena_f[r, soff + dim + j])
            sigma = (np.sqrt(n + g * g) - np.sqrt(n)) / lr
            arena_f[r, soff + j] = z + g - sigma * w
            arena_f[r, soff + dim + j] = n + g * g
            z = np.float64(arena_f[r, soff + j])
            n = np.float64(arena_f[r, soff + dim + j])
            if abs(z) <= l1:
                w = 0.0
            else:
                w = -(z - np.sign(z) * l1) / ((beta + np.sqrt(n)) / lr + l2)
            arena_f[r, voff + j] = _clip(w, hp)


@njit(nogil=True, cache=True)
def apply_updates(values_state, grads, scales, dim, opt, hp):
    """Apply one step to each row of a standalone [n, dim + state] float32 array (test and reference
    entry point: the same rule the table runs). grads : float32[n, dim]; scales : float64[n]."""
    for i in range(values_state.shape[0]):
        apply_update(values_state, i, 0, dim, dim, grads, i, scales[i], opt, hp)


@njit(nogil=True, cache=True)
def init_states(values_state, dim, opt, hp):
    """Initialise the optimizer state columns of a standalone [n, dim + state] array."""
    for i in range(values_state.shape[0]):
        init_state(values_state, i, dim, dim, opt, hp)
