"""CTR training inputs read straight from an object store (``streaming.inputs``) on a real S3 server (moto's,
on 127.0.0.1): a directory of an IPC stream, an IPC file and a Parquet file reads, counts, splits and
fingerprints exactly as its local copy does; what cannot be read is named by its URI, before a batch of
it is delivered; and the launcher's data checks (``ctr_data.prepare_data``, ``check_train_split``) take
URIs."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from engine.errors import ConfigError
from engine.program_configs import DataConfig
from engine.programs.ctr_data import (check_train_split, expected_schema, file_rows, files_fingerprint, make_source,
                                      prepare_data, to_batch)
from streaming.criteo import convert_criteo, generate_criteo
from streaming.errors import DataFormatError
from streaming.inputs import RemoteInput
from streaming.source import count_rows, list_files, read_batches, read_schema

SLOTS = ["C1", "C2", "C3"]
SCHEMA = expected_schema(SLOTS, 13)
FILES = ["part-0.arrows", "part-1.arrow", "part-2.parquet"]


def _tables(d):
    generate_criteo(d / "rows.txt", 500, 3)
    convert_criteo([d / "rows.txt"], d / "conv", split="train", batch_size=16)
    t = pa.concat_tables(pa.ipc.open_stream(str(f)).read_all() for f in sorted((d / "conv").glob("*.arrow")))
    return t.slice(0, 150), t.slice(150, 130), t.slice(280)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, s3_bucket, s3_storage_options, moto_s3):
    """(local directory, its copy's URI): one IPC stream, one IPC file, one Parquet file of the same
    Criteo rows, a ``_SUCCESS`` marker and a ``README.txt`` no reader reads."""
    d = tmp_path_factory.mktemp("remote_inputs")
    local = d / "train"
    local.mkdir()
    a, b, c = _tables(d)
    with pa.OSFile(str(local / FILES[0]), "wb") as f, pa.ipc.new_stream(f, a.schema) as w:
        w.write_table(a, max_chunksize=16)
    with pa.OSFile(str(local / FILES[1]), "wb") as f, pa.ipc.new_file(f, b.schema) as w:
        w.write_table(b, max_chunksize=32)
    pq.write_table(c, str(local / FILES[2]), row_group_size=50)
    (local / "_SUCCESS").write_bytes(b"")
    (local / "README.txt").write_text("not data")
    uri = f"s3://{s3_bucket}/remote-inputs/train"
    pafs.copy_files(str(local), uri.removeprefix("s3://"), source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=_s3(moto_s3))
    return local, uri


def _s3(moto_s3):
    return pafs.S3FileSystem(access_key=moto_s3.access_key, secret_key=moto_s3.secret_key, region=moto_s3.region,
                             scheme="http", endpoint_override=moto_s3.endpoint)


def test_a_directory_uri_lists_the_data_files_a_local_directory_lists(inputs, s3_storage_options):
    local, uri = inputs
    remote = list_files(uri, storage_options=s3_storage_options)
    assert all(isinstance(r, RemoteInput) for r in remote)
    assert [str(r) for r in remote] == [f"{uri}/{n}" for n in FILES]
    assert [r.name for r in remote] == [p.rsplit("/", 1)[-1] for p in list_files(str(local))]
    one = list_files(f"{uri}/{FILES[2]}", storage_options=s3_storage_options)      # a file URI: itself
    assert [str(r) for r in one] == [f"{uri}/{FILES[2]}"]


@pytest.mark.parametrize("i", range(len(FILES)))
def test_every_reader_gives_what_it_gives_of_the_local_copy(inputs, s3_storage_options, i):
    local, uri = inputs
    remote = list_files(uri, storage_options=s3_storage_options)[i]
    path = str(local / FILES[i])
    assert read_schema(remote) == read_schema(path)
    assert count_rows(remote) == count_rows(path) > 0
    got = pa.Table.from_batches(list(read_batches(remote)))
    assert got.equals(pa.Table.from_batches(list(read_batches(path))))


@pytest.mark.parametrize("workers", [1, 3])
def test_the_row_split_reads_the_same_rows_per_worker_as_from_local_disk(inputs, s3_storage_options, workers):
    """Each worker's batches (shard_by rows, shuffled as training shuffles) equal those of the local copy."""
    local, uri = inputs
    rows = file_rows(uri, s3_storage_options)
    assert rows == file_rows(str(local))
    for rank in range(workers):
        got, want = ([to_batch(rb, SLOTS, 13) for rb in make_source(
            path, batch_size=32, schema=SCHEMA, rank=rank, num_workers=workers, shuffle_buffer=64, seed=5,
            file_rows=rows, storage_options=opts).batches(1)]
            for path, opts in ((uri, s3_storage_options), (str(local), None)))
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert (g.keys == w.keys).all() and (g.labels == w.labels).all() and (g.dense == w.dense).all()


def test_the_fingerprint_of_a_copy_on_s3_equals_the_local_one(inputs, s3_storage_options):
    """A job whose inputs moved to a store (or back) resumes its checkpoints: the position's fingerprint
    names files by name, size and content, not by where they are."""
    local, uri = inputs
    assert files_fingerprint(uri, s3_storage_options) == files_fingerprint(str(local))


def test_the_launcher_checks_take_a_uri_and_keep_it(inputs, s3_storage_options, caplog):
    local, uri = inputs
    assert check_train_split(uri, SCHEMA, s3_storage_options) == sum(file_rows(str(local)))
    with caplog.at_level("WARNING", logger="engine.programs.ctr_data"):
        out = prepare_data(DataConfig(source="arrow", train_path=uri, test_path=uri + "/"), SCHEMA,
                           s3_storage_options)
    assert (out.train_path, out.test_path) == (uri, uri + "/")
    assert any(f"model.data.train_path: 1 file(s) of {uri} are not read" in r.getMessage()
               and "README.txt" in r.getMessage() for r in caplog.records)


def test_a_missing_uri_is_a_config_error_naming_the_key_and_the_uri(inputs, s3_storage_options, s3_bucket):
    _, uri = inputs
    for missing, what in ((f"s3://{s3_bucket}/nothing-here", "data path does not exist"),
                          (f"s3://{s3_bucket}/remote-inputs", "no Arrow IPC or Parquet files in directory")):
        with pytest.raises(ConfigError, match=rf"^model\.data\.test_path: {what}:? {missing}$"):
            prepare_data(DataConfig(source="arrow", train_path=uri, test_path=missing), SCHEMA, s3_storage_options)


def _put(moto_s3, key: str, data: bytes) -> None:
    with _s3(moto_s3).open_output_stream(key) as out:
        out.write(data)


def test_a_truncated_stream_on_s3_is_refused_by_its_uri_before_a_batch_is_delivered(inputs, moto_s3, s3_bucket,
                                                                                     s3_storage_options):
    """The stream's writer stopped between two record batches: no end-of-stream marker. Its first batches
    are not delivered (a worker would train on them, then fail), and the error names the object's URI."""
    local, _ = inputs
    whole = (local / FILES[0]).read_bytes()
    cut = whole[:-8]                                   # drop the end-of-stream marker only
    key = f"{s3_bucket}/remote-truncated/part-0.arrows"
    _put(moto_s3, key, cut)
    (f,) = list_files(f"s3://{key}", storage_options=s3_storage_options)
    delivered = []
    with pytest.raises(DataFormatError, match=rf"^s3://{key}: row 151: field <record batch 10>: expected another "
                                              rf"record batch or the Arrow IPC end-of-stream marker"):
        for rb in read_batches(f):
            delivered.append(rb)
    assert delivered == []
    with pytest.raises(DataFormatError, match=rf"^s3://{key}: row 151: "):   # the header walk refuses it too
        count_rows(f)


def test_a_bad_label_deep_in_an_s3_file_is_named_by_uri_row_and_column(inputs, moto_s3, s3_bucket,
                                                                        s3_storage_options):
    local, _ = inputs
    t = pq.read_table(str(local / FILES[2]))
    labels = t.column("label").to_pylist()
    labels[57] = 2.0
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(labels, t.schema.field("label").type))
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink, row_group_size=50)
    key = f"{s3_bucket}/remote-bad/part-9.parquet"
    _put(moto_s3, key, sink.getvalue().to_pybytes())
    with pytest.raises(DataFormatError, match=rf"^s3://{key}: row 58: field label: "):
        check_train_split(f"s3://{s3_bucket}/remote-bad", SCHEMA, s3_storage_options)


def _stream_bytes(table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=16)
    return sink.getvalue().to_pybytes()


def _file_bytes(table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=16)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("kind", ["stream", "file"])
def test_an_object_overwritten_while_it_is_read_is_refused_before_a_row_of_the_new_version(
        inputs, moto_s3, s3_bucket, s3_storage_options, monkeypatch, tmp_path, kind):
    """S3 replaces an object whole; the ranged reads that follow, at the old offsets, return the new
    object's bytes. Two versions of the same size (fixed-width columns, the same row count: a day's file
    written again) read as one: before, every row was delivered, a mix of both, without an error."""
    import streaming.inputs
    monkeypatch.setattr(streaming.inputs, "STREAM_BUFFER_BYTES", 4096)     # several ranged GETs per file
    t = pa.Table.from_batches(list(read_batches(str(inputs[0] / FILES[0]))))
    old = t.slice(0, 120).combine_chunks()
    i = old.schema.get_field_index("label")
    new = old.set_column(i, old.schema.field(i), pa.compute.subtract(pa.scalar(1, old.schema.field(i).type),
                                                                     old.column(i)))    # the labels flipped
    write = _stream_bytes if kind == "stream" else _file_bytes
    assert len(write(old)) == len(write(new))
    key = f"{s3_bucket}/remote-overwritten-{kind}/part-0.arrow"
    _put(moto_s3, key, write(old))
    (f,) = list_files(f"s3://{key}", storage_options=s3_storage_options)
    delivered = []
    with pytest.raises(DataFormatError, match=rf"^s3://{key}: row (\d+): field <record batch \d+>: expected the "
                                              rf"object the read began on .* got another version .*written again"):
        for rb in read_batches(f):
            delivered.append(rb)
            if len(delivered) == 1:
                _put(moto_s3, key, write(new))
    got = pa.Table.from_batches(delivered)
    assert 0 < got.num_rows < old.num_rows and got.equals(old.slice(0, got.num_rows))    # the old version only
    # read again (the next epoch) as listed before: refused at its open, before its first row
    with pytest.raises(DataFormatError, match=rf"^s3://{key}: row 1: field <record batch 0>: expected the object "
                                              rf"as the job listed it"):
        next(read_batches(f))


def test_an_object_deleted_while_it_is_read_is_named_as_deleted(inputs, moto_s3, s3_bucket, s3_storage_options,
                                                               monkeypatch):
    import streaming.inputs
    monkeypatch.setattr(streaming.inputs, "STREAM_BUFFER_BYTES", 4096)
    key = f"{s3_bucket}/remote-deleted/part-0.arrows"
    _put(moto_s3, key, (inputs[0] / FILES[0]).read_bytes())
    (f,) = list_files(f"s3://{key}", storage_options=s3_storage_options)
    with pytest.raises(DataFormatError, match=rf"^s3://{key}: row \d+: field <record batch \d+>: expected the "
                                              rf"object the read began on .*got none: deleted while it was read"):
        for i, _ in enumerate(read_batches(f)):
            if i == 0:
                _s3(moto_s3).delete_file(key)


def test_a_uri_ending_in_a_slash_names_the_directory_even_beside_an_object_of_its_name(inputs, moto_s3, s3_bucket,
                                                                                       s3_storage_options):
    """S3 keeps an object ``both`` and the objects under ``both/`` side by side. ``s3://.../both/`` read the
    object ``both`` (the slash dropped) instead of the directory the user named."""
    key = f"{s3_bucket}/remote-both/both"
    _put(moto_s3, key, b"not the data")
    _put(moto_s3, f"{key}/part-0.arrows", (inputs[0] / FILES[0]).read_bytes())
    assert [str(f) for f in list_files(f"s3://{key}/", storage_options=s3_storage_options)] == \
        [f"s3://{key}/part-0.arrows"]
    assert [str(f) for f in list_files(f"s3://{key}", storage_options=s3_storage_options)] == [f"s3://{key}"]
    with pytest.raises(ConfigError, match=rf"^model\.data\.test_path: data path is a file, not the directory its "
                                          rf"trailing slash names: s3://{key}/part-0\.arrows/$"):
        prepare_data(DataConfig(source="arrow", train_path=f"s3://{key}/", test_path=f"s3://{key}/part-0.arrows/"),
                     SCHEMA, s3_storage_options)


def test_the_same_bytes_copied_again_are_the_same_object(inputs, moto_s3, s3_bucket, s3_storage_options):
    """A copy of the same bytes (a sync run again, a store restored) has a new modification time but the same
    ETag: read on, not refused."""
    import time
    key = f"{s3_bucket}/remote-copied-again/part-0.arrows"
    data = (inputs[0] / FILES[0]).read_bytes()
    _put(moto_s3, key, data)
    (f,) = list_files(f"s3://{key}", storage_options=s3_storage_options)
    want = pa.Table.from_batches(list(read_batches(f)))
    time.sleep(1.1)                                     # S3 gives modification times to the second
    _put(moto_s3, key, data)
    assert pa.Table.from_batches(list(read_batches(f))).equals(want)


def test_a_criteo_file_on_s3_is_copied_once_converted_and_copied_again_when_it_changes(moto_s3, s3_bucket,
                                                                                       s3_storage_options, tmp_path):
    """``model.data.criteo_path`` by URI was refused (converted from local paths only): it is copied into
    the cache, converted as a local file would be, and reused while the object is unchanged."""
    generate_criteo(tmp_path / "rows.txt", 60, 4)
    key = f"{s3_bucket}/criteo-text/train.txt"
    _put(moto_s3, key, (tmp_path / "rows.txt").read_bytes())
    cfg = DataConfig(source="criteo", criteo_path=f"s3://{key}", cache_dir=str(tmp_path / "cache"))
    out = prepare_data(cfg, SCHEMA, s3_storage_options)
    local = DataConfig(source="criteo", criteo_path=str(tmp_path / "rows.txt"), cache_dir=str(tmp_path / "cache2"))
    ref = prepare_data(local, SCHEMA)
    for a, b in ((out.train_path, ref.train_path), (out.test_path, ref.test_path)):
        assert pa.Table.from_batches(list(read_batches(list_files(a)[0]))).equals(
            pa.Table.from_batches(list(read_batches(list_files(b)[0]))))
    (copy,) = (tmp_path / "cache").glob("download-*/train.txt")
    stamp = copy.stat().st_mtime_ns
    import subprocess

    from hdfs_io import temp_names
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = copy.parent / f".train.txt.fetch-{temp_names._origin()}-{dead.pid}-0000beef"   # a killed copy's
    left.write_bytes(b"half a copy")
    assert prepare_data(cfg, SCHEMA, s3_storage_options) == out and copy.stat().st_mtime_ns == stamp    # reused
    generate_criteo(tmp_path / "rows.txt", 80, 5)                       # the object replaced: other rows
    _put(moto_s3, key, (tmp_path / "rows.txt").read_bytes())
    again = prepare_data(cfg, SCHEMA, s3_storage_options)
    assert copy.read_bytes() == (tmp_path / "rows.txt").read_bytes() and not left.exists()
    assert sum(count_rows(f) for f in list_files(again.train_path)) == 64              # 80 lines, 4 of 5 train
    missing = DataConfig(source="criteo", criteo_path=f"s3://{s3_bucket}/criteo-text/nope.txt",
                         cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=rf"^model\.data\.criteo_path: file not found: s3://{s3_bucket}/criteo-text/"
                                          rf"nope\.txt$"):
        prepare_data(missing, SCHEMA, s3_storage_options)


def test_a_word2vec_corpus_on_s3_is_copied_beside_its_arrow_dir_and_converted(moto_s3, s3_bucket, s3_storage_options,
                                                                               tmp_path):
    """``model.corpus`` by URI was taken for a local path (abspath of 's3:/...': 'not found'); it is copied
    beside ``model.arrow_dir`` and converted as a local corpus, the same vocabulary."""
    import dataclasses

    from engine.config import load_config
    from engine.programs.word2vec import corpus_meta
    from engine.programs.word2vec import prepare_data as w2v_prepare
    text = "\n".join(" ".join(f"w{(i * 7 + j) % 40}" for j in range(30)) for i in range(200)) + "\n"
    (tmp_path / "corpus.txt").write_text(text)
    key = f"{s3_bucket}/w2v/corpus.txt"
    _put(moto_s3, key, text.encode())
    from pathlib import Path
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "word2vec.yaml", ["model.min_count=1"])
    remote = dataclasses.replace(cfg.model.params, corpus=f"s3://{key}", arrow_dir=str(tmp_path / "remote"))
    local = dataclasses.replace(cfg.model.params, corpus=str(tmp_path / "corpus.txt"),
                                arrow_dir=str(tmp_path / "local"))
    got, want = w2v_prepare(remote, s3_storage_options), w2v_prepare(local)
    assert got.corpus == str(tmp_path / "remote.download" / "corpus.txt")
    assert (tmp_path / "remote.download" / "corpus.txt").read_text() == text
    a, b = corpus_meta(got.arrow_dir), corpus_meta(want.arrow_dir)
    assert a["vocab_size"] == b["vocab_size"] == 40 and a["total_tokens"] == b["total_tokens"] == 6000


def test_an_object_deleted_after_the_listing_is_named_as_deleted_at_its_open(inputs, moto_s3, s3_bucket,
                                                                             s3_storage_options):
    """Between two epochs: the open found nothing and raised a plain FileNotFoundError (exit 1, a traceback,
    a restart that listed the directory without the file and trained on fewer rows). It is the same
    change as an object written again: InputChangedError, exit 2."""
    from streaming.inputs import InputChangedError
    local, _ = inputs
    key = f"{s3_bucket}/remote-deleted-between/{FILES[1]}"
    _put(moto_s3, key, (local / FILES[1]).read_bytes())
    (f,) = list_files(f"s3://{key}", storage_options=s3_storage_options)
    assert pa.Table.from_batches(list(read_batches(f))).num_rows == count_rows(str(local / FILES[1]))
    _s3(moto_s3).delete_file(key)
    with pytest.raises(InputChangedError, match=rf"^s3://{key}: row 1: field <[^>]+>: expected the object "
                                                rf"as the job listed it \(\d+ bytes.*\), got none: deleted"):
        list(read_batches(f))
