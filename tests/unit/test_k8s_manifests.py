"""``engine k8s``: every rendered manifest validates against the Kubernetes API schema in strict mode
(kubernetes-validate: an unknown or misspelled field fails), and the manifests say what the job needs:
no secret in the ConfigMap, the servers' DNS names in ENGINE_SERVERS, the podFailurePolicy of the exit
codes, a grace period above the preemption timeout, the resources of the config, the Secret's files per
role; configs that cannot run in pods are refused naming the key."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine.cli import main
from engine.config import from_dict, load_config
from engine.config_yaml import load_yaml
from engine.errors import ConfigError
from engine.launch import k8s
from engine.security import certs

REPO = Path(__file__).resolve().parents[2]
CTR = str(REPO / "configs" / "ctr.yaml")
IMAGE = "registry.example/sparse-engine:1.0"
#: the oldest version with everything used GA (podFailurePolicy: 1.31) and the newest the validator knows
VERSIONS = ("1.31", kubernetes_validate.latest_version())
DATA = ("model.data.source=arrow", "model.data.train_path=/data/criteo/train",
        "model.data.test_path=/data/criteo/test", "checkpoint.root=s3://bucket/ckpt")


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("creds")
    certs.write_cluster_credentials(out, ["ctr-dnn-server-0.ctr-dnn-ps", "ctr-dnn-server-1.ctr-dnn-ps"])
    return out


def security_sets(creds: Path) -> list[str]:
    return [f"security.tls.cert={creds / 'server.pem'}", f"security.tls.key={creds / 'server.key'}",
            f"security.tls.ca={creds / 'ca.pem'}", f"security.tls.client_cert={creds / 'client.pem'}",
            f"security.tls.client_key={creds / 'client.key'}", f"security.token_file={creds / 'token'}",
            f"security.admin_token_file={creds / 'admin_token'}"]


def sets(creds: Path, *extra: str) -> list[str]:
    return ["mode=sync", "cluster.servers=2", "cluster.workers=2", *DATA, *security_sets(creds), *extra]


def render(creds: Path, *extra: str) -> k8s.Manifests:
    return k8s.render(load_config(CTR, sets(creds, *extra)), image=IMAGE)


def cli(out: Path, overrides: list[str], *, image: str | None = IMAGE) -> int:
    argv = ["k8s", CTR, "--out", str(out)] + (["--image", image] if image else [])
    for s in overrides:
        argv += ["--set", s]
    return main(argv)


def objects(out: Path) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}


def by_kind(m: k8s.Manifests) -> dict[str, dict]:
    """ConfigMap, Service, server, worker."""
    out = {}
    for obj in m.files.values():
        key = obj["kind"] if obj["kind"] != "Job" else obj["metadata"]["labels"]["app.kubernetes.io/component"]
        out[key] = obj
    return out


def container(job: dict) -> dict:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


def env(job: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(job)["env"]}


def error_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("engine k8s: ")]
    assert len(lines) == 1, lines
    return lines[0]


VARIANTS = {
    "secured": [],
    "storage_secret_spill_3_servers": ["cluster.servers=3", "storage.access_key_env=S3_KEY",
                                       "storage.secret_key_env=S3_SECRET", "storage.session_token_env=S3_TOKEN",
                                       "kubernetes.storage_secret=s3-creds", "tables.sparse.embedding.spill_path=/spill",
                                       "kubernetes.namespace=ml", "kubernetes.name=ctr-a"],
    "storage_secret_envfrom_shared_root": ["kubernetes.storage_secret=s3-creds", "checkpoint.root=/mnt/ckpt",
                                           "checkpoint.shared=true"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(tmp_path, creds, variant, version):
    out = tmp_path / "out"
    assert cli(out, sets(creds, *VARIANTS[variant])) == 0
    objs = objects(out)
    assert [o["kind"] for o in objs.values()] == ["ConfigMap", "Service", "Job", "Job"]
    for name, obj in objs.items():
        assert kubernetes_validate.validate(obj, version, strict=True), name


def test_insecure_renders_without_the_secret_and_validates(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(out, ["mode=sync", *DATA, "security.insecure=true"]) == 0
    assert "security.insecure: true" in capsys.readouterr().err
    objs = objects(out)
    for obj in objs.values():
        kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)
        if obj["kind"] == "Job":
            assert all("secret" not in v for v in obj["spec"]["template"]["spec"]["volumes"])


@pytest.mark.parametrize("keep", ["tls-and-token", "token"])
def test_insecure_keeps_the_security_that_is_configured(creds, keep):
    """``security.insecure: true`` with a part missing (here the admin token, and TLS too) keeps the rest:
    it once rendered the pods with no TLS and no token at all, though the config had them. The pods read
    what is kept from the Secret's mount, and mount only those files (a key the Secret lacks would stop a
    pod's start)."""
    given = security_sets(creds)[:-1] if keep == "tls-and-token" else [f"security.token_file={creds / 'token'}"]
    m = k8s.render(load_config(CTR, ["mode=sync", "cluster.servers=2", "cluster.workers=2", *DATA, *given,
                                     "security.insecure=true"]), image=IMAGE)
    sec = m.config.security
    assert sec.insecure and sec.token_file == f"{k8s.SECURITY_DIR}/{certs.TOKEN}" and not sec.has_admin_token
    assert bool(sec.tls.cert) == (keep == "tls-and-token")
    objs = by_kind(m)
    mounted = {role: [i["key"] for v in objs[role]["spec"]["template"]["spec"]["volumes"] if "secret" in v
                      for i in v["secret"]["items"]] for role in ("server", "worker")}
    tls = {"server": [certs.CA_CERT, certs.SERVER_CERT, certs.SERVER_KEY],
           "worker": [certs.CA_CERT, certs.CLIENT_CERT, certs.CLIENT_KEY]}
    for role in ("server", "worker"):
        assert mounted[role] == (tls[role] if keep == "tls-and-token" else []) + [certs.TOKEN], mounted
    warning = " ".join(m.warnings)
    assert "security.admin_token_file" in warning and "worker token grants admin methods" in warning
    assert ("in plaintext" in warning) == (keep == "token"), warning
    for obj in m.files.values():
        kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("key", ["train_path", "test_path"])
def test_an_object_store_uri_as_a_data_path_needs_no_volume(creds, key):
    """Workers read s3:// and hdfs:// inputs directly (streaming.inputs), so the renderer accepts them and
    warns about a volume only for a local path."""
    sets = [s for s in DATA if not s.startswith(f"model.data.{key}=")] + [f"model.data.{key}=s3://bucket/x"]
    cfg = load_config(CTR, ["mode=sync", "cluster.servers=2", "cluster.workers=2", *sets, *security_sets(creds)])
    m = k8s.render(cfg, image=IMAGE)
    mounts = [w for w in m.warnings if w.startswith("model.data.")]
    other = "test_path" if key == "train_path" else "train_path"
    assert len(mounts) == 1 and mounts[0].startswith(f"model.data.{other} "), mounts
    assert getattr(m.config.model.params.data, key) == "s3://bucket/x"       # what the pods run


@pytest.mark.parametrize("where", ["container", "pod_failure_rule", "probe", "service"])
def test_the_validator_rejects_a_misspelled_field(creds, where):
    """Strict mode is what catches a typo: the same manifest with one field misspelled fails."""
    objs = by_kind(render(creds))
    if where == "container":
        obj = objs["worker"]
        container(obj)["imagePullPolicyy"] = "Always"
    elif where == "pod_failure_rule":
        obj = objs["server"]
        obj["spec"]["podFailurePolicy"]["rules"][0]["onExitCode"] = obj["spec"]["podFailurePolicy"]["rules"][0].pop(
            "onExitCodes")
    elif where == "probe":
        obj = objs["server"]
        container(obj)["readinessProbe"]["grpc"]["prot"] = 7001
    else:
        obj = objs["Service"]
        obj["spec"]["publishNotReadyAdresses"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="unexpected"):
        kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)


def test_configmap_holds_the_pod_config_and_no_secret(tmp_path, creds):
    out = tmp_path / "out"
    assert cli(out, sets(creds, "storage.access_key_env=S3_KEY", "storage.secret_key_env=S3_SECRET",
                         "kubernetes.storage_secret=s3-creds")) == 0
    text = "".join(p.read_text() for p in out.glob("*.yaml"))
    for name in certs.FILES:        # no key, certificate or token content anywhere in the manifests
        secret = (creds / name).read_text().strip()
        for line in secret.splitlines():
            if "-----" not in line:
                assert line not in text, name
    assert str(creds) not in text   # the local paths are gone too
    cm = next(o for o in objects(out).values() if o["kind"] == "ConfigMap")
    cfg = from_dict(load_yaml(cm["data"]["config.yaml"], "configmap"))
    sec = cfg.security
    assert (sec.tls.cert, sec.tls.key, sec.tls.ca, sec.tls.client_cert, sec.tls.client_key, sec.token_file,
            sec.admin_token_file) == tuple(f"{k8s.SECURITY_DIR}/{n}" for n in (
                "server.pem", "server.key", "ca.pem", "client.pem", "client.key", "token", "admin_token"))
    assert cfg.storage.access_key == cfg.storage.secret_key == ""
    assert cfg.storage.access_key_env == "S3_KEY"
    assert cfg.cluster.stop_servers_at_end is True and cfg.cluster.health_port == cfg.kubernetes.health_port == 7001
    assert cfg.cluster.endpoints == () and cfg.mode == "sync" and cfg.cluster.servers == 2


def test_inline_storage_secret_is_refused_naming_the_key(tmp_path, creds, capsys):
    assert cli(tmp_path / "out", sets(creds, "storage.access_key=AKIAEXAMPLE", "storage.secret_key=hunter2")) == 2
    line = error_line(capsys)
    assert "storage.access_key" in line and "kubernetes.storage_secret" in line
    assert "AKIAEXAMPLE" not in line and "hunter2" not in line
    assert not (tmp_path / "out").exists()


def test_storage_env_without_a_secret_is_refused(tmp_path, creds, capsys):
    assert cli(tmp_path / "out", sets(creds, "storage.access_key_env=S3_KEY")) == 2
    assert "kubernetes.storage_secret" in error_line(capsys)


def test_config_without_security_is_refused_naming_the_keys(tmp_path, capsys):
    assert cli(tmp_path / "out", ["mode=sync", *DATA]) == 2
    line = error_line(capsys)
    for key in ("security.tls.cert", "security.token_file", "security.admin_token_file", "security.insecure"):
        assert key in line, line
    assert cli(tmp_path / "out", ["mode=sync", *DATA, "security.token_file=/t", "security.admin_token_file=/a"]) == 2
    line = error_line(capsys)
    assert "security.tls.cert" in line and "security.token_file" not in line


def test_engine_servers_are_the_server_pods_dns_names(creds):
    m = render(creds, "cluster.servers=3", "cluster.workers=4", "kubernetes.port=7100", "kubernetes.health_port=7101")
    objs = by_kind(m)
    svc, server, worker = objs["Service"], objs["server"], objs["worker"]
    service, job = svc["metadata"]["name"], server["metadata"]["name"]
    assert (service, job, worker["metadata"]["name"]) == ("ctr-dnn-ps", "ctr-dnn-server", "ctr-dnn-worker")
    hosts = [f"{job}-{i}.{service}" for i in range(3)]       # Indexed Job hostname + subdomain
    assert m.server_hosts == hosts
    assert env(worker)["ENGINE_SERVERS"]["value"] == ",".join(f"{h}:7100" for h in hosts)
    assert env(worker)["ENGINE_NUM_WORKERS"]["value"] == "4"
    # one run per worker Job (ctr_online's max_partitions), and rendering again gives the same manifests
    assert env(worker)["ENGINE_RUN_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/controller-uid']"
    assert render(creds, "cluster.servers=3", "cluster.workers=4", "kubernetes.port=7100",
                  "kubernetes.health_port=7101") == m
    assert "ENGINE_SERVERS" not in env(server)
    spec = server["spec"]
    assert spec["template"]["spec"]["subdomain"] == service
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert (worker["spec"]["completionMode"], worker["spec"]["completions"], worker["spec"]["parallelism"]) == (
        "Indexed", 4, 4)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert not svc["spec"]["selector"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"ps": 7100, "health": 7101}
    for job_obj in (server, worker):     # the rank is the completion index, through the downward API
        ref = env(job_obj)["ENGINE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert ref == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    args = container(server)["args"]
    assert args == ["train", k8s.CONFIG_PATH, "--role", "server", "--host", "0.0.0.0", "--port", "7100",
                    "--health-port", "7101", "--resume"]    # a replacement server loads the newest checkpoint
    assert container(worker)["args"] == ["train", k8s.CONFIG_PATH, "--role", "worker", "--host", "0.0.0.0",
                                         "--health-port", "7101"]       # its liveness (engine.liveness)


def test_an_operators_resume_uri_is_what_every_server_starts_from(creds, tmp_path):
    """``engine k8s --resume URI`` (a roll-back, or a warm start from another job): every server pod
    starts from that checkpoint with a ``--resume-id`` derived from URI; the checkpoints it writes record
    the pair, so a replacement restores the newest of those instead (``engine.roles.run_server``) and
    keeping it in the manifests is safe; rendering again gives the same id (the same roll-back), and
    ``--resume-id`` gives another (a new roll-back to the same URI)."""
    uri = "s3://bucket/ckpt/ctr_dnn/20261128/0900-base"
    server = by_kind(k8s.render(load_config(CTR, sets(creds)), image=IMAGE, resume=uri))["server"]
    assert container(server)["args"][-4:] == ["--resume", uri, "--resume-id", k8s.resume_id_of(uri)]
    assert k8s.resume_id_of(uri) == k8s.resume_id_of(uri + "/") != k8s.resume_id_of(uri + ".1")
    argv = ["k8s", CTR, "--out", str(tmp_path / "out"), "--image", IMAGE, "--resume", uri]
    flags = [a for kv in sets(creds) for a in ("--set", kv)]
    assert main([*argv, *flags]) == 0
    (job,) = [o for o in objects(tmp_path / "out").values()
              if o.get("kind") == "Job" and o["metadata"]["name"].endswith("-server")]
    assert container(job)["args"][-4:] == ["--resume", uri, "--resume-id", k8s.resume_id_of(uri)]
    assert main([*argv, "--resume-id", "again-2", *flags]) == 0
    (job,) = [o for o in objects(tmp_path / "out").values()
              if o.get("kind") == "Job" and o["metadata"]["name"].endswith("-server")]
    assert container(job)["args"][-2:] == ["--resume-id", "again-2"]
    for bad in (["--resume-id", "a b"], ["--resume-id", "x" * 65]):
        assert main([*argv, *bad, *flags]) == 2
    assert main(["k8s", CTR, "--out", str(tmp_path / "o2"), "--image", IMAGE, "--resume-id", "x", *flags]) == 2


def test_probes_use_the_plaintext_grpc_health_port(creds):
    server, worker = (by_kind(render(creds, "kubernetes.health_port=7201"))[r] for r in ("server", "worker"))
    c = container(server)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": 7201}, probe
    # liveness asks for the service that is NOT_SERVING only while the server is stuck (never while it
    # preempts: it serves the job's last checkpoint then), with a short grace (a stuck server can do nothing)
    assert c["livenessProbe"]["grpc"] == {"port": 7201, "service": "liveness"}
    assert c["livenessProbe"]["terminationGracePeriodSeconds"] == k8s.LIVENESS_GRACE_S
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120   # startup_timeout_s
    # a worker: startup and liveness (a stalled loop or a frozen process), no readiness (nothing connects)
    w = container(worker)
    assert sorted(k for k in w if k.endswith("Probe")) == ["livenessProbe", "startupProbe"]
    assert w["livenessProbe"]["grpc"] == w["startupProbe"]["grpc"] == {"port": 7201}
    assert w["ports"] == [{"name": "health", "containerPort": 7201, "protocol": "TCP"}]
    assert w["startupProbe"]["periodSeconds"] * w["startupProbe"]["failureThreshold"] >= 120
    # its kill's own grace: a hung worker cannot act on the SIGTERM, the pod's grace is preempt_timeout_s + 60
    assert w["livenessProbe"]["terminationGracePeriodSeconds"] == k8s.LIVENESS_GRACE_S < 60


def test_pod_failure_policy_maps_the_exit_codes(creds):
    for role, job in by_kind(render(creds)).items():
        if role not in ("server", "worker"):
            continue
        spec = job["spec"]
        assert spec["template"]["spec"]["restartPolicy"] == "Never"     # podFailurePolicy requires it
        assert spec["podReplacementPolicy"] == "Failed"
        actions = {}
        for rule in spec["podFailurePolicy"]["rules"]:
            if "onExitCodes" in rule:
                assert rule["onExitCodes"]["operator"] == "In"
                for code in rule["onExitCodes"]["values"]:
                    actions.setdefault(code, rule["action"])     # the first matching rule wins
            else:
                assert rule["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
                actions["DisruptionTarget"] = rule["action"]
        assert actions == {2: "FailJob", 74: "FailJob", 75: "Ignore", 76: "Ignore", "DisruptionTarget": "Ignore"}, role


def test_grace_period_exceeds_the_preemption_timeout_and_backoff_limit(creds):
    for t in (300, 42.5):
        objs = by_kind(render(creds, f"cluster.preempt_timeout_s={t}", "kubernetes.backoff_limit=7"))
        for role in ("server", "worker"):
            assert objs[role]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= t + 60
            assert objs[role]["spec"]["backoffLimit"] == 7


def test_resources_come_from_the_config(creds):
    objs = by_kind(render(creds, "kubernetes.server_cpu=4", "kubernetes.server_memory=16Gi",
                          "kubernetes.worker_cpu=1500m", "kubernetes.worker_memory=3G"))
    assert container(objs["server"])["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                                      "limits": {"cpu": "4", "memory": "16Gi"}}
    assert container(objs["worker"])["resources"] == {"requests": {"cpu": "1500m", "memory": "3G"},
                                                      "limits": {"cpu": "1500m", "memory": "3G"}}
    blas = env(objs["worker"])["OPENBLAS_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert blas["resource"] == "limits.cpu"
    with pytest.raises(ConfigError, match="kubernetes.worker_cpu"):
        render(creds, "kubernetes.worker_cpu=two")


def test_each_role_mounts_its_files_of_the_secret_read_only(creds):
    objs = by_kind(render(creds, "kubernetes.security_secret=my-creds"))
    want = {"server": {"ca.pem", "server.pem", "server.key", "token", "admin_token"},
            "worker": {"ca.pem", "client.pem", "client.key", "token", "admin_token"}}   # admin_token: see k8s.py
    for role, files in want.items():
        pod = objs[role]["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if "secret" in v]
        assert vol["secret"]["secretName"] == "my-creds"
        assert {i["key"] for i in vol["secret"]["items"]} == files
        assert all(i["key"] == i["path"] for i in vol["secret"]["items"])
        (mount,) = [m for m in container(objs[role])["volumeMounts"] if m["name"] == vol["name"]]
        assert mount == {"name": vol["name"], "mountPath": k8s.SECURITY_DIR, "readOnly": True}
        assert "subPath" not in mount          # a subPath mount never sees a rotated Secret


def test_pods_run_as_non_root_on_a_read_only_root(creds):
    objs = by_kind(render(creds, "tables.sparse.embedding.spill_path=/var/spill"))
    for role in ("server", "worker"):
        pod = objs[role]["spec"]["template"]["spec"]
        sc = container(objs[role])["securityContext"]
        assert sc["runAsNonRoot"] and sc["runAsUser"] == 10001 and sc["readOnlyRootFilesystem"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert pod["automountServiceAccountToken"] is False
        empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        writable = {m["mountPath"] for m in container(objs[role])["volumeMounts"] if m["name"] in empty}
        assert {"/tmp", k8s.WORK_DIR} <= writable
        assert ("/var/spill" in writable) == (role == "server")
        assert container(objs[role])["workingDir"] == k8s.WORK_DIR
        assert env(objs[role])["NUMBA_CACHE_DIR"]["value"].startswith("/tmp/")


def test_storage_credentials_come_from_the_storage_secret(creds):
    w = by_kind(render(creds, "storage.access_key_env=S3_KEY", "storage.secret_key_env=S3_SECRET",
                       "kubernetes.storage_secret=s3-creds"))["worker"]
    assert env(w)["S3_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": "S3_KEY"}
    assert env(w)["S3_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": "S3_SECRET"}
    w = by_kind(render(creds, "kubernetes.storage_secret=s3-creds"))["worker"]   # AWS_* keys, all of them
    assert container(w)["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]


@pytest.mark.parametrize("extra, key", [
    (["checkpoint.root=runs/ckpt"], "checkpoint.root"),
    (["model.data.source=shared_criteo"], "model.data.source"),
    (["kubernetes.name=Bad_Name"], "kubernetes.name"),
    (["kubernetes.name=" + "a" * 60], "kubernetes.name"),
    (["kubernetes.namespace=No"], "kubernetes.namespace"),
    (["kubernetes.health_port=7000"], "kubernetes.health_port"),
    (["mode=hybrid"], "mode hybrid with cluster.workers=2"),     # the worker pods are not one MPI world
])
def test_what_cannot_run_in_pods_is_refused(tmp_path, creds, capsys, extra, key):
    assert cli(tmp_path / "out", sets(creds, *extra)) == 2
    assert key in error_line(capsys)


def test_a_one_worker_hybrid_job_renders(tmp_path, creds):
    """One hybrid worker has no MPI peers: its pod runs without mpiexec, so only more workers are refused."""
    assert cli(tmp_path / "out", sets(creds, "mode=hybrid", "cluster.workers=1")) == 0
    assert yaml.safe_load(by_kind(render(creds, "mode=hybrid", "cluster.workers=1"))["ConfigMap"]["data"]
                          ["config.yaml"])["mode"] == "hybrid"


def test_an_image_is_required(tmp_path, creds, capsys):
    assert cli(tmp_path / "out", sets(creds), image=None) == 2
    assert "kubernetes.image" in error_line(capsys)
    assert cli(tmp_path / "out", sets(creds, f"kubernetes.image={IMAGE}"), image=None) == 0
    assert container(by_kind(render(creds))["worker"])["image"] == IMAGE


def test_the_cli_prints_the_certs_and_secret_commands(tmp_path, creds, capsys):
    out = tmp_path / "out"
    assert cli(out, sets(creds, "kubernetes.namespace=ml")) == 0
    printed = capsys.readouterr().out
    assert "engine certs CREDS --hosts ctr-dnn-server-0.ctr-dnn-ps,ctr-dnn-server-1.ctr-dnn-ps" in printed
    assert "kubectl -n ml create secret generic engine-security" in printed and "ca.key" not in printed
    assert f"kubectl apply -f {out}" in printed
    assert sorted(p.name for p in out.iterdir()) == ["00-ctr-dnn-config.yaml", "01-ctr-dnn-ps.yaml",
                                                     "02-ctr-dnn-server.yaml", "03-ctr-dnn-worker.yaml"]
    assert all("&id" not in p.read_text() for p in out.iterdir())     # no YAML anchors


def test_the_name_defaults_to_the_job_as_a_dns_label(creds):
    assert k8s.base_name(load_config(CTR, sets(creds, "checkpoint.job=My_Job.v2"))) == "my-job-v2"
    assert k8s.base_name(load_config(CTR, sets(creds, "checkpoint.job=", "kubernetes.name=ctr"))) == "ctr"
    assert k8s.base_name(load_config(CTR, sets(creds, "checkpoint.job=2024"))) == "engine-2024"


def test_a_directory_holding_another_renders_manifests_is_refused(tmp_path, creds, capsys):
    """Rendering a renamed job into the same --out left the old job's four files beside the new ones, and the
    printed 'kubectl apply -f DIR' applied both jobs. The same job renders again in place; a file of another
    origin is left alone."""
    out = tmp_path / "out"
    assert cli(out, sets(creds)) == 0
    before = sorted(p.name for p in out.iterdir())
    (out / "notes.yaml").write_text("# mine\n")
    assert cli(out, sets(creds)) == 0                                    # the same render: replaced in place
    capsys.readouterr()
    assert cli(out, sets(creds, "checkpoint.job=other")) == 2
    line = error_line(capsys)
    assert "holds manifests of another `engine k8s` render (00-ctr-dnn-config.yaml, 01-ctr-dnn-ps.yaml and 2 " \
           "more)" in line and "kubectl apply -f" in line, line
    assert sorted(p.name for p in out.iterdir()) == sorted(before + ["notes.yaml"])   # nothing written, no temp
