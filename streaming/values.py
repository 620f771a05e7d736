"""Values a model cannot use, found where data enters: the first bad label or dense value of a column.

Both the trainer (``engine.programs.ctr_data.check_values``) and the predictor
(``engine.export.predictor.Bundle.check_values``) refuse the same values with the same words, through
``ArrowSource``'s ``check``, which names the file and its row. Each check is O(rows), one vectorized
pass when the column holds nothing bad.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["first", "label_problem", "list_values", "dense_values"]


def first(mask) -> int:
    """Index of the first True of ``mask : bool[n]`` (which has one)."""
    return int(np.flatnonzero(np.asarray(mask))[0])


def label_problem(col) -> tuple[int, str] | None:
    """The first label of ``col`` (a numeric or boolean Arrow array, length n) that is null, NaN or outside
    [0, 1] (a click, or a probability for soft labels), as ``(row 0-based, reason)``, or None; a column
    of another type is refused at row 0."""
    t = col.type
    if not (pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)):
        return 0, f"expected a numeric label column (0/1 clicks), got type {t}"
    if col.null_count:
        return first(col.is_null()), "expected a label, got null"
    y = col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    out = ~((y >= 0) & (y <= 1))
    if out.any():
        i = first(out)
        return i, f"expected a label in [0, 1], got {float(y[i])}"
    return None


def list_values(col) -> pa.Array:
    """The values of a ``fixed_size_list`` array without null lists, in row order (zero-copy: a slice of
    its child array; ``flatten()`` copies, 220 us for 8192 rows of 13 floats where this takes 1 us)."""
    if col.null_count:
        return col.flatten()
    D = col.type.list_size
    return col.values.slice(col.offset * D, len(col) * D)


def dense_values(col, D: int) -> tuple[np.ndarray, tuple[int, str] | None]:
    """The values of a ``fixed_size_list<float>[D]`` column, flat (``float[B*D]`` row-major), and its first
    problem, ``(row 0-based, reason)`` or None: a null list, a null value, NaN or an infinity. On a
    problem the array returned is empty."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    empty = np.empty(0, np.float32)
    if col.null_count:
        return empty, (first(col.is_null()), f"expected a list of {D} numbers, got null")
    values = list_values(col)
    if values.null_count:
        i = first(values.is_null())
        return empty, (i // D, f"expected a number at position {i % D}, got null")
    flat = values.to_numpy(zero_copy_only=False)
    finite = np.isfinite(flat)
    if not finite.all():
        i = first(~finite)
        return empty, (i // D, f"expected a finite number at position {i % D}, got {float(flat[i])}")
    return flat, None
