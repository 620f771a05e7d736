"""``engine status`` (run as a subprocess) against real clusters: a LocalCluster of 2 server processes
holding known keys, read through its run directory and through an endpoint list, must report the tables'
true row counts (the PS client's ``stats()``), request rates and a p99 latency while a client pulls; a
dead endpoint in the list is one "unreachable" entry, not a crash; a real ``engine train`` prints its
findable run directory ({cluster.run_root}/{job}-{time}-{pid}, ``latest`` pointing at it), and status
without a target finds it and shows the worker's epoch and steps/s while it trains."""
from __future__ import annotations

import bisect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.config import from_dict
from engine.launch.local import LocalCluster
from engine.ps import PSClient

REPO = Path(__file__).resolve().parents[2]

CONFIG = {
    "cluster": {"servers": 2, "workers": 1, "startup_timeout_s": 60, "local_shards": 2},
    "tables": {"sparse": {name: {"dim": 4, "optimizer": "sgd", "learning_rate": 1.0, "initializer": "zeros"}
                          for name in ("emb", "other")},
               "dense": {"d": {"optimizer": "sgd", "learning_rate": 1.0}}},
}


def status(*args: str, cwd: Path = REPO, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "status", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def status_json(*args: str, cwd: Path = REPO) -> dict:
    # a live server must answer within --timeout: 10 s, not the command's 2 s, on a loaded test machine
    timeout = () if "--timeout" in args else ("--timeout", "10")
    proc = status(*args, *timeout, "--once", "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("status") / "run"
    c = LocalCluster(from_dict(CONFIG), run_dir)
    try:
        c.start_servers()
        client = PSClient(c.endpoints, name="status-test")
        client.push("emb", np.arange(1000, dtype=np.uint64), np.ones((1000, 4), np.float32))
        client.push("other", np.arange(5000, 5300, dtype=np.uint64), np.ones((300, 4), np.float32))
        yield c, client
        client.close()
    finally:
        c.stop_servers()
        c.shutdown()


def _pulling(client, stop: threading.Event) -> None:
    keys = np.arange(2000, dtype=np.uint64)          # pulls of unknown keys create nothing
    while not stop.is_set():
        client.pull("emb", keys)


def _check_servers(snap: dict, c: LocalCluster, client: PSClient) -> None:
    truth = client.stats()
    assert [s["endpoint"] for s in snap["servers"]] == c.endpoints
    for s, t in zip(snap["servers"], truth):
        assert s["status"] == "ok" and s["server"] == t["server"]
        for name in ("emb", "other"):
            assert s["tables"][name]["rows"] == t["sparse"][name]["rows"]
        assert s["rows"] == t["sparse"]["emb"]["rows"] + t["sparse"]["other"]["rows"]
        assert s["rows_in_ram"] == s["rows"] and s["rows_on_disk"] == 0
        assert s["rss_bytes"] > 10 << 20 and s["table_ram_bytes"] > 0
        assert s["requests_per_s"] > 1                        # the pulling thread's requests
        assert 0 < s["p99_latency_s"] < 5.0
    assert sum(s["rows"] for s in snap["servers"]) == 1300
    assert all(0 < s["rows"] < 1300 for s in snap["servers"])      # both servers hold some


def test_status_reports_true_row_counts_rates_and_latency(cluster):
    c, client = cluster
    stop = threading.Event()
    t = threading.Thread(target=_pulling, args=(client, stop), daemon=True)
    t.start()
    try:
        by_dir = status_json(str(c.run_dir))
        by_endpoints = status_json(",".join(c.endpoints))
    finally:
        stop.set()
        t.join(10)
    assert by_dir["run_dir"] == str(c.run_dir.resolve()) and by_dir["interval_s"] > 0.5
    _check_servers(by_dir, c, client)
    _check_servers(by_endpoints, c, client)
    assert by_endpoints["run_dir"] is None and by_endpoints["workers"] == []
    # the Stats latency histogram counts every handled request once
    for st in client.stats():
        for method, counts in st["latency"].items():
            assert sum(counts) in (st["requests"][method], st["requests"][method] - 1), method  # - this Stats


def test_dead_endpoint_is_reported_unreachable_not_a_crash(cluster):
    c, client = cluster
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    snap = status_json(",".join([c.endpoints[0], dead]), "--timeout", "5")
    assert time.monotonic() - t0 < 30
    ok, gone = snap["servers"]
    assert ok["status"] == "ok" and ok["rows"] == client.stats()[0]["sparse"]["emb"]["rows"] + \
        client.stats()[0]["sparse"]["other"]["rows"]
    assert gone == {"server": 1, "endpoint": dead, "status": "unreachable", "error": gone["error"]}
    assert "UNAVAILABLE" in gone["error"] or "DEADLINE" in gone["error"]
    # every server gone: exit 1 with the entries; the live table renders the same entries
    proc = status(dead, "--once", "--json", "--timeout", "1")
    assert proc.returncode == 1 and json.loads(proc.stdout)["servers"][0]["status"] == "unreachable"
    proc = status(dead, "--once", "--timeout", "1")
    assert proc.returncode == 1 and "unreachable" in proc.stdout


def test_bad_targets_are_one_line_errors(tmp_path):
    for args, words in [((str(tmp_path),), "endpoints.json"), (("nohost",), "neither a directory"),
                        (("--root", str(tmp_path / "none")), "no local run")]:
        proc = status(*args, "--once", "--json")
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("engine status:") and words in lines[0], lines


def small_job(tmp_path, root: Path, *sets: str) -> tuple[subprocess.Popen, list[str]]:
    """A small CTR job (1 worker, generated rows, no checkpoints) whose run directory is made under
    ``root``; its stderr lines are collected into the returned list as they come."""
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"),
           "--set", f"cluster.run_root={root}", "--set", "cluster.workers=1",
           "--set", "model.data.source=generated", "--set", "model.data.generated_rows=20000",
           "--set", f"model.data.cache_dir={tmp_path / 'cache'}", "--set", f"model.metrics_dir={tmp_path / 'm'}",
           "--set", f"observability.tensorboard_dir={tmp_path / 'tb'}",
           "--set", "checkpoint.root=", "--set", "model.hidden=[16]", "--set", "model.batch_size=8",
           "--set", "model.epochs=2", "--set", "model.eval_every_epoch=false",
           *[a for kv in sets for a in ("--set", kv)]]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(job.stderr), daemon=True).start()
    return job, lines


def printed_run_dir(job: subprocess.Popen, lines: list[str], deadline: float) -> Path:
    """The run directory the launcher printed (``run directory: ...``), waited for until ``deadline``."""
    while time.monotonic() < deadline and job.poll() is None:
        found = [m.group(1) for ln in list(lines) if (m := re.search(r"run directory: (\S+)", ln))]
        if found:
            return Path(found[0])
        time.sleep(0.2)
    raise AssertionError("no run directory printed\n" + "".join(lines)[-3000:])


@pytest.mark.long   # make test-long (pyproject.toml): status by run directory is also the first test's
@pytest.mark.slow
def test_train_prints_a_findable_run_dir_and_status_follows_its_worker(tmp_path):
    root = tmp_path / "runs"
    job, lines = small_job(tmp_path, root)
    try:
        deadline = time.monotonic() + 120
        run_dir = printed_run_dir(job, lines, deadline)
        assert run_dir.parent == root.resolve()
        assert re.fullmatch(rf"ctr_dnn-\d{{8}}-\d{{6}}-{job.pid}", run_dir.name), run_dir.name
        assert (root / "latest").resolve() == run_dir
        seen = None
        while time.monotonic() < deadline and job.poll() is None:
            proc = status("--root", str(root), "--once", "--json", "--interval", "0.7")
            if proc.returncode == 0:
                snap = json.loads(proc.stdout)
                assert snap["run_dir"] == str(run_dir)
                live = [w for w in snap["workers"] if w["steps_per_s"]]
                if live and live[0]["epoch"] is not None and snap["servers"][0]["rows"] > 0:
                    seen = snap
                    break
            time.sleep(0.3)
        assert seen is not None, "status never saw the worker training\n" + "".join(lines)[-3000:]
        (w,) = seen["workers"]
        assert w["rank"] == 0 and w["steps_per_s"] > 1 and w["examples_per_s"] == pytest.approx(8 * w["steps_per_s"], rel=0.2)
        assert 0 <= w["epoch"] < 2 and w["beat_age_s"] < 5 and w["alive"] is True and seen["launcher_alive"] is True
        assert seen["servers"][0]["status"] == "ok" and seen["servers"][0]["requests_per_s"] > 0
        assert json.loads((run_dir / "endpoints.json").read_text())["endpoints"] == \
            [s["endpoint"] for s in seen["servers"]]
        assert job.wait(timeout=180) == 0, "".join(lines)[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


def test_secured_server_is_read_with_the_runs_security_config(tmp_path):
    """TLS + tokens: status reaches the server with the config's security section (its certificate and
    token files); without it the plaintext call fails as that server's entry, and a wrong token is an
    "error" entry (refused), not "unreachable"."""
    from engine.config import dump_config
    from engine.ps import PSServer, serve
    from engine.security import certs
    from engine.security.credentials import server_security
    from sparse_tables import TableConfig

    d = tmp_path / "creds"
    certs.write_cluster_credentials(d, ["localhost"])
    sec = {"tls": {"cert": str(d / "server.pem"), "key": str(d / "server.key"), "ca": str(d / "ca.pem"),
                   "client_cert": str(d / "client.pem"), "client_key": str(d / "client.key")},
           "token_file": str(d / "token"), "admin_token_file": str(d / "admin_token")}
    cfg = from_dict({**CONFIG, "security": sec})
    core = PSServer({"emb": TableConfig(dim=4, optimizer="sgd")}, local_shards=2)
    server, port = serve(core, "127.0.0.1", 0, threads=4, security=server_security(cfg.security))
    ep = f"127.0.0.1:{port}"
    try:
        from engine.connect import connect
        with connect(cfg, [ep], name="test", admin=False) as c:
            c.push("emb", np.arange(77, dtype=np.uint64), np.ones((77, 4), np.float32))
        dump_config(cfg, tmp_path / "config.yaml")
        snap = status_json(ep, "--config", str(tmp_path / "config.yaml"))
        assert snap["servers"][0]["status"] == "ok" and snap["servers"][0]["rows"] == 77
        plain = status(ep, "--once", "--json", "--timeout", "2")
        assert plain.returncode == 1 and json.loads(plain.stdout)["servers"][0]["status"] == "unreachable"
        (tmp_path / "wrong").write_text("not-the-token\n")
        wrong = from_dict({**CONFIG, "security": {**sec, "token_file": str(tmp_path / "wrong")}})
        dump_config(wrong, tmp_path / "wrong.yaml")
        proc = status(ep, "--config", str(tmp_path / "wrong.yaml"), "--once", "--json")
        entry = json.loads(proc.stdout)["servers"][0]
        assert proc.returncode == 1 and entry["status"] == "error" and "UNAUTHENTICATED" in entry["error"]
    finally:
        server.stop(0).wait()
        core.close()


def test_p99_of_the_latency_histogram_lies_in_the_bucket_of_the_exact_p99():
    from engine.observability.status import quantile
    from engine.ps.server import LATENCY_BOUNDS_S
    rng = np.random.default_rng(0)
    for scale in (2e-4, 3e-3, 0.2):
        lat = rng.lognormal(np.log(scale), 0.8, 20000)
        counts = [0] * (len(LATENCY_BOUNDS_S) + 1)
        for x in lat:
            counts[bisect.bisect_left(LATENCY_BOUNDS_S, x)] += 1
        exact = float(np.quantile(lat, 0.99))
        b = bisect.bisect_left(LATENCY_BOUNDS_S, exact)
        lo, hi = (LATENCY_BOUNDS_S[b - 1] if b else 0.0), LATENCY_BOUNDS_S[min(b, len(LATENCY_BOUNDS_S) - 1)]
        assert lo <= quantile(list(LATENCY_BOUNDS_S), counts, 0.99) <= hi, scale
    assert quantile(list(LATENCY_BOUNDS_S), [0] * (len(LATENCY_BOUNDS_S) + 1), 0.99) is None


@pytest.mark.long   # make test-long (pyproject.toml): the restart itself is in make test (test_online_faults)
@pytest.mark.slow
def test_without_run_dir_a_restarts_attempt_goes_below_the_first_and_status_shows_it(tmp_path):
    """Without ``--run-dir`` the launcher makes ``{run_root}/{job}-{time}-{pid}``; a restarted attempt
    must go below it (``restart-1/``), where the directory the launcher printed, ``latest`` and ``engine
    status`` find it. Before, each attempt made a new sibling, and status on the printed directory showed
    the dead first attempt while the job ran on."""
    root = tmp_path / "runs"
    job, lines = small_job(tmp_path, root, "cluster.warm_up=false")
    try:
        deadline = time.monotonic() + 150
        first = printed_run_dir(job, lines, deadline)
        report = first / "worker-0.progress.json"
        while time.monotonic() < deadline and job.poll() is None:
            try:
                if json.loads(report.read_text()).get("step", 0) >= 20:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        os.kill(json.loads(report.read_text())["pid"], signal.SIGKILL)     # a process this job started
        restart = first / "restart-1"
        while not (restart / "worker-0.progress.json").exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        assert (restart / "worker-0.progress.json").exists(), "".join(lines)[-3000:]
        assert sorted(p.name for p in root.iterdir()) == [first.name, "latest"]      # no sibling
        seen = None
        while seen is None and time.monotonic() < deadline and job.poll() is None:
            proc = status(str(first), "--once", "--json", "--interval", "0.5")
            if proc.returncode == 0 and json.loads(proc.stdout)["run_dir"] == str(restart):
                seen = json.loads(proc.stdout)
            time.sleep(0.3)
        assert seen is not None and seen["launcher_alive"] is True, "".join(lines)[-3000:]
        assert job.wait(timeout=180) == 0, "".join(lines)[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


def test_a_beat_written_after_the_clock_was_read_is_not_negative():
    """``engine status`` reads its clock before the progress files: a worker that beat in between showed
    ``beat_age_s`` -0.017 (the audit); it is 0."""
    from engine.observability.status import _worker_row
    now = time.time()
    assert _worker_row(0, {"pid": 1, "beat": now + 0.02}, None, now)["beat_age_s"] == 0.0
    assert _worker_row(0, {"pid": 1, "beat": now - 2.0}, None, now)["beat_age_s"] == pytest.approx(2.0)


def test_the_step_is_the_jobs_and_the_first_frame_shows_no_lifetime_p99():
    """A resumed worker's step column is the job's (its checkpoint's step plus its own; it showed its own,
    0 after a resume); the p99 comes from two reads like the rates (the first frame showed the p99 of
    the server's whole life)."""
    from engine import progress
    from engine.observability.status import _server_row, _worker_row
    rep = progress.Progress(None)
    rep.base(500)
    for _ in range(3):
        rep.step(128)
    row = _worker_row(0, rep.report(), None, time.time())
    assert (row["step"], row["process_steps"]) == (503, 3)
    bounds = [0.001, 0.01, 0.1]
    stats = {"server": 0, "uptime_s": 10.0, "requests": {"Pull": 90}, "latency_bounds_s": bounds,
             "latency": {"Pull": [0, 0, 90, 0]}}
    first = _server_row(0, "e", {"ok": True, "stats": stats}, None, 1.0)
    assert first["p99_latency_s"] is None and first["requests_per_s"] is None
    later = {**stats, "uptime_s": 11.0, "requests": {"Pull": 100}, "latency": {"Pull": [10, 0, 90, 0]}}
    second = _server_row(0, "e", {"ok": True, "stats": later}, {"ok": True, "stats": stats}, 1.0)
    assert second["requests_per_s"] == 10 and second["p99_latency_s"] <= 0.001   # the interval's 10 fast ones
