"""Storage contract: the same behaviour on the local filesystem, S3 (moto) and HDFS (when configured)."""
from __future__ import annotations

import os

import pyarrow as pa
import pytest

import hdfs_io
from hdfs_io import Storage


def test_fresh_root_does_not_exist(storage: Storage):
    assert not storage.exists()
    assert not storage.exists("a")
    with pytest.raises(FileNotFoundError):
        storage.listdir()


def test_write_read_roundtrip(storage: Storage):
    payload = os.urandom(100_000)
    entry = storage.write_bytes("x/y/data.bin", payload)
    assert entry == hdfs_io.FileEntry.of_bytes(payload)
    assert storage.read_bytes("x/y/data.bin") == payload
    assert storage.read_buffer("x/y/data.bin").to_pybytes() == payload
    assert storage.size("x/y/data.bin") == len(payload)


def test_write_replaces_content(storage: Storage):
    storage.write_bytes("f", b"first version")
    storage.write_bytes("f", b"2nd")
    assert storage.read_bytes("f") == b"2nd"
    assert storage.size("f") == 3


def test_empty_file(storage: Storage):
    storage.write_bytes("empty", b"")
    assert storage.is_file("empty")
    assert storage.size("empty") == 0
    assert storage.read_bytes("empty") == b""


def test_extension_does_not_trigger_compression(storage: Storage):
    # pyarrow's default compression="detect" would gzip "*.gz"; storage writes bytes as given.
    storage.write_bytes("raw.gz", b"not gzip")
    assert storage.read_bytes("raw.gz") == b"not gzip"


def test_parents_exist_after_writing_a_file(storage: Storage):
    storage.write_bytes("a/b/c.bin", b"1")
    assert storage.exists()
    assert storage.is_dir("a")
    assert storage.is_dir("a/b")
    assert storage.is_file("a/b/c.bin")
    assert not storage.is_dir("a/b/c.bin")
    assert not storage.exists("a/b/c")
    assert not storage.exists("a/bb")


def test_listdir_direct_children_sorted(storage: Storage):
    for name in ["b.bin", "a.bin", "d/x.bin", "c/deeper/y.bin", "_SUCCESS"]:
        storage.write_bytes(name, b"z")
    assert storage.listdir() == ["_SUCCESS", "a.bin", "b.bin", "c", "d"]
    assert storage.listdir("c") == ["deeper"]
    assert storage.listdir("c/deeper") == ["y.bin"]


def test_listdir_missing_and_file(storage: Storage):
    storage.write_bytes("f.bin", b"1")
    with pytest.raises(FileNotFoundError) as err:
        storage.listdir("nope")
    assert storage.uri_of("nope") in str(err.value)
    with pytest.raises(NotADirectoryError):
        storage.listdir("f.bin")


def test_makedirs_makes_an_empty_dir_visible(storage: Storage):
    storage.makedirs("empty/inner")
    storage.makedirs("empty/inner")  # idempotent
    assert storage.is_dir("empty")
    assert storage.is_dir("empty/inner")
    assert storage.listdir("empty") == ["inner"]
    assert storage.listdir("empty/inner") == []


def test_delete_file(storage: Storage):
    storage.write_bytes("d/keep.bin", b"1")
    storage.write_bytes("d/gone.bin", b"2")
    storage.delete("d/gone.bin")
    assert not storage.exists("d/gone.bin")
    assert storage.listdir("d") == ["keep.bin"]


def test_delete_dir_recursively(storage: Storage):
    for name in ["ckpt/1/a", "ckpt/1/sub/b", "ckpt/2/c", "ckpt10/d"]:
        storage.write_bytes(name, b"x")
    storage.delete("ckpt/1")
    assert not storage.exists("ckpt/1")
    assert not storage.exists("ckpt/1/sub/b")
    assert storage.listdir("ckpt") == ["2"]
    storage.delete("ckpt")
    assert not storage.exists("ckpt")
    assert storage.read_bytes("ckpt10/d") == b"x"  # a sibling sharing the name prefix survives
    assert storage.listdir() == ["ckpt10"]


def test_delete_missing(storage: Storage):
    with pytest.raises(FileNotFoundError) as err:
        storage.delete("missing")
    assert storage.uri_of("missing") in str(err.value)
    storage.delete("missing", missing_ok=True)


def test_delete_root_refused(storage: Storage):
    storage.write_bytes("a", b"1")
    with pytest.raises(ValueError, match="root"):
        storage.delete("")
    assert storage.exists("a")


def test_missing_file_errors_name_the_uri(storage: Storage):
    for call in (storage.read_bytes, storage.open_input_stream, storage.open_input_file, storage.size):
        with pytest.raises(FileNotFoundError) as err:
            call("nope/file.bin")
        assert storage.uri_of("nope/file.bin") in str(err.value)


def test_size_of_dir_is_an_error(storage: Storage):
    storage.write_bytes("d/f", b"1")
    with pytest.raises(IsADirectoryError):
        storage.size("d")


def test_streams(storage: Storage):
    with storage.open_output_stream("s/stream.bin") as out:
        for i in range(10):
            out.write(bytes([i]) * 1000)
    with storage.open_input_stream("s/stream.bin") as f:
        assert f.read(1000) == b"\x00" * 1000
        assert len(f.read()) == 9000
    with storage.open_input_file("s/stream.bin") as f:
        assert f.size() == 10_000
        f.seek(9500)
        assert f.read(10) == b"\x09" * 10
        assert f.read_at(3, 1000) == b"\x01" * 3


def test_write_with_reports_size_and_checksum(storage: Storage):
    def writer(out):
        out.write(b"abc")
        out.write(pa.py_buffer(b"def"))

    entry = storage.write_with("w.bin", writer)
    assert entry == hdfs_io.FileEntry.of_bytes(b"abcdef")
    assert storage.read_bytes("w.bin") == b"abcdef"


def test_failed_write_leaves_no_partial_file(storage: Storage):
    def writer(out):
        out.write(b"half of it")
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError):
        storage.write_with("p/partial.bin", writer)
    assert not storage.exists("p/partial.bin")


def test_sub_storage(storage: Storage):
    sub = storage.sub("job/20240101")
    sub.write_bytes("x", b"1")
    assert storage.read_bytes("job/20240101/x") == b"1"
    assert sub.uri_of("x") == storage.uri_of("job/20240101/x")
    assert sub.retry_stats is storage.retry_stats


@pytest.mark.parametrize("bad", ["/abs", "../up", "a/../b", "a//b", "./a"])
def test_paths_must_be_relative_and_normalized(storage: Storage, bad: str):
    with pytest.raises(ValueError):
        storage.write_bytes(bad, b"x")


def test_join():
    assert hdfs_io.join("a/", "/b", "", "c.bin") == "a/b/c.bin"
    assert hdfs_io.join() == ""


def test_arrow_ipc_roundtrip_zstd(storage: Storage):
    table = pa.table(
        {
            "key": pa.array(range(50_000), pa.uint64()),
            "value": pa.array([float(i % 97) for i in range(50_000)], pa.float32()),
        }
    )
    entry = hdfs_io.write_ipc_file(storage, "t/part-0.arrow", table)
    data = storage.read_bytes("t/part-0.arrow")
    assert entry == hdfs_io.FileEntry.of_bytes(data)  # checksum computed while writing matches the bytes
    assert data[:6] == b"ARROW1"
    back = hdfs_io.read_ipc_file(storage, "t/part-0.arrow", expected=entry)
    assert back.equals(table)
    # buffers really are zstd-compressed: smaller than the raw 12 bytes/row
    assert entry.size < table.nbytes


def test_arrow_ipc_from_batch_iterator(storage: Storage):
    schema = pa.schema([("k", pa.uint64())])
    batches = (pa.record_batch([pa.array(range(i * 10, i * 10 + 10), pa.uint64())], schema=schema) for i in range(5))
    entry = hdfs_io.write_ipc_file(storage, "it.arrow", batches, schema=schema)
    table = hdfs_io.read_ipc_file(storage, "it.arrow", expected=entry)
    assert table.column("k").to_pylist() == list(range(50))
    with pytest.raises(ValueError, match="schema"):
        hdfs_io.write_ipc_file(storage, "no-schema.arrow", iter([]))


def test_truncated_arrow_file_is_corrupt(storage: Storage):
    table = pa.table({"k": pa.array(range(10_000), pa.uint64())})
    entry = hdfs_io.write_ipc_file(storage, "t.arrow", table)
    data = storage.read_bytes("t.arrow")
    storage.write_bytes("t.arrow", data[: len(data) // 2])
    with pytest.raises(hdfs_io.CheckpointCorruptError) as err:
        hdfs_io.read_ipc_file(storage, "t.arrow")
    assert storage.uri_of("t.arrow") in str(err.value)
    assert err.value.uri == storage.uri_of("t.arrow")
    with pytest.raises(hdfs_io.CheckpointCorruptError, match="size"):
        hdfs_io.read_ipc_file(storage, "t.arrow", expected=entry)


def test_a_large_arrow_file_is_checksummed_then_read_a_batch_at_a_time(storage: Storage, monkeypatch):
    """``open_ipc_batches`` over ``STREAM_MIN_BYTES`` (here: every file): a streaming pass checks size and
    CRC-32 before any batch is returned, then batches come one at a time, as often as asked; damage is a
    ``CheckpointCorruptError`` naming the file, before the first batch."""
    from hdfs_io import arrow_io
    monkeypatch.setattr(arrow_io, "STREAM_MIN_BYTES", 0)
    schema = pa.schema([("key", pa.uint64()), ("value", pa.float32())])
    batches = [pa.record_batch([pa.array(range(i * 5_000, (i + 1) * 5_000), pa.uint64()),
                                pa.array([float(i)] * 5_000, pa.float32())], schema=schema) for i in range(8)]
    entry = hdfs_io.write_ipc_file(storage, "big/part.arrow", iter(batches), schema=schema)
    got = arrow_io.open_ipc_batches(storage, "big/part.arrow", expected=entry)
    assert got.streamed and got.schema.equals(schema)
    for _ in range(2):
        read = list(got)
        assert len(read) == 8 and pa.Table.from_batches(read).equals(pa.Table.from_batches(batches))
    data = bytearray(storage.read_bytes("big/part.arrow"))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes("big/part.arrow", bytes(data))
    with pytest.raises(hdfs_io.CheckpointCorruptError, match="crc32") as err:
        arrow_io.open_ipc_batches(storage, "big/part.arrow", expected=entry)
    assert err.value.uri == storage.uri_of("big/part.arrow")
    storage.write_bytes("big/part.arrow", bytes(data[: len(data) // 3]))
    with pytest.raises(hdfs_io.CheckpointCorruptError, match="size"):
        arrow_io.open_ipc_batches(storage, "big/part.arrow", expected=entry)
    monkeypatch.setattr(arrow_io, "STREAM_MIN_BYTES", 1 << 20)
    small = arrow_io.open_ipc_batches(storage, "it.arrow", expected=hdfs_io.write_ipc_file(
        storage, "it.arrow", pa.Table.from_batches(batches[:1])))
    assert not small.streamed and sum(b.num_rows for b in small) == 5_000     # under the threshold: in memory
