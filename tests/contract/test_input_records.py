"""The job's input records (``engine.programs.ctr_records``): a start whose train and test files are the
versions an earlier start checked reads neither again (the launcher's check, the rows, the fingerprint),
and a file written again, touched, or a record that is damaged is read and checked as before. On a local
directory and on a real S3 server (moto's, on 127.0.0.1), whose own request log counts the reads."""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from engine.config import load_config
from engine.programs.ctr import follow
from engine.programs.ctr_data import expected_schema, file_rows, files_fingerprint
from engine.programs.ctr_inputs import check_splits
from engine.programs.ctr_records import RECORD_DIR, Listing, Records, check_key
from streaming.criteo import convert_criteo, generate_criteo
from streaming.errors import DataFormatError
from streaming.source import list_files

REPO = Path(__file__).resolve().parents[2]
SLOTS = ["C1", "C2", "C3"]
SCHEMA = expected_schema(SLOTS, 13)


def _split(d: Path) -> tuple[Path, Path]:
    """(train dir of 3 IPC streams, test dir of 1) of generated Criteo rows."""
    generate_criteo(d / "rows.txt", 900, 3)
    convert_criteo([d / "rows.txt"], d / "conv", split="train", batch_size=50)
    convert_criteo([d / "rows.txt"], d / "test", split="test", batch_size=50)
    t = pa.concat_tables(pa.ipc.open_stream(str(f)).read_all() for f in sorted((d / "conv").glob("*.arrow")))
    (d / "train").mkdir()
    third = t.num_rows // 3
    for i in range(3):
        _write(d / "train" / f"part-{i}.arrow", t.slice(i * third, third if i < 2 else t.num_rows - 2 * third))
    return d / "train", d / "test"


def _write(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=50)


def _read(path: Path) -> pa.Table:
    """The whole file in memory (not mapped: the tests write it again under the same name)."""
    return pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()


def _cfg(tmp: Path, train, test, *sets: str):
    cfg = load_config(REPO / "configs" / "ctr.yaml", [
        "model.data.source=arrow", f"model.data.train_path={train}", f"model.data.test_path={test}",
        "model.slots=[C1, C2, C3]", f"checkpoint.root={tmp / 'ckpt'}", f"model.metrics_file={tmp / 'm.jsonl'}",
        *sets])
    return cfg, cfg.model.params.data


def _records(tmp: Path) -> list[Path]:
    return sorted((tmp / "ckpt" / "ctr_dnn" / RECORD_DIR).glob("*.json"))


def test_a_second_start_on_the_same_files_reads_nothing_again_and_a_rewritten_file_is_checked(tmp_path, caplog):
    train, test = _split(tmp_path)
    cfg, data = _cfg(tmp_path, train, test)
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr_inputs"):
        rows, test_rows = check_splits(cfg, data, SCHEMA)
    assert rows == sum(file_rows(str(train))) and test_rows > 0
    assert "checked by an earlier start" not in caplog.text
    assert [p.name.split("-")[0] for p in _records(tmp_path)] == ["test", "train"]
    listing = Listing(Records.of(cfg), "train", list_files(str(train)))
    assert listing.rows == file_rows(str(train))                        # what the workers read at their start
    assert listing.fingerprint == files_fingerprint(str(train))
    assert listing.checked(check_key("train", SCHEMA))

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr_inputs"):
        assert check_splits(cfg, data, SCHEMA) == (rows, None)          # test rows: not counted again
    assert caplog.text.count("values checked by an earlier start, the files unchanged since") == 2
    assert follow(cfg).total == rows * cfg.model.params.epochs          # the progress bar's count, recorded

    # the same name, written again with a bad label: another version, read and refused
    t = _read(train / "part-1.arrow")
    labels = t.column("label").to_numpy().copy()
    labels[7] = 3.0
    _write(train / "part-1.arrow", t.set_column(0, "label", pa.array(labels, pa.float32())))
    with pytest.raises(DataFormatError, match=r"part-1\.arrow: row 8: field label"):
        check_splits(cfg, data, SCHEMA)

    # the test split alike: a bad value in a test file checked before is found
    _write(train / "part-1.arrow", t)
    check_splits(cfg, data, SCHEMA)
    (f,) = sorted(test.glob("*.arrow"))[:1]
    tt = _read(f)
    dense = tt.column("dense").to_pylist()
    dense[3] = [float("nan")] * len(dense[3])
    _write(f, tt.set_column(tt.schema.get_field_index("dense"), "dense", pa.array(dense, tt.schema.field("dense").type)))
    with pytest.raises(DataFormatError, match=rf"{f.name}: row 4: field dense"):
        check_splits(cfg, data, SCHEMA)


def test_a_touched_file_or_a_damaged_record_is_read_again_and_the_record_mended(tmp_path, caplog):
    train, test = _split(tmp_path)
    cfg, data = _cfg(tmp_path, train, test)
    check_splits(cfg, data, SCHEMA)
    os.utime(train / "part-0.arrow")                # the same bytes, another version: read again, recorded again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr_inputs"):
        check_splits(cfg, data, SCHEMA)
    assert caplog.text.count("checked by an earlier start") == 1        # the test split only
    for rec in _records(tmp_path):                  # damaged: cut short, or its facts edited by hand
        body = json.loads(rec.read_text())
        if rec.name.startswith("train"):
            rec.write_text(rec.read_text()[:40])
        else:
            rec.write_text(json.dumps({**body, "checked": body["checked"] + ["0" * 16]}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.programs"):
        check_splits(cfg, data, SCHEMA)
    assert "checked by an earlier start" not in caplog.text
    assert caplog.text.count("is damaged or names other files (ignored") >= 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr_inputs"):
        check_splits(cfg, data, SCHEMA)             # mended by the run before
    assert caplog.text.count("checked by an earlier start") == 2


def test_without_checkpoints_nothing_is_recorded_and_every_start_checks(tmp_path, caplog):
    train, test = _split(tmp_path)
    cfg, data = _cfg(tmp_path, train, test, "checkpoint.root=")
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.programs.ctr_inputs"):
            assert check_splits(cfg, data, SCHEMA)[1] > 0
        assert "checked by an earlier start" not in caplog.text
    assert not (tmp_path / "ckpt").exists()


def test_a_record_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path, caplog):
    train, test = _split(tmp_path)
    cfg, data = _cfg(tmp_path, train, test)
    (tmp_path / "ckpt" / "ctr_dnn").mkdir(parents=True)
    (tmp_path / "ckpt" / "ctr_dnn" / RECORD_DIR).write_text("a file where the directory goes")
    with caplog.at_level(logging.WARNING):
        rows, test_rows = check_splits(cfg, data, SCHEMA)
    assert rows == sum(file_rows(str(train))) and test_rows > 0
    assert "could not be written" in caplog.text


class _Requests(logging.Handler):
    """Counts the GET and HEAD requests in moto's own request log (werkzeug's access log)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()))     # moto colours some lines

    def count(self, verb: str) -> int:
        return sum(1 for line in self.lines if f'"{verb} /' in line)


def test_on_s3_a_second_start_costs_a_head_per_file_and_a_rewritten_object_is_read(tmp_path, moto_s3, s3_bucket,
                                                                                   caplog):
    train, test = _split(tmp_path)
    s3 = pafs.S3FileSystem(access_key=moto_s3.access_key, secret_key=moto_s3.secret_key, region=moto_s3.region,
                           scheme="http", endpoint_override=moto_s3.endpoint)
    base = f"{s3_bucket}/records-{tmp_path.name}"
    for split, d in (("train", train), ("test", test)):
        pafs.copy_files(str(d), f"{base}/{split}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=s3)
    o = moto_s3.options()
    cfg, data = _cfg(tmp_path, f"s3://{base}/train", f"s3://{base}/test", f"storage.endpoint={o.endpoint_override}",
                     "storage.scheme=http", f"storage.region={o.region}", f"storage.access_key={o.access_key}",
                     f"storage.secret_key={o.secret_key}", f"checkpoint.root=s3://{base}/ckpt")
    log = logging.getLogger("werkzeug")
    counter, level = _Requests(), log.level
    log.addHandler(counter)
    log.setLevel(logging.INFO)
    try:
        first = check_splits(cfg, data, SCHEMA, cfg.storage.options())
        gets_first = counter.count("GET")
        counter.lines.clear()
        assert check_splits(cfg, data, SCHEMA, cfg.storage.options()) == (first[0], None)
        files = len(list_files(str(train))) + len(list_files(str(test)))
        # listings (GET ?list-type), one HEAD per file, the two records: no byte of the data read
        assert counter.count("HEAD") <= 2 * files + 4, counter.lines
        data_gets = [x for x in counter.lines if '"GET /' in x and "list-type" not in x and RECORD_DIR not in x]
        assert not data_gets, data_gets
        assert gets_first > 3 * files                                    # the first start read every file
    finally:
        log.removeHandler(counter)
        log.setLevel(level)
    # an object written again (other rows) under the same name: its ETag differs, it is read and checked
    t = _read(train / "part-2.arrow")
    labels = t.column("label").to_numpy().copy()
    labels[1] = -1.0
    _write(tmp_path / "bad.arrow", t.set_column(0, "label", pa.array(labels, pa.float32())))
    s3.copy_file(f"{base}/train/part-2.arrow", f"{base}/part-2.good")
    pafs.copy_files(str(tmp_path / "bad.arrow"), f"{base}/train/part-2.arrow",
                    source_filesystem=pafs.LocalFileSystem(), destination_filesystem=s3)
    with pytest.raises(DataFormatError, match=r"part-2\.arrow: row 2: field label"):
        check_splits(cfg, data, SCHEMA, cfg.storage.options())


def test_checks_that_changed_since_a_record_read_the_data_again(tmp_path, caplog, monkeypatch):
    """A record vouches for the checks of the engine that wrote it: their source code is in its key
    (ctr_records.checks_digest), so an engine whose checks differ (an upgrade) checks the data again."""
    from engine.programs import ctr_records
    train, test = _split(tmp_path)
    cfg, data = _cfg(tmp_path, train, test)
    check_splits(cfg, data, SCHEMA)
    monkeypatch.setattr(ctr_records, "checks_digest", lambda: "another engine's checks")
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr_inputs"):
        assert check_splits(cfg, data, SCHEMA)[1] > 0
    assert "checked by an earlier start" not in caplog.text


def test_a_job_keeps_its_newest_records_only(tmp_path, caplog, monkeypatch):
    from engine.programs import ctr_records
    monkeypatch.setattr(ctr_records, "MAX_RECORDS", 3)
    train, test = _split(tmp_path)
    cfg, data = _cfg(tmp_path, train, test)
    for i in range(4):                       # a directory that changes between starts: a new listing each time
        os.utime(train / f"part-{i % 3}.arrow")
        check_splits(cfg, data, SCHEMA)
        assert len(_records(tmp_path)) <= 3
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr_inputs"):
        check_splits(cfg, data, SCHEMA)      # the newest records were kept: nothing read
    assert caplog.text.count("checked by an earlier start") == 2
