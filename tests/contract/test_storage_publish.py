"""Atomic publish contract (data files → manifest.json → _SUCCESS) on every storage backend."""
from __future__ import annotations

import json
import threading

import pyarrow as pa
import pytest

import hdfs_io
from hdfs_io import MANIFEST_NAME, SUCCESS_NAME, CheckpointCorruptError, NotPublishedError, Storage

FILES = {
    "part-0.arrow": b"a" * 1000,
    "part-1.arrow": b"b" * 2000,
    "dense/weights.bin": bytes(range(256)) * 4,
}


def _publish(storage: Storage, dir: str = "20240101/0100-base", **meta) -> dict:
    return hdfs_io.publish_dir(storage, dir, FILES, {"hash_version": 1, **meta})


class _Crash(BaseException):
    """Stands for the process dying (kill -9) at a chosen point of a publish."""


def _crash_before_success(storage: Storage, monkeypatch) -> None:
    real = storage.write_bytes

    def write_bytes(path, data):
        if path.endswith("/" + SUCCESS_NAME):
            raise _Crash(path)
        return real(path, data)

    monkeypatch.setattr(storage, "write_bytes", write_bytes)


def test_publish_writes_files_manifest_and_marker(storage: Storage):
    manifest = _publish(storage, parent=None, rows={"part-0": 10})
    d = "20240101/0100-base"
    assert hdfs_io.is_complete(storage, d)
    assert storage.listdir(d) == sorted([SUCCESS_NAME, MANIFEST_NAME, "dense", "part-0.arrow", "part-1.arrow"])
    assert storage.read_bytes(f"{d}/{SUCCESS_NAME}") == b""
    for name, data in FILES.items():
        assert storage.read_bytes(f"{d}/{name}") == data
    on_disk = json.loads(storage.read_bytes(f"{d}/{MANIFEST_NAME}"))
    assert on_disk == manifest
    assert manifest["manifest_version"] == 1
    assert manifest["checksum"] == "crc32"
    assert manifest["hash_version"] == 1 and manifest["rows"] == {"part-0": 10} and manifest["parent"] is None
    assert manifest["files"] == {n: hdfs_io.FileEntry.of_bytes(b).to_json() for n, b in FILES.items()}
    assert hdfs_io.read_manifest(storage, d) == manifest
    assert hdfs_io.verify(storage, d) == manifest


def test_publisher_context_with_tables_streams_and_callbacks(storage: Storage):
    table = pa.table({"k": pa.array(range(1000), pa.uint64()), "v": pa.array([0.5] * 1000, pa.float32())})
    with hdfs_io.Publisher(storage, "ck", manifest={"step": 7}) as pub:
        e0 = pub.write_table("part-0.arrow", table)
        pub.write_with("cb.bin", lambda out: out.write(b"callback"))
        with pub.open("stream.bin") as out:
            out.write(b"str")
            out.write(b"eam")
        pub.manifest["rows"] = table.num_rows
        assert not hdfs_io.is_complete(storage, "ck")
    manifest = hdfs_io.verify(storage, "ck")
    assert manifest["step"] == 7 and manifest["rows"] == 1000
    entries = hdfs_io.file_entries(manifest)
    assert list(entries) == ["cb.bin", "part-0.arrow", "stream.bin"]
    assert entries["stream.bin"] == hdfs_io.FileEntry.of_bytes(b"stream")
    assert hdfs_io.read_ipc_file(storage, "ck/part-0.arrow", expected=e0).equals(table)


def test_list_complete_skips_incomplete_dirs(storage: Storage):
    _publish(storage, "day/0100-base")
    _publish(storage, "day/0300-delta")
    storage.write_bytes("day/0200-delta/part-0.arrow", b"half")  # writer still running / crashed
    storage.write_bytes("day/stray-file", b"x")
    assert hdfs_io.list_complete(storage, "day") == ["0100-base", "0300-delta"]
    assert hdfs_io.list_complete(storage, "no-such-day") == []


def test_crash_before_success_is_never_seen(storage: Storage, monkeypatch):
    _publish(storage, "day/0100-base")
    _crash_before_success(storage, monkeypatch)
    with pytest.raises(_Crash):
        _publish(storage, "day/0200-delta")
    monkeypatch.undo()
    # data files and the manifest are all there, only the marker is missing
    assert storage.is_file(f"day/0200-delta/{MANIFEST_NAME}")
    assert storage.is_file("day/0200-delta/part-1.arrow")
    assert not hdfs_io.is_complete(storage, "day/0200-delta")
    assert hdfs_io.list_complete(storage, "day") == ["0100-base"]
    with pytest.raises(NotPublishedError) as err:
        hdfs_io.read_manifest(storage, "day/0200-delta")
    assert isinstance(err.value, FileNotFoundError)
    assert storage.uri_of("day/0200-delta") in str(err.value)
    with pytest.raises(NotPublishedError):
        hdfs_io.verify(storage, "day/0200-delta")
    # a debugging reader can still look at the leftover manifest explicitly
    assert "files" in hdfs_io.read_manifest(storage, "day/0200-delta", require_complete=False)
    # a retry of the publish cleans the leftovers and completes
    storage.write_bytes("day/0200-delta/stale-from-crash.bin", b"old")
    _publish(storage, "day/0200-delta")
    assert hdfs_io.list_complete(storage, "day") == ["0100-base", "0200-delta"]
    assert not storage.exists("day/0200-delta/stale-from-crash.bin")


def test_exception_inside_publisher_writes_no_manifest(storage: Storage):
    with pytest.raises(RuntimeError):
        with hdfs_io.Publisher(storage, "ck") as pub:
            pub.write_bytes("a.bin", b"a")
            raise RuntimeError("trainer died")
    assert storage.is_file("ck/a.bin")
    assert not storage.exists(f"ck/{MANIFEST_NAME}")
    assert not hdfs_io.is_complete(storage, "ck")
    assert hdfs_io.list_complete(storage) == []


def test_republish_requires_overwrite(storage: Storage):
    _publish(storage, "ck")
    with pytest.raises(FileExistsError):
        _publish(storage, "ck")
    hdfs_io.publish_dir(storage, "ck", {"only.bin": b"new"}, overwrite=True)
    assert storage.listdir("ck") == [SUCCESS_NAME, MANIFEST_NAME, "only.bin"]
    assert list(hdfs_io.verify(storage, "ck")["files"]) == ["only.bin"]


def test_reader_never_sees_an_incomplete_dir(storage: Storage):
    """A reader polling while a writer publishes either sees nothing or a directory that verifies."""
    done = threading.Event()
    seen: list[str] = []
    failures: list[BaseException] = []

    def reader() -> None:
        while True:
            finished = done.is_set()
            try:
                for name in hdfs_io.list_complete(storage, "day"):
                    hdfs_io.verify(storage, f"day/{name}")
                    seen.append(name)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
                return
            if finished:
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for hour in range(3):
            with hdfs_io.Publisher(storage, f"day/{hour:02d}00-delta") as pub:
                for i in range(4):
                    pub.write_bytes(f"part-{i}.arrow", bytes([hour, i]) * 5000)
    finally:
        done.set()
        thread.join(timeout=30)
    assert not failures, failures
    assert set(seen) == {"0000-delta", "0100-delta", "0200-delta"}


def test_verify_detects_missing_file(storage: Storage):
    _publish(storage, "ck")
    storage.delete("ck/part-1.arrow")
    with pytest.raises(CheckpointCorruptError, match="missing") as err:
        hdfs_io.verify(storage, "ck")
    assert err.value.uri == storage.uri_of("ck/part-1.arrow")
    assert storage.uri_of("ck/part-1.arrow") in str(err.value)


def test_verify_detects_wrong_checksum(storage: Storage):
    _publish(storage, "ck")
    storage.write_bytes("ck/dense/weights.bin", bytes(reversed(FILES["dense/weights.bin"])))  # same size
    hdfs_io.verify(storage, "ck", checksums=False)  # sizes alone cannot tell
    with pytest.raises(CheckpointCorruptError, match="crc32") as err:
        hdfs_io.verify(storage, "ck")
    assert err.value.uri == storage.uri_of("ck/dense/weights.bin")
    assert storage.uri_of("ck/dense/weights.bin") in str(err.value)


def test_verify_detects_truncated_file(storage: Storage):
    _publish(storage, "ck")
    storage.write_bytes("ck/part-0.arrow", FILES["part-0.arrow"][:500])
    for checksums in (False, True):
        with pytest.raises(CheckpointCorruptError, match="truncated") as err:
            hdfs_io.verify(storage, "ck", checksums=checksums)
        assert err.value.uri == storage.uri_of("ck/part-0.arrow")
        assert "500" in str(err.value) and "1000" in str(err.value)


def test_verify_detects_truncated_arrow_file(storage: Storage):
    table = pa.table({"k": pa.array(range(20_000), pa.uint64())})
    with hdfs_io.Publisher(storage, "ck") as pub:
        pub.write_table("part-0.arrow", table)
    data = storage.read_bytes("ck/part-0.arrow")
    storage.write_bytes("ck/part-0.arrow", data[:-100])
    with pytest.raises(CheckpointCorruptError, match="part-0.arrow"):
        hdfs_io.verify(storage, "ck")
    entry = hdfs_io.file_entries(hdfs_io.read_manifest(storage, "ck"))["part-0.arrow"]
    with pytest.raises(CheckpointCorruptError, match="part-0.arrow"):
        hdfs_io.read_ipc_file(storage, "ck/part-0.arrow", expected=entry)


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "missing"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"manifest_version": 99, "checksum": "crc32", "files": {}}).encode(), "manifest_version"),
        (json.dumps({"manifest_version": 1, "checksum": "md5", "files": {}}).encode(), "checksum"),
        (json.dumps({"manifest_version": 1, "checksum": "crc32", "files": []}).encode(), "files"),
        (
            json.dumps({"manifest_version": 1, "checksum": "crc32", "files": {"a": {"size": -1, "crc32": "0"}}}).encode(),
            "'a'",
        ),
    ],
)
def test_bad_manifest_is_corrupt(storage: Storage, content, problem):
    _publish(storage, "ck")
    if content is None:
        storage.delete(f"ck/{MANIFEST_NAME}")
    else:
        storage.write_bytes(f"ck/{MANIFEST_NAME}", content)
    for read in (hdfs_io.read_manifest, hdfs_io.verify):
        with pytest.raises(CheckpointCorruptError, match=problem) as err:
            read(storage, "ck")
        assert err.value.uri == storage.uri_of(f"ck/{MANIFEST_NAME}")


def test_publisher_input_checks(storage: Storage):
    with pytest.raises(ValueError, match="reserved"):
        hdfs_io.publish_dir(storage, "ck", {"a": b"1"}, {"files": {}})
    with pytest.raises(ValueError):
        hdfs_io.publish_dir(storage, "ck", {MANIFEST_NAME: b"1"})
    with pytest.raises(ValueError):
        hdfs_io.publish_dir(storage, "ck", {SUCCESS_NAME: b"1"})
    with pytest.raises(ValueError):
        hdfs_io.Publisher(storage, "")
    with pytest.raises(ValueError, match="already written"):
        with hdfs_io.Publisher(storage, "ck") as pub:
            pub.write_bytes("a", b"1")
            pub.write_bytes("a", b"2")
    with pytest.raises(ValueError, match="JSON"):
        hdfs_io.publish_dir(storage, "ck2", {"a": b"1"}, {"bad": object()})
    assert hdfs_io.list_complete(storage) == []
