"""Numba kernels of the engine package (metrics accumulation).

Each takes only numpy arrays and scalars, writes into arrays owned by the caller and runs without the
GIL (``nogil=True``) on the calling thread.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def binary_metrics_update(probs, labels, pos, neg, log_eps):
    """Add one batch to prediction histograms and return its logloss / prediction / label sums.

    Bucket of a prediction ``p``: ``min(int(p * nb), nb - 1)`` with ``nb = len(pos)``; an example is
    positive when its label is ``> 0.5``. The logloss term is ``-(y log p' + (1 - y) log(1 - p'))`` with
    ``p' = clip(p, log_eps, 1 - log_eps)`` (soft labels allowed), accumulated in float64.

    Parameters
    ----------
    probs : float32[n] or float64[n]
        Predicted probabilities in [0, 1].
    labels : float32[n] or float64[n]
    pos, neg : int64[nb]
        Histograms of positives / negatives, incremented in place.
    log_eps : float

    Returns
    -------
    bad : int
        -1, or the index of the first probability outside [0, 1] or NaN (nothing is added then).
    loss_sum, pred_sum, label_sum : float
    """
    n = len(probs)
    for i in range(n):
        p = np.float64(probs[i])
        if not (p >= 0.0 and p <= 1.0):
            return i, 0.0, 0.0, 0.0
    nb = len(pos)
    loss = 0.0
    psum = 0.0
    ysum = 0.0
    for i in range(n):
        p = np.float64(probs[i])
        y = np.float64(labels[i])
        b = min(np.int64(p * nb), nb - 1)
        if y > 0.5:
            pos[b] += 1
        else:
            neg[b] += 1
        q = min(max(p, log_eps), 1.0 - log_eps)
        loss -= y * math.log(q) + (1.0 - y) * math.log(1.0 - q)
        psum += p
        ysum += y
    return -1, loss, psum, ysum
