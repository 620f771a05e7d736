"""A save onto a full checkpoint disk (a real 2 MB tmpfs, mounted by the test: root only) fails with the
storage error and the file it was writing named in the server's reply, publishes nothing, and leaves the
server serving: the same save onto a disk with room then succeeds and restores exactly.

pyarrow's error alone reads ``[Errno 28] Error writing bytes to file``: neither the file nor the table."""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from engine.errors import RemoteError
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

DIM = 8
N_KEYS = 60_000      # ~5 MB of Arrow rows: more than the 2 MB disk holds


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MB tmpfs at tmp_path/disk, unmounted after the test whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_save_onto_a_full_disk_names_the_file_publishes_nothing_and_the_server_serves_on(tmp_path, full_disk):
    cfg = TableConfig(dim=DIM, optimizer="adagrad", initializer="uniform", num_threads=1)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=64, local_shards=2)
    client = PSClient(InProcessTransport([server]))
    keys = np.arange(1, N_KEYS + 1, dtype=np.uint64)
    client.push("emb", keys, np.random.default_rng(0).normal(size=(N_KEYS, DIM)).astype(np.float32))
    live = client.pull("emb", keys).copy()

    with pytest.raises(RemoteError) as info:
        CheckpointManager(str(full_disk), "job").save(client, "base", when=0.0)
    msg = str(info.value)
    assert "No space left on device" in msg
    # the part file being written and the save it belonged to, by URI
    assert f"writing {full_disk}/job/" in msg and "/sparse/emb/" in msg and ".arrow" in msg
    assert "base of table 'emb' shard" in msg
    assert CheckpointManager(str(full_disk), "job").latest() is None
    assert not [d for d, _, files in os.walk(full_disk) if "_SUCCESS" in files]

    # nothing lost: the server answers, and a save onto a disk with room holds every row
    np.testing.assert_array_equal(client.pull("emb", keys), live)
    roomy = tmp_path / "roomy"
    CheckpointManager(str(roomy), "job").save(client, "base", when=0.0)
    fresh = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=64, local_shards=2)
    fresh_client = PSClient(InProcessTransport([fresh]))
    CheckpointManager(str(roomy), "job").restore(fresh_client)
    np.testing.assert_array_equal(fresh_client.pull("emb", keys), live)
