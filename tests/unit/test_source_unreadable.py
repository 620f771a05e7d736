"""``ArrowSource`` on inputs pyarrow cannot read (empty, truncated, corrupt, not Arrow / Parquet): a
``DataFormatError`` naming the file, the record batch and its first row, from the prefetch thread too;
a truncated stream file is refused before its first batch is delivered (its tail lacks the end-of-stream
marker), a stream that cannot seek where the reading stopped (the rows before it are delivered); errors
of the medium are not turned into format errors."""
from __future__ import annotations

import errno
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streaming.errors import DataFormatError
from streaming.source import ArrowSource, _unreadable

SCHEMA = pa.schema([("label", pa.float32()), ("C1", pa.uint64())])


def _batch(start, n):
    ids = np.arange(start, start + n)
    return pa.RecordBatch.from_arrays([pa.array(ids.astype(np.float32)), pa.array(ids.astype(np.uint64))],
                                      schema=SCHEMA)


def _stream_bytes(sizes, file_format=False) -> bytes:
    sink = pa.BufferOutputStream()
    w = pa.ipc.new_file(sink, SCHEMA) if file_format else pa.ipc.new_stream(sink, SCHEMA)
    start = 0
    for n in sizes:
        w.write_batch(_batch(start, n))
        start += n
    w.close()
    return sink.getvalue().to_pybytes()


def _read_all(src, prefetch=0):
    rows = []
    with pytest.raises(DataFormatError) as ei:
        for rb in ArrowSource(src, batch_size=7, prefetch=prefetch).batches(0):
            rows.extend(rb.column("C1").to_pylist())
    return ei.value, rows


@pytest.mark.parametrize("prefetch", [0, 2])
def test_truncated_stream_names_file_batch_and_row(tmp_path, prefetch):
    data = _stream_bytes([10, 10, 10, 10])
    p = tmp_path / "part-0.arrow"
    p.write_bytes(data[:len(data) - 200])          # the last batch cut
    err, rows = _read_all(str(p), prefetch)
    assert err.path == str(p) and err.unit == "row" and err.line == 31 and err.field == "<record batch 3>"
    assert str(err).startswith(f"{p}: row 31: field <record batch 3>: expected a complete record batch, got one "
                               f"pyarrow cannot read (")
    assert "truncated or corrupt after 30 readable rows in 3 record batches" in str(err)
    assert rows == []                              # the tail gave the cut away: nothing of the file delivered


@pytest.mark.parametrize("prefetch", [0, 2])
def test_truncated_pipe_delivers_what_was_read_before(prefetch):
    err, rows = _read_all(io.BufferedReader(io.BytesIO(_stream_bytes([10, 10, 10, 10])[:-200])), prefetch)
    assert err.line == 31 and err.field == "<record batch 3>"
    assert rows == list(range(28))                 # what was read before is delivered, in whole batches


def test_directory_names_the_bad_file(tmp_path):
    (tmp_path / "a.arrow").write_bytes(_stream_bytes([5]))
    (tmp_path / "b.arrow").write_bytes(_stream_bytes([5, 5])[:-60])
    err, _ = _read_all(str(tmp_path))
    assert err.path == str(tmp_path / "b.arrow") and err.line == 6 and err.field == "<record batch 1>"


@pytest.mark.parametrize("name,content,expect", [
    ("empty.arrow", b"", "row 1: field <file header>: expected an Arrow IPC file or stream, got an empty file "
                         "(0 bytes)"),
    ("junk.arrow", b"hello, world\n" * 50, "row 1: field <file header>: expected an Arrow IPC file or stream, got "
                                          "bytes pyarrow cannot read as one ("),
    ("cut-footer.arrow", None, "row 1: field <file header>: expected an Arrow IPC file or stream, got bytes"),
    ("junk.parquet", b"PAR1" + b"x" * 100, "row 1: field <file header>: expected a Parquet file, got bytes"),
    ("empty.parquet", b"", "row 1: field <file header>: expected a Parquet file, got an empty file (0 bytes)"),
])
def test_unreadable_header(tmp_path, name, content, expect):
    if content is None:                            # an IPC *file* (ARROW1 magic) without its footer
        content = _stream_bytes([10, 10], file_format=True)[:-40]
    p = tmp_path / name
    p.write_bytes(content)
    err, rows = _read_all(str(p))
    assert rows == [] and str(err).startswith(f"{p}: {expect}")


def test_truncated_parquet(tmp_path):
    p = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_batches([_batch(0, 1000)]), p, row_group_size=100)
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2] + data[-8:])      # the footer's length and magic kept, body cut
    err, _ = _read_all(str(p))
    assert err.path == str(p) and str(err).startswith(f"{p}: row 1: field <file header>: expected a Parquet file")
    assert "\n" not in str(err)                   # pyarrow's multi-line text made one line


def test_truncated_stream_object():
    err, rows = _read_all(io.BytesIO(_stream_bytes([4, 4])[:-30]))
    assert err.path == "<stream>" and err.line == 5 and err.field == "<record batch 1>"
    assert "after 4 readable rows in 1 record batch" in str(err) and rows == []   # 4 rows < one batch of 7


def test_good_inputs_unchanged(tmp_path):
    p = tmp_path / "ok.arrow"
    p.write_bytes(_stream_bytes([3, 4], file_format=True))
    got = [rb.num_rows for rb in ArrowSource(str(p), batch_size=2, prefetch=0).batches(0)]
    assert got == [2, 2, 2, 1]


def test_only_unreadable_bytes_count_as_format_errors():
    assert _unreadable(pa.ArrowInvalid("Tried reading schema message, was null or length 0"))
    assert _unreadable(OSError("Expected to be able to read 33792 bytes for message body, got 25504"))
    # the medium failing is not a format error: an errno, a transient storage error, a missing file
    assert not _unreadable(OSError(errno.EIO, "Input/output error"))
    assert not _unreadable(ConnectionResetError(errno.ECONNRESET, "reset"))
    assert not _unreadable(OSError("When reading: AWS Error NETWORK_CONNECTION during GetObject"))
    assert not _unreadable(OSError("HTTP response code: 503 SERVICE_UNAVAILABLE"))
    assert not _unreadable(FileNotFoundError(errno.ENOENT, "No such file"))
    assert not _unreadable(ValueError("not pyarrow's"))


@pytest.mark.parametrize("name, content", [("empty.arrow", b""), ("garbage.arrow", b"not arrow at all" * 10),
                                           ("cut.parquet", b"PAR1garbage")])
def test_read_schema_names_an_unreadable_file(tmp_path, name, content):
    """``read_schema`` (the group column's look at the test files) said a raw ArrowInvalid before."""
    from streaming.source import read_schema
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataFormatError) as ei:
        read_schema(str(path))
    assert str(ei.value).startswith(f"{path}: row 1: field <file header>: expected "), str(ei.value)
    good = tmp_path / "good.arrow"
    good.write_bytes(_stream_bytes([3]))
    assert read_schema(str(good)) == _batch(0, 1).schema


def test_a_store_refusing_a_read_is_not_taken_for_unreadable_bytes():
    """SSE-KMS objects the job may HEAD but not decrypt: GetObject's AccessDenied has no errno and was called
    'bytes pyarrow cannot read ... another format, or truncated' (bad input data)."""
    from streaming.source import _unreadable
    assert not _unreadable(OSError("AWS Error ACCESS_DENIED during GetObject operation: Access Denied"))
    assert _unreadable(OSError("Expected to be able to read 4096 bytes for message body, got 12"))
