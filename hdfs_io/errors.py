"""Typed storage errors.

Every error is an ``OSError`` so code that already handles I/O failures keeps working, and every message
names the URI (or the file inside a published directory) it is about, so a log line is enough to find the
object on HDFS/S3/disk.

Hierarchy::

    OSError
    └── StorageError                     any failure this package reports itself
        ├── StorageUnavailableError      backend cannot be reached or is not installed (libhdfs, no endpoint)
        ├── CheckpointCorruptError       published data does not match its manifest (missing/short/bad file)
        └── NotPublishedError            directory has no ``_SUCCESS`` marker (also a FileNotFoundError)
"""
from __future__ import annotations

__all__ = [
    "StorageError",
    "StorageUnavailableError",
    "CheckpointCorruptError",
    "NotPublishedError",
]


class StorageError(OSError):
    """Base class of the errors raised by :mod:`hdfs_io`.

    Parameters
    ----------
    message : str
        Human-readable description; should already contain the URI.
    uri : str or None
        The URI (``s3://bucket/key``, ``hdfs://nn/path``, ``/local/path``) the error is about.
    """

    def __init__(self, message: str, *, uri: str | None = None) -> None:
        super().__init__(message)
        self.uri = uri

    def __reduce__(self):  # keep the error picklable across processes (launcher, workers)
        return (_rebuild, (type(self), str(self), self.uri))


def _rebuild(cls: type, message: str, uri: str | None) -> StorageError:
    return cls(message, uri=uri)


class StorageUnavailableError(StorageError):
    """The storage backend cannot be used at all.

    Raised when the client library is missing (no ``libhdfs``/JVM for ``hdfs://``), or when an endpoint
    stays unreachable after every retry. Retrying the same call immediately will not help.
    """


class CheckpointCorruptError(StorageError):
    """A published directory is damaged: its manifest is missing or invalid, or a file it lists is
    missing, has the wrong size (truncated) or the wrong checksum.

    ``uri`` names the offending file, not just the directory.
    """


class NotPublishedError(StorageError, FileNotFoundError):
    """A directory was read as published but has no ``_SUCCESS`` marker.

    By the publish contract such a directory does not exist yet (it is being written, or its writer
    crashed), hence this is also a ``FileNotFoundError``.
    """
