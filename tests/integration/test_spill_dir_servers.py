"""Spill directories of real server processes: two jobs with the same ``spill_path`` and table names on
one machine (the second job's server is refused with an error naming the spill directory it would have
shared, and the first job's server keeps serving with its rows intact: nothing of its spill directory was
wiped); a spill disk that fills up (the server says it is not live)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from engine.config import from_dict
from engine.errors import LaunchError
from engine.launch.local import LocalCluster
from engine.ps import PSClient

pytestmark = pytest.mark.slow

DIM = 4


def test_second_server_on_a_used_spill_path_is_refused_and_the_first_keeps_serving(tmp_path):
    spill = tmp_path / "spill"
    cfg = from_dict({"cluster": {"servers": 1, "workers": 1, "local_shards": 2, "startup_timeout_s": 120},
                     "tables": {"sparse": {"emb": {"dim": DIM, "optimizer": "sgd", "learning_rate": 1.0,
                                                   "initializer": "zeros", "memory_rows": 100,
                                                   "spill_path": str(spill), "num_threads": 1}}}})
    first = LocalCluster(cfg, tmp_path / "run-a")
    second = LocalCluster(cfg, tmp_path / "run-b")
    try:
        endpoints = first.start_servers()
        keys = np.arange(1, 2001, dtype=np.uint64)
        with PSClient(endpoints, timeout_s=60) as client:
            client.wait_ready(60)
            client.push("emb", keys, np.ones((len(keys), DIM), np.float32))
            before = client.pull("emb", keys)
            assert client.stats()[0]["sparse"]["emb"]["rows_spilled"] > 0
            owned = sorted(os.listdir(spill))
            assert owned == ["emb-server0-shard0", "emb-server0-shard1"]
            with pytest.raises(LaunchError) as ei:
                second.start_servers()
            msg = str(ei.value)
            assert str(spill / "emb-server0-shard0") in msg and "in use by another table or process" in msg
            assert first.servers[0].proc.poll() is None          # the first server is still up ...
            np.testing.assert_array_equal(client.pull("emb", keys), before)   # ... with every row
            client.push("emb", keys[:10], np.ones((10, DIM), np.float32))
            np.testing.assert_array_equal(client.pull("emb", keys[:10]), before[:10] - 1)
            assert sorted(os.listdir(spill)) == owned
            for d in owned:
                assert (spill / d / ".sparse-engine-spill").is_file()
        first.stop_servers()
    finally:
        second.shutdown()
        first.shutdown()


def test_a_server_whose_spill_disk_fills_up_says_it_is_not_live_once_and_refuses_the_shard(tmp_path, tmpfs):
    """A real server process: its spill store stops writing for good on a full disk. The push that met it
    and every later one get UNAVAILABLE naming the shard and the store; the health port answers
    NOT_SERVING for readiness and liveness (a probe restarts it), Health says why, the local launcher's
    watch ends the attempt; the server logs the failure once, no traceback per request."""
    from grpc_health.v1 import health_pb2
    from rich.console import Console

    from engine.errors import RemoteError
    from engine.observability import status
    from engine.ps.health import LIVENESS
    from tests.integration.test_health_and_job_end import health, wait_health
    from tests.integration.test_observability import scrape
    from tests.integration.test_role_resume import free_ports
    from tests.tmpfs import leave_free

    disk = tmpfs("spill", 16 << 20)
    (port,) = free_ports(1)
    cfg = from_dict({"cluster": {"servers": 1, "workers": 1, "local_shards": 1, "startup_timeout_s": 120,
                                 "warm_up": False, "health_port": port},
                     "observability": {"prometheus_port": 0},
                     "tables": {"sparse": {"emb": {"dim": DIM, "optimizer": "sgd", "learning_rate": 1.0,
                                                   "initializer": "zeros", "memory_bytes": 60 << 20,
                                                   "spill_path": str(disk / "spill"), "num_threads": 1}}}})
    cluster = LocalCluster(cfg, tmp_path / "run")
    try:
        endpoints = cluster.start_servers()
        wait_health(port, "SERVING")
        with PSClient(endpoints, timeout_s=60, retries=0) as client:
            client.push("emb", np.arange(1, 2001, dtype=np.uint64), np.ones((2000, DIM), np.float32))
            leave_free(disk, 256 << 10)
            with pytest.raises(RemoteError) as ei:
                for i in range(1, 40):
                    keys = np.arange(i * 10**6, i * 10**6 + 50_000, dtype=np.uint64)
                    client.push("emb", keys, np.ones((len(keys), DIM), np.float32))
            store = disk / "spill" / "emb-server0-shard0" / "rocksdb"
            assert ei.value.code == "UNAVAILABLE" and "table 'emb', shard 0" in str(ei.value), str(ei.value)
            assert f"{store} stopped writing for good: IO error: No space left on device" in str(ei.value)
            with pytest.raises(RemoteError, match="out of service.*the request was refused, nothing applied"):
                client.pull("emb", np.arange(1, 11, dtype=np.uint64))
            wait_health(port, "NOT_SERVING", timeout=10)
            assert health(port, LIVENESS) == health_pb2.HealthCheckResponse.ServingStatus.Name(
                health_pb2.HealthCheckResponse.NOT_SERVING)
            h = client.health()[0]
            assert not h["ready"] and not h["live"] and h["failed"].startswith("table 'emb' shard 0: RocksDB spill")
            # the dashboards show it too: Prometheus (an alert's input) and engine status
            url = next((tmp_path / "run").rglob("server-0.metrics")).read_text().strip()
            metrics = scrape(url)
            assert metrics["engine_ps_spill_failed_stores", (("table", "emb"),)] == 1
            snap = status.once(status.resolve(endpoints[0]), interval_s=0.1)
            assert snap["servers"][0]["spill_failed"] == h["failed"]
            shown = Console(width=400, record=True)
            shown.print(status.render(snap))
            assert f"server 0 ({endpoints[0]}) not live, spill store failed: table 'emb' shard 0" in shown.export_text()
        deadline = time.monotonic() + 10
        while not cluster.watch.failed() and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(LaunchError, match=r"server 0 .*not live: table 'emb' shard 0: RocksDB spill store"):
            cluster._check_hangs()
        text = cluster.servers[0].log_path.read_text()
        lines = [ln for ln in text.splitlines() if "stopped writing for good" in ln]
        # the store logs its failure once; the refused requests are logged at most once a second per code
        # (grpc_service._Refusals: here the push that met it, maybe the pull); the role once, not live
        assert sum("sparse_tables.spill" in ln for ln in lines) == 1, text[-3000:]
        assert sum("refused UNAVAILABLE" in ln for ln in lines) <= 2, text[-3000:]
        assert sum("engine.roles" in ln for ln in lines) == 1, text[-3000:]
        assert "not live: table 'emb' shard 0" in text and "Traceback" not in text, text[-3000:]
    finally:
        cluster.shutdown()


def test_a_server_on_a_read_only_spill_path_exits_2_with_one_line_naming_it(tmp_path, tmpfs):
    """A config error, not a fault: exit code 2 (the launcher does not restart it), one line naming the
    table's spill_path, the directory and the reason; no traceback."""
    ro = tmpfs("ro", 1 << 20, read_only=True)
    cfg = from_dict({"cluster": {"servers": 1, "workers": 1, "local_shards": 1, "startup_timeout_s": 120,
                                 "warm_up": False},
                     "tables": {"sparse": {"emb": {"dim": DIM, "optimizer": "sgd", "memory_rows": 100,
                                                   "spill_path": str(ro / "spill"), "num_threads": 1}}}})
    cluster = LocalCluster(cfg, tmp_path / "run")
    try:
        with pytest.raises(LaunchError) as ei:
            cluster.start_servers()
        assert ei.value.exit_code == 2, str(ei.value)
        text = cluster.servers[0].log_path.read_text()
        assert (f"engine train: table error: tables.sparse.emb.spill_path='{ro / 'spill'}': spill directory "
                f"{ro / 'spill' / 'emb-server0-shard0'}: cannot create its parent {ro / 'spill'}: Read-only file "
                f"system") in text and "Traceback" not in text, text[-3000:]
    finally:
        cluster.shutdown()
