"""The pods of ``engine k8s``, simulated: each rendered container's exact command, arguments and
environment, given to a local process on 127.0.0.1, train CTR-DNN in sync mode on the shared Criteo rows
to the test AUC of the same job under the local launcher, and every process, servers included (the
job-end protocol the manifests turn on), exits 0.

What stands in for Kubernetes (``Kubelet`` below), and nothing else is changed:

* the user's steps: ``engine k8s`` (CLI), ``engine certs --hosts`` with the names it prints, and the
  Secret ``kubectl create secret generic --from-file`` would make of those files (validated strictly);
* volumes: each pod gets a directory standing for its filesystem; the ConfigMap's keys, the Secret's
  ``items`` (each role gets only its files) and the emptyDirs are laid out there at their mount paths,
  and a path under a mount (in args, env values, ``workingDir`` and the config file) points into it;
  paths under the test's own directory and under the shared reference run's (the Arrow data) stand for
  storage every pod mounts (data, ``checkpoint.root``);
* the downward API: ``ENGINE_RANK`` is the pod's completion index, ``limits.cpu`` its CPU limit;
* networking: server i's DNS name ``{job}-{i}.{service}`` becomes 127.0.0.1 with a free PS port and a
  free health port (``ENGINE_SERVERS``, ``--port``, ``--health-port``), and ``--host 0.0.0.0`` becomes
  127.0.0.1 (TLS is checked against 127.0.0.1, which every server certificate names);
* the probes: the servers' health ports, and the workers' liveness ports (a free port each, on
  127.0.0.1), must answer SERVING (grpc.health.v1) within their startup probes' budget;
* the Job controller, in the preemption tests: SIGTERM as on eviction, and a replacement pod with the
  same index (a fresh filesystem) for each pod that exited 75, which the podFailurePolicy ignores; the
  replacements resume at the checkpoint (servers pass ``--resume``; workers that find servers in use
  roll them back to the newest complete checkpoint).

One deviation, to save compile time only: the first test starts every pod cold (its own empty
``NUMBA_CACHE_DIR`` on the ``/tmp`` emptyDir: the servers compile every kernel and must still answer
the startup probe in time); the preemption tests point ``NUMBA_CACHE_DIR`` of every pod at one directory
of the module (a node-local cache), seeded with the repository's own compiled kernels and what the first
test's worker 0 compiled (``make test`` leaves the first test to ``make test-long``). A compile cache
holds machine code only, so nothing they check (exit codes, the checkpoint, the resume position) can
depend on it. The reference run of the local launcher is one per session (``loopback_reference``).
"""
from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import load_config
from tests.integration.test_multihost import AUC_TOLERANCE
from tests.integration.test_role_resume import free_ports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENGINE = str(Path(sys.executable).parent / "engine")        # the image's ENTRYPOINT, from this venv
INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
CONTROLLER_UID = "metadata.labels['batch.kubernetes.io/controller-uid']"


def cpu_count(quantity: str) -> int:
    """``limits.cpu`` through the downward API with divisor 1: cores, rounded up."""
    return math.ceil(int(quantity[:-1]) / 1000) if quantity.endswith("m") else math.ceil(float(quantity))


def kubectl_secret(name: str, namespace: str, files: dict[str, Path]) -> dict:
    """The Secret ``kubectl create secret generic NAME --from-file=...`` creates."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": name, "namespace": namespace},
            "data": {key: base64.b64encode(p.read_bytes()).decode() for key, p in files.items()}}


class Kubelet:
    """Turns a rendered Job's pod template and a completion index into (argv, env, cwd) of a local
    process (see the module docstring)."""

    def __init__(self, root: Path, shared: tuple[Path, ...], objects: list[dict], secrets: list[dict],
                 numba_cache: Path | None = None):
        self.root, self.shared, self.numba_cache = root, tuple(str(s) for s in shared), numba_cache
        self.config_maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
        self.secrets = {s["metadata"]["name"]: s for s in secrets}
        self.service = next(o for o in objects if o["kind"] == "Service")
        server_job = next(o for o in objects if o["kind"] == "Job" and o["spec"]["template"]["spec"].get("subdomain"))
        worker_job = next(o for o in objects if o["kind"] == "Job" and o is not server_job)
        n, w = server_job["spec"]["completions"], worker_job["spec"]["completions"]
        ports = free_ports(2 * n + w)             # at once: a port freed and drawn again would be shared
        svc = self.service["metadata"]["name"]
        self.servers = {f"{server_job['metadata']['name']}-{i}.{svc}": (ports[2 * i], ports[2 * i + 1]) for i in range(n)}
        self.server_job = server_job["metadata"]["name"]
        # a worker pod's name -> its health port (its replacements keep it)
        self.workers = {f"{worker_job['metadata']['name']}-{i}": ports[2 * n + i] for i in range(w)}
        # the Job controller's label on every pod of a Job: its uid (one per Job, kept by replacements)
        self.uids = {o["metadata"]["name"]: str(uuid.uuid4()) for o in objects if o["kind"] == "Job"}

    def pod(self, job: dict, index: int, root: Path | None = None) -> tuple[list[str], dict, Path, str]:
        """(argv, env, cwd, hostname) of pod ``index`` of ``job``, its filesystem under ``root``
        (default: the Kubelet's)."""
        name = f"{job['metadata']['name']}-{index}"
        spec = job["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        fs = (root or self.root) / name
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}

        def local(value: str) -> str:
            if value.startswith(self.shared):
                return value                     # stands for a volume every pod mounts at the same path
            for path in sorted(mounts, key=len, reverse=True):
                if value == path or value.startswith(path.rstrip("/") + "/"):
                    return str(fs) + value
            return value

        for path, m in mounts.items():
            target = fs / path.lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            vol = volumes[m["name"]]
            if "configMap" in vol:
                for key, text in self.config_maps[vol["configMap"]["name"]]["data"].items():
                    data = self._rewrite(yaml.safe_load(text), local)
                    (target / key).write_text(yaml.safe_dump(data, sort_keys=False))
            elif "secret" in vol:
                data = self.secrets[vol["secret"]["secretName"]]["data"]
                for item in vol["secret"]["items"]:
                    (target / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
                    (target / item["path"]).chmod(vol["secret"]["defaultMode"])
            else:
                assert "emptyDir" in vol, vol
        env = {"PATH": f"{Path(ENGINE).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(fs / "tmp"),
               "LANG": "C.UTF-8"}
        for e in c["env"]:
            env[e["name"]] = self._env_value(e, index, c, local, self.uids[job["metadata"]["name"]])
        if self.numba_cache is not None:      # the node-local cache (module docstring), instead of the emptyDir
            assert env.get("NUMBA_CACHE_DIR", "").startswith(str(fs / "tmp") + "/"), env.get("NUMBA_CACHE_DIR")
            env["NUMBA_CACHE_DIR"] = str(self.numba_cache)
        if "ENGINE_SERVERS" in env:
            env["ENGINE_SERVERS"] = ",".join(self._address(ep) for ep in env["ENGINE_SERVERS"].split(","))
        assert c["command"] == ["engine"]
        args = [local(a) for a in c["args"]]
        hostname = name
        if hostname + "." + self.service["metadata"]["name"] in self.servers:
            ps, health = self.servers[hostname + "." + self.service["metadata"]["name"]]
            for flag, value in (("--host", "127.0.0.1"), ("--port", str(ps)), ("--health-port", str(health))):
                args[args.index(flag) + 1] = value
        else:                                    # a worker: its liveness port, on the pod's own address
            health = self.workers[name]
            assert args[args.index("--health-port") + 1] == str(c["livenessProbe"]["grpc"]["port"])
            for flag, value in (("--host", "127.0.0.1"), ("--health-port", str(health))):
                args[args.index(flag) + 1] = value
        return [ENGINE, *args], env, Path(local(c["workingDir"])), hostname

    def _address(self, endpoint: str) -> str:
        host, port = endpoint.rsplit(":", 1)
        assert host in self.servers, (host, sorted(self.servers))
        assert int(port) == self.service["spec"]["ports"][0]["port"]
        return f"127.0.0.1:{self.servers[host][0]}"

    def _env_value(self, e: dict, index: int, c: dict, local, uid: str) -> str:
        if "value" in e:
            return local(e["value"])
        src = e["valueFrom"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            assert path in (INDEX, CONTROLLER_UID), src
            return str(index) if path == INDEX else uid
        if "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            assert ref["resource"] == "limits.cpu" and ref.get("divisor", "1") == "1", ref
            return str(cpu_count(c["resources"]["limits"]["cpu"]))
        ref = src["secretKeyRef"]
        return base64.b64decode(self.secrets[ref["name"]]["data"][ref["key"]]).decode()

    def _rewrite(self, node, local):
        if isinstance(node, dict):
            return {k: self._rewrite(v, local) for k, v in node.items()}
        if isinstance(node, list):
            return [self._rewrite(v, local) for v in node]
        return local(node) if isinstance(node, str) else node


def health(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def wait_serving(port: int, budget_s: float, procs: list) -> float:
    start = time.monotonic()
    while time.monotonic() - start < budget_s:
        try:
            if health(port) == "SERVING":
                return time.monotonic() - start
        except grpc.RpcError:
            pass
        assert all(p.poll() is None for p, _ in procs), "a pod exited during start-up"
        time.sleep(0.1)
    raise AssertionError(f"health port {port} not SERVING within the startup probe's {budget_s:g} s")


def last_test_auc(metrics: Path) -> float:
    events = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    return [e for e in events if e.get("event") == "eval" and e.get("split") == "test"][-1]["auc"]


class Pods:
    """The user's steps and the cluster for one rendering: ``engine k8s`` with ``sets``, ``engine certs``
    with the names it prints, the Secret kubectl would create, every manifest validated strictly, and a
    ``Kubelet`` (``shared``: further directories every pod mounts; ``numba_cache``: see the module
    docstring). ``start(job, index)`` starts a pod (a replacement gets a fresh directory)."""

    def __init__(self, tmp: Path, sets: list[str], shared: tuple[Path, ...] = (), numba_cache: Path | None = None):
        self.tmp, out, creds = tmp, tmp / "manifests", tmp / "creds"
        p = subprocess.run([ENGINE, "k8s", str(REPO / "configs/ctr.yaml"), "--image", "sparse-engine:test", "--out",
                            str(out), *(a for s in sets for a in ("--set", s))], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        hosts = re.search(r"engine certs CREDS --hosts (\S+)", p.stdout).group(1)
        p = subprocess.run([ENGINE, "certs", str(creds), "--hosts", hosts], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        self.objects = [yaml.safe_load(f.read_text()) for f in sorted(out.glob("*.yaml"))]
        jobs = [o for o in self.objects if o["kind"] == "Job"]
        self.server_job = next(j for j in jobs if j["spec"]["template"]["spec"].get("subdomain"))
        self.worker_job = next(j for j in jobs if j is not self.server_job)
        secret_name = next(v["secret"]["secretName"] for j in jobs for v in j["spec"]["template"]["spec"]["volumes"]
                           if "secret" in v)
        secret = kubectl_secret(secret_name, self.objects[0]["metadata"]["namespace"],
                                {n: creds / n for n in ("ca.pem", "server.pem", "server.key", "client.pem",
                                                        "client.key", "token", "admin_token")})
        for obj in [*self.objects, secret]:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        self.kubelet = Kubelet(tmp / "pods", (tmp, *shared), self.objects, [secret], numba_cache)
        self.procs: list[subprocess.Popen] = []

    def start(self, job: dict, index: int, attempt: int = 0) -> tuple[subprocess.Popen, Path]:
        argv, env, cwd, host = self.kubelet.pod(job, index, self.tmp / ("pods" if not attempt else f"pods-{attempt}"))
        log = self.tmp / f"{host}{'' if not attempt else f'-{attempt}'}.log"
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                start_new_session=True)
        self.procs.append(proc)
        return proc, log

    def start_all(self) -> tuple[list, list, list[float]]:
        """Both Jobs at once (kubectl apply); returns (servers, workers, seconds until each server's health
        port answered SERVING, within the startup probe's budget); each worker's liveness port must answer
        SERVING within its startup probe's budget too."""
        servers = [self.start(self.server_job, i) for i in range(self.server_job["spec"]["completions"])]
        workers = [self.start(self.worker_job, i) for i in range(self.worker_job["spec"]["completions"])]
        budget = {job["metadata"]["name"]: probe["periodSeconds"] * probe["failureThreshold"]
                  for job in (self.server_job, self.worker_job)
                  for probe in [job["spec"]["template"]["spec"]["containers"][0]["startupProbe"]]}
        ready = [wait_serving(port, budget[self.server_job["metadata"]["name"]], servers + workers)
                 for _, port in self.kubelet.servers.values()]
        for port in self.kubelet.workers.values():
            wait_serving(port, budget[self.worker_job["metadata"]["name"]], servers + workers)
        return servers, workers, ready

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def metrics(self, index: int = 0, attempt: int = 0) -> Path:
        pods = self.tmp / ("pods" if not attempt else f"pods-{attempt}")
        return pods / f"{self.worker_job['metadata']['name']}-{index}" / "var/lib/engine/runs/metrics/ctr_dnn-sync.jsonl"


def job_sets(tmp: Path, resolved: Path, *extra: str) -> list[str]:
    data = load_config(resolved).model.params.data
    return ["mode=sync", "cluster.servers=2", "cluster.workers=2", "model.data.source=arrow",
            f"model.data.train_path={data.train_path}", f"model.data.test_path={data.test_path}",
            f"checkpoint.root={tmp / 'ckpt-k8s'}", "checkpoint.shared=true",
            "kubernetes.server_cpu=1", "kubernetes.worker_cpu=1", "kubernetes.server_memory=2Gi",
            "kubernetes.worker_memory=2Gi", *(f"security.{k}=/anywhere/{k}" for k in (
                "tls.cert", "tls.key", "tls.ca", "tls.client_cert", "tls.client_key", "token_file", "admin_token_file")),
            *extra]


@pytest.fixture(scope="module")
def node_numba_cache(tmp_path_factory, loopback_reference) -> Path:
    """The preemption tests' shared ``NUMBA_CACHE_DIR`` (module docstring), seeded with the repository's
    own Numba cache (the reference run, which ran the same CTR job, filled it) laid out as Numba lays out
    a ``NUMBA_CACHE_DIR``; the first test adds what its worker 0 compiled. An entry that is missing or
    stale is compiled again, so the seed can only save time."""
    from numba.core.caching import UserProvidedCacheLocator

    cache = tmp_path_factory.mktemp("node-numba-cache")
    for package in ("engine", "sparse_tables", "models", "streaming", "hdfs_io"):
        for pycache in (REPO / package).glob("**/__pycache__"):
            files = [*pycache.glob("*.nbi"), *pycache.glob("*.nbc")]
            if files:
                sub = cache / UserProvidedCacheLocator.get_suitable_cache_subpath(str(pycache.parent / "_.py"))
                sub.mkdir(parents=True, exist_ok=True)
                for f in files:
                    shutil.copy2(f, sub / f.name)
    return cache


@pytest.mark.long   # make test-long (see pyproject.toml): the preemption test starts the pods of the same rendering
def test_rendered_pods_train_ctr_to_the_local_launchers_auc_and_all_exit_0(tmp_path, loopback_reference,
                                                                           node_numba_cache):
    reference, resolved = loopback_reference       # sync, 2 servers, 2 workers; converts the data to Arrow
    pods = Pods(tmp_path, job_sets(tmp_path, resolved), shared=(resolved.parent.parent,))
    t1 = time.monotonic()
    try:
        servers, workers, ready = pods.start_all()
        for proc, log in workers:
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        t_workers = time.monotonic() - t1
        for proc, log in servers:           # stop_servers_at_end: worker 0 stopped them, they exit 0
            assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        t_all = time.monotonic() - t1
    finally:
        pods.kill_all()
    assert "the job ended; stopping the servers" in workers[0][1].read_text()
    auc, ref = last_test_auc(pods.metrics()), reference["test"]["auc"]
    print(json.dumps({"k8s_pods_auc": auc, "local_launcher_auc": ref,
                      "servers_serving_s": [round(r, 1) for r in ready], "workers_done_s": round(t_workers, 1),
                      "all_exited_s": round(t_all, 1)}))
    assert abs(auc - ref) <= AUC_TOLERANCE, (auc, ref)
    assert sorted((tmp_path / "ckpt-k8s").glob("ctr_dnn/*/*/_SUCCESS")), "no complete checkpoint in checkpoint.root"
    (c,) = pods.worker_job["spec"]["template"]["spec"]["containers"]
    cache = next((e["value"] for e in c["env"] if e["name"] == "NUMBA_CACHE_DIR"), None)
    assert cache, "the worker container sets no NUMBA_CACHE_DIR (a writable Numba cache on its emptyDir)"
    cold = tmp_path / "pods" / f"{pods.worker_job['metadata']['name']}-0" / cache.lstrip("/")
    shutil.copytree(cold, node_numba_cache, dirs_exist_ok=True)     # one pod's whole cache: a consistent index


@pytest.mark.parametrize("evicted", [pytest.param("one_worker", marks=pytest.mark.long), "every_pod"])
def test_a_preempted_job_resumes_at_its_checkpoint_in_replacement_pods(tmp_path, evicted, loopback_reference,
                                                                       node_numba_cache):
    """SIGTERM (what the kubelet sends on eviction) to worker 1 only, or to every pod: the workers write a
    checkpoint and exit 75; servers that got SIGTERM too are stopped by worker 0 once every worker has
    left and exit 75 at once, long before cluster.preempt_timeout_s (60 s here); servers that did not keep
    serving. The podFailurePolicy ignores 75, so the Job controller starts replacement pods with the same
    indexes. They must resume at the checkpoint and finish, every process exiting 0."""
    _, resolved = loopback_reference
    pods = Pods(tmp_path, job_sets(tmp_path, resolved, "model.epochs=2", "checkpoint.align_steps=8",
                                   "cluster.preempt_timeout_s=60"),
                shared=(resolved.parent.parent,), numba_cache=node_numba_cache)
    policy = {c: r["action"] for r in pods.worker_job["spec"]["podFailurePolicy"]["rules"]
              for c in r.get("onExitCodes", {}).get("values", [])}
    assert policy[75] == "Ignore"
    try:
        servers, workers, _ = pods.start_all()
        deadline = time.monotonic() + 300
        while "steps per epoch" not in workers[1][1].read_text():
            assert time.monotonic() < deadline and all(p.poll() is None for p, _ in workers), workers[1][1].read_text()
            time.sleep(0.1)
        time.sleep(0.5)                     # into the epoch: the preemption lands mid-epoch (align_steps=8)
        evict = [workers[1]] if evicted == "one_worker" else servers + workers
        for proc, _ in evict:
            proc.send_signal(signal.SIGTERM)
        for proc, log in workers:
            assert proc.wait(timeout=300) == 75, log.read_text()[-3000:]
        left = time.monotonic()
        if evicted == "every_pod":
            for i, (proc, log) in enumerate(servers):
                assert proc.wait(timeout=120) == 75, log.read_text()[-3000:]
                servers[i] = pods.start(pods.server_job, i, attempt=1)
            assert time.monotonic() - left < 20, "the preempted servers waited out preempt_timeout_s"
            assert "stopping the preempting servers [0, 1]" in workers[0][1].read_text()
        else:
            assert all(p.poll() is None for p, _ in servers)      # not preempted: still serving
        workers = [pods.start(pods.worker_job, i, attempt=1) for i in range(len(workers))]
        for proc, log in workers:
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert "resuming at epoch" in workers[0][1].read_text()
        for proc, log in servers:
            assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        pods.kill_all()
