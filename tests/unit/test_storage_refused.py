"""A checkpoint storage that refuses writes for good (a read-only file system, access refused, a full
disk or quota) is told from one that may answer again (``hdfs_io.permanent_failure``), in this process
(the OSError's errno, through ``raise ... from``) and across gRPC (a server marks its reply
``[permanent storage failure: EROFS]``), so ``engine train`` ends the job at once with one resumable line
and exit 74 instead of restarting it into the same failed save ``cluster.max_restarts`` times (before,
each restart trained again since the last checkpoint: 4 attempts, then exit 1 without a resume line)."""
from __future__ import annotations

import errno

import numpy as np
import pytest

import hdfs_io
from engine.checkpoint import CheckpointManager
from engine.errors import CheckpointStorageError
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT])
def test_the_errnos_no_restart_mends_are_permanent(code):
    assert hdfs_io.permanent_failure(OSError(code, "x")) == errno.errorcode[code]
    try:                                          # raised from one: the chain is followed
        try:
            raise OSError(code, "x")
        except OSError as e:
            raise hdfs_io.StorageUnavailableError("checkpoint save failed") from e
    except hdfs_io.StorageError as wrapped:
        assert hdfs_io.permanent_failure(wrapped) == errno.errorcode[code]


@pytest.mark.parametrize("exc", [ConnectionRefusedError(errno.ECONNREFUSED, "refused"), FileNotFoundError("gone"),
                                 OSError("AWS Error NETWORK_CONNECTION"), hdfs_io.StorageUnavailableError("down"),
                                 RuntimeError("permanent storage failure: (none)")])
def test_what_a_later_attempt_may_not_meet_is_not_permanent(exc):
    assert hdfs_io.permanent_failure(exc) is None


def test_a_servers_save_onto_a_read_only_disk_says_so_across_the_wire(tmpfs):
    disk = tmpfs("ckpt", 1 << 20, read_only=True)
    cfg = TableConfig(dim=4, optimizer="sgd", initializer="uniform", num_threads=1)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=16, local_shards=1)
    client = PSClient(InProcessTransport([server]))
    client.push("emb", np.arange(1, 11, dtype=np.uint64), np.ones((10, 4), np.float32))
    with pytest.raises(CheckpointStorageError) as info:
        CheckpointManager(str(disk), "job").save(client, "base", when=0.0)
    assert "[permanent storage failure: EROFS]" in str(info.value), str(info.value)
    assert hdfs_io.permanent_failure(info.value) == "EROFS"
