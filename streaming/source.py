"""Arrow source: IPC stream files, directories of them, Parquet files or a stream on stdin → record
batches of exactly ``batch_size`` rows, optionally shuffled, read ahead on a prefetch thread.

Pipeline (each step a generator; the first three run on the prefetch thread)::

    files (sorted, sharded) → input record batches (schema-checked, columns selected)
        → shuffle buffer (optional) → re-chunk to batch_size → bounded queue → consumer

Position. ``SourcePosition(file_index, batch_index, row)`` names the next input row not yet delivered:
row ``row`` of input record batch ``batch_index`` of file ``file_index`` (index into the full sorted file
list, before sharding). ``ArrowSource.position`` is the position after the last batch the consumer
received; passing it as ``start=`` resumes exactly there. With a shuffle buffer the position is the read
frontier: rows still in the buffer when the position was taken are not re-read on resume.

Reading. Files are read with plain reads (``pyarrow.OSFile``), never memory-mapped (a file truncated
while it is read is a ``DataFormatError``, not a SIGBUS); an IPC stream must end with its end-of-stream
marker (``streaming.ipc_stream``): one cut between two record batches is refused, not read as a shorter
stream. Inputs named by URI (``s3://``, ``hdfs://``) are read from the store directly
(``streaming.inputs``).

Sharding. ``shard=(w, W)`` with ``shard_by="files"`` (default) gives worker ``w`` the files ``w::W`` of
the sorted list; ``shard_by="batches"`` reads every file and keeps input record batches ``w::W`` (counted
over the whole stream), for a single file or stdin; ``shard_by="rows"`` (``file_rows``: the rows of every
file, ``count_rows``) gives worker ``w`` the rows ``[N*w // W, N*(w+1) // W)`` of the ``N`` rows of all
files read in order, so every worker holds ``N // W`` or ``N // W + 1`` rows, whatever the files' sizes
and record batches: a file wholly outside a worker's range is never opened, and its reading stops at its
range's end (the record batches on the two ends of a range are read whole and sliced).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import keys
from .errors import DataFormatError, SchemaError
from .inputs import CHANGED, InputChangedError, RemoteInput, input_error, is_uri, list_remote, remote_batches
from .prefetch import prefetch  # noqa: F401 - ArrowSource's, and this module's public name before its move
from .ipc_stream import CheckedStream, IncompleteStreamError, TrackedInput, ipc_file_batches, stream_rows

__all__ = ["ArrowSource", "SourcePosition", "check_inputs", "check_schema", "count_rows", "list_files", "prefetch",
           "read_batches", "read_schema", "row_ranges"]

log = logging.getLogger(__name__)

_IPC_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather")
_PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclasses.dataclass(frozen=True)
class SourcePosition:
    """The next input row not yet delivered (see the module docstring).

    Attributes
    ----------
    file_index : int
        Index into the full sorted file list (before sharding).
    batch_index : int
        Input record batch within that file.
    row : int
        Row within that record batch.
    """

    file_index: int = 0
    batch_index: int = 0
    row: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "SourcePosition":
        return cls(int(d["file_index"]), int(d["batch_index"]), int(d["row"]))


def list_files(paths, *, storage_options=None) -> list:
    """Expand inputs to the ordered list the source reads.

    Parameters
    ----------
    paths : str, PathLike, binary file object, ``streaming.inputs.RemoteInput``, or a list of them
        A directory expands to its IPC/Parquet files (suffixes ``.arrow .arrows .ipc .feather .parquet
        .pq``; names starting with ``_`` or ``.`` skipped), sorted by name. ``"-"`` means stdin. File
        objects and ``RemoteInput`` are kept as they are. A URI (``s3://``, ``hdfs://``, ``file://``)
        expands alike to ``RemoteInput`` objects (``streaming.inputs.list_remote``).
    storage_options : hdfs_io.StorageOptions, optional
        For URIs: endpoint, credentials, timeouts (None: the environment's).

    Raises
    ------
    FileNotFoundError
        If a path does not exist or a directory holds no data files.
    hdfs_io.StorageUnavailableError, OSError
        A URI's store cannot be reached (after the retries).
    """
    if isinstance(paths, (str, os.PathLike, RemoteInput)) or hasattr(paths, "read"):
        paths = [paths]
    out = []
    for p in paths:
        if hasattr(p, "read") or p == "-" or isinstance(p, RemoteInput):
            out.append(p)
            continue
        if is_uri(p):
            out.extend(list_remote(p, storage_options))
            continue
        p = Path(p)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(("_", "."))
                           and f.suffix in _IPC_SUFFIXES + _PARQUET_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"no Arrow IPC or Parquet files in directory {p}")
            out.extend(str(f) for f in found)
        elif p.is_file():
            out.append(str(p))
        else:
            raise FileNotFoundError(f"data path does not exist: {p}")
    return out


def is_file_input(src) -> bool:
    """Whether ``src`` (an entry of ``list_files``) is a file that can be opened again and sized: a local
    path or a ``RemoteInput``, not stdin or a file object."""
    return isinstance(src, RemoteInput) or (isinstance(src, str) and src != "-")


def open_file(src) -> pa.NativeFile:
    """A file input (``is_file_input``) opened for random access: ``pyarrow.OSFile`` (plain reads, never
    a memory map) or the store's ranged reads.

    Raises
    ------
    FileNotFoundError, OSError
        The file is missing or cannot be opened (a ``RemoteInput`` after the store's retries).
    """
    return src.open_file() if isinstance(src, RemoteInput) else pa.OSFile(src, "r")


def _name(src) -> str:
    if isinstance(src, RemoteInput):
        return str(src)
    if src == "-":
        return "<stdin>"
    if hasattr(src, "read"):
        return getattr(src, "name", "<stream>") if isinstance(getattr(src, "name", None), str) else "<stream>"
    return str(src)


def read_batches(src, columns=None, version=None) -> Iterator[pa.RecordBatch]:
    """Record batches of one input, in order, as stored. Parquet by suffix; IPC stream or IPC file by magic.

    Files are read with plain reads (``pyarrow.OSFile``), not memory-mapped: a file truncated or replaced
    while it is read is a ``DataFormatError``, never a SIGBUS, and no delivered batch points into the file.
    A local file is stat-ed after each record batch is read and before it is delivered: a file written in
    place (or replaced, touched, deleted) since the read began is ``InputChangedError`` at that batch, so
    no batch mixes bytes of two versions (a store's object: ``streaming.inputs``' pinned reads). Given
    ``version``, the file must be that one from its first batch on, not only the one the read began on.
    An IPC stream must end with its end-of-stream marker (``streaming.ipc_stream``): a stream cut at a
    record-batch boundary (its writer killed between two batches) is refused, not read as a shorter
    stream; a file is tested for it before its first batch is delivered (then scanned to name the batch),
    and exactly once its last batch was read.

    Parameters
    ----------
    src : str, ``"-"`` (stdin) or binary file object
    columns : list of str, optional
        Parquet only: read just these (those the file has); IPC batches come whole.
    version : (int, int, int), optional
        A local file's ``(size, mtime_ns, inode)`` as its reader listed (or last checked) it: a file
        written since, even before this read began, is refused at its first batch.

    Raises
    ------
    DataFormatError
        The input is empty, truncated (cut inside a record batch or between two, or without its
        end-of-stream marker), corrupt or not Arrow IPC / Parquet: names the input, the record batch that
        could not be read or is missing (``<file header>`` when not even the schema could be) and its
        first row (1-based, over the file). I/O failures of the medium (an errno, or a transient error per
        ``hdfs_io.retry.is_transient``) propagate unchanged.
    """
    name = _name(src)
    parquet = is_file_input(src) and src.endswith(_PARQUET_SUFFIXES)
    pin = local_version(src) if is_file_input(src) and not isinstance(src, RemoteInput) else None
    began = "the file the read began on"
    if pin is not None and version is not None:     # the version listed: rewritten before the open counts too
        pin, began = tuple(int(v) for v in version), "the file as the job listed it"
    opened: list = []
    it = _raw_batches(src, columns, opened)
    batch, rows = 0, 0
    try:
        while True:
            try:
                rb = next(it)
                if pin is not None and (now := local_version(src)) != pin:   # written in place (or replaced)
                    raise InputChangedError(name, f"expected {began} ({pin[0]} bytes, "
                                                  f"inode {pin[2]}, modified {pin[1]} ns), got {now[0]} bytes, "
                                                  f"inode {now[2]}, modified {now[1]} ns", advice=CHANGED)
            except StopIteration:
                return
            except IncompleteStreamError as exc:
                raise _incomplete_error(name, src, exc) from exc
            except InputChangedError as exc:    # a store's object overwritten: where the read stopped
                raise exc.at(name, rows + 1, f"<record batch {batch}>") from exc
            except Exception as exc:  # noqa: BLE001 - only unreadable bytes become DataFormatError
                if not _unreadable(exc):
                    _reraise(src, exc)
                raise _format_error(name, src, parquet, bool(opened), batch, rows, exc) from exc
            yield rb
            batch, rows = batch + 1, rows + rb.num_rows
    finally:
        it.close()


def local_version(path) -> tuple[int, int, int]:
    """``(size, mtime_ns, inode)`` of a local file now, ``(-1, 0, 0)`` when it is gone: the version
    ``read_batches`` compares after each record batch it reads, before delivering it (a stat: ~2 us), and
    the one a trainer lists its files with (``engine.programs.ctr_data.local_versions``)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return -1, 0, 0
    return st.st_size, st.st_mtime_ns, st.st_ino


def _raw_batches(src, columns, opened: list) -> Iterator[pa.RecordBatch]:
    """``read_batches`` without the error translation; appends to ``opened`` once the schema is read."""
    if src == "-":
        src = sys.stdin.buffer
    if hasattr(src, "read"):
        reader = CheckedStream(TrackedInput(src))
        opened.append(True)
        yield from reader
        return
    if src.endswith(_PARQUET_SUFFIXES):
        with _parquet(src, pinned=True) as pf:
            opened.append(True)
            cols = [c for c in columns if c in pf.schema_arrow.names] if columns else None
            yield from pf.iter_batches(batch_size=65536, columns=cols)
        return
    if isinstance(src, RemoteInput):
        yield from remote_batches(src, opened)
        return
    with open_file(src) as f:
        batches = ipc_file_batches(f, opened)
        if batches is not None:
            yield from batches
            return
        reader = CheckedStream(f)
        opened.append(True)
        yield from reader


@contextlib.contextmanager
def _parquet(src, pinned: bool = False) -> Iterator[pq.ParquetFile]:
    """A Parquet input opened (a ``RemoteInput`` with ``pre_buffer``: coalesced ranged reads, each checked
    to be of the version listed when ``pinned``: ``RemoteInput.open_pinned``), closed on leaving the
    ``with`` block."""
    if isinstance(src, RemoteInput):
        with (src.open_pinned() if pinned else src.open_file()) as f:
            yield pq.ParquetFile(f, pre_buffer=True)
        return
    with pq.ParquetFile(src) as pf:
        yield pf


def read_schema(path, *, check_end: bool = False) -> pa.Schema:
    """The schema of one Arrow IPC (file or stream) or Parquet input, without reading its batches.

    Parameters
    ----------
    path : str or streaming.inputs.RemoteInput
    check_end : bool
        Also test that an IPC stream ends with its end-of-stream marker (its last 8 bytes; when they are
        wrong the stream is read through to name the record batch where it stops).

    Raises
    ------
    DataFormatError
        The input is empty or not Arrow IPC / Parquet, or (``check_end``) a truncated IPC stream (named,
        as ``read_batches`` names it).
    FileNotFoundError
        ``path`` does not exist.
    """
    parquet = path.endswith(_PARQUET_SUFFIXES)
    try:
        if parquet:
            with _parquet(path) as pf:
                return pf.schema_arrow
        with open_file(path) as f:
            if f.read(6) == b"ARROW1":
                f.seek(0)
                return pa.ipc.open_file(f).schema
            f.seek(0)
            return CheckedStream(f, precheck="tail" if check_end else None).schema
    except IncompleteStreamError as exc:
        raise _incomplete_error(_name(path), path, exc) from exc
    except Exception as exc:  # noqa: BLE001 - only unreadable bytes become DataFormatError
        if not _unreadable(exc):
            _reraise(path, exc)
        raise _format_error(_name(path), path, parquet, False, 0, 0, exc) from exc


def count_rows(path) -> int:
    """Rows of one Arrow IPC (file or stream) or Parquet input, from metadata: Parquet's and an IPC file's
    footer, an IPC stream's message headers (``ipc_stream.stream_rows``: the record batch bodies are
    skipped); a stream that walk does not understand to its end is read through.

    Raises
    ------
    DataFormatError
        The input is empty, truncated or not Arrow IPC / Parquet (named, as ``read_batches`` names it).
    FileNotFoundError
        ``path`` does not exist.
    """
    parquet = path.endswith(_PARQUET_SUFFIXES)
    try:
        if parquet:
            with _parquet(path) as pf:
                return pf.metadata.num_rows
        with open_file(path) as f:
            if f.read(6) == b"ARROW1":
                f.seek(0)
                return int(pa.ipc.open_file(f).count_rows())
            f.seek(0)
            rows = stream_rows(f)            # the messages' metadata; the bodies are skipped
    except Exception as exc:  # noqa: BLE001 - only unreadable bytes become DataFormatError
        if not _unreadable(exc):
            _reraise(path, exc)
        raise _format_error(_name(path), path, parquet, False, 0, 0, exc) from exc
    return rows if rows is not None else sum(rb.num_rows for rb in read_batches(path))


def row_ranges(file_rows, num_workers: int) -> list[tuple[int, int]]:
    """Each worker's rows under ``shard_by="rows"``: ``[(lo, hi), ...]``, worker ``w`` reading rows
    ``lo <= i < hi`` of the inputs' ``N = sum(file_rows)`` rows in reading order (``file_rows : int[F]``,
    rows of each input), ``lo = N*w // W``: ``N // W`` or ``N // W + 1`` rows each, no row in two ranges
    or in none."""
    n = int(sum(file_rows))
    return [(n * w // num_workers, n * (w + 1) // num_workers) for w in range(num_workers)]


def check_schema(got: pa.Schema, expected: pa.Schema, name: str, string_slots=()) -> None:
    """Raise unless ``got`` holds every column of ``expected`` with its type (``ArrowSource``'s rule: a
    column of ``string_slots`` expected as uint64 may also hold raw strings, hashed when read: string,
    binary, their large and view forms, or dictionary-encoded, ``keys.is_raw_strings``; a float32 column
    any number or boolean, a ``fixed_size_list<float32>`` one of float16 or float64 values, cast when
    read: ``_casts_to``).
    Other columns of ``got`` are ignored.

    Raises
    ------
    SchemaError
        Names the column, both types (or the columns present when it is missing) and ``name``.
    """
    present = got.names
    for field in expected:
        idx = got.get_field_index(field.name)
        if idx < 0:
            raise SchemaError(name, field.name, str(field.type), None, present)
        actual = got.field(idx).type
        if actual == field.type:
            continue
        if _casts_to(actual, field.type):
            continue
        if field.name in string_slots and field.type == pa.uint64():
            if keys.is_raw_strings(actual):
                continue
            raise SchemaError(name, field.name, "uint64 keys or raw strings (string, large_string, binary, "
                              "large_binary, their views, or dictionary-encoded)", str(actual))
        raise SchemaError(name, field.name, str(field.type), str(actual))


def _casts_to(actual: pa.DataType, expected: pa.DataType) -> bool:
    """Whether a column of type ``actual`` is read as ``expected`` by a cast (``ArrowSource``): an integer,
    boolean or other floating column as a float32 one (labels: 0/1 clicks written as int64 or double,
    exact), a ``fixed_size_list`` of float16 or float64 as a ``fixed_size_list<float32>`` of the same
    size (dense features written as double, rounded to the float32 the models compute in; a value beyond
    float32's range becomes an infinity, which a value check refuses)."""
    if expected == pa.float32():
        return pa.types.is_integer(actual) or pa.types.is_boolean(actual) or pa.types.is_floating(actual)
    if pa.types.is_fixed_size_list(expected) and expected.value_type == pa.float32():
        return (pa.types.is_fixed_size_list(actual) and actual.list_size == expected.list_size
                and pa.types.is_floating(actual.value_type))
    return False


def check_inputs(paths, schema: pa.Schema | None = None, *, string_slots=(), storage_options=None) -> list:
    """Check every input file before any batch is read: readable as Arrow IPC / Parquet, an IPC stream
    ending with its end-of-stream marker (``read_schema(check_end=True)``), and holding ``schema``'s
    columns as ``ArrowSource`` checks them (``check_schema``). Reads a few bytes and the schema of each
    file (a whole file only when its stream looks truncated). Stdin and file objects are not checked.

    Parameters
    ----------
    paths : as ``list_files`` takes them
    schema : pyarrow.Schema, optional
        None = check readability only.
    string_slots : collection of str
        Columns that may hold raw strings instead of uint64 keys.
    storage_options : hdfs_io.StorageOptions, optional
        For URIs (``list_files``).

    Returns
    -------
    list
        ``list_files(paths)``.

    Raises
    ------
    FileNotFoundError, DataFormatError, SchemaError
        The first input at fault, named.
    """
    files = list_files(paths, storage_options=storage_options)
    for f in files:
        if is_file_input(f):
            got = read_schema(f, check_end=True)
            if schema is not None:
                check_schema(got, schema, _name(f), string_slots)
    return files


def _unreadable(exc: BaseException) -> bool:
    """Whether a pyarrow error means the bytes are not valid Arrow IPC / Parquet: ``ArrowInvalid``,
    ``ArrowNotImplementedError``, or a plain ``OSError`` without an errno (pyarrow's "Expected to be able
    to read N bytes" of a truncated message) that ``hdfs_io.retry.is_transient`` does not call a storage
    hiccup worth retrying."""
    if isinstance(exc, (pa.ArrowInvalid, pa.ArrowNotImplementedError)):
        return True
    if type(exc) is OSError and exc.errno is None:
        from hdfs_io import permanent_failure
        from hdfs_io.retry import is_transient
        return not is_transient(exc) and permanent_failure(exc) is None   # a store's refusal is no bad byte
    return False


def _reraise(src, exc: BaseException):
    """Raise ``exc``, a failure of the medium while reading ``src``: for a store's input as
    ``streaming.inputs.input_error`` gives it (a refusal or a store that does not answer:
    ``InputUnavailableError`` naming the URI)."""
    err = input_error(str(src), exc) if isinstance(src, RemoteInput) and isinstance(exc, OSError) else exc
    if err is exc:
        raise exc
    raise err from exc


def _format_error(name: str, src, parquet: bool, opened: bool, batch: int, rows: int,
                  exc: BaseException) -> DataFormatError:
    """The ``DataFormatError`` of an input pyarrow could not read (see ``read_batches``)."""
    kind = "a Parquet file" if parquet else "an Arrow IPC file or stream"
    exc = " ".join(str(exc).split())        # pyarrow's text may span lines; the error is one line
    if not opened:
        if isinstance(src, RemoteInput) and src.size == 0 or (
                isinstance(src, str) and os.path.isfile(src) and os.path.getsize(src) == 0):
            got = "an empty file (0 bytes)"
        else:
            got = f"bytes pyarrow cannot read as one ({exc}): another format, or truncated"
        return DataFormatError(name, 1, "<file header>", f"expected {kind}, got {got}", unit="row")
    before = (f"after {rows} readable row{'s' * (rows != 1)} in {batch} record batch{'es' * (batch != 1)}"
              if batch else "before its first record batch")
    return DataFormatError(name, rows + 1, f"<record batch {batch}>",
                           f"expected a complete record batch, got one pyarrow cannot read ({exc}): the "
                           f"input is truncated or corrupt {before}", unit="row")


def _incomplete_error(name: str, src, exc: IncompleteStreamError) -> DataFormatError:
    """The ``DataFormatError`` of an IPC stream that stops short of its end-of-stream marker."""
    if exc.cause is not None:     # a batch that cannot be read, found by the scan of a stream with a bad tail
        return _format_error(name, src, False, True, exc.batches, exc.rows, exc.cause)
    b, rows = exc.batches, exc.rows
    read = f"{rows} row{'s' * (rows != 1)} in {b} complete record batch{'es' * (b != 1)}"
    return DataFormatError(name, rows + 1, f"<record batch {b}>",
                           f"expected another record batch or the Arrow IPC end-of-stream marker after "
                           f"{read}, got {exc.reason}", unit="row")


class ArrowSource:
    """Record batches of exactly ``batch_size`` rows from Arrow IPC streams, Parquet files or stdin.

    Parameters
    ----------
    paths : str, PathLike, URI, file object or list of them
        See ``list_files``. ``"-"`` reads an IPC stream from stdin; a binary file object (pipe,
        ``BytesIO``) is read as an IPC stream.
    batch_size : int, rows
    schema : pyarrow.Schema, optional
        Expected columns and types. Only these columns are delivered, in this order; each input's
        schema is checked against it before its first batch is used. Without it the first input's
        schema is expected of every input.
    string_slots : mapping of column name → slot id, optional
        Columns that may arrive as raw strings (string/binary); they are hashed with
        ``keys.hash_array(slot, values, empty_is_missing=True)`` into uint64 keys.
    shuffle_buffer : int, rows
        0 = no shuffling. Otherwise rows are shuffled within a buffer of this many rows.
    seed : int, optional
        Required with a shuffle buffer. The order of epoch ``e`` depends only on (seed, e, the input).
    drop_last : bool
        Drop the final short batch.
    prefetch : int
        Batches read ahead on a background thread; 0 reads on the consumer's thread.
    shard : (int, int), optional
        ``(worker, num_workers)``; see ``shard_by`` and the module docstring.
    shard_by : "files", "batches" or "rows"
    file_rows : list of int, optional
        ``shard_by="rows"``: the rows of each input (``count_rows``); counted here when not given. They
        must be the inputs' rows as read: a file changed since they were counted could give a row to two
        workers or to none (a resumed CTR position refuses changed files: ``ctr_positions``).
    start : SourcePosition, optional
        Resume point (skips everything before it).
    check : callable, optional
        ``check(rb) -> (column, row, reason) or None``, called on every record batch of an input (after
        string slots are hashed) before it is delivered: a tuple names the first value the consumer
        cannot use (``row`` 0-based in ``rb``), and ``batches`` raises ``DataFormatError`` naming the
        file, the row of the file and the column. E.g. ``engine.programs.ctr_data.check_values``.
    storage_options : hdfs_io.StorageOptions, optional
        For URI ``paths`` (``s3://``, ``hdfs://``; ``streaming.inputs``): endpoint, credentials.
    versions : list, optional
        Per input, a local file's ``(size, mtime_ns, inode)`` as listed (or None): each is read only as
        that version (``read_batches``' ``version``): a file written in place after it was listed and
        before this source opened it is ``InputChangedError`` at its first batch, not read whole as the
        new version with the listed counts.

    Raises
    ------
    ValueError
        On bad arguments.
    FileNotFoundError
        If a path does not exist.

    Examples
    --------
    >>> src = ArrowSource("data/train", batch_size=512, schema=criteo_schema())  # doctest: +SKIP
    >>> for batch in src.batches(epoch=0):                                         # doctest: +SKIP
    ...     train_step(batch); pos = src.position
    """

    def __init__(self, paths, *, batch_size: int, schema: pa.Schema | None = None,
                 string_slots: Mapping[str, int] | None = None, shuffle_buffer: int = 0,
                 seed: int | None = None, drop_last: bool = False, prefetch: int = 4,
                 shard: tuple[int, int] | None = None, shard_by: str = "files",
                 file_rows=None, start: SourcePosition | None = None, check=None, storage_options=None,
                 versions=None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
        if shuffle_buffer and seed is None:
            raise ValueError("a shuffle buffer needs an explicit seed: pass seed=... (e.g. the run seed)")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if shard_by not in ("files", "batches", "rows"):
            raise ValueError(f"shard_by must be 'files', 'batches' or 'rows', got {shard_by!r}")
        if shard is not None:
            w, n = shard
            if not (n >= 1 and 0 <= w < n):
                raise ValueError(f"shard must be (worker, num_workers) with 0 <= worker < num_workers, "
                                 f"got {shard}")
        self.files = list_files(paths, storage_options=storage_options)
        self.batch_size = batch_size
        self.schema = schema
        self.string_slots = dict(string_slots or {})
        for col, slot in self.string_slots.items():
            keys.slot_prefix(slot)  # range check
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.shard = shard
        self.shard_by = shard_by
        self.file_rows = None
        if shard_by == "rows":
            if not all(is_file_input(f) for f in self.files):
                raise ValueError("shard_by='rows' needs files (their rows are counted first), not stdin or "
                                 "a file object: use shard_by='batches'")
            self.file_rows = ([int(r) for r in file_rows] if file_rows is not None
                              else [count_rows(f) for f in self.files])
            if len(self.file_rows) != len(self.files):
                raise ValueError(f"file_rows must give the rows of each of the {len(self.files)} inputs, got "
                                 f"{len(self.file_rows)} counts")
        self.versions = list(versions) if versions is not None else [None] * len(self.files)
        if len(self.versions) != len(self.files):
            raise ValueError(f"versions must give the version of each of the {len(self.files)} inputs, got "
                             f"{len(self.versions)}")
        self.start = start or SourcePosition()
        self.position = self.start
        self.check = check

    # -- reading -------------------------------------------------------------------------------

    def _check_schema(self, got: pa.Schema, expected: pa.Schema | None, name: str):
        """Validate one input's schema (``check_schema``); return the expected schema."""
        if expected is None:
            return got
        check_schema(got, expected, name, self.string_slots)
        return expected

    def _conform(self, rb: pa.RecordBatch, expected: pa.Schema) -> pa.RecordBatch:
        cols = []
        for field in expected:
            col = rb.column(rb.schema.get_field_index(field.name))
            if col.type != field.type and _casts_to(col.type, field.type):    # checked in _check_schema
                col = col.cast(field.type, safe=False)
            elif col.type != field.type:  # a raw string slot (checked in _check_schema)
                col = pa.array(keys.hash_array(self.string_slots[field.name], col, empty_is_missing=True))
            cols.append(col)
        return pa.RecordBatch.from_arrays(cols, schema=expected)

    def _input_batches(self):
        """Yield ``(file_index, batch_index, record_batch, row0)`` for this shard, from ``start`` on:
        ``record_batch`` is rows ``row0..`` of input record batch ``batch_index`` of file ``file_index``."""
        expected = self.schema
        columns = self.schema.names if self.schema is not None else None
        stream_counter = 0
        w, n = self.shard or (0, 1)
        lo, hi = row_ranges(self.file_rows, n)[w] if self.file_rows is not None else (0, 0)
        file_start = 0      # rows of the files before this one (shard_by="rows": by the counts)
        for fi, src in enumerate(self.files):
            if self.file_rows is not None:
                first_row, file_start = file_start, file_start + self.file_rows[fi]
                if first_row >= hi:
                    return
                if file_start <= lo or first_row == file_start:     # before the range, or no rows
                    continue
            if fi < self.start.file_index:
                continue
            if self.shard_by == "files" and fi % n != w:
                continue
            name = _name(src)
            checked = False
            file_row = 0    # rows of this file before rb
            batches = read_batches(src, columns, self.versions[fi])
            try:
                for bi, rb in enumerate(batches):
                    if not checked:
                        expected = self._check_schema(rb.schema, expected, name)
                        checked = True
                    row_in_file, file_row = file_row, file_row + rb.num_rows
                    cut0, cut1 = 0, rb.num_rows
                    if self.shard_by == "batches":
                        mine = stream_counter % n == w
                        stream_counter += 1
                        if not mine:
                            continue
                    elif self.file_rows is not None:       # this shard's rows of the batch
                        g = first_row + row_in_file
                        if g >= hi:
                            break
                        cut0, cut1 = max(0, lo - g), min(rb.num_rows, hi - g)
                    if fi == self.start.file_index and bi < self.start.batch_index:
                        continue
                    if fi == self.start.file_index and bi == self.start.batch_index:
                        cut0 = max(cut0, self.start.row)
                    if cut0 >= cut1:
                        continue
                    if cut0 or cut1 < rb.num_rows:
                        rb = rb.slice(cut0, cut1 - cut0)
                    rb = self._conform(rb, expected)
                    if self.check is not None:
                        bad = self.check(rb)
                        if bad is not None:
                            column, row, reason = bad
                            raise DataFormatError(name, row_in_file + cut0 + row + 1, column, reason, unit="row")
                    yield fi, bi, rb, cut0
            finally:
                batches.close()

    def _rechunk(self, pieces):
        """Re-chunk ``(fi, bi, rb, row0)`` pieces into ``(batch, position_after)`` of batch_size rows."""
        pending, count = [], 0
        for fi, bi, rb, row0 in pieces:
            off = 0
            while off < rb.num_rows:
                take = min(rb.num_rows - off, self.batch_size - count)
                pending.append(rb.slice(off, take))
                count += take
                off += take
                if count == self.batch_size:
                    yield _concat(pending), SourcePosition(fi, bi, row0 + off)
                    pending, count = [], 0
        if count and not self.drop_last:
            yield _concat(pending), self._end_position()

    def _end_position(self):
        return SourcePosition(len(self.files), 0, 0)

    def _shuffled(self, pieces, rng):
        """Shuffle rows through a buffer: fill to capacity, permute, emit half, refill. Pieces carry the
        read frontier as their position."""
        buf, rows, cap = [], 0, self.shuffle_buffer
        frontier = self.start
        for fi, bi, rb, row0 in pieces:
            buf.append(rb)
            rows += rb.num_rows
            frontier = SourcePosition(fi, bi + 1, 0)
            if rows >= cap:
                table = _concat(buf)
                table = table.take(pa.array(rng.permutation(table.num_rows)))
                keep = min(cap // 2, table.num_rows)
                emit = table.num_rows - keep
                yield fi, bi, table.slice(0, emit), frontier
                buf, rows = [table.slice(emit)], keep
        if rows:
            table = _concat(buf)
            yield (frontier.file_index, frontier.batch_index,
                   table.take(pa.array(rng.permutation(table.num_rows))), frontier)

    def _rechunk_shuffled(self, pieces):
        pending, count = [], 0
        for _fi, _bi, rb, frontier in pieces:
            off = 0
            while off < rb.num_rows:
                take = min(rb.num_rows - off, self.batch_size - count)
                pending.append(rb.slice(off, take))
                count += take
                off += take
                if count == self.batch_size:
                    yield _concat(pending), frontier
                    pending, count = [], 0
        if count and not self.drop_last:
            yield _concat(pending), self._end_position()

    def _pipeline(self, epoch: int):
        pieces = self._input_batches()
        if self.shuffle_buffer:
            rng = np.random.default_rng([self.seed, epoch])
            return self._rechunk_shuffled(self._shuffled(pieces, rng))
        return self._rechunk(pieces)

    def batches(self, epoch: int = 0) -> Iterator[pa.RecordBatch]:
        """Yield record batches of ``batch_size`` rows (the last may be shorter unless ``drop_last``).

        ``self.position`` is updated as each batch is handed out.

        Raises
        ------
        SchemaError
            If an input lacks an expected column or has it with another type (names column and file).
        DataFormatError
            ``check`` found a value the consumer cannot use (names the file, row and column), or an
            input is empty, truncated or not Arrow IPC / Parquet (names the file, the record batch that
            could not be read and its first row).
        """
        it = self._pipeline(epoch)
        if self.prefetch:
            it = prefetch(it, self.prefetch, name="arrow-source")
        try:
            for rb, pos in it:
                self.position = pos
                yield rb
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return self.batches(0)


def _concat(batches) -> pa.RecordBatch:
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]

