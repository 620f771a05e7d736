"""The plaintext health port: the standard gRPC health checking protocol (``grpc.health.v1.Health``,
grpcio-health-checking), served apart from the PS port for probes that speak neither TLS nor tokens
(Kubernetes' native gRPC probe). It serves nothing else: no PS method, no table, no data.

The overall status (service ``""``) and ``engine.ps.ParameterServer`` are SERVING while the server
serves, NOT_SERVING while it is preempting (it still answers its job, but should get no new one),
stuck (a request hung: ``engine.ps.watchdog``), failed (a shard's spill store stopped writing for good:
``PSServer.spill_failed``) or stopping: the readiness probe's answer. Service ``liveness`` is
NOT_SERVING only while the server is stuck or failed (or stopping): the liveness probe's, which must
not restart a server that preempts (it serves its job's last checkpoint meanwhile).

The port is a ``grpc.aio`` server on one event loop per process (a daemon thread, ``_event_loop``): a
call costs a coroutine, never a thread, so calls that send their headers and never their request, or
``Watch`` streams held open, by anyone who reaches the port (it has no credentials), cannot keep a
probe's ``Check`` from being answered. (A thread pool of 2, as before, was held by two such calls, and
every probe then timed out: a liveness probe restarted a healthy server.) The status is pushed from
the role's own threads into the loop (``set``), which alone touches the servicer.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from . import ps_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
#: the service a server's liveness probe asks for (``engine k8s``): NOT_SERVING only while it is stuck
#: or failed
LIVENESS = "liveness"
#: longest wait (seconds) for the event loop to start, stop or update a port
LOOP_WAIT_S = 10.0

__all__ = ["HealthPort", "LIVENESS", "SERVICE"]

_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's health event loop, started on first use (again in a forked child, whose copy of
    the thread does not run)."""
    global _loop, _loop_thread
    with _loop_lock:
        if _loop is None or _loop_thread is None or not _loop_thread.is_alive():
            _loop = asyncio.new_event_loop()
            _loop_thread = threading.Thread(target=_loop.run_forever, name="health-aio", daemon=True)
            _loop_thread.start()
        return _loop


class HealthPort:
    """A plaintext gRPC server on ``host:port`` (port 0: a free one) with only the health service,
    answering for ``services`` (default: the overall status and the PS service; a worker's liveness
    port, the overall status only). Every service starts NOT_SERVING. Any thread may call ``set`` and
    ``close``.

    Raises
    ------
    RuntimeError
        The address could not be bound.
    """

    def __init__(self, host: str, port: int, services: tuple[str, ...] = ("", SERVICE),
                 live_services: tuple[str, ...] = ()):
        self.services, self.live_services = tuple(services), tuple(live_services)
        self.serving: bool | None = False
        self.live: bool | None = False
        self._lock = threading.Lock()
        self._closed = False
        self._loop = _event_loop()
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.server, self.servicer, self.port = self._run(self._start(addr))
        log.info("health checking (plaintext, grpc.health.v1 only) on %s:%d", host, self.port)

    def _run(self, coro):
        """Run ``coro`` on the health loop and wait for its result (``LOOP_WAIT_S`` at most)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(LOOP_WAIT_S)

    async def _start(self, addr: str):
        server = grpc.aio.server(
            # no SO_REUSEPORT: a second process on a port in use must fail, not split the probes with the first
            options=[("grpc.max_receive_message_length", 4096), ("grpc.so_reuseport", 0)])
        servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        try:
            port = server.add_insecure_port(addr)
        except RuntimeError as e:
            port, why = 0, f": {e}"
        else:
            why = ""
        if port == 0:
            await server.stop(None)
            raise RuntimeError(f"health port: cannot bind {addr}{why}")
        for name in {*self.services, *self.live_services}:
            await servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        return server, servicer, port

    async def _set(self, changes: list) -> None:
        for name, status in changes:
            await self.servicer.set(name, status)

    def set(self, serving: bool, live: bool | None = None) -> None:
        """SERVING or NOT_SERVING for each of ``services`` (``serving``) and of ``live_services`` (``live``;
        None: as ``serving``). Returns once the port answers so (a loop that does not get to it within
        ``LOOP_WAIT_S``: logged, applied when it does)."""
        live = serving if live is None else live
        with self._lock:
            changes = []
            for services, now, attr in ((self.services, serving, "serving"), (self.live_services, live, "live")):
                if now == getattr(self, attr):
                    continue
                setattr(self, attr, now)
                status = (health_pb2.HealthCheckResponse.SERVING if now
                          else health_pb2.HealthCheckResponse.NOT_SERVING)
                changes += [(name, status) for name in services]
            if not changes or self._closed:
                return
            try:
                self._run(self._set(changes))
            except TimeoutError:
                log.warning("health port %d: the status change (%s) waits for the health event loop, busy "
                            "for %gs", self.port, changes, LOOP_WAIT_S)

    async def _stop(self) -> None:
        await self.servicer.enter_graceful_shutdown()
        await self.server.stop(1.0)

    def close(self) -> None:
        """NOT_SERVING everywhere, then stop (calls in flight get 1 s); idempotent."""
        self.set(False, False)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._run(self._stop())
        except TimeoutError:
            log.warning("health port %d: not stopped within %gs", self.port, LOOP_WAIT_S)
