"""Arrow IPC streams read up to their end-of-stream marker, and no shorter.

An IPC stream ends with an end-of-stream marker (``IPC_EOS``: the continuation token ``0xFFFFFFFF`` then
an int32 0; ``LEGACY_IPC_EOS``, an int32 0, in the framing of Arrow < 0.15). pyarrow's stream reader also
stops, quietly, when the bytes end where a message would begin: a stream cut at a record-batch boundary
(its writer killed between two batches) reads as a complete, shorter stream. ``CheckedStream`` refuses
it: once the reader stops, the bytes that followed the last message must be exactly an end-of-stream
marker (nothing after it either: bytes there would be a second stream pyarrow never reads).

Worked example (a stream of 3 batches cut after the second)::

    bytes:  [schema][batch 0][batch 1]            (no 0xFFFFFFFF 00000000 at the end)
    CheckedStream(pa.OSFile(path))   -> IncompleteStreamError(batches=2, rows=rows of batches 0-1,
                                        cause=None): "... ends after record batch 1 without ..."

A seekable input is checked up front from its first 4 and last 8 bytes (``tail_has_eos``), then, if the
tail looks wrong, scanned to count the complete batches before the cut, so nothing of a truncated file is
delivered in the usual case; the exact check after the last message runs in every case (a batch's last
bytes can equal the marker: e.g. an int32 column ending in -1 and 4 bytes of padding).
"""
from __future__ import annotations

import os
from typing import Iterator

import pyarrow as pa

__all__ = ["IPC_EOS", "LEGACY_IPC_EOS", "CheckedStream", "IncompleteStreamError", "TrackedInput",
           "ipc_file_batches", "stream_rows", "tail_has_eos"]

#: end-of-stream marker of the IPC stream format (continuation token, then metadata length 0)
IPC_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
#: end-of-stream marker of the pre-0.15 ("legacy") framing: metadata length 0
LEGACY_IPC_EOS = b"\x00\x00\x00\x00"


class IncompleteStreamError(pa.ArrowInvalid):
    """An IPC stream that ends without its end-of-stream marker, is followed by bytes after it, or whose
    record batch ``batches`` cannot be read (found while scanning a stream whose tail looked wrong).

    A ``pyarrow.ArrowInvalid``, so callers that refuse unreadable Arrow input refuse this too.

    Attributes
    ----------
    batches : int
        Complete record batches before the fault (their rows were, or could be, read).
    rows : int
        Rows of those batches.
    reason : str
        What was found, e.g. "the end of the input, without the end-of-stream marker".
    cause : BaseException or None
        pyarrow's error when a record batch could not be read; None when every batch could.
    """

    def __init__(self, reason: str, batches: int, rows: int, cause: BaseException | None = None):
        self.reason, self.batches, self.rows, self.cause = reason, int(batches), int(rows), cause
        where = (f"after record batch {batches - 1} ({rows} row{'s' * (rows != 1)} in {batches} complete "
                 f"record batch{'es' * (batches != 1)})" if batches else "before its first record batch")
        super().__init__(f"Arrow IPC stream {where}: {reason}")

    def __reduce__(self):   # picklable (prefetch threads, worker processes) with its attributes
        return type(self), (self.reason, self.batches, self.rows, None)


def tail_has_eos(f) -> bool:
    """Whether a seekable input's stream ends with its end-of-stream marker, judged from its first 4
    bytes (the framing: ``0xFFFFFFFF`` = current, else legacy) and its last 8.

    A quick test, not a proof: False means truncated for sure; True can be a batch whose last bytes equal
    the marker (``CheckedStream`` checks exactly after the last message).

    Parameters
    ----------
    f : pyarrow.NativeFile
        Seekable (``OSFile``, ``BufferReader``), positioned at the stream's first byte; left there.
    """
    start, size = f.tell(), f.size()
    n = size - start
    if n < 4:
        return False
    legacy = f.read_at(4, start) != IPC_EOS[:4]
    tail = f.read_at(min(8, n), size - min(8, n))
    f.seek(start)           # an OSFile refuses an implicitly positioned read after read_at until a seek
    return tail[-4:] == LEGACY_IPC_EOS if legacy else tail == IPC_EOS


def ipc_file_batches(f, opened: list) -> Iterator[pa.RecordBatch] | None:
    """The record batches of ``f`` when it is an Arrow IPC *file* (its first 6 bytes ``ARROW1``), read
    from its footer on demand; None, with ``f`` back at 0, when it is not (a stream: ``CheckedStream``).
    Appends to ``opened`` once the footer is read.

    Parameters
    ----------
    f : pyarrow.NativeFile
        Seekable, at offset 0.
    opened : list
        ``streaming.source.read_batches``' record of whether the input's schema was read.
    """
    magic = f.read(6)
    f.seek(0)
    if magic != b"ARROW1":
        return None
    ipc_file = pa.ipc.open_file(f)
    opened.append(True)
    return (ipc_file.get_batch(i) for i in range(ipc_file.num_record_batches))


def stream_rows(path) -> int | None:
    """Rows of the IPC stream file ``path`` (a path, or a seekable ``pyarrow.NativeFile`` at offset 0: a
    file on an object store, where each read is a ranged GET) read from its messages' metadata alone
    (each record batch's ``length``), the bodies skipped by a seek: a few KB read per record batch, not
    the batch. None when
    the bytes are not a stream this walk understands to its end-of-stream marker, at the file's end (a
    truncated or corrupt stream, bytes after the marker): the caller then reads the stream through, which
    names what is wrong.

    Framing (``Message.fbs``): each message is ``[0xFFFFFFFF] int32 metadata size, flatbuffer Message,
    body of Message.bodyLength bytes``; a ``RecordBatch`` header (type 3) holds the batch's ``length``
    (rows) in its first field.
    """
    if not isinstance(path, (str, os.PathLike)):
        return _walk(path, path.size())
    with open(path, "rb") as f:
        return _walk(f, os.fstat(f.fileno()).st_size)


#: bytes ``stream_rows`` reads at each message's start: its framing and, nearly always, its whole metadata
#: (a record batch's is ~0.5-3 KB), so a message costs one read (one ranged GET on an object store)
HEADER_READ = 1 << 14


def _walk(f, size: int) -> int | None:
    """``stream_rows`` of the open file ``f`` (``read``, ``seek``) of ``size`` bytes, from its start."""
    import struct
    rows = 0
    pos = 0
    while True:
        f.seek(pos)
        chunk = f.read(min(HEADER_READ, size - pos))
        if len(chunk) < 4:
            return None
        n, at = struct.unpack_from("<i", chunk, 0)[0], 4
        if n == -1:                        # continuation token: the size follows
            if len(chunk) < 8:
                return None
            n, at = struct.unpack_from("<i", chunk, 4)[0], 8
        pos += at
        if n == 0:                         # the end-of-stream marker: it must end the file
            return rows if pos == size else None
        if n < 0 or pos + n > size:
            return None
        meta = chunk[at:at + n]
        if len(meta) < n:                  # metadata longer than the first read (a wide schema)
            meta += f.read(n - len(meta))
        pos += n
        parsed = _message_header(meta)
        if parsed is None:
            return None
        kind, body, length = parsed
        if body < 0 or pos + body > size:
            return None
        if kind == 3:
            rows += length
        pos += body


def _message_header(meta: bytes) -> tuple[int, int, int] | None:
    """(header type, body length, record batch length or 0) of one flatbuffer ``Message``; None if it
    does not parse."""
    import struct
    try:
        def field(table: int, slot: int) -> int:          # the field's absolute offset, 0 = absent
            vt = table - struct.unpack_from("<i", meta, table)[0]
            vt_size = struct.unpack_from("<H", meta, vt)[0]
            off = struct.unpack_from("<H", meta, vt + 4 + 2 * slot)[0] if 4 + 2 * slot < vt_size else 0
            return table + off if off else 0

        root = struct.unpack_from("<I", meta, 0)[0]
        t = field(root, 1)
        kind = meta[t] if t else 0
        b = field(root, 3)
        body = struct.unpack_from("<q", meta, b)[0] if b else 0
        length = 0
        if kind == 3:
            h = field(root, 2)
            if not h:
                return None
            rb = h + struct.unpack_from("<I", meta, h)[0]
            ln = field(rb, 0)
            length = struct.unpack_from("<q", meta, ln)[0] if ln else 0
            if length < 0:
                return None
        return kind, body, length
    except (struct.error, IndexError, ValueError, OverflowError):
        return None


def _size(f) -> int:
    """The size of a seekable input now (an ``OSFile`` caches the size it had when opened)."""
    if isinstance(f, pa.OSFile):
        return os.fstat(f.fileno()).st_size
    return f.size()


class TrackedInput:
    """A binary file object (stdin, a pipe, a socket's file) read through, counting the bytes taken and
    keeping the last 8, so a ``CheckedStream`` can see what followed the last message of a stream that
    cannot seek. ``pa.ipc.open_stream`` reads it as a Python file.

    Parameters
    ----------
    raw : binary file object with ``read(n)``
    """

    def __init__(self, raw):
        self.raw, self.pos, self.last = raw, 0, b""
        self.name = getattr(raw, "name", None)

    @property
    def closed(self) -> bool:
        return bool(getattr(self.raw, "closed", False))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        """Bytes read so far."""
        return self.pos

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.pos += len(data)
            self.last = (self.last + bytes(data[-8:]))[-8:]
        return data

    def close(self) -> None:
        pass        # the caller owns ``raw``


class CheckedStream:
    """Record batches of one Arrow IPC stream, refusing a stream that does not end with its
    end-of-stream marker (module docstring).

    Parameters
    ----------
    f : pyarrow.NativeFile or TrackedInput
        Positioned at the stream's first byte. A seekable ``NativeFile`` (``OSFile``, ``BufferReader``)
        is checked exactly: what follows the last message must be the marker and nothing else; a
        ``TrackedInput`` (no seeking): the last bytes read after the last message must be the marker
        (bytes after it are never read).
    precheck : {"tail", "scan", None}
        Seekable input only, before the first batch is delivered: ``"tail"`` tests ``tail_has_eos`` and,
        when it fails, scans the whole stream then and there to raise naming the batch where it stops;
        ``"scan"`` always scans (for an input in memory, where reading is free: no batch of a bad stream
        is ever delivered); None checks only once the last batch was read.

    Attributes
    ----------
    schema : pyarrow.Schema

    Raises
    ------
    IncompleteStreamError
        From the constructor (precheck) or from iterating: the stream ends without its marker, has bytes
        after it, or (precheck scan) a record batch cannot be read.
    pyarrow.ArrowInvalid, OSError
        As ``pyarrow.ipc.open_stream`` raises them: not even the schema could be read (empty input,
        another format), or, while iterating, a record batch could not be read.
    """

    def __init__(self, f, *, precheck: str | None = "tail"):
        if precheck not in ("tail", "scan", None):
            raise ValueError(f"precheck must be 'tail', 'scan' or None, got {precheck!r}")
        self.f = f
        self._seekable = isinstance(f, pa.NativeFile) and f.seekable()
        start = f.tell()
        if self._seekable and (precheck == "scan" or (precheck == "tail" and not tail_has_eos(f))):
            self._scan()        # raises, naming the batch where it stops
            f.seek(start)
        self._reader = pa.ipc.open_stream(f)
        self.schema = self._reader.schema

    def _scan(self) -> None:
        """Read the whole stream, counting batches, and raise where it stops short; return if it is
        complete."""
        reader = pa.ipc.open_stream(self.f)     # an unreadable schema: pyarrow's error, as without precheck
        batches = rows = 0
        mark = self.f.tell()
        while True:
            try:
                rb = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as exc:
                raise IncompleteStreamError(f"record batch {batches} cannot be read ({' '.join(str(exc).split())})"
                                            f": the input is truncated or corrupt", batches, rows, exc) from exc
            batches, rows, mark = batches + 1, rows + rb.num_rows, self.f.tell()
        self._check_end(mark, batches, rows)

    def _check_end(self, mark: int, batches: int, rows: int) -> None:
        """Raise unless what follows offset ``mark`` (the end of the last message) is the marker alone."""
        f = self.f
        if self._seekable:
            extra = _size(f) - mark
            after = f.read_at(min(extra, 64), mark) if extra > 0 else b""
            if extra < 0 or len(after) != min(extra, 64):
                raise IncompleteStreamError(f"an input shorter than the bytes already read ({_size(f)} bytes now, "
                                            f"{mark} read): truncated or replaced while being read",
                                            batches, rows)
        else:
            extra = f.tell() - mark
            after = f.last[-extra:] if 0 < extra <= 8 else b""
        if after in (IPC_EOS, LEGACY_IPC_EOS) and extra == len(after):
            return
        if extra == 0:
            what = "the end of the input, without the end-of-stream marker: truncated (its writer stopped " \
                   "between two record batches?)"
        elif after.startswith((IPC_EOS, LEGACY_IPC_EOS)):
            n = extra - (8 if after.startswith(IPC_EOS) else 4)
            what = (f"{n} byte{'s' * (n != 1)} after the end-of-stream marker (two streams written into one "
                    f"file?): pyarrow stops at the marker, so the rows after it would be lost")
        else:
            what = f"{extra} byte{'s' * (extra != 1)} that are neither a record batch nor the end-of-stream marker"
        raise IncompleteStreamError(what, batches, rows)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        batches = rows = 0
        mark = self.f.tell()
        for rb in self._reader:
            batches, rows, mark = batches + 1, rows + rb.num_rows, self.f.tell()
            yield rb
        self._check_end(mark, batches, rows)
