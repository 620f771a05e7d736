"""Row records <-> Arrow record batches: the dump format of ``SparseTable.rows()`` and checkpoints.

Schema (metadata ``layout_version``, ``optimizer``, ``dim``, ``state_width``)::

    key        uint64
    values     fixed_size_list<float32>[dim]
    state      fixed_size_list<float32>[state_width]   (absent for sgd)
    show       float32
    click      float32
    last_seen  uint32, seconds of the table clock

A delta's rows (``SparseTable.dirty_dump``, ``delta_schema``) add::

    existed    uint8: did the key hold a row at the parent checkpoint? EXISTED_NO 0, EXISTED_YES 1,
               EXISTED_UNKNOWN 2 (not written today; a loader asks RocksDB); ``sparse_tables._delta``

Float columns are bit copies of the record words, so a dump and load is bit-exact.
"""
from __future__ import annotations

import weakref

import numpy as np
import pyarrow as pa

from . import _kernels as K
from ._inputs import record_keys
from ._load_kernels import fill_records
from .config import KEY_WORDS, LAYOUT_VERSION, RowLayout
from .errors import TableInputError
from .keysets import in_sorted, merged_chunks

EXISTED_NO, EXISTED_YES, EXISTED_UNKNOWN = 0, 1, 2
EXISTED_FIELD = pa.field("existed", pa.uint8(), nullable=False)


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


def delta_schema(schema: pa.Schema) -> pa.Schema:
    """The row schema of a delta: ``schema`` and the ``existed`` column (module docstring)."""
    return schema.append(EXISTED_FIELD)


def existed_column(batch: pa.RecordBatch) -> np.ndarray | None:
    """A batch's ``existed`` column as uint8[m], or None when it has none (a base, or a delta written
    before the column existed).

    Raises
    ------
    TableInputError
        The column is not uint8, has nulls, or holds a value other than 0, 1 or 2 (the first row named).
    """
    i = batch.schema.get_field_index("existed")
    if i < 0:
        return None
    col = _column(batch, "existed", pa.uint8())
    out = col.to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(out > EXISTED_UNKNOWN)
    if len(bad):
        raise TableInputError(f"row batch: column 'existed': row {int(bad[0])} holds {int(out[bad[0]])}, "
                              f"expected 0 (no row at the parent), 1 (a row) or 2 (unknown); "
                              f"{len(bad)} such row(s)")
    return out


def _existed(records: np.ndarray, layout: RowLayout, generation: int, removed: np.ndarray) -> pa.Array:
    """``existed`` of a delta's records (``DirtyRows``): a row stamped with the capture's generation was
    created since the parent, and its key had no row there unless a row of an earlier generation was
    deleted under it since (``removed``: sorted keys; the key was created again)."""
    created = K.generations(records[:, layout.meta + K.M_FLAGS]) == generation
    if len(removed) and created.any():
        at = np.flatnonzero(created)
        created[at[in_sorted(removed, record_keys(records[at]))]] = False
    return pa.array(np.where(created, EXISTED_NO, EXISTED_YES).astype(np.uint8), type=pa.uint8())


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

    def floats(name: str, width: int) -> np.ndarray:
        col = _column(batch, name, pa.list_(pa.float32(), width))
        return col.flatten().to_numpy(zero_copy_only=False).reshape(m, width).view(np.uint32)

    def words(name: str, typ: pa.DataType) -> np.ndarray:
        return _column(batch, name, typ).to_numpy(zero_copy_only=False).view(np.uint32)

    keys = np.ascontiguousarray(_column(batch, "key", pa.uint64()).to_numpy(zero_copy_only=False), np.uint64)
    vals = floats("values", layout.dim)
    state = floats("state", layout.state_width) if layout.state_width else np.empty((m, 0), np.uint32)
    rec = np.empty((m, layout.stride), np.uint32)
    fill_records(rec, keys, vals, state, words("show", pa.float32()), words("click", pa.float32()),
                 words("last_seen", pa.uint32()), layout.values, layout.state, layout.meta)
    return rec


class DirtyRows:
    """The rows of a delta (``SparseTable.dirty_dump``) at one instant, read as record batches of the
    delta schema (``delta_schema``: the row schema and ``existed``); iterable more than once (a
    retried delta file reads the same rows again).

    The RAM rows were copied at the instant (``_snapshot.RecordSnapshot``: into a spool file in the
    spill directory when the table spills); the spilled ones are read from a RocksDB view made at the
    same instant, ``chunk_rows`` at a time, so a delta holds at most one chunk of them at once. Their
    keys are the dirty-keys set's own runs at the instant with a mask of those not in RAM
    (``keysets.merged_chunks``), never one sorted array of them all.

    Attributes
    ----------
    deleted : uint64[k]
        Sorted keys that had a row at the last clear and have none now (the delta's tombstones).
    schema : pa.Schema
        Of the batches it yields (``delta_schema`` of the table's row schema).

    Raises
    ------
    SpillError
        While iterated: RocksDB reported a read error.
    RuntimeError
        Iterated after ``close`` (it would otherwise yield nothing: an empty delta that looks whole).

    One thread at a time: its spilled rows are read through one RocksDB iterator.
    """

    def __init__(self, records, spilled: list, spill, view, deleted: np.ndarray,
                 layout: RowLayout, schema: pa.Schema, chunk_rows: int, *, generation: int,
                 removed: np.ndarray):
        # generation, removed: the capture's generation and the keys whose row of an earlier one was
        # deleted since the parent (sorted), for ``existed``
        self._records, self._spilled, self._spill, self._view = records, spilled, spill, view
        self.deleted = deleted
        self._layout, self._schema, self._chunk = layout, schema, chunk_rows
        self.schema = delta_schema(schema)
        self._generation = generation
        self._removed = removed
        self._finalizers: list = []

    def _batch(self, recs: np.ndarray) -> pa.RecordBatch:
        base = records_to_batch(recs, self._layout, self._schema)
        return base.append_column(EXISTED_FIELD, _existed(recs, self._layout, self._generation, self._removed))

    def on_close(self, fn) -> None:
        """Call ``fn()`` once when the dump is closed or collected (a budget's count of its keys)."""
        self._finalizers.append(weakref.finalize(self, fn))

    def __iter__(self):
        if self._records is None:
            raise RuntimeError("DirtyRows: iterated after close()")
        for recs in self._records.chunks(self._chunk):
            yield self._batch(recs)
        if self._view is not None:
            for keys in merged_chunks(self._spilled, self._chunk):
                for _, recs in self._spill.seek_records(self._view, keys, self._chunk):
                    yield self._batch(recs)

    def close(self) -> None:
        """Drop the RAM rows' copy (its spool file) and the RocksDB view (its iterators pin the files
        they read)."""
        if self._records is not None:
            self._records.close()
        self._records = self._spilled = self._view = None
        for f in self._finalizers:
            f()
