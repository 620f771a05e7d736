"""Input checks of the table's public methods, and the keys of row records."""
from __future__ import annotations

import numpy as np

from .errors import TableInputError


def check_keys(keys) -> np.ndarray:
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.ndim != 1:
        got = f"{keys.dtype}{list(keys.shape)}" if isinstance(keys, np.ndarray) else type(keys).__name__
        raise TableInputError(f"keys: expected a uint64[n] array, got {got}")
    return np.ascontiguousarray(keys)


def check_vector(arr, n: int, name: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.shape != (n,):
        got = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise TableInputError(f"{name}: expected float32[{n}] (one count per key), got {got}")
    return np.ascontiguousarray(arr)


def check_counts(shows, clicks, n: int):
    """A push's ``shows`` and ``clicks`` checked: (float32[n], float32[n]) or (None, None); clicks
    default to zeros when shows are given. Raises TableInputError."""
    if clicks is not None and shows is None:
        raise TableInputError("clicks given without shows: pass shows too")
    if shows is None:
        return None, None
    return (check_vector(shows, n, "shows"),
            np.zeros(n, np.float32) if clicks is None else check_vector(clicks, n, "clicks"))


def record_keys(records: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(records[:, :2]).view(np.uint64).reshape(-1)
