"""File checksums for manifests, computed while data streams through (a file is never read twice).

The algorithm is CRC-32 (``zlib.crc32``, the IEEE polynomial used by gzip/zip): it runs at several GB/s,
releases the GIL on large buffers and is always available. It detects truncation and accidental
corruption, not tampering. A manifest entry records it as ``"crc32": "<8 lowercase hex digits>"``;
the field name carries the algorithm so a stronger one can be added later without ambiguity.

Worked example::

    >>> entry = FileEntry.of_bytes(b"hello")
    >>> entry
    FileEntry(size=5, crc32='3610a686')
    >>> entry.to_json()
    {'size': 5, 'crc32': '3610a686'}
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import pyarrow as pa

__all__ = ["CHECKSUM_ALGORITHM", "FileEntry", "ChecksumWriter", "crc32_hex", "checksum_stream"]

CHECKSUM_ALGORITHM = "crc32"
_CHUNK = 8 << 20  # bytes per read when checksumming a stream


def crc32_hex(value: int) -> str:
    """Format a CRC-32 value as 8 lowercase hex digits."""
    return f"{value & 0xFFFFFFFF:08x}"


@dataclass(frozen=True)
class FileEntry:
    """Size and checksum of one published file.

    Parameters
    ----------
    size : int, bytes
    crc32 : str
        8 lowercase hex digits.
    """

    size: int
    crc32: str

    @classmethod
    def of_bytes(cls, data: bytes | bytearray | memoryview | pa.Buffer) -> "FileEntry":
        """Entry of an in-memory payload."""
        view = memoryview(data)
        return cls(size=view.nbytes, crc32=crc32_hex(zlib.crc32(view)))

    def to_json(self) -> dict[str, Any]:
        """JSON form stored in ``manifest.json``."""
        return {"size": self.size, CHECKSUM_ALGORITHM: self.crc32}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "FileEntry":
        """Parse the JSON form.

        Raises
        ------
        ValueError
            When ``size`` or ``crc32`` is missing or malformed.
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"expected an object with size and {CHECKSUM_ALGORITHM}, got {obj!r}")
        size, crc = obj.get("size"), obj.get(CHECKSUM_ALGORITHM)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"expected size to be an int >= 0, got {size!r}")
        if not isinstance(crc, str) or len(crc) != 8 or any(c not in "0123456789abcdef" for c in crc):
            raise ValueError(f"expected {CHECKSUM_ALGORITHM} to be 8 lowercase hex digits, got {crc!r}")
        return cls(size=size, crc32=crc)


class ChecksumWriter:
    """File-like writer that forwards to a pyarrow output stream while counting bytes and the CRC-32.

    Usable wherever pyarrow accepts a Python file object (``pyarrow.ipc.new_file``,
    ``pyarrow.parquet.write_table``) or directly with ``write``. It does not own ``sink``: closing it
    only marks it closed; the caller closes ``sink``.

    Parameters
    ----------
    sink : pyarrow.NativeFile
        Writable stream (``FileSystem.open_output_stream``).
    """

    def __init__(self, sink: pa.NativeFile) -> None:
        self._sink = sink
        self._crc = 0
        self._size = 0
        self.closed = False

    def write(self, data) -> int:
        """Write ``data`` (bytes-like or ``pyarrow.Buffer``); returns the number of bytes written."""
        view = memoryview(data)
        if view.nbytes:
            self._crc = zlib.crc32(view, self._crc)
            self._sink.write(view)
            self._size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def flush(self) -> None:
        """Flush the underlying stream."""
        self._sink.flush()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        """Mark closed; the underlying stream stays open."""
        self.closed = True

    @property
    def entry(self) -> FileEntry:
        """Size and checksum of everything written so far."""
        return FileEntry(size=self._size, crc32=crc32_hex(self._crc))


def checksum_stream(stream: pa.NativeFile) -> FileEntry:
    """Read a stream to its end and return its size and CRC-32.

    Parameters
    ----------
    stream : pyarrow.NativeFile
        Readable stream positioned at the start.

    Returns
    -------
    FileEntry
    """
    crc, size = 0, 0
    while True:
        chunk = stream.read_buffer(_CHUNK)
        if chunk.size == 0:
            break
        crc = zlib.crc32(chunk, crc)
        size += chunk.size
    return FileEntry(size=size, crc32=crc32_hex(crc))
