"""``serve``: the gRPC server of a ``PSServer`` (the ``engine.ps.ParameterServer`` service).

Transport only: requests are parsed by the zero-copy codec and handed to ``PSServer.handle``, whose
``ServerError`` becomes the call's status (refusals are logged with the caller's address); TLS, tokens,
keepalive, message limits, the RPC thread pool and the bound of calls stalled on the wire
(``call_guard``) are set here.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from sparse_tables._warn import WarnGate

from . import _malloc, codec, protocol
from . import ps_pb2 as pb
from .call_guard import CallGuard
from .keepalive import server_keepalive_options
from .server import ADMIN_METHODS, METHODS, PSServer, ServerError, admin_reason

log = logging.getLogger("engine.ps.server")


class _Refusals:
    """Refused requests of one server, logged with their caller's address at most once a second per
    status code (how many were not logged is said on the next line; ``sparse_tables._warn.WarnGate``)."""

    def __init__(self, name: str):
        self.name = name
        self._gates: dict[str, WarnGate] = {}
        self._lock = threading.Lock()

    def note(self, method: str, code: str, message: str, context) -> None:
        with self._lock:
            gate = self._gates.setdefault(code, WarnGate())
        n = gate.add(1, 1.0)
        if n:
            log.warning("%s: %s refused %s to %s: %s%s", self.name, method, code, context.peer(), message[:400],
                        f" ({n - 1} more {code} since the last such line)" if n > 1 else "")


def _make_handler(core: PSServer, method: str, guard: CallGuard | None, refusals: _Refusals):
    # request-streaming: gRPC calls it at the call's start, before the request arrives, so the guard sees
    # a call that never sends it (a unary handler's thread waits for the message unseen)
    def handler(request_iterator, context):
        token = guard.start(method, context) if guard is not None else None
        try:
            request = next(request_iterator, None)
            if request is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} requires exactly one request message")
            if token is not None:
                guard.received(token)
            if (why := protocol.refusal(method, context.invocation_metadata())) is not None:
                raise ServerError("FAILED_PRECONDITION", why)   # another engine version: nothing applied
            return core.handle(method, request)
        except ServerError as e:
            refusals.note(method, e.code, str(e), context)
            context.abort(getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL), str(e))
        finally:
            if token is not None:
                guard.replied(token)
    handler.__name__ = method
    return handler


SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name


def method_paths() -> list[str]:
    """The full path (``/engine.ps.ParameterServer/Pull``...) of every method a server serves."""
    return [f"/{SERVICE}/{m}" for m in METHODS]


def generic_handler(core: PSServer, guard: CallGuard | None = None) -> grpc.GenericRpcHandler:
    """The ``engine.ps.ParameterServer`` service of ``core`` with the zero-copy codec: requests are
    parsed by ``codec.parse`` (a malformed one reaches ``handle`` and gets INVALID_ARGUMENT with its
    context instead of gRPC's bare deserialization error), replies written by ``codec.serialize``.
    The bytes are the protobuf encoding of ps.proto, so generated stubs interoperate. The handlers
    read the one request message of each call themselves (request-streaming handlers), so that
    ``guard`` (``call_guard.CallGuard``) sees every call from its start; refused requests are logged
    with their caller's address, once a second per status code at most."""
    refusals = _Refusals(f"server {core.index}/{core.num_servers}")
    return grpc.method_handlers_generic_handler(SERVICE, {
        m: grpc.stream_unary_rpc_method_handler(_make_handler(core, m, guard, refusals),
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
    (``keepalive.server_keepalive_options``). A call whose request has not arrived, or whose reply has
    not been read, ``client.timeout_s`` (``core.watchdog.request_bound_s``) after it started or was
    answered is cancelled and logged with its caller's address (``core.call_guard``, a
    ``call_guard.CallGuard`` reaped by a daemon thread until ``core.stopped``): each such call holds an
    RPC thread, or its reply's memory, at most that long.

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
    # a call that never sends its request, or never reads its reply, is cancelled after client.timeout_s
    core.call_guard = CallGuard(core.watchdog.request_bound_s, f"server {core.index}/{core.num_servers}")
    threading.Thread(target=core.call_guard.run, args=(core.stopped,), name=f"ps{core.index}-calls",
                     daemon=True).start()
    server.add_generic_rpc_handlers((generic_handler(core, core.call_guard),))
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

