"""Arrow IPC files (zstd) on any :class:`~hdfs_io.storage.Storage`, checksummed while written.

Writing streams record batches through :class:`~hdfs_io.checksum.ChecksumWriter` into the backend's
output stream, so size and CRC-32 are known when the file is closed without reading it back. Reading
fetches the file once into memory, checks it against its manifest entry when one is given, then parses
it zero-copy.
"""
from __future__ import annotations

import logging
from typing import Iterable

import pyarrow as pa
import pyarrow.ipc as ipc

from hdfs_io.checksum import ChecksumWriter, FileEntry
from hdfs_io.errors import CheckpointCorruptError
from hdfs_io.storage import Storage

__all__ = ["write_ipc_file", "read_ipc_file", "check_entry"]

logger = logging.getLogger(__name__)

ArrowData = pa.Table | pa.RecordBatch | pa.RecordBatchReader | Iterable[pa.RecordBatch]


def _ipc_writer(data: ArrowData, schema: pa.Schema | None, compression: str | None):
    options = ipc.IpcWriteOptions(compression=compression)
    if isinstance(data, pa.Table):
        schema = schema or data.schema

        def write(out) -> None:
            with ipc.new_file(out, schema, options=options) as writer:
                writer.write_table(data)

        return write, True
    if isinstance(data, pa.RecordBatch):
        return _ipc_writer(pa.Table.from_batches([data]), schema, compression)
    if isinstance(data, (list, tuple)):
        if schema is None and not data:
            raise ValueError("expected a schema to write an empty list of record batches")
        return _ipc_writer(pa.Table.from_batches(list(data), schema=schema), schema, compression)
    if isinstance(data, pa.RecordBatchReader):
        schema = schema or data.schema
    elif schema is None:
        raise ValueError("expected a schema with an iterator of record batches, got schema=None")
    batches = iter(data)

    def write_once(out) -> None:
        with ipc.new_file(out, schema, options=options) as writer:
            for batch in batches:
                writer.write_batch(batch)

    return write_once, False


def write_ipc_file(
    storage: Storage,
    path: str,
    data: ArrowData,
    *,
    schema: pa.Schema | None = None,
    compression: str | None = "zstd",
) -> FileEntry:
    """Write ``data`` as an Arrow IPC *file* (random-access format) with compressed buffers.

    Parameters
    ----------
    storage : Storage
    path : str
        Relative to ``storage``'s root.
    data : pyarrow.Table, RecordBatch, list of RecordBatch, RecordBatchReader or iterator of RecordBatch
        Tables, batches and lists are written with retries on transient errors; a reader or iterator is
        consumed once and written in a single attempt (it cannot be replayed).
    schema : pyarrow.Schema or None
        Required for a bare iterator; otherwise taken from ``data``.
    compression : {"zstd", "lz4", None}
        IPC buffer compression.

    Returns
    -------
    FileEntry
        File size in bytes and CRC-32, computed while writing.

    Raises
    ------
    ValueError
        Missing schema for an iterator.
    OSError
        Storage errors (see :class:`Storage`).
    """
    write, repeatable = _ipc_writer(data, schema, compression)
    if repeatable:
        entry = storage.write_with(path, write)
    else:
        sink = storage.open_output_stream(path)
        out = ChecksumWriter(sink)
        try:
            write(out)
        except BaseException:
            storage._discard(sink, storage.full_path(path))
            raise
        sink.close()
        entry = out.entry
    logger.debug("wrote %s: %d bytes, crc32 %s", storage.uri_of(path), entry.size, entry.crc32)
    return entry


def check_entry(storage: Storage, path: str, buf: pa.Buffer, expected: FileEntry) -> None:
    """Compare an in-memory file with its manifest entry.

    Raises
    ------
    CheckpointCorruptError
        Size or CRC-32 differs; the message names the file's URI.
    """
    got = FileEntry.of_bytes(buf)
    uri = storage.uri_of(path)
    if got.size != expected.size:
        raise CheckpointCorruptError(
            f"{uri}: size is {got.size} bytes, manifest says {expected.size} (truncated or overwritten)",
            uri=uri,
        )
    if got.crc32 != expected.crc32:
        raise CheckpointCorruptError(
            f"{uri}: crc32 is {got.crc32}, manifest says {expected.crc32} (corrupt file)", uri=uri
        )


def read_ipc_file(storage: Storage, path: str, *, expected: FileEntry | None = None) -> pa.Table:
    """Read an Arrow IPC file written by :func:`write_ipc_file` (any compression).

    Parameters
    ----------
    storage : Storage
    path : str
    expected : FileEntry or None
        Manifest entry; when given, size and CRC-32 are checked before parsing.

    Returns
    -------
    pyarrow.Table

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    CheckpointCorruptError
        Size/checksum mismatch, or the bytes are not a valid Arrow IPC file (e.g. truncated); the
        message names the file.
    """
    buf = storage.read_buffer(path)
    if expected is not None:
        check_entry(storage, path, buf, expected)
    try:
        return ipc.open_file(pa.BufferReader(buf)).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        uri = storage.uri_of(path)
        raise CheckpointCorruptError(
            f"{uri}: not a readable Arrow IPC file ({buf.size} bytes; truncated?): {exc}", uri=uri
        ) from exc
