"""``engine k8s`` with ``observability.prometheus_port``: the server pods carry Prometheus' scrape
annotations and a ``metrics`` port, the manifests still validate strictly, and the shipped scrape config
(``deploy/prometheus/scrape-kubernetes.yml``) applied to those pods, as Prometheus' Kubernetes service
discovery presents them, scrapes each server at a name its certificate holds, with the ``role`` and
``rank`` labels the shipped alerts and dashboard use; worker pods are not scraped (their metrics stay on
loopback: a warning names ``observability.pushgateway``)."""
from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine.launch import k8s
from tests.unit.test_k8s_manifests import VERSIONS, by_kind, cli, creds, error_line, render, sets  # noqa: F401 - creds: the fixture

REPO = Path(__file__).resolve().parents[2]
SCRAPE = REPO / "deploy" / "prometheus" / "scrape-kubernetes.yml"


def _meta(name: str) -> str:
    """A label or annotation name as Kubernetes service discovery puts it in a meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered(job: dict, index: int, namespace: str) -> dict[str, str]:
    """The labels Prometheus' pod discovery gives the ``index``-th pod of ``job`` (a rendered Job): its
    template's labels and annotations, and what the Job controller adds to every pod it creates."""
    tmpl = job["spec"]["template"]["metadata"]
    labels = {**tmpl.get("labels", {}), "job-name": job["metadata"]["name"],
              "batch.kubernetes.io/job-name": job["metadata"]["name"]}
    annotations = {**tmpl.get("annotations", {}), k8s.INDEX_ANNOTATION: str(index)}
    out = {f"__meta_kubernetes_pod_label_{_meta(k)}": v for k, v in labels.items()}
    out |= {f"__meta_kubernetes_pod_annotation_{_meta(k)}": v for k, v in annotations.items()}
    return {**out, "__meta_kubernetes_namespace": namespace, "__address__": f"10.0.0.{index + 1}:7000",
            "__scheme__": "http", "__metrics_path__": "/metrics"}


def relabel(target: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus' ``replace`` (the default) and ``keep`` actions: the regex anchored at both ends, the
    source labels joined by ``;``, ``$N`` groups in the replacement. None: the target was dropped."""
    out = dict(target)
    for c in configs:
        value = c.get("separator", ";").join(out.get(s, "") for s in c["source_labels"])
        m = re.fullmatch(c.get("regex", "(.*)"), value)
        action = c.get("action", "replace")
        if action == "keep":
            if m is None:
                return None
            continue
        assert action == "replace", action
        if m is not None:
            out[c["target_label"]] = re.sub(r"\$(\d+)", lambda g: m.group(int(g.group(1))),
                                            c.get("replacement", "$1"))
    return out


def test_server_pods_are_annotated_and_the_shipped_scrape_config_reaches_each_at_a_certificate_name(creds):
    m = render(creds, "observability.prometheus_port=9400", "kubernetes.namespace=ml", "cluster.servers=3")
    jobs = by_kind(m)
    server, worker = jobs["server"], jobs["worker"]
    ann = server["spec"]["template"]["metadata"]["annotations"]
    assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400", "prometheus.io/path": "/metrics",
                   "prometheus.io/scheme": "https"}
    ports = {p["name"]: p["containerPort"] for p in server["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == 9400
    assert "annotations" not in worker["spec"]["template"]["metadata"]
    assert any("observability.pushgateway" in w for w in m.warnings)
    for version in VERSIONS:
        for obj in m.files.values():
            assert kubernetes_validate.validate(obj, version, strict=True)

    (job,) = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    assert job["job_name"] == "engine"                  # deploy/prometheus/alerts.yml selects job="engine"
    scraped = []
    for index in range(3):
        t = relabel(discovered(server, index, "ml"), job["relabel_configs"])
        assert t is not None
        host, port = t["__address__"].rsplit(":", 1)
        assert port == "9400" and host in m.cert_hosts, (host, m.cert_hosts)     # the certificate names it
        assert host == f"{m.server_hosts[index]}.ml.svc"
        assert (t["__scheme__"], t["__metrics_path__"], t["role"], t["rank"]) == ("https", "/metrics", "server",
                                                                                 str(index))
        scraped.append(host)
    assert len(set(scraped)) == 3
    assert relabel(discovered(worker, 0, "ml"), job["relabel_configs"]) is None        # nothing to scrape there


def test_the_printed_certs_line_names_the_cluster_wide_names_and_an_insecure_job_is_scraped_over_http(tmp_path,
                                                                                                    creds, capsys):
    assert cli(tmp_path / "out", sets(creds, "observability.prometheus_port=9400")) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "engine certs CREDS --hosts" in ln)
    hosts = line.split("--hosts ")[1].split(",")
    assert "ctr-dnn-server-0.ctr-dnn-ps" in hosts and "ctr-dnn-server-0.ctr-dnn-ps.default.svc" in hosts
    m = render(creds)                                                                   # without the port: unchanged
    assert "annotations" not in by_kind(m)["server"]["spec"]["template"]["metadata"] and m.cert_hosts == m.server_hosts
    insecure = render(creds, "observability.prometheus_port=9400", "security.insecure=true", "security.tls.cert=",
                      "security.tls.key=", "security.tls.ca=", "security.tls.client_cert=", "security.tls.client_key=",
                      "security.token_file=", "security.admin_token_file=")
    assert by_kind(insecure)["server"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "http"


@pytest.mark.parametrize("port, why", [("0", "cannot be scraped in pods"), ("7000", "also kubernetes.port"),
                                       ("7001", "also kubernetes.health_port")])
def test_a_metrics_port_nothing_can_scrape_is_refused_naming_the_key(tmp_path, creds, capsys, port, why):
    assert cli(tmp_path / "out", sets(creds, f"observability.prometheus_port={port}")) == 2
    line = error_line(capsys)
    assert "observability.prometheus_port" in line and why in line, line
