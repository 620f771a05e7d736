"""Fault injection for the PS protocol: a real gRPC proxy on 127.0.0.1 that forwards every call to a
server and, for calls chosen by a rule, throws the server's reply away and answers UNAVAILABLE, as a
connection lost after the server applied the request would. The request bytes reach the server
unchanged, so a retry carries the same request id."""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from engine.ps import codec
from engine.ps import ps_pb2 as pb
from engine.ps.protocol import METADATA_KEY
from engine.ps.protocol import metadata as protocol_metadata
from engine.ps.server import METHODS

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
_FORWARDED = (METADATA_KEY, "authorization")


def _identity(b):
    return b


class DroppingProxy:
    """Forward ``engine.ps.ParameterServer`` calls to ``target`` (``host:port``).

    ``drop(method, n)`` -> bool is asked after the server answered the ``n``-th call (0-based, all
    methods counted) of ``method``; True drops the reply (the caller gets UNAVAILABLE). ``dropped``
    counts the replies thrown away, ``forwarded`` every call that reached the server, by method.
    """

    def __init__(self, target: str, drop, threads: int = 16):
        self.drop = drop
        self.dropped: dict[str, int] = {}
        self.forwarded: dict[str, int] = {}
        self._lock = threading.Lock()
        opts = [("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES), ("grpc.enable_retries", 0)]
        self._channel = grpc.insecure_channel(target, options=opts)
        self._server = grpc.server(ThreadPoolExecutor(threads), options=opts)
        handlers = {m: grpc.unary_unary_rpc_method_handler(self._forwarder(m), request_deserializer=_identity,
                                                           response_serializer=_identity) for m in METHODS}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"127.0.0.1:{self.port}"

    def _forwarder(self, method: str):
        call = self._channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_identity,
                                         response_deserializer=_identity)

        def forward(request: bytes, context):
            try:
                # the caller's protocol version and token travel on (engine.ps.protocol)
                md = tuple((k, v) for k, v in context.invocation_metadata() if k in _FORWARDED)
                reply = call(request, timeout=60, metadata=md)
            except grpc.RpcError as e:
                context.abort(e.code(), e.details() or "")
            with self._lock:
                n = self.forwarded.get(method, 0)
                self.forwarded[method] = n + 1
                drop = self.drop(method, n)
                if drop:
                    self.dropped[method] = self.dropped.get(method, 0) + 1
            if drop:
                context.abort(grpc.StatusCode.UNAVAILABLE, "fault injection: reply dropped after the "
                              "server applied the request")
            return reply
        return forward

    def close(self) -> None:
        self._server.stop(0).wait(5)
        self._channel.close()


class ServerClock:
    """A server's clock for tests (``PSServer(clock=...)``): ``time.time()`` plus an offset that
    ``advance(seconds)`` grows, so an expiry pass (``Shrink``, which takes no client time) can be made
    to see rows as old."""

    def __init__(self):
        self.offset = 0.0

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def __call__(self) -> float:
        return time.time() + self.offset


class FailingWrites:
    """A RocksDB store's ``Rdict`` (a builtin type: wrapped, not patched) whose write call number
    ``fail_on`` (1-based; 0: every call) raises ``OSError(message)``; every other call and attribute goes
    to ``real``. ``calls`` counts the write calls."""

    def __init__(self, real, fail_on: int, message: str):
        self.real, self.fail_on, self.message, self.calls = real, fail_on, message, 0

    def write(self, wb, opts):
        self.calls += 1
        if self.fail_on in (0, self.calls):
            raise OSError(self.message)
        self.real.write(wb, opts)

    def __getattr__(self, name):
        return getattr(self.real, name)


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _ProtocolHeader(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Adds this engine's protocol version to every call's metadata, as ``GrpcTransport`` does."""

    @staticmethod
    def _details(d):
        return _Details(d.method, d.timeout, (*(d.metadata or ()), protocol_metadata()), d.credentials,
                        d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def protocol_channel(endpoint: str, **kwargs) -> grpc.Channel:
    """A plaintext channel to a PS server whose raw calls (stubs, ``unary_unary``) carry this engine's
    protocol version (``engine.ps.protocol``), which a server requires of every data request."""
    return grpc.intercept_channel(grpc.insecure_channel(endpoint, **kwargs), _ProtocolHeader())
