"""The plaintext health port: the standard gRPC health checking protocol (``grpc.health.v1.Health``,
grpcio-health-checking), served apart from the PS port for probes that speak neither TLS nor tokens
(Kubernetes' native gRPC probe). It serves nothing else: no PS method, no table, no data.

The overall status (service ``""``) and ``engine.ps.ParameterServer`` are SERVING while the server
serves, NOT_SERVING while it is preempting (it still answers its job, but should get no new one),
stuck (a request hung: ``engine.ps.watchdog``) or stopping: the readiness probe's answer. Service
``liveness`` is NOT_SERVING only while the server is stuck (or stopping): the liveness probe's, which
must not restart a server that preempts (it serves its job's last checkpoint meanwhile).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import ps_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
#: the service a server's liveness probe asks for (``engine k8s``): NOT_SERVING only while it is stuck
LIVENESS = "liveness"

__all__ = ["HealthPort", "LIVENESS", "SERVICE"]


class HealthPort:
    """A plaintext gRPC server on ``host:port`` (port 0: a free one) with only the health service,
    answering for ``services`` (default: the overall status and the PS service; a worker's liveness
    port, the overall status only).

    Raises
    ------
    RuntimeError
        The address could not be bound.
    """

    def __init__(self, host: str, port: int, services: tuple[str, ...] = ("", SERVICE),
                 live_services: tuple[str, ...] = ()):
        self.servicer = health.HealthServicer()
        self.server = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="health"),
                                  # no SO_REUSEPORT: a second process on a port in use must fail,
                                  # not split the probes with the first
                                  options=[("grpc.max_receive_message_length", 4096), ("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(addr)
        except RuntimeError as e:
            raise RuntimeError(f"health port: cannot bind {addr}: {e}") from None
        if self.port == 0:
            raise RuntimeError(f"health port: cannot bind {addr}")
        self.services, self.live_services = tuple(services), tuple(live_services)
        self.serving: bool | None = None
        self.live: bool | None = None
        self.set(False)
        self.server.start()
        log.info("health checking (plaintext, grpc.health.v1 only) on %s:%d", host, self.port)

    def set(self, serving: bool, live: bool | None = None) -> None:
        """SERVING or NOT_SERVING for each of ``services`` (``serving``) and of ``live_services`` (``live``;
        None: as ``serving``)."""
        live = serving if live is None else live
        for services, now, attr in ((self.services, serving, "serving"), (self.live_services, live, "live")):
            if now == getattr(self, attr):
                continue
            setattr(self, attr, now)
            status = (health_pb2.HealthCheckResponse.SERVING if now
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in services:
                self.servicer.set(name, status)

    def close(self) -> None:
        self.set(False, False)
        self.servicer.enter_graceful_shutdown()
        self.server.stop(1.0).wait(5.0)
