"""``CallGuard``: every call of a PS gRPC server from its start to its end, and a reaper that cancels the
calls whose bytes stall on the wire.

A sync gRPC server gives a call one of its RPC threads (``cluster.server_threads``) from the call's
start: the thread waits for the request message, then runs the handler. A caller that sent a call's
headers and never its message (a stalled or hostile client: one with the worker token, or anyone on a
loopback server without tokens) held that thread for as long as it kept its connection open, and
``server_threads`` such calls made every other client's calls time out, with nothing logged and the
watchdog blind (``engine.ps.watchdog`` sees handlers, and none was entered). Likewise a reply the caller
never read (HTTP/2 flow control) stayed in the server's memory until the connection closed.

The rule: a call whose request message has not arrived ``bound_s`` seconds after it started, or whose
reply has not been taken ``bound_s`` seconds after its handler returned, is cancelled (its thread, or
its reply's memory, is freed), counted in ``cancelled`` (``Stats``: ``calls_cancelled``) and logged with
its peer (one line a second at most). ``bound_s`` is ``client.timeout_s``: a client's own call ends at its
deadline before that, so no client that waits for its answer is cancelled. The time a handler runs is
not bounded here (that is the watchdog's).

What remains (README "Bounded requests"): each stalled call holds an RPC thread for up to ``bound_s``,
so a caller that keeps opening them (it needs the worker token when tokens are configured) can still
delay everybody else's calls while it does so: it is named in the log. Replies held unread are at most
``server.max_concurrent_rpcs`` calls of at most ``server.max_message_bytes`` each, each for ``bound_s``.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

from sparse_tables._warn import WarnGate

__all__ = ["CallGuard"]

log = logging.getLogger("engine.ps.server")

#: the phases of a call the guard bounds (``handling``: the handler runs, the watchdog's)
_REQUEST, _HANDLING, _REPLY = "request", "handling", "reply"


def _peer(context) -> str:
    try:
        return context.peer() or "an unknown peer"
    except Exception:  # noqa: BLE001 - a call gone meanwhile: the line is still worth it
        return "an unknown peer"


class CallGuard:
    """The calls of one server (see the module docstring). ``start`` at a call's start (in its handler,
    before the request is read), ``received`` once its request is read, ``replied`` when its handler
    returns or fails; the call's end (gRPC's callback) forgets it. ``reap`` cancels the late ones; ``run``
    reaps every ``period_s`` seconds until its event is set. Any thread.

    Parameters
    ----------
    bound_s : float, seconds, > 0
        How long a call may wait for its request message, and its reply for its reader.
    name : str
        Who cancels, for the log (``server 0/2``).
    period_s : float, seconds
        Time between two reaps in ``run``.
    clock : callable returning float seconds, optional
        Monotonic time (default ``time.monotonic``).

    Raises
    ------
    ValueError
        ``bound_s`` is not positive.
    """

    def __init__(self, bound_s: float, name: str = "server", period_s: float = 1.0, clock=time.monotonic):
        if not bound_s > 0:
            raise ValueError(f"bound_s must be > 0 seconds, got {bound_s!r}")
        self.bound_s, self.name, self.period_s, self.clock = float(bound_s), name, float(period_s), clock
        self.cancelled = {_REQUEST: 0, _REPLY: 0}       # calls cancelled, by what they stalled on
        self._calls: dict[int, list] = {}               # token -> [since, phase, method, context]
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._gate = WarnGate()                         # one line a second at most

    def start(self, method: str, context) -> int:
        """A call of ``method`` started (``context``: its ``grpc.ServicerContext``); returns its token."""
        token = next(self._tokens)
        with self._lock:
            self._calls[token] = [self.clock(), _REQUEST, method, context]
        if not context.add_callback(lambda: self._end(token)):     # it ended already
            self._end(token)
        return token

    def received(self, token: int) -> None:
        """The call's request was read: its handler runs (unbounded here)."""
        with self._lock:
            call = self._calls.get(token)
            if call is not None:
                call[1] = _HANDLING

    def replied(self, token: int) -> None:
        """The call's handler returned or failed: its reply (or status) is on its way to the caller."""
        with self._lock:
            call = self._calls.get(token)
            if call is not None:
                call[0], call[1] = self.clock(), _REPLY

    def _end(self, token: int) -> None:
        with self._lock:
            self._calls.pop(token, None)

    def in_flight(self) -> dict[str, int]:
        """Calls now waiting for their request, being handled, and waiting for their reply to be taken."""
        with self._lock:
            phases = [c[1] for c in self._calls.values()]
        return {p: phases.count(p) for p in (_REQUEST, _HANDLING, _REPLY)}

    def reap(self) -> int:
        """Cancel every call that waited ``bound_s`` for its request or for its reply's reader; returns
        how many were cancelled."""
        now = self.clock()
        with self._lock:
            late = [(tok, c) for tok, c in self._calls.items() if c[1] != _HANDLING and now - c[0] > self.bound_s]
            for tok, c in late:
                del self._calls[tok]
                self.cancelled[c[1]] += 1
        named = []
        for _, (since, phase, method, context) in late:
            if len(named) < 3:          # the address before the cancel (a cancelled call has none)
                named.append(f"{method} from {_peer(context)} "
                             f"({'no request' if phase == _REQUEST else 'reply unread'} for {now - since:.0f}s)")
            context.cancel()
        if late:
            self._log(len(late), named)
        return len(late)

    def _log(self, n: int, named: list[str]) -> None:
        total = self._gate.add(n, 1.0)
        if not total:
            return
        more = total - n
        log.warning("%s: cancelled %d call(s) whose caller sent no request message or read no reply within "
                    "client.timeout_s = %gs (each held an RPC thread or its reply's memory): %s%s", self.name, n,
                    self.bound_s, ", ".join(named) + (", ..." if n > len(named) else ""),
                    f"; {more} more cancelled since the last such line" if more else "")

    def run(self, stop: threading.Event) -> None:
        """Reap every ``period_s`` seconds until ``stop`` is set (a server's daemon thread)."""
        while not stop.wait(self.period_s):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad call
                log.exception("%s: the call reaper failed once", self.name)
