"""The parameter server: wire protocol (``ps.proto``), routing, codec, server, client, transports.

    >>> from engine.ps import PSClient, PSServer, InProcessTransport
    >>> servers = [PSServer({"emb": TableConfig(dim=8)}, index=i, num_servers=2) for i in range(2)]
    >>> client = PSClient(InProcessTransport(servers))

The protocol and the command that regenerates the committed ``ps_pb2*.py`` are in ``ps.proto``.
"""
from .client import PSClient
from .routing import DEFAULT_NUM_VSHARDS, mix64, route, vshard_of
from .grpc_service import serve
from .server import PSServer
from .transport import GrpcTransport, InProcessTransport, Transport

__all__ = ["PSClient", "PSServer", "serve", "Transport", "GrpcTransport", "InProcessTransport",
           "route", "vshard_of", "mix64", "DEFAULT_NUM_VSHARDS"]
