"""Training inputs on an object store or HDFS: ``s3://bucket/criteo/train/``, ``hdfs://nn:8020/data/train``.

``streaming.source.list_files`` expands such a URI (with ``hdfs_io``'s storage options: endpoint,
credentials, timeouts) into ``RemoteInput`` objects, one per data file, in the order a local directory
is read (names sorted; only the data suffixes; names starting with ``_`` or ``.`` skipped). Every reader of
``streaming.source`` (``read_batches``, ``read_schema``, ``count_rows``, ``ArrowSource`` with every
``shard_by``) takes a ``RemoteInput`` where it takes a local path, and names it by its URI in every
error. Nothing is copied to local disk first.

How each format is read, so an epoch costs few requests:

==================  =================================================================================
IPC stream          one sequential read through a ``STREAM_BUFFER_BYTES`` buffer (ranged GETs of that
                    size on S3), after the tail test (``ipc_stream.tail_has_eos``: two small ranged
                    reads) that refuses a truncated stream before its first batch is delivered
IPC file            random access: the footer, then each record batch's own range
Parquet             random access with ``pre_buffer`` (pyarrow coalesces a row group's column ranges)
row counts          Parquet's and IPC files' footers; an IPC stream's message headers
                    (``ipc_stream.stream_rows``: one ranged read of up to 16 KiB per message)
==================  =================================================================================

One version of each file: a ``RemoteInput`` is read as listed (its size and modification time; on S3,
once opened, the ETag its first open saw: the same bytes copied again pass), and an IPC stream, IPC
file or Parquet file read for its rows (``open_pinned``, ``open_stream``, ``remote_batches``) is checked
again after every ranged read (one HEAD on S3, comparing the ETag the open saw; a stat elsewhere): an
object written again, cut, grown or deleted since the listing, or while it is read, raises
``InputChangedError`` (a ``DataFormatError``) naming the URI before a byte of the other version is
delivered. A reader that keeps its ``RemoteInput`` objects (the CTR trainer lists its train files once)
so reads every epoch the version its row counts were taken on. S3 overwrites an object whole and in
place, and ranged reads at the offsets of the old one would otherwise return the new one's bytes: rows
of two versions mixed in one epoch, silently when both have the same size (fixed-width columns, the
same row count).

Retries: listing and every open go through ``hdfs_io.Storage`` (``RetryPolicy``: a transient error is
retried with backoff); a read that fails in the middle of a file is not, and raises
``InputUnavailableError`` naming the input: the job's recovery rule (a lost worker restarts the job from
its last checkpoint) takes over. A store refusing the job (access denied, bad or expired credentials:
``refused``) is never retried: ``InputUnavailableError`` with ``refused`` set, which no restart mends.
"""
from __future__ import annotations

import json
import os
import posixpath
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from hdfs_io import Storage, StorageOptions, StorageUnavailableError, described, permanent_failure
from hdfs_io.retry import is_transient

from .errors import DataFormatError
from .ipc_stream import CheckedStream, TrackedInput, ipc_file_batches, tail_has_eos

__all__ = ["CHANGED", "InputChangedError", "InputUnavailableError", "RemoteInput", "STREAM_BUFFER_BYTES", "fetch",
           "input_error", "is_uri", "refused", "list_remote", "list_remote_unread"]

#: read-ahead of an IPC stream read from an object store or HDFS, in bytes: each ranged GET fetches this
#: much (a record batch of 64k Criteo rows is ~11 MB; at 8 MiB a batch costs one or two requests)
STREAM_BUFFER_BYTES = 8 << 20

_DATA_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather", ".parquet", ".pq")


class InputUnavailableError(StorageUnavailableError):
    """A training input's store did not answer (a listing or an open, after ``hdfs_io.RetryPolicy``'s
    retries; a read in the middle of a file, not retried), or refused the job. Not bad data and not a
    checkpoint's storage. ``refused`` (a permanent failure: access denied, bad or expired credentials;
    ``refused()``) is set, to ``"EACCES"``, when no restart with the same settings reads the input; else
    the same job runs once the store answers.

    ``str()`` is ``"training input URI: REASON"`` (``engine train``'s wording); ``uri`` and ``reason``
    (what the store did, naming no command) let another command (``engine predict``, ``engine eval``)
    say whose input it is in its own words.

    Parameters
    ----------
    uri : str
        The input (a file or a directory as listed).
    reason : str
        What failed: the store's own words, with ``hdfs_io``'s note of the call.
    refused : str, optional
        ``"EACCES"`` when the store refused the job (see above).
    """

    def __init__(self, uri: str, reason: str, refused: str | None = None):
        super().__init__(f"training input {uri}: {reason}", uri=uri)
        self.reason = reason
        self.refused = refused

    def __reduce__(self):   # picklable across processes (workers, Ray) with its reason and refusal
        return type(self), (self.uri, self.reason, self.refused)


class InputChangedError(DataFormatError):
    """A training input on a store that is no longer the version the job listed: overwritten (another
    size, modification time or ETag), or deleted, before or while it was read. A ``DataFormatError``
    (``engine train`` ends with exit code 2, not restarted into the same change): the row counts that
    split the rows among the workers and the checkpoints' positions were taken on the version listed.

    ``str()`` is ``"URI: row N: field <object version>: FACT: ADVICE"`` (``sep`` between the two: ``"; "``
    after a fact that ends in a clause of its own, ``got none: deleted``). ``fact`` (what changed: both
    versions) names no command; ``advice`` (what it means and what to do; ``CHANGED``: a training job's row
    split, its checkpoints and ``--resume``) is the raiser's, and ``advised`` gives the message with
    another command's (``engine predict``, ``engine eval``) in its place.

    Parameters
    ----------
    uri : str
        The input.
    fact : str
        What changed, in "expected X, got Y" form.
    row : int
        1-based row of the input where the read stopped.
    field : str
        ``"<object version>"``, ``"<record batch N>"``, ``"<listing>"``.
    advice : str, optional
        What it means and what to do (None: nothing appended).
    sep : str
        Between ``fact`` and ``advice``.
    """

    def __init__(self, uri: str, fact: str, row: int = 1, field: str = "<object version>", *,
                 advice: str | None = None, sep: str = ": "):
        self.fact, self.advice, self.sep = fact, advice, sep
        super().__init__(uri, row, field, fact if advice is None else f"{fact}{sep}{advice}", unit="row")

    def advised(self, advice: str | None) -> str:
        """``str()`` of this error with ``advice`` in place of its own (None: the fact alone)."""
        return f"{self.path}: row {self.line}: field {self.field}: " + (
            self.fact if advice is None else f"{self.fact}{self.sep}{advice}")

    def at(self, uri: str, row: int, field: str) -> InputChangedError:
        """The same change, found at ``row`` and ``field`` of ``uri`` (where a reader stopped)."""
        return InputChangedError(uri, self.fact, row, field, advice=self.advice, sep=self.sep)

    def __reduce__(self):   # picklable as itself (DataFormatError's rebuilds a DataFormatError)
        return _rebuild_changed, (self.path, self.fact, self.line, self.field, self.advice, self.sep)


def _rebuild_changed(uri, fact, row, field, advice, sep):
    return InputChangedError(uri, fact, row, field, advice=advice, sep=sep)


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a store refusing to let the job read (access denied, unknown or expired
    credentials, a bad signature: ``hdfs_io.errors.S3_REFUSED``; ``PermissionError``/``EACCES``/``EPERM`` on
    a file system): permanent, as ``hdfs_io.retry.is_transient`` already does not retry it."""
    return isinstance(exc, PermissionError) or permanent_failure(exc) in ("EACCES", "EPERM")


def input_error(uri: str, exc: OSError) -> OSError:
    """``exc`` (a storage call's failure) as ``InputUnavailableError`` naming ``uri`` when the store refused
    the job (``refused`` set: not mended by a restart) or did not answer; else ``exc`` itself."""
    if isinstance(exc, InputUnavailableError):
        return exc
    if isinstance(exc, StorageUnavailableError):
        return InputUnavailableError(uri, str(exc), getattr(exc, "refused", None) or None)
    if not isinstance(exc, FileNotFoundError) and refused(exc):
        return InputUnavailableError(uri, f"access refused ({described(exc)})", "EACCES")
    if is_transient(exc):       # a read in the middle of a file: not retried (the module docstring)
        return InputUnavailableError(uri, described(exc))
    return exc


@contextmanager
def _reaching(uri: str):
    """Turn a storage call's failure into ``InputUnavailableError`` naming ``uri`` (``input_error``)."""
    try:
        yield
    except OSError as exc:
        err = input_error(uri, exc)
        if err is exc:
            raise
        raise err from exc


def is_uri(path) -> bool:
    """Whether ``path`` is a URI with a scheme (``s3://``, ``hdfs://``, ``file://``) that
    ``list_remote`` reads, rather than a local path."""
    return isinstance(path, str) and "://" in path


@dataclass(frozen=True, eq=False)
class RemoteInput:
    """One data file on an object store or HDFS.

    Attributes
    ----------
    storage : hdfs_io.Storage
        Rooted at the file's directory (its retries and storage options).
    name : str
        The file's name in that directory.
    size : int
        Bytes, when listed.
    mtime_ns : int or None
        Modification time when listed, nanoseconds since the epoch (seconds' resolution on S3); None:
        the store gave none (then only ``size`` is compared).
    """

    storage: Storage
    name: str
    size: int
    mtime_ns: int | None = None
    #: the ETag the first open saw (S3), which every later open must see too: it tells an object written
    #: again within the second of its listed modification time, and of the same size
    _etag: list = field(default_factory=list, repr=False)

    def __str__(self) -> str:
        return self.storage.uri_of(self.name)

    def __repr__(self) -> str:
        return f"RemoteInput({str(self)!r}, size={self.size})"

    def endswith(self, suffixes) -> bool:
        """``str(self).endswith(suffixes)``: the format test the readers make by suffix."""
        return self.name.endswith(suffixes)

    def open_file(self) -> pa.NativeFile:
        """The file for random access (``seek``, ``read_at``; a ranged GET per read on S3), checked at
        the open to be the version listed (its size and modification time, and on S3 the ETag of this
        object's first open; no request more on S3).

        Raises
        ------
        InputChangedError
            Deleted since the listing, or another version: its size, modification time or (once known)
            ETag is not the listing's (named by its URI).
        InputUnavailableError
            The store did not answer (after ``hdfs_io.RetryPolicy``'s retries), or refused the job.
        """
        return self._opened()[0]

    def open_pinned(self) -> pa.NativeFile:
        """``open_file``, and every read of it checked after its ranged GET (a HEAD on S3, comparing the
        ETag the open saw; a stat elsewhere): an object overwritten or deleted while it is read raises
        ``InputChangedError`` before the read's bytes are returned. For reading rows (IPC files, Parquet).

        Raises
        ------
        FileNotFoundError, InputChangedError, InputUnavailableError
            As ``open_file``; ``InputChangedError`` and ``InputUnavailableError`` from any read too.
        """
        raw, pin = self._opened()
        return pa.PythonFile(_PinnedFile(self, raw, pin), mode="r")

    def open_stream(self, buffer_size: int | None = None) -> pa.NativeFile:
        """The file for one sequential read, read ahead ``buffer_size`` bytes at a time (None:
        ``STREAM_BUFFER_BYTES``; a ranged GET of that size, then the check of ``open_pinned``).

        Raises
        ------
        FileNotFoundError, InputChangedError, InputUnavailableError
            As ``open_pinned``.
        """
        return pa.BufferedInputStream(self.open_pinned(), buffer_size or STREAM_BUFFER_BYTES)

    def version(self) -> tuple[int, int | None, bytes | None]:
        """``(size, mtime_ns or None, etag or None)`` of the object now, checked against the listing as an
        open is (one HEAD on S3; elsewhere an open and a stat): the ETag it reads is pinned, so every later
        open and read of this input must see the same one.

        Raises
        ------
        InputChangedError, InputUnavailableError
            As ``open_file``.
        """
        f, pin = self._opened()
        f.close()
        return pin

    def _opened(self) -> tuple[pa.NativeFile, tuple]:
        """The file opened for random access and the version it is, checked against the listing."""
        uri = str(self)
        try:
            with _reaching(uri):
                f = self.storage.open_input_file(self.name)
        except FileNotFoundError:       # listed, then gone: the same change as one written again
            raise InputChangedError(uri, f"expected the object as the job listed it "
                                         f"({_described(self.size, self.mtime_ns)}), got none: deleted",
                                    advice=CHANGED, sep="; ") from None
        try:
            pin = self._version(f)
            size, mtime_ns, etag = pin
            if self._etag and etag is not None:     # the content's tag: the same bytes copied again pass
                changed = size != self.size or etag != self._etag[0]
            else:
                changed = size != self.size or (self.mtime_ns is not None and mtime_ns is not None
                                                and not _same_time(mtime_ns, self.mtime_ns, etag is not None))
            if changed:
                raise InputChangedError(uri, f"expected the object as the job listed it "
                                             f"({_described(self.size, self.mtime_ns)}), got "
                                             f"{_described(size, mtime_ns)}", advice=CHANGED)
        except BaseException:
            f.close()
            raise
        if etag is not None and not self._etag:
            self._etag.append(etag)
        return f, pin

    def _version(self, f: pa.NativeFile | None = None) -> tuple:
        """``(size, mtime_ns or None, etag or None)`` of the object now: from the open file ``f``'s
        metadata (S3: the open's HEAD; no request), else a HEAD (S3) or a stat (elsewhere)."""
        meta = {}
        if f is not None:
            try:
                meta = f.metadata() or {}
            except (NotImplementedError, pa.ArrowNotImplementedError):     # a file system without metadata
                meta = {}
        elif self.storage.fs.type_name == "s3":
            with _reaching(str(self)), self.storage.open_input_file(self.name) as g:
                meta = g.metadata() or {}
        etag = meta.get("ETag")
        if etag is not None:
            stamp = meta.get("Last-Modified")
            return (int(meta.get("Content-Length", b"-1")), _header_time_ns(stamp), bytes(etag))
        with _reaching(str(self)):
            info = self.storage.info(self.name)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{self}: no such file")
        return int(info.size), info.mtime_ns, None


#: what an input written again means for the job, and what to do (the end of ``InputChangedError``'s reason)
CHANGED = ("it was written again since the job listed it, or while it was read; the row split and the "
            "checkpoints' positions hold for the version listed, and reading on would mix rows of two versions "
            "in one epoch: put that version back and resume, or resume from a checkpoint taken at an epoch's "
            "start to read the new files (a --resume inside the epoch is refused, naming one); new data is best "
            "written under new names, a new directory")


def _described(size: int, mtime_ns: int | None) -> str:
    """``"N bytes, modified ISO-TIME"``, the time to the microsecond where the store gives more than seconds."""
    if mtime_ns is None:
        return f"{size} bytes"
    when = datetime.fromtimestamp(mtime_ns / 1e9).astimezone()
    return f"{size} bytes, modified {when.isoformat(timespec='seconds' if mtime_ns % 10**9 == 0 else 'microseconds')}"


def _same_time(a: int, b: int, seconds: bool) -> bool:
    """Whether two modification times are one (to the second when one came from an HTTP header)."""
    return a // 10**9 == b // 10**9 if seconds else a == b


def _header_time_ns(stamp) -> int | None:
    """A ``Last-Modified`` value (``2026-12-01T01:43:18Z``, or RFC 1123) in nanoseconds, None if absent or
    not understood."""
    if not stamp:
        return None
    text = bytes(stamp).decode("ascii", "replace")
    try:
        return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()) * 10**9
    except ValueError:
        from email.utils import parsedate_to_datetime
        try:
            return int(parsedate_to_datetime(text).timestamp()) * 10**9
        except (TypeError, ValueError):
            return None


class _PinnedFile:
    """A Python file object (for ``pyarrow.PythonFile``) over a store's random-access file that, after
    each read (a ranged GET), checks that the object is still the version ``pin`` the open saw (S3: the
    ETag of a HEAD; elsewhere size and modification time of a stat), raising ``InputChangedError``
    before the bytes are returned."""

    def __init__(self, inp: RemoteInput, raw: pa.NativeFile, pin: tuple):
        self.inp, self.raw, self.pin = inp, raw, pin

    closed = property(lambda self: self.raw.closed)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.raw.seek(pos, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def size(self) -> int:
        return self.raw.size()

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.raw.read() if n is None or n < 0 else self.raw.read(n)
        except OSError as exc:
            self._check()       # a GET that failed for the object being gone or cut: named so
            err = input_error(str(self.inp), exc)
            if err is exc:
                raise
            raise err from exc
        if data:
            self._check()
        return data

    def _check(self) -> None:
        uri, began = str(self.inp), _described(self.pin[0], self.pin[1])
        try:
            now = self.inp._version()
        except FileNotFoundError:
            raise InputChangedError(uri, f"expected the object the read began on ({began}), got none: deleted "
                                         f"while it was read", advice=CHANGED, sep="; ") from None
        same = now[2] == self.pin[2] if self.pin[2] is not None else now[:2] == self.pin[:2]
        if not same or now[0] != self.pin[0]:
            raise InputChangedError(uri, f"expected the object the read began on ({began}), got another version "
                                         f"({_described(now[0], now[1])})", advice=CHANGED)

    def close(self) -> None:
        self.raw.close()


def _listing(uri: str, storage_options) -> tuple[Storage, pafs.FileInfo, list | None]:
    """``(storage at uri, its FileInfo, its children's FileInfo)``; children None when ``uri`` is read as
    a file (one without a trailing ``/``), [] when nothing is there.

    Raises
    ------
    FileNotFoundError
        ``uri`` ends in ``/`` but names a file with no directory of that name.
    InputUnavailableError
        As ``list_remote``.
    """
    with _reaching(uri):
        storage = Storage.from_uri(uri, storage_options=storage_options)
        info = storage.info()
        if info.type == pafs.FileType.File and not uri.endswith("/"):
            return storage, info, None
        if info.type == pafs.FileType.NotFound:
            return storage, info, []
        try:
            return storage, info, storage.children()
        except (NotADirectoryError, FileNotFoundError):     # "file.arrow/": only the object is there
            raise FileNotFoundError(f"data path is a file, not the directory its trailing slash names: {uri}") \
                from None


def list_remote(uri: str, storage_options: StorageOptions | None = None) -> list[RemoteInput]:
    """The data files of ``uri`` (a file, or a directory read as a local one is: its direct children
    with a data suffix, ``.arrow .arrows .ipc .feather .parquet .pq``, not starting with ``_`` or ``.``,
    sorted by name). A URI ending in ``/`` names a directory, also where an object of that name without
    the slash exists (S3 keeps ``train`` and ``train/part-0.arrow`` side by side).

    Parameters
    ----------
    uri : str
        ``s3://bucket/prefix``, ``hdfs://host:port/path``, ``file:///abs/path``.
    storage_options : hdfs_io.StorageOptions, optional
        Endpoint, credentials, timeouts (the config's ``storage`` section); None: the environment's
        (``AWS_*`` variables, ``HADOOP_*``).

    Raises
    ------
    FileNotFoundError
        Nothing at ``uri``, a directory without a data file, or a file named with a trailing ``/``
        (names the URI).
    ValueError
        An unsupported scheme.
    InputUnavailableError
        The store cannot be reached (after the retries), or its client library is missing.
    """
    return list_remote_unread(uri, storage_options)[0]


def list_remote_unread(uri: str, storage_options: StorageOptions | None = None) -> tuple[list[RemoteInput], list[str]]:
    """``(list_remote(uri), names)`` from one listing of the store: ``names`` of the files directly in the
    directory ``uri`` that ``list_remote`` leaves unread for their names (no data suffix; ``_``/``.`` markers
    and temporary files excepted), sorted; [] for a file. So a check that warns of those lists once, and
    reads what it listed. Raises as ``list_remote``."""
    storage, info, children = _listing(uri, storage_options)
    if children is None:
        parent = Storage(storage.fs, posixpath.dirname(storage.root), uri=storage.uri.rsplit("/", 1)[0],
                         retry=storage.retry, retry_stats=storage.retry_stats)
        return [RemoteInput(parent, info.base_name, int(info.size), info.mtime_ns)], []
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"data path does not exist: {uri}")
    found = [RemoteInput(storage, i.base_name, int(i.size), i.mtime_ns) for i in children
             if i.type == pafs.FileType.File and not i.base_name.startswith(("_", "."))
             and i.base_name.endswith(_DATA_SUFFIXES)]
    if not found:
        raise FileNotFoundError(f"no Arrow IPC or Parquet files in directory {uri}")
    unread = sorted(i.base_name for i in children if i.type == pafs.FileType.File
                    and not i.base_name.startswith(("_", ".")) and not i.base_name.endswith(_DATA_SUFFIXES))
    return sorted(found, key=lambda r: r.name), unread


def remote_batches(src: RemoteInput, opened: list) -> Iterator[pa.RecordBatch]:
    """The record batches of an IPC file or stream on a store (``streaming.source.read_batches`` translates
    its errors), every read checked to be of the version listed (``RemoteInput.open_pinned``): a stream's
    tail tested first (then, when it lacks the end-of-stream marker, the stream scanned to raise where it
    stops), then read through once. Appends to ``opened`` once the schema is read."""
    with src.open_pinned() as f:
        batches = ipc_file_batches(f, opened)
        if batches is not None:
            yield from batches
            return
        complete = tail_has_eos(f)
    if not complete:
        with src.open_file() as f:
            CheckedStream(f)        # scans the stream now, raising where it stops: nothing of it is delivered
    with src.open_stream() as raw:  # one sequential, read-ahead pass (streaming.inputs)
        reader = CheckedStream(TrackedInput(raw))
        opened.append(True)
        yield from reader


def fetch(uri: str, directory, storage_options: StorageOptions | None = None, *,
          in_directory: str | None = None) -> str:
    """Copy the file at ``uri`` (a Criteo text file or a text corpus on a store) into the local
    ``directory`` (created if missing), under the URI's last name, unless the copy there is current, and
    return its path. What was copied is recorded beside it (``NAME.source.json``: the URI, the object's
    size and modification time in the store); the copy is taken again when any of them changed. Copied
    with ``pyarrow.fs.copy_files`` under a temporary name (``hdfs_io.temp_names``; those a killed process
    left are removed first) and renamed once whole: a copy cut short is never taken for the file.

    Parameters
    ----------
    uri : str
        ``s3://bucket/key``, ``hdfs://nn:8020/path``.
    directory : str or PathLike
        Local directory of the copy.
    in_directory : str, optional
        When ``uri`` names a directory, copy its file of this name (``vocab.arrow`` of a converted corpus).

    Raises
    ------
    FileNotFoundError
        Nothing at ``uri``, or a directory (without ``in_directory``, or without that file in it; names the
        URI).
    InputUnavailableError
        The store did not answer (after the retries), or refused the job.
    OSError
        The copy was cut short (its size is not the object's), or ``directory`` cannot be written.
    """
    from hdfs_io.temp_names import stale, temp_name
    storage, info, children = _listing(uri.rstrip("/"), storage_options)
    if children is not None and in_directory and info.type == pafs.FileType.Directory:
        return fetch(f"{uri.rstrip('/')}/{in_directory}", directory, storage_options)
    if children is not None:
        raise FileNotFoundError(f"file not found: {uri}" + (" (a directory)" if info.type == pafs.FileType.Directory
                                                             else ""))
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    name = info.base_name
    dest, side = os.path.join(directory, name), os.path.join(directory, name + ".source.json")
    want = {"uri": uri, "size": int(info.size), "mtime_ns": info.mtime_ns}
    try:
        with open(side) as f:
            if json.load(f) == want and os.path.getsize(dest) == want["size"]:
                return dest
    except (OSError, ValueError):
        pass
    for left in stale(os.listdir(directory), name, "fetch"):
        os.unlink(os.path.join(directory, left))
    tmp = os.path.join(directory, temp_name(name, "fetch"))
    try:
        with _reaching(uri):
            pafs.copy_files(storage.full_path(), tmp, source_filesystem=storage.fs,
                            destination_filesystem=pafs.LocalFileSystem())
        if os.path.getsize(tmp) != want["size"]:
            raise OSError(f"{uri}: copied {os.path.getsize(tmp)} bytes of {want['size']}: the object changed or "
                          f"the read was cut short; run again")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with open(side, "w") as f:
        json.dump(want, f)
    return dest
