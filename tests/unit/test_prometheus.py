"""The Prometheus side of ``engine.observability`` against a real in-process gRPC server and a real
HTTP(S) endpoint: RPC counts and latencies by method and status code, table statistics read at scrape
time, HTTPS with the cluster's certificate (mutual TLS), garbage on the metrics port, a port in use,
the launcher's per-role ports and the config section."""
from __future__ import annotations

import socket
import ssl
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import from_dict
from engine.errors import ConfigError, RemoteError
from engine.observability import prometheus
from engine.observability.prometheus import RoleMetrics
from engine.ps import PSClient, PSServer, serve
from engine.ps import ps_pb2 as pb
from engine.ps.grpc_service import method_paths
from engine.ps.transport import GrpcTransport
from engine.security import certs
from engine.security.settings import SecurityConfig, TlsConfig
from sparse_tables import TableConfig

DIM = 4


def scrape(url: str, context: ssl.SSLContext | None = None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, parsed by prometheus_client's parser."""
    with urllib.request.urlopen(url, timeout=10, context=context) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def server():
    """A PS server with the metrics interceptor and table collector, and its metrics on a free port;
    yields (endpoint, core, RoleMetrics)."""
    m = RoleMetrics("server", 0)
    core = PSServer({"emb": TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0)}, local_shards=2)
    m.watch_server(core)
    srv, port = serve(core, "127.0.0.1", 0, threads=4, interceptors=[m.interceptor(method_paths())])
    m.serve("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}", core, m
    finally:
        m.close()
        srv.stop(0).wait()
        core.close()


def test_rpc_counts_latencies_and_table_stats_move_with_traffic(server):
    ep, core, m = server
    keys = np.arange(1, 301, dtype=np.uint64)
    with PSClient([ep], timeout_s=10, retries=0) as c:
        c.push("emb", keys, np.ones((len(keys), DIM), np.float32))
        before = scrape(m.url)
        c.pull("emb", keys[:100])
        c.pull("emb", keys[:100])
        with pytest.raises(RemoteError):      # NOT_FOUND from the server: counted under its status code
            GrpcTransport([ep], retries=0).call(0, "Pull", pb.PullRequest(table="nope", request_id="x"), 10.0)
        after = scrape(m.url)
        (stats,) = c.stats()
    table = (("table", "emb"),)
    assert after["engine_ps_pull_keys_total", table] - before["engine_ps_pull_keys_total", table] == 200
    assert after["engine_ps_push_keys_total", table] == stats["sparse"]["emb"]["push_keys"] == 300
    assert after["engine_ps_rows", (("table", "emb"), ("tier", "ram"))] == stats["sparse"]["emb"]["rows_in_ram"] == 300
    assert after["engine_ps_rows", (("table", "emb"), ("tier", "rocksdb"))] == 0
    assert after["engine_ps_rows_created_total", table] == 300
    call_s = {part: after["engine_ps_table_call_seconds_total", (("part", part), ("table", "emb"))]
              for part in prometheus._spill_parts()}
    assert call_s["push_locked"] == stats["sparse"]["emb"]["push_locked_ns"] / 1e9 > 0   # a RAM-only table:
    assert call_s["promote"] == call_s["evict"] == call_s["pull_spilled"] == 0          # nothing spills
    ok = ("engine_ps_rpc_requests_total", (("code", "OK"), ("method", "Pull")))
    assert after[ok] - before.get(ok, 0) == 2
    assert after["engine_ps_rpc_requests_total", (("code", "NOT_FOUND"), ("method", "Pull"))] == 1
    assert after["engine_ps_rpc_duration_seconds_count", (("method", "Pull"),)] >= 3
    assert after["engine_ps_rpc_duration_seconds_sum", (("method", "Pull"),)] > 0
    assert after["engine_restarts_total", ()] == 0
    assert ("process_resident_memory_bytes", ()) in after


def test_methods_the_server_does_not_serve_share_one_label(tmp_path):
    """On a server with tokens, the token check answers every path a caller sends, served or not, and
    the metrics see each answer before it: labelled by the path, each invented one was a new series,
    so a loop of them (no token needed) grew /metrics and the server's memory without bound. They count
    as ``method="other"``."""
    import grpc
    from engine.security.credentials import server_security
    (tmp_path / "token").write_text("s3cret\n")
    security = server_security(SecurityConfig(token_file=str(tmp_path / "token")))
    m = RoleMetrics("server", 0)
    core = PSServer({"emb": TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0)}, local_shards=2)
    srv, port = serve(core, "127.0.0.1", 0, threads=4, security=security,
                      interceptors=[m.interceptor(method_paths())])
    m.serve("127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for path in [f"/no.such.Service/M{i}" for i in range(40)] + ["/engine.ps.ParameterServer/Pull"]:
                with pytest.raises(grpc.RpcError) as e:
                    ch.unary_unary(path)(b"", timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        after = scrape(m.url)
    finally:
        m.close()
        srv.stop(0).wait()
        core.close()
    counts = {dict(labels)["method"]: v for (name, labels), v in after.items()
              if name == "engine_ps_rpc_requests_total"}
    assert counts == {"other": 40, "Pull": 1}, counts


def test_a_hung_request_shows_in_the_watchdog_gauges_before_and_when_the_server_is_stuck(server):
    """``engine_ps_requests_in_flight``, ``engine_ps_oldest_request_seconds`` and ``engine_ps_stuck`` follow
    the server's watchdog (``engine.ps.watchdog``): a request held inside the server (a real Pull, on a
    real gRPC server, blocked on the tables' lock) counts, grows old, makes the server stuck past the
    bound, and leaves no trace once answered."""
    import threading

    ep, core, m = server
    core.watchdog.request_bound_s = 0.5
    idle = scrape(m.url)
    assert idle["engine_ps_stuck", ()] == 0 and idle["engine_ps_oldest_request_seconds", ()] == 0
    with PSClient([ep], timeout_s=30, retries=0) as c:
        with core._tables_lock.exclusive():         # the Pull waits for the tables, as behind a hung Load
            t = threading.Thread(target=c.pull, args=("emb", np.arange(1, 9, dtype=np.uint64)), daemon=True)
            t.start()
            deadline = time.monotonic() + 10
            while core.watchdog.stuck() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            held = scrape(m.url)
        t.join(10)
    assert held["engine_ps_stuck", ()] == 1 and held["engine_ps_requests_in_flight", ()] >= 1
    assert held["engine_ps_oldest_request_seconds", ()] > 0.5
    after = scrape(m.url)
    assert not t.is_alive() and after["engine_ps_stuck", ()] == 0 and after["engine_ps_oldest_request_seconds", ()] == 0


def test_garbage_on_the_metrics_port_does_not_hurt_the_server(server):
    ep, core, m = server
    port = int(m.url.rsplit(":", 1)[1].split("/")[0])
    for junk in (b"\x16\x03\x01\x02\x00garbage" * 50, b"GET /metrics HTTP/9.9\r\n\r\n", b"\x00" * 4096):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.recv(65536)
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)     # connects, never speaks
    try:
        with PSClient([ep], timeout_s=10, retries=0) as c:
            keys = np.arange(1, 11, dtype=np.uint64)
            c.push("emb", keys, np.ones((10, DIM), np.float32))
            assert c.pull("emb", keys).shape == (10, DIM)
        assert scrape(m.url)["engine_ps_push_keys_total", (("table", "emb"),)] == 10
    finally:
        silent.close()


def test_a_port_in_use_names_the_key_and_the_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        m = RoleMetrics("worker", 3)
        with pytest.raises(ConfigError) as ei:
            m.serve("127.0.0.1", port)
    msg = str(ei.value)
    assert "observability.prometheus_port" in msg and f"127.0.0.1:{port}" in msg and "worker 3" in msg


def test_https_with_the_cluster_certificate_and_client_certificates(tmp_path):
    d = tmp_path / "creds"
    certs.write_cluster_credentials(d, ["localhost"])
    sec = SecurityConfig(tls=TlsConfig(cert=str(d / "server.pem"), key=str(d / "server.key"), ca=str(d / "ca.pem")))
    m = RoleMetrics("server", 0)
    url = m.serve("127.0.0.1", 0, sec)
    try:
        assert url.startswith("https://")
        https = url.replace("127.0.0.1", "localhost")
        ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
        ctx.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
        assert ("engine_restarts_total", ()) in scrape(https, ctx)
        # the certificate it serves is the cluster's server certificate
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        served = ssl.get_server_certificate(("127.0.0.1", port))
        assert ssl.PEM_cert_to_DER_cert(served) == ssl.PEM_cert_to_DER_cert((d / "server.pem").read_text().split(
            "-----END CERTIFICATE-----")[0] + "-----END CERTIFICATE-----\n")
        # no client certificate: refused in the handshake
        bare = ssl.create_default_context(cafile=str(d / "ca.pem"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            scrape(https, bare)
        # plain HTTP gets no metrics
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            scrape(url.replace("https://", "http://"))
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)   # never starts its handshake
        try:
            assert ("engine_restarts_total", ()) in scrape(https, ctx)     # the others are still served
        finally:
            silent.close()
    finally:
        m.close()


def test_start_reads_the_config_and_the_launchers_environment(tmp_path, monkeypatch):
    cfg = from_dict({"observability": {"prometheus_port": 0}, "cluster": {"servers": 2}})
    env = prometheus.child_env(cfg, "worker", 1, tmp_path, restarts=2)
    assert env[prometheus.PORT_ENV] == "0" and env[prometheus.RESTARTS_ENV] == "2"
    fixed = from_dict({"observability": {"prometheus_port": 9400}, "cluster": {"servers": 2}})
    assert prometheus.child_env(fixed, "server", 1, tmp_path)[prometheus.PORT_ENV] == "9401"
    assert prometheus.child_env(fixed, "worker", 1, tmp_path)[prometheus.PORT_ENV] == "9403"
    assert prometheus.PORT_ENV not in prometheus.child_env(from_dict({}), "worker", 0, tmp_path)
    with pytest.raises(ConfigError, match="observability.prometheus_port"):
        prometheus.child_env(from_dict({"observability": {"prometheus_port": 65535}}), "worker", 0, tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    m = prometheus.start(cfg, "worker", 1)
    try:
        assert prometheus.current() is m
        assert (tmp_path / "worker-1.metrics").read_text().strip() == m.url
        assert scrape(m.url)["engine_restarts_total", ()] == 2
        prometheus.record_checkpoint("save", "base", 1.5, 1000)
        got = scrape(m.url)
        assert got["engine_checkpoint_seconds_count", (("kind", "base"), ("op", "save"))] == 1
        assert got["engine_checkpoint_bytes_total", (("kind", "base"),)] == 1000
    finally:
        m.close()
    assert prometheus.current() is None


def test_off_loopback_without_tls_is_refused_and_bad_keys_are_named():
    cfg = from_dict({"observability": {"prometheus_port": 0}, "cluster": {"host": "0.0.0.0"},
                     "security": {"insecure": False}})
    with pytest.raises(ConfigError, match="observability.prometheus_port.*without security.tls.cert and "
                                          "security.tls.key and security.tls.ca"):
        prometheus._check_address("0.0.0.0", cfg.security)
    server_only = SecurityConfig(tls=TlsConfig(cert="s.pem", key="s.key"))     # no client certificates
    with pytest.raises(ConfigError, match=r"without security.tls.ca \(the scrapers' client certificates\)"):
        prometheus._check_address("0.0.0.0", server_only)
    prometheus._check_address("0.0.0.0", SecurityConfig(tls=TlsConfig(cert="s.pem", key="s.key", ca="ca.pem")))
    prometheus._check_address("127.0.0.1", SecurityConfig())
    with pytest.raises(ConfigError, match="observability: unknown key"):
        from_dict({"observability": {"port": 1}})
    with pytest.raises(ConfigError, match="observability.prometheus_port must be >= 0"):
        from_dict({"observability": {"prometheus_port": -1}})


def test_pushgateway_gets_the_registry_periodically_and_at_close_and_an_outage_is_not_fatal():
    """A stand-in Pushgateway (an HTTP server recording PUTs, the protocol push_to_gateway speaks)."""
    import http.server
    import threading

    got: list[tuple[str, bytes]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            got.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    gw = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=gw.serve_forever, daemon=True).start()
    m = RoleMetrics("worker", 1, run_id="ctr_dnn-async-x")
    try:
        m.start_pushing(f"http://127.0.0.1:{gw.server_address[1]}", 0.1)
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(got) >= 2
        m.close()
        n = len(got)
        assert got[-1][0] == "/metrics/job/engine/rank/1/role/worker/run/ctr_dnn-async-x"
        assert b"engine_restarts_total" in got[-1][1]
    finally:
        gw.shutdown()
        gw.server_close()
    assert n >= 3          # two periodic pushes and the last one at close
    down = RoleMetrics("server", 0)
    down._push_url = f"http://127.0.0.1:{gw.server_address[1]}"      # nobody listens any more
    assert down.push() is False


def test_the_catch_up_of_a_restores_stores_is_a_gauge_per_table_and_state(tmp_path):
    """``engine_ps_rocksdb_catch_up_stores``: the stores of a spilling table whose compaction after a bulk
    load is pending (here both shards, inside their loads), none once they caught up, and one that
    RocksDB refused (``catch_up_error``) as failed; each equals the table's ``stats()["rocksdb"]``."""
    m = RoleMetrics("server", 0)
    core = PSServer({"emb": TableConfig(dim=DIM, optimizer="sgd", memory_rows=100,
                                        spill_path=str(tmp_path / "spill"))}, local_shards=2)
    m.watch_server(core)
    m.serve("127.0.0.1", 0)
    pending, failed = (("engine_ps_rocksdb_catch_up_stores", (("state", s), ("table", "emb")))
                       for s in ("pending", "failed"))
    try:
        shards = core.sparse["emb"].shards
        got = scrape(m.url)
        assert (got[pending], got[failed]) == (0, 0)
        for shard in shards:
            shard._spill.bulk(True)
        got, stats = scrape(m.url), core.sparse["emb"].stats()["rocksdb"]
        assert got[pending] == stats["catching_up"] == 2 and got[failed] == 0
        for shard in shards:
            shard._spill.bulk(False)             # nothing loaded: caught up at once
        shards[1]._spill.catch_up_failed(RuntimeError("set_options: IO error (injected)"))
        got, stats = scrape(m.url), core.sparse["emb"].stats()["rocksdb"]
        assert got[pending] == stats["catching_up"] == 0
        assert got[failed] == stats["catch_up_failed"] == 1
    finally:
        m.close()
        core.close()


def test_trainer_counters_are_the_trainers_live_counters_of_this_process():
    """``engine_worker_{examples,steps,train_seconds}_total`` come from ``live_counters()`` (moved every
    step, counted by this process) when the trainer has it, not from attributes that move only at commit
    points (a CTR trainer's ``steps`` holds the restored checkpoint's step and moves at aligned points)."""
    class Trainer:
        examples, steps, train_seconds = 0, 512, 0.0            # what the old collector exported
        phases = {"compute": 1.5}

        def live_counters(self):
            return {"examples": 84864, "steps": 663, "train_seconds": 12.5}

    class Other:
        def live_counters(self):
            return {"steps": 7, "examples": 896}

    m = RoleMetrics("worker", 0)
    m.watch_trainer(Trainer())
    get = m.registry.get_sample_value
    assert (get("engine_worker_examples_total"), get("engine_worker_steps_total"),
            get("engine_worker_train_seconds_total")) == (84864, 663, 12.5)
    assert get("engine_worker_phase_seconds_total", {"phase": "compute"}) == 1.5
    docs = {f.name: f.documentation for f in m.registry.collect()}
    for name in ("engine_worker_examples", "engine_worker_steps", "engine_worker_train_seconds"):
        assert "since it started" in docs[name] and "restarted process starts from 0" in docs[name], docs[name]
    m.watch_trainer(Other())                                    # replaces the first trainer
    assert (get("engine_worker_steps_total"), get("engine_worker_examples_total")) == (7, 896)
    assert get("engine_worker_train_seconds_total") is None
