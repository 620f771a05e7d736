"""URI to pyarrow filesystem, atomic publish with done markers, checkpoint manifests, retries.

Public API::

    resolve(uri, *, storage_options=None) -> (pyarrow.fs.FileSystem, path)
    StorageOptions(endpoint_override=, region=, access_key=, secret_key=, scheme=, ...)
    Storage(fs, root) / Storage.from_uri(uri)     exists, listdir, delete, makedirs, size, read/write
    RetryPolicy, RetryStats, is_transient
    Publisher(storage, dir, manifest=...)         data files → manifest.json → _SUCCESS
    publish_dir, is_complete, list_complete, read_manifest, file_entries, verify
    write_ipc_file, read_ipc_file                 zstd Arrow IPC, checksummed while written
    IpcFileWriter                                 the same, streamed batch by batch
    StorageError, StorageUnavailableError, CheckpointCorruptError, NotPublishedError
"""
from hdfs_io.arrow_io import IpcFileWriter, read_ipc_file, write_ipc_file
from hdfs_io.checksum import CHECKSUM_ALGORITHM, ChecksumWriter, FileEntry
from hdfs_io.errors import (
    PERMANENT_MARKER,
    CheckpointCorruptError,
    NotPublishedError,
    StorageError,
    StorageUnavailableError,
    described,
    permanent_failure,
    permanent_mark,
)
from hdfs_io.publish import (
    MANIFEST_NAME,
    SUCCESS_NAME,
    Publisher,
    file_entries,
    is_complete,
    list_complete,
    publish_dir,
    read_manifest,
    verify,
)
from hdfs_io.retry import RetryPolicy, RetryStats, is_transient
from hdfs_io.storage import Storage, join
from hdfs_io.uri import StorageOptions, clear_cache, resolve

__all__ = [
    "resolve",
    "clear_cache",
    "StorageOptions",
    "Storage",
    "join",
    "RetryPolicy",
    "RetryStats",
    "is_transient",
    "Publisher",
    "publish_dir",
    "is_complete",
    "list_complete",
    "read_manifest",
    "file_entries",
    "verify",
    "MANIFEST_NAME",
    "SUCCESS_NAME",
    "CHECKSUM_ALGORITHM",
    "FileEntry",
    "ChecksumWriter",
    "write_ipc_file",
    "IpcFileWriter",
    "read_ipc_file",
    "StorageError",
    "StorageUnavailableError",
    "CheckpointCorruptError",
    "NotPublishedError",
    "PERMANENT_MARKER",
    "described",
    "permanent_failure",
    "permanent_mark",
]
