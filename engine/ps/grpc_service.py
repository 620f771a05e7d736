"""``serve``: the gRPC server of a ``PSServer`` (the ``engine.ps.ParameterServer`` service).

Transport only: requests are parsed by the zero-copy codec and handed to ``PSServer.handle``, whose
``ServerError`` becomes the call's status; TLS, tokens, keepalive, message limits and the RPC thread
pool are set here.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from . import _malloc, codec
from . import ps_pb2 as pb
from .keepalive import server_keepalive_options
from .server import ADMIN_METHODS, METHODS, PSServer, ServerError, admin_reason

log = logging.getLogger("engine.ps.server")


def _make_handler(core: PSServer, method: str):
    def handler(request, context):
        try:
            return core.handle(method, request)
        except ServerError as e:
            context.abort(getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL), str(e))
    handler.__name__ = method
    return handler


SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name


def method_paths() -> list[str]:
    """The full path (``/engine.ps.ParameterServer/Pull``...) of every method a server serves."""
    return [f"/{SERVICE}/{m}" for m in METHODS]


def generic_handler(core: PSServer) -> grpc.GenericRpcHandler:
    """The ``engine.ps.ParameterServer`` service of ``core`` with the zero-copy codec: requests are
    parsed by ``codec.parse`` (a malformed one reaches ``handle`` and gets INVALID_ARGUMENT with its
    context instead of gRPC's bare deserialization error), replies written by ``codec.serialize``.
    The bytes are the protobuf encoding of ps.proto, so generated stubs interoperate."""
    return grpc.method_handlers_generic_handler(SERVICE, {
        m: grpc.unary_unary_rpc_method_handler(_make_handler(core, m),
                                               request_deserializer=codec.parser(codec.REQUEST[m]),
                                               response_serializer=codec.serialize)
        for m in METHODS})


def serve(core: PSServer, host: str = "127.0.0.1", port: int = 0, threads: int = 8,
          max_concurrent_rpcs: int = 0, security=None, interceptors=(),
          dead_after_s: float = 30.0) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``core`` on host:port (port 0: a free port). Returns (server, port).

    ``security`` (``engine.security.credentials.ServerSecurity``, None: plaintext without tokens):
    with TLS the port is a TLS port whose certificate is re-read when its files change; with tokens an
    ``AuthInterceptor`` checks every call's bearer token before any handler runs (``ADMIN_METHODS``,
    forced dense re-initialisations and dense state sets need the admin token). Requests over
    ``core.max_message_bytes`` are refused by gRPC with RESOURCE_EXHAUSTED before they are parsed.

    ``threads`` RPC threads serve the calls; at most half of them linger in barrier polls, so arrivals
    and other requests always find one. ``max_concurrent_rpcs`` (``server.max_concurrent_rpcs``; 0 =
    unlimited) bounds the calls accepted at once: gRPC answers the excess RESOURCE_EXHAUSTED, which
    clients back off from and retry. ``interceptors`` run before the token check (the Prometheus
    ``engine.observability.prometheus.RpcMetricsInterceptor``, which so counts refused calls too).
    ``dead_after_s`` (seconds, ``client.dead_after_s``): the server accepts its clients' keepalive pings
    and pings them too, closing a connection from a host that went silent after about that long
    (``keepalive.server_keepalive_options``).

    Raises
    ------
    RuntimeError
        The address could not be bound.
    """
    budgeted = any(h.config.memory_bytes for h in core.sparse.values())
    _malloc.tune(budgeted=budgeted)
    if budgeted:
        _malloc.start_trimming()
    core.barriers.max_lingering = max(0, threads // 2)
    interceptors = list(interceptors)
    if security is not None and security.tokens is not None:
        from ..security.interceptor import AuthInterceptor
        core.auth = AuthInterceptor(security.tokens, ADMIN_METHODS, name=f"server {core.index}/{core.num_servers}",
                                    admin_request={m: (lambda req, m=m: admin_reason(m, req))
                                                   for m in ("Dense", "Fence", "Clock")})
        interceptors.append(core.auth)
    server = grpc.server(ThreadPoolExecutor(threads, thread_name_prefix=f"ps{core.index}-rpc"),
                         interceptors=interceptors,
                         options=[("grpc.max_send_message_length", core.max_message_bytes),
                                  ("grpc.max_receive_message_length", core.max_message_bytes),
                                  ("grpc.so_reuseport", 0), *server_keepalive_options(dead_after_s)],
                         maximum_concurrent_rpcs=max_concurrent_rpcs or None)
    server.add_generic_rpc_handlers((generic_handler(core),))
    creds = security.credentials() if security is not None else None
    try:
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)
    except RuntimeError as e:
        raise RuntimeError(f"server {core.index}: cannot bind {host}:{port}: {e}") from None
    if bound == 0:
        raise RuntimeError(f"server {core.index}: cannot bind {host}:{port}")
    server.start()
    log.info("server %d/%d listening on %s:%d (%s%s)", core.index, core.num_servers, host, bound,
             "TLS" if creds is not None else "plaintext", ", tokens" if core.auth is not None else "")
    return server, bound

