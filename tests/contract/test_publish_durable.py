"""Publisher.commit: fsync before ``_SUCCESS`` on a local disk, and refusal to publish a directory that
is no longer the publisher's own (another writer published, deleted or rewrote it). hdfs_io only."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hdfs_io
from hdfs_io import MANIFEST_NAME, SUCCESS_NAME, CheckpointCorruptError, Publisher, Storage

REPO = Path(__file__).resolve().parents[2]
DIR = "20240101/1000-delta.1"


# ---------------------------------------------------------------- ownership (every backend)

def test_second_writer_published_first_is_refused(storage: Storage):
    """e2: a zombie publisher's directory is taken over and published by a new writer; the zombie's
    commit must fail instead of overwriting the published manifest and re-marking it complete."""
    zombie = Publisher(storage, DIR, manifest={"who": "zombie"}).__enter__()
    zombie.write_bytes("part-0.arrow", b"z" * 300)
    zombie.write_bytes("dense/w.bin", b"z" * 40)
    hdfs_io.publish_dir(storage, DIR, {"part-0.arrow": b"n" * 100}, {"who": "new"})   # removes the zombie's files
    published = hdfs_io.verify(storage, DIR)
    with pytest.raises(CheckpointCorruptError) as err:
        zombie.commit()
    assert storage.uri_of(DIR) in str(err.value) and SUCCESS_NAME in str(err.value)
    assert err.value.uri == storage.uri_of(DIR)
    assert hdfs_io.verify(storage, DIR) == published          # the new writer's checkpoint is intact
    assert published["who"] == "new"


def test_directory_pruned_before_commit_is_refused(storage: Storage):
    """e3: a retention pass deletes the in-flight directory; the commit must not publish an empty
    'complete' directory."""
    pub = Publisher(storage, DIR).__enter__()
    pub.write_bytes("part-0.arrow", b"a" * 500)
    pub.write_bytes("part-1.arrow", b"b" * 500)
    storage.delete(DIR)
    with pytest.raises(CheckpointCorruptError) as err:
        pub.commit()
    assert err.value.uri == storage.uri_of(f"{DIR}/part-0.arrow")
    assert "part-0.arrow" in str(err.value) and "missing" in str(err.value)
    assert not hdfs_io.is_complete(storage, DIR)
    assert hdfs_io.list_complete(storage, "20240101") == []


def test_files_rewritten_by_a_second_writer_are_refused(storage: Storage):
    """Two publishers on one directory, the second still writing when the first commits: the first
    sees its files replaced (another size) or gone and refuses; the second then publishes."""
    first = Publisher(storage, DIR).__enter__()
    first.write_bytes("part-0.arrow", b"1" * 700)
    first.write_bytes("part-1.arrow", b"1" * 700)
    second = Publisher(storage, DIR).__enter__()                 # removes the first one's files
    second.write_bytes("part-0.arrow", b"2" * 650)
    with pytest.raises(CheckpointCorruptError) as err:
        first.commit()
    assert err.value.uri == storage.uri_of(f"{DIR}/part-0.arrow")
    assert "size is 650 bytes, manifest says 700" in str(err.value)
    assert not hdfs_io.is_complete(storage, DIR)
    second.write_bytes("part-1.arrow", b"2" * 10)
    second.commit()                  # the refused commit wrote nothing: the second writer publishes
    manifest = hdfs_io.verify(storage, DIR)
    assert manifest["files"]["part-0.arrow"]["size"] == 650


def test_concurrent_manifest_blocks_the_other_commit(storage: Storage):
    """Two publishers reach commit on one directory: once one has written its manifest, the other is
    refused (atomically on a local disk, O_EXCL; check-then-write elsewhere)."""
    first = Publisher(storage, DIR).__enter__()
    first.write_bytes("part-0.arrow", b"1" * 70)
    storage.create_new(f"{DIR}/{MANIFEST_NAME}", b"{}")    # the other one's commit is under way
    with pytest.raises(CheckpointCorruptError, match=MANIFEST_NAME):
        first.commit()
    assert not hdfs_io.is_complete(storage, DIR)


def test_manifest_replaced_before_success_is_refused(storage: Storage, monkeypatch):
    """Another writer's manifest lands between ours and _SUCCESS: refuse rather than mark theirs ours."""
    pub = Publisher(storage, DIR).__enter__()
    pub.write_bytes("part-0.arrow", b"a" * 10)
    real = storage.create_new

    def create_new(path, data):
        entry = real(path, data)
        storage.write_bytes(path, b'{"someone": "else"}')
        return entry

    monkeypatch.setattr(storage, "create_new", create_new)
    with pytest.raises(CheckpointCorruptError, match="manifest.json: replaced"):
        pub.commit()
    assert not hdfs_io.is_complete(storage, DIR)


def test_a_commit_retried_after_a_failure_past_its_manifest_finishes_with_the_same_manifest(storage: Storage,
                                                                                           monkeypatch):
    """_SUCCESS fails to be written once (storage down): the same publisher's second commit() finishes the
    publish with the manifest it created (it used to refuse its own manifest as another writer's)."""
    pub = Publisher(storage, DIR, manifest={"who": "me"}).__enter__()
    pub.write_bytes("part-0.arrow", b"a" * 10)
    real = storage.write_bytes
    failed = []

    def write_bytes(path, data, *a, **k):
        if path.endswith(SUCCESS_NAME) and not failed:
            failed.append(path)
            raise OSError("storage down")
        return real(path, data, *a, **k)

    monkeypatch.setattr(storage, "write_bytes", write_bytes)
    with pytest.raises(OSError, match="storage down"):
        pub.commit()
    first = storage.read_bytes(f"{DIR}/{MANIFEST_NAME}")
    assert failed and not hdfs_io.is_complete(storage, DIR)
    m = pub.commit()
    assert hdfs_io.is_complete(storage, DIR) and m["who"] == "me"
    assert storage.read_bytes(f"{DIR}/{MANIFEST_NAME}") == first
    assert list(hdfs_io.verify(storage, DIR)["files"]) == ["part-0.arrow"]


def test_normal_publish_and_overwrite_still_work(storage: Storage):
    hdfs_io.publish_dir(storage, DIR, {"a.bin": b"a", "sub/b.bin": b"bb"})
    hdfs_io.publish_dir(storage, DIR, {"a.bin": b"new"}, overwrite=True)
    assert list(hdfs_io.verify(storage, DIR)["files"]) == ["a.bin"]


def test_create_new_is_exclusive(storage: Storage):
    assert storage.create_new("x/m.json", b"abc").size == 3
    with pytest.raises(FileExistsError) as err:
        storage.create_new("x/m.json", b"other")
    assert storage.uri_of("x/m.json") in str(err.value)
    assert storage.read_bytes("x/m.json") == b"abc"


def test_sync_local_and_noop_elsewhere(storage: Storage):
    storage.write_bytes("d/f.bin", b"x")
    storage.sync("d/f.bin")
    storage.sync("d")
    storage.sync("")
    if storage.is_local:
        with pytest.raises(FileNotFoundError) as err:
            storage.sync("d/nope.bin")
        assert storage.uri_of("d/nope.bin") in str(err.value)
    else:
        storage.sync("d/nope.bin")        # no-op off local disk


# ---------------------------------------------------------------- durability (local disk, strace)

_PUBLISH = textwrap.dedent("""
    import sys
    import pyarrow.fs as pafs
    sys.path.insert(0, {repo!r})
    import hdfs_io
    st = hdfs_io.Storage(pafs.LocalFileSystem(), {root!r})
    files = {{f"part-{{i}}.arrow": bytes([i]) * (1000 + i) for i in range(12)}}
    files.update({{f"dense/t{{i}}.arrow": bytes([i]) * 77 for i in range(3)}})
    files["dense/deep/x.bin"] = b"x" * 5
    hdfs_io.publish_dir(st, {dir!r}, files, {{"kind": "base"}})
    print("ok")
""")

_LINE = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?(\w+)\((.*)\)\s+=\s+(-?\d+)")


def _strace_usable() -> str | None:
    exe = shutil.which("strace")
    if exe is None:
        return "strace is not installed: the fsync order of a publish cannot be observed"
    probe = subprocess.run([exe, "-f", "-o", "/dev/null", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"strace cannot trace here (ptrace not permitted?): {probe.stderr.strip()[:200]}"
    return None


def test_local_publish_fsyncs_everything_before_success(tmp_path: Path):
    reason = _strace_usable()
    if reason:
        pytest.skip(reason)
    root = tmp_path / "ckpt"
    script = tmp_path / "publish.py"
    script.write_text(_PUBLISH.format(repo=str(REPO), root=str(root), dir="20240101/0000-base"))
    log = tmp_path / "strace.log"
    res = subprocess.run(["strace", "-f", "-e", "trace=fsync,openat,mkdir,rename", "-y", "-o", str(log),
                          sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]

    pub = root / "20240101" / "0000-base"
    data = sorted(str(p) for p in pub.rglob("*") if p.is_file() and p.name not in (MANIFEST_NAME, SUCCESS_NAME))
    assert len(data) == 16
    success, manifest = str(pub / SUCCESS_NAME), str(pub / MANIFEST_NAME)
    fsynced: dict[str, list[int]] = {}      # path -> strace line numbers where an fsync of it returned 0
    pending: dict[str, str] = {}            # pid -> path of its unfinished fsync
    created_success = None
    for i, line in enumerate(log.read_text().splitlines()):
        pid = line.split(" ", 1)[0]
        # the call that creates _SUCCESS, whether strace printed it whole or cut it (<unfinished ...>,
        # another thread's call in between): its start is the instant that counts
        if (created_success is None and f'"{success}"' in line and not re.search(r"\)\s+=\s+-\d+", line)
                and (("openat(" in line and "O_CREAT" in line) or "rename(" in line)):
            created_success = i
        start = re.search(r"fsync\(\d+<([^>]*)>", line)
        if start and "<unfinished" in line:
            pending[pid] = start.group(1)
            continue
        if "<... fsync resumed>" in line:
            path = pending.pop(pid)
            if re.search(r"\)\s+=\s+0\s*$", line):
                fsynced.setdefault(path, []).append(i)
            continue
        m = _LINE.match(line)
        if not m or int(m.group(3)) < 0:
            continue
        if m.group(1) == "fsync":
            fsynced.setdefault(start.group(1), []).append(i)
    assert created_success is not None, "the publish never created _SUCCESS; strace's lines naming it:\n" + \
        "\n".join(ln for ln in log.read_text().splitlines() if SUCCESS_NAME in ln)[-3000:]

    def synced_before(path: str) -> bool:
        return any(i < created_success for i in fsynced.get(path, []))

    def synced_after(path: str) -> bool:
        return any(i > created_success for i in fsynced.get(path, []))

    not_synced = [p for p in data + [manifest] if not synced_before(p)]
    assert not not_synced, f"not fsynced before {SUCCESS_NAME} was created: {not_synced}"
    for d in (pub / "dense" / "deep", pub / "dense", pub):
        assert synced_before(str(d)), f"directory {d} not fsynced before {SUCCESS_NAME}"
    assert synced_after(success), f"{SUCCESS_NAME} itself was not fsynced"
    for d in (pub, pub.parent, root):
        assert synced_after(str(d)), f"directory {d} not fsynced after {SUCCESS_NAME} was created"
    # and nothing twice in one phase: the directory once before _SUCCESS (with the manifest in it, which
    # makes the data files' entries durable too) and once after; it was fsynced a third time right
    # before the manifest was created, for nothing
    counts = {p: len(lines) for p, lines in fsynced.items() if p.startswith(str(root))}
    assert counts.pop(str(pub)) == 2, fsynced[str(pub)]
    assert set(counts.values()) == {1}, {p: n for p, n in counts.items() if n != 1}
