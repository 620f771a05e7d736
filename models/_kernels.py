"""Numba kernels of the models package.

Every kernel takes only numpy arrays and scalars, writes into arrays owned by the caller and does not
allocate. They are generic over the float type (float32 in training, float64 in gradient checks).
None of them is parallel: each call runs on the calling thread without the GIL (``nogil=True``), so
a worker can run several model instances on several threads.

Sparse index layout used by the pool/scatter kernels (one batch of ``B`` examples, ``S`` slots)::

    emb      : float[u, width]   one row per UNIQUE key of the batch (pulled from the PS)
    rows     : int32[nnz]        occurrence i reads row rows[i] of emb
    segments : int32[nnz]        occurrence i belongs to cell segments[i] = example * S + slot

    e.g. B=2, S=2, example 0 = {slot0: [k7], slot1: [k3, k7]}, example 1 = {slot0: [k3], slot1: []}
    unique keys [k7, k3] -> emb rows 0, 1
    rows     = [0, 1, 0, 1]
    segments = [0, 1, 1, 2]          # cell 3 (example 1, slot 1) is empty and pools to zeros

Pooling is a SUM over the occurrences of one cell; the pooled cell (b, s) occupies the ``width``
columns ``dst_col + s*width ... dst_col + (s+1)*width - 1`` of row ``b`` of the output.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def pool_sum(emb, rows, segments, src_col, width, num_slots, out, dst_col):
    """Sum-pool embedding rows into per-example slot blocks.

    Zeroes ``out[:, dst_col : dst_col + num_slots*width]`` and then, for every occurrence ``i``
    with cell ``c = segments[i] = b*num_slots + s``, adds
    ``emb[rows[i], src_col : src_col+width]`` into ``out[b, dst_col + s*width : ... + width]``.

    Parameters
    ----------
    emb : float[u, row_width]
        Pulled rows, one per unique key.
    rows : int32[nnz]
        Row of ``emb`` read by each occurrence.
    segments : int32[nnz]
        Pooled cell id of each occurrence, ``example * num_slots + slot``.
    src_col : int
        First column of ``emb`` to pool.
    width : int
        Number of columns to pool (``src_col + width <= row_width``).
    num_slots : int
        Slots per example ``S``.
    out : float[B, n_cols]
        Output, written in columns ``dst_col ... dst_col + num_slots*width - 1``.
    dst_col : int
        First output column.

    Returns
    -------
    bad : int
        -1 on success, else the index of the first occurrence whose row is outside ``[0, u)`` or
        whose cell is outside ``[0, B*num_slots)``; ``out`` is then only partly written.
    """
    n_b = out.shape[0]
    n_u = emb.shape[0]
    n_cells = n_b * num_slots
    out[:, dst_col:dst_col + num_slots * width] = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        cell = segments[i]
        if r < 0 or r >= n_u or cell < 0 or cell >= n_cells:
            return i
        b = cell // num_slots
        # 1-D row views: unit stride and no aliasing between o and e, so LLVM vectorizes
        o = out[b, dst_col + (cell - b * num_slots) * width:]
        e = emb[r, src_col:]
        for j in range(width):
            o[j] += e[j]
    return -1


@njit(cache=True, nogil=True)
def scatter_add(grad, rows, segments, src_col, width, num_slots, grad_emb, dst_col):
    """Backward of :func:`pool_sum`: scatter-add pooled-cell gradients onto the unique rows.

    For every occurrence ``i`` with cell ``c = segments[i] = b*num_slots + s``, adds
    ``grad[b, src_col + s*width : ... + width]`` into ``grad_emb[rows[i], dst_col : dst_col+width]``.
    ``grad_emb`` is accumulated into, not zeroed, so several calls (e.g. DeepFM's first-order column
    and its embedding columns) can fill one row block. Duplicate keys add up.

    Parameters
    ----------
    grad : float[B, n_cols]
        Gradient w.r.t. the pooled output laid out as :func:`pool_sum` writes it.
    rows : int32[nnz]
    segments : int32[nnz]
    src_col : int
        First column of ``grad`` holding slot 0.
    width : int
    num_slots : int
    grad_emb : float[u, row_width]
        Accumulated into.
    dst_col : int
        First column of ``grad_emb`` to write.

    Returns
    -------
    bad : int
        -1 on success, else the index of the first out-of-range occurrence (nothing is written for
        it or after it).
    """
    n_b = grad.shape[0]
    n_u = grad_emb.shape[0]
    n_cells = n_b * num_slots
    for i in range(rows.shape[0]):
        r = rows[i]
        cell = segments[i]
        if r < 0 or r >= n_u or cell < 0 or cell >= n_cells:
            return i
        b = cell // num_slots
        gr = grad[b, src_col + (cell - b * num_slots) * width:]
        ge = grad_emb[r, dst_col:]
        for j in range(width):
            ge[j] += gr[j]
    return -1


@njit(cache=True, nogil=True)
def bias_relu(z, bias):
    """In place ``z = max(z + bias, 0)``.

    Parameters
    ----------
    z : float[B, n]
    bias : float[n]
    """
    n_b, n = z.shape
    for b in range(n_b):
        for j in range(n):
            v = z[b, j] + bias[j]
            z[b, j] = v if v > 0.0 else 0.0


@njit(cache=True, nogil=True)
def relu_backward_bias(d, h, grad_bias):
    """In place ReLU backward plus the bias gradient.

    ``d`` holds dL/dh on entry and dL/dz on exit (zeroed where ``h <= 0``, i.e. where the
    pre-activation was not positive); ``grad_bias[j] = sum_b d[b, j]`` (overwritten).

    Parameters
    ----------
    d : float[B, n]
    h : float[B, n]
        Post-activation values of the forward pass.
    grad_bias : float[n]
    """
    n_b, n = d.shape
    zero = d.dtype.type(0.0)
    for j in range(n):
        grad_bias[j] = zero
    for b in range(n_b):
        db = d[b]
        hb = h[b]
        for j in range(n):
            # branch-free select in the array dtype so LLVM vectorizes the row
            v = db[j] if hb[j] > zero else zero
            db[j] = v
            grad_bias[j] += v


@njit(cache=True, nogil=True)
def sigmoid_xent(z, y, scale, prob, grad):
    """Numerically stable sigmoid cross-entropy on logits.

    ``loss_i = max(z,0) - z*y + log1p(exp(-|z|))``; ``prob_i = sigmoid(z_i)``;
    ``grad_i = (prob_i - y_i) * scale`` (``scale = 1/B`` gives the gradient of the mean loss).
    Computed in float64 internally, also for float32 arrays, and rounded once when stored; no overflow
    for any finite ``z``. (``np.float64(x)``, not ``float(x)``: Numba types ``float()`` of a float32 as
    float32, so ``exp``, ``log1p`` and ``z*y`` ran in float32 and each loss term had float32 precision,
    e.g. 7000.0 for ``z = 1e4, y = 0.3`` instead of 6999.99988.)

    Parameters
    ----------
    z : float[B]
        Logits.
    y : float[B]
        Labels in [0, 1].
    scale : float
    prob : float[B]
        Output probabilities.
    grad : float[B]
        Output dL/dz.

    Returns
    -------
    loss_sum : float
        Sum (not mean) of the per-example losses, in float64.
    """
    total = 0.0
    for i in range(z.shape[0]):
        zi = np.float64(z[i])
        yi = np.float64(y[i])
        if zi >= 0.0:
            e = math.exp(-zi)
            p = 1.0 / (1.0 + e)
            total += zi - zi * yi + math.log1p(e)
        else:
            e = math.exp(zi)
            p = e / (1.0 + e)
            total += -zi * yi + math.log1p(e)
        prob[i] = p
        grad[i] = (p - yi) * scale
    return total


@njit(cache=True, nogil=True)
def sigmoid(z, prob):
    """``prob = 1 / (1 + exp(-z))`` without overflow, in float64 (as :func:`sigmoid_xent`, bit for bit).

    Parameters
    ----------
    z : float[B]
    prob : float[B]
    """
    for i in range(z.shape[0]):
        zi = np.float64(z[i])
        if zi >= 0.0:
            prob[i] = 1.0 / (1.0 + math.exp(-zi))
        else:
            e = math.exp(zi)
            prob[i] = e / (1.0 + e)


@njit(cache=True, nogil=True)
def fm_forward(x, num_slots, dim, col0, sum_v, out):
    """Second-order factorization-machine term over pooled slot embeddings.

    With ``v[b, s, :] = x[b, col0 + s*dim : col0 + (s+1)*dim]``:
    ``sum_v[b, d] = sum_s v[b, s, d]`` and
    ``out[b] = 0.5 * sum_d (sum_v[b, d]**2 - sum_s v[b, s, d]**2)`` (the sum of pairwise dot
    products of the slot embeddings).

    Parameters
    ----------
    x : float[B, n_cols]
    num_slots : int
    dim : int
    col0 : int
    sum_v : float[B, dim]
        Output, kept for :func:`fm_backward`.
    out : float[B]
        Output.
    """
    n_b = x.shape[0]
    for b in range(n_b):
        xb = x[b, col0:]
        sv = sum_v[b]
        sv[:] = 0
        sq = 0.0
        for s in range(num_slots):
            vs = xb[s * dim:]
            for d in range(dim):
                v = vs[d]
                sv[d] += v
                sq += v * v
        tot = 0.0
        for d in range(dim):
            tot += sv[d] * sv[d]
        out[b] = 0.5 * (tot - sq)


@njit(cache=True, nogil=True)
def fm_backward(g, x, num_slots, dim, col0, sum_v, dx):
    """Backward of :func:`fm_forward`, accumulated into ``dx``.

    ``dx[b, col0 + s*dim + d] += g[b] * (sum_v[b, d] - v[b, s, d])``.

    Parameters
    ----------
    g : float[B]
        dL/d out.
    x : float[B, n_cols]
        Forward input.
    num_slots, dim, col0 : int
    sum_v : float[B, dim]
        From :func:`fm_forward`.
    dx : float[B, n_cols_dx]
        Accumulated into, same column layout as ``x`` shifted by ``col0`` (slot ``s`` at
        ``s*dim``).
    """
    n_b = x.shape[0]
    for b in range(n_b):
        gb = g[b]
        xb = x[b, col0:]
        dxb = dx[b]
        sv = sum_v[b]
        for s in range(num_slots):
            o = s * dim
            for d in range(dim):
                dxb[o + d] += gb * (sv[d] - xb[o + d])


# error_model="numpy": Numba's default ("python") checks every division for a zero divisor to raise
# ZeroDivisionError, and that branch keeps LLVM from vectorizing the loop (scalar vsqrtss/vdivss). Here
# the divisor is >= eps > 0, so the check never fires and dropping it changes no bit (IEEE sqrt and
# division are correctly rounded, packed or not): the 430k-parameter CTR-DNN step went from 1.5-1.8 ms to
# 0.19-0.20 ms on this machine (vsqrtps/vdivps; both alternating in one process beside another benchmark,
# 0.26 ms on the idle machine), bit-identical (tests/unit/test_models_optim.py).
@njit(cache=True, nogil=True, error_model="numpy")
def adam_update(params, grad, m, v, step_size, inv_sqrt_bc2, beta1, beta2, eps):
    """One Adam step in place (PyTorch's formulation), with float32 arithmetic.

    ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
    ``params -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)`` where the caller passes
    ``step_size = lr / (1 - b1**t)`` and ``inv_sqrt_bc2 = 1 / sqrt(1 - b2**t)``.

    The scalars are rounded to float32 once and every element is computed in float32, as PyTorch's
    Adam does for float32 parameters; mixing in the float64 scalars made each element convert to
    float64 and back, and the 430k-parameter CTR-DNN step took 1.4 ms instead of 0.8 ms.

    Parameters
    ----------
    params, grad, m, v : float32[n]
    step_size, inv_sqrt_bc2, beta1, beta2, eps : float
    """
    b1 = np.float32(beta1)
    b2 = np.float32(beta2)
    c1 = np.float32(1.0 - beta1)
    c2 = np.float32(1.0 - beta2)
    ss = np.float32(step_size)
    ib = np.float32(inv_sqrt_bc2)
    e = np.float32(eps)
    for i in range(params.shape[0]):
        gi = grad[i]
        mi = b1 * m[i] + c1 * gi
        vi = b2 * v[i] + c2 * gi * gi
        m[i] = mi
        v[i] = vi
        params[i] -= ss * mi / (np.sqrt(vi) * ib + e)


@njit(cache=True, nogil=True)
def sgd_update(params, grad, lr):
    """In place ``params -= lr * grad``.

    Parameters
    ----------
    params, grad : float32[n]
    lr : float
    """
    for i in range(params.shape[0]):
        params[i] -= lr * grad[i]
