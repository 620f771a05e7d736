"""Hourly partitions: ``{root}/{YYYYMMDD}/{HH}/`` directories of Arrow files, consumed in time order.

A partition is complete when its ``_SUCCESS`` marker exists (``hdfs_io``'s publish protocol: data files,
``manifest.json``, then ``_SUCCESS``); an incomplete one is never read. ``HourlySource`` yields the
partitions after a given one, oldest first, and when none is ready waits (polling every
``poll_interval_s``) for the next. It never skips a partition whose directory exists but is not yet
complete (a producer still writing hour 05 holds back hour 06); hours with no directory are skipped.

Worked example::

    root/20240101/00/part-0.arrow, _SUCCESS
    root/20240101/01/part-0.arrow, part-1.arrow, manifest.json, _SUCCESS
    root/20240101/02/part-0.arrow                 (being written: no _SUCCESS yet)

    >>> src = HourlySource("s3://logs/ctr", poll_interval_s=30)          # doctest: +SKIP
    >>> for part in src.partitions(after="20240101/00"):                 # doctest: +SKIP
    ...     part.name, part.files        # "20240101/01", ["part-0.arrow", "part-1.arrow"]
    ...     for rb in part.record_batches(shard=(rank, workers)): ...    # waits for 02 after that

Works on every ``hdfs_io`` backend (local, S3, HDFS); files are read whole through ``read_buffer``.
"""
from __future__ import annotations

import datetime as _dt
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa
import pyarrow.ipc as ipc

import hdfs_io
from hdfs_io import Storage, StorageOptions

from .errors import DataFormatError, SchemaError

__all__ = ["Partition", "HourlySource", "partition_name", "partition_time"]

log = logging.getLogger(__name__)

_DAY_RE = re.compile(r"^\d{8}$")
_HOUR_RE = re.compile(r"^\d{2}$")
_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather")


def partition_name(when: _dt.datetime) -> str:
    """``datetime(2024, 1, 1, 5)`` -> ``"20240101/05"``."""
    return when.strftime("%Y%m%d/%H")


def partition_time(name: str) -> _dt.datetime:
    """``"20240101/05"`` -> the hour's start, UTC.

    Raises
    ------
    ValueError
        Not a partition name.
    """
    try:
        return _dt.datetime.strptime(name, "%Y%m%d/%H").replace(tzinfo=_dt.timezone.utc)
    except ValueError:
        raise ValueError(f"expected a partition name YYYYMMDD/HH, got {name!r}") from None


@dataclass(frozen=True)
class Partition:
    """One complete hourly partition.

    Attributes
    ----------
    name : str
        ``YYYYMMDD/HH``.
    files : list of str
        Arrow file names inside it, sorted.
    storage : Storage
        Rooted at the partition directory.
    """

    name: str
    files: tuple
    storage: Storage

    @property
    def start(self) -> _dt.datetime:
        return partition_time(self.name)

    @property
    def end(self) -> _dt.datetime:
        return self.start + _dt.timedelta(hours=1)

    def record_batches(self, *, shard: tuple[int, int] = (0, 1), schema: pa.Schema | None = None,
                       start_file: int = 0, start_batch: int = 0,
                       check=None) -> Iterator[tuple[int, int, pa.RecordBatch]]:
        """``(file_index, batch_index, batch)`` of this worker's share, in file order.

        Worker ``w`` of ``W`` gets the input record batches ``w::W`` counted over the whole partition,
        so every worker gets work even from a single file. ``start_file`` / ``start_batch`` resume
        after a recorded position. ``check``: as ``ArrowSource``'s, on every batch of this worker's share.

        Raises
        ------
        hdfs_io.CheckpointCorruptError
            A file is not readable Arrow (named).
        SchemaError
            A file lacks a column of ``schema`` or has another type (names the file and column).
        DataFormatError
            ``check`` found a value the consumer cannot use (names the file, its row and the column).
        """
        w, n = shard
        counter = 0
        for fi, fname in enumerate(self.files):
            buf = self.storage.read_buffer(fname)
            try:
                reader = _open(buf)
            except (pa.ArrowInvalid, OSError) as exc:
                uri = self.storage.uri_of(fname)
                raise hdfs_io.CheckpointCorruptError(f"{uri}: not a readable Arrow file: {exc}", uri=uri) from exc
            if schema is not None:
                _check_schema(reader.schema, schema, self.storage.uri_of(fname))
            file_row = 0    # rows of this file before rb
            for bi, rb in enumerate(reader):
                mine = counter % n == w
                counter += 1
                row_in_file, file_row = file_row, file_row + rb.num_rows
                if not mine or fi < start_file or (fi == start_file and bi < start_batch):
                    continue
                if schema is not None:
                    rb = pa.RecordBatch.from_arrays([rb.column(f.name) for f in schema], schema=schema)
                if check is not None and (bad := check(rb)) is not None:
                    column, row, reason = bad
                    raise DataFormatError(self.storage.uri_of(fname), row_in_file + row + 1, column, reason,
                                          unit="row")
                yield fi, bi, rb


def _open(buf: pa.Buffer):
    if buf.size >= 6 and buf[:6].to_pybytes() == b"ARROW1":
        return _FileIter(ipc.open_file(pa.BufferReader(buf)))
    return ipc.open_stream(pa.BufferReader(buf))


class _FileIter:
    def __init__(self, f):
        self.f, self.schema = f, f.schema

    def __iter__(self):
        return (self.f.get_batch(i) for i in range(self.f.num_record_batches))


def _check_schema(got: pa.Schema, want: pa.Schema, where: str) -> None:
    for field in want:
        idx = got.get_field_index(field.name)
        if idx < 0:
            raise SchemaError(where, field.name, str(field.type), None, got.names)
        if not got.field(idx).type.equals(field.type):
            raise SchemaError(where, field.name, str(field.type), str(got.field(idx).type))


class HourlySource:
    """Complete hourly partitions under ``root``, in time order, waiting for new ones.

    Parameters
    ----------
    root : str
        URI of the partition root (local path, ``s3://``, ``hdfs://``).
    poll_interval_s : float, seconds
        Wait between listings when the next partition is not ready.
    storage_options : StorageOptions, optional
    stop : threading.Event, optional
        Set it to make a waiting ``partitions`` return.
    """

    def __init__(self, root: str, *, poll_interval_s: float = 10.0, storage_options: StorageOptions | None = None,
                 stop: threading.Event | None = None, retry: hdfs_io.RetryPolicy | None = None):
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.storage = Storage.from_uri(root, storage_options=storage_options, retry=retry)
        self.poll_interval_s = poll_interval_s
        self.stop = stop or threading.Event()

    def _names(self, after: str | None) -> list[str]:
        """Existing partition directories after ``after`` (complete or not), sorted."""
        try:
            days = [d for d in self.storage.listdir("") if _DAY_RE.match(d)]
        except FileNotFoundError:
            return []
        out = []
        for day in days:
            if after is not None and day < after[:8]:
                continue
            try:
                hours = [h for h in self.storage.listdir(day) if _HOUR_RE.match(h)]
            except (FileNotFoundError, NotADirectoryError):
                continue
            out += [f"{day}/{h}" for h in hours if after is None or f"{day}/{h}" > after]
        return sorted(out)

    def complete(self, after: str | None = None) -> list[str]:
        """Complete partitions after ``after``, up to the first incomplete one (which holds back the rest)."""
        out = []
        for name in self._names(after):
            if not hdfs_io.is_complete(self.storage, name):
                break
            out.append(name)
        return out

    def open(self, name: str) -> Partition:
        """The complete partition ``name``.

        Raises
        ------
        hdfs_io.NotPublishedError
            It has no ``_SUCCESS``.
        """
        partition_time(name)
        if not hdfs_io.is_complete(self.storage, name):
            uri = self.storage.uri_of(name)
            raise hdfs_io.NotPublishedError(f"{uri} is not complete (no _SUCCESS)", uri=uri)
        st = self.storage.sub(name)
        files = tuple(f for f in st.listdir("") if f.endswith(_SUFFIXES) and not f.startswith(("_", ".")))
        return Partition(name, files, st)

    def partitions(self, after: str | None = None, *, until: _dt.datetime | None = None,
                   wait: bool = True) -> Iterator[Partition]:
        """Complete partitions after ``after``, oldest first; waits for the next one when ``wait``.

        Parameters
        ----------
        after : str, optional
            The last consumed partition (``YYYYMMDD/HH``); None starts at the oldest.
        until : datetime, optional
            Stop before the first partition starting at or after this time.
        wait : bool
            Poll for new partitions (forever, or until ``stop`` is set); False ends at the newest.
        """
        last = after
        while not self.stop.is_set():
            ready = self.complete(last)
            for name in ready:
                if until is not None and partition_time(name) >= until:
                    return
                yield self.open(name)
                last = name
                if self.stop.is_set():
                    return
            if ready:
                continue
            if until is not None and last is not None and partition_time(last) + _dt.timedelta(hours=1) >= until:
                return
            if not wait:
                return
            log.debug("no complete partition after %s under %s; polling in %.1f s", last, self.storage.uri,
                      self.poll_interval_s)
            self.stop.wait(self.poll_interval_s)

    def wait_for(self, name: str, timeout_s: float) -> bool:
        """Wait until partition ``name`` is complete; False after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while not hdfs_io.is_complete(self.storage, name):
            if time.monotonic() > deadline or self.stop.wait(min(self.poll_interval_s, 0.5)):
                return False
        return True
