"""Kubernetes manifests of a job (``engine k8s CONFIG --image IMAGE --out DIR``): plain YAML that
``kubectl apply -f DIR`` runs, no operator. Every object is built as a dict and dumped with PyYAML.

One file per object in DIR, numbered in the order ``kubectl apply -f DIR`` should create them::

    00-{name}-config.yaml    ConfigMap  config.yaml: the resolved config, no secret in it
    01-{name}-ps.yaml        Service    headless (clusterIP None): the servers' DNS names
    02-{name}-server.yaml    Job        Indexed, completions = parallelism = cluster.servers
    03-{name}-worker.yaml    Job        Indexed, completions = parallelism = cluster.workers

**Servers are an Indexed Job, not a StatefulSet.** A StatefulSet restarts any pod that exits, 0
included, so its servers would outlive the job forever. The servers must end when the job ends. The
rendered config sets ``cluster.stop_servers_at_end: true``: every worker meets at a last barrier, worker
rank 0 sends ``Stop`` (admin token) to every server, and they exit 0, which completes the server Job. An
Indexed Job still gives each pod a stable DNS name: its hostname is ``{job}-{index}``, and with the
headless Service as the pod template's ``subdomain`` it resolves as ``{job}-{index}.{service}`` in the
namespace. Those names, with the PS port, are the workers' ``ENGINE_SERVERS``, and the server certificate
must name them (``engine certs DIR --hosts ...``: the CLI prints the line). The Service publishes
not-ready addresses: a preempting server answers NOT_SERVING (unready), and the workers must still reach
it to write the preemption checkpoint.

**Ranks.** ``ENGINE_RANK`` comes from the pod's ``batch.kubernetes.io/job-completion-index`` annotation
through the downward API; a replacement pod keeps its index, so it keeps its rank.

**Runs.** ``ENGINE_RUN_ID`` is the worker Job's uid (its pods' ``batch.kubernetes.io/controller-uid``
label, through the downward API): every worker pod and its replacements are one run, as the attempts of
one local ``engine train`` are, so ``ctr_online``'s ``max_partitions`` counts the whole Job (its
checkpoints carry the count), while rendering stays deterministic and a new Job is a new run.

**Exit codes and podFailurePolicy** (it needs ``restartPolicy: Never``): 2 (a config error or bad input
data, which never heal: every worker of a CTR job whose inputs hold a bad value exits 2 before its first
step, ``engine.programs.ctr_inputs``) and 74 (the checkpoint storage refuses writes: read-only, access
refused, full) fail the Job at once; 75 (preempted at a checkpoint, resumable) and 76 (a worker whose servers
changed under it, or that lost one or got no answer from one in time, or that waits for a roll-back) are
retried without counting against ``backoffLimit``; so is a pod with the ``DisruptionTarget`` condition
(evicted, preempted by the scheduler, node drain). Anything else counts against
``kubernetes.backoff_limit``. ``podReplacementPolicy: Failed``: a replacement starts only once the
old pod has terminated, so two servers never hold one DNS name. ``terminationGracePeriodSeconds`` is
``cluster.preempt_timeout_s`` + 60 s: after SIGTERM the job has that long to reach its checkpoint.

**Health.** Each server also serves the standard gRPC health checking protocol in plaintext on
``kubernetes.health_port`` (``cluster.health_port``) and nothing else: kubelet's native ``grpc`` probe
speaks neither TLS nor tokens. Startup, readiness and liveness probes use it; the startup probe allows
``cluster.startup_timeout_s`` (kernel compilation, a checkpoint restore). A value whose rendered integer
Kubernetes would refuse (over int32 or int64, an Indexed Job over 100000 pods) is a ConfigError
(``check_limits``). Readiness asks for the overall
status (NOT_SERVING while preempting or stuck), liveness for service ``liveness`` (NOT_SERVING only while
stuck: a request hung past ``client.timeout_s``, ``engine.ps.watchdog``), with ``LIVENESS_GRACE_S``.
Each worker serves its liveness on the same port (``engine.liveness``: NOT_SERVING once its loop stalls past ``client.dead_after_s``, no
answer when frozen), with a startup and a liveness probe (10 s × 3; a kill it causes gets
``LIVENESS_GRACE_S`` before SIGKILL, not the pod's grace) and no readiness probe.

**Security.** Pods listen on 0.0.0.0, so the config must have TLS, a worker token and an admin token, or
``security.insecure: true`` (else ConfigError naming the keys). Their paths are rewritten to the Secret
``kubernetes.security_secret`` (the files of ``engine certs``) mounted read-only at
``/etc/engine/security``: mutual TLS with its CA. Servers mount ca.pem, server.pem, server.key, token and
admin_token; workers ca.pem, client.pem, client.key, token and admin_token. Only worker rank 0 reads the
admin token, but every pod of an Indexed Job has the same template (Kubernetes cannot give one index
another volume), so every worker pod has it mounted. Inline storage secrets are refused; storage
credentials come from the Secret ``kubernetes.storage_secret`` as the environment variables
``storage.access_key_env`` / ``secret_key_env`` / ``session_token_env`` name.

**Filesystem.** Non-root (uid/gid 10001), read-only root filesystem, no privilege escalation, no
capabilities, no service-account token. Writable: ``/tmp`` (Numba's cache: ``NUMBA_CACHE_DIR``), the
working directory ``/var/lib/engine`` (relative paths of the config: metrics files) and absolute
``spill_path`` directories, each an emptyDir. Checkpoints and data must be on storage every pod reaches:
``s3://``, ``hdfs://``, or a shared volume the user adds to both Jobs at the same path. A local
``checkpoint.root`` is refused unless ``checkpoint.shared: true`` declares such a volume (then a warning
says to add it); local data paths are rendered with a warning.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import EngineConfig, StorageConfig, from_dict
from ..config_yaml import load_yaml
from ..errors import EXIT_STORAGE_REFUSED, ConfigError
from ..job_checkpoints import check_resume_id
from ..ps.health import LIVENESS
from ..preempt import EXIT_PREEMPTED
from ..roles import EXIT_ROLLBACK
from ..security import certs
from ..security.settings import SecurityConfig, TlsConfig

__all__ = ["CONFIG_PATH", "SECURITY_DIR", "WORK_DIR", "SERVER_ITEMS", "WORKER_ITEMS", "Manifests", "base_name",
           "check_limits", "pod_config", "render", "storage_env_names", "write"]

CONFIG_DIR = "/etc/engine/config"
CONFIG_FILE = "config.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
SECURITY_DIR = "/etc/engine/security"
WORK_DIR = "/var/lib/engine"
TMP_DIR = "/tmp"
NUMBA_CACHE = f"{TMP_DIR}/numba-cache"
RUN_AS = 10001
GRACE_MARGIN_S = 60
CONTAINER = "engine"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: the Secret's keys (``engine certs``' files) mounted in each role's pods
SERVER_ITEMS = (certs.CA_CERT, certs.SERVER_CERT, certs.SERVER_KEY, certs.TOKEN, certs.ADMIN_TOKEN)
WORKER_ITEMS = (certs.CA_CERT, certs.CLIENT_CERT, certs.CLIENT_KEY, certs.TOKEN, certs.ADMIN_TOKEN)
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
EXIT_CONFIG = 2         # a config error or bad input data (engine.cli.train); 75 and 76: engine.preempt,
#                         engine.roles; 74: engine.errors.EXIT_STORAGE_REFUSED (checkpoint storage refusing
#                         writes: FailJob too)
#: the servers' startup probe asks every this many seconds; it allows ``cluster.startup_timeout_s`` in all
STARTUP_PERIOD_S = 5
#: Kubernetes' integer fields: int32 (probe thresholds, backoffLimit, completions), int64 (grace periods)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
#: the largest parallelism Kubernetes accepts for an Indexed Job (ours: parallelism = completions)
INDEXED_JOB_MAX = 100_000
#: seconds between a failed liveness probe's SIGTERM and its SIGKILL (the probe's own
#: terminationGracePeriodSeconds): a hung or frozen worker, or a stuck server, cannot act on the SIGTERM
LIVENESS_GRACE_S = 10

_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")                     # DNS-1035 label
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|[mkMGTPE]|[KMGTPE]i)?\Z")
_QUANTITY_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Manifests:
    """What ``render`` returns.

    Attributes
    ----------
    files : dict of str -> dict
        File name -> Kubernetes object, in ``kubectl apply`` order.
    config : EngineConfig
        The config the pods run (the ConfigMap's ``config.yaml``).
    server_hosts : list of str
        The servers' DNS names ``{job}-{index}.{service}``, in rank order: the ``--hosts`` of
        ``engine certs``.
    warnings : list of str
        Things that render but need the user's attention: a shared local ``checkpoint.root`` or local
        data paths (volumes to add), ``security.insecure``.
    cert_hosts : list of str
        The names the server certificate must hold: ``server_hosts``, and with ``observability.prometheus_port``
        their cluster-wide forms ``{host}.{namespace}.svc`` too (the address a scraper in another namespace
        reaches a server pod by: ``deploy/prometheus/scrape-kubernetes.yml``).
    """

    files: dict[str, dict]
    config: EngineConfig
    server_hosts: list[str]
    warnings: list[str] = field(default_factory=list)
    cert_hosts: list[str] = field(default_factory=list)


def base_name(cfg: EngineConfig) -> str:
    """The objects' name prefix: ``kubernetes.name``, else ``checkpoint.job`` or ``model.kind`` made a
    DNS label (lower case, runs of other characters become ``-``).

    Raises
    ------
    ConfigError
        ``kubernetes.name`` is not a DNS-1035 label, or the longest pod hostname it gives exceeds 63
        characters.
    """
    k = cfg.kubernetes
    if k.name:
        if not _LABEL.match(k.name):
            raise ConfigError(f"kubernetes.name must be a DNS label (lower-case letters, digits and '-', "
                              f"starting with a letter), got {k.name!r}")
        name = k.name
    else:
        raw = cfg.checkpoint.job or (cfg.model.kind if cfg.model is not None else "")
        name = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
        if not name or not name[0].isalpha():
            name = f"engine-{name}".rstrip("-")
    longest = max(f"{name}-server-{cfg.cluster.servers - 1}", f"{name}-worker-{cfg.cluster.workers - 1}", key=len)
    if len(longest) > 63:
        raise ConfigError(f"kubernetes.name: the pod hostname {longest!r} would exceed 63 characters; set a "
                          f"shorter kubernetes.name")
    return name


def pod_config(cfg: EngineConfig) -> tuple[EngineConfig, list[str]]:
    """The config the pods run, and warnings: security paths on the Secret's mount, the server list left
    to ``ENGINE_SERVERS``, the health port and the job-end protocol on.

    Raises
    ------
    ConfigError
        Inline storage secrets (``storage.access_key`` / ``storage.secret_key``); a ``storage.*_env``
        without ``kubernetes.storage_secret``; TLS, a token or an admin token missing without
        ``security.insecure: true`` (the keys are named); a CTR job whose data is not Arrow; a local
        ``checkpoint.root`` without ``checkpoint.shared: true``; ``mode: hybrid`` with more than one worker
        (the worker Job's pods are not one MPI world).
    """
    warnings: list[str] = []
    if cfg.mode == "hybrid" and cfg.cluster.workers > 1:
        # each pod of the worker Job would start a world of its own and stop at HybridMode's rank check
        raise ConfigError(f"mode hybrid with cluster.workers={cfg.cluster.workers}: the worker Job starts one "
                          f"process per pod, but hybrid workers form one MPI world that a single mpiexec starts; "
                          f"run them as a Kubeflow MPIJob whose launcher runs `mpiexec -n {cfg.cluster.workers} "
                          f"sh -c 'engine train CONFIG --role worker --rank $PMI_RANK'` (each rank's own "
                          f"PMI_RANK; README, 'Hybrid mode'), or use mode async")
    for key in StorageConfig.SECRETS:
        if getattr(cfg.storage, key):
            raise ConfigError(f"storage.{key}: inline credentials are refused in Kubernetes manifests (the "
                              f"ConfigMap is readable by anyone who can read the namespace): put them in a Secret, "
                              f"name it in kubernetes.storage_secret and its keys in storage.{key}_env")
    envs = storage_env_names(cfg)
    if envs and not cfg.kubernetes.storage_secret:
        raise ConfigError(f"kubernetes.storage_secret: empty, but storage names the environment variables "
                          f"{envs}: name the Secret holding them (its keys are those names)")
    sec = cfg.security
    missing = [k for k, ok in (("security.tls.cert and security.tls.key", bool(sec.tls.cert)),
                               ("security.token_file (or token_env)", sec.has_token),
                               ("security.admin_token_file (or admin_token_env)", sec.has_admin_token)) if not ok]
    if missing and sec.insecure:
        open_to = ([" in plaintext"] if not sec.tls.cert else []) + \
            ([" without tokens"] if not sec.has_token else
             [" where the worker token grants admin methods"] if not sec.has_admin_token else [])
        warnings.append(f"security.insecure: true and no {', '.join(missing)}: the servers listen on 0.0.0.0"
                        f"{','.join(open_to)}; anyone who reaches a pod can read and change the tables"
                        + (f"; what is configured is kept (the Secret kubernetes.security_secret="
                           f"{cfg.kubernetes.security_secret!r} must hold its files)"
                           if sec.tls.cert or sec.has_token else ""))
    if not missing or sec.insecure:
        # what is configured runs from the Secret's mount; before, insecure: true with any part missing
        # dropped TLS and tokens the config did have, and the pods ran open (the local launcher keeps them)
        mounted = {n: f"{SECURITY_DIR}/{n}" for n in certs.FILES}
        tls = TlsConfig(cert=mounted[certs.SERVER_CERT], key=mounted[certs.SERVER_KEY], ca=mounted[certs.CA_CERT],
                        client_cert=mounted[certs.CLIENT_CERT], client_key=mounted[certs.CLIENT_KEY]) \
            if sec.tls.cert else TlsConfig()
        sec = SecurityConfig(tls=tls, token_file=mounted[certs.TOKEN] if sec.has_token else "",
                             admin_token_file=mounted[certs.ADMIN_TOKEN] if sec.has_admin_token else "",
                             token_overlap_s=sec.token_overlap_s, reload_interval_s=sec.reload_interval_s,
                             insecure=sec.insecure)
    else:
        raise ConfigError(f"Kubernetes pods listen on 0.0.0.0, which needs {', '.join(missing)} (any path: the "
                          f"manifests mount the files of the Secret kubernetes.security_secret="
                          f"{cfg.kubernetes.security_secret!r} at {SECURITY_DIR}); run 'engine certs' and set "
                          f"them, or set security.insecure: true to accept open ports")
    if cfg.model is not None and cfg.model.kind in ("ctr_dnn", "deepfm"):
        data = cfg.model.params.data
        if data.source != "arrow" or not data.train_path or not data.test_path:
            raise ConfigError(f"model.data.source is {data.source!r}: pods run --role workers, which need source: "
                              f"arrow with model.data.train_path and test_path on storage every worker reaches "
                              f"(convert first with `engine convert criteo`)")
        for key in ("train_path", "test_path"):
            if "://" not in getattr(data, key):     # s3:// and hdfs:// inputs are read with the storage section
                warnings.append(f"model.data.{key} {getattr(data, key)!r}: every worker pod must mount it at that "
                                f"path (a volume you add to the worker Job; the manifests do not mount it), or "
                                f"name it by an s3:// or hdfs:// URI the pods read directly")
    root = cfg.checkpoint.root
    if root and "://" not in root:
        if not getattr(cfg.checkpoint, "shared", False):
            raise ConfigError(f"checkpoint.root {root!r} is a local path, and each pod has its own disk: use s3:// "
                              f"or hdfs://, or a path every server and worker pod mounts (a shared volume you add "
                              f"to both Jobs) declared with checkpoint.shared: true")
        warnings.append(f"checkpoint.root {root!r} (checkpoint.shared: true): add the shared volume at that path "
                        f"to both Jobs; the manifests do not mount it")
    cluster = dataclasses.replace(cfg.cluster, endpoints=(), health_port=cfg.kubernetes.health_port,
                                  stop_servers_at_end=True)
    out = dataclasses.replace(cfg, cluster=cluster, security=sec,
                              checkpoint=dataclasses.replace(cfg.checkpoint, restored=""))
    return out, warnings


def storage_env_names(cfg: EngineConfig) -> list[str]:
    """The environment variables ``storage.access_key_env`` / ``secret_key_env`` / ``session_token_env``
    name (in that order, empty ones left out).

    Raises
    ------
    ConfigError
        A name that is not a C identifier (the key is named).
    """
    names = []
    for key in ("access_key_env", "secret_key_env", "session_token_env"):
        value = getattr(cfg.storage, key)
        if value and not _ENV_NAME.match(value):
            raise ConfigError(f"storage.{key} must name an environment variable, got {value!r}")
        if value:
            names.append(value)
    return names


def resume_id_of(uri: str) -> str:
    """The default ``--resume-id`` of ``engine k8s --resume URI``: 16 hex digits of URI's SHA-256, so
    rendering the same roll-back again (a pipeline that renders at every apply) is the same roll-back,
    never a new one that would take the job back to URI once more."""
    return hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]


def render(cfg: EngineConfig, image: str | None = None, resume: str | None = None,
           resume_id: str | None = None) -> Manifests:
    """The manifests of ``cfg`` (see the module docstring).

    Parameters
    ----------
    cfg : EngineConfig
        As ``engine.config.load_config`` gives it; nothing is converted or prepared.
    image : str, optional
        The container image (``--image``); default ``kubernetes.image``.
    resume : str, optional
        A checkpoint (or job root) URI every server starts from (``--resume URI``: an operator's
        roll-back, or a warm start from another job); default: the job's newest complete checkpoint.
        Kept in the manifests for the job's life, with ``--resume-id``: every checkpoint the servers
        write records the pair, and a server pod replaced later (one, or all at once) restores the job's
        newest checkpoint, when that one records the pair, instead of the URI
        (``job_checkpoints.resumed_since``).
    resume_id : str, optional
        With ``resume``: the id (default ``resume_id_of(resume)``). Another id rolls the job back to
        the same URI once more (so does rendering the default again after another render wrote a
        checkpoint).

    Raises
    ------
    ConfigError
        No image; a bad ``kubernetes`` value (name, namespace, Secret names, quantities); a value whose
        rendered integer Kubernetes would refuse (``check_limits``); everything ``pod_config`` refuses.
        The key is named.
    """
    k = cfg.kubernetes
    image = image or k.image
    if not image:
        raise ConfigError("kubernetes.image: empty; pass --image IMAGE (the image built from the Dockerfile)")
    if not _LABEL.match(k.namespace):
        raise ConfigError(f"kubernetes.namespace must be a DNS label, got {k.namespace!r}")
    for key in ("security_secret", "storage_secret"):
        value = getattr(k, key)
        if value and not _SUBDOMAIN.match(value):
            raise ConfigError(f"kubernetes.{key} must be a Secret name (DNS subdomain), got {value!r}")
    for key in ("server_cpu", "server_memory", "worker_cpu", "worker_memory"):
        if not _QUANTITY.match(getattr(k, key)):
            raise ConfigError(f"kubernetes.{key} must be a Kubernetes quantity (2, 500m, 8Gi), got {getattr(k, key)!r}")
    if k.port == k.health_port:
        raise ConfigError(f"kubernetes.health_port must differ from kubernetes.port ({k.port})")
    check_limits(cfg)
    name = base_name(cfg)
    pcfg, warnings = pod_config(cfg)
    held = _held(pcfg.security)
    text = yaml.safe_dump(pcfg.to_dict(), sort_keys=False)
    from_dict(load_yaml(text, "the rendered config"))      # what the pods will read loads back
    service, server_job, worker_job = f"{name}-ps", f"{name}-server", f"{name}-worker"
    hosts = [f"{server_job}-{i}.{service}" for i in range(cfg.cluster.servers)]
    grace = _grace_s(cfg.cluster.preempt_timeout_s)

    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(k, f"{name}-config", name, "config"),
                  "data": {CONFIG_FILE: text}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(k, service, name, "server"),
           "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": _labels(name, "server"),
                    "ports": [{"name": "ps", "port": k.port, "targetPort": k.port, "protocol": "TCP"},
                              {"name": "health", "port": k.health_port, "targetPort": k.health_port,
                               "protocol": "TCP"}]}}

    spill = sorted({t.spill_path for t in cfg.sparse_tables.values() if t.spill_path and os.path.isabs(t.spill_path)})
    server_env = _env(cfg, name, [])
    worker_env = _env(cfg, name, [{"name": "ENGINE_SERVERS", "value": ",".join(f"{h}:{k.port}" for h in hosts)},
                                  {"name": "ENGINE_NUM_WORKERS", "value": str(cfg.cluster.workers)},
                                  {"name": "ENGINE_RUN_ID", "valueFrom": {"fieldRef": {"fieldPath": RUN_ID_FIELD}}}])
    probe = {"grpc": {"port": k.health_port}, "timeoutSeconds": 5}
    # --resume at every start: a replacement server (eviction, preemption) loads its vshards of the job's
    # newest complete checkpoint, or the operator's URI until the job wrote one since (--resume-id); the
    # first start of a job finds none and starts empty
    check_resume_id(resume, resume_id)
    resume_args = (["--resume", resume, "--resume-id", resume_id or resume_id_of(resume)] if resume
                   else ["--resume"] if cfg.checkpoint.enabled else [])
    server = _container(image, ["train", CONFIG_PATH, "--role", "server", "--host", "0.0.0.0", "--port", str(k.port),
                                "--health-port", str(k.health_port), *resume_args], server_env, k.server_cpu,
                        k.server_memory)
    server["ports"] = [{"name": "ps", "containerPort": k.port, "protocol": "TCP"},
                       {"name": "health", "containerPort": k.health_port, "protocol": "TCP"}]
    server["startupProbe"] = {**probe, "periodSeconds": STARTUP_PERIOD_S,
                              "failureThreshold": _startup_failures(cfg.cluster.startup_timeout_s)}
    server["readinessProbe"] = {**probe, "periodSeconds": 5, "failureThreshold": 2}
    # the liveness service: NOT_SERVING only while the server is stuck (engine.ps.watchdog), never while
    # it preempts; a stuck server cannot serve the SIGTERM's checkpoint either: the probe's own grace
    server["livenessProbe"] = {"grpc": {"port": k.health_port, "service": LIVENESS}, "timeoutSeconds": 5,
                               "periodSeconds": 10, "failureThreshold": 6,
                               "terminationGracePeriodSeconds": LIVENESS_GRACE_S}
    worker = _container(image, ["train", CONFIG_PATH, "--role", "worker", "--host", "0.0.0.0", "--health-port",
                                str(k.health_port)], worker_env, k.worker_cpu, k.worker_memory)
    # a worker's liveness (engine.liveness): NOT_SERVING once its loop stalls past client.dead_after_s,
    # no answer when it is frozen; the kubelet then kills it (restartPolicy Never: the pod fails, and
    # the Job controller starts a replacement that rejoins by the recovery rule). Its own grace period:
    # the kill's SIGTERM would otherwise wait out the pod's (preempt_timeout_s + 60 s) in a worker that
    # cannot act on it. No readiness: nothing connects to a worker
    worker["ports"] = [{"name": "health", "containerPort": k.health_port, "protocol": "TCP"}]
    worker["startupProbe"] = dict(server["startupProbe"])
    worker["livenessProbe"] = {**probe, "periodSeconds": 10, "failureThreshold": 3,
                               "terminationGracePeriodSeconds": LIVENESS_GRACE_S}
    annotations = _scrape_annotations(cfg, warnings)
    if annotations:
        server["ports"].append({"name": "metrics", "containerPort": cfg.observability.prometheus_port,
                                "protocol": "TCP"})
    if k.storage_secret and not storage_env_names(cfg):   # its keys (AWS_ACCESS_KEY_ID, ...) become variables
        for c in (server, worker):
            c["envFrom"] = [{"secretRef": {"name": k.storage_secret}}]
    server_vol, worker_vol = (_volumes(name, k.security_secret, [n for n in items if n in held], extra)
                              for items, extra in ((SERVER_ITEMS, spill), (WORKER_ITEMS, [])))
    for c, (mounts, _) in ((server, server_vol), (worker, worker_vol)):
        c["volumeMounts"] = mounts
    files = {f"00-{name}-config.yaml": config_map, f"01-{service}.yaml": svc,
             f"02-{server_job}.yaml": _job(cfg, name, server_job, "server", cfg.cluster.servers, server,
                                           server_vol[1], grace, subdomain=service, annotations=annotations),
             f"03-{worker_job}.yaml": _job(cfg, name, worker_job, "worker", cfg.cluster.workers, worker,
                                           worker_vol[1], grace)}
    cert_hosts = hosts + ([f"{h}.{k.namespace}.svc" for h in hosts] if annotations else [])
    return Manifests(files, pcfg, hosts, warnings, cert_hosts)


def _startup_failures(startup_timeout_s: float) -> int:
    """The startup probe's failureThreshold: ``startup_timeout_s`` in probes of ``STARTUP_PERIOD_S``, at
    least 12 (a minute)."""
    return max(12, math.ceil(startup_timeout_s / STARTUP_PERIOD_S))


def _grace_s(preempt_timeout_s: float) -> int:
    """The pods' terminationGracePeriodSeconds: the preemption's time and ``GRACE_MARGIN_S``."""
    return math.ceil(preempt_timeout_s) + GRACE_MARGIN_S


def check_limits(cfg: EngineConfig) -> None:
    """Every integer the manifests compute from the config fits its Kubernetes field: kubectl refuses
    a number over the field's type (int32 or int64) and an Indexed Job of more than ``INDEXED_JOB_MAX``
    pods. The ports are bounded by the config itself; the other integers are constants.

    Raises
    ------
    ConfigError
        Naming the key, its value and the largest value allowed.
    """
    c, k = cfg.cluster, cfg.kubernetes
    if _startup_failures(c.startup_timeout_s) > INT32_MAX:
        raise ConfigError(f"cluster.startup_timeout_s={c.startup_timeout_s:g} is too large for Kubernetes: the "
                          f"startup probe's failureThreshold (one probe every {STARTUP_PERIOD_S} s) is an int32, "
                          f"so at most {INT32_MAX * STARTUP_PERIOD_S} s")
    if _grace_s(c.preempt_timeout_s) > INT64_MAX:
        raise ConfigError(f"cluster.preempt_timeout_s={c.preempt_timeout_s:g} is too large for Kubernetes: "
                          f"terminationGracePeriodSeconds (it + {GRACE_MARGIN_S} s) is an int64, so at most "
                          f"{INT64_MAX - GRACE_MARGIN_S} s")
    if k.backoff_limit > INT32_MAX:
        raise ConfigError(f"kubernetes.backoff_limit={k.backoff_limit} is too large for Kubernetes: the Jobs' "
                          f"backoffLimit is an int32, at most {INT32_MAX}")
    budgets = {name: t.memory_bytes for name, t in cfg.sparse_tables.items() if t.memory_bytes > 0}
    pod = quantity_bytes(k.server_memory)
    if budgets and sum(budgets.values()) > pod:
        named = " + ".join(f"tables.sparse.{n}.memory_bytes={b}" for n, b in budgets.items())
        raise ConfigError(f"kubernetes.server_memory={k.server_memory} ({pod:.0f} bytes) is less than the table "
                          f"budgets of one server ({named}): the pod's memory limit is where the server is "
                          f"OOM-killed; give server_memory the budgets plus ~1Gi for the process, or lower them")
    for key in ("servers", "workers"):
        n = getattr(c, key)
        if n > INDEXED_JOB_MAX:
            raise ConfigError(f"cluster.{key}={n} is too many for Kubernetes: the {key[:-1]} Job is an Indexed "
                              f"Job of one pod per {key[:-1]}, all at once, and Kubernetes allows an Indexed Job "
                              f"a parallelism of at most {INDEXED_JOB_MAX}")


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes quantity (``8Gi``, ``500M``, ``1e9``; already matched by ``_QUANTITY``) in bytes."""
    m = _QUANTITY.match(quantity)
    number, suffix = float(m.group(1)), m.group(3) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:          # an exponent: 1e9, 5E+6
        return number * 10.0 ** int(suffix[1:])
    return number * _QUANTITY_SUFFIX[suffix]


def write(manifests: Manifests, out_dir, *, source: str = "") -> list[Path]:
    """Write each object to its file in ``out_dir`` (created); returns the paths.

    Raises
    ------
    ManifestsError
        ``out_dir`` holds ``.yaml`` files of another render (another job's names): ``kubectl apply -f`` would
        apply them too; nothing was written.
    OSError
        The directory or a file cannot be written (each file is written whole or not at all).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.glob("*.yaml") if p.name not in manifests.files and _rendered_by_us(p))
    if stale:       # `kubectl apply -f DIR` would apply them too: another job's (or a renamed job's) objects
        more = f" and {len(stale) - 2} more" if len(stale) > 2 else ""
        raise ManifestsError(f"{out} holds manifests of another `engine k8s` render ({', '.join(stale[:2])}{more}), "
                             f"which 'kubectl apply -f {out}' would apply too: remove them or render into a new "
                             f"directory")
    head = f"{_HEAD}{f' from {source}' if source else ''}; render again rather than edit\n"
    paths = []
    for fname, obj in manifests.files.items():      # each file whole or not at all (a new file renamed in)
        path = out / fname
        tmp = out / f".{fname}.{os.getpid()}.tmp"
        try:
            tmp.write_text(head + yaml.dump(obj, Dumper=_Dumper, sort_keys=False))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        paths.append(path)
    return paths


#: the first words of every file ``write`` renders
_HEAD = "# rendered by `engine k8s`"


class ManifestsError(OSError):
    """``write``'s directory holds manifests of another render (``engine k8s`` exits 2 naming them)."""


def _rendered_by_us(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(len(_HEAD)) == _HEAD
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ helpers
class _Dumper(yaml.SafeDumper):
    """Safe YAML without anchors and aliases (objects share sub-dicts; kubectl users read the files)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _labels(name: str, component: str) -> dict:
    return {"app.kubernetes.io/name": "sparse-engine", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def _meta(k, obj_name: str, name: str, component: str) -> dict:
    return {"name": obj_name, "namespace": k.namespace,
            "labels": {**_labels(name, component), "app.kubernetes.io/managed-by": "engine-k8s"}}


#: the worker pods' run id: their Job's uid (set by the Job controller on every pod it creates)
RUN_ID_FIELD = "metadata.labels['batch.kubernetes.io/controller-uid']"


def _env(cfg: EngineConfig, name: str, role_env: list[dict]) -> list[dict]:
    """Rank from the downward API, the role's own variables, Numba's cache on /tmp, BLAS threads = the
    CPU limit (rounded up), and the storage credentials from ``kubernetes.storage_secret``."""
    env = [{"name": "ENGINE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
           *role_env,
           {"name": "NUMBA_CACHE_DIR", "value": NUMBA_CACHE},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [{"name": var, "valueFrom": {"resourceFieldRef": {"containerName": CONTAINER, "resource": "limits.cpu",
                                                             "divisor": "1"}}} for var in BLAS_ENV]
    secret = cfg.kubernetes.storage_secret
    names = storage_env_names(cfg)
    for var in names:
        ref = {"name": secret, "key": var}
        if var == cfg.storage.session_token_env:
            ref["optional"] = True
        env.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
    return env


def _container(image: str, args: list[str], env: list[dict], cpu: str, memory: str) -> dict:
    resources = {"cpu": cpu, "memory": memory}
    return {"name": CONTAINER, "image": image, "command": ["engine"], "args": args, "workingDir": WORK_DIR,
            "env": env, "resources": {"requests": dict(resources), "limits": dict(resources)},
            "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                                "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}}}


def _held(sec: SecurityConfig) -> set[str]:
    """The Secret's files (``engine.security.certs.FILES``) a pod config ``sec`` reads."""
    paths = (sec.tls.cert, sec.tls.key, sec.tls.ca, sec.tls.client_cert, sec.tls.client_key, sec.token_file,
             sec.admin_token_file)
    return {os.path.basename(p) for p in paths if p.startswith(SECURITY_DIR + "/")}


def _volumes(name: str, secret: str, items, spill: list[str]) -> tuple[list[dict], list[dict]]:
    """(volumeMounts, volumes): the ConfigMap, the Secret's ``items`` (none when there are none), emptyDirs
    for /tmp, the working directory and each absolute spill path."""
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [{"name": "config", "configMap": {"name": f"{name}-config"}}]
    if items:
        # items, not subPath: a projected key follows updates of the Secret (certificate rotation)
        mounts.append({"name": "security", "mountPath": SECURITY_DIR, "readOnly": True})
        volumes.append({"name": "security", "secret": {"secretName": secret, "defaultMode": 0o440,
                                                       "items": [{"key": n, "path": n} for n in items]}})
    for vol, path in [("tmp", TMP_DIR), ("work", WORK_DIR)] + [(f"spill-{i}", p) for i, p in enumerate(spill)]:
        mounts.append({"name": vol, "mountPath": path})
        volumes.append({"name": vol, "emptyDir": {}})
    return mounts, volumes


#: the pod annotations Prometheus' usual Kubernetes scrape config keys on (deploy/prometheus/scrape-kubernetes.yml)
SCRAPE, SCRAPE_PORT, SCRAPE_SCHEME, SCRAPE_PATH = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/scheme",
                                                   "prometheus.io/path")


def _scrape_annotations(cfg: EngineConfig, warnings: list[str]) -> dict:
    """The server pods' annotations for Prometheus when ``observability.prometheus_port`` is set, else {}.
    A server serves ``/metrics`` on the pod's address (``--host 0.0.0.0``), over HTTPS with the cluster's
    certificates when ``security.tls`` is set (the scraper then needs a client certificate of the
    cluster's CA). A worker serves its metrics on ``cluster.host`` only (it holds no server certificate
    to serve them off loopback): ``observability.pushgateway`` collects them; without it a warning says so.

    Raises
    ------
    ConfigError
        ``observability.prometheus_port`` is 0 (a free port per process: nothing to scrape by) or one of the
        pods' own ports.
    """
    port = cfg.observability.prometheus_port
    if port is None:
        return {}
    k = cfg.kubernetes
    if port == 0:
        raise ConfigError("observability.prometheus_port: 0 (a free port per process) cannot be scraped in pods: "
                          "Prometheus finds a pod's metrics by a fixed port; give one, e.g. 9400")
    if port in (k.port, k.health_port):
        raise ConfigError(f"observability.prometheus_port: {port} is also kubernetes."
                          f"{'port' if port == k.port else 'health_port'}; give the metrics a port of their own")
    if not cfg.observability.pushgateway:
        warnings.append(f"observability.prometheus_port: the server pods serve /metrics on port {port} (annotated "
                        f"for Prometheus); the worker pods serve theirs on {cfg.cluster.host} only, out of a "
                        f"scraper's reach: set observability.pushgateway to collect the workers' metrics")
    return {SCRAPE: "true", SCRAPE_PORT: str(port), SCRAPE_PATH: "/metrics",
            SCRAPE_SCHEME: "https" if cfg.security.tls.cert else "http"}


def _job(cfg: EngineConfig, name: str, job: str, role: str, n: int, container: dict, volumes: list[dict], grace: int,
         *, subdomain: str = "", annotations: dict | None = None) -> dict:
    k = cfg.kubernetes

    def on_code(*codes: int) -> dict:
        return {"containerName": CONTAINER, "operator": "In", "values": list(codes)}
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": grace,
           "automountServiceAccountToken": False, "enableServiceLinks": False,
           "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                               "seccompProfile": {"type": "RuntimeDefault"}},
           "containers": [container], "volumes": volumes}
    if subdomain:
        pod["subdomain"] = subdomain
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(k, job, name, role),
            "spec": {"completionMode": "Indexed", "completions": n, "parallelism": n,
                     "backoffLimit": k.backoff_limit, "podReplacementPolicy": "Failed",
                     "podFailurePolicy": {"rules": [
                         {"action": "FailJob", "onExitCodes": on_code(EXIT_CONFIG, EXIT_STORAGE_REFUSED)},
                         {"action": "Ignore", "onExitCodes": on_code(EXIT_PREEMPTED, EXIT_ROLLBACK)},
                         {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
                     "template": {"metadata": {"labels": _labels(name, role),
                                               **({"annotations": annotations} if annotations else {})},
                                  "spec": pod}}}
