"""Storage backends for contract tests: a local directory, a real S3 endpoint (moto's server on
127.0.0.1) and, when ``ENGINE_TEST_HDFS`` names a cluster URI, HDFS.

Imported by ``tests/contract/conftest.py``; other test modules can use the fixtures directly:

* ``moto_s3`` (session): a running moto S3 server, see :class:`MotoS3`.
* ``s3_bucket`` (session): name of a bucket created on it.
* ``s3_storage_options`` (session): :class:`hdfs_io.StorageOptions` pointing at it.
* ``s3_root_uri`` (function): a fresh ``s3://bucket/<unique prefix>`` URI.
* ``storage`` (function, parametrized local / s3 / hdfs): a fresh, not yet existing
  :class:`hdfs_io.Storage` root per test; the suite written against it runs on every backend.
"""
from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Iterator

import pyarrow.fs as pafs
import pytest

import hdfs_io

HDFS_ENV = "ENGINE_TEST_HDFS"
TEST_BUCKET = "engine-test"
# Fast backoff so retry tests and transient hiccups cost milliseconds.
FAST_RETRY = hdfs_io.RetryPolicy(max_attempts=4, initial_delay_s=0.001, max_delay_s=0.01)


@dataclass(frozen=True)
class MotoS3:
    """A moto S3 server listening on 127.0.0.1.

    Attributes
    ----------
    host : str
    port : int
    """

    host: str
    port: int
    access_key: str = "testing"
    secret_key: str = "testing"
    region: str = "us-east-1"

    @property
    def endpoint(self) -> str:
        """``"127.0.0.1:PORT"``, the form ``S3FileSystem(endpoint_override=...)`` takes."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``"http://127.0.0.1:PORT"``, the form ``AWS_ENDPOINT_URL`` and boto3 take."""
        return f"http://{self.endpoint}"

    def options(self) -> hdfs_io.StorageOptions:
        """Storage options for :func:`hdfs_io.resolve`."""
        return hdfs_io.StorageOptions(
            endpoint_override=self.endpoint,
            scheme="http",
            region=self.region,
            access_key=self.access_key,
            secret_key=self.secret_key,
        )

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables pointing at this server."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def create_bucket(self, name: str) -> str:
        """Create a bucket (no error if it exists) and return its name."""
        fs = pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=self.region,
            scheme="http",
            endpoint_override=self.endpoint,
            allow_bucket_creation=True,
        )
        fs.create_dir(name)
        return name


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """Start moto's S3 server in a thread on a free port of 127.0.0.1 for the whole session."""
    server_mod = pytest.importorskip(
        "moto.server", reason="moto[server] not installed: pip install -e '.[test]'"
    )
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield MotoS3(host=host, port=int(port))
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_bucket(moto_s3: MotoS3) -> str:
    """Name of a bucket on the moto server."""
    return moto_s3.create_bucket(TEST_BUCKET)


@pytest.fixture(scope="session")
def s3_storage_options(moto_s3: MotoS3) -> hdfs_io.StorageOptions:
    """:class:`hdfs_io.StorageOptions` for the moto server."""
    return moto_s3.options()


@pytest.fixture
def s3_root_uri(s3_bucket: str) -> str:
    """A fresh ``s3://engine-test/<unique>`` URI; nothing exists under it yet."""
    return f"s3://{s3_bucket}/{uuid.uuid4().hex[:12]}"


def _hdfs_root() -> str:
    base = os.environ.get(HDFS_ENV)
    if not base:
        pytest.skip(f"{HDFS_ENV} is not set (e.g. hdfs://namenode:8020/tmp/engine-test)")
    return f"{base.rstrip('/')}/{uuid.uuid4().hex[:12]}"


# The HDFS backend joins the suite only where a cluster is configured, so machines without one see a
# single skip (tests/contract/test_storage_resolve.py::test_hdfs_cluster_configured) instead of one per test.
BACKENDS = ["local", "s3"] + ([pytest.param("hdfs", marks=pytest.mark.hdfs)] if os.environ.get(HDFS_ENV) else [])


@pytest.fixture(params=BACKENDS)
def storage(request, tmp_path) -> Iterator[hdfs_io.Storage]:
    """A fresh storage root (not yet created) on each backend."""
    backend = request.param
    if backend == "local":
        yield hdfs_io.Storage.from_uri(str(tmp_path / "root"), retry=FAST_RETRY)
        return
    if backend == "s3":
        uri = request.getfixturevalue("s3_root_uri")
        options = request.getfixturevalue("s3_storage_options")
        yield hdfs_io.Storage.from_uri(uri, storage_options=options, retry=FAST_RETRY)
        return
    st = hdfs_io.Storage.from_uri(_hdfs_root(), retry=FAST_RETRY)
    try:
        yield st
    finally:
        if st.exists():
            st.fs.delete_dir(st.root)
