"""Observability of real processes: a CTR job (``engine train``, 1 server + 2 workers, mode hybrid: the
sparse side as in async, plus the workers' all-reduce figures) scraped over HTTP while it trains, its
TensorBoard event files read back with TensorBoard's own reader, and a role-mode server whose row gauges
equal its tables' statistics taken through the PS client."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.ps import PSClient

REPO = Path(__file__).resolve().parents[2]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_file(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        assert proc.poll() is None, f"exited with {proc.returncode} before writing {path}"
        time.sleep(0.05)
    raise AssertionError(f"{path} not written within {timeout}s")


@contextlib.contextmanager
def role_server(tmp_path: Path, *sets: str):
    """``engine train configs/ctr.yaml --role server`` with a metrics port and ``--set`` overrides:
    yields (process, endpoint, metrics URL); the process is killed if the test leaves it running."""
    ready, metrics = tmp_path / "ready", tmp_path / "metrics"
    env = {**os.environ, "ENGINE_PROMETHEUS_FILE": str(metrics)}
    env.pop("ENGINE_PS_MALLOC_TUNE", None)
    args = [a for kv in ("observability.prometheus_port=0",) + sets for a in ("--set", kv)]
    proc = subprocess.Popen([sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--role",
                             "server", "--rank", "0", "--port", "0", "--ready-file", str(ready), *args],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield proc, wait_file(ready, proc), wait_file(metrics, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_running_job_is_scraped_and_its_event_files_hold_the_final_auc(tmp_path):
    run, tb = tmp_path / "run", tmp_path / "tb"
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(run),
           *[a for s in ("mode=hybrid", "model.data.source=generated", "model.data.generated_rows=30000",
                         "model.epochs=3",
                         f"model.data.cache_dir={tmp_path / 'cache'}", f"model.metrics_dir={tmp_path / 'm'}",
                         "checkpoint.root=", "model.hidden=[32]", "model.log_every_s=0.2",
                         "observability.prometheus_port=0", f"observability.tensorboard_dir={tb}")
             for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server_url = wait_file(run / "server-0.metrics", proc)
        worker_url = wait_file(run / "worker-0.metrics", proc)
        pulled = ("engine_ps_pull_keys_total", (("table", "embedding"),))
        examples = ("engine_worker_examples_total", ())
        deadline = time.monotonic() + 120
        # training started on both sides: the server has served pulls (worker 1's may come first) and
        # worker 0 has finished a batch
        while scrape(server_url).get(pulled, 0) == 0 or scrape(worker_url).get(examples, 0) == 0:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        first, w_first = scrape(server_url), scrape(worker_url)
        targets = json.loads(wait_file(run / "prometheus.json", proc))      # written once every role listens
        calls = ("engine_worker_allreduce_total", ())
        ok_pulls = ("engine_ps_rpc_requests_total", (("code", "OK"), ("method", "Pull")))
        steps = ("engine_ps_rpc_requests_total", (("code", "OK"), ("method", "Step")))

        def served(m: dict) -> float:
            return m.get(ok_pulls, 0) + m.get(steps, 0)
        # until each counter moved (a fixed 0.5 s could fall in a pause of the lockstep job on a loaded machine)
        deadline = time.monotonic() + 60
        while True:
            time.sleep(0.2)
            second, w_second = scrape(server_url), scrape(worker_url)
            if (second[pulled] > first[pulled] and served(second) > served(first)
                    and w_second[examples] > w_first[examples] and w_second.get(calls, 0) > w_first.get(calls, 0)):
                break
            assert time.monotonic() < deadline and proc.poll() is None, "the job's counters stopped moving"
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert second[pulled] > first[pulled] > 0
    assert served(second) > served(first)
    assert second["engine_ps_rows", (("table", "embedding"), ("tier", "ram"))] > 0
    assert w_second[examples] > w_first[examples] > 0
    # live (no aligned checkpoint point in this job: steps and seconds move with every step all the same)
    steps_total = w_second["engine_worker_steps_total", ()]
    assert steps_total > 0 and w_second[examples] == pytest.approx(128 * steps_total, abs=128)
    assert w_second["engine_worker_train_seconds_total", ()] > 0
    assert w_second["engine_worker_phase_seconds_total", (("phase", "compute"),)] > 0
    wait, cpu = (("engine_worker_allreduce_seconds_total", (("kind", k),)) for k in ("wait", "cpu"))
    assert w_second[calls] > w_first.get(calls, 0)            # one all-reduce per step
    assert 0 < w_second[cpu] <= w_second[wait] + 1e-3         # the waiting thread's CPU within its wall time
    assert w_second["engine_restarts_total", ()] == 0
    assert sorted((t["labels"]["role"], t["labels"]["rank"]) for t in targets) == [
        ("server", "0"), ("worker", "0"), ("worker", "1")]
    # the job ended: no target left for Prometheus (before, the ended run's roles were listed for ever, and
    # deploy/prometheus/alerts.yml's EngineRoleDown fired for every finished run)
    assert json.loads((run / "prometheus.json").read_text()) == []
    assert "Prometheus metrics" in err and server_url in err

    final = json.loads(out.strip().splitlines()[-1])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logdir = Path(final["tensorboard_dir"])
    assert logdir.parent == tb and logdir.name == Path(final["metrics_file"]).stem
    ea = EventAccumulator(str(logdir))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/rank0/auc", "train/rank1/examples_per_s", "test/auc", "test/logloss", "test/copc",
            "test/accuracy"} <= tags
    # one step axis: each evaluation at the job's step when it ran, the last one at the end of training
    events = [json.loads(line) for line in Path(final["metrics_file"]).read_text().splitlines()]
    profiles = {e["rank"]: e for e in events if e["event"] == "profile"}
    evals = ea.Scalars("test/auc")
    assert [e.step for e in evals] == [e["step"] for e in events if e["event"] == "eval"]
    assert len(evals) == 3 and 0 < evals[0].step < evals[1].step < evals[2].step == profiles[0]["step"]
    assert evals[-1].value == pytest.approx(final["test_auc"], abs=1e-6)
    assert [e.step for e in ea.Scalars("profile/rank0/phase_seconds/compute")] == [profiles[0]["step"]]
    train_steps = [e.step for e in ea.Scalars("train/rank0/auc")]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == profiles[0]["step"]
    assert ea.Scalars("final/test_auc")[0].value == pytest.approx(final["test_auc"], abs=1e-6)


def test_role_server_row_gauges_equal_the_tables_stats_and_keys_pulled_move(tmp_path):
    """A server started with --role (as a scheduler would): its metrics port comes from the config; on
    an idle server the row gauges equal ``stats()`` taken through the client at the same moment."""
    with role_server(tmp_path, "cluster.warm_up=false") as (proc, ep, url):
        with PSClient([ep], timeout_s=20, retries=1) as c:
            keys = np.arange(1, 5001, dtype=np.uint64) * np.uint64(7919)
            c.push("embedding", keys, np.ones((len(keys), 10), np.float32))
            (stats,) = c.stats()
            got = scrape(url)
            emb = stats["sparse"]["embedding"]
            assert got["engine_ps_rows", (("table", "embedding"), ("tier", "ram"))] == emb["rows_in_ram"] == 5000
            assert got["engine_ps_rows", (("table", "embedding"), ("tier", "rocksdb"))] == emb["rows_spilled"]
            assert got["engine_ps_push_keys_total", (("table", "embedding"),)] == emb["push_keys"]
            before = got["engine_ps_pull_keys_total", (("table", "embedding"),)]
            c.pull("embedding", keys[:1000])
            assert scrape(url)["engine_ps_pull_keys_total", (("table", "embedding"),)] == before + 1000
            c.stop()
        proc.wait(timeout=30)
