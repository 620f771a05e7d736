"""Transports: how a PSClient reaches server ``i``. One interface, two implementations.

``Transport.call(server, method, request, timeout)`` sends one protobuf request to server ``server``
(its rank) and returns the reply, or raises ``RemoteError(code, message, endpoint)`` with the gRPC
status code name. It blocks for at most ``timeout`` seconds (gRPC deadline) and is thread-safe.

Requests are protobuf messages or ``codec.Wire`` (a message plus numpy arrays); replies of methods
with arrays (Pull, Dense) come back as ``codec.Received``, read like the message, whose Tensor fields
``codec.decode`` views without copying.

- ``GrpcTransport(endpoints)``: real servers at ``host:port`` (one channel per server), with the
  zero-copy codec (``codec.serialize`` / ``codec.parse``) as gRPC (de)serializers. UNAVAILABLE is
  retried by gRPC itself (the channel's service-config retry policy, exponential back-off, up to
  ``GRPC_MAX_ATTEMPTS`` attempts), resending the same bytes, so a retry keeps its request id and the
  server's reply window answers it without applying it twice.
  With ``security`` (``engine.security.credentials.ClientSecurity``) the channels use TLS (reopened
  when the certificate files change) and every call carries ``authorization: Bearer <token>``: the
  admin token on admin methods when this role holds it.
  Channels ping their server (HTTP/2 keepalive, ``keepalive_options``) so a connection to a host that
  went silent (powered off, its network cut: no RST ever arrives) is closed after about ``dead_after_s``
  seconds of silence; its calls then fail UNAVAILABLE and are retried on a new connection, to the address the
  server's name resolves to then (a replacement), instead of waiting on the dead one until their deadline.
- ``InProcessTransport(servers)``: ``PSServer`` objects in this process, no sockets; requests and
  replies go through the same codec by default, so unit tests exercise the same bytes.
"""
from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod

import grpc

from ..errors import RemoteError
from . import _malloc, codec
from . import ps_pb2 as pb
from .keepalive import keepalive_options
from .protocol import metadata as _protocol_metadata
from .server import ADMIN_METHODS, METHODS, PSServer, ServerError, admin_reason

_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
_SERVICE = "/" + _SERVICE_NAME + "/"
_PROTOCOL_MD = (_protocol_metadata(),)
#: gRPC refuses retry policies of more than 5 attempts
GRPC_MAX_ATTEMPTS = 5


def retry_service_config(attempts: int, backoff_s: float, max_backoff_s: float) -> str:
    """The channel's service config (JSON): retry UNAVAILABLE ``attempts`` times in all (2..5), with
    exponential back-off from ``backoff_s`` to ``max_backoff_s`` seconds (gRPC's A6 retry design)."""
    policy = {"maxAttempts": max(2, min(GRPC_MAX_ATTEMPTS, attempts)),
              "initialBackoff": f"{max(backoff_s, 0.001):.3f}s",
              "maxBackoff": f"{max(max_backoff_s, backoff_s, 0.001):.3f}s",
              "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    return json.dumps({"methodConfig": [{"name": [{"service": _SERVICE_NAME}], "retryPolicy": policy}]})


class Transport(ABC):
    """Reaches the servers of one cluster, addressed by rank. ``attempts_per_call``: how many attempts
    one ``call`` already makes on UNAVAILABLE (gRPC's own retries), so callers retry only beyond it."""

    endpoints: list[str]
    attempts_per_call: int = 1

    @property
    def num_servers(self) -> int:
        return len(self.endpoints)

    @abstractmethod
    def call(self, server: int, method: str, request, timeout: float):
        """Send ``request`` to ``method`` on server ``server``; raises RemoteError."""

    def close(self) -> None:
        """Release channels (idempotent)."""


class GrpcTransport(Transport):
    """gRPC channels to ``endpoints`` (``["host:port", ...]`` in server-rank order).

    ``retries`` (UNAVAILABLE), ``backoff_s`` and ``max_backoff_s`` (seconds) set gRPC's retry policy;
    gRPC makes at most ``GRPC_MAX_ATTEMPTS`` attempts per call (``attempts_per_call``).
    ``dead_after_s`` (seconds, ``client.dead_after_s``): a connection whose server stopped answering
    is closed after about that long (``keepalive_options``)."""

    def __init__(self, endpoints: list[str], *, max_message_bytes: int = codec.MAX_MESSAGE_BYTES,
                 retries: int = 4, backoff_s: float = 0.05, max_backoff_s: float = 2.0, security=None,
                 dead_after_s: float = 30.0):
        if not endpoints:
            raise ValueError("GrpcTransport: expected at least one endpoint host:port")
        self.endpoints = list(endpoints)
        self.security = security        # engine.security.credentials.ClientSecurity or None
        if security is not None:
            security.check_endpoints(self.endpoints)    # no token in plaintext off loopback
        _malloc.tune()
        self.attempts_per_call = max(1, min(GRPC_MAX_ATTEMPTS, retries + 1))
        opts = [("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                # a request is retried only while gRPC still holds its bytes: hold whole messages
                ("grpc.per_rpc_retry_buffer_size", max_message_bytes + (1 << 20)),
                *keepalive_options(dead_after_s)]
        if self.attempts_per_call > 1:
            opts += [("grpc.enable_retries", 1),
                     ("grpc.service_config", retry_service_config(self.attempts_per_call, backoff_s,
                                                                  max_backoff_s))]
        else:
            opts.append(("grpc.enable_retries", 0))
        self._opts = opts
        self._lock = threading.Lock()
        self._retired: list = []
        self._closed = False
        self._version = security.version if security is not None else 0
        self._channels, self._calls = self._open()

    def _open(self):
        creds = self.security.channel_credentials() if self.security is not None else None
        channels = [grpc.secure_channel(ep, creds, options=self._opts) if creds is not None
                    else grpc.insecure_channel(ep, options=self._opts) for ep in self.endpoints]
        calls = [{m: ch.unary_unary(_SERVICE + m, request_serializer=codec.serialize,
                                    response_deserializer=codec.parser(codec.REPLY[m]))
                  for m in METHODS} for ch in channels]
        return channels, calls

    def _rotated(self) -> None:
        """The certificate files changed: new calls go on new channels (new handshakes with the new
        certificate); the channels they replace close at the next rotation or at ``close``, so calls in
        flight on them finish."""
        with self._lock:
            version = self.security.version
            if version == self._version or self._closed:
                return
            for ch in self._retired:
                ch.close()
            self._retired = self._channels
            self._channels, self._calls = self._open()
            self._version = version

    def call(self, server: int, method: str, request, timeout: float):
        md = _PROTOCOL_MD        # every call names its protocol version (``protocol``)
        if self.security is not None:
            if self.security.tls and self.security.version != self._version:
                self._rotated()
            msg = request.msg if isinstance(request, codec.Wire) else request
            md = (*(self.security.metadata(admin=method in ADMIN_METHODS or admin_reason(method, msg) is not None)
                    or ()), *_PROTOCOL_MD)
        try:
            reply = self._calls[server][method](request, timeout=timeout, metadata=md)
        except grpc.RpcError as e:
            code = e.code().name if hasattr(e, "code") and e.code() is not None else "UNKNOWN"
            details = e.details() if hasattr(e, "details") else str(e)
            if code == "UNAVAILABLE" and "Socket closed" in (details or "") and "failed to connect" in details:
                details += self._closed_hint()
            raise RemoteError(code, details or code, self.endpoints[server]) from None
        if getattr(reply, "error", None) is not None:
            raise RemoteError("INTERNAL", f"malformed {method} reply: {reply.error}",
                              self.endpoints[server])
        return reply

    def _closed_hint(self) -> str:
        """Why a server may close a new connection at once: gRPC reports a TLS server refusing this
        client's handshake only as "Socket closed"."""
        if self.security is None or not self.security.tls:
            return ("; a server that closes the connection at once may require TLS, and this client has none "
                    "(security.tls: the servers' CA and, when they verify clients, a client certificate)")
        return ("; a TLS server closes the connection at once when it refuses this client's certificate "
                "(security.tls.client_cert / client_key: signed by another CA than the servers' security.tls.ca?)")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                for ch in self._channels + self._retired:
                    ch.close()




class InProcessTransport(Transport):
    """``PSServer`` objects in this process (index i = rank i). With ``serialize`` (default) every
    request and reply is encoded to bytes and parsed back, as on the wire."""

    def __init__(self, servers: list[PSServer], *, serialize: bool = True):
        self.servers = list(servers)
        self.endpoints = [f"inproc:{i}" for i in range(len(servers))]
        self.serialize = serialize
        self._lock = threading.Lock()

    def call(self, server: int, method: str, request, timeout: float):
        core = self.servers[server]
        if core.stopped.is_set() and method != "Health":
            raise RemoteError("UNAVAILABLE", "server stopped", self.endpoints[server])
        if self.serialize:
            request = codec.parse(codec.serialize(request), codec.REQUEST[method])
        try:
            reply = core.handle(method, request)
        except ServerError as e:
            raise RemoteError(e.code, str(e), self.endpoints[server]) from None
        if self.serialize:
            reply = codec.parse(codec.serialize(reply), codec.REPLY[method])
            if getattr(reply, "error", None) is not None:
                raise RemoteError("INTERNAL", f"malformed {method} reply: {reply.error}",
                                  self.endpoints[server])
        return reply
