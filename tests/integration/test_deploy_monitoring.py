"""The shipped Prometheus alerts (``deploy/prometheus/alerts.yml``) and Grafana dashboard
(``deploy/grafana/sparse-engine.json``) against the metrics a real job exports: every expression parses
as PromQL (``promql-parser``, Prometheus' grammar), every metric it reads is one a server or a worker of
a real job serves (a hybrid job with checkpoints, a spill tier under a memory budget and an evaluation
every epoch: every family of ``engine.observability.prometheus`` but the online and Word2Vec gauges),
with labels those series carry, ``rate``/``increase`` only over counters, ``histogram_quantile`` over
``le``, and every label a legend or an annotation names is one the expression keeps."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

promql = pytest.importorskip("promql_parser", reason="promql-parser not installed: pip install -e '.[test]'")

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "sparse-engine.json"
#: labels Prometheus gives every series of a target: the scrape job's, the target's, and prometheus.json's
TARGET_LABELS = {"job", "instance", "role", "rank"}
#: series Prometheus makes itself
PROMETHEUS_OWN = {"up": ("gauge", set())}
#: functions of a counter's (or a histogram's buckets, sum and count) range, and of a gauge's
COUNTER_FUNCTIONS = {"rate", "irate", "increase", "resets"}
GAUGE_FUNCTIONS = {"delta", "idelta", "deriv", "predict_linear", "holt_winters", "double_exponential_smoothing"}


def _series(text: str, into: dict) -> None:
    """Add every series name of one ``/metrics`` scrape to ``into``: name -> (type, labels), a counter
    family ``F`` as ``F_total``, a histogram's as ``F_bucket`` (with ``le``), ``F_sum`` and ``F_count``;
    families declared without samples too."""
    for fam in text_string_to_metric_families(text):
        labels = set().union(*(set(s.labels) for s in fam.samples)) if fam.samples else set()
        if fam.type == "counter":
            names = {f"{fam.name}_total": labels}
        elif fam.type == "histogram":
            names = {f"{fam.name}_bucket": labels | {"le"}, f"{fam.name}_sum": labels - {"le"},
                     f"{fam.name}_count": labels - {"le"}}
        else:
            names = {fam.name: labels}
        for name, ls in names.items():
            kind = "counter" if fam.type in ("counter", "histogram") else fam.type
            old = into.get(name, (kind, set()))
            into[name] = (kind, old[1] | ls)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[str, set]]:
    """The series a real job's server and workers serve while it trains (scraped every 0.3 s, until it
    ends): 1 server + 2 workers in mode hybrid, aligned checkpoints, a spill tier under a memory budget,
    an evaluation after every epoch."""
    tmp = tmp_path_factory.mktemp("monitoring")
    run = tmp / "run"
    sets = ("mode=hybrid", "model.data.source=generated", "model.data.generated_rows=20000", "model.epochs=2",
            f"model.data.cache_dir={tmp / 'cache'}", f"model.metrics_dir={tmp / 'm'}", f"checkpoint.root={tmp / 'ck'}",
            "checkpoint.delta_every=10steps", "checkpoint.align_steps=10", "model.hidden=[32]",
            "model.log_every_s=0.2", "model.eval_every_epoch=true", "observability.prometheus_port=0",
            "observability.tensorboard=false", f"tables.sparse.embedding.spill_path={tmp / 'spill'}",
            "tables.sparse.embedding.memory_bytes=200000000")
    proc = subprocess.Popen([sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir",
                             str(run), *[a for s in sets for a in ("--set", s)]], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    series: dict[str, tuple[str, set]] = {}
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            for f in run.glob("*.metrics"):
                try:
                    with urllib.request.urlopen(f.read_text().strip(), timeout=5) as r:
                        _series(r.read().decode(), series)
                except OSError:     # not listening yet, or already gone
                    pass
            time.sleep(0.3)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    # what the checks below stand on: this job served the conditional families
    for name in ("engine_checkpoint_last_success_timestamp_seconds", "engine_worker_allreduce_total",
                 "engine_ps_memory_governor_bytes", "engine_eval_auc", "engine_ps_rocksdb_level0_files"):
        assert name in series, sorted(series)
    return series


class _Checker:
    """Walks one PromQL expression; ``problems`` collects what does not hold against ``known``."""

    def __init__(self, known: dict, where: str):
        self.known, self.where, self.problems, self.selectors = known, where, [], 0

    def fail(self, what: str) -> None:
        self.problems.append(f"{self.where}: {what}")

    def series(self, sel) -> tuple[str, set]:
        self.selectors += 1
        name = sel.name
        kind, labels = self.known.get(name) or PROMETHEUS_OWN.get(name) or (None, set())
        if kind is None:
            self.fail(f"no real job serves {name!r}")
            return "unknown", set()
        labels = labels | TARGET_LABELS
        for m in sel.matchers.matchers:
            if m.name not in labels:
                self.fail(f"{name} has no label {m.name!r} (it has {sorted(labels)})")
            if m.name == "role" and m.op == promql.MatchOp.Equal and m.value not in ("server", "worker"):
                self.fail(f"{name}: role={m.value!r} is neither server nor worker")
        return kind, labels

    def walk(self, node) -> tuple[str, set]:
        """-> (kind of the result: counter, gauge, unknown or scalar; labels the result keeps)."""
        if isinstance(node, promql.VectorSelector):
            return self.series(node)
        if isinstance(node, promql.MatrixSelector):
            return self.series(node.vector_selector)
        if isinstance(node, (promql.ParenExpr, promql.UnaryExpr)):
            return self.walk(node.expr)
        if isinstance(node, promql.SubqueryExpr):
            return self.walk(node.expr)
        if isinstance(node, (promql.NumberLiteral, promql.StringLiteral)):
            return "scalar", set()
        if isinstance(node, promql.Call):
            name = node.func.name
            results = [self.walk(a) for a in node.args]
            vectors = [r for a, r in zip(node.args, results) if not isinstance(a, (promql.NumberLiteral,
                                                                                    promql.StringLiteral))]
            kind, labels = vectors[-1] if vectors else ("scalar", set())
            if name in COUNTER_FUNCTIONS and kind != "counter":
                self.fail(f"{name}() over a {kind}, not a counter")
            if name in GAUGE_FUNCTIONS and kind != "gauge":
                self.fail(f"{name}() over a {kind}, not a gauge")
            if name == "histogram_quantile" and "le" not in labels:
                self.fail("histogram_quantile() over series without 'le'")
            if name == "histogram_quantile":
                labels = labels - {"le"}                 # the quantile is computed over the buckets
            return ("gauge" if name not in ("abs", "ceil", "floor", "round") else kind), labels
        if isinstance(node, promql.AggregateExpr):
            kind, labels = self.walk(node.expr)
            mod = node.modifier
            if mod is None:
                return "gauge", set()
            named = set(mod.labels)
            if not named <= labels:
                self.fail(f"{node.op} by/without {sorted(named - labels)}: not labels of its operand ({sorted(labels)})")
            if mod.type == promql.AggModifierType.By:
                return "gauge", named
            return "gauge", labels - named
        if isinstance(node, promql.BinaryExpr):
            (lk, ll), (rk, rl) = self.walk(node.lhs), self.walk(node.rhs)
            mod = node.modifier
            if mod is not None and mod.matching is not None:
                for label in mod.matching.labels:
                    if label not in ll | rl:
                        self.fail(f"vector matching on {label!r}: neither side has it")
            if lk == "scalar":
                return rk, rl
            return lk, ll
        self.fail(f"unexpected node {type(node).__name__}")
        return "unknown", set()


def _check(expr: str, known: dict, where: str, templates: set[str]) -> list[str]:
    try:
        tree = promql.parse(expr)
    except Exception as e:  # noqa: BLE001 - the parser's error is the finding
        return [f"{where}: not PromQL: {e}"]
    c = _Checker(known, where)
    _, labels = c.walk(tree)
    if not c.selectors:
        c.fail("reads no metric")
    for label in templates - labels:
        c.fail(f"names {{{{{label}}}}} but the expression keeps only {sorted(labels)}")
    return c.problems


def test_the_alerts_are_prometheus_rules_over_metrics_a_real_job_serves(exported):
    rules = yaml.safe_load(ALERTS.read_text())
    problems, names = [], set()
    for group in rules["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            name = rule["alert"]
            assert name not in names, f"alert {name} twice"
            names.add(name)
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
            if "for" in rule:
                assert promql.parse_duration(rule["for"]).total_seconds() > 0, name
            text = " ".join(rule["annotations"].values())
            templates = set(re.findall(r"\$labels\.(\w+)", text))
            problems += _check(rule["expr"], exported, f"alert {name}", templates)
    assert not problems, "\n".join(problems)
    assert len(names) >= 10


def test_the_dashboard_is_grafana_json_over_metrics_a_real_job_serves(exported):
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["datasource"]["uid"] == "${datasource}"
    problems, ids, cells = [], set(), {}
    for panel in dash["panels"]:
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):             # no two panels on one cell of the grid
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs) and refs, panel["title"]
        for t in panel["targets"]:
            expr = t["expr"].replace("$job", "engine")       # the variable, as Grafana substitutes it
            templates = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            problems += _check(expr, exported, f"panel {panel['title']!r} {t['refId']}", templates)
    assert not problems, "\n".join(problems)
    assert len(ids) >= 25


def test_the_checker_finds_what_it_is_meant_to_find(exported):
    """The checks above can fail: an unknown metric, a label the series lacks, rate over a gauge, a
    grouping by a missing label, a legend naming a dropped label, and text that is not PromQL."""
    cases = {
        "engine_ps_no_such_metric": "no real job serves",
        'engine_ps_rows{tabel="embedding"}': "has no label 'tabel'",
        "rate(engine_ps_rows[5m])": "rate() over a gauge",
        "sum by (phase) (engine_ps_rows)": "not labels of its operand",
        "sum(rate(engine_ps_pull_keys_total[1m]))": "names {{table}}",
        "rate(engine_ps_pull_keys_total[5m)": "not PromQL",
    }
    for expr, found in cases.items():
        got = _check(expr, exported, "case", {"table"} if "names" in found else set())
        assert any(found in p for p in got), (expr, got)
    assert _check("sum by (table) (rate(engine_ps_pull_keys_total[1m]))", exported, "case", {"table"}) == []
