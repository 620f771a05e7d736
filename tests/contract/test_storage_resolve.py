"""hdfs_io.resolve(): URI schemes, S3 settings from options and from AWS environment variables, caching."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import hdfs_io
from hdfs_io import StorageOptions, StorageUnavailableError, resolve

from tests.contract.storage_fixtures import HDFS_ENV

_AWS_VARS = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in _AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    hdfs_io.clear_cache()
    yield
    hdfs_io.clear_cache()


def _s3_settings(fs: pafs.FileSystem) -> dict:
    return fs.__reduce__()[1][0]  # the keyword arguments S3FileSystem was built with


# --------------------------------------------------------------------------- local


def test_plain_absolute_path(tmp_path):
    fs, path = resolve(str(tmp_path / "ckpt") + "/")
    assert isinstance(fs, pafs.LocalFileSystem)
    assert path == str(tmp_path / "ckpt")


def test_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = resolve("out/ckpt")
    assert isinstance(fs, pafs.LocalFileSystem)
    assert path == str(tmp_path / "out" / "ckpt")


def test_file_uri(tmp_path):
    fs, path = resolve(f"file://{tmp_path}/a")
    assert isinstance(fs, pafs.LocalFileSystem)
    assert path == f"{tmp_path}/a"
    with pytest.raises(ValueError, match="host"):
        resolve("file://otherhost/a")


def test_local_filesystem_is_cached(tmp_path):
    assert resolve(str(tmp_path))[0] is resolve(f"file://{tmp_path}/x")[0]


def test_storage_from_uri_local_roundtrip(tmp_path):
    st = hdfs_io.Storage.from_uri(f"file://{tmp_path}/r")
    st.write_bytes("a/b", b"1")
    assert (Path(tmp_path) / "r" / "a" / "b").read_bytes() == b"1"
    assert st.uri == f"file://{tmp_path}/r"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("uri", ["gs://bucket/x", "ftp://host/x", "mem://x"])
def test_unsupported_scheme(uri):
    with pytest.raises(ValueError, match="unsupported URI scheme"):
        resolve(uri)


@pytest.mark.parametrize("uri", ["", None])
def test_empty_uri(uri):
    with pytest.raises(ValueError):
        resolve(uri)


def test_s3_needs_a_bucket():
    with pytest.raises(ValueError, match="bucket"):
        resolve("s3:///key")


# --------------------------------------------------------------------------- S3


def test_s3_from_options(moto_s3, s3_bucket):
    fs, path = resolve(f"s3://{s3_bucket}/ctr/ckpt/", storage_options=moto_s3.options())
    assert isinstance(fs, pafs.S3FileSystem)
    assert path == f"{s3_bucket}/ctr/ckpt"
    settings = _s3_settings(fs)
    assert settings["endpoint_override"] == moto_s3.endpoint
    assert settings["scheme"] == "http"
    assert settings["region"] == "us-east-1"
    assert settings["access_key"] == "testing"
    with fs.open_output_stream(f"{path}/x", compression=None) as out:
        out.write(b"via options")
    assert fs.open_input_stream(f"{path}/x").read() == b"via options"


def test_s3_from_environment(moto_s3, s3_bucket, monkeypatch):
    for var, value in moto_s3.env().items():
        monkeypatch.setenv(var, value)
    fs, path = resolve(f"s3://{s3_bucket}/env")
    settings = _s3_settings(fs)
    assert settings["endpoint_override"] == moto_s3.endpoint
    assert settings["scheme"] == "http"  # from the endpoint URL
    assert settings["region"] == moto_s3.region
    assert settings["access_key"] == moto_s3.access_key
    st = hdfs_io.Storage.from_uri(f"s3://{s3_bucket}/env")
    st.write_bytes("f", b"via environment")
    assert st.read_bytes("f") == b"via environment"
    assert st.listdir() == ["f"]


def test_s3_env_precedence(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://generic.example:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-specific.example:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    settings = _s3_settings(resolve("s3://b/k")[0])
    assert settings["endpoint_override"] == "s3-specific.example:2"
    assert settings["scheme"] == "http"
    assert settings["region"] == "eu-west-1"
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    assert _s3_settings(resolve("s3://b/k")[0])["region"] == "ap-south-1"
    # explicit options win over the environment
    opts = StorageOptions(endpoint_override="cfg.example:3", scheme="https", region="us-west-2")
    settings = _s3_settings(resolve("s3://b/k", storage_options=opts)[0])
    assert (settings["endpoint_override"], settings["scheme"], settings["region"]) == ("cfg.example:3", "https", "us-west-2")


def test_s3_credentials_from_environment(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secretenv")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "tok")
    settings = _s3_settings(resolve("s3://b/k", storage_options=StorageOptions(region="us-east-1"))[0])
    assert (settings["access_key"], settings["secret_key"], settings["session_token"]) == ("AKIDENV", "secretenv", "tok")
    opts = StorageOptions(region="us-east-1", access_key="AKIDCFG", secret_key="secretcfg")
    settings = _s3_settings(resolve("s3://b/k", storage_options=opts)[0])
    assert (settings["access_key"], settings["session_token"]) == ("AKIDCFG", "")


def test_s3_cache_per_options(monkeypatch):
    a = StorageOptions(endpoint_override="h:1", scheme="http", region="us-east-1")
    b = StorageOptions(endpoint_override="h:2", scheme="http", region="us-east-1")
    fs_a, _ = resolve("s3://bucket1/x", storage_options=a)
    assert resolve("s3://bucket2/y", storage_options=a)[0] is fs_a  # one client serves all buckets
    assert resolve("s3://bucket1/x", storage_options=StorageOptions(**vars(a)))[0] is fs_a
    assert resolve("s3://bucket1/x", storage_options=b)[0] is not fs_a
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "rotated")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated")
    assert resolve("s3://bucket1/x", storage_options=a)[0] is not fs_a  # the environment is part of the key


def test_storage_options_from_mapping():
    opts = StorageOptions.from_mapping({"endpoint_override": "h:1", "region": "us-east-1", "scheme": "http"})
    assert opts == StorageOptions(endpoint_override="h:1", region="us-east-1", scheme="http")
    assert StorageOptions.from_mapping(None) == StorageOptions()
    with pytest.raises(ValueError, match=r"storage\.endpoint "):
        StorageOptions.from_mapping({"endpoint": "h:1"})
    with pytest.raises(ValueError, match="storage.scheme"):
        StorageOptions(scheme="ftp")
    with pytest.raises(ValueError, match="together"):
        StorageOptions(access_key="only-half")
    with pytest.raises(ValueError, match="connect_timeout_s"):
        StorageOptions(connect_timeout_s=0)
    conf = StorageOptions(hdfs_extra_conf={"b": "2", "a": "1"})
    assert conf.hdfs_extra_conf == (("a", "1"), ("b", "2"))
    hash(conf)  # usable as a cache key
    assert "secret" not in repr(StorageOptions(access_key="k", secret_key="secret"))


# --------------------------------------------------------------------------- HDFS


def test_import_does_not_touch_hadoop():
    """Importing the package and using local/S3 never loads libhdfs (it prints dlopen noise and needs a JVM)."""
    code = "import hdfs_io; hdfs_io.resolve('/tmp/x'); hdfs_io.resolve('s3://b/k', storage_options=hdfs_io.StorageOptions(region='us-east-1'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert "libjvm" not in proc.stderr and "libhdfs" not in proc.stderr


@pytest.mark.skipif(bool(os.environ.get(HDFS_ENV)), reason="a Hadoop client is configured on this machine")
def test_hdfs_without_libhdfs_is_a_typed_error():
    with pytest.raises(StorageUnavailableError) as err:
        resolve("hdfs://namenode.invalid:8020/ckpt")
    assert "hdfs://namenode.invalid:8020/ckpt" in str(err.value)
    assert err.value.uri == "hdfs://namenode.invalid:8020/ckpt"
    assert isinstance(err.value, OSError)


@pytest.mark.hdfs
def test_hdfs_cluster_configured():
    """The contract suites run on HDFS too when ENGINE_TEST_HDFS names a writable directory."""
    base = os.environ.get(HDFS_ENV)
    if not base:
        pytest.skip(f"{HDFS_ENV} is not set (e.g. hdfs://namenode:8020/tmp/engine-test): HDFS backend not tested")
    fs, path = resolve(base)
    assert isinstance(fs, pafs.HadoopFileSystem)
    assert path.startswith("/")
