"""``Storage.move``: the same behaviour on the local filesystem, S3 (moto) and HDFS (when configured):
replaces the destination file, refuses directories, names a missing source; retried on transient
errors, and a retry after a move whose answer was lost succeeds. The faults come from the
fault-injecting filesystem of ``test_storage_retry`` wrapped around the real backend."""
from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from hdfs_io import RetryPolicy, Storage, StorageUnavailableError
from tests.contract.test_storage_retry import FlakyHandler, Sleeps


def test_move_renames_and_replaces(storage: Storage):
    storage.write_bytes("out/.p.arrow.tmp-1", b"new predictions")
    storage.move("out/.p.arrow.tmp-1", "out/p.arrow")
    assert storage.read_bytes("out/p.arrow") == b"new predictions"
    assert not storage.exists("out/.p.arrow.tmp-1")
    storage.write_bytes("out/.p.arrow.tmp-2", b"newer")
    storage.move("out/.p.arrow.tmp-2", "out/p.arrow")           # an existing file is replaced
    assert storage.read_bytes("out/p.arrow") == b"newer"
    assert storage.listdir("out") == ["p.arrow"]
    storage.move("out/p.arrow", "elsewhere/deeper/p.arrow")      # parents made as writing makes them
    assert storage.read_bytes("elsewhere/deeper/p.arrow") == b"newer"


def test_move_errors(storage: Storage):
    with pytest.raises(FileNotFoundError) as ei:
        storage.move("missing", "dst")
    assert ei.value.filename == storage.uri_of("missing")
    storage.write_bytes("d/f", b"x")
    storage.write_bytes("g", b"y")
    with pytest.raises(IsADirectoryError):
        storage.move("d", "e")
    with pytest.raises(IsADirectoryError):
        storage.move("g", "d")
    with pytest.raises(ValueError, match="same path"):
        storage.move("g", "g")
    with pytest.raises(ValueError, match="root"):
        storage.move("g", "")
    assert storage.read_bytes("g") == b"y" and storage.read_bytes("d/f") == b"x"


def _flaky(storage: Storage, handler: FlakyHandler) -> Storage:
    policy = RetryPolicy(max_attempts=3, initial_delay_s=0.01, jitter=0.0, sleep=Sleeps())
    return Storage(pafs.PyFileSystem(handler), storage.root, uri=storage.uri, retry=policy)


def test_move_is_retried_on_transient_errors(storage: Storage):
    handler = FlakyHandler(storage.fs)
    st = _flaky(storage, handler)
    storage.write_bytes("a", b"payload")
    handler.fail("move", 2)
    st.move("a", "b")
    assert storage.read_bytes("b") == b"payload" and not storage.exists("a")
    assert st.retry_stats.as_dict() == {"retries": 2, "gave_up": 0}
    storage.write_bytes("c", b"c")
    handler.fail("move", 3)
    with pytest.raises(StorageUnavailableError, match="move"):
        st.move("c", "b")
    assert storage.read_bytes("b") == b"payload" and storage.read_bytes("c") == b"c"


class LostAnswer(FlakyHandler):
    """Moves, then reports a connection reset once: the answer of a move that happened was lost."""

    lost = 1

    def move(self, src, dest):
        self.inner.move(src, dest)
        if self.lost:
            self.lost -= 1
            raise ConnectionResetError(104, "injected: connection reset after the move")


LostAnswer.__abstractmethods__ = frozenset()


def test_retry_after_a_lost_answer_succeeds(storage: Storage):
    st = _flaky(storage, LostAnswer(storage.fs))
    storage.write_bytes("a", b"payload")
    st.move("a", "b")
    assert storage.read_bytes("b") == b"payload" and not storage.exists("a")
    assert st.retry_stats.retries == 1
