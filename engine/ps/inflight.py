"""The calls a client has in flight to its servers, for a liveness check (``engine.liveness``).

A worker waiting on a server that stopped answering (frozen, or its host lost) is not hung: each of its
calls has a bound (``PSClient._call``: ``timeout_s`` x (``retries`` + 1) and the back-off), after which
it raises ``ShardUnavailableError`` or ``PSTimeoutError`` and the worker exits for its restart by the
recovery rule. A liveness probe that restarted it first would count a server's failure against the
worker (Kubernetes' ``backoffLimit``), so the liveness check asks this registry whether the process is
inside such a call.
"""
from __future__ import annotations

import itertools
import time

#: a call that lasted this long (seconds) counts as a wait: the loop resumes from its end (a shorter one
#: does not, so background pushes that go on after the training loop hung do not hide the hang)
LONG_CALL_S = 1.0


class InFlight:
    """Calls in flight: ``enter`` before a call, ``exit`` after it (any thread; no lock: one dict
    store or delete each, atomic under the GIL)."""

    def __init__(self):
        self._calls: dict[int, tuple[float, float, int, str]] = {}
        self._tokens = itertools.count()
        #: monotonic seconds when the last call of at least ``LONG_CALL_S`` ended (0: none yet)
        self.long_call_ended = 0.0

    def enter(self, server: int, method: str, bound_s: float) -> int:
        """Register a call to ``server`` that ends within ``bound_s`` seconds; returns its token."""
        token = next(self._tokens)
        self._calls[token] = (time.monotonic(), float(bound_s), server, method)
        return token

    def exit(self, token: int) -> None:
        """The call of ``token`` (``enter``) returned or raised."""
        now = time.monotonic()
        if now - self._calls.pop(token)[0] >= LONG_CALL_S:
            self.long_call_ended = now

    def waiting(self) -> str | None:
        """The oldest call in flight still within its bound, described (``Pull to server 1 for 12s, at
        most 365s``), or None."""
        now = time.monotonic()
        live = [c for c in self._calls.copy().values() if now - c[0] <= c[1]]
        if not live:
            return None
        started, bound, server, method = min(live)
        return f"{method} to server {server} for {now - started:.0f}s, at most {bound:.0f}s"
