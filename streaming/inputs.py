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
                    (``ipc_stream.stream_rows``: one or two small ranged reads per record batch)
==================  =================================================================================

Retries: listing and every open go through ``hdfs_io.Storage`` (``RetryPolicy``: a transient error is
retried with backoff); a read that fails in the middle of a file is not, and propagates as an
``OSError`` naming the input, as a failing local disk's does: the job's recovery rule (a lost worker
restarts the job from its last checkpoint) takes over.
"""
from __future__ import annotations

import json
import os
import posixpath
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from hdfs_io import Storage, StorageOptions, StorageUnavailableError

__all__ = ["InputUnavailableError", "RemoteInput", "STREAM_BUFFER_BYTES", "fetch", "is_uri", "list_remote",
           "unread_names"]

#: read-ahead of an IPC stream read from an object store or HDFS, in bytes: each ranged GET fetches this
#: much (a record batch of 64k Criteo rows is ~11 MB; at 8 MiB a batch costs one or two requests)
STREAM_BUFFER_BYTES = 8 << 20

_DATA_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather", ".parquet", ".pq")


class InputUnavailableError(StorageUnavailableError):
    """A training input's store did not answer (a listing or an open, after ``hdfs_io.RetryPolicy``'s
    retries): the message starts ``training input URI:``. Not bad data and not a checkpoint's storage:
    nothing was read from the input, and the same job runs once the store answers. ``refused`` (a
    permanent failure: access denied, read-only) is kept from the storage's error."""


@contextmanager
def _reaching(uri: str):
    """Turn the storage's ``StorageUnavailableError`` into ``InputUnavailableError`` naming ``uri``."""
    try:
        yield
    except InputUnavailableError:
        raise
    except StorageUnavailableError as exc:
        err = InputUnavailableError(f"training input {uri}: {exc}")
        if getattr(exc, "refused", None):
            err.refused = exc.refused
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
    """

    storage: Storage
    name: str
    size: int

    def __str__(self) -> str:
        return self.storage.uri_of(self.name)

    def __repr__(self) -> str:
        return f"RemoteInput({str(self)!r}, size={self.size})"

    def endswith(self, suffixes) -> bool:
        """``str(self).endswith(suffixes)``: the format test the readers make by suffix."""
        return self.name.endswith(suffixes)

    def open_file(self) -> pa.NativeFile:
        """The file for random access (``seek``, ``read_at``; a ranged GET per read on S3).

        Raises
        ------
        FileNotFoundError
            The file is gone (named by its URI).
        InputUnavailableError
            The store did not answer (after ``hdfs_io.RetryPolicy``'s retries).
        """
        with _reaching(str(self)):
            return self.storage.open_input_file(self.name)

    def open_stream(self, buffer_size: int = STREAM_BUFFER_BYTES) -> pa.NativeFile:
        """The file for one sequential read, read ahead ``buffer_size`` bytes at a time.

        Raises
        ------
        FileNotFoundError, InputUnavailableError
            As ``open_file``.
        """
        with _reaching(str(self)):
            return self.storage.open_input_stream(self.name, buffer_size=buffer_size)


def list_remote(uri: str, storage_options: StorageOptions | None = None) -> list[RemoteInput]:
    """The data files of ``uri`` (a file, or a directory read as a local one is: its direct children
    with a data suffix, ``.arrow .arrows .ipc .feather .parquet .pq``, not starting with ``_`` or ``.``,
    sorted by name).

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
        Nothing at ``uri``, or a directory without a data file (names the URI).
    ValueError
        An unsupported scheme.
    InputUnavailableError
        The store cannot be reached (after the retries), or its client library is missing.
    """
    with _reaching(uri):
        storage = Storage.from_uri(uri, storage_options=storage_options)
        info = storage.info()
        children = storage.children() if info.type == pafs.FileType.Directory else []
    if info.type == pafs.FileType.File:
        parent = Storage(storage.fs, posixpath.dirname(storage.root), uri=storage.uri.rsplit("/", 1)[0],
                         retry=storage.retry, retry_stats=storage.retry_stats)
        return [RemoteInput(parent, info.base_name, int(info.size))]
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"data path does not exist: {uri}")
    found = [RemoteInput(storage, i.base_name, int(i.size)) for i in children
             if i.type == pafs.FileType.File and not i.base_name.startswith(("_", "."))
             and i.base_name.endswith(_DATA_SUFFIXES)]
    if not found:
        raise FileNotFoundError(f"no Arrow IPC or Parquet files in directory {uri}")
    return sorted(found, key=lambda r: r.name)


def unread_names(uri: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Names of the files directly in the directory ``uri`` that ``list_remote`` leaves unread for their
    names (no data suffix; ``_``/``.`` markers and temporary files excepted), sorted; [] for a file.
    Raises ``InputUnavailableError`` as ``list_remote``."""
    with _reaching(uri):
        storage = Storage.from_uri(uri, storage_options=storage_options)
        children = storage.children() if storage.info().type == pafs.FileType.Directory else []
    return sorted(i.base_name for i in children if i.type == pafs.FileType.File
                  and not i.base_name.startswith(("_", ".")) and not i.base_name.endswith(_DATA_SUFFIXES))



def fetch(uri: str, dest, storage_options: StorageOptions | None = None) -> str:
    """Copy the file at ``uri`` (a Criteo text file on a store, say) to the local path ``dest`` unless
    ``dest`` already holds it, and return ``dest``. What was copied is recorded beside it
    (``dest.source.json``: the URI, the object's size and modification time in the store); the copy is
    taken again when any of them changed. Written under a temporary name and renamed once whole: a copy
    cut short is never taken for the file.

    Parameters
    ----------
    uri : str
        ``s3://bucket/key``, ``hdfs://nn:8020/path``.
    dest : str or PathLike
        A local file path; its directory must exist.

    Raises
    ------
    FileNotFoundError
        Nothing at ``uri``, or a directory (names the URI).
    InputUnavailableError
        The store did not answer (after the retries).
    OSError
        The copy was cut short (the bytes read differ from the object's size), or ``dest`` cannot be
        written.
    """
    dest = os.fspath(dest)
    with _reaching(uri):
        storage = Storage.from_uri(uri, storage_options=storage_options)
        info = storage.info()
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"file not found: {uri}" + (" (a directory)" if info.type == pafs.FileType.Directory
                                                             else ""))
    want = {"uri": uri, "size": int(info.size), "mtime_ns": info.mtime_ns}
    side = dest + ".source.json"
    try:
        with open(side) as f:
            if json.load(f) == want and os.path.getsize(dest) == want["size"]:
                return dest
    except (OSError, ValueError):
        pass
    tmp = os.path.join(os.path.dirname(dest) or ".", f".{os.path.basename(dest)}.{os.getpid()}.tmp")
    try:
        with _reaching(uri):
            src = storage.open_input_stream("", buffer_size=STREAM_BUFFER_BYTES)
        copied = 0
        with src, open(tmp, "wb") as out:
            while chunk := src.read(STREAM_BUFFER_BYTES):
                out.write(chunk)
                copied += len(chunk)
        if copied != want["size"]:
            raise OSError(f"{uri}: copied {copied} bytes of {want['size']}: the object changed or the read was "
                          f"cut short; run again")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with open(side, "w") as f:
        json.dump(want, f)
    return dest
