"""A checkpoint file read batch by batch (``hdfs_io.arrow_io.open_ipc_batches``, files over
``STREAM_MIN_BYTES``) from a real S3 server (moto, a process of its own) behind a TCP relay; the relay is
killed between two batches, so the store stops answering in the middle of the read. That is the store's
failure (an ``OSError``, which a server's Load reports as a checkpoint storage error and a restart meets
again only if the store stays down), not a damaged file: before, pyarrow's ``ArrowIOError`` (an alias of
``OSError``) was caught as a parse error and the read said ``CheckpointCorruptError`` "not a readable
Arrow IPC file", so a restore with fallback took the checkpoint for damaged and went back to the one
before it. Bytes that do not parse are still damage (the last test)."""
from __future__ import annotations

import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import hdfs_io
from hdfs_io import arrow_io
from tests.integration.test_remote_inputs_train import _free_port, _moto, _relay

ROWS = 64 * 1024         # a batch: 512 KiB of uint64
BATCHES = 8


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """``(storage through the relay, the relay process, the file's FileEntry)``: moto, a relay in front of
    it, bucket ``ckpt`` with ``part.arrow`` (8 batches of random uint64, 4 MiB) written through the relay.
    ``STREAM_MIN_BYTES`` is lowered to 1 MiB so that a file of that size is read batch by batch."""
    monkeypatch.setattr(arrow_io, "STREAM_MIN_BYTES", 1 << 20)
    moto_port, relay_port = _free_port(), _free_port()
    moto = _moto(moto_port, tmp_path / "moto.log")
    relay = None
    try:
        relay = _relay(relay_port, moto_port)
        opts = hdfs_io.StorageOptions(endpoint_override=f"127.0.0.1:{relay_port}", scheme="http",
                                      region="us-east-1", access_key="testing", secret_key="testing",
                                      connect_timeout_s=1, request_timeout_s=3, sdk_retry_attempts=1)
        pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                          endpoint_override=f"127.0.0.1:{moto_port}", allow_bucket_creation=True).create_dir("ckpt")
        storage = hdfs_io.Storage.from_uri("s3://ckpt/job", storage_options=opts,
                                           retry=hdfs_io.RetryPolicy(max_attempts=1))
        rng = np.random.default_rng(0)
        schema = pa.schema([("key", pa.uint64())])
        batches = [pa.record_batch([pa.array(rng.integers(0, 2**63, ROWS, dtype=np.uint64))], schema=schema)
                   for _ in range(BATCHES)]
        entry = hdfs_io.write_ipc_file(storage, "part.arrow", batches, schema=schema, compression=None)
        assert entry.size >= arrow_io.STREAM_MIN_BYTES
        yield storage, relay, entry
    finally:
        if relay is not None:
            _stop(relay)
        _stop(moto)


def test_a_store_that_stops_answering_mid_read_is_a_storage_error_not_a_damaged_file(store):
    storage, relay, entry = store
    got = arrow_io.open_ipc_batches(storage, "part.arrow", expected=entry)
    assert got.streamed
    it = iter(got)
    assert next(it).num_rows == ROWS
    _stop(relay)                                     # the store's address answers no more
    with pytest.raises(OSError) as ei:
        for _ in it:
            pass
    assert not isinstance(ei.value, hdfs_io.CheckpointCorruptError), ei.value
    assert hdfs_io.is_transient(ei.value), ei.value
    assert "reading s3://ckpt/job/part.arrow" in hdfs_io.described(ei.value)


def test_a_store_that_stops_answering_before_the_footer_is_read_is_a_storage_error(store, monkeypatch):
    """The second open (a HEAD) answered, then the store went before the footer's GET."""
    storage, relay, entry = store
    real = storage.open_input_file

    def open_then_cut(path):
        f = real(path)
        _stop(relay)
        return f
    monkeypatch.setattr(storage, "open_input_file", open_then_cut)
    with pytest.raises(OSError) as ei:
        arrow_io.open_ipc_batches(storage, "part.arrow", expected=entry)
    assert not isinstance(ei.value, hdfs_io.CheckpointCorruptError), ei.value
    assert hdfs_io.is_transient(ei.value), ei.value


def test_bytes_that_do_not_parse_are_still_a_damaged_file(store, monkeypatch):
    """The same file replaced, after the checksum pass, by as many bytes that are no Arrow file: damage."""
    storage, _, entry = store
    real = arrow_io.checksum_stream

    def pass_then_replace(f):
        out = real(f)
        storage.write_bytes("part.arrow", os.urandom(entry.size))
        return out
    monkeypatch.setattr(arrow_io, "checksum_stream", pass_then_replace)
    with pytest.raises(hdfs_io.CheckpointCorruptError, match="not a readable Arrow IPC file"):
        arrow_io.open_ipc_batches(storage, "part.arrow", expected=entry)
