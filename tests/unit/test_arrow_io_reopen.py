"""``hdfs_io.arrow_io.open_ipc_batches`` of a checkpoint file over ``STREAM_MIN_BYTES`` (64 MiB, a real file of
that size on local disk) checks it in a streaming pass, then opens it again to read its footer. What that
second open meets is named as it is: a file replaced since the pass is "changed while read" (its size and
the manifest's), a file gone is a ``FileNotFoundError`` (the restore names it "listed in the manifest but
missing"). Before, every error of the second open, the open's own refusal included, read "not a readable
Arrow IPC file", as if the bytes were bad."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import hdfs_io
from hdfs_io import arrow_io


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """``(storage, its FileEntry, the file's bytes)``: 8 record batches of random uint64 (zstd cannot shrink
    them), just over 64 MiB."""
    storage = hdfs_io.Storage.from_uri(str(tmp_path_factory.mktemp("arrow_io_big") / "root"))
    rng = np.random.default_rng(0)
    rows = (arrow_io.STREAM_MIN_BYTES // 8) // 8 + 1024
    schema = pa.schema([("key", pa.uint64())])
    batches = [pa.record_batch([pa.array(rng.integers(0, 2**63, rows, dtype=np.uint64))], schema=schema)
               for _ in range(8)]
    entry = hdfs_io.write_ipc_file(storage, "part.arrow", batches, schema=schema, compression=None)
    assert entry.size >= arrow_io.STREAM_MIN_BYTES
    return storage, entry, storage.read_bytes("part.arrow")


def _after_the_pass(monkeypatch, then):
    """Run ``then()`` once ``open_ipc_batches``' checksum pass is done, before its second open."""
    real = arrow_io.checksum_stream

    def pass_then(f):
        out = real(f)
        then()
        return out
    monkeypatch.setattr(arrow_io, "checksum_stream", pass_then)


def test_a_large_file_checks_and_reads(big):
    storage, entry, _ = big
    got = arrow_io.open_ipc_batches(storage, "part.arrow", expected=entry)
    assert got.streamed and sum(b.num_rows for b in got) * 8 + 2000 > arrow_io.STREAM_MIN_BYTES


def test_a_large_file_replaced_after_its_check_is_named_changed_not_unreadable(big, monkeypatch):
    storage, entry, data = big
    uri = storage.uri_of("part.arrow")
    _after_the_pass(monkeypatch, lambda: storage.write_bytes("part.arrow", data[: len(data) // 2]))
    try:
        with pytest.raises(hdfs_io.CheckpointCorruptError) as err:
            arrow_io.open_ipc_batches(storage, "part.arrow", expected=entry)
    finally:
        storage.write_bytes("part.arrow", data)
    assert str(err.value) == (f"{uri}: size is {len(data) // 2} bytes, manifest says {entry.size} (changed while "
                              f"read)") and err.value.uri == uri
    assert "not a readable" not in str(err.value)


def test_a_large_file_removed_after_its_check_is_not_found_not_unreadable(big, monkeypatch):
    storage, entry, data = big
    _after_the_pass(monkeypatch, lambda: storage.delete("part.arrow"))
    try:
        with pytest.raises(FileNotFoundError) as err:
            arrow_io.open_ipc_batches(storage, "part.arrow", expected=entry)
    finally:
        storage.write_bytes("part.arrow", data)
    assert not isinstance(err.value, hdfs_io.CheckpointCorruptError), err.value
