"""Numba kernels of the training modes (GEO replica bookkeeping).

Each takes only numpy arrays and scalars, writes into arrays owned by the caller and runs without the
GIL on the calling thread. Not parallel: a row is written by exactly one iteration.
"""
from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def replica_deltas(local, synced, scale, changed, deltas):
    """Rows a worker changed since the last sync, and their scaled deltas, in one pass.

    Parameters
    ----------
    local, synced : float32[N, dim]
        The replica trained in place and its values at the last sync.
    scale : float32
        ``delta = (local - synced) * scale`` (1: the difference itself).
    changed : int64[N]
        Gets the changed rows in ascending order (first ``n`` entries).
    deltas : float32[N, dim]
        Gets their deltas (first ``n`` rows).

    Returns
    -------
    n : int
        Changed rows: those with any element where ``local != synced`` (NaN counts as changed).
    """
    n = 0
    dim = local.shape[1]
    for i in range(local.shape[0]):
        diff = False
        for j in range(dim):
            if local[i, j] != synced[i, j]:
                diff = True
                break
        if diff:
            changed[n] = i
            if scale == 1:
                for j in range(dim):
                    deltas[n, j] = local[i, j] - synced[i, j]
            else:
                for j in range(dim):
                    deltas[n, j] = (local[i, j] - synced[i, j]) * scale
            n += 1
    return n


@njit(cache=True, nogil=True)
def set_replica_rows(local, synced, rows, values):
    """``local[rows[k]] = synced[rows[k]] = values[k]`` for every k (fresh server values after a sync).

    rows : int64[m] (distinct); values : float32[m, dim].
    """
    dim = local.shape[1]
    for k in range(rows.shape[0]):
        r = rows[k]
        for j in range(dim):
            v = values[k, j]
            local[r, j] = v
            synced[r, j] = v
