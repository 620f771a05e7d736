"""A server whose checkpoint storage is gone (an S3 endpoint where nothing answers any more: connections
refused, as when the store's process died) fails a Save or a Load with ``CheckpointStorageError``: one
message naming the server, the operation, the checkpoint and the storage call that failed, a
``hdfs_io.StorageError`` (so ``engine train`` ends on it with one line, not a traceback), not retried by
the client, and the server serves on with its tables as they were.

Before, both failed INTERNAL with a traceback in the server's log, and the launcher's restore of a
restart (or ``--resume``) met while the store died ended ``engine train`` with a traceback."""
from __future__ import annotations

import socket

import numpy as np
import pytest

import hdfs_io
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
