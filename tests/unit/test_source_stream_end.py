"""An Arrow IPC stream must end with its end-of-stream marker (``streaming.ipc_stream``), and files are
read without memory-mapping them.

pyarrow's stream reader stops quietly where the bytes end at a record-batch boundary: a stream whose
writer was killed between two batches read as a complete, shorter one and its remaining rows were lost
silently. Now ``ArrowSource`` (files, directories, pipes), ``read_schema(check_end=True)``,
``check_inputs`` and the hourly partitions refuse it, naming the file and the row after the last
complete batch; IPC *file* format, Parquet, legacy-framed streams and a schema-only stream with its
marker are still read. A file truncated in place while it is read was a SIGBUS (memory map): now a
``DataFormatError``."""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streaming.errors import DataFormatError, SchemaError
from streaming.ipc_stream import CheckedStream, IncompleteStreamError, TrackedInput, tail_has_eos
from streaming.source import ArrowSource, check_inputs, read_schema

REPO = Path(__file__).resolve().parents[2]
SCHEMA = pa.schema([("label", pa.float32()), ("C1", pa.uint64())])


def _batch(start, n):
    ids = np.arange(start, start + n)
    return pa.RecordBatch.from_arrays([pa.array(ids.astype(np.float32)), pa.array(ids.astype(np.uint64))],
                                      schema=SCHEMA)


def _stream(sizes, *, legacy=False, schema=SCHEMA, batch=_batch):
    """(stream bytes, end offset of each batch's message)."""
    sink = pa.BufferOutputStream()
    ends = []
    with pa.ipc.new_stream(sink, schema, options=pa.ipc.IpcWriteOptions(use_legacy_format=legacy)) as w:
        start = 0
        for n in sizes:
            w.write_batch(batch(start, n))
            start += n
            ends.append(sink.tell())
    return sink.getvalue().to_pybytes(), ends


def _rows(src, prefetch=0, **kw):
    return [v for rb in ArrowSource(src, batch_size=7, prefetch=prefetch, **kw).batches(0)
            for v in rb.column("C1").to_pylist()]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("cut_after", [0, 1, 2])
def test_file_cut_at_a_batch_boundary_is_refused_naming_the_next_row(tmp_path, prefetch, cut_after):
    data, ends = _stream([10, 10, 10])
    schema_end = len(_stream([])[0]) - 8                  # a stream cut right after its schema
    p = tmp_path / "part-1.arrow"
    p.write_bytes(data[:ends[cut_after - 1] if cut_after else schema_end])
    got = []
    with pytest.raises(DataFormatError) as ei:
        for rb in ArrowSource(str(p), batch_size=7, prefetch=prefetch).batches(0):
            got.extend(rb.column("C1").to_pylist())
    e = ei.value
    rows = 10 * cut_after
    assert (e.path, e.unit, e.line, e.field) == (str(p), "row", rows + 1, f"<record batch {cut_after}>")
    assert "expected another record batch or the Arrow IPC end-of-stream marker after " \
           f"{rows} rows in {cut_after} complete record batch" in str(e)
    assert "without the end-of-stream marker: truncated" in str(e)
    assert got == []                                      # refused before any of its rows was delivered


def test_directory_with_a_cut_file_names_it(tmp_path):
    (tmp_path / "a.arrow").write_bytes(_stream([5])[0])
    data, ends = _stream([5, 5, 5])
    (tmp_path / "b.arrow").write_bytes(data[:ends[1]])
    (tmp_path / "c.arrow").write_bytes(_stream([5])[0])
    with pytest.raises(DataFormatError) as ei:
        _rows(str(tmp_path))
    assert (ei.value.path, ei.value.line) == (str(tmp_path / "b.arrow"), 11)


def test_a_batch_ending_like_the_marker_is_caught_after_the_last_batch(tmp_path):
    """An int32 column ending in -1 and 4 bytes of padding ends exactly like the marker: the quick tail
    test passes, the exact check after the last message does not."""
    schema = pa.schema([("C1", pa.int32())])
    data, ends = _stream([3, 3], schema=schema, batch=lambda s, n: pa.record_batch(
        [pa.array([1] * (n - 1) + [-1], pa.int32())], schema=schema))
    cut = data[:ends[0]]
    assert tail_has_eos(pa.BufferReader(cut))
    p = tmp_path / "x.arrow"
    p.write_bytes(cut)
    with pytest.raises(DataFormatError) as ei:
        list(ArrowSource(str(p), batch_size=2, prefetch=0).batches(0))
    assert (ei.value.line, ei.value.field) == (4, "<record batch 1>")


def test_bytes_after_the_marker_are_refused(tmp_path):
    one = _stream([4])[0]
    p = tmp_path / "two-streams.arrow"
    p.write_bytes(one + one)                              # cat a.arrow b.arrow > two-streams.arrow
    with pytest.raises(DataFormatError, match=rf"{len(one)} bytes after the end-of-stream marker"):
        _rows(str(p))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_pipe_cut_at_a_boundary_is_refused_after_its_rows(prefetch):
    data, ends = _stream([10, 10, 10])
    with pytest.raises(DataFormatError) as ei:
        _rows(io.BufferedReader(io.BytesIO(data[:ends[1]])), prefetch)
    assert (ei.value.path, ei.value.line, ei.value.field) == ("<stream>", 21, "<record batch 2>")


def test_every_cut_of_a_stream_is_refused_and_only_the_whole_one_read():
    """At every byte offset, seekable (with and without the tail test) and not."""
    for legacy in (False, True):
        data, _ = _stream([3, 3, 4], legacy=legacy)
        for cut in range(len(data) + 1):
            for make in (lambda d: CheckedStream(pa.BufferReader(d)),
                         lambda d: CheckedStream(pa.BufferReader(d), precheck=None),
                         lambda d: CheckedStream(TrackedInput(io.BytesIO(d)))):
                try:
                    n = sum(rb.num_rows for rb in make(data[:cut]))
                except (IncompleteStreamError, pa.ArrowInvalid, OSError):
                    n = None
                assert n == (10 if cut == len(data) else None), (legacy, cut)


@pytest.mark.parametrize("kind", ["stream", "legacy", "ipc_file", "parquet", "schema_only", "schema_only_legacy"])
def test_complete_inputs_are_read_as_before(tmp_path, kind):
    p = tmp_path / ("x.parquet" if kind == "parquet" else "x.arrow")
    t = pa.Table.from_batches([_batch(0, 5), _batch(5, 6)])
    if kind == "ipc_file":
        with pa.ipc.new_file(str(p), SCHEMA) as w:
            w.write_table(t)
    elif kind == "parquet":
        pq.write_table(t, p, row_group_size=4)
    else:
        p.write_bytes(_stream([] if kind.startswith("schema_only") else [5, 6], legacy=kind.endswith("legacy"))[0])
    want = [] if kind.startswith("schema_only") else list(range(11))
    assert _rows(str(p)) == want
    assert _rows(str(p), schema=SCHEMA) == want
    assert read_schema(str(p), check_end=True) == SCHEMA
    assert check_inputs(str(p), SCHEMA) == [str(p)]


def test_read_schema_and_check_inputs(tmp_path):
    data, ends = _stream([4, 4])
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(data[:ends[0]])
    assert read_schema(str(cut)) == SCHEMA                # the schema alone is readable
    with pytest.raises(DataFormatError, match=r"cut\.arrow: row 5: field <record batch 1>"):
        read_schema(str(cut), check_end=True)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.arrow").write_bytes(data)
    other = pa.schema([("label", pa.float32()), ("C2", pa.uint64())])
    (d / "b.arrow").write_bytes(_stream([2], schema=other, batch=lambda s, n: pa.record_batch(
        [pa.array(np.zeros(n, np.float32)), pa.array(np.zeros(n, np.uint64))], schema=other))[0])
    with pytest.raises(SchemaError, match=r"column 'C1'.*missing \(file .*b\.arrow"):
        check_inputs(str(d), SCHEMA)                      # the second file's schema, before any batch
    (d / "b.arrow").unlink()
    (d / "c.arrow").write_bytes(data[:ends[0]])
    with pytest.raises(DataFormatError, match=r"c\.arrow: row 5"):
        check_inputs(str(d))
    (d / "c.arrow").unlink()
    assert check_inputs(str(d), SCHEMA) == [str(d / "a.arrow")]


_TRUNCATE_WHILE_READING = textwrap.dedent("""
    import os, sys
    import numpy as np, pyarrow as pa
    from streaming.source import ArrowSource
    p = sys.argv[1]
    schema = pa.schema([("C1", pa.uint64())])
    with pa.OSFile(p, "wb") as f, pa.ipc.new_stream(f, schema) as w:
        for i in range(64):
            keys = np.arange(i * 8192, (i + 1) * 8192, dtype=np.uint64)
            w.write_batch(pa.record_batch([pa.array(keys)], schema=schema))
    held = []
    try:
        for i, rb in enumerate(ArrowSource(p, batch_size=8192, prefetch=int(sys.argv[2])).batches(0)):
            held.append(rb)
            if i == 5:
                os.truncate(p, os.path.getsize(p) // 3)
            for b in held:                  # touch every delivered batch, as a consumer does
                int(b.column("C1").to_numpy().sum())
    except Exception as e:
        print(type(e).__name__, e)
""")


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_file_truncated_while_read_is_a_format_error_not_sigbus(tmp_path, prefetch):
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_WHILE_READING, str(tmp_path / "big.arrow"), str(prefetch)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])      # was -7 (SIGBUS), no message
    # cut inside a batch: a format error ("truncated"); between two: the stat after each batch finds the file
    # shorter than when the read began (InputChangedError, a DataFormatError)
    assert r.stdout.startswith((f"DataFormatError {tmp_path / 'big.arrow'}: row ",
                                f"InputChangedError {tmp_path / 'big.arrow'}: row ")), r.stdout
    assert "truncated" in r.stdout or "expected the file the read began on" in r.stdout, r.stdout
