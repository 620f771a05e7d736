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

import errno as _errno
import re

__all__ = [
    "StorageError",
    "StorageUnavailableError",
    "CheckpointCorruptError",
    "NotPublishedError",
    "PERMANENT_ERRNOS",
    "PERMANENT_MARKER",
    "described",
    "permanent_failure",
    "permanent_mark",
]

#: errnos of a storage that refuses a write for good: a read-only file system, access refused, a full disk
#: or quota. Neither ``hdfs_io``'s retries nor a restart of the job mend them (a full disk stays full: the
#: job frees nothing before its next save, whose retention runs only once that save is published)
PERMANENT_ERRNOS = frozenset(getattr(_errno, n) for n in ("EROFS", "EACCES", "EPERM", "ENOSPC", "EDQUOT")
                             if hasattr(_errno, n))
#: how a message that crossed a process boundary (a server's reply) says so: ``[MARKER: EROFS]``
PERMANENT_MARKER = "permanent storage failure"
_MARKED = re.compile(re.escape(PERMANENT_MARKER) + r": (E[A-Z]+)")
#: what S3 (through pyarrow, which gives no errno) says when it refuses the job's credentials or a policy
#: refuses the request: no retry and no restart with the same settings mends it (``permanent_failure``
#: names it ``EACCES``)
S3_REFUSED = re.compile(r"ACCESS_DENIED|AccessDenied|INVALID_ACCESS_KEY_ID|InvalidAccessKeyId|SIGNATURE_DOES_NOT_MATCH"
                        r"|SignatureDoesNotMatch|EXPIRED_TOKEN|ExpiredToken|InvalidToken")
# (not a bare HTTP 403: S3's RequestTimeTooSkewed is a 403 too, and a restart after the clock is set mends it)


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


def permanent_failure(exc: BaseException) -> str | None:
    """The errno name (``"EROFS"``, ``"EACCES"``, ``"EPERM"``, ``"ENOSPC"``, ``"EDQUOT"``) when ``exc``, or an
    exception it was raised from (``__cause__`` / ``__context__``, at most 8 deep), is an ``OSError`` with
    one of ``PERMANENT_ERRNOS`` or a message marked ``[PERMANENT_MARKER: NAME]``; ``"EACCES"`` for an
    ``OSError`` in which S3 refuses the credentials or the request (``S3_REFUSED``: AccessDenied, an
    unknown or expired key, a bad signature; pyarrow gives those no errno); else None (a network failure,
    a missing file, anything a later attempt may not meet again).

    >>> permanent_failure(OSError(30, "Read-only file system"))
    'EROFS'
    >>> permanent_failure(RuntimeError("save failed [permanent storage failure: ENOSPC]"))
    'ENOSPC'
    >>> permanent_failure(ConnectionRefusedError(111, "refused")) is None
    True
    >>> permanent_failure(OSError("AWS Error ACCESS_DENIED during HeadObject operation"))
    'EACCES'
    >>> permanent_failure(OSError("HTTP status 403: RequestTimeTooSkewed")) is None    # a clock set mends it
    True
    """
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        code = getattr(seen, "errno", None)
        if isinstance(seen, OSError) and code in PERMANENT_ERRNOS:
            return _errno.errorcode[code]
        m = _MARKED.search(str(seen))
        if m is not None:
            return m.group(1)
        if isinstance(seen, OSError) and S3_REFUSED.search(str(seen)):
            return "EACCES"
        seen = seen.__cause__ or seen.__context__
    return None


def permanent_mark(exc: BaseException) -> str:
    """`` [PERMANENT_MARKER: NAME]`` for a message about ``exc`` when ``permanent_failure`` names it, else
    ""."""
    name = permanent_failure(exc)
    return f" [{PERMANENT_MARKER}: {name}]" if name else ""


def described(exc: BaseException) -> str:
    """``exc``'s message with its notes (``add_note``: ``hdfs_io`` names the operation and the file's URI
    there; pyarrow's own message names neither): ``[Errno 28] Error writing bytes to file (writing
    /ckpt/.../g03-s0000-j01.arrow; base of table 'emb' shard 1 to /ckpt/...)``.

    >>> e = OSError("Error writing bytes"); e.add_note("writing /ckpt/a.arrow"); described(e)
    'Error writing bytes (writing /ckpt/a.arrow)'
    """
    notes = [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str)]
    return f"{exc} ({'; '.join(notes)})" if notes else str(exc)
