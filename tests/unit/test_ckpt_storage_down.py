"""A server whose checkpoint storage is gone (an S3 endpoint where nothing answers any more: connections
refused, as when the store's process died) fails a Save or a Load with ``CheckpointStorageError``: one
message naming the server, the operation, the checkpoint and the storage call that failed, a
``hdfs_io.StorageError`` (so ``engine train`` ends on it with one line, not a traceback), not retried by
the client, and the server serves on with its tables as they were.

Before, both failed INTERNAL with a traceback in the server's log, and the launcher's restore of a
restart (or ``--resume``) met while the store died ended ``engine train`` with a traceback."""
from __future__ import annotations

import socket
import subprocess

import numpy as np
import pytest

import hdfs_io
from engine.checkpoint import CheckpointManager
from engine.errors import CheckpointStorageError
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

ROOT = "s3://ckpt-bucket/root"


def _dead_endpoint() -> str:
    """host:port of a loopback port nobody listens on (bound, then closed: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def cluster():
    hdfs_io.clear_cache()
    opts = hdfs_io.StorageOptions(endpoint_override=_dead_endpoint(), scheme="http", region="us-east-1",
                                  access_key="k", secret_key="s", connect_timeout_s=1.0, sdk_retry_attempts=1)
    cfg = TableConfig(dim=4, optimizer="sgd", initializer="uniform", num_threads=1)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=16, local_shards=1,
                      storage_options=opts, checkpoint_root=ROOT)
    client = PSClient(InProcessTransport([server]), retries=2)
    keys = np.arange(1, 101, dtype=np.uint64)
    client.push("emb", keys, np.ones((100, 4), np.float32))
    yield client, keys
    hdfs_io.clear_cache()


def test_a_save_onto_a_dead_store_names_it_and_the_server_serves_on(cluster):
    client, keys = cluster
    live = client.pull("emb", keys).copy()
    uri = f"{ROOT}/job/20240101/0000-base"
    with pytest.raises(CheckpointStorageError) as info:
        client.save(uri)
    e = info.value
    assert isinstance(e, hdfs_io.StorageError) and e.code == "FAILED_PRECONDITION", repr(e)
    assert f"checkpoint storage error: save of {uri} failed" in str(e), str(e)
    assert "failed after 5 attempts" in str(e) and f"{uri}/sparse/emb/" in str(e), str(e)   # the call, the file
    np.testing.assert_array_equal(client.pull("emb", keys), live)


def test_a_load_from_a_dead_store_names_it_and_changes_nothing(cluster):
    client, keys = cluster
    live = client.pull("emb", keys).copy()
    uri = f"{ROOT}/job/20240101/0000-base"
    with pytest.raises(CheckpointStorageError) as info:
        client.load(uri)
    e = info.value
    assert isinstance(e, hdfs_io.StorageError), repr(e)
    assert f"checkpoint storage error: load of {uri} failed" in str(e), str(e)
    assert "failed after 5 attempts" in str(e) and uri in str(e).split("failed:", 1)[1], str(e)
    np.testing.assert_array_equal(client.pull("emb", keys), live)


class _ThenReadOnly:
    """The client as the coordinator's cluster, whose disk turns read-only once every server wrote its
    parts: the coordinator's own writes (``manifest.json``, ``_SUCCESS``) meet the read-only disk."""

    def __init__(self, client: PSClient, disk):
        self.client, self.disk, self.num_servers = client, disk, client.num_servers

    def save(self, uri: str, parent: str = "") -> int:
        rows = self.client.save(uri, parent)
        subprocess.run(["mount", "-o", "remount,ro", str(self.disk)], check=True, timeout=30)
        return rows


def test_a_disk_turned_read_only_inside_a_save_names_the_file_and_publishes_nothing(tmp_path, tmpfs):
    """The coordinator's own failure is typed too (``StorageUnavailableError`` naming the root and the file),
    so a role ends on it with one line; before, pyarrow's plain OSError and a traceback."""
    disk = tmpfs("ckpt", 8 << 20)
    cfg = TableConfig(dim=4, optimizer="sgd", initializer="uniform", num_threads=1)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=16, local_shards=1)
    client = PSClient(InProcessTransport([server]))
    client.push("emb", np.arange(1, 101, dtype=np.uint64), np.ones((100, 4), np.float32))
    mgr = CheckpointManager(str(disk), "job")
    with pytest.raises(hdfs_io.StorageUnavailableError) as info:
        mgr.save(_ThenReadOnly(client, disk), "base", when=0.0)
    msg = str(info.value)
    assert f"checkpoint save under {disk}/job failed, nothing published" in msg, msg
    assert "Read-only file system" in msg and "manifest.json" in msg, msg
    subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True, timeout=30)
    assert mgr.latest() is None and not list(disk.rglob("_SUCCESS"))
    assert mgr.save(client, "delta", when=60.0)["kind"] == "base"     # the store back: the next save, a base
    assert mgr.latest() is not None


def test_a_retention_that_fails_after_the_publish_does_not_fail_the_published_save(tmp_path, tmpfs):
    """A base is published, then its retention cannot delete the base before it (here a directory busy
    with a mount inside it, EBUSY through the retries): the save returns the published checkpoint with
    a warning, and the next base's retention tries again. Before, the save raised although its checkpoint
    was complete, and worker 0 failed the attempt."""
    cfg = TableConfig(dim=4, optimizer="sgd", initializer="uniform", num_threads=1)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=16, local_shards=1)
    client = PSClient(InProcessTransport([server]))
    keys = np.arange(1, 101, dtype=np.uint64)
    client.push("emb", keys, np.ones((100, 4), np.float32))
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job", keep_bases=1)
    first = mgr.save(client, "base", when=0.0)["name"]
    tmpfs(f"ckpt/job/{first}/held", 1 << 20)          # the old base cannot be deleted while it is mounted
    client.push("emb", keys, np.ones((100, 4), np.float32))
    second = mgr.save(client, "base", when=60.0)
    assert mgr.latest().name == second["name"] != first
    fresh = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=16, local_shards=1)
    fresh_client = PSClient(InProcessTransport([fresh]))
    CheckpointManager(str(tmp_path / "ckpt"), "job").restore(fresh_client)
    np.testing.assert_array_equal(fresh_client.pull("emb", keys), client.pull("emb", keys))


def test_a_role_mode_servers_own_restore_from_a_dead_store_ends_on_the_storage_error(cluster):
    """``--role server --resume``: the server restores itself (``engine.roles._OneServer``). A store that
    fails inside that Load is the same ``CheckpointStorageError`` (``engine train``'s one line, exit 1 for
    its scheduler). Before, a RuntimeError: a traceback (reproduced with moto stopped in the Load)."""
    from engine.roles import _OneServer
    client, _ = cluster
    server = client.transport.servers[0]
    uri = f"{ROOT}/job/20240101/0000-base"
    with pytest.raises(CheckpointStorageError) as info:
        _OneServer(server).load(uri)
    assert f"checkpoint storage error: load of {uri} failed" in str(info.value), str(info.value)
    assert hdfs_io.permanent_failure(info.value) is None        # down, not refusing: its scheduler restarts it
