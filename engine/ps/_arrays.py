"""Array helpers of ``PSClient``: argument checks (before anything is sent) and the Numba gathers,
deduplication and segment sums that prepare requests and reassemble replies."""
from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from . import _kernels


def check_keys(keys) -> np.ndarray:
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.ndim != 1:
        got = f"{keys.dtype}{list(keys.shape)}" if isinstance(keys, np.ndarray) else type(keys).__name__
        raise ProtocolError(f"keys: expected a uint64[n] array, got {got}")
    return keys


def check_array(arr, shape: tuple, name: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.ndim != len(shape) or any(
            w is not None and w != g for w, g in zip(shape, arr.shape)):
        got = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
        want = "[" + ", ".join("P" if w is None else str(w) for w in shape) + "]"
        raise ProtocolError(f"{name}: expected float32{want}, got {got}")
    if not _kernels.all_finite(arr):
        raise ProtocolError(f"{name}: contains NaN or Inf; nothing was sent")
    return np.ascontiguousarray(arr)


def take(arr: np.ndarray | None, pos) -> np.ndarray | None:
    """arr[pos] for a slice (a view) or int64 positions (a Numba gather); None for no positions
    (a server without a part of a Step request) or no array."""
    if arr is None or pos is None:
        return None
    if isinstance(pos, slice):
        return arr if pos.start == 0 and pos.stop >= len(arr) else arr[pos]
    out = np.empty((len(pos),) + arr.shape[1:], arr.dtype)
    if arr.ndim == 1:
        _kernels.take_1d(arr, pos, out)
    else:
        _kernels.take_rows(arr, pos, out)
    return out


def count(pos) -> int:
    if pos is None:
        return 0
    return pos.stop - pos.start if isinstance(pos, slice) else len(pos)


def unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(unique keys in first-occurrence order, inverse int64[n]); inverse is None when keys are
    already unique (then the keys are returned as given). O(n), no sort."""
    uniq = np.empty(len(keys), np.uint64)
    inverse = np.empty(len(keys), np.int64)
    nu = _kernels.dedup(np.ascontiguousarray(keys), uniq, inverse)
    if nu == len(keys):
        return keys, None
    return uniq[:nu], inverse


def segment_sum(values: np.ndarray, inverse: np.ndarray, n: int) -> np.ndarray:
    """Sum rows of values with the same inverse index -> float32 of shape (n, ...)."""
    out = np.empty((n,) + values.shape[1:], np.float32)
    if values.ndim == 1:
        _kernels.segment_sum_1d(values, inverse, out)
    else:
        _kernels.segment_sum_2d(values, inverse, out)
    return out


def concat_pushes(parts: list[tuple]) -> tuple:
    """Concatenate pushes ``[(keys uint64[n_i], grads float32[n_i, dim], shows float32[n_i] or None,
    clicks float32[n_i] or None)]`` -> ``(keys, grads, shows or None, clicks or None)``. When some parts
    have shows, the others count one show and no click per key (shows are None only when no part has
    any)."""
    keys = np.concatenate([p[0] for p in parts])
    grads = np.concatenate([p[1] for p in parts])
    if all(p[2] is None for p in parts):
        return keys, grads, None, None
    shows = np.concatenate([p[2] if p[2] is not None else np.ones(len(p[0]), np.float32) for p in parts])
    clicks = np.concatenate([p[3] if p[3] is not None else np.zeros(len(p[0]), np.float32) for p in parts])
    return keys, grads, shows, clicks
