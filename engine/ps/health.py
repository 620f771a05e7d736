"""The plaintext health port: the standard gRPC health checking protocol (``grpc.health.v1.Health``,
grpcio-health-checking), served apart from the PS port for probes that speak neither TLS nor tokens
(Kubernetes' native gRPC probe). It serves nothing else: no PS method, no table, no data.

The overall status (service ``""``) and ``engine.ps.ParameterServer`` are SERVING while the server
serves, NOT_SERVING while it is preempting (it still answers its job, but should get no new one),
stuck (a request hung: ``engine.ps.watchdog``; the liveness probe restarts it) or stopping.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import ps_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name

__all__ = ["HealthPort", "SERVICE"]


class HealthPort:
    """A plaintext gRPC server on ``host:port`` (port 0: a free one) with only the health service,
    answering for ``services`` (default: the overall status and the PS service; a worker's liveness
    port, the overall status only).

    Raises
    ------
    RuntimeError
        The address could not be bound.
    """

    def __init__(self, host: str, port: int, services: tuple[str, ...] = ("", SERVICE)):
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
        self.services = tuple(services)
        self.serving: bool | None = None
        self.set(False)
        self.server.start()
        log.info("health checking (plaintext, grpc.health.v1 only) on %s:%d", host, self.port)

    def set(self, serving: bool) -> None:
        """SERVING or NOT_SERVING for each of ``services``."""
        if serving == self.serving:
            return
        self.serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.services:
            self.servicer.set(name, status)

    def close(self) -> None:
        self.set(False)
        self.servicer.enter_graceful_shutdown()
        self.server.stop(1.0).wait(5.0)
