"""Atomic publish of a directory on any backend, including object stores without rename.

Protocol (writer)::

    1. every data file          dir/part-0.arrow, dir/dense.arrow, ...
    2. dir/manifest.json        names, sizes and CRC-32 of every data file + caller metadata
    3. dir/_SUCCESS             empty marker, written last

Readers only ever consider a directory whose ``_SUCCESS`` exists (:func:`is_complete`,
:func:`list_complete`); a writer that crashes anywhere before step 3 leaves a directory that does not
exist for them. Each step is one ``PUT`` on S3 (an object appears whole at close), so no rename is
needed. ``manifest.json`` then lets a reader check the data it reads (:func:`verify`).

Durability (local disk only). On a local filesystem :meth:`Publisher.commit` fsyncs, in this order:
every data file the manifest lists and every subdirectory holding them; ``manifest.json`` and the
directory (its entries: the data files' and the manifest's, in one fsync); then ``_SUCCESS``, the directory and each of its ancestors up to the storage root (the new
directory entries). A power loss can therefore never leave ``_SUCCESS`` next to an empty part file or
manifest. S3 needs nothing (an object is durable once its PUT returned); HDFS is left to its close
semantics (replicated to the datanodes' memory; pyarrow has no ``hsync``), so a whole-cluster power
loss may still lose a just-published HDFS directory.

Ownership. :meth:`Publisher.commit` refuses (:class:`~hdfs_io.CheckpointCorruptError`, nothing
marked complete) when another writer published the directory meanwhile (``_SUCCESS`` exists), when
``manifest.json`` is already there or was replaced (another writer's commit), or when a file it
wrote is missing or has another size (deleted or rewritten by another writer or a retention pass).
On a local disk ``manifest.json`` is created with ``O_EXCL``, so of two writers committing the same
directory at most one gets past it; on S3/HDFS the checks narrow the race but cannot close it (no
conditional PUT through pyarrow), so give concurrent writers distinct directories.

``manifest.json`` (worked example)::

    {
      "manifest_version": 1,
      "checksum": "crc32",
      "created_unix_s": 1704067200.0,
      "files": {
        "dense.arrow":  {"size": 1032, "crc32": "9a0b11c2"},
        "part-0.arrow": {"size": 48211, "crc32": "0f3e77d1"}
      },
      "parent": "20240101/0000-base",       <- caller metadata, merged at top level
      "hash_version": 1
    }

Usage::

    with Publisher(storage, "20240101/0100-delta", manifest={"hash_version": 1}) as pub:
        pub.write_table("part-0.arrow", table)        # zstd Arrow IPC, checksummed while written
        pub.write_bytes("notes.txt", b"...")
        pub.manifest["rows"] = 123                    # metadata may be added until the block ends
    # leaving the block normally writes manifest.json then _SUCCESS; an exception writes neither
"""
from __future__ import annotations

import errno
import json
import logging
import posixpath
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import pyarrow as pa
import pyarrow.fs as pafs

from hdfs_io.arrow_io import ArrowData, write_ipc_file
from hdfs_io.checksum import CHECKSUM_ALGORITHM, ChecksumWriter, FileEntry, checksum_stream
from hdfs_io.errors import CheckpointCorruptError, NotPublishedError
from hdfs_io.storage import Storage, _check_relative, join

__all__ = [
    "MANIFEST_NAME",
    "SUCCESS_NAME",
    "MANIFEST_VERSION",
    "Publisher",
    "publish_dir",
    "is_complete",
    "list_complete",
    "read_manifest",
    "file_entries",
    "verify",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SUCCESS_NAME = "_SUCCESS"
MANIFEST_VERSION = 1
_RESERVED_KEYS = frozenset({"manifest_version", "checksum", "created_unix_s", "files"})
_VERIFY_THREADS = 8

FileSource = bytes | bytearray | memoryview | pa.Buffer | Callable[[ChecksumWriter], None]


class Publisher:
    """Context manager that publishes one directory atomically (see module docstring).

    Parameters
    ----------
    storage : Storage
    dir : str
        Directory to publish, relative to ``storage``'s root.
    manifest : mapping or None
        Caller metadata stored at the top level of ``manifest.json`` (JSON-serializable; the keys
        ``manifest_version``, ``checksum``, ``created_unix_s`` and ``files`` are reserved). Also
        editable through :attr:`manifest` until the block ends.
    overwrite : bool
        Replace an already published directory (its ``_SUCCESS`` is removed first, so readers stop
        seeing it before anything else changes). Without it, publishing over a complete directory
        raises ``FileExistsError``.

    Raises
    ------
    FileExistsError
        On enter, when ``dir`` is already published and ``overwrite`` is false.
    ValueError
        Reserved manifest key, bad or duplicate file name.

    Notes
    -----
    Leftovers of an earlier crashed attempt (``dir`` without ``_SUCCESS``) are deleted on enter.
    Files are written one after the other; the publisher is not thread-safe.
    """

    def __init__(
        self,
        storage: Storage,
        dir: str,
        *,
        manifest: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        self.storage = storage
        self.dir = _check_relative(dir)
        if not self.dir:
            raise ValueError(f"expected a directory below the storage root {storage.uri}, got {dir!r}")
        self.manifest: dict[str, Any] = dict(manifest or {})
        self.overwrite = overwrite
        self.entries: dict[str, FileEntry] = {}
        self.written_manifest: dict[str, Any] | None = None  # set by commit()
        self._state = "new"
        # (manifest, payload) once this publisher created manifest.json: a commit() retried after a
        # failure past that point finishes with the same bytes instead of refusing its own manifest
        self._created: tuple[dict[str, Any], bytes] | None = None

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Publisher":
        self._check_manifest_keys()
        uri = self.storage.uri_of(self.dir)
        if is_complete(self.storage, self.dir):
            if not self.overwrite:
                raise FileExistsError(errno.EEXIST, "already published (pass overwrite=True to replace)", uri)
            logger.info("overwriting published directory %s", uri)
            self.storage.delete(join(self.dir, SUCCESS_NAME), missing_ok=True)
            self.storage.delete(self.dir, missing_ok=True)
        elif self.storage.exists(self.dir):
            logger.warning("removing leftovers of an incomplete publish at %s", uri)
            self.storage.delete(self.dir, missing_ok=True)
        self._state = "open"
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._state = "aborted"
            logger.warning(
                "publish of %s aborted by %s: %d file(s) written, no manifest, no %s",
                self.storage.uri_of(self.dir), exc_type.__name__, len(self.entries), SUCCESS_NAME,
            )
            return False
        self.commit()
        return False

    def commit(self) -> dict[str, Any]:
        """Write ``manifest.json`` then ``_SUCCESS``; called by a normal exit of the ``with`` block.

        Steps: refuse if the directory was published meanwhile or a listed file is missing or has
        another size; fsync the data files and their subdirectories (local disk only); create ``manifest.json`` (exclusively on a local disk) and fsync
        it and the directory (all its entries: the data files' and the manifest's); check that ``manifest.json`` is still ours and every file it lists is
        there with its listed size (one metadata call per file, no data read); refuse again if
        ``_SUCCESS`` appeared; write ``_SUCCESS`` and fsync it, the directory and its ancestors up to
        the storage root. See the module docstring for what is (not) guaranteed on S3 and HDFS.

        Returns
        -------
        dict
            The manifest as written.

        Raises
        ------
        CheckpointCorruptError
            The directory is no longer this publisher's: already published by someone else
            (``_SUCCESS`` or another ``manifest.json`` there; ``uri`` is the directory), or a listed
            file is missing or has another size (``uri`` and the message name the first such file in
            name order). ``_SUCCESS`` is not written; what is in the directory is left as found.
        ValueError
            The manifest is not JSON-serializable, or uses a reserved key.
        OSError
            Storage failures, including a failed fsync (the data may not be on disk).
        """
        self._require_open()
        self._check_manifest_keys()
        if self._created is not None:
            return self._finish(*self._created)
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "checksum": CHECKSUM_ALGORITHM,
            "created_unix_s": time.time(),
            "files": {name: self.entries[name].to_json() for name in sorted(self.entries)},
            **self.manifest,
        }
        try:
            payload = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"manifest for {self.storage.uri_of(self.dir)} is not JSON-serializable: {exc}") from exc
        st = self.storage
        manifest_path = join(self.dir, MANIFEST_NAME)
        self._refuse_if_published()
        for name, problem in _check_files(st, self.dir, self.entries, checksums=False):
            raise self._conflict(name, problem)     # before writing anything: leave the directory as found
        self._sync_data_files()
        try:
            st.create_new(manifest_path, payload)
        except FileExistsError as exc:
            uri = st.uri_of(self.dir)
            raise CheckpointCorruptError(
                f"refusing to publish {uri}: {MANIFEST_NAME} is already there, so another writer is "
                f"committing or has committed this directory since this publisher started; nothing "
                f"was written by this commit", uri=uri,
            ) from exc
        self._created = manifest, payload
        return self._finish(manifest, payload)

    def _finish(self, manifest: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """The steps of ``commit`` after this publisher created ``manifest.json`` (``payload``)."""
        st = self.storage
        st.sync(join(self.dir, MANIFEST_NAME))
        st.sync(self.dir)
        self._check_still_ours(payload)
        self._refuse_if_published()
        st.write_bytes(join(self.dir, SUCCESS_NAME), b"")
        st.sync(join(self.dir, SUCCESS_NAME))
        st.sync(self.dir)
        parent = self.dir
        while parent:       # the new directory entries up to the storage root
            parent = posixpath.dirname(parent)
            st.sync(parent)
        self._state = "committed"
        self.written_manifest = manifest
        logger.info(
            "published %s: %d file(s), %d bytes",
            st.uri_of(self.dir), len(self.entries), sum(e.size for e in self.entries.values()),
        )
        return manifest

    # ------------------------------------------------------------ commit checks

    def _refuse_if_published(self) -> None:
        if is_complete(self.storage, self.dir):
            uri = self.storage.uri_of(self.dir)
            raise CheckpointCorruptError(
                f"refusing to publish {uri}: it was published by another writer while this publisher was "
                f"writing it ({SUCCESS_NAME} exists); this publisher's files may have been replaced", uri=uri,
            )

    def _conflict(self, name: str, problem: str) -> CheckpointCorruptError:
        uri = self.storage.uri_of(join(self.dir, name))
        return CheckpointCorruptError(
            f"refusing to publish {self.storage.uri_of(self.dir)}: {uri}: {problem} (deleted or rewritten "
            f"by another writer or a retention pass since this publisher wrote it)", uri=uri,
        )

    def _sync_data_files(self) -> None:
        """fsync every listed file, then every subdirectory holding one (deepest first); local disk only."""
        st = self.storage
        if not st.is_local or not self.entries:
            return
        names = sorted(self.entries)
        dirs: set[str] = set()
        for name in names:
            d = posixpath.dirname(name)
            while d:
                dirs.add(d)
                d = posixpath.dirname(d)

        def sync(name: str) -> str | None:
            try:
                st.sync(join(self.dir, name))
            except FileNotFoundError:
                return name
            return None

        with ThreadPoolExecutor(max_workers=min(_VERIFY_THREADS, len(names))) as pool:
            missing = [n for n in pool.map(sync, names) if n is not None]
        if missing:
            raise self._conflict(missing[0], "listed in the manifest but missing")
        for d in sorted(dirs, key=lambda p: (-p.count("/"), p)):
            try:
                st.sync(join(self.dir, d))
            except FileNotFoundError:
                raise self._conflict(d, "directory holding listed files is missing") from None
        # ``self.dir`` itself is fsynced once ``manifest.json`` is in it (``_finish``): one fsync of a
        # directory makes all its entries durable, the data files' and subdirectories' with the
        # manifest's, before ``_SUCCESS`` exists. Synced here too, it was fsynced three times a publish.

    def _check_still_ours(self, payload: bytes) -> None:
        """Our manifest is in place and, on a local disk, every file it lists has its listed size (on
        S3/HDFS the check before the manifest stands: one HEAD per file per commit is enough there)."""
        try:
            on_disk = self.storage.read_bytes(join(self.dir, MANIFEST_NAME))
        except FileNotFoundError:
            on_disk = None
        if on_disk != payload:
            raise self._conflict(MANIFEST_NAME, "missing" if on_disk is None else "replaced by another writer's")
        if not self.storage.is_local:
            return
        for name, problem in _check_files(self.storage, self.dir, self.entries, checksums=False):
            raise self._conflict(name, problem)

    # ------------------------------------------------------------ writing files

    def write_bytes(self, name: str, data: bytes | bytearray | memoryview | pa.Buffer) -> FileEntry:
        """Write one data file from memory (retried as a whole). Returns its manifest entry."""
        path = self._claim(name)
        return self._record(name, self.storage.write_bytes(path, data))

    def write_with(self, name: str, writer: Callable[[ChecksumWriter], None]) -> FileEntry:
        """Write one data file with a repeatable callback (see :meth:`Storage.write_with`)."""
        path = self._claim(name)
        return self._record(name, self.storage.write_with(path, writer))

    def write_table(
        self, name: str, data: ArrowData, *, schema: pa.Schema | None = None, compression: str | None = "zstd"
    ) -> FileEntry:
        """Write one Arrow IPC file (zstd by default), checksummed while written."""
        path = self._claim(name)
        return self._record(name, write_ipc_file(self.storage, path, data, schema=schema, compression=compression))

    @contextmanager
    def open(self, name: str) -> Iterator[ChecksumWriter]:
        """Stream one data file: ``with pub.open("x.bin") as out: out.write(...)``.

        Not retried (a stream cannot be replayed); prefer :meth:`write_with` when the content can be
        produced twice.
        """
        path = self._claim(name)
        sink = self.storage.open_output_stream(path)
        out = ChecksumWriter(sink)
        try:
            yield out
        except BaseException:
            self.storage._discard(sink, self.storage.full_path(path))
            raise
        sink.close()
        self._record(name, out.entry)

    # ------------------------------------------------------------ helpers

    def _require_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"publisher for {self.storage.uri_of(self.dir)} is {self._state}, not open")

    def _check_manifest_keys(self) -> None:
        clash = sorted(_RESERVED_KEYS & set(self.manifest))
        if clash:
            raise ValueError(f"manifest key {clash[0]!r} is reserved; use another name")

    def _claim(self, name: str) -> str:
        self._require_open()
        rel = _check_relative(name)
        if not rel or rel in (MANIFEST_NAME, SUCCESS_NAME):
            raise ValueError(f"expected a data file name other than {MANIFEST_NAME}/{SUCCESS_NAME}, got {name!r}")
        if rel in self.entries:
            raise ValueError(f"file {rel!r} already written to {self.storage.uri_of(self.dir)}")
        return join(self.dir, rel)

    def _record(self, name: str, entry: FileEntry) -> FileEntry:
        self.entries[_check_relative(name)] = entry
        return entry


def publish_dir(
    storage: Storage,
    dir: str,
    files: Mapping[str, FileSource],
    manifest: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Publish ``files`` into ``dir`` atomically: data files, then ``manifest.json``, then ``_SUCCESS``.

    Parameters
    ----------
    storage : Storage
    dir : str
        Relative to ``storage``'s root.
    files : mapping of str to bytes-like or callable(ChecksumWriter) -> None
        File name (may contain ``/``) to content, or to a repeatable writer callback.
    manifest : mapping or None
        Caller metadata (see :class:`Publisher`).
    overwrite : bool
        Replace an already published ``dir``.

    Returns
    -------
    dict
        The manifest as written.

    Raises
    ------
    FileExistsError, ValueError, OSError
        See :class:`Publisher` and :class:`Storage`.
    """
    with Publisher(storage, dir, manifest=manifest, overwrite=overwrite) as pub:
        for name, source in files.items():
            if callable(source):
                pub.write_with(name, source)
            else:
                pub.write_bytes(name, source)
    return pub.written_manifest


def is_complete(storage: Storage, dir: str) -> bool:
    """True when ``dir/_SUCCESS`` exists: the directory is published and may be read."""
    return storage.is_file(join(_check_relative(dir), SUCCESS_NAME))


def list_complete(storage: Storage, parent: str = "") -> list[str]:
    """Names of the published child directories of ``parent``, sorted; ``[]`` when ``parent`` is absent.

    Children without ``_SUCCESS`` (in progress, or left by a crash) are skipped.
    """
    try:
        names = storage.listdir(parent)
    except FileNotFoundError:
        return []
    return [n for n in names if n not in (SUCCESS_NAME, MANIFEST_NAME) and is_complete(storage, join(parent, n))]


def read_manifest(storage: Storage, dir: str, *, require_complete: bool = True) -> dict[str, Any]:
    """Read and validate ``dir/manifest.json``.

    Parameters
    ----------
    storage : Storage
    dir : str
    require_complete : bool
        Refuse a directory without ``_SUCCESS`` (default). ``False`` is for debugging leftovers.

    Returns
    -------
    dict
        The manifest; ``manifest["files"]`` maps names to ``{"size", "crc32"}`` (see :func:`file_entries`).

    Raises
    ------
    NotPublishedError
        ``dir`` has no ``_SUCCESS`` and ``require_complete`` is true.
    CheckpointCorruptError
        ``manifest.json`` is missing, not JSON, or malformed; the message names it.
    """
    dir = _check_relative(dir)
    if require_complete and not is_complete(storage, dir):
        uri = storage.uri_of(dir)
        raise NotPublishedError(f"{uri} is not published: no {SUCCESS_NAME} marker (incomplete or in progress)", uri=uri)
    path = join(dir, MANIFEST_NAME)
    uri = storage.uri_of(path)
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{uri} is missing", uri=uri) from exc
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{uri} is not valid JSON: {exc}", uri=uri) from exc
    if not isinstance(manifest, dict):
        raise CheckpointCorruptError(f"{uri}: expected a JSON object, got {type(manifest).__name__}", uri=uri)
    version = manifest.get("manifest_version")
    if version != MANIFEST_VERSION:
        raise CheckpointCorruptError(f"{uri}: expected manifest_version {MANIFEST_VERSION}, got {version!r}", uri=uri)
    if manifest.get("checksum") != CHECKSUM_ALGORITHM:
        raise CheckpointCorruptError(
            f"{uri}: expected checksum {CHECKSUM_ALGORITHM!r}, got {manifest.get('checksum')!r}", uri=uri
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointCorruptError(f"{uri}: expected 'files' to be an object, got {files!r}", uri=uri)
    for name, entry in files.items():
        try:
            _check_relative(name)
            FileEntry.from_json(entry)
        except (TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{uri}: bad entry for file {name!r}: {exc}", uri=uri) from exc
    return manifest


def file_entries(manifest: Mapping[str, Any]) -> dict[str, FileEntry]:
    """Typed view of ``manifest["files"]`` (name → :class:`FileEntry`), sorted by name."""
    return {name: FileEntry.from_json(e) for name, e in sorted(manifest["files"].items())}


def verify(storage: Storage, dir: str, *, checksums: bool = True) -> dict[str, Any]:
    """Check that every file listed in the manifest of a published ``dir`` is intact.

    Sizes come from one metadata call per file; with ``checksums`` every file is also read once (up to
    8 files concurrently) and its CRC-32 compared.

    Parameters
    ----------
    storage : Storage
    dir : str
    checksums : bool
        Also compare CRC-32 (reads all data); ``False`` checks presence and size only.

    Returns
    -------
    dict
        The manifest.

    Raises
    ------
    NotPublishedError
        No ``_SUCCESS`` marker.
    CheckpointCorruptError
        Manifest invalid, or a listed file is missing, has another size, or another checksum; the
        message names the first bad file in name order.
    """
    manifest = read_manifest(storage, dir)
    problems = _check_files(storage, dir, file_entries(manifest), checksums=checksums)
    for name, problem in problems:
        uri = storage.uri_of(join(dir, name))
        raise CheckpointCorruptError(f"{uri}: {problem}", uri=uri)
    logger.debug("verified %s: %d file(s)", storage.uri_of(dir), len(manifest["files"]))
    return manifest


def _check_files(
    storage: Storage, dir: str, entries: Mapping[str, FileEntry], *, checksums: bool
) -> list[tuple[str, str]]:
    """``(name, problem)`` for every file of ``entries`` (below ``dir``) that is missing, not a file, of
    another size or (with ``checksums``) another CRC-32, in name order; ``[]`` when all are intact.
    Up to 8 files are checked concurrently."""

    def check(name: str) -> str | None:
        path = join(dir, name)
        info = storage.info(path)
        if info.type == pafs.FileType.NotFound:
            return "listed in the manifest but missing"
        if info.type != pafs.FileType.File:
            return "listed in the manifest as a file but is a directory"
        expected = entries[name]
        if info.size != expected.size:
            return f"size is {info.size} bytes, manifest says {expected.size} (truncated or overwritten)"
        if checksums:
            with storage.open_input_stream(path) as stream:
                got = checksum_stream(stream)
            if got.size != expected.size:
                return f"read {got.size} bytes, manifest says {expected.size} (truncated)"
            if got.crc32 != expected.crc32:
                return f"crc32 is {got.crc32}, manifest says {expected.crc32} (corrupt file)"
        return None

    names = sorted(entries)
    if len(names) > 1:
        with ThreadPoolExecutor(max_workers=min(_VERIFY_THREADS, len(names))) as pool:
            problems = list(pool.map(check, names))
    else:
        problems = [check(n) for n in names]
    return [(n, p) for n, p in zip(names, problems) if p is not None]
