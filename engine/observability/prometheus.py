"""Prometheus metrics of a server or worker process (``prometheus-client``).

One ``RoleMetrics`` per process (``start(cfg, role, rank)``) owns a private ``CollectorRegistry`` with
the process collectors (``process_*``, ``python_*``) and the engine's metrics, serves it at
``/metrics`` on ``observability.prometheus_port`` (HTTPS with ``security.tls.cert``; mutual TLS with
``security.tls.ca``) and optionally pushes it to a Pushgateway. Names follow Prometheus' conventions
(``engine_`` prefix, base units as suffixes, ``_total`` for counters):

===========================================  ======  ===========================================
metric                                       role    what
===========================================  ======  ===========================================
engine_ps_rpc_requests_total{method,code}    server  RPCs answered, by gRPC status code
engine_ps_rpc_duration_seconds{method}       server  handling latency (histogram)
engine_ps_pull_keys_total{table}             server  keys pulled (after the client's dedup)
engine_ps_push_keys_total{table}             server  keys pushed
engine_ps_rows{table,tier}                   server  rows in RAM (``tier="ram"``) / in RocksDB
engine_ps_rows_created_total{table}          server  rows created by pushes (admitted)
engine_ps_admission_rejects_total{table}     server  new keys not admitted (admission rules)
engine_ps_rows_refused_full_total{table}     server  new keys refused at ``max_rows``
engine_ps_evictions_total{table}             server  rows written from RAM to RocksDB
engine_ps_promotions_total{table}            server  rows read back from RocksDB into RAM
engine_ps_ram_misses_total{table}            server  pulled keys not in RAM (looked up in RocksDB)
engine_ps_rocksdb_writes_total{table}        server  row writes to RocksDB (spills)
engine_ps_memory_bytes{table,part}           server  RAM by part (rows, index, block cache, ...)
engine_ps_disk_bytes{table}                  server  RocksDB files
engine_ps_table_stats_age_seconds{table}     server  age of the size figures (0: read now; a shard a writer held)
engine_ps_checkpoint_part_seconds_total{op}  server  this server's part of a save / load
engine_ps_checkpoint_parts_total{op}         server  saves / loads of this server
engine_ps_checkpoint_part_bytes_total        server  bytes of part files written
engine_worker_examples_total                 worker  training examples (CTR) consumed (*)
engine_worker_steps_total                    worker  training steps ended (*)
engine_worker_phase_seconds_total{phase}     worker  step time by phase (read, pull_sparse, compute, ...)
engine_worker_allreduce_total                worker  hybrid: all-reduces of the dense tower completed
engine_worker_allreduce_seconds_total{kind}  worker  hybrid: completing them, wall (wait) and CPU (cpu)
engine_worker_train_seconds_total            worker  wall time inside training epochs, the running one
                                                     included (*)
engine_worker_examples_per_second            worker  the last reporting window's rate (words/s: W2V)
engine_worker_train_logloss / _auc           worker  the last reporting window's values
engine_eval_auc / _logloss / _copc ...       rank 0  the last global evaluation
engine_checkpoint_seconds{op,kind}           rank 0  a whole checkpoint save / restore
engine_checkpoint_bytes_total{kind}          rank 0  bytes of published checkpoints
engine_restarts_total                        all     restarts of the job before this process (role mode:
                                                     the roll-backs the servers counted, ``PSServer.rollbacks``)
===========================================  ======  ===========================================

(*) Live (every step moves them) and counted by this worker process since it started: a restarted or
resumed process starts again from 0, whatever checkpoint step it resumed at (Prometheus' ``rate`` and
``increase`` take that as a counter reset), so the three stay consistent with each other. The job's
step across attempts is the ``step`` of the metrics-file events and TensorBoard's axis.

Everything read from tables or trainers is read at scrape time by collectors: the step loop and the
request handlers are untouched. The one per-request cost is the gRPC interceptor (two clock reads,
one histogram observation and one counter increment per RPC).

Faults: a scrape that fails or a client that sends garbage or never finishes its TLS handshake costs
one thread of the endpoint for at most ``CONNECTION_TIMEOUT_S`` and never touches the PS port; a
Pushgateway that is down is logged (at most once a minute) and retried at the next interval.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
import time
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc

from ..errors import ConfigError

# prometheus_client is imported where it is used: every server, worker and launcher imports this module,
# and with metrics off (the default) none of them should pay for loading it

__all__ = ["RoleMetrics", "RpcMetricsInterceptor", "ServerCollector", "TrainerCollector", "current",
           "start", "record_checkpoint", "child_env", "announce", "PORT_ENV", "FILE_ENV", "RESTARTS_ENV"]

log = logging.getLogger(__name__)

#: the local launcher's per-role port (overrides observability.prometheus_port in that child)
PORT_ENV = "ENGINE_PROMETHEUS_PORT"
#: where a child writes its endpoint URL once it listens (the launcher collects them)
FILE_ENV = "ENGINE_PROMETHEUS_FILE"
#: restarts of the job before this process started (set by the launcher)
RESTARTS_ENV = "ENGINE_RESTARTS"
CONNECTION_TIMEOUT_S = 10.0
#: latency buckets of RPCs, seconds (100 us .. 60 s)
RPC_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

_current: "RoleMetrics | None" = None


def current() -> "RoleMetrics | None":
    """This process's ``RoleMetrics`` (None when observability is off here)."""
    return _current


# ---------------------------------------------------------------------------------------- the role
class RoleMetrics:
    """The metrics of one process: registry, endpoint, Pushgateway thread.

    Parameters
    ----------
    role : {"server", "worker"}
    rank : int
    run_id : str
        Names the run in the Pushgateway's grouping key.
    restarts : int
        Restarts of the job before this process (``engine_restarts_total`` starts there).
    """

    def __init__(self, role: str, rank: int, run_id: str = "", restarts: int = 0):
        from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                                       ProcessCollector, disable_created_metrics)
        self.role, self.rank, self.run_id = role, rank, run_id
        disable_created_metrics()      # no *_created series: the process start time is exported once
        self.registry = CollectorRegistry(auto_describe=True)
        for c in (ProcessCollector, PlatformCollector, GCCollector):
            c(registry=self.registry)
        self.restarts = Counter("engine_restarts", "Restarts of the job (the whole cluster from its newest "
                                "checkpoint) before this process started", registry=self.registry)
        self.restarts.inc(max(0, int(restarts)))
        self.checkpoint_seconds = Histogram("engine_checkpoint_seconds", "Duration of a whole checkpoint save "
                                            "or restore by its coordinator", ["op", "kind"],
                                            buckets=CHECKPOINT_BUCKETS, registry=self.registry)
        self.checkpoint_bytes = Counter("engine_checkpoint_bytes", "Bytes of the checkpoints this coordinator "
                                        "published", ["kind"], registry=self.registry)
        # the time of the last one, what an alert on a job that stopped checkpointing reads (Prometheus'
        # *_last_success_timestamp_seconds convention; deploy/prometheus/alerts.yml, EngineNoCheckpoint)
        self.checkpoint_last = Gauge("engine_checkpoint_last_success_timestamp_seconds", "Wall-clock time (Unix "
                                     "seconds) of the last checkpoint save or restore this coordinator finished",
                                     ["op"], registry=self.registry)
        self.events = EventGauges()
        self.registry.register(self.events)
        self.url: str | None = None
        self._httpd = None
        self._push_stop = threading.Event()
        self._push_thread: threading.Thread | None = None
        self._push_url = ""
        self._push_logged = 0.0

    # ------------------------------------------------------------------ endpoint
    def serve(self, host: str, port: int, security=None) -> str:
        """Serve ``/metrics`` on host:port (0: a free port). Returns the URL.

        Parameters
        ----------
        security : engine.security.settings.SecurityConfig, optional
            ``tls.cert``/``tls.key``: HTTPS with them; ``tls.ca``: client certificates required.

        Raises
        ------
        ConfigError
            The port is in use or the address cannot be bound (names ``observability.prometheus_port``
            and the port), or the certificate files cannot be loaded.
        """
        from prometheus_client import make_wsgi_app
        ctx = None
        tls = getattr(security, "tls", None)
        if tls is not None and tls.cert:
            ctx = _ssl_context(tls)
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        except socket.gaierror as e:
            raise ConfigError(f"observability.prometheus_port: cannot resolve the {self.role}'s address "
                              f"{host!r}: {e}") from None
        server_cls = type("_MetricsServer", (_MetricsServer,), {"address_family": family})
        try:
            httpd = make_server(host, port, make_wsgi_app(self.registry), server_cls, handler_class=_Handler)
        except OSError as e:
            raise ConfigError(f"observability.prometheus_port: {self.role} {self.rank} cannot serve metrics on "
                              f"{host}:{port}: {e.strerror or e} (another process holds the port? set another "
                              f"port, or 0 for a free one)") from None
        httpd.ssl_context = ctx
        httpd.tls_files = (tls.cert, tls.key, security.reload_interval_s) if ctx is not None else None
        self._httpd = httpd
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True,
                         name="prometheus-http").start()
        bound = httpd.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if ctx is not None else 'http'}://{shown}:{bound}/metrics"
        log.info("%s %d: Prometheus metrics at %s%s", self.role, self.rank, self.url,
                 " (client certificates required)" if ctx is not None and tls.ca else "")
        return self.url

    # ------------------------------------------------------------------ pushgateway
    def start_pushing(self, url: str, interval_s: float) -> None:
        """Push the registry to the Pushgateway at ``url`` every ``interval_s`` seconds (and at ``close``)."""
        self._push_url = url

        def loop() -> None:
            while not self._push_stop.wait(interval_s):
                self.push()
        self._push_thread = threading.Thread(target=loop, daemon=True, name="prometheus-push")
        self._push_thread.start()

    def push(self) -> bool:
        """Push once; False (logged at most once a minute) when the Pushgateway cannot be reached."""
        from prometheus_client import push_to_gateway
        if not self._push_url:
            return False
        key = {"run": self.run_id or "-", "role": self.role, "rank": str(self.rank)}
        try:
            push_to_gateway(self._push_url, job="engine", registry=self.registry, grouping_key=key, timeout=10)
            return True
        except Exception as e:  # noqa: BLE001 - a monitoring outage must not stop training
            now = time.monotonic()
            if now - self._push_logged > 60:
                self._push_logged = now
                log.warning("%s %d: cannot push metrics to the Pushgateway %s (observability.pushgateway): %s",
                            self.role, self.rank, self._push_url, e)
            return False

    def close(self) -> None:
        """Push a last time (Pushgateway), stop the endpoint. Idempotent."""
        global _current
        if self._push_url and not self._push_stop.is_set():
            self._push_stop.set()
            self.push()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if _current is self:
            _current = None

    # ------------------------------------------------------------------ hooks
    def interceptor(self, methods) -> "RpcMetricsInterceptor":
        """The server's RPC metrics; ``methods``: the full paths (``/package.Service/Method``) it serves."""
        return RpcMetricsInterceptor(self.registry, methods)

    def watch_server(self, core) -> None:
        """Export ``core``'s (``engine.ps.server.PSServer``) tables and checkpoint parts at scrape time,
        and count its roll-backs (``PSServer.rollbacks``) in ``engine_restarts_total``."""
        self.registry.register(ServerCollector(core))
        self.restarts.inc(core.rollbacks)
        core.on_rollback = self.restarts.inc

    def watch_trainer(self, trainer) -> None:
        """Export a worker program's counters (``live_counters()`` or the attributes ``examples``,
        ``steps``, ``train_seconds``; ``phases``) at scrape time (``TrainerCollector``); a later trainer
        of this process replaces an earlier one."""
        old = getattr(self, "_trainer_collector", None)
        if old is not None:
            self.registry.unregister(old)
        self._trainer_collector = TrainerCollector(trainer)
        self.registry.register(self._trainer_collector)


def start(cfg, role: str, rank: int, host: str | None = None) -> RoleMetrics | None:
    """Start this process's metrics when ``observability.prometheus_port`` or ``pushgateway`` is set.

    The port is ``ENGINE_PROMETHEUS_PORT`` (the local launcher's per-role port) or
    ``observability.prometheus_port``; the address ``host`` (default ``cluster.host``). The URL is
    written to ``ENGINE_PROMETHEUS_FILE`` when set. Returns None when both are off.

    Raises
    ------
    ConfigError
        See ``RoleMetrics.serve``; an off-loopback address without TLS (and no ``security.insecure``).
    """
    global _current
    obs = cfg.observability
    raw = os.environ.get(PORT_ENV, "")
    try:
        port = int(raw) if raw else obs.prometheus_port
    except ValueError:
        raise ConfigError(f"{PORT_ENV} must be a port number, got {raw!r}") from None
    if port is None and not obs.pushgateway:
        return None
    metrics_file = getattr(getattr(cfg.model, "params", None), "metrics_file", "") if cfg.model else ""
    m = RoleMetrics(role, rank, run_id=Path(metrics_file).stem if metrics_file else "",
                    restarts=int(os.environ.get(RESTARTS_ENV, "0") or 0))
    if port is not None:
        host = host or cfg.cluster.host
        _check_address(host, cfg.security)
        url = m.serve(host, port, cfg.security)
        out = os.environ.get(FILE_ENV)
        if out:
            tmp = Path(out + ".tmp")
            tmp.write_text(url + "\n")
            tmp.replace(out)
    if obs.pushgateway:
        m.start_pushing(obs.pushgateway, obs.push_interval_s)
    _current = m
    return m


def record_checkpoint(op: str, kind: str, seconds: float, nbytes: int = 0) -> None:
    """A checkpoint save or restore by this process's coordinator (no-op when metrics are off)."""
    m = _current
    if m is None:
        return
    m.checkpoint_seconds.labels(op, kind).observe(seconds)
    m.checkpoint_last.labels(op).set(time.time())
    if nbytes:
        m.checkpoint_bytes.labels(kind).inc(nbytes)


def _check_address(host: str, security) -> None:
    """The listener rule for the metrics endpoint: off loopback, HTTPS with client certificates (the
    endpoint takes no bearer token: a scraper's certificate, signed by ``security.tls.ca``, is its
    credential), unless ``security.insecure``. Before, a server certificate alone passed, and anyone who
    reached the port could read the metrics."""
    from ..security.listen import is_loopback
    if is_loopback(host) or (security.tls.cert and security.tls.ca):
        return
    missing = " and ".join(k for k, ok in (("security.tls.cert and security.tls.key", security.tls.cert),
                                           ("security.tls.ca (the scrapers' client certificates)", security.tls.ca))
                           if not ok)
    if security.insecure:
        log.warning("the metrics endpoint listens on %s WITHOUT %s (security.insecure: true): anyone who "
                    "reaches the port can read the metrics", host, missing)
        return
    raise ConfigError(f"observability.prometheus_port: refusing to serve metrics on the non-loopback address "
                      f"{host!r} (cluster.host) without {missing}: set them, or security.insecure: true")


# ---------------------------------------------------------------------------------------- HTTP(S)
def _ssl_context(tls) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
        if tls.ca:
            ctx.load_verify_locations(tls.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"security.tls: the metrics endpoint cannot load {tls.cert!r} / {tls.key!r} / "
                          f"{tls.ca!r}: {e}") from None
    return ctx


class _Handler(WSGIRequestHandler):
    """Quiet; the TLS handshake runs here (in the connection's own thread, with a timeout), never in
    the accepting thread, so a client that connects and stays silent blocks nobody."""

    timeout = CONNECTION_TIMEOUT_S

    def setup(self) -> None:
        self.request.settimeout(self.timeout)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        pass


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    ssl_context: ssl.SSLContext | None = None
    tls_files = None
    _next_reload = 0.0
    _stamp = None

    def get_request(self):
        sock, addr = self.socket.accept()
        if self.ssl_context is not None:
            self._maybe_reload()
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def _maybe_reload(self) -> None:
        """New certificate files (rotation) serve from the next connection on, checked at most every
        ``security.reload_interval_s``."""
        cert, key, every = self.tls_files
        now = time.monotonic()
        if now < self._next_reload:
            return
        self._next_reload = now + every
        try:
            stamp = (os.stat(cert).st_mtime_ns, os.stat(key).st_mtime_ns)
            if self._stamp is not None and stamp != self._stamp:
                self.ssl_context.load_cert_chain(cert, key)
                log.info("metrics endpoint: reloaded %s", cert)
            self._stamp = stamp
        except (OSError, ssl.SSLError) as e:
            log.warning("metrics endpoint: cannot reload %s: %s (serving the previous certificate)", cert, e)

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics endpoint: a bad request from %s", client_address, exc_info=True)


# ---------------------------------------------------------------------------------------- gRPC
class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every RPC of a server (one request, one reply each; their handlers read the request themselves, so a call's time includes its arrival): ``engine_ps_rpc_requests_total{method,code}`` and
    ``engine_ps_rpc_duration_seconds{method}``. Installed first, it sees the token check's refusals too
    (``UNAUTHENTICATED``). Label children are cached, so a call costs two clock reads, one observation
    and one increment.

    ``methods``: the full paths the server serves (``/package.Service/Method``); the label is the last
    part. Any other path a caller sends (before the token check, so anyone who reaches the port can) is
    counted as ``method="other"``: labelled by what it sent, each invented name made new series, and a
    loop of them grew ``/metrics`` and the server's memory without bound."""

    OTHER = "other"

    def __init__(self, registry: CollectorRegistry, methods=()):
        from prometheus_client import Counter, Histogram
        self.requests = Counter("engine_ps_rpc_requests", "RPCs answered by this server, by method and gRPC "
                                "status code", ["method", "code"], registry=registry)
        self.duration = Histogram("engine_ps_rpc_duration_seconds", "Time to handle an RPC (from the handler's "
                                  "start to its reply or error)", ["method"], buckets=RPC_BUCKETS,
                                  registry=registry)
        self._counts: dict[tuple[str, str], object] = {}
        self._hists: dict[str, object] = {}
        self._names = {m: m.rsplit("/", 1)[-1] for m in methods}

    def _count(self, method: str, code: str):
        c = self._counts.get((method, code))
        if c is None:
            c = self._counts[method, code] = self.requests.labels(method, code)
        return c

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        # the PS handlers are request-streaming (they read their one message: engine.ps.call_guard), as is the
        # token check's refusal, which reads nothing; unary ones are timed all the same
        kind = "unary_unary" if handler is not None and handler.unary_unary is not None else \
            "stream_unary" if handler is not None and handler.stream_unary is not None else None
        if kind is None:
            return handler
        method = self._names.get(details.method, self.OTHER)
        hist = self._hists.get(method)
        if hist is None:
            hist = self._hists[method] = self.duration.labels(method)
        inner, clock, count = getattr(handler, kind), time.perf_counter, self._count

        def timed(request, context):
            t0 = clock()
            try:
                reply = inner(request, context)
            except BaseException:
                hist.observe(clock() - t0)
                code = context.code()
                count(method, code.name if code is not None else "UNKNOWN").inc()
                raise
            hist.observe(clock() - t0)
            count(method, "OK").inc()
            return reply
        return handler._replace(**{kind: timed})


# ---------------------------------------------------------------------------------------- collectors
#: table counter (``SparseTable.stats()`` key) -> (metric name without engine_ps_ and _total, help)
_TABLE_COUNTERS = (("pull_keys", "pull_keys", "Keys pulled from this server's shards of the table"),
                   ("push_keys", "push_keys", "Keys pushed to this server's shards of the table"),
                   ("created", "rows_created", "Rows created by pushes (admitted new keys)"),
                   ("rejected", "admission_rejects", "New keys the admission rules did not admit"),
                   ("rows_refused_full", "rows_refused_full", "New keys refused because the table held max_rows"),
                   ("deleted", "rows_deleted", "Rows deleted (expiry, shrink)"),
                   ("evictions", "evictions", "Rows evicted from RAM to RocksDB"),
                   ("promotions", "promotions", "Rows read back from RocksDB into RAM"),
                   ("pull_misses", "ram_misses", "Pulled keys not in RAM (looked up in RocksDB when the "
                                                 "table spills)"),
                   ("spill_writes", "rocksdb_writes", "Row writes to RocksDB"))


def _spill_parts() -> tuple[str, ...]:
    """Parts of ``engine_ps_table_call_seconds``: ``SparseTable.stats()``'s wall-time ``{part}_ns``
    counters (the thread-CPU ones, ``*_cpu_ns``, stay in ``stats()``: a different quantity). Imported
    here, not at the top: only a server's collector needs the tables (and Numba) loaded."""
    from sparse_tables._spill_tier import SPILL_TIME_NS
    return tuple(k[:-3] for k in SPILL_TIME_NS if not k.endswith("_cpu_ns"))


def _malloc_families(core):
    """glibc's heap of the server's process (``PSServer.heap_stats``): most of a budgeted server's RSS
    beyond its tables' parts. Nothing off glibc."""
    from prometheus_client.core import GaugeMetricFamily

    h = core.heap_stats() if hasattr(core, "heap_stats") else None
    if h is None:
        return
    heap = GaugeMetricFamily("engine_ps_malloc_bytes", "This process's malloc heap by state: in_use, free "
                             "(fragments inside the heap), mmap (large chunks mapped on their own)",
                             labels=["state"])
    for state in ("in_use", "free", "mmap"):
        heap.add_metric([state], float(h[f"{state}_bytes"]))
    yield heap
    yield GaugeMetricFamily("engine_ps_malloc_arenas", "malloc arenas of this process", value=h["arenas"])


def _governor_family(core):
    """The memory governor's last reading (``engine.ps.governor``), on a budgeted role server."""
    from prometheus_client.core import GaugeMetricFamily

    gov = getattr(core, "governor", None)
    if gov is not None:
        g = gov.stats()
        fam = GaugeMetricFamily("engine_ps_memory_governor_bytes", "A budgeted server's RSS by the memory "
                                "governor's reading: baseline (before any table), counted (the tables' parts), "
                                "unaccounted (the rest) and its high-water mark (the tables' reserve)",
                                labels=["part"])
        for part in ("baseline", "counted", "unaccounted", "high_water"):
            fam.add_metric([part], float(g[f"{part}_bytes"]))
        yield fam


class ServerCollector:
    """A PS server's tables, read at scrape time from ``SparseHost.stats()`` (no hot-path cost).

    Parameters
    ----------
    core : engine.ps.server.PSServer
        Its ``sparse`` hosts are read; ``checkpoint_parts`` (op -> (count, seconds, bytes)) too.
    """

    def __init__(self, core):
        self.core = core

    def describe(self):
        return []     # families depend on the tables: described at collect time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        fams = {name: CounterMetricFamily(f"engine_ps_{name}", doc, labels=["table"])
                for _, name, doc in _TABLE_COUNTERS}
        rows = GaugeMetricFamily("engine_ps_rows", "Rows of the table on this server by tier (ram, rocksdb)",
                                 labels=["table", "tier"])
        mem = GaugeMetricFamily("engine_ps_memory_bytes", "RAM of the table on this server by part",
                                labels=["table", "part"])
        disk = GaugeMetricFamily("engine_ps_disk_bytes", "RocksDB files of the table on this server",
                                 labels=["table"])
        stall = CounterMetricFamily("engine_ps_rocksdb_write_stall_seconds", "Time this server's spill "
                                    "writes waited out RocksDB write stalls (compaction behind)", labels=["table"])
        l0 = GaugeMetricFamily("engine_ps_rocksdb_level0_files", "Level-0 files of the table's RocksDB "
                               "stores on this server (writes slow down at 20 per store, stop at 36)",
                               labels=["table"])
        catch_up = GaugeMetricFamily("engine_ps_rocksdb_catch_up_stores", "RocksDB stores of the table on "
                                     "this server whose compaction after a bulk load (a restore) is pending "
                                     "(waiting its turn or merging), or was refused by RocksDB (failed)",
                                     labels=["table", "state"])
        spill_time = CounterMetricFamily(
            "engine_ps_table_call_seconds", "Wall time of this server's calls on the table by part (summed "
            "over threads): spill_lock_wait / pull_spilled, pulls that missed RAM waiting for a shard's lock "
            "/ holding it; push_lock_wait / push_locked, pushes; promote (of it promote_read, RocksDB's "
            "reads) and evict (of it evict_write) inside them", labels=["table", "part"])
        failed = GaugeMetricFamily("engine_ps_spill_failed_stores", "RocksDB stores of the table on this server "
                                   "that stopped writing for good (a full or lost spill disk): their shards refuse "
                                   "every request and the server reports not live until it is restarted",
                                   labels=["table"])
        stale = GaugeMetricFamily("engine_ps_table_stats_age_seconds", "Age of the table's size figures "
                                  "(engine_ps_rows, engine_ps_memory_bytes) on this server: 0 when read now, "
                                  "else those of the last read of a shard a writer held (an expiry pass, a "
                                  "restore); counters are always current", labels=["table"])
        call_parts = _spill_parts()
        for table, host in list(self.core.sparse.items()):
            try:
                s = host.stats()
            except Exception as e:  # noqa: BLE001 - a table being swapped by a Load: skip it this scrape
                log.debug("metrics: stats of table %s: %s", table, e)
                continue
            for key, name, _ in _TABLE_COUNTERS:
                fams[name].add_metric([table], float(s.get(key, 0)))
            rows.add_metric([table, "ram"], float(s.get("rows_in_ram", 0)))
            rows.add_metric([table, "rocksdb"], float(s.get("rows_spilled", 0)))
            for part, v in (s.get("memory") or {}).items():
                mem.add_metric([table, part], float(v))
            disk.add_metric([table], float(s.get("disk_bytes", 0)))
            stale.add_metric([table], float(s.get("stats_age_s", 0.0)))
            for part in call_parts:
                spill_time.add_metric([table, part], s.get(f"{part}_ns", 0) / 1e9)
            if "rocksdb" in s:
                stall.add_metric([table], float(s["rocksdb"].get("write_stall_s", 0)))
                l0.add_metric([table], float(s["rocksdb"].get("level0_files", 0)))
                catch_up.add_metric([table, "pending"], float(s["rocksdb"].get("catching_up", 0)))
                catch_up.add_metric([table, "failed"], float(s["rocksdb"].get("catch_up_failed", 0)))
                failed.add_metric([table], float(s["rocksdb"].get("failed", 0)))
        yield from fams.values()
        yield from (rows, mem, disk, stale, stall, l0, catch_up, failed, spill_time)
        yield from _malloc_families(self.core)
        yield from _governor_family(self.core)
        parts = getattr(self.core, "checkpoint_parts", None) or {}
        secs = CounterMetricFamily("engine_ps_checkpoint_part_seconds", "Time this server spent writing "
                                   "(save) or reading (load) its checkpoint parts", labels=["op"])
        count = CounterMetricFamily("engine_ps_checkpoint_parts", "Checkpoint saves / loads of this server",
                                    labels=["op"])
        nbytes = CounterMetricFamily("engine_ps_checkpoint_part_bytes", "Bytes of checkpoint part files this "
                                     "server wrote", labels=[])
        for op, (n, seconds, b) in sorted(parts.items()):
            secs.add_metric([op], seconds)
            count.add_metric([op], n)
        nbytes.add_metric([], float(parts.get("save", (0, 0.0, 0))[2]))
        yield from (secs, count, nbytes)
        yield from _watchdog_families(getattr(self.core, "watchdog", None))


def _watchdog_families(watchdog):
    """A server's requests in flight (``engine.ps.watchdog``): how many, the oldest one's time (time behind
    a checkpoint, restore or expiry pass left out) and whether the server is stuck; an alert on the
    oldest's time nearing ``client.timeout_s`` comes before the liveness restart."""
    if watchdog is None:
        return
    from prometheus_client.core import GaugeMetricFamily
    st = watchdog.state()
    yield GaugeMetricFamily("engine_ps_requests_in_flight", "Requests this server is handling now",
                            value=float(st["requests_in_flight"]))
    yield GaugeMetricFamily("engine_ps_oldest_request_seconds", "Seconds the oldest request in flight has waited "
                            "(time behind a checkpoint, restore or expiry pass left out); stuck past "
                            "client.timeout_s", value=st["oldest_request_s"])
    yield GaugeMetricFamily("engine_ps_stuck", "1 while this server is stuck (a request hung past client.timeout_s, "
                            "or a checkpoint, restore or expiry pass past 3600 s): its health port says NOT_SERVING",
                            value=float(st["stuck"] is not None))


class TrainerCollector:
    """A worker program's counters, read at scrape time: ``examples``, ``steps`` and ``train_seconds``
    from its ``live_counters()`` (this process's work since it started, moving every step: the CTR and
    Word2Vec trainers; a program that ``watch_trainer``s must have it); ``phases`` (phase -> seconds); and its mode's
    all-reduce figures in mode hybrid (``mode.profile()["allreduce"]``). Missing values are skipped."""

    _COUNTERS = (("examples", "engine_worker_examples", "Training examples this worker process consumed since "
                  "it started (a restarted process starts from 0)"),
                 ("steps", "engine_worker_steps", "Training steps this worker process ended since it started "
                  "(a restarted process starts from 0, whatever checkpoint step it resumed at)"),
                 ("train_seconds", "engine_worker_train_seconds", "Wall seconds this worker process spent "
                  "inside training epochs since it started, the running epoch included (a restarted process "
                  "starts from 0)"))

    def __init__(self, trainer):
        self.trainer = trainer

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily
        t = self.trainer
        values = t.live_counters()
        for key, name, doc in self._COUNTERS:
            v = values.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield CounterMetricFamily(name, doc, value=float(v))
        phases = getattr(t, "phases", None)
        if isinstance(phases, dict):
            fam = CounterMetricFamily("engine_worker_phase_seconds", "Seconds of training steps by phase (read, "
                                      "dedup, pull_sparse, pull_dense, compute, push_sparse, push_dense, ...)",
                                      labels=["phase"])
            for phase, v in list(phases.items()):
                fam.add_metric([phase], float(v))
            yield fam
        yield from self._allreduce(getattr(getattr(t, "mode", None), "profile", None))

    @staticmethod
    def _allreduce(profile):
        """Mode hybrid (``HybridMode.profile``): the dense tower's all-reduces completed, and the wall and
        CPU seconds spent completing them: a worker whose wait grows while its CPU does not is waiting
        for a slower peer (a straggler)."""
        from prometheus_client.core import CounterMetricFamily
        stats = profile().get("allreduce") if callable(profile) else None
        if not isinstance(stats, dict):
            return
        yield CounterMetricFamily("engine_worker_allreduce", "All-reduces of the dense tower completed (mode hybrid; "
                                  "one per bucket when overlapped with the backward pass)",
                                  value=float(stats["calls"]))
        fam = CounterMetricFamily("engine_worker_allreduce_seconds", "Seconds completing the dense tower's "
                                  "all-reduces (mode hybrid): wall (wait) and this thread's CPU (cpu)",
                                  labels=["kind"])
        fam.add_metric(["wait"], float(stats["wait_s"]))
        fam.add_metric(["cpu"], float(stats["wait_cpu_s"]))
        yield fam


class EventGauges:
    """The last values of the events a worker writes to its metrics file (``note``): examples/s and
    the window's loss of ``train`` events, the global evaluation of ``eval`` events, progressive
    validation of ``partition`` events."""

    _TRAIN = (("examples_per_s", "engine_worker_examples_per_second", "Examples per second in the last "
               "reporting window"),
              ("words_per_s", "engine_worker_words_per_second", "Raw words per second in the last window (word2vec)"),
              ("logloss", "engine_worker_train_logloss", "Training logloss of the last reporting window"),
              ("loss", "engine_worker_train_loss", "Training loss of the last reporting window (word2vec)"),
              ("auc", "engine_worker_train_auc", "Training AUC of the last reporting window"))
    _EVAL = (("auc", "engine_eval_auc"), ("logloss", "engine_eval_logloss"), ("copc", "engine_eval_copc"),
             ("accuracy", "engine_eval_accuracy"), ("count", "engine_eval_examples"))
    _PARTITION = (("progressive_auc", "engine_online_progressive_auc"),
                  ("progressive_logloss", "engine_online_progressive_logloss"), ("rows", "engine_online_rows"))

    def __init__(self):
        self.values: dict[str, float] = {}
        self._docs = {name: doc for _, name, doc in self._TRAIN}

    def note(self, event: dict) -> None:
        kind = event.get("event")
        table = (((k, n) for k, n, _ in self._TRAIN) if kind == "train" else
                 self._EVAL if kind == "eval" else self._PARTITION if kind == "partition" else ())
        for key, name in table:
            v = event.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.values[name] = float(v)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        for name, v in sorted(self.values.items()):
            yield GaugeMetricFamily(name, self._docs.get(name, "The last global evaluation (rank 0) / "
                                                               "progressive validation"), value=v)


# ---------------------------------------------------------------------------------------- the launcher
def child_env(cfg, role: str, rank: int, run_dir, restarts: int = 0) -> dict[str, str]:
    """The environment the local launcher gives one child: its own metrics port (server r:
    ``prometheus_port + r``, worker r: ``prometheus_port + cluster.servers + r``; 0: each a free port),
    the file it writes its URL to (``run_dir/{role}-{rank}.metrics``) and the job's restarts so far.

    Raises
    ------
    ConfigError
        The role's port would exceed 65535.
    """
    out = {RESTARTS_ENV: str(int(restarts))}
    base = cfg.observability.prometheus_port
    if base is None:
        return out
    port = 0 if base == 0 else base + rank + (cfg.cluster.servers if role == "worker" else 0)
    if port > 65535:
        raise ConfigError(f"observability.prometheus_port: {base} + the offset of {role} {rank} is {port}, "
                          f"past 65535; choose a lower port or 0")
    path = Path(run_dir) / f"{role}-{rank}.metrics"
    path.unlink(missing_ok=True)
    return {**out, PORT_ENV: str(port), FILE_ENV: str(path)}


def withdraw(cfg, run_dir) -> None:
    """An attempt's roles are gone: empty ``run_dir/prometheus.json`` (``[]``, no target), so a Prometheus
    reading the runs' files (``deploy/prometheus/scrape-local.yml``) stops scraping them instead of
    reporting every ended run's roles down for ever (the shipped EngineRoleDown alert). The file stays:
    a scrape config's glob keeps matching it. Nothing when metrics are off or nothing was announced."""
    out = Path(run_dir) / "prometheus.json"
    if cfg.observability.prometheus_port is None or not out.is_file():
        return
    try:
        _write_targets(out, [])
    except OSError as e:        # the run directory is the user's: a failure to empty it is no failure of the job
        log.warning("could not empty %s (its targets stay listed for Prometheus): %s", out, e)


def _write_targets(out: Path, groups: list[dict]) -> None:
    """Replace the file_sd target list ``out`` with ``groups`` at once (a temporary file renamed over it:
    Prometheus never reads half of it)."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(groups, indent=1) + "\n")
    tmp.replace(out)


def announce(cfg, run_dir, children) -> bool:
    """Once every child (objects with ``role`` and ``rank``) wrote its metrics URL: log them and write
    ``run_dir/prometheus.json``, a Prometheus ``file_sd_configs`` target list (labels ``role``, ``rank``,
    ``__scheme__``). Returns True when done (or metrics are off), False while some are missing."""
    if cfg.observability.prometheus_port is None:
        return True
    urls = {}
    for c in children:
        try:
            urls[c.role, c.rank] = (Path(run_dir) / f"{c.role}-{c.rank}.metrics").read_text().strip()
        except OSError:
            return False
        if not urls[c.role, c.rank]:
            return False
    groups = []
    for (role, rank), url in urls.items():
        scheme, rest = url.split("://", 1)
        groups.append({"targets": [rest.split("/", 1)[0]],
                       "labels": {"role": role, "rank": str(rank), "__scheme__": scheme}})
    out = Path(run_dir) / "prometheus.json"
    _write_targets(out, groups)
    log.info("Prometheus metrics (file_sd targets in %s): %s", out,
             ", ".join(f"{role} {rank} {url}" for (role, rank), url in urls.items()))
    return True
