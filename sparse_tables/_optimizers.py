"""Per-row sparse optimizer rules (Numba), applied on the server to one row record at a time.

Each rule reads the row's values ``w = arena_f[r, voff:voff+dim]`` and optimizer state
``s = arena_f[r, soff:...]``, and a gradient ``g = grads[gi] * scale`` (scale is 1/show when the push
carried show counts). Arithmetic is float64, stored back as float32, except row-wise
Adagrad's per-dimension loops, which run in float32 (the hottest rule; see ``adagrad_row``). After every update values are
clipped to ``[hp[HP_MIN], hp[HP_MAX]]`` (Paddle's weight_bounds).

sgd          w -= lr * g
adagrad      row-wise (FBGEMM/TorchRec ROWWISE_ADAGRAD): a += mean(g^2); w -= lr * g / (sqrt(a) + eps)
std_adagrad  per dimension (Duchi et al. 2011): a_j += g_j^2; w_j -= lr * g_j / (sqrt(a_j) + eps)
adam         lazy Adam (Kingma & Ba 2015, per-row step via beta powers as Paddle's SparseAdamSGDRule):
             p1 *= b1; p2 *= b2; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
             w -= lr * sqrt(1-p2) / (1-p1) * m / (sqrt(v) + eps)
             eps here is the paper's "epsilon hat" (the form at the end of its section 2), added to the
             UNcorrected sqrt(v): Paddle's SparseAdamSGDRule (ps/table/sparse_sgd_rule.cc), PyTorch's
             SparseAdam and TensorFlow's Adam / LazyAdam do the same. The dense tables' Adam
             (models.optim.Adam: PyTorch's Adam, the paper's Algorithm 1) adds its epsilon to the
             bias-corrected sqrt(v / (1-b2^t)) instead, so one `epsilon` value is a larger damping here:
             this rule equals the dense one with eps / sqrt(1-p2) there, i.e. 31.6x (t = 1), 10x (t = 10),
             3.2x (t = 100), 1.26x (t = 1000) the configured value at b2 = 0.999, t being the row's own
             update count (lazy: rare keys stay at small t). It matters only for gradients near epsilon.
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
def apply_other(arena_f, r, voff, soff, dim, grads, gi, scale, opt, hp):
    """One step of any rule but row-wise Adagrad (``adagrad_row``) to row r with gradient grads[gi] * scale."""
    lr = hp[HP_LR]
    eps = hp[HP_EPS]
    if opt == OPT_SGD:
        for j in range(dim):
            g = np.float64(grads[gi, j]) * scale
            arena_f[r, voff + j] = _clip(np.float64(arena_f[r, voff + j]) - lr * g, hp)
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


@njit(inline="always")
def adagrad_row(arena_f, r, voff, soff, dim, grads, gi, scale, hp):
    """Row-wise Adagrad on row r with gradient ``grads[gi] * scale`` (scale : float64).

    The hottest rule, inlined into the table's push loop (which runs without reference counting, so
    inlining adds no atomics). Per-dimension loops run in float32 (twice the SIMD width of float64);
    the row's accumulator and step size stay in float64. The squared gradient is summed in 8
    interleaved lanes, then pairwise: float adds do not reassociate, so one running sum is a chain of
    dim dependent adds while 8 lanes are independent. The order is fixed, so every caller gets the
    same bits.
    """
    s32 = np.float32(scale)
    q0 = q1 = q2 = q3 = q4 = q5 = q6 = q7 = np.float32(0.0)
    j = 0
    while j + 8 <= dim:
        g0 = grads[gi, j] * s32
        g1 = grads[gi, j + 1] * s32
        g2 = grads[gi, j + 2] * s32
        g3 = grads[gi, j + 3] * s32
        g4 = grads[gi, j + 4] * s32
        g5 = grads[gi, j + 5] * s32
        g6 = grads[gi, j + 6] * s32
        g7 = grads[gi, j + 7] * s32
        q0 += g0 * g0
        q1 += g1 * g1
        q2 += g2 * g2
        q3 += g3 * g3
        q4 += g4 * g4
        q5 += g5 * g5
        q6 += g6 * g6
        q7 += g7 * g7
        j += 8
    while j < dim:
        g = grads[gi, j] * s32
        q0 += g * g
        j += 1
    gsq = ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7))
    acc = np.float64(arena_f[r, soff]) + np.float64(gsq) / dim
    arena_f[r, soff] = acc
    mult = np.float32(hp[HP_LR] / (np.sqrt(np.float64(arena_f[r, soff])) + hp[HP_EPS])) * s32
    lo = np.float32(hp[HP_MIN])
    hi = np.float32(hp[HP_MAX])
    for j in range(dim):
        w = arena_f[r, voff + j] - mult * grads[gi, j]
        arena_f[r, voff + j] = min(max(w, lo), hi)


@njit(nogil=True, cache=True)
def apply_updates(values_state, grads, scales, dim, opt, hp):
    """Apply one step to each row of a standalone [n, dim + state] float32 array (test and reference
    entry point: the same rule the table runs). grads : float32[n, dim]; scales : float64[n]."""
    for i in range(values_state.shape[0]):
        if opt == OPT_ADAGRAD:
            adagrad_row(values_state, i, 0, dim, dim, grads, i, scales[i], hp)
        else:
            apply_other(values_state, i, 0, dim, dim, grads, i, scales[i], opt, hp)


@njit(nogil=True, cache=True)
def init_states(values_state, dim, opt, hp):
    """Initialise the optimizer state columns of a standalone [n, dim + state] array."""
    for i in range(values_state.shape[0]):
        init_state(values_state, i, dim, dim, opt, hp)
