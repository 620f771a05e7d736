"""The server interceptor that checks the bearer token before any handler runs.

Every call must carry the gRPC metadata ``authorization: Bearer <token>``:

* missing or wrong token: ``UNAUTHENTICATED``, answered at the call's start: the request is neither
  received nor parsed (a handler that only refuses and reads no message; what gRPC's flow-control
  window holds is all a caller without a token makes the server buffer: measured 2026-11-30, 24
  concurrent 15 MiB requests without a token grew a server's RSS by 50-65 MiB against 190-223 MiB
  when the refusal took the whole request first);
* a worker token on an admin method (``admin_methods``), or on a request that ``admin_request``
  says needs the admin token (a forced dense re-initialisation): ``PERMISSION_DENIED``.

Refusals are counted (``denied``) and logged at most once a second per kind, with the caller's address.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from .credentials import ADMIN, ServerTokens

__all__ = ["AuthInterceptor", "bearer"]

log = logging.getLogger(__name__)


def bearer(metadata) -> bytes | None:
    """The token of an ``authorization: Bearer <token>`` entry of gRPC metadata, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip().encode("latin-1")
            return None
    return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Token check of every call to a server (see the module docstring).

    Parameters
    ----------
    tokens : ServerTokens
    admin_methods : frozenset of str
        Method names (the last part of ``/package.Service/Method``) that need the admin token.
    admin_request : dict of str -> callable(request) -> str or None, optional
        Per method, a check of the parsed request: a reason string when it needs the admin token
        (e.g. ``"Dense: a forced re-initialisation"``), else None.
    name : str
        Who refuses, for messages (``server 1/2``).
    """

    def __init__(self, tokens: ServerTokens, admin_methods: frozenset, *,
                 admin_request: dict[str, Callable] | None = None, name: str = "server"):
        self.tokens, self.admin_methods = tokens, frozenset(admin_methods)
        self.admin_request = dict(admin_request or {})
        self.name = name
        self.denied = {"UNAUTHENTICATED": 0, "PERMISSION_DENIED": 0}
        self._logged: dict[str, float] = {}
        self._lock = threading.Lock()

    def _deny(self, code: grpc.StatusCode, message: str):
        def refuse(request_iterator, context):
            with self._lock:
                self.denied[code.name] += 1
                now = time.monotonic()
                if now - self._logged.get(code.name, 0.0) > 1.0:
                    self._logged[code.name] = now
                    log.warning("%s: %s from %s: %s", self.name, code.name, context.peer(), message)
            context.abort(code, f"[{self.name}] {message}")
        # a request-streaming handler: gRPC calls it at the call's start, before any message arrives, and
        # it never reads one (a unary handler is called only once the whole request, up to
        # server.max_message_bytes, has been received and buffered); no deserializer either
        return grpc.stream_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, details):
        method = details.method.rsplit("/", 1)[-1]
        token = bearer(details.invocation_metadata)
        role = self.tokens.role(token)
        if role is None:
            why = "no bearer token" if token is None else "a wrong bearer token"
            return self._deny(grpc.StatusCode.UNAUTHENTICATED,
                              f"{method}: {why}; send the metadata 'authorization: Bearer <token>' with the "
                              f"cluster's token (security.token_file or security.token_env)")
        if role != ADMIN and method in self.admin_methods:
            return self._deny(grpc.StatusCode.PERMISSION_DENIED,
                              f"{method} needs the admin token (security.admin_token_file or "
                              f"admin_token_env), held by the launcher and worker rank 0; this call "
                              f"carried the worker token")
        handler = continuation(details)
        check = self.admin_request.get(method)
        if role == ADMIN or check is None or handler is None:
            return handler

        def refused(request, context) -> None:
            reason = check(request)
            if reason:
                with self._lock:
                    self.denied["PERMISSION_DENIED"] += 1
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"[{self.name}] {reason} needs the admin token; this call carried the worker token")
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def guarded(request, context):
                refused(request, context)
                return inner(request, context)
            return handler._replace(unary_unary=guarded)
        if handler.stream_unary is not None:    # the PS handlers read their one message themselves
            inner_stream = handler.stream_unary

            def guarded_stream(request_iterator, context):
                def checked():
                    for request in request_iterator:
                        refused(request, context)
                        yield request
                return inner_stream(checked(), context)
            return handler._replace(stream_unary=guarded_stream)
        return handler
