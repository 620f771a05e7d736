"""The engine config: one frozen dataclass tree loaded from YAML.

Unknown keys and bad values are rejected with the key path named
(``cluster.servers must be >= 1, got 0``). ``--set a.b=c`` overrides are applied to the YAML mapping
before it is checked; the value is parsed with ``yaml.safe_load`` (``--set cluster.workers=3``,
``--set mode=geo``, ``--set tables.sparse.emb.learning_rate=0.1``).

Layout (see ``configs/logreg_demo.yaml`` for every knob with a comment)::

    mode: async                 # sync | async | geo
    cluster: {servers, workers, host, endpoints, local_shards, num_vshards, ...}
    client: {timeout_s, retries, backoff_s, threads, async_queue, barrier_timeout_s}
    geo: {k_steps, learning_rate, dense_learning_rate, evict_after_steps, delta_scale}
    checkpoint: {root, job, delta_every, base_every, keep_bases, fallback, final, threads, align_steps}
                                (engine.checkpoint.schedule; root "" = no checkpoints)
    storage: {endpoint, region, scheme, access_key_env, secret_key_env, ...}   (StorageConfig: s3/hdfs)
    tables:
      sparse: {NAME: {sparse_tables.TableConfig fields}}
      dense:  {NAME: {optimizer, learning_rate, beta1, beta2, epsilon}}
    model: {kind: logreg, ...the worker program's own fields}

The ``model`` section is owned by the worker program that ``model.kind`` selects (see
``engine.programs``): its fields are that program's ``Config`` dataclass.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sparse_tables import TableConfig, TableConfigError

from .checkpoint.schedule import CheckpointConfig
from .errors import ConfigError

MODES = ("sync", "async", "geo")


def knob(default, *, ge=None, gt=None, le=None, choices=None, doc: str = ""):
    """A dataclass field with bounds checked by ``build``."""
    meta = {"ge": ge, "gt": gt, "le": le, "choices": choices, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ClusterConfig:
    """Processes and addresses. ``endpoints`` (``host:port`` of every server, in rank order) is for
    multi-host runs; empty means the launcher starts ``servers`` servers on ``host`` with free ports.
    ``warm_up``: every process compiles its Numba kernels (or loads them from the cache) before it
    serves or trains (``engine.ps.warmup``), so no request or step of the job compiles."""

    servers: int = knob(1, ge=1)
    workers: int = knob(1, ge=1)
    host: str = "127.0.0.1"
    endpoints: tuple = ()
    server_threads: int = knob(8, ge=1)
    local_shards: int = knob(4, ge=1)
    num_vshards: int = knob(1024, ge=1)
    startup_timeout_s: float = knob(120.0, gt=0)
    stop_timeout_s: float = knob(10.0, gt=0)
    warm_up: bool = True


@dataclass(frozen=True)
class ClientConfig:
    """PS client behaviour (timeouts in seconds)."""

    timeout_s: float = knob(60.0, gt=0)
    retries: int = knob(5, ge=0)
    backoff_s: float = knob(0.05, gt=0)
    max_backoff_s: float = knob(2.0, gt=0)
    threads: int = knob(8, ge=1)
    async_queue: int = knob(0, ge=0)
    barrier_timeout_s: float = knob(600.0, gt=0)


@dataclass(frozen=True)
class GeoConfig:
    """GEO-SGD: local plain-SGD learning rates, sync period, the local cache's expiry, and whether
    deltas are averaged over the workers (``mean``, Paddle's geo-SGD) or added in full (``sum``)."""

    k_steps: int = knob(10, ge=1)
    learning_rate: float = knob(0.05, gt=0)
    dense_learning_rate: float = knob(0.05, gt=0)
    evict_after_steps: int = knob(1000, ge=1)
    delta_scale: str = knob("mean", choices=("mean", "sum"))


@dataclass(frozen=True)
class DenseTableConfig:
    """A dense table: a flat float32 vector updated on the servers by Adam or SGD."""

    optimizer: str = knob("adam", choices=("adam", "sgd"))
    learning_rate: float = knob(1e-3, gt=0)
    beta1: float = knob(0.9, ge=0, le=0.999999)
    beta2: float = knob(0.999, ge=0, le=0.999999)
    epsilon: float = knob(1e-8, gt=0)


@dataclass(frozen=True)
class StorageConfig:
    """Connection settings of remote storage (``s3://``, ``hdfs://``) for every process of a job: the
    servers writing checkpoint parts, the workers reading hourly partitions and writing manifests.

    Empty fields fall back to the standard AWS environment variables (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``) and the SDK's defaults. Keep secrets
    out of config files: ``access_key_env`` / ``secret_key_env`` / ``session_token_env`` name environment
    variables that hold them, read in each process. Inline ``access_key`` / ``secret_key`` also work;
    checkpoint manifests never record them.
    """

    endpoint: str = ""          # S3 endpoint: "host:port" or a URL "http://host:port"
    region: str = ""            # e.g. us-east-1
    scheme: str = knob("", choices=("", "http", "https"))
    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    access_key_env: str = ""    # name of the environment variable holding the access key
    secret_key_env: str = ""
    session_token_env: str = ""
    anonymous: bool = False     # S3 without credentials (public buckets)
    connect_timeout_s: float = knob(0.0, ge=0)   # 0 = the SDK's default
    request_timeout_s: float = knob(0.0, ge=0)
    hdfs_user: str = ""
    hdfs_kerb_ticket: str = ""  # path of a Kerberos ticket cache for hdfs://

    SECRETS = ("access_key", "secret_key")

    def options(self):
        """``hdfs_io.StorageOptions`` of these settings (None when every field is empty).

        Raises
        ------
        ConfigError
            An ``*_env`` field names an unset variable, or only one of the access/secret key is given.
        """
        from hdfs_io import StorageOptions

        def secret(inline: str, env_key: str, kp: str) -> str | None:
            if env_key:
                import os
                value = os.environ.get(env_key)
                if not value:
                    raise ConfigError(f"storage.{kp}_env names the environment variable {env_key!r}, which "
                                      f"is not set in this process")
                return value
            return inline or None

        access = secret(self.access_key, self.access_key_env, "access_key")
        secret_key = secret(self.secret_key, self.secret_key_env, "secret_key")
        token = secret("", self.session_token_env, "session_token")
        if (access is None) != (secret_key is None):
            raise ConfigError("storage: access_key (or access_key_env) and secret_key (or secret_key_env) "
                              "must be given together")
        fields = dict(endpoint_override=self.endpoint or None, region=self.region or None,
                      scheme=self.scheme or None, access_key=access, secret_key=secret_key, session_token=token,
                      connect_timeout_s=self.connect_timeout_s or None,
                      request_timeout_s=self.request_timeout_s or None, anonymous=self.anonymous,
                      hdfs_user=self.hdfs_user or None, hdfs_kerb_ticket=self.hdfs_kerb_ticket or None)
        if not any(v for v in fields.values()):
            return None
        return StorageOptions(**fields)


@dataclass(frozen=True)
class ModelConfig:
    """``kind`` picks the worker program; ``params`` is that program's own Config dataclass."""

    kind: str
    params: Any


@dataclass(frozen=True)
class EngineConfig:
    mode: str = knob("async", choices=MODES)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    geo: GeoConfig = field(default_factory=GeoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    sparse_tables: dict = field(default_factory=dict)   # name -> sparse_tables.TableConfig
    dense_tables: dict = field(default_factory=dict)    # name -> DenseTableConfig
    model: ModelConfig | None = None

    def to_dict(self) -> dict:
        """The YAML mapping this config loads from (round-trips through ``from_dict``)."""
        out = {"mode": self.mode, "cluster": _plain(self.cluster), "client": _plain(self.client),
               "geo": _plain(self.geo), "checkpoint": _plain(self.checkpoint), "storage": _plain(self.storage),
               "tables": {"sparse": {k: _plain(v) for k, v in self.sparse_tables.items()},
                          "dense": {k: _plain(v) for k, v in self.dense_tables.items()}}}
        if self.model is not None:
            out["model"] = {"kind": self.model.kind, **_plain(self.model.params)}
        return out


def build(cls, data: Any, path: str):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and out-of-range values.

    Raises
    ------
    ConfigError
        Naming the key path: ``{path}: unknown key(s) [...]``, ``{path}.x must be >= 1, got 0``,
        ``{path}.x must be an int, got 'a'``.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        f, kp = fields[name], f"{path}.{name}" if path else name
        kwargs[name] = _check(kp, _coerce(kp, hints[name], value), f.metadata)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from None


def _coerce(kp: str, typ, value):
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin is typing.Union or str(origin) == "types.UnionType":
        if value is None and type(None) in args:
            return None
        typ = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(typ):
        return build(typ, value, kp)
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{kp} must be true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{kp} must be an int, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{kp} must be a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{kp} must be a string, got {value!r}")
        return value
    if typ is tuple or origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{kp} must be a list, got {value!r}")
        return tuple(value)
    return value


def _check(kp: str, value, meta) -> Any:
    if value is None or not meta:
        return value
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(f"{kp} must be one of {list(meta['choices'])}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and math.isnan(value):
            raise ConfigError(f"{kp} must be a number, got nan")
        if meta.get("ge") is not None and not value >= meta["ge"]:
            raise ConfigError(f"{kp} must be >= {meta['ge']}, got {value!r}")
        if meta.get("gt") is not None and not value > meta["gt"]:
            raise ConfigError(f"{kp} must be > {meta['gt']}, got {value!r}")
        if meta.get("le") is not None and not value <= meta["le"]:
            raise ConfigError(f"{kp} must be <= {meta['le']}, got {value!r}")
    return value


def from_dict(data: dict) -> EngineConfig:
    """Build an EngineConfig from the YAML mapping.

    Raises
    ------
    ConfigError
        Unknown keys, wrong types, out-of-range values, unknown ``model.kind``, tables that violate
        ``sparse_tables.TableConfig``'s checks; the message names the key path.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping at the top level, got {type(data).__name__}")
    data = dict(data)
    tables = data.pop("tables", None) or {}
    model = data.pop("model", None)
    cfg = build(EngineConfig, data, "")
    if not isinstance(tables, dict):
        raise ConfigError(f"tables must be a mapping with 'sparse' and 'dense', got {tables!r}")
    unknown = sorted(set(tables) - {"sparse", "dense"})
    if unknown:
        raise ConfigError(f"tables: unknown key(s) {unknown}; known keys: ['dense', 'sparse']")
    sparse = {}
    for name, spec in _mapping(tables.get("sparse"), "tables.sparse").items():
        kp = f"tables.sparse.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{kp} must be a mapping of TableConfig fields, got {spec!r}")
        try:
            sparse[str(name)] = TableConfig.from_dict(spec, kp)
        except TableConfigError as e:
            raise ConfigError(str(e).replace("TableConfig.", kp + ".")) from None
        except TypeError as e:
            raise ConfigError(f"{kp}: {e}") from None
    dense = {str(name): build(DenseTableConfig, spec, f"tables.dense.{name}")
             for name, spec in _mapping(tables.get("dense"), "tables.dense").items()}
    clash = sorted(set(sparse) & set(dense))
    if clash:
        raise ConfigError(f"tables: names {clash} are both sparse and dense; table names must be unique")
    model_cfg = None
    if model is not None:
        if not isinstance(model, dict) or "kind" not in model:
            raise ConfigError(f"model must be a mapping with a 'kind', got {model!r}")
        from .programs import program_config_class
        params = dict(model)
        kind = params.pop("kind")
        model_cfg = ModelConfig(kind, build(program_config_class(kind), params, "model"))
    cfg = dataclasses.replace(cfg, sparse_tables=sparse, dense_tables=dense, model=model_cfg)
    if cfg.cluster.endpoints and len(cfg.cluster.endpoints) != cfg.cluster.servers:
        raise ConfigError(f"cluster.endpoints lists {len(cfg.cluster.endpoints)} servers but "
                          f"cluster.servers is {cfg.cluster.servers}")
    if cfg.cluster.num_vshards < cfg.cluster.servers:
        raise ConfigError(f"cluster.num_vshards must be >= cluster.servers ({cfg.cluster.servers}), "
                          f"got {cfg.cluster.num_vshards}")
    return cfg


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=c`` overrides to a YAML mapping (a deep copy is returned).

    Raises
    ------
    ConfigError
        An override without ``=``, or a path through a non-mapping value.
    """
    import copy
    data = copy.deepcopy(data) if data else {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE")
        path, raw = item.split("=", 1)
        keys = [k for k in path.strip().split(".")]
        if not all(keys):
            raise ConfigError(f"--set {item!r}: empty key in path {path!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: value is not valid YAML: {e}") from None
        node = data
        for i, k in enumerate(keys[:-1]):
            nxt = node.setdefault(k, {})
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(keys[:i + 1])} is {nxt!r}, not a mapping")
            node = nxt
        node[keys[-1]] = value
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> EngineConfig:
    """Read a YAML config file, apply ``--set`` overrides, and build the config tree.

    Raises
    ------
    ConfigError
        The file is missing or not YAML, or any value is bad (the key path is named).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return from_dict(apply_overrides(data, overrides or []))


def dump_config(cfg: EngineConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (the launcher hands this file to every child process)."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def _mapping(value, kp: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{kp} must be a mapping of table name -> settings, got {value!r}")
    return value


def _plain(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):   # a nested section of a program's Config
            v = _plain(v)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out
