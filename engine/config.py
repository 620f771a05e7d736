"""The engine config: one frozen dataclass tree loaded from YAML.

Every section is a frozen pydantic dataclass (``engine.config_base.section``) with its bounds and
choices declared on the fields; unknown keys, wrong types and bad values are rejected with the key path,
the value and what is allowed (``cluster.servers must be >= 1, got 0``, ``mode must be one of ['sync',
'async', 'geo'], got 'x'``, ``cluster: unknown key(s) ['foo']; known keys: [...]``).

Files are read as YAML 1.2 (``engine.config_yaml``): ``yes``/``no`` are strings, ``0100`` is 100.
``--set a.b=c`` overrides are applied to the YAML mapping before it is checked; the value is read as
YAML (``--set cluster.workers=3`` an int, ``--set cluster.warm_up=false`` a bool, ``--set
cluster.endpoints=[h:1,h:2]`` a list), except that a string field always gets the text as written, in
files and in ``--set`` alike: ``--set model.until=2024010108`` and ``until: 0100`` give the strings
``"2024010108"`` and ``"0100"``.

Layout (``configs/ctr.yaml`` sets every knob, with a comment; each program's config its ``model`` knobs)::

    mode: async                 # sync | async | geo | hybrid
    cluster: {servers, workers, host, endpoints, local_shards, num_vshards, ...}
    client: {timeout_s, retries, backoff_s, threads, async_queue, barrier_timeout_s}
    server: {max_barrier_wait_s, max_concurrent_rpcs, reply_window_bytes, max_message_bytes, ...}
    security: {tls: {cert, key, ca, client_cert, client_key}, token_file, admin_token_file, insecure, ...}
                                (engine.security.settings)
    geo: {k_steps, learning_rate, evict_after_steps, delta_scale}   (dense: tables.dense's optimizer)
    hybrid: {dense_sync_steps}  (engine.modes.hybrid: dense tower all-reduced among the workers over MPI)
    checkpoint: {root, job, delta_every, base_every, keep_bases, fallback, final, threads, align_steps}
                                (engine.checkpoint.schedule; root "" = no checkpoints)
    storage: {endpoint, region, scheme, access_key_env, secret_key_env, ...}   (StorageConfig: s3/hdfs)
    observability: {prometheus_port, pushgateway, push_interval_s, tensorboard, tensorboard_dir}
                                (engine.observability.settings; metrics endpoint off unless a port is set)
    tables:
      sparse: {NAME: {sparse_tables.TableConfig fields}}
      dense:  {NAME: {optimizer, learning_rate, beta1, beta2, epsilon}}
    model: {kind: logreg, ...the worker program's own fields}

The ``model`` section is owned by the worker program that ``model.kind`` selects (see
``engine.programs``): its fields are that program's ``Config`` section, declared in
``engine.program_configs`` (so reading a config imports no program).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import typing
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field

from sparse_tables import TableConfig, TableConfigError

from .checkpoint.schedule import CheckpointConfig
from .config_base import MAX_SECONDS, Nested, StrTuple, build, section, with_texts
from .config_yaml import Source, load_yaml, parse_value
from .errors import ConfigError
from .observability.settings import ObservabilityConfig
from .program_configs import program_config_class
from .security.settings import SecurityConfig

Mode = Literal["sync", "async", "geo", "hybrid"]
MODES = typing.get_args(Mode)

#: inline storage secrets -> the environment variable that carries each to the launcher's children
SECRET_ENV = {"access_key": "ENGINE_STORAGE_ACCESS_KEY", "secret_key": "ENGINE_STORAGE_SECRET_KEY"}


#: most virtual shards a job may have: every client and server holds an int32 owner map of
#: ``num_vshards`` entries (vshard ids are int32), 4 MiB at this bound, 1024x the default; 2^40 asked each
#: server for a 4 TiB array and every server died with a MemoryError traceback
MAX_VSHARDS = 1 << 20


@section
class ClusterConfig:
    """Processes and addresses. ``endpoints`` (``host:port`` of every server, in rank order) is for
    multi-host runs; empty means the launcher starts ``servers`` servers on ``host`` with free ports.
    ``warm_up``: every process compiles its Numba kernels (or loads them from the cache) before it
    serves or trains (``engine.ps.warmup``), so no request or step of the job compiles.

    Supervision (``engine.launch.supervisor``): when a role dies or hangs, the launcher restarts the
    whole cluster from the newest complete checkpoint, at most ``max_restarts`` times within any
    ``restart_window_s`` seconds. ``preempt_timeout_s``: after SIGTERM, how long the job may take to
    reach its next step boundary and write a checkpoint before it is stopped anyway.

    ``launcher``: ``local`` (child processes, ``engine.launch.local``) or ``ray`` (Ray actors placed by a
    placement group, ``engine.launch.ray``; ``ray_address`` joins a running cluster, empty starts a local
    Ray; ``server_resources`` / ``worker_resources`` are each role's Ray resources, e.g. ``{CPU: 1,
    ps_node: 1}``, custom ones pinning roles to the nodes that offer them).

    ``health_port`` (-1: off; 0: a free port): each server also serves the standard gRPC health checking
    protocol (``grpc.health.v1.Health``) in plaintext on this port and nothing else, for probes that speak
    neither TLS nor tokens (Kubernetes' native gRPC probe); SERVING once the PS port listens, NOT_SERVING
    while preempting or stopping. ``stop_servers_at_end`` (role mode, e.g. Kubernetes Jobs, where no
    launcher stops the servers): when the job ends normally, every worker meets at a last barrier and
    worker rank 0 sends ``Stop`` (admin token) to every server, which then exits 0; when the workers
    stop at a preemption checkpoint, rank 0 stops the servers that got SIGTERM themselves, which exit 75
    at once instead of after ``preempt_timeout_s`` (the others keep serving the replacement workers).

    ``run_root``: where the local launcher makes each run's directory (config, logs, progress files,
    ``endpoints.json``) when ``--run-dir`` is not given: ``{run_root}/{job}-{YYYYmmdd-HHMMSS}-{pid}``,
    with ``{run_root}/latest`` pointing at the newest (``engine status`` without a target reads it)."""

    servers: Annotated[int, Field(ge=1)] = 1
    workers: Annotated[int, Field(ge=1)] = 1
    host: str = "127.0.0.1"
    endpoints: StrTuple = ()
    server_threads: Annotated[int, Field(ge=1)] = 8
    local_shards: Annotated[int, Field(ge=1)] = 4
    num_vshards: Annotated[int, Field(ge=1, le=MAX_VSHARDS)] = 1024
    startup_timeout_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 120.0
    stop_timeout_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 10.0
    warm_up: bool = True
    max_restarts: Annotated[int, Field(ge=0)] = 3
    restart_window_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 3600.0
    preempt_timeout_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 300.0
    launcher: Literal["local", "ray"] = "local"
    ray_address: str = ""                       # "" : RAY_ADDRESS, else start a local Ray
    server_resources: dict[str, Annotated[float, Field(ge=0, strict=False)]] = field(default_factory=dict)
    worker_resources: dict[str, Annotated[float, Field(ge=0, strict=False)]] = field(default_factory=dict)
    health_port: Annotated[int, Field(ge=-1, le=65535)] = -1   # -1 off; gRPC health checking, plaintext
    stop_servers_at_end: bool = False   # role mode: worker rank 0 stops the servers when the job ends
    run_root: str = "runs/run"          # local launcher: each run's directory is {run_root}/{job}-{time}-{pid}


@section
class ClientConfig:
    """PS client behaviour (timeouts in seconds)."""

    timeout_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 60.0
    retries: Annotated[int, Field(ge=0)] = 5
    backoff_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 0.05
    max_backoff_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 2.0
    threads: Annotated[int, Field(ge=1)] = 8
    async_queue: Annotated[int, Field(ge=0)] = 0
    barrier_timeout_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 600.0
    # a silent server or a stuck worker is dead after this
    dead_after_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 30.0


@section
class ServerConfig:
    """Limits a parameter server enforces whatever its clients ask.

    Attributes
    ----------
    max_barrier_wait_s : float, seconds, in (0, MAX_SECONDS]
        Longest a barrier waits on the server; a client's own barrier timeout
        (``client.barrier_timeout_s``) is capped by it.
    max_concurrent_rpcs : int, >= 0
        RPCs a server handles at once (gRPC's ``maximum_concurrent_rpcs``); calls beyond it fail at
        once with ``RESOURCE_EXHAUSTED``. 0 = unlimited.
    reply_window_bytes : int, bytes, >= 0
        Bytes of recent replies a server keeps to answer a retried request without applying it twice
        (64 MiB by default; 0 keeps none).
    max_message_bytes : int, bytes, in [4 MiB, 2 GiB)
        The largest request a server accepts and the largest reply it sends (gRPC's message limits);
        a larger request is refused with ``RESOURCE_EXHAUSTED`` before anything is allocated. Clients
        learn it from the servers' ``Health`` and size their chunks to fit.
    expiry_clock : {"wall", "data"}
        The clock of ``last_seen`` and of the expiry pass (``expire_after``): the server's wall clock, or
        the data clock the online job moves to the end of each hour it trains (``engine.ps.data_clock``:
        forward only, never past the wall clock + 1 h, unset by a load until the job sets it).
    max_dense_floats : int, floats, >= 1
        The largest dense table a client may initialize (``init_dense``, 2^25 by default: 128 MiB of
        parameters, the shipped models have under 500 000); a larger size is refused with
        INVALID_ARGUMENT before anything is allocated.
    """

    max_barrier_wait_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 600.0
    max_concurrent_rpcs: Annotated[int, Field(ge=0)] = 256
    reply_window_bytes: Annotated[int, Field(ge=0)] = 64 << 20
    max_message_bytes: Annotated[int, Field(ge=4 << 20, le=(2 << 30) - 1)] = 16 << 20
    expiry_clock: Literal["wall", "data"] = "wall"
    max_dense_floats: Annotated[int, Field(ge=1)] = 1 << 25


@section
class GeoConfig:
    """GEO-SGD: the local plain-SGD learning rate of the sparse rows, sync period, the local cache's
    expiry, and whether deltas are averaged over the workers (``mean``, Paddle's geo-SGD) or added in
    full (``sum``). The dense parameters are stepped on the worker with their table's optimizer
    (``tables.dense.NAME``: adam, learning_rate, beta1, beta2, epsilon; ``engine.modes.geo``); the
    former plain-SGD step ``geo.dense_learning_rate`` is ignored with a warning (``GEO_REMOVED_KEYS``)."""

    k_steps: Annotated[int, Field(ge=1)] = 10
    learning_rate: Annotated[float, Field(gt=0)] = 0.05
    evict_after_steps: Annotated[int, Field(ge=1)] = 1000
    delta_scale: Literal["mean", "sum"] = "mean"


#: keys ``geo`` no longer has -> why and what replaces them. A config that still sets one (every config
#: and checkpoint snapshot written before: ``to_dict`` dumps defaults) loads, with one WARNING naming
#: the replacement, and the key is ignored (read as an Adam learning rate, the former SGD step 0.05
#: would train CTR-DNN to test AUC 0.51)
GEO_REMOVED_KEYS = {
    "dense_learning_rate": (
        "was GEO's plain-SGD step of the dense parameters; GEO now steps them with the dense table's own "
        "optimizer (tables.dense.NAME: optimizer, learning_rate, beta1, beta2, epsilon), whose learning "
        "rate has another scale, so it is ignored: delete it (to change GEO's dense learning rate, set "
        "tables.dense.NAME.learning_rate)"),
}


def _drop_removed_geo_keys(geo):
    """``geo`` without the keys of ``GEO_REMOVED_KEYS`` (one WARNING per key found)."""
    found = [k for k in GEO_REMOVED_KEYS if k in geo] if isinstance(geo, dict) else []
    for key in found:
        logging.getLogger(__name__).warning("geo.%s: %r %s", key, geo[key], GEO_REMOVED_KEYS[key])
    return {k: v for k, v in geo.items() if k not in GEO_REMOVED_KEYS} if found else geo


@section
class HybridConfig:
    """``mode: hybrid`` (``engine.modes.hybrid``): sparse tables on the servers as in async; every worker
    holds the dense tower and steps it with ``tables.dense.NAME``'s optimizer, kept identical over MPI.

    ``dense_sync_steps`` 1 (default): the mean of the workers' dense gradients is all-reduced every step
    (exact: every worker steps with the same mean gradient). k > 1: model averaging, each worker steps
    with its own gradient and every k steps the parameters and the optimizer's moments are averaged.

    How other keys apply: ``model.dense_merge_steps`` must be 1 (merging gradients before a step is
    what ``dense_sync_steps`` does here, exactly); ``model.pipeline`` ``exact`` runs the dense step
    beside the step's sparse push and pull and waits for both; ``stale`` keeps two sparse requests in
    flight (a step sees this worker's own sparse updates one step later, as in async's stale pipeline)
    while the dense step stays exact, never stale; ``sequential`` runs one after the other. CTR models only (``model.kind`` ctr_dnn, deepfm);
    ``cluster.launcher: local`` only (the workers form one ``mpiexec`` world); off loopback it needs
    ``security.insecure: true`` (MPI traffic is neither authenticated nor encrypted).
    """

    dense_sync_steps: Annotated[int, Field(ge=1)] = 1
    #: k = 1 with ``model.pipeline`` exact or stale, > 0: the all-reduce and the optimizer step run layer
    #: by layer beside the backward pass on a progress thread, in collectives of at least this many floats
    #: (DDP's gradient buckets, Horovod's fusion threshold; 65536 is a good start). 0 (default): one
    #: all-reduce of the whole gradient after the pass. On a 2-core machine shared by a server and two
    #: workers the overlap measured slower (the thread's work competes with the matrix products; README)
    bucket_floats: Annotated[int, Field(ge=0)] = 0


@section
class DenseTableConfig:
    """A dense table: a flat float32 vector updated on the servers by Adam or SGD."""

    optimizer: Literal["adam", "sgd"] = "adam"
    learning_rate: Annotated[float, Field(gt=0)] = 1e-3
    beta1: Annotated[float, Field(ge=0, le=0.999999)] = 0.9
    beta2: Annotated[float, Field(ge=0, le=0.999999)] = 0.999
    #: Adam's epsilon as PyTorch's ``torch.optim.Adam`` (Kingma & Ba, Algorithm 1): added to the
    #: bias-corrected ``sqrt(v / (1 - beta2^t))`` (``models.optim.Adam``). A sparse table's ``epsilon``
    #: (``tables.sparse.NAME.epsilon``, lazy Adam as Paddle's SparseAdamSGDRule) is the paper's "epsilon
    #: hat", added to the uncorrected ``sqrt(v)``: the same number damps more there (README "Optimizers")
    epsilon: Annotated[float, Field(gt=0)] = 1e-8


@section
class StorageConfig:
    """Connection settings of remote storage (``s3://``, ``hdfs://``) for every process of a job: the
    servers writing checkpoint parts, the workers reading hourly partitions and writing manifests.

    Empty fields fall back to the standard AWS environment variables (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``) and the SDK's defaults. Keep secrets
    out of config files: ``access_key_env`` / ``secret_key_env`` / ``session_token_env`` name environment
    variables that hold them, read in each process. Inline ``access_key`` / ``secret_key`` also work;
    checkpoint manifests never record them, and the launcher hands them to its children through their
    environment, not the config file it writes (``dump_config``, ``restore_secrets``).
    """

    endpoint: str = ""          # S3 endpoint: "host:port" or a URL "http://host:port"
    region: str = ""            # e.g. us-east-1
    scheme: Literal["", "http", "https"] = ""
    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    access_key_env: str = ""    # name of the environment variable holding the access key
    secret_key_env: str = ""
    session_token_env: str = ""
    anonymous: bool = False     # S3 without credentials (public buckets)
    connect_timeout_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = 0.0   # 0 = the SDK's default
    request_timeout_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = 0.0
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


@section
class KubernetesConfig:
    """What ``engine k8s`` renders (``engine.launch.k8s``): namespace, job name prefix (default
    ``checkpoint.job`` or ``model.kind``), image, requests = limits per role (Kubernetes quantities),
    the PS and health ports, the Secret holding ``engine certs``' files, an optional Secret of storage
    credentials (its keys become the environment variables ``storage.*_env`` name) and the Jobs'
    ``backoffLimit``."""

    namespace: str = "default"
    name: str = ""
    image: str = ""
    server_cpu: str = "2"
    server_memory: str = "8Gi"
    worker_cpu: str = "2"
    worker_memory: str = "4Gi"
    port: Annotated[int, Field(ge=1, le=65535)] = 7000
    health_port: Annotated[int, Field(ge=1, le=65535)] = 7001
    security_secret: str = "engine-security"
    storage_secret: str = ""
    backoff_limit: Annotated[int, Field(ge=0)] = 3


@section
class ModelConfig:
    """``kind`` picks the worker program; ``params`` is that program's own ``Config`` section."""

    kind: str
    params: Any


@section
class EngineConfig:
    mode: Mode = "async"
    cluster: Annotated[ClusterConfig, Nested] = field(default_factory=ClusterConfig)
    client: Annotated[ClientConfig, Nested] = field(default_factory=ClientConfig)
    server: Annotated[ServerConfig, Nested] = field(default_factory=ServerConfig)
    geo: Annotated[GeoConfig, Nested] = field(default_factory=GeoConfig)
    hybrid: Annotated[HybridConfig, Nested] = field(default_factory=HybridConfig)
    checkpoint: Annotated[CheckpointConfig, Nested] = field(default_factory=CheckpointConfig)
    storage: Annotated[StorageConfig, Nested] = field(default_factory=StorageConfig)
    security: Annotated[SecurityConfig, Nested] = field(default_factory=SecurityConfig)
    kubernetes: Annotated[KubernetesConfig, Nested] = field(default_factory=KubernetesConfig)
    observability: Annotated[ObservabilityConfig, Nested] = field(default_factory=ObservabilityConfig)
    sparse_tables: dict[str, Any] = field(default_factory=dict)   # name -> sparse_tables.TableConfig
    dense_tables: dict[str, DenseTableConfig] = field(default_factory=dict)
    model: Annotated[ModelConfig, Nested] | None = None

    def to_dict(self) -> dict:
        """The YAML mapping this config loads from (round-trips through ``from_dict``)."""
        out = {"mode": self.mode, "cluster": _plain(self.cluster), "client": _plain(self.client),
               "server": _plain(self.server), "geo": _plain(self.geo),
               "hybrid": _plain(self.hybrid), "checkpoint": _plain(self.checkpoint),
               "storage": _plain(self.storage), "security": _plain(self.security),
               "kubernetes": _plain(self.kubernetes), "observability": _plain(self.observability),
               "tables": {"sparse": {k: _plain(v) for k, v in self.sparse_tables.items()},
                          "dense": {k: _plain(v) for k, v in self.dense_tables.items()}}}
        if self.model is not None:
            out["model"] = {"kind": self.model.kind, **_plain(self.model.params)}
        return out


#: the keys of the top level of a config file
TOP_KEYS = sorted({f.name for f in dataclasses.fields(EngineConfig)} - {"sparse_tables", "dense_tables"}
                  | {"tables"})


def from_dict(data: dict) -> EngineConfig:
    """Build an EngineConfig from the YAML mapping.

    Parameters
    ----------
    data : dict
        The mapping; a ``engine.config_yaml.Source`` (what ``load_config`` and ``apply_overrides``
        give) also carries the source text of its scalars, which string fields take.

    Raises
    ------
    ConfigError
        Unknown keys, wrong types, out-of-range values, unknown ``model.kind``, tables that violate
        ``sparse_tables.TableConfig``'s checks; the message names the key path.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping at the top level, got {type(data).__name__}")
    texts = getattr(data, "texts", None)
    data = dict(data)
    tables = data.pop("tables", None) or {}
    model = data.pop("model", None)
    unknown = sorted(str(k) for k in set(data) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"config: unknown key(s) {unknown}; known keys: {TOP_KEYS}")
    if "geo" in data:
        data["geo"] = _drop_removed_geo_keys(data["geo"])
    cfg = build(EngineConfig, data, "", texts=texts)
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
        spec = with_texts(TableConfig, spec, ("tables", "sparse", name), texts)
        try:
            sparse[str(name)] = TableConfig.from_dict(spec, kp)
        except TableConfigError as e:
            raise ConfigError(str(e).replace("TableConfig.", kp + ".")) from None
        except TypeError as e:
            raise ConfigError(f"{kp}: {e}") from None
    dense = {str(name): build(DenseTableConfig, spec, f"tables.dense.{name}", texts=texts,
                              at=("tables", "dense", name))
             for name, spec in _mapping(tables.get("dense"), "tables.dense").items()}
    clash = sorted(set(sparse) & set(dense))
    if clash:
        raise ConfigError(f"tables: names {clash} are both sparse and dense; table names must be unique")
    model_cfg = None
    if model is not None:
        if not isinstance(model, dict) or "kind" not in model:
            raise ConfigError(f"model must be a mapping with a 'kind', got {model!r}")
        params = dict(model)
        kind = params.pop("kind")
        if not isinstance(kind, str):
            raise ConfigError(f"model.kind must be the name of a worker program, got {kind!r}")
        _check_model_keys(kind, params)
        model_cfg = ModelConfig(kind, build(program_config_class(kind), params, "model", texts=texts))
    cfg = _drop_former_metrics_table(dataclasses.replace(cfg, sparse_tables=sparse, dense_tables=dense,
                                                         model=model_cfg))
    _check_unused_tables(cfg)
    for i, endpoint in enumerate(cfg.cluster.endpoints):
        check_endpoint(endpoint, f"cluster.endpoints[{i}]")
    if cfg.cluster.endpoints and len(cfg.cluster.endpoints) != cfg.cluster.servers:
        raise ConfigError(f"cluster.endpoints lists {len(cfg.cluster.endpoints)} servers but "
                          f"cluster.servers is {cfg.cluster.servers}")
    if cfg.cluster.num_vshards < cfg.cluster.servers:
        raise ConfigError(f"cluster.num_vshards must be >= cluster.servers ({cfg.cluster.servers}), "
                          f"got {cfg.cluster.num_vshards}")
    per_server = cfg.cluster.num_vshards // cfg.cluster.servers      # the fewest vshards a server owns
    if cfg.cluster.local_shards > per_server:       # a local shard owns whole vshards: the rest stay empty
        raise ConfigError(f"cluster.local_shards must be <= cluster.num_vshards // cluster.servers ({per_server}: "
                          f"a local shard holds whole vshards, more would stay empty), got {cfg.cluster.local_shards}")
    if cfg.mode == "hybrid":
        _check_hybrid(cfg)
    kind = cfg.model.kind if cfg.model is not None else None
    if cfg.server.expiry_clock == "data" and kind not in (None, "ctr_online"):
        raise ConfigError(f"server.expiry_clock: data needs model.kind: ctr_online (the program that moves the "
                          f"data clock to each hour it trains), got model.kind: {kind}; use wall")
    for name, t in cfg.sparse_tables.items():
        if 0 < t.max_rows < cfg.cluster.local_shards:    # each local shard needs a share of at least 1
            raise ConfigError(f"tables.sparse.{name}.max_rows must be 0 (no limit) or >= cluster.local_shards "
                              f"({cfg.cluster.local_shards}), got {t.max_rows}")
    return cfg


def check_endpoint(endpoint: str, key: str) -> None:
    """``endpoint`` is ``host:port``: a host (a name, an IPv4 address or ``[IPv6]``) and a port in [1, 65535].

    Raises
    ------
    ConfigError
        It is not: names ``key`` (``cluster.endpoints[1]``, ``ENGINE_SERVERS``), the endpoint and why. A
        server given ``h`` or ``h:x`` died on it with a traceback; a worker waited ``startup_timeout_s``
        for it.
    """
    host, sep, port = endpoint.rpartition(":")
    why = ("no ':port'" if not sep else "no host" if not host.strip() else
           None if port.isascii() and port.isdigit() and 1 <= int(port) <= 65535 else
           f"the port must be in [1, 65535], got {port!r}")
    if why:
        raise ConfigError(f"{key} must be host:port ({why}), got {endpoint!r}")


def _check_model_keys(kind: str, params: dict) -> None:
    """Refuse ``model`` keys that ``kind``'s program does not have, naming the kinds that have them:
    ``--set model.window=5`` on a CTR config is a word2vec knob.

    Raises
    ------
    ConfigError
        ``model: unknown key(s) ['window'] for model.kind ctr_dnn (key of model.kind word2vec); known
        keys: [...]``. An unknown ``kind`` is left to ``build``'s caller (``program_config_class``).
    """
    from .program_configs import PROGRAM_CONFIGS
    if kind not in PROGRAM_CONFIGS:
        return
    keys_of = {k: {f.name for f in dataclasses.fields(c)} for k, c in PROGRAM_CONFIGS.items()}
    unknown = sorted(str(k) for k in params if str(k) not in keys_of[kind])
    if not unknown:
        return
    groups: dict[tuple, list] = {}          # the kinds that have a key -> those keys
    for k in unknown:
        groups.setdefault(tuple(other for other, keys in keys_of.items() if k in keys), []).append(k)
    if len(groups) == 1 and () not in groups:
        hint = f"key{'s' if len(unknown) > 1 else ''} of model.kind {', '.join(next(iter(groups)))}"
    else:
        hint = "; ".join(f"{ks} of model.kind {', '.join(kinds)}" for kinds, ks in groups.items() if kinds)
    raise ConfigError(f"model: unknown key(s) {unknown} for model.kind {kind}{f' ({hint})' if hint else ''}; "
                      f"known keys: {sorted(keys_of[kind])}")


def _drop_former_metrics_table(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` without the dense table ``model.metrics_table`` names, with one WARNING. Configs written
    before 2026-11-25 declared it (``tables.dense.metrics``: sgd, learning rate 1) to merge evaluation
    histograms; the servers now sum metrics in accumulators of that name, and a declared table of it
    was refused as a misspelt one, so such a config no longer loaded."""
    name = getattr(cfg.model.params, "metrics_table", None) if cfg.model is not None else None
    if not name or name not in cfg.dense_tables or name == getattr(cfg.model.params, "dense_table", None):
        return cfg
    logging.getLogger(__name__).warning(
        "tables.dense.%s: the dense table model.metrics_table named before 2026-11-25 (evaluation histograms "
        "were merged in it); the servers now sum metrics themselves, so it is ignored: delete it", name)
    return dataclasses.replace(cfg, dense_tables={n: t for n, t in cfg.dense_tables.items() if n != name})


def _check_unused_tables(cfg: EngineConfig) -> None:
    """Refuse a declared table the program does not train (``used_tables`` of its ``model`` section;
    programs without it are not checked): a misspelt ``--set tables.sparse.embeding.learning_rate=0.5``
    declared a table of its own, and the setting was lost without a word.

    Raises
    ------
    ConfigError
        Names the first unused table's key path and the tables the program uses (with the keys naming them).
    """
    used_of = getattr(cfg.model.params, "used_tables", None) if cfg.model is not None else None
    if used_of is None:
        return
    used = used_of()
    for kind, declared in (("sparse", cfg.sparse_tables), ("dense", cfg.dense_tables)):
        unused = [name for name in declared if name not in used[kind]]
        if unused:
            uses = "; ".join(f"{k} table(s) " + ", ".join(f"{n!r} ({key})" for n, key in used[k].items())
                             for k in ("sparse", "dense"))
            raise ConfigError(f"tables.{kind}.{unused[0]}: model.kind {cfg.model.kind} uses no {kind} table "
                              f"{unused[0]!r} (it uses {uses}); a misspelt table name loses its settings: fix the "
                              f"name, or remove the table")


#: a dense block's params, Adam's m and v in one message (3 x 4 bytes x ``engine.ps.codec.DENSE_BLOCK``
#: floats) and the envelope: what mode hybrid's state pulls and uploads need (checked equal in tests)
HYBRID_MIN_MESSAGE_BYTES = 3 * 4 * (1 << 19) + (1 << 20)
#: programs that can train in mode hybrid (the CTR worker loop, ``engine.programs.ctr``)
HYBRID_KINDS = ("ctr_dnn", "deepfm")


def _check_hybrid(cfg: EngineConfig) -> None:
    """Refuse what mode hybrid cannot do (see ``HybridConfig``), naming the keys."""
    from .security.listen import is_loopback
    kind = cfg.model.kind if cfg.model is not None else None
    if kind is not None and kind not in HYBRID_KINDS:
        raise ConfigError(f"mode hybrid trains {list(HYBRID_KINDS)} only (its dense tower is all-reduced among "
                          f"the workers), got model.kind={kind!r}: use mode async or geo")
    p = cfg.model.params if cfg.model is not None else None
    if getattr(p, "dense_merge_steps", 1) > 1:
        raise ConfigError(f"mode hybrid needs model.dense_merge_steps=1 (the dense step is all-reduced every "
                          f"step; for fewer syncs set hybrid.dense_sync_steps), got {p.dense_merge_steps}")
    h = cfg.hybrid
    if h.bucket_floats > 0 and (h.dense_sync_steps > 1 or getattr(p, "pipeline", "exact") == "sequential"):
        raise ConfigError(f"hybrid.bucket_floats={h.bucket_floats} overlaps the all-reduce with the backward pass, "
                          f"which needs hybrid.dense_sync_steps=1 and model.pipeline exact or stale; got "
                          f"hybrid.dense_sync_steps={h.dense_sync_steps}, model.pipeline="
                          f"{getattr(p, 'pipeline', None)!r}: set hybrid.bucket_floats=0 (it was ignored)")
    if cfg.cluster.launcher != "local":
        raise ConfigError(f"mode hybrid runs with cluster.launcher (--launcher) local only, got "
                          f"{cfg.cluster.launcher!r}: its workers form one MPI world started by mpiexec (see "
                          f"README, 'Hybrid mode', for Ray and Kubernetes)")
    least = HYBRID_MIN_MESSAGE_BYTES
    if cfg.server.max_message_bytes < least:
        raise ConfigError(f"mode hybrid needs server.max_message_bytes >= {least} (a dense block's optimizer "
                          f"state, params + Adam's m and v, travels in one message at every checkpoint and "
                          f"resume), got {cfg.server.max_message_bytes}")
    hosts = [cfg.cluster.host] + [e.rsplit(":", 1)[0] for e in cfg.cluster.endpoints]
    remote = [h for h in hosts if not is_loopback(h)]
    if remote and not cfg.security.insecure:
        raise ConfigError(f"mode hybrid off loopback ({remote[0]!r} in cluster.host / cluster.endpoints) needs "
                          f"security.insecure: true: the workers' MPI traffic is neither authenticated nor "
                          f"encrypted")


def apply_overrides(data: dict, overrides: list[str]) -> Source:
    """Apply ``a.b=c`` overrides to a YAML mapping (a deep copy is returned).

    Each value is read as YAML 1.2 and its raw text (after ``=``) kept for string fields
    (``engine.config_yaml.parse_value``); the source texts ``data`` carries (a ``Source``) are kept
    for every key not overridden.

    Raises
    ------
    ConfigError
        An override without ``=``, an empty key, a value that is not YAML, or a path through a
        non-mapping value.
    """
    out = Source(copy.deepcopy(dict(data)) if data else {}, getattr(data, "texts", None))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE")
        path, raw = item.split("=", 1)
        keys = path.strip().split(".")
        if not all(keys):
            raise ConfigError(f"--set {item!r}: empty key in path {path!r}")
        value, texts = parse_value(raw, f"--set {item!r}")
        node = out
        for i, k in enumerate(keys[:-1]):
            nxt = node.setdefault(k, {})
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(keys[:i + 1])} is {nxt!r}, not a mapping")
            node = nxt
        node[keys[-1]] = value
        at = tuple(keys)
        out.texts = {p: t for p, t in out.texts.items() if p[:len(at)] != at}
        out.texts.update({at + p: t for p, t in texts.items()})
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> EngineConfig:
    """Read a YAML config file, apply ``--set`` overrides, and build the config tree.

    Raises
    ------
    ConfigError
        The file is missing, a directory, unreadable, not UTF-8 (the byte offset and line are named) or not YAML,
        or any value is bad (the key path is named).
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {p}: is a directory, not a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    return from_dict(apply_overrides(load_yaml(read_config_text(p), str(p)), overrides or []))


def read_config_text(path: Path) -> str:
    """The text of the config file ``path``, decoded as UTF-8 (what YAML 1.2 files are).

    Raises
    ------
    ConfigError
        The file cannot be read (names it and the OS error), or holds bytes that are not UTF-8 (names
        the file, the first bad byte's 0-based offset and its line).
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"config file {path}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                          f"(line {line}) cannot be decoded ({e.reason}); save the file as UTF-8") from None


# ------------------------------------------------------------------------------- the resolved file
def dump_config(cfg: EngineConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (the launcher hands this file to every child process).

    The file is created readable and writable by its owner only (mode 0600; written to a new file and
    renamed over ``path``), and holds no inline storage secret: ``storage.access_key`` and
    ``storage.secret_key`` are written empty. The launcher passes them to its children in their
    environment (``secret_env``), where ``restore_secrets`` finds them again.
    """
    path = Path(path)
    text = yaml.safe_dump(redact_secrets(cfg).to_dict(), sort_keys=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def redact_secrets(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` with the inline storage secrets (``StorageConfig.SECRETS``) emptied."""
    if not any(getattr(cfg.storage, k) for k in StorageConfig.SECRETS):
        return cfg
    return dataclasses.replace(cfg, storage=dataclasses.replace(
        cfg.storage, **{k: "" for k in StorageConfig.SECRETS}))


def secret_env(cfg: EngineConfig) -> dict[str, str]:
    """The environment variables (``SECRET_ENV``) that carry ``cfg``'s inline storage secrets to a
    child process: ``{"ENGINE_STORAGE_SECRET_KEY": "...", ...}``, empty without inline secrets."""
    return {SECRET_ENV[k]: getattr(cfg.storage, k) for k in StorageConfig.SECRETS if getattr(cfg.storage, k)}


def restore_secrets(cfg: EngineConfig, environ: typing.Mapping[str, str] | None = None) -> EngineConfig:
    """``cfg`` with each empty inline storage secret taken from its ``SECRET_ENV`` variable.

    A child of the launcher reads the config file ``dump_config`` wrote, then calls this (see
    ``engine.roles``). A secret the config holds is kept; variables that are unset or empty change
    nothing.

    Parameters
    ----------
    environ : mapping, optional
        Default ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    found = {k: environ.get(var, "") for k, var in SECRET_ENV.items() if not getattr(cfg.storage, k)}
    found = {k: v for k, v in found.items() if v}
    if not found:
        return cfg
    return dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, **found))


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
