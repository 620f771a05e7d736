"""Reading one part file of a published checkpoint, shared by the row reader (``reader``) and the
admission sketches' (``sketch_parts``): the file checked against its manifest entry, then its columns
against the schema its kind is written with."""
from __future__ import annotations

import pyarrow as pa

from hdfs_io import CheckpointCorruptError, FileEntry, Storage, read_ipc_file

__all__ = ["read_part", "check_columns"]


def read_part(ckpt: Storage, name: str, entry: FileEntry) -> pa.Table:
    """The part file ``name`` of the checkpoint ``ckpt``, checked against ``entry`` (size, CRC-32).

    Raises
    ------
    hdfs_io.CheckpointCorruptError
        Missing, damaged or not a readable Arrow file (the URI named).
    """
    try:
        return read_ipc_file(ckpt, name, expected=entry)
    except FileNotFoundError as exc:
        uri = ckpt.uri_of(name)
        raise CheckpointCorruptError(f"{uri}: listed in the manifest but missing", uri=uri) from exc


def check_columns(table: pa.Table, schema: pa.Schema, uri: str, what: str) -> None:
    """Raise CheckpointCorruptError unless ``table`` has every column of ``schema`` with its type and
    no nulls where the schema forbids them."""
    for f in schema:
        i = table.schema.get_field_index(f.name)
        if i < 0:
            raise CheckpointCorruptError(f"{uri}: {what}: missing column {f.name!r} (expected {f.type})", uri=uri)
        col = table.column(i)
        if not col.type.equals(f.type):
            raise CheckpointCorruptError(f"{uri}: {what}: column {f.name!r}: expected {f.type}, got {col.type}",
                                         uri=uri)
        if not f.nullable and col.null_count:
            raise CheckpointCorruptError(f"{uri}: {what}: column {f.name!r} has {col.null_count} nulls", uri=uri)
