"""``Storage``: a pyarrow filesystem plus a root path, with retries and one behaviour on every backend.

Paths given to :class:`Storage` methods are *relative* to its root, use ``/`` as separator on every
platform, and may not contain ``..``; ``""`` is the root itself. Example::

    st = Storage.from_uri("s3://ckpt/ctr")          # or "hdfs://nn:8020/ckpt/ctr", "/data/ckpt/ctr"
    st.write_bytes("20240101/0100-delta/part-0.arrow", payload)
    st.listdir("20240101")                          # ['0100-delta']
    st.uri_of("20240101")                           # 's3://ckpt/ctr/20240101'

Directories on object stores
----------------------------
S3 has no directories, only keys. :class:`Storage` treats a directory as existing when at least one
object has it as a prefix (or :meth:`Storage.makedirs` left an empty ``dir/`` marker), on every
backend alike: :meth:`exists` and :meth:`listdir` agree, writing ``a/b/c`` makes ``a`` and ``a/b``
exist without an explicit :meth:`makedirs`, and :meth:`delete` of a directory removes everything
under it. The one difference callers may see: on a local disk or HDFS a directory emptied file by file
still exists, on S3 it vanishes.

Retries
-------
Every call that talks to the backend is retried on transient errors (see :mod:`hdfs_io.retry`) under
the storage's :class:`~hdfs_io.retry.RetryPolicy`; retries are logged and counted in
:attr:`Storage.retry_stats`. Whole operations are retried (open + write + close), so a write callback
passed to :meth:`write_with` may run more than once and must be repeatable. Streams returned by the
``open_*`` methods are retried only while opening.
"""
from __future__ import annotations

import errno
import logging
import os
import posixpath
from typing import Callable, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from hdfs_io.checksum import ChecksumWriter, FileEntry
from hdfs_io.errors import StorageUnavailableError
from hdfs_io.retry import RetryPolicy, RetryStats, call_with_retry
from hdfs_io.uri import StorageOptions, resolve

__all__ = ["Storage", "join"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Filesystems where "directories" are only key prefixes: never create parents before writing.
_OBJECT_STORE_TYPES = frozenset({"s3", "gcs", "abfs"})


def join(*parts: str) -> str:
    """Join relative path components with ``/``, ignoring empty parts and stray slashes.

    >>> join("20240101", "0100-delta/", "part-0.arrow")
    '20240101/0100-delta/part-0.arrow'
    >>> join("", "x")
    'x'
    """
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def _check_relative(path: str) -> str:
    if not isinstance(path, str):
        raise TypeError(f"expected a relative path string, got {type(path).__name__}")
    norm = path.strip("/") if path else ""
    if path.startswith("/"):
        raise ValueError(f"expected a path relative to the storage root, got absolute path {path!r}")
    if any(part in ("..", ".") for part in norm.split("/")) or "//" in norm or "\\" in norm:
        raise ValueError(f"expected a normalized relative path without '.', '..', '//' or '\\\\', got {path!r}")
    return norm


class Storage:
    """A filesystem rooted at a directory, with retries, consistent listing and URI-naming errors.

    Parameters
    ----------
    fs : pyarrow.fs.FileSystem
        Any pyarrow filesystem (local, S3, HDFS, or a ``PyFileSystem`` wrapper).
    root : str
        Root path inside ``fs`` (``"/abs/dir"`` locally, ``"bucket/prefix"`` on S3).
    uri : str or None
        URI shown in logs and errors; default ``root`` prefixed with the filesystem type.
    retry : RetryPolicy or None
        Backoff for transient errors; default :class:`RetryPolicy()`.
    retry_stats : RetryStats or None
        Counters to share between storages; a new one by default.
    """

    def __init__(
        self,
        fs: pafs.FileSystem,
        root: str,
        *,
        uri: str | None = None,
        retry: RetryPolicy | None = None,
        retry_stats: RetryStats | None = None,
    ) -> None:
        if not isinstance(fs, pafs.FileSystem):
            raise TypeError(f"expected a pyarrow.fs.FileSystem, got {type(fs).__name__}")
        self.fs = fs
        self.root = root.rstrip("/") if root not in ("", "/") else root
        if uri is None:
            uri = self.root if fs.type_name == "local" else f"{fs.type_name}://{self.root.lstrip('/')}"
        self.uri = uri.rstrip("/") if uri not in ("/",) else uri
        self.retry = retry or RetryPolicy()
        self.retry_stats = retry_stats or RetryStats()
        self._object_store = fs.type_name in _OBJECT_STORE_TYPES
        self._local = fs.type_name == "local"

    @classmethod
    def from_uri(
        cls,
        uri: str,
        *,
        storage_options: StorageOptions | None = None,
        retry: RetryPolicy | None = None,
    ) -> "Storage":
        """Open the storage rooted at ``uri`` (see :func:`hdfs_io.resolve` for the schemes).

        Raises
        ------
        ValueError
            Unsupported scheme or bad options.
        StorageUnavailableError
            Backend library or endpoint unavailable.
        """
        fs, path = resolve(uri, storage_options=storage_options)
        shown = uri if "://" in uri else path
        return cls(fs, path, uri=shown, retry=retry)

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    @property
    def is_local(self) -> bool:
        """True when the filesystem is pyarrow's ``LocalFileSystem`` (a mounted disk, NFS included):
        the one backend where :meth:`sync` does anything and :meth:`create_new` is atomic."""
        return self._local

    @property
    def is_object_store(self) -> bool:
        """True on an object store (S3, GCS, Azure): an object written appears whole at once."""
        return self._object_store

    # ---------------------------------------------------------------- paths

    join = staticmethod(join)

    def sub(self, path: str) -> "Storage":
        """A storage rooted at ``path`` below this root, sharing filesystem, policy and counters."""
        rel = _check_relative(path)
        return Storage(
            self.fs, self.full_path(rel), uri=self.uri_of(rel), retry=self.retry, retry_stats=self.retry_stats
        )

    def full_path(self, path: str = "") -> str:
        """Path inside :attr:`fs` for a path relative to the root."""
        rel = _check_relative(path)
        if not rel:
            return self.root
        return posixpath.join(self.root, rel) if self.root else rel

    def uri_of(self, path: str = "") -> str:
        """URI of a path relative to the root, for messages (``s3://bucket/root/path``)."""
        rel = _check_relative(path)
        if not rel:
            return self.uri
        return f"{self.uri}/{rel}" if not self.uri.endswith("/") else self.uri + rel

    # ---------------------------------------------------------------- plumbing

    def _retry(self, what: str, path: str, fn: Callable[[], T]) -> T:
        uri = self.uri_of(path)
        return call_with_retry(fn, policy=self.retry, what=f"{what} {uri}", stats=self.retry_stats, uri=uri)

    def _not_found(self, path: str, exc: BaseException | None = None) -> FileNotFoundError:
        err = FileNotFoundError(errno.ENOENT, "No such file or directory", self.uri_of(path))
        if exc is not None:
            err.__cause__ = exc
        return err

    def _discard(self, sink: pa.NativeFile, full: str) -> None:
        """Best-effort removal of a half-written file (pyarrow streams have no abort: closing an S3
        stream uploads what was written so far)."""
        try:
            sink.close()
        except Exception:  # noqa: BLE001 - the original error is what matters
            pass
        try:
            self.fs.delete_file(full)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not remove partial file %s after a failed write: %s", full, exc)

    def _ensure_parent(self, full: str) -> None:
        if not self._object_store:
            parent = posixpath.dirname(full)
            if parent:
                self.fs.create_dir(parent, recursive=True)

    # ---------------------------------------------------------------- metadata

    def info(self, path: str = "") -> pafs.FileInfo:
        """``pyarrow.fs.FileInfo`` of a path (type ``NotFound`` when absent; never raises for that)."""
        full = self.full_path(path)
        return self._retry("stat", path, lambda: self.fs.get_file_info(full))

    def newest_mtime(self, path: str = "") -> float | None:
        """Seconds since the epoch of the newest modification of ``path`` or anything below it (None:
        nothing there carries a time, e.g. absent).

        Raises
        ------
        OSError
            The listing failed (after the retries).
        """
        infos = [self.info(path)]
        full = self.full_path(path)
        infos += self._retry("list", path, lambda: self.fs.get_file_info(
            pafs.FileSelector(full, recursive=True, allow_not_found=True)))
        stamps = [i.mtime_ns for i in infos if i.mtime_ns is not None]
        return max(stamps) / 1e9 if stamps else None

    def clock_now(self, path: str = "") -> float:
        """The store's clock now, in seconds since the epoch: the modification time the store gives a
        probe file written at ``path/_clock-<random>`` (removed again). Compare ``newest_mtime`` with this,
        not with this host's ``time.time()``: the store's times come from the clock of whatever stamped
        them (S3's servers, an HDFS NameNode, an NFS server), which may be minutes from this host's
        (``engine.checkpoint.coordinator.INCOMPLETE_GRACE_S``). On a local file system it is this host's
        clock. Costs one write, one stat and one delete.

        Raises
        ------
        OSError
            The probe could not be written or stated (after the retries); a failed delete is logged only.
        """
        probe = posixpath.join(path, f"_clock-{os.urandom(6).hex()}")     # "" joins to the bare name
        self.write_bytes(probe, b"")
        try:
            info = self.info(probe)
            if info.mtime_ns is None:
                raise OSError(f"{self.uri_of(probe)}: the store gave the clock probe no modification time")
            return info.mtime_ns / 1e9
        finally:
            try:
                self.delete(probe, missing_ok=True)
            except OSError as exc:
                logger.warning("could not remove the clock probe %s: %s", self.uri_of(probe), exc)

    def exists(self, path: str = "") -> bool:
        """True when ``path`` is a file or a directory (on S3: any object has it as a prefix)."""
        return self.info(path).type != pafs.FileType.NotFound

    def is_file(self, path: str) -> bool:
        """True when ``path`` is a file."""
        return self.info(path).type == pafs.FileType.File

    def is_dir(self, path: str = "") -> bool:
        """True when ``path`` is a directory (on S3: a key prefix or a ``makedirs`` marker)."""
        return self.info(path).type == pafs.FileType.Directory

    def size(self, path: str) -> int:
        """Size of a file in bytes.

        Raises
        ------
        FileNotFoundError
            ``path`` does not exist.
        IsADirectoryError
            ``path`` is a directory.
        """
        info = self.info(path)
        if info.type == pafs.FileType.NotFound:
            raise self._not_found(path)
        if info.type != pafs.FileType.File:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", self.uri_of(path))
        return int(info.size)

    def listdir(self, path: str = "") -> list[str]:
        """Names of the direct children (files and directories) of ``path``, sorted.

        Raises
        ------
        FileNotFoundError
            ``path`` does not exist (on S3: no object has it as a prefix).
        NotADirectoryError
            ``path`` is a file.
        """
        return sorted(info.base_name for info in self.children(path))

    def children(self, path: str = "") -> list[pafs.FileInfo]:
        """``pyarrow.fs.FileInfo`` of the direct children of ``path`` (type, size, mtime), in the store's
        order. Raises as :meth:`listdir`."""
        full = self.full_path(path)

        def op() -> list[pafs.FileInfo]:
            return self.fs.get_file_info(pafs.FileSelector(full, recursive=False))

        try:
            infos = self._retry("list", path, op)
        except StorageUnavailableError:
            # the store did not answer through the retries: a stat would only wait them out a second time
            # (an unreachable S3 endpoint: 11 s more before the caller heard of it)
            raise
        except OSError as exc:
            # a file has no children: local/HDFS say "not a directory", S3 "no such prefix"
            if self.is_file(path):
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", self.uri_of(path)) from exc
            if isinstance(exc, FileNotFoundError):
                raise self._not_found(path, exc) from exc
            raise
        return infos

    # ---------------------------------------------------------------- mutation

    def makedirs(self, path: str = "") -> None:
        """Create ``path`` and its parents; no error when it exists.

        On S3 this writes an empty ``path/`` marker object so the empty directory is listable; it is not
        needed before writing files.
        """
        full = self.full_path(path)
        self._retry("makedirs", path, lambda: self.fs.create_dir(full, recursive=True))

    def delete(self, path: str, *, missing_ok: bool = False) -> None:
        """Delete a file, or a directory with everything below it.

        Parameters
        ----------
        path : str
            Relative path; the root itself (``""``) is refused.
        missing_ok : bool
            Return silently when ``path`` does not exist.

        Raises
        ------
        ValueError
            ``path`` is the storage root.
        FileNotFoundError
            ``path`` does not exist and ``missing_ok`` is false.
        """
        rel = _check_relative(path)
        if not rel:
            raise ValueError(f"refusing to delete the storage root {self.uri}; delete a path below it")
        full = self.full_path(rel)

        def op() -> bool:
            kind = self.fs.get_file_info(full).type
            if kind == pafs.FileType.NotFound:
                return False
            if kind == pafs.FileType.Directory:
                self.fs.delete_dir(full)
            else:
                self.fs.delete_file(full)
            return True

        try:
            deleted = self._retry("delete", rel, op)
        except FileNotFoundError:  # vanished between stat and delete (a concurrent cleaner)
            deleted = False
        if not deleted and not missing_ok:
            raise self._not_found(rel)
        if deleted:
            logger.debug("deleted %s", self.uri_of(rel))

    def move(self, src: str, dst: str) -> None:
        """Rename the file ``src`` to ``dst`` (both relative to the root), replacing a file at ``dst``.

        The way to publish a file written under a temporary name: readers see the old ``dst`` or the
        whole new one. Atomic on a local disk and HDFS (a rename); on S3 and other object stores it
        is a copy then a delete of ``src``, so readers still never see a partial object, but ``src``
        may outlive a failure. Retried as a whole on transient errors; an attempt finding ``src``
        gone and ``dst`` present (an earlier attempt moved it, then its answer was lost) succeeds.

        Parameters
        ----------
        src, dst : str
            Relative paths; ``dst``'s parent directories are created where directories exist.

        Raises
        ------
        ValueError
            ``src`` or ``dst`` is the storage root, or they are the same path.
        FileNotFoundError
            ``src`` does not exist (the message names its URI).
        IsADirectoryError
            ``src`` or ``dst`` is a directory.
        StorageUnavailableError
            Still failing transiently after the retry policy's attempts.
        """
        s, d = _check_relative(src), _check_relative(dst)
        if not s or not d:
            raise ValueError(f"cannot move the storage root {self.uri}: got src={src!r}, dst={dst!r}")
        if s == d:
            raise ValueError(f"move: source and destination are the same path, {self.uri_of(s)}")
        full_s, full_d = self.full_path(s), self.full_path(d)
        attempts = [0]

        def op() -> None:
            attempts[0] += 1
            kind = self.fs.get_file_info(full_s).type
            if kind == pafs.FileType.NotFound:
                if attempts[0] > 1 and self.fs.get_file_info(full_d).type == pafs.FileType.File:
                    return      # the previous attempt moved it but its answer was lost
                raise self._not_found(s)
            if kind == pafs.FileType.Directory:
                raise IsADirectoryError(errno.EISDIR, "move: source is a directory", self.uri_of(s))
            if self.fs.get_file_info(full_d).type == pafs.FileType.Directory:
                raise IsADirectoryError(errno.EISDIR, "move: destination is a directory", self.uri_of(d))
            self._ensure_parent(full_d)
            self.fs.move(full_s, full_d)

        self._retry("move", s, op)
        logger.debug("moved %s to %s", self.uri_of(s), self.uri_of(d))

    def sync(self, path: str = "") -> None:
        """Flush the file or directory ``path`` to stable storage, on a local filesystem only.

        Local disk: ``os.open(O_RDONLY)`` + ``os.fsync`` (works for files other processes wrote, since
        the page cache is shared). Syncing a file makes its *content* durable; syncing a directory makes
        the *entries* created in it (files, subdirectories) durable: a new file needs both.

        No-op elsewhere: an S3 (or other object store) object is durable once its PUT returned, and on
        HDFS a closed file is replicated to the datanodes (pyarrow exposes no ``hsync``), which this
        package accepts as its durability point there.

        Parameters
        ----------
        path : str
            Relative to the root; ``""`` is the root directory itself.

        Raises
        ------
        FileNotFoundError
            ``path`` does not exist (the message names its URI).
        OSError
            The fsync failed (``EIO``: the data may not be on disk); the message names the URI. A
            directory on a filesystem that cannot fsync directories (``EINVAL``) is skipped.
        """
        if not self._local:
            return
        full = self.full_path(path)
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:
            raise self._not_found(path, exc) from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno == errno.EINVAL and os.path.isdir(full):
                logger.debug("filesystem of %s cannot fsync a directory; skipped", self.uri_of(path))
                return
            raise OSError(exc.errno, f"fsync failed: {exc.strerror}", self.uri_of(path)) from exc
        finally:
            os.close(fd)

    def create_new(self, path: str, data: bytes | bytearray | memoryview | pa.Buffer) -> FileEntry:
        """Write ``data`` to ``path`` only if no file is there yet. Returns its size and CRC-32.

        Atomic on a local disk (``O_CREAT | O_EXCL``: of two writers racing, exactly one succeeds). On
        S3 and HDFS it is a check then a write: a writer racing in between is not detected. Not retried
        (a retry could not tell its own earlier file from someone else's); parent directories are
        created where directories exist. The content is not fsynced (see :meth:`sync`).

        Raises
        ------
        FileExistsError
            ``path`` already exists (the message names its URI).
        OSError
            Write failed; a partial local file is removed.
        """
        full = self.full_path(path)
        view = memoryview(data).cast("B")
        if not self._local:
            if self.exists(path):
                raise FileExistsError(errno.EEXIST, "File exists", self.uri_of(path))
            return self.write_bytes(path, view)
        self._ensure_parent(full)
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError as exc:
            raise FileExistsError(errno.EEXIST, "File exists", self.uri_of(path)) from exc
        try:
            with os.fdopen(fd, "wb", closefd=True) as f:
                out = ChecksumWriter(f)
                out.write(view)
        except BaseException:
            try:
                os.unlink(full)
            except OSError:
                pass
            raise
        return out.entry

    # ---------------------------------------------------------------- streams

    def open_output_stream(self, path: str) -> pa.NativeFile:
        """Open ``path`` for writing (truncating it), creating parent directories where they exist.

        The caller must close the stream; on S3 the object appears only at ``close()``. No compression
        is applied whatever the file extension. Only the open is retried.
        """
        full = self.full_path(path)

        def op() -> pa.NativeFile:
            self._ensure_parent(full)
            return self.fs.open_output_stream(full, compression=None)

        return self._retry("open for write", path, op)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        """Open ``path`` for sequential reading (no decompression). Only the open is retried.

        Raises
        ------
        FileNotFoundError
            ``path`` does not exist; the message names its URI.
        """
        full = self.full_path(path)
        try:
            return self._retry("open", path, lambda: self.fs.open_input_stream(full, compression=None))
        except FileNotFoundError as exc:
            raise self._not_found(path, exc) from exc

    def open_input_file(self, path: str) -> pa.NativeFile:
        """Open ``path`` for random access (seek/read_at; ranged GETs on S3). Only the open is retried.

        Raises
        ------
        FileNotFoundError
            ``path`` does not exist; the message names its URI.
        """
        full = self.full_path(path)
        try:
            return self._retry("open", path, lambda: self.fs.open_input_file(full))
        except FileNotFoundError as exc:
            raise self._not_found(path, exc) from exc

    # ---------------------------------------------------------------- whole files

    def write_with(self, path: str, writer: Callable[[ChecksumWriter], None]) -> FileEntry:
        """Write ``path`` by calling ``writer(out)`` with a checksumming file-like over the output stream.

        The whole open/write/close is retried on transient errors, so ``writer`` must be repeatable
        (write the same bytes each time it is called). When ``writer`` raises, the partial file is
        deleted (best effort) before the error propagates.

        Parameters
        ----------
        path : str
        writer : callable(ChecksumWriter) -> None
            Writes the content with ``out.write(bytes_like)`` or by handing ``out`` to pyarrow
            (``pyarrow.ipc.new_file(out, schema)``).

        Returns
        -------
        FileEntry
            Size in bytes and CRC-32 of what was written.
        """
        full = self.full_path(path)

        def op() -> FileEntry:
            self._ensure_parent(full)
            sink = self.fs.open_output_stream(full, compression=None)
            out = ChecksumWriter(sink)
            try:
                writer(out)
            except BaseException:
                self._discard(sink, full)
                raise
            sink.close()
            return out.entry

        return self._retry("write", path, op)

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview | pa.Buffer) -> FileEntry:
        """Write ``data`` to ``path``, replacing it. Returns its size and CRC-32 (retried as a whole)."""
        view = memoryview(data)
        return self.write_with(path, lambda out: out.write(view))

    def read_buffer(self, path: str) -> pa.Buffer:
        """Read the whole file into a ``pyarrow.Buffer`` (zero-copy into pyarrow readers).

        Raises
        ------
        FileNotFoundError
            ``path`` does not exist; the message names its URI.
        """
        full = self.full_path(path)

        def op() -> pa.Buffer:
            # A random-access file knows its size and reads it in one request; an input stream's
            # unbounded read_buffer() grows in small chunks (one ranged GET each on S3: ~50x slower).
            with self.fs.open_input_file(full) as f:
                return f.read_buffer()

        try:
            return self._retry("read", path, op)
        except FileNotFoundError as exc:
            raise self._not_found(path, exc) from exc

    def read_bytes(self, path: str) -> bytes:
        """Read the whole file as ``bytes`` (see :meth:`read_buffer` for large files)."""
        return self.read_buffer(path).to_pybytes()
