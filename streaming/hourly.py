"""Hourly partitions: ``{root}/{YYYYMMDD}/{HH}/`` directories of Arrow files, consumed in time order.

A partition is complete when its ``_SUCCESS`` marker exists (``hdfs_io``'s publish protocol: data files,
``manifest.json``, then ``_SUCCESS``); an incomplete one is never read. ``HourlySource`` yields the
partitions after a given one, oldest first, and when none is ready waits (polling every
``poll_interval_s``) for the next. It never skips a partition whose directory exists but is not yet
complete (a producer still writing hour 05 holds back hour 06). An hour with no directory is skipped
when a later hour is complete (at once, or after ``wait_for_missing_s``), with a WARNING naming it; a
directory that appears later for a skipped hour is logged (WARNING) as too late and is never trained.
Directories named like partitions but not real hours (``20241350``, ``20240101/24``) are ignored with a
WARNING.

A partition published by ``hdfs_io.Publisher`` has a ``manifest.json``: its data files are the ones the
manifest lists, each checked to exist with the listed size before any is read, and each file's CRC-32
checked against the manifest's as it is read, before any of its batches is used (a missing, truncated or
corrupt file raises ``hdfs_io.CheckpointCorruptError`` naming the partition and the file). A partition from
another writer (``_SUCCESS`` but no manifest) is read from a directory listing; its files that no reader
here supports (Hive ``000000_0``, ``.orc``, ...) are logged (WARNING), not read. Data files are Arrow IPC
(file or stream format: ``.arrow``, ``.arrows``, ``.ipc``, ``.feather``) or Parquet (``.parquet``).

Worked example::

    root/20240101/00/part-0.arrow, _SUCCESS
    root/20240101/01/part-0.arrow, part-1.arrow, manifest.json, _SUCCESS
    root/20240101/02/part-0.arrow                 (being written: no _SUCCESS yet)

    >>> src = HourlySource("s3://logs/ctr", poll_interval_s=30)          # doctest: +SKIP
    >>> for part in src.partitions(after="20240101/00"):                 # doctest: +SKIP
    ...     part.name, part.files        # "20240101/01", ["part-0.arrow", "part-1.arrow"]
    ...     for rb in part.record_batches(shard=(rank, workers)): ...    # waits for 02 after that

Works on every ``hdfs_io`` backend (local, S3, HDFS); files are read whole through ``read_buffer``.
Several workers each run their own ``HourlySource``; this module does not coordinate them (the online job
does: rank 0 decides each next partition, ``engine.programs.online_next``).
"""
from __future__ import annotations

import datetime as _dt
import logging
import re
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

import hdfs_io
from hdfs_io import Storage, StorageOptions
from hdfs_io.checksum import crc32_hex

from .errors import DataFormatError, SchemaError
from .ipc_stream import CheckedStream

__all__ = ["Partition", "HourlySource", "partition_name", "partition_time"]

log = logging.getLogger(__name__)

_DAY_RE = re.compile(r"^\d{8}$")
_HOUR_RE = re.compile(r"^\d{2}$")
_IPC_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather")
_PARQUET_SUFFIXES = (".parquet",)
_SUFFIXES = _IPC_SUFFIXES + _PARQUET_SUFFIXES
#: rows per record batch read from a Parquet file (batches never span row groups)
PARQUET_BATCH_ROWS = 65536
#: skipped hours remembered to report their late arrival (one week)
_MAX_TRACKED_SKIPPED = 168
#: seconds a partition seen complete and then gone (Publisher(overwrite=True) removes it before writing it
#: again) is waited for before it may be skipped as missing (or ``wait_for_missing_s``, when longer)
REPUBLISH_WAIT_S = 300.0
_HOUR = _dt.timedelta(hours=1)


def partition_name(when: _dt.datetime) -> str:
    """``datetime(2024, 1, 1, 5)`` -> ``"20240101/05"``: the hour in UTC (a naive ``when`` is UTC; one
    that carries another time zone is converted, so an hour of a DST change is never named twice)."""
    if when.tzinfo is not None:
        when = when.astimezone(_dt.timezone.utc)
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
    files : tuple of str
        Data file names inside it (Arrow IPC or Parquet), sorted: the manifest's data files when the
        partition has a ``manifest.json``, else those of a directory listing.
    storage : Storage
        Rooted at the partition directory.
    sizes : tuple of int or None
        Expected size of each of ``files`` in bytes (from the manifest); None without a manifest.
    crc32s : tuple of str or None
        Expected CRC-32 of each of ``files`` (8 hex digits, from the manifest); None without a manifest.
    """

    name: str
    files: tuple
    storage: Storage
    sizes: tuple | None = field(default=None, compare=False)
    crc32s: tuple | None = field(default=None, compare=False)

    @property
    def start(self) -> _dt.datetime:
        return partition_time(self.name)

    @property
    def end(self) -> _dt.datetime:
        return self.start + _HOUR

    def record_batches(self, *, shard: tuple[int, int] = (0, 1), schema: pa.Schema | None = None,
                       start_file: int = 0, start_batch: int = 0,
                       check=None) -> Iterator[tuple[int, int, pa.RecordBatch]]:
        """``(file_index, batch_index, batch)`` of this worker's share, in file order.

        Worker ``w`` of ``W`` gets the input record batches ``w::W`` counted over the whole partition,
        so every worker gets work even from a single file. ``start_file`` / ``start_batch`` resume
        after a recorded position. ``check``: as ``ArrowSource``'s, on every batch of this worker's share.
        A Parquet file's batches hold up to ``PARQUET_BATCH_ROWS`` rows and never span row groups.

        Raises
        ------
        hdfs_io.CheckpointCorruptError
            A file is not readable Arrow IPC / Parquet, an IPC stream lacks its end-of-stream marker
            (truncated) or has bytes after it (``streaming.ipc_stream``, checked before the file's first
            batch is used), or a file's size in bytes or CRC-32 differs from the manifest's (changed since
            the partition was opened, or corrupt); the message names the partition and the file.
        FileNotFoundError
            A file disappeared since the partition was opened.
        SchemaError
            A file lacks a column of ``schema`` or has another type (names the file and column).
        DataFormatError
            ``check`` found a value the consumer cannot use (names the file, its row and the column).
        """
        w, n = shard
        counter = 0
        for fi, fname in enumerate(self.files):
            buf = self.storage.read_buffer(fname)
            uri = self.storage.uri_of(fname)
            if self.sizes is not None and buf.size != self.sizes[fi]:
                raise hdfs_io.CheckpointCorruptError(
                    f"partition {self.name}: {uri}: size is {buf.size} bytes, manifest says {self.sizes[fi]} "
                    f"(changed since the partition was opened)", uri=uri)
            if self.crc32s is not None and (got := crc32_hex(zlib.crc32(memoryview(buf)))) != self.crc32s[fi]:
                raise hdfs_io.CheckpointCorruptError(
                    f"partition {self.name}: {uri}: crc32 is {got}, manifest says {self.crc32s[fi]} (corrupt "
                    f"file)", uri=uri)
            try:
                reader = _open(buf, fname)
            except (pa.ArrowInvalid, OSError) as exc:
                raise hdfs_io.CheckpointCorruptError(
                    f"partition {self.name}: {uri}: not a readable {_kind(fname)} file: {exc}", uri=uri) from exc
            if schema is not None:
                _check_schema(reader.schema, schema, uri)
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
                    raise DataFormatError(uri, row_in_file + row + 1, column, reason, unit="row")
                yield fi, bi, rb


def _kind(fname: str) -> str:
    return "Parquet" if fname.endswith(_PARQUET_SUFFIXES) else "Arrow IPC"


def _open(buf: pa.Buffer, fname: str = ""):
    if fname.endswith(_PARQUET_SUFFIXES):
        return _ParquetIter(pq.ParquetFile(pa.BufferReader(buf)))
    if buf.size >= 6 and buf[:6].to_pybytes() == b"ARROW1":
        return _FileIter(ipc.open_file(pa.BufferReader(buf)))
    # a stream cut at a batch boundary reads "fine" without its end-of-stream marker: the whole stream is
    # checked before its first batch is used (in memory: a zero-copy scan)
    return CheckedStream(pa.BufferReader(buf), precheck="scan")


class _FileIter:
    def __init__(self, f):
        self.f, self.schema = f, f.schema

    def __iter__(self):
        return (self.f.get_batch(i) for i in range(self.f.num_record_batches))


class _ParquetIter:
    def __init__(self, f: pq.ParquetFile):
        self.f, self.schema = f, f.schema_arrow

    def __iter__(self):
        for g in range(self.f.num_row_groups):
            yield from self.f.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[g])


def _check_schema(got: pa.Schema, want: pa.Schema, where: str) -> None:
    for field_ in want:
        idx = got.get_field_index(field_.name)
        if idx < 0:
            raise SchemaError(where, field_.name, str(field_.type), None, got.names)
        if not got.field(idx).type.equals(field_.type):
            raise SchemaError(where, field_.name, str(field_.type), str(got.field(idx).type))


def _hours_between(after: str, before: str) -> list[str]:
    """Partition names strictly between two partition names."""
    t, end, out = partition_time(after) + _HOUR, partition_time(before), []
    while t < end:
        out.append(partition_name(t))
        t += _HOUR
    return out


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)} hours)"


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
    retry : hdfs_io.RetryPolicy, optional
    wait_for_missing_s : float, seconds
        How long an hour with no directory is waited for once a later hour is complete, counted from
        when this source first saw that later hour complete; then it is skipped (WARNING). 0 (default)
        skips it at once. An hour whose directory exists but lacks ``_SUCCESS`` is always waited for.

    Raises
    ------
    ValueError
        ``poll_interval_s`` <= 0 or ``wait_for_missing_s`` < 0.
    """

    def __init__(self, root: str, *, poll_interval_s: float = 10.0, storage_options: StorageOptions | None = None,
                 stop: threading.Event | None = None, retry: hdfs_io.RetryPolicy | None = None,
                 wait_for_missing_s: float = 0.0):
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        if not wait_for_missing_s >= 0:
            raise ValueError(f"wait_for_missing_s must be >= 0 seconds, got {wait_for_missing_s}")
        self.storage = Storage.from_uri(root, storage_options=storage_options, retry=retry)
        self.poll_interval_s = poll_interval_s
        self.wait_for_missing_s = float(wait_for_missing_s)
        self.stop = stop or threading.Event()
        self._warned: set[str] = set()                  # names already warned about (once each)
        self._skipped: dict[str, str] = {}              # skipped missing hour -> the hour yielded after it
        self._gap_seen: dict[str, float] = {}           # hour after a gap -> monotonic time first seen
        self._republishing: dict[str, float] = {}       # seen complete, then not -> monotonic time since

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _valid(self, name: str) -> bool:
        try:
            _dt.datetime.strptime(name, "%Y%m%d/%H" if "/" in name else "%Y%m%d")
            return True
        except ValueError:
            self._warn_once(f"bad:{name}", "ignoring %s: named like an hourly partition but %s is not a real "
                            "date/hour", self.storage.uri_of(name), name)
            return False

    def _names(self, after: str | None) -> list[str]:
        """Existing partition directories after ``after`` (complete or not), sorted.

        Also reports (WARNING) directories that appeared for hours this source skipped as missing.
        """
        try:
            days = [d for d in self.storage.listdir("") if _DAY_RE.match(d)]
        except FileNotFoundError:
            return []
        skipped_days = {s[:8] for s in self._skipped}
        out = []
        for day in days:
            if after is not None and day < after[:8] and day not in skipped_days:
                continue
            if not self._valid(day):
                continue
            try:
                hours = [h for h in self.storage.listdir(day) if _HOUR_RE.match(h)]
            except (FileNotFoundError, NotADirectoryError):
                continue
            for h in hours:
                name = f"{day}/{h}"
                if not self._valid(name):
                    continue
                if name in self._skipped:
                    log.warning("hourly partition %s arrived too late: skipped as missing when %s was next; it "
                                "is not trained", self.storage.uri_of(name), self._skipped.pop(name))
                if after is None or name > after:
                    out.append(name)
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
        """The complete partition ``name``, its files checked against its manifest when it has one.

        Raises
        ------
        ValueError
            ``name`` is not a partition name ``YYYYMMDD/HH``.
        hdfs_io.NotPublishedError
            It has no ``_SUCCESS``.
        hdfs_io.CheckpointCorruptError
            Its ``manifest.json`` is invalid, a file it lists is missing or has another size in bytes, or
            it lists files but none that can be read; the message names the partition and the file.
        """
        part = self.open_if_complete(name)
        if part is None:
            uri = self.storage.uri_of(name)
            raise hdfs_io.NotPublishedError(f"{uri} is not complete (no _SUCCESS)", uri=uri)
        return part

    def open_if_complete(self, name: str) -> Partition | None:
        """``open``, but None when the partition is not published (yet, or again: being republished)."""
        partition_time(name)
        st = self.storage.sub(name)
        try:
            listing = st.listdir("")
        except (FileNotFoundError, NotADirectoryError):
            return None
        if hdfs_io.SUCCESS_NAME not in listing:
            return None
        if hdfs_io.MANIFEST_NAME not in listing:
            files = [f for f in listing if f.endswith(_SUFFIXES) and not f.startswith(("_", "."))]
            other = [f for f in listing if not f.endswith(_SUFFIXES) and not f.startswith(("_", "."))]
            if other:
                self._warn_once(f"other:{name}", "hourly partition %s has no %s (not written by hdfs_io.Publisher); "
                                "not reading %d file(s) of no supported format (%s): %s%s",
                                st.uri, hdfs_io.MANIFEST_NAME, len(other), ", ".join(_SUFFIXES), ", ".join(other[:5]),
                                "" if files else "; the hour trains as EMPTY")
            return Partition(name, tuple(files), st)
        try:
            manifest = hdfs_io.verify(self.storage, name, checksums=False)
        except hdfs_io.NotPublishedError:
            return None
        except hdfs_io.CheckpointCorruptError as exc:
            if not hdfs_io.is_complete(self.storage, name):      # republished while checked: wait for it
                return None
            raise hdfs_io.CheckpointCorruptError(f"hourly partition {name}: {exc}", uri=exc.uri) from exc
        entries = hdfs_io.file_entries(manifest)
        files = [f for f in entries if f.endswith(_SUFFIXES)]
        other = [f for f in entries if not f.endswith(_SUFFIXES)]
        if other and not files:
            raise hdfs_io.CheckpointCorruptError(
                f"hourly partition {st.uri}: its manifest lists {len(other)} file(s) but none of a supported format "
                f"({', '.join(_SUFFIXES)}): {', '.join(other[:5])}", uri=st.uri_of(other[0]))
        if other:
            self._warn_once(f"other:{name}", "hourly partition %s: not reading %d file(s) of its manifest of no "
                            "supported format: %s", st.uri, len(other), ", ".join(other[:5]))
        stray = [f for f in listing if f.endswith(_SUFFIXES) and f not in entries and not f.startswith(("_", "."))]
        if stray:
            self._warn_once(f"stray:{name}", "hourly partition %s: not reading %d data file(s) its manifest does "
                            "not list: %s", st.uri, len(stray), ", ".join(stray[:5]))
        return Partition(name, tuple(files), st, sizes=tuple(entries[f].size for f in files),
                         crc32s=tuple(entries[f].crc32 for f in files))

    def partitions(self, after: str | None = None, *, until: _dt.datetime | None = None,
                   wait: bool = True) -> Iterator[Partition]:
        """Complete partitions after ``after``, oldest first; waits for the next one when ``wait``.

        A partition that loses its ``_SUCCESS`` between listing and opening (republished with
        ``Publisher(overwrite=True)``, which may remove its directory first) is waited for, up to
        ``REPUBLISH_WAIT_S`` (or ``wait_for_missing_s`` when longer), never skipped as a missing hour. Hours with no directory
        before a complete later hour are skipped with a WARNING (after ``wait_for_missing_s``; with
        ``wait=False`` a later hour still inside that bound ends the iteration).

        Parameters
        ----------
        after : str, optional
            The last consumed partition (``YYYYMMDD/HH``); None starts at the oldest.
        until : datetime, optional
            Stop before the first partition starting at or after this time.
        wait : bool
            Poll for new partitions (forever, or until ``stop`` is set); False ends at the newest.

        Raises
        ------
        hdfs_io.CheckpointCorruptError
            See ``open``.
        """
        last = after
        while not self.stop.is_set():
            progressed, pause = False, self.poll_interval_s
            for name in self.complete(last):
                if until is not None and partition_time(name) >= until:
                    return
                missing = _hours_between(last, name) if last is not None else []
                held = [m for m in missing if m in self._republishing]
                if held:     # seen complete, now gone: a republish in progress, not an hour that never came
                    now = time.monotonic()
                    left = self._republishing[held[0]] + max(REPUBLISH_WAIT_S, self.wait_for_missing_s) - now
                    if left > 0:
                        pause = min(pause, left)
                        break
                    log.warning("hourly partition %s was complete, then removed, and not republished within "
                                "%.0f s: skipped", self.storage.uri_of(held[0]),
                                max(REPUBLISH_WAIT_S, self.wait_for_missing_s))
                    for m in held:
                        self._republishing.pop(m, None)
                if missing and self.wait_for_missing_s > 0:
                    now = time.monotonic()
                    left = self._gap_seen.setdefault(name, now) + self.wait_for_missing_s - now
                    if left > 0:
                        self._warn_once(f"gap:{name}", "hourly partition %s missing; waiting up to %.0f s for it "
                                        "before training %s", _span(missing), left, name)
                        pause = min(pause, left)
                        break
                part = self.open_if_complete(name)
                if part is None:
                    log.info("hourly partition %s is no longer complete (being republished?); waiting for it",
                             self.storage.uri_of(name))
                    self._republishing.setdefault(name, time.monotonic())
                    pause = min(pause, 1.0)
                    break
                if missing:
                    log.warning("hourly partition %s missing under %s: skipped, %s is next", _span(missing),
                                self.storage.uri, name)
                    for m in missing[-_MAX_TRACKED_SKIPPED:]:
                        self._skipped[m] = name
                    while len(self._skipped) > _MAX_TRACKED_SKIPPED:
                        self._skipped.pop(next(iter(self._skipped)))
                self._gap_seen.pop(name, None)
                self._republishing.pop(name, None)
                yield part
                last, progressed = name, True
                if self.stop.is_set():
                    return
            if progressed:
                continue
            if until is not None and last is not None and partition_time(last) + _HOUR >= until:
                return
            if not wait:
                return
            log.debug("no complete partition after %s under %s; polling in %.1f s", last, self.storage.uri, pause)
            self.stop.wait(pause)

    def wait_for(self, name: str, timeout_s: float) -> bool:
        """Wait until partition ``name`` is complete; False after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while not hdfs_io.is_complete(self.storage, name):
            if time.monotonic() > deadline or self.stop.wait(min(self.poll_interval_s, 0.5)):
                return False
        return True
