"""Arrow source: re-chunking, shuffling, schema checks, inputs (dir/parquet/stream), prefetch, sharding,
positions."""
from __future__ import annotations

import io
import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streaming import keys
from streaming.errors import SchemaError
from streaming.source import ArrowSource, SourcePosition, prefetch

SCHEMA = pa.schema([("label", pa.float32()), ("C1", pa.uint64())])


def batch(start, n):
    ids = np.arange(start, start + n)
    return pa.RecordBatch.from_arrays([pa.array(ids.astype(np.float32)), pa.array(ids.astype(np.uint64))],
                                      schema=SCHEMA)


def write_stream(path, sizes, start=0, schema=SCHEMA):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        for n in sizes:
            w.write_batch(batch(start, n))
            start += n
    return start


@pytest.fixture
def data_dir(tmp_path):
    """Three stream files, 0..99 in uneven batches, plus a _meta.json the source must skip."""
    d = tmp_path / "d"
    d.mkdir()
    nxt = write_stream(d / "part-00000.arrow", [7, 13, 20])
    nxt = write_stream(d / "part-00001.arrow", [1, 29], nxt)
    write_stream(d / "part-00002.arrow", [30], nxt)
    (d / "_meta.json").write_text("{}")
    return d


def ids_of(batches):
    return [int(v) for b in batches for v in b.column("C1").to_numpy()]


@pytest.mark.parametrize("prefetch_n", [0, 2])
def test_rechunk_exact_sizes(data_dir, prefetch_n):
    bs = list(ArrowSource(str(data_dir), batch_size=16, prefetch=prefetch_n))
    assert [b.num_rows for b in bs] == [16] * 6 + [4]
    assert ids_of(bs) == list(range(100))
    bs = list(ArrowSource(str(data_dir), batch_size=16, drop_last=True, prefetch=prefetch_n))
    assert [b.num_rows for b in bs] == [16] * 6


def test_shuffle_deterministic_and_complete(data_dir):
    def run(seed, epoch=0):
        src = ArrowSource(str(data_dir), batch_size=8, shuffle_buffer=32, seed=seed)
        return ids_of(src.batches(epoch))
    a, b = run(1), run(1)
    assert a == b and sorted(a) == list(range(100)) and a != list(range(100))
    assert run(2) != a and run(1, epoch=1) != a
    with pytest.raises(ValueError, match="explicit seed"):
        ArrowSource(str(data_dir), batch_size=8, shuffle_buffer=32)


def test_schema_errors_name_column_and_file(data_dir, tmp_path):
    want = pa.schema([("label", pa.float32()), ("C1", pa.uint64()), ("C3", pa.uint64())])
    with pytest.raises(SchemaError, match=r"column 'C3': expected uint64, but the column is missing "
                                          r"\(file .*part-00000.arrow"):
        list(ArrowSource(str(data_dir), batch_size=8, schema=want))
    bad = pa.schema([("label", pa.float32()), ("C1", pa.string())])
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, pa.ipc.new_stream(sink, bad) as w:
        w.write_batch(pa.RecordBatch.from_arrays([pa.array([1.0], pa.float32()), pa.array(["x"])],
                                                 schema=bad))
    with pytest.raises(SchemaError, match=r"column 'C1': expected uint64, got string \(file .*s.arrow\)"):
        list(ArrowSource(str(tmp_path / "s.arrow"), batch_size=8, schema=SCHEMA))
    # a later file with another schema is caught too, even without an explicit schema
    with pytest.raises(SchemaError, match="s.arrow"):
        list(ArrowSource([str(data_dir), str(tmp_path / "s.arrow")], batch_size=8))
    # raw strings are hashed when the column is declared a string slot
    got = list(ArrowSource(str(tmp_path / "s.arrow"), batch_size=8, schema=SCHEMA, string_slots={"C1": 9}))
    assert got[0].column("C1")[0].as_py() == keys.hash_value(9, "x")


def test_column_selection_and_order(data_dir):
    want = pa.schema([("C1", pa.uint64())])
    bs = list(ArrowSource(str(data_dir), batch_size=50, schema=want))
    assert bs[0].schema.names == ["C1"] and ids_of(bs) == list(range(100))


def test_parquet_and_ipc_file_inputs(tmp_path):
    pq.write_table(pa.Table.from_batches([batch(0, 40)]), tmp_path / "a.parquet", row_group_size=15)
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as w:
        w.write_batch(batch(40, 10))
    bs = list(ArrowSource([str(tmp_path / "a.parquet"), str(tmp_path / "b.arrow")], batch_size=12,
                          schema=SCHEMA))
    assert ids_of(bs) == list(range(50)) and [b.num_rows for b in bs] == [12, 12, 12, 12, 2]


def test_stream_inputs_bytesio_and_pipe(tmp_path):
    buf = io.BytesIO()
    with pa.ipc.new_stream(buf, SCHEMA) as w:
        w.write_batch(batch(0, 10))
        w.write_batch(batch(10, 5))
    assert ids_of(ArrowSource(io.BytesIO(buf.getvalue()), batch_size=4)) == list(range(15))
    r, wfd = os.pipe()
    payload = buf.getvalue()

    def feed():
        with os.fdopen(wfd, "wb") as f:
            f.write(payload)
    t = threading.Thread(target=feed)
    t.start()
    with os.fdopen(r, "rb") as f:
        assert ids_of(ArrowSource(f, batch_size=4)) == list(range(15))
    t.join()


def test_early_stop_does_not_hang_and_errors_propagate(data_dir):
    src = ArrowSource(str(data_dir), batch_size=1, prefetch=2)
    t0 = time.monotonic()
    for i, _ in enumerate(src):
        if i == 3:
            break
    assert time.monotonic() - t0 < 5
    assert not [t for t in threading.enumerate() if t.name == "arrow-source"]

    def boom():
        yield 1
        raise RuntimeError("reader failed")
    it = prefetch(boom(), 1)
    assert next(it) == 1
    with pytest.raises(RuntimeError, match="reader failed"):
        next(it)


def test_prefetch_is_bounded():
    produced = []

    def gen():
        for i in range(100):
            produced.append(i)
            yield i
    it = prefetch(gen(), 3)
    next(it)
    time.sleep(0.2)
    assert len(produced) <= 1 + 3 + 1  # one consumed, queue full, one blocked in put
    it.close()


def test_sharding_files_and_batches(data_dir):
    files = [ids_of(ArrowSource(str(data_dir), batch_size=100, shard=(w, 2))) for w in range(2)]
    assert files[0] == list(range(40)) + list(range(70, 100)) and files[1] == list(range(40, 70))
    parts = [ids_of(ArrowSource(str(data_dir), batch_size=100, shard=(w, 3), shard_by="batches"))
             for w in range(3)]
    assert sorted(sum(parts, [])) == list(range(100)) and all(parts)
    with pytest.raises(ValueError, match="shard"):
        ArrowSource(str(data_dir), batch_size=1, shard=(2, 2))


def test_position_resume_is_exact(data_dir):
    src = ArrowSource(str(data_dir), batch_size=9)
    seen, positions = [], []
    for b in src:
        seen.append(ids_of([b]))
        positions.append(src.position)
    flat = sum(seen, [])
    for k, pos in enumerate(positions):
        pos = SourcePosition.from_dict(pos.to_dict())
        rest = ids_of(ArrowSource(str(data_dir), batch_size=9, start=pos))
        assert rest == flat[9 * (k + 1):], (k, pos)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ArrowSource(str(tmp_path / "nope"), batch_size=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no Arrow IPC or Parquet"):
        ArrowSource(str(tmp_path / "empty"), batch_size=4)


def test_stdin_dash(tmp_path):
    import subprocess
    import sys
    buf = io.BytesIO()
    with pa.ipc.new_stream(buf, SCHEMA) as w:
        w.write_batch(batch(0, 10))
    code = ("from streaming.source import ArrowSource; "
            "print(sum(b.num_rows for b in ArrowSource('-', batch_size=3)))")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], input=buf.getvalue(), capture_output=True,
                         cwd=repo, timeout=120, check=True)
    assert out.stdout.strip() == b"10"
