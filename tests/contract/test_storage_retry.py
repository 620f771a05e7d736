"""Retries with backoff, driven by a fault-injecting filesystem wrapped around each real backend."""
from __future__ import annotations

import logging
import socket

import pyarrow.fs as pafs
import pytest

import hdfs_io
from hdfs_io import RetryPolicy, Storage, StorageUnavailableError
from hdfs_io.retry import call_with_retry, is_transient

_DELEGATED = (
    "get_file_info", "get_file_info_selector", "create_dir", "delete_dir", "delete_dir_contents",
    "delete_root_dir_contents", "delete_file", "move", "copy_file", "open_input_stream", "open_input_file",
    "open_output_stream", "open_append_stream",
)


class FlakyHandler(pafs.FileSystemHandler):
    """Delegates to a real filesystem; the next ``failures[method]`` calls of a method raise ``error``.

    A fault injector for one process (not a mock of the backend): everything that does not fail runs
    against the real local disk or S3 endpoint.
    """

    def __init__(self, inner: pafs.FileSystem) -> None:
        self.inner = inner
        self.failures: dict[str, int] = {}
        self.error: type[OSError] | OSError = ConnectionResetError
        self.calls: dict[str, int] = {}

    def fail(self, method: str, times: int, error=ConnectionResetError) -> None:
        self.failures[method] = times
        self.error = error

    def _maybe_fail(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        left = self.failures.get(method, 0)
        if left:
            self.failures[method] = left - 1
            err = self.error
            raise err if isinstance(err, OSError) else err(104, f"injected fault in {method}")

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    def get_type_name(self) -> str:
        return "flaky"

    def normalize_path(self, path: str) -> str:
        return path


# handler signature -> FileSystem call
_ADAPT = {
    "get_file_info_selector": lambda fs, selector: fs.get_file_info(selector),
    "create_dir": lambda fs, path, recursive: fs.create_dir(path, recursive=recursive),
    "delete_dir_contents": lambda fs, path, missing_dir_ok=False: fs.delete_dir_contents(
        path, missing_dir_ok=missing_dir_ok
    ),
    "open_input_stream": lambda fs, path: fs.open_input_stream(path, compression=None),
    "open_output_stream": lambda fs, path, metadata: fs.open_output_stream(path, compression=None, metadata=metadata),
    "open_append_stream": lambda fs, path, metadata: fs.open_append_stream(path, compression=None, metadata=metadata),
}


def _delegate(name: str):
    call = _ADAPT.get(name, lambda fs, *args: getattr(fs, name)(*args))

    def method(self, *args):
        self._maybe_fail(name)
        return call(self.inner, *args)

    method.__name__ = name
    return method


for _name in _DELEGATED:
    setattr(FlakyHandler, _name, _delegate(_name))
FlakyHandler.__abstractmethods__ = frozenset()


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def flaky(storage: Storage):
    """``(flaky_storage, handler, sleeps)`` over the same root as ``storage``; no real sleeping."""
    handler = FlakyHandler(storage.fs)
    sleeps = Sleeps()
    policy = RetryPolicy(max_attempts=4, initial_delay_s=0.01, multiplier=2.0, max_delay_s=1.0, jitter=0.0, sleep=sleeps)
    st = Storage(pafs.PyFileSystem(handler), storage.root, uri=storage.uri, retry=policy)
    return st, handler, sleeps


def test_write_succeeds_after_two_connection_errors(flaky, storage, caplog):
    st, handler, sleeps = flaky
    handler.fail("open_output_stream", 2)
    with caplog.at_level(logging.WARNING, logger="hdfs_io.retry"):
        entry = st.write_bytes("a/b.bin", b"payload")
    assert entry.size == 7
    assert storage.read_bytes("a/b.bin") == b"payload"
    assert st.retry_stats.as_dict() == {"retries": 2, "gave_up": 0}
    assert sleeps == [0.01, 0.02]  # exponential backoff
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2
    assert st.uri_of("a/b.bin") in retries[0].getMessage()


def test_read_and_metadata_calls_are_retried(flaky, storage):
    st, handler, _ = flaky
    storage.write_bytes("d/f.bin", b"xyz")
    handler.fail("open_input_file", 2)
    assert st.read_bytes("d/f.bin") == b"xyz"
    handler.fail("open_input_stream", 1)
    with st.open_input_stream("d/f.bin") as f:
        assert f.read() == b"xyz"
    handler.fail("get_file_info", 2)
    assert st.exists("d/f.bin")
    handler.fail("get_file_info_selector", 2)
    assert st.listdir("d") == ["f.bin"]
    handler.fail("open_input_file", 1)
    with st.open_input_file("d/f.bin") as f:
        assert f.read() == b"xyz"
    assert st.retry_stats.retries == 8


def test_publish_survives_transient_errors(flaky, storage):
    st, handler, _ = flaky
    handler.fail("open_output_stream", 2)
    hdfs_io.publish_dir(st, "ck", {"a.bin": b"a" * 100, "b.bin": b"b" * 10})
    handler.fail("get_file_info", 2)
    hdfs_io.verify(st, "ck")
    hdfs_io.verify(storage, "ck")
    assert st.retry_stats.retries == 4


def test_gives_up_after_max_attempts(flaky):
    st, handler, sleeps = flaky
    handler.fail("open_output_stream", 100)
    with pytest.raises(StorageUnavailableError) as err:
        st.write_bytes("x.bin", b"1")
    assert isinstance(err.value.__cause__, ConnectionResetError)
    assert err.value.uri == st.uri_of("x.bin")
    assert "4 attempts" in str(err.value)
    assert handler.calls["open_output_stream"] == 4
    assert sleeps == [0.01, 0.02, 0.04]
    assert st.retry_stats.as_dict() == {"retries": 3, "gave_up": 1}


def test_a_listing_that_gives_up_is_not_waited_out_again_as_a_stat(flaky, storage):
    """A store that does not answer a listing through the retries is not asked once more whether the path
    is a file: before, ``children`` (every listing: a checkpoint job root, a training input directory)
    stat-ed it through a second round of retries, and ``engine export`` of an unreachable S3 endpoint
    waited 22 s instead of 11 before saying so."""
    st, handler, sleeps = flaky
    storage.write_bytes("d/f.bin", b"1")
    handler.fail("get_file_info_selector", 100)
    handler.fail("get_file_info", 100)
    with pytest.raises(StorageUnavailableError, match="list .* failed after 4 attempts"):
        st.listdir("d")
    assert handler.calls["get_file_info_selector"] == 4 and handler.calls.get("get_file_info", 0) == 0
    assert sleeps == [0.01, 0.02, 0.04]


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError(2, "injected: no such file"),
        PermissionError(13, "injected: permission denied"),
        OSError("When reading 'x': AWS Error ACCESS_DENIED during GetObject operation: Access Denied"),
    ],
    ids=["not-found", "permission", "s3-access-denied"],
)
def test_permanent_errors_are_not_retried(flaky, storage, error):
    st, handler, sleeps = flaky
    storage.write_bytes("f.bin", b"1")
    handler.fail("open_input_file", 1, error=error)
    with pytest.raises(type(error)):
        st.read_bytes("f.bin")
    assert handler.calls["open_input_file"] == 1
    assert sleeps == []
    assert st.retry_stats.as_dict() == {"retries": 0, "gave_up": 0}


def test_write_callback_is_replayed_on_retry(flaky, storage):
    st, handler, _ = flaky
    runs = []

    def writer(out):
        runs.append(1)
        out.write(b"same bytes every time")

    handler.fail("open_output_stream", 1)
    entry = st.write_with("w.bin", writer)
    assert len(runs) == 1  # open failed before the callback ran
    assert entry == hdfs_io.FileEntry.of_bytes(b"same bytes every time")
    assert storage.read_bytes("w.bin") == b"same bytes every time"


# ----------------------------------------------------------------------- classification (unit level)


@pytest.mark.parametrize(
    "exc, transient",
    [
        (ConnectionResetError(104, "reset"), True),
        (ConnectionRefusedError(111, "refused"), True),
        (TimeoutError("timed out"), True),
        (OSError(110, "Connection timed out"), True),
        (OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not connect"), True),
        (OSError("AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate."), True),
        (OSError("AWS Error SERVICE_UNAVAILABLE during GetObject operation: HTTP response code: 503"), True),
        (OSError("AWS Error INTERNAL_FAILURE during ListObjectsV2 operation"), True),
        (OSError("AWS Error UNKNOWN (HTTP status 500) during GetObject: HTTP response code: 500"), True),
        (OSError("AWS Error ACCESS_DENIED during HeadObject operation: No response body."), False),
        (OSError("AWS Error NO_SUCH_BUCKET during HeadObject operation"), False),
        (OSError("some unknown failure"), False),
        (FileNotFoundError(2, "missing"), False),
        (PermissionError(13, "denied"), False),
        (IsADirectoryError(21, "dir"), False),
        (hdfs_io.CheckpointCorruptError("bad crc", uri="x"), False),
        (hdfs_io.StorageUnavailableError("gone", uri="x"), False),
        (ValueError("not I/O"), False),
    ],
)
def test_is_transient(exc, transient):
    assert is_transient(exc) is transient


def test_real_connection_error_from_s3_is_transient():
    """A real pyarrow S3 error (nothing listens on the port) is classified transient and retried."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: connections are refused
    options = hdfs_io.StorageOptions(
        endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
        access_key="k", secret_key="s", connect_timeout_s=0.5, sdk_retry_attempts=1,
    )
    sleeps = Sleeps()
    st = Storage.from_uri(
        "s3://nowhere/x", storage_options=options,
        retry=RetryPolicy(max_attempts=2, initial_delay_s=0.001, sleep=sleeps),
    )
    with pytest.raises(StorageUnavailableError) as err:
        st.exists("f")
    assert is_transient(err.value.__cause__)
    assert "s3://nowhere/x/f" in str(err.value)
    assert st.retry_stats.as_dict() == {"retries": 1, "gave_up": 1}


def test_retry_policy_validation_and_delays():
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=2)
    p = RetryPolicy(initial_delay_s=1.0, multiplier=3.0, max_delay_s=5.0, jitter=0.0)
    assert [p.delay_s(k) for k in (1, 2, 3, 4)] == [1.0, 3.0, 5.0, 5.0]
    jittery = RetryPolicy(initial_delay_s=1.0, jitter=0.5)
    assert all(0.5 <= jittery.delay_s(1) <= 1.0 for _ in range(100))


def test_call_with_retry_non_os_errors_propagate():
    calls = []

    def fn():
        calls.append(1)
        raise KeyError("bug")

    with pytest.raises(KeyError):
        call_with_retry(fn, policy=RetryPolicy(sleep=lambda s: None), what="op")
    assert calls == [1]
