"""Row records <-> Arrow record batches: the dump format of ``SparseTable.rows()`` and checkpoints.

Schema (metadata ``layout_version``, ``optimizer``, ``dim``, ``state_width``)::

    key        uint64
    values     fixed_size_list<float32>[dim]
    state      fixed_size_list<float32>[state_width]   (absent for sgd)
    show       float32
    click      float32
    last_seen  uint32, seconds of the table clock

Float columns are bit copies of the record words, so a dump and load is bit-exact.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from .config import KEY_WORDS, LAYOUT_VERSION, RowLayout
from .errors import TableInputError


def row_schema(layout: RowLayout, optimizer: str) -> pa.Schema:
    fields = [pa.field("key", pa.uint64(), nullable=False),
              pa.field("values", pa.list_(pa.float32(), layout.dim), nullable=False)]
    if layout.state_width:
        fields.append(pa.field("state", pa.list_(pa.float32(), layout.state_width), nullable=False))
    fields += [pa.field("show", pa.float32(), nullable=False),
               pa.field("click", pa.float32(), nullable=False),
               pa.field("last_seen", pa.uint32(), nullable=False)]
    meta = {"layout_version": str(LAYOUT_VERSION), "optimizer": optimizer, "dim": str(layout.dim),
            "state_width": str(layout.state_width)}
    return pa.schema(fields, metadata=meta)


def _fixed_list(block: np.ndarray, width: int) -> pa.FixedSizeListArray:
    flat = pa.array(np.ascontiguousarray(block).view(np.float32).reshape(-1), type=pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, width)


def records_to_batch(records: np.ndarray, layout: RowLayout, schema: pa.Schema) -> pa.RecordBatch:
    """records : uint32[m, stride] -> RecordBatch of ``schema``."""
    keys = np.ascontiguousarray(records[:, :KEY_WORDS]).view(np.uint64).reshape(-1)
    cols = [pa.array(keys, type=pa.uint64()),
            _fixed_list(records[:, layout.values:layout.values + layout.dim], layout.dim)]
    if layout.state_width:
        cols.append(_fixed_list(records[:, layout.state:layout.meta], layout.state_width))
    m = layout.meta
    cols += [pa.array(np.ascontiguousarray(records[:, m]).view(np.float32)),
             pa.array(np.ascontiguousarray(records[:, m + 1]).view(np.float32)),
             pa.array(np.ascontiguousarray(records[:, m + 2]), type=pa.uint32())]
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def _column(batch: pa.RecordBatch, name: str, expected: pa.DataType) -> pa.Array:
    idx = batch.schema.get_field_index(name)
    if idx < 0:
        raise TableInputError(f"row batch: missing column {name!r} (expected {expected})")
    col = batch.column(idx)
    if not col.type.equals(expected):
        raise TableInputError(f"row batch: column {name!r}: expected {expected}, got {col.type}")
    if col.null_count:
        raise TableInputError(f"row batch: column {name!r} has {col.null_count} nulls")
    return col


def batch_to_records(batch: pa.RecordBatch, layout: RowLayout) -> np.ndarray:
    """RecordBatch of the row schema -> uint32[m, stride] records (tick and flags zero).

    Raises
    ------
    TableInputError
        A column is missing, mistyped, has nulls, or its width differs from the table's.
    """
    m = batch.num_rows
    rec = np.zeros((m, layout.stride), np.uint32)
    keys = _column(batch, "key", pa.uint64()).to_numpy(zero_copy_only=False)
    rec[:, :KEY_WORDS] = np.ascontiguousarray(keys, dtype=np.uint64).view(np.uint32).reshape(m, KEY_WORDS)
    vals = _column(batch, "values", pa.list_(pa.float32(), layout.dim))
    rec[:, layout.values:layout.values + layout.dim] = (
        vals.flatten().to_numpy(zero_copy_only=False).reshape(m, layout.dim).view(np.uint32))
    if layout.state_width:
        st = _column(batch, "state", pa.list_(pa.float32(), layout.state_width))
        rec[:, layout.state:layout.meta] = (
            st.flatten().to_numpy(zero_copy_only=False).reshape(m, layout.state_width).view(np.uint32))
    mo = layout.meta
    rec[:, mo] = _column(batch, "show", pa.float32()).to_numpy(zero_copy_only=False).view(np.uint32)
    rec[:, mo + 1] = _column(batch, "click", pa.float32()).to_numpy(zero_copy_only=False).view(np.uint32)
    rec[:, mo + 2] = _column(batch, "last_seen", pa.uint32()).to_numpy(zero_copy_only=False)
    return rec
