"""URI → ``(pyarrow.fs.FileSystem, path)``, in the spirit of ``pyarrow.fs.FileSystem.from_uri``.

Supported schemes::

    /abs/path, rel/path, file:///abs/path   → LocalFileSystem,   path "/abs/path"
    hdfs://namenode:8020/user/x (viewfs://) → HadoopFileSystem,  path "/user/x"
    s3://bucket/prefix/key (s3a://)         → S3FileSystem,      path "bucket/prefix/key"

S3 settings come from :class:`StorageOptions` (filled from the job config) and, for every field left
``None``, from the standard AWS environment variables:

    endpoint  AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL   (e.g. "http://127.0.0.1:5000")
    region    AWS_REGION, then AWS_DEFAULT_REGION
    keys      AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN

Filesystems are cached per ``(scheme, netloc, effective options)``; the environment is read on every call,
so changing it yields a new filesystem instead of a stale cached one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from hdfs_io.errors import StorageUnavailableError

__all__ = ["StorageOptions", "resolve", "clear_cache", "SUPPORTED_SCHEMES"]

logger = logging.getLogger(__name__)

SUPPORTED_SCHEMES = ("file", "hdfs", "viewfs", "s3", "s3a")
_S3_SCHEMES = ("s3", "s3a")
_HDFS_SCHEMES = ("hdfs", "viewfs")


@dataclass(frozen=True)
class StorageOptions:
    """Connection settings for remote filesystems; every field is optional.

    A field left ``None`` falls back to the AWS environment variables (S3) or to the library default.

    Parameters
    ----------
    endpoint_override : str or None
        S3 endpoint as ``"host:port"`` or a URL ``"http://host:port"`` (a URL also sets ``scheme``).
    region : str or None
        S3 region, e.g. ``"us-east-1"``.
    access_key, secret_key, session_token : str or None
        S3 credentials. ``access_key`` and ``secret_key`` must be given together.
    scheme : str or None
        ``"http"`` or ``"https"`` (default ``"https"``) for the S3 endpoint.
    connect_timeout_s, request_timeout_s : float or None, seconds
        S3 socket timeouts.
    anonymous : bool
        Connect to S3 without credentials.
    sdk_retry_attempts : int or None
        Attempts of the AWS SDK's own retry loop inside each S3 call (``None``: SDK default, 3). The
        :class:`~hdfs_io.retry.RetryPolicy` of a :class:`~hdfs_io.Storage` retries on top of it.
    hdfs_user : str or None
        User name for ``hdfs://``.
    hdfs_kerb_ticket : str or None
        Path to a Kerberos ticket cache for ``hdfs://``.
    hdfs_extra_conf : tuple of (str, str)
        Extra Hadoop configuration pairs, e.g. ``(("dfs.client.use.datanode.hostname", "true"),)``.
    """

    endpoint_override: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    scheme: str | None = None
    connect_timeout_s: float | None = None
    request_timeout_s: float | None = None
    anonymous: bool = False
    sdk_retry_attempts: int | None = None
    hdfs_user: str | None = None
    hdfs_kerb_ticket: str | None = None
    hdfs_extra_conf: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.scheme is not None and self.scheme not in ("http", "https"):
            raise ValueError(f"storage.scheme must be 'http' or 'https', got {self.scheme!r}")
        for name in ("connect_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"storage.{name} must be > 0 seconds, got {value!r}")
        if self.sdk_retry_attempts is not None and self.sdk_retry_attempts < 1:
            raise ValueError(f"storage.sdk_retry_attempts must be >= 1, got {self.sdk_retry_attempts}")
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("storage.access_key and storage.secret_key must be given together")
        if isinstance(self.hdfs_extra_conf, Mapping):  # accept a dict, store a hashable tuple
            object.__setattr__(self, "hdfs_extra_conf", tuple(sorted(self.hdfs_extra_conf.items())))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None, *, key_path: str = "storage") -> "StorageOptions":
        """Build options from a config mapping, rejecting unknown keys.

        Parameters
        ----------
        mapping : mapping of str to value, or None
            E.g. the ``storage:`` section of a YAML config. ``None`` gives the defaults.
        key_path : str
            Prefix used in error messages (``"storage.endpoint"``).

        Raises
        ------
        ValueError
            On an unknown key or an invalid value; the message names the key path.
        """
        if mapping is None:
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(
                f"{key_path}.{unknown[0]} is not a storage option; expected one of {sorted(known)}"
            )
        return cls(**dict(mapping))


_cache: dict[tuple, pafs.FileSystem] = {}
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every cached filesystem (tests; credential rotation)."""
    with _cache_lock:
        _cache.clear()


def resolve(uri: str, *, storage_options: StorageOptions | None = None) -> tuple[pafs.FileSystem, str]:
    """Map a URI or plain path to a pyarrow filesystem and the path inside it.

    Parameters
    ----------
    uri : str
        ``file:///abs``, ``/abs``, ``relative/path``, ``hdfs://host:port/path``, ``s3://bucket/key``.
    storage_options : StorageOptions or None
        Connection settings; ``None`` means defaults plus environment variables.

    Returns
    -------
    (pyarrow.fs.FileSystem, str)
        The (cached) filesystem and the path to pass to it: absolute for local and HDFS,
        ``"bucket/key"`` for S3. A trailing slash is removed.

    Raises
    ------
    ValueError
        Unsupported scheme, ``s3://`` without a bucket, or invalid options.
    StorageUnavailableError
        ``hdfs://`` on a machine without libhdfs/JVM, or a filesystem that cannot be constructed.

    Examples
    --------
    >>> fs, path = resolve("s3://ckpt/ctr/20240101")      # doctest: +SKIP
    >>> path
    'ckpt/ctr/20240101'
    """
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"expected a non-empty URI string, got {uri!r}")
    options = storage_options or StorageOptions()
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    # "C:\\x" style drive letters are parsed as a one-letter scheme; treat them as plain paths.
    if scheme in ("", "file") or len(scheme) == 1:
        local = parts.path if scheme == "file" else uri
        if scheme == "file" and parts.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URI with a host is not supported: {uri!r}")
        path = os.path.abspath(os.path.expanduser(local))
        return _cached(("file", "", ()), pafs.LocalFileSystem), path
    if scheme in _S3_SCHEMES:
        return _resolve_s3(uri, parts, options)
    if scheme in _HDFS_SCHEMES:
        return _resolve_hdfs(uri, parts, options)
    raise ValueError(f"unsupported URI scheme {scheme!r} in {uri!r}; expected one of {SUPPORTED_SCHEMES}")


def _cached(key: tuple, factory) -> pafs.FileSystem:
    with _cache_lock:
        fs = _cache.get(key)
        if fs is None:
            fs = factory()
            _cache[key] = fs
        return fs


def _strip(path: str) -> str:
    return path.rstrip("/") if path not in ("", "/") else path


def _resolve_s3(uri: str, parts, options: StorageOptions) -> tuple[pafs.FileSystem, str]:
    bucket = parts.netloc
    if not bucket:
        raise ValueError(f"S3 URI needs a bucket: expected s3://bucket/key, got {uri!r}")
    env = os.environ
    endpoint = options.endpoint_override or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    scheme = options.scheme
    if endpoint and "://" in endpoint:
        ep = urlsplit(endpoint)
        endpoint = ep.netloc
        scheme = scheme or ep.scheme
    region = options.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    access_key, secret_key, token = options.access_key, options.secret_key, options.session_token
    if access_key is None and not options.anonymous:
        env_key, env_secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        if env_key and env_secret:
            access_key, secret_key = env_key, env_secret
            token = token or env.get("AWS_SESSION_TOKEN")
    kwargs: dict[str, Any] = {"scheme": scheme or "https"}
    if endpoint:
        kwargs["endpoint_override"] = endpoint
    if region:
        kwargs["region"] = region
    if options.anonymous:
        kwargs["anonymous"] = True
    elif access_key is not None:
        kwargs.update(access_key=access_key, secret_key=secret_key)
        if token:
            kwargs["session_token"] = token
    if options.connect_timeout_s is not None:
        kwargs["connect_timeout"] = options.connect_timeout_s
    if options.request_timeout_s is not None:
        kwargs["request_timeout"] = options.request_timeout_s
    key = ("s3", "", tuple(sorted(kwargs.items())), options.sdk_retry_attempts)  # one client, all buckets
    if options.sdk_retry_attempts is not None:
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=options.sdk_retry_attempts)

    def make() -> pafs.FileSystem:
        logger.info(
            "connecting S3FileSystem endpoint=%s scheme=%s region=%s credentials=%s",
            endpoint or "<aws default>", kwargs["scheme"], region or "<sdk default>",
            "anonymous" if options.anonymous else ("explicit" if access_key else "sdk chain"),
        )
        try:
            return pafs.S3FileSystem(**kwargs)
        except (OSError, ValueError) as exc:
            raise StorageUnavailableError(f"cannot create S3 filesystem for {uri}: {exc}", uri=uri) from exc

    path = _strip(bucket + parts.path)
    return _cached(key, make), path


def _resolve_hdfs(uri: str, parts, options: StorageOptions) -> tuple[pafs.FileSystem, str]:
    host = parts.hostname or "default"  # "default" = fs.defaultFS from the Hadoop configuration
    port = parts.port or (0 if host == "default" else 8020)
    if parts.scheme.lower() == "viewfs":
        host = f"viewfs://{parts.netloc}"
    user = options.hdfs_user or parts.username
    extra = dict(options.hdfs_extra_conf) or None
    key = ("hdfs", parts.netloc, (user, options.hdfs_kerb_ticket, options.hdfs_extra_conf))

    def make() -> pafs.FileSystem:
        logger.info("connecting HadoopFileSystem host=%s port=%s user=%s", host, port, user)
        try:
            return pafs.HadoopFileSystem(
                host, port, user=user, kerb_ticket=options.hdfs_kerb_ticket, extra_conf=extra
            )
        except (OSError, RuntimeError) as exc:
            hint = (
                "libhdfs/JVM not found: set JAVA_HOME, HADOOP_HOME (or ARROW_LIBHDFS_DIR) and CLASSPATH "
                "(`hadoop classpath --glob`)"
                if _looks_like_missing_library(exc)
                else "namenode unreachable or refused the connection"
            )
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StorageUnavailableError(f"cannot open HDFS for {uri}: {hint} ({detail})", uri=uri) from exc

    return _cached(key, make), _strip(parts.path or "/")


def _looks_like_missing_library(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("libhdfs", "libjvm", "java_home", "hadoop_home", "classpath"))
