"""Arrow IPC files (zstd) on any :class:`~hdfs_io.storage.Storage`, checksummed while written.

Writing streams record batches through :class:`~hdfs_io.checksum.ChecksumWriter` into the backend's
output stream, so size and CRC-32 are known when the file is closed without reading it back. Reading
fetches the file once into memory, checks it against its manifest entry when one is given, then parses
it zero-copy; ``open_ipc_batches`` reads a large file batch by batch after a streaming checksum pass.
"""
from __future__ import annotations

import logging
from typing import Iterable

import pyarrow as pa
import pyarrow.ipc as ipc

from hdfs_io.checksum import ChecksumWriter, FileEntry, checksum_stream
from hdfs_io.errors import CheckpointCorruptError, permanent_failure
from hdfs_io.retry import is_transient
from hdfs_io.storage import Storage

__all__ = ["write_ipc_file", "IpcFileWriter", "read_ipc_file", "open_ipc_batches", "IpcBatches", "check_entry"]

logger = logging.getLogger(__name__)

ArrowData = pa.Table | pa.RecordBatch | pa.RecordBatchReader | Iterable[pa.RecordBatch]


def _ipc_writer(data: ArrowData, schema: pa.Schema | None, compression: str | None):
    """(write, None) for data that can be written again (a retry replays ``write``), or (None, batches)
    for a reader or iterator, consumed once."""
    options = ipc.IpcWriteOptions(compression=compression)
    if isinstance(data, pa.Table):
        schema = schema or data.schema

        def write(out) -> None:
            with ipc.new_file(out, schema, options=options) as writer:
                writer.write_table(data)

        return write, None
    if isinstance(data, pa.RecordBatch):
        return _ipc_writer(pa.Table.from_batches([data]), schema, compression)
    if isinstance(data, (list, tuple)):
        if schema is None and not data:
            raise ValueError("expected a schema to write an empty list of record batches")
        return _ipc_writer(pa.Table.from_batches(list(data), schema=schema), schema, compression)
    if not isinstance(data, pa.RecordBatchReader) and schema is None:
        raise ValueError("expected a schema with an iterator of record batches, got schema=None")
    return None, iter(data)


class IpcFileWriter:
    """One Arrow IPC file written to ``storage`` batch by batch, checksummed as it goes: memory holds
    one batch, not the file. One attempt (a stream cannot be replayed): a storage error propagates, and
    ``abort()`` removes the partial file. On S3 the object appears only at ``close()``.

    Parameters
    ----------
    storage : Storage
    path : str
        Relative to ``storage``'s root.
    schema : pyarrow.Schema
    compression : {"zstd", "lz4", None}
        IPC buffer compression.

    Raises
    ------
    OSError
        Storage errors (see :class:`Storage`), from the constructor, ``write`` or ``close``; those of
        ``write`` and ``close`` carry a note (``add_note``) naming the file's URI.
    """

    def __init__(self, storage: Storage, path: str, schema: pa.Schema, *, compression: str | None = "zstd"):
        self.storage, self.path = storage, path
        self._sink = storage.open_output_stream(path)
        self._out = ChecksumWriter(self._sink)
        try:
            self._writer = ipc.new_file(self._out, schema, options=ipc.IpcWriteOptions(compression=compression))
        except BaseException:
            self.abort()
            raise

    def write(self, data: pa.RecordBatch | pa.Table) -> None:
        """Append a record batch, or a table's batches."""
        try:
            if isinstance(data, pa.Table):
                self._writer.write_table(data)
            else:
                self._writer.write_batch(data)
        except OSError as exc:
            exc.add_note(f"writing {self.storage.uri_of(self.path)}")
            raise

    def close(self) -> FileEntry:
        """Finish the file (its footer) and close the stream; returns its size and CRC-32."""
        try:
            self._writer.close()
            self._sink.close()
        except OSError as exc:
            exc.add_note(f"writing {self.storage.uri_of(self.path)}")
            raise
        entry = self._out.entry
        logger.debug("wrote %s: %d bytes, crc32 %s", self.storage.uri_of(self.path), entry.size, entry.crc32)
        return entry

    def abort(self) -> None:
        """Remove the partial file (best effort); the error that led here is the caller's to raise."""
        self.storage._discard(self._sink, self.storage.full_path(self.path))


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
        consumed once and written in a single attempt (it cannot be replayed; ``IpcFileWriter``).
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
    write, batches = _ipc_writer(data, schema, compression)
    if write is not None:
        entry = storage.write_with(path, write)
        logger.debug("wrote %s: %d bytes, crc32 %s", storage.uri_of(path), entry.size, entry.crc32)
        return entry
    writer = IpcFileWriter(storage, path, schema or data.schema, compression=compression)
    try:
        for batch in batches:
            writer.write(batch)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def check_entry(storage: Storage, path: str, buf: pa.Buffer, expected: FileEntry) -> None:
    """Compare an in-memory file with its manifest entry.

    Raises
    ------
    CheckpointCorruptError
        Size or CRC-32 differs; the message names the file's URI.
    """
    _compare(storage, path, FileEntry.of_bytes(buf), expected)


def _compare(storage: Storage, path: str, got: FileEntry, expected: FileEntry) -> None:
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


#: files this large are checked and read batch by batch, never held whole (bytes)
STREAM_MIN_BYTES = 64 << 20


def _unreadable(uri: str, exc: BaseException, detail: str = "") -> CheckpointCorruptError:
    """What a large file's read from its store that failed with ``exc`` (``pa.ArrowInvalid`` or ``OSError``)
    raises: ``exc`` itself, with a note naming ``uri``, when the store failed (a network error, a store
    refusing the credentials: ``is_transient`` / ``permanent_failure``); else the returned
    ``CheckpointCorruptError`` "not a readable Arrow IPC file" (bytes that do not parse; ``detail`` after
    it). pyarrow's ``ArrowIOError`` is ``OSError``: caught as one, a connection reset in the middle of a
    restore read as a damaged checkpoint, and a restore with fallback went back to the checkpoint before."""
    if isinstance(exc, OSError) and (is_transient(exc) or permanent_failure(exc) is not None):
        exc.add_note(f"reading {uri}")
        raise exc
    return CheckpointCorruptError(f"{uri}: not a readable Arrow IPC file{detail}: {exc}", uri=uri)


class IpcBatches:
    """The record batches of a checked Arrow IPC file (:func:`open_ipc_batches`), readable many times.

    Attributes
    ----------
    schema : pyarrow.Schema
    streamed : bool
        Batches are read from storage one at a time (the file was at least ``STREAM_MIN_BYTES``).
    """

    def __init__(self, schema: pa.Schema, batches=None, opener=None, uri: str = ""):
        self.schema = schema
        self._batches, self._opener, self._uri = batches, opener, uri
        self.streamed = opener is not None

    def __iter__(self):
        if self._batches is not None:
            yield from self._batches
            return
        with self._opener() as f:
            try:
                reader = ipc.open_file(f)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
            except (pa.ArrowInvalid, OSError) as exc:   # the store failed, or it changed since its checksum
                raise _unreadable(self._uri, exc) from exc


def open_ipc_batches(storage: Storage, path: str, *, expected: FileEntry) -> IpcBatches:
    """An Arrow IPC file's batches, checked against its manifest entry before any is returned (a large
    file's second open is checked for its size again).

    A file under ``STREAM_MIN_BYTES`` is read once into memory (``read_ipc_file``). A larger one is
    never held whole: a first pass streams it through CRC-32 (``checksum_stream``) and compares size and
    checksum with ``expected``; the batches are then read one at a time from a random-access handle
    (on local disk, the second read comes from the page cache; on S3 or HDFS it is a second fetch).
    A restore of 100M rows read two 350 MB part files at once into memory: 0.7 GB of a budgeted
    server's RSS for the whole restore, which this bounds to a batch per reading thread.

    Parameters
    ----------
    storage : Storage
    path : str
    expected : FileEntry
        Size and CRC-32 from the manifest.

    Raises
    ------
    FileNotFoundError
        The file does not exist (also when removed between the checksum pass and the second open).
    CheckpointCorruptError
        Size or checksum mismatch (``changed while read``: replaced between the pass and the second open),
        or not a readable Arrow IPC file; the message names the file.
    OSError
        Storage errors of either open or of the footer's read, as raised (see :class:`Storage`): a network
        failure, a store refusing the credentials (``is_transient``, ``permanent_failure``), with a note
        naming the file. Iterating the batches raises the store's failures the same way, and bytes that do
        not parse as ``CheckpointCorruptError``.
    """
    uri = storage.uri_of(path)
    if expected.size < STREAM_MIN_BYTES:
        table = read_ipc_file(storage, path, expected=expected)
        return IpcBatches(table.schema, batches=table.to_batches(), uri=uri)
    with storage.open_input_stream(path) as f:
        got = checksum_stream(f)
    _compare(storage, path, got, expected)
    size = got.size

    def opener():
        f = storage.open_input_file(path)
        now = f.size()
        if now != expected.size:            # replaced since its checksum was read
            f.close()
            raise CheckpointCorruptError(f"{uri}: size is {now} bytes, manifest says {expected.size} "
                                         f"(changed while read)", uri=uri)
        return f
    # the second open's own errors as raised (replaced, gone, a store refusing or not answering): only bytes
    # that do not parse are "not a readable Arrow IPC file"
    with opener() as f:
        try:
            schema = ipc.open_file(f).schema    # the footer only; no batch is read twice
        except (pa.ArrowInvalid, OSError) as exc:
            raise _unreadable(uri, exc, f" ({size} bytes)") from exc
    return IpcBatches(schema, opener=opener, uri=uri)

