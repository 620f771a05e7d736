"""Which servers this host reaches now: the diagnosis a worker prints when it loses a server.

A worker that gives a server up (``ShardUnavailableError``: silent past ``client.dead_after_s`` and the
retries) named only that server. Across hosts the cause is often elsewhere: this host's own link went
down (then every server fails, and the first one named was blamed), or only the path between this host
and that server failed while every other role still reaches it (an asymmetric partition: the server is
alive). ``probe`` asks every server's ``Health`` once, over fresh connections (the client's own
channels may sit in gRPC's reconnect back-off after a failure and fail at once though the network is
back), and ``describe`` turns the answers into one sentence that says which of these it is.
"""
from __future__ import annotations

import threading

from ..errors import RemoteError
from . import ps_pb2 as pb
from .transport import GrpcTransport, Transport


def probe(transport: Transport, timeout_s: float) -> list[str | None]:
    """Ask every server of ``transport`` for ``Health`` once, concurrently, each within ``timeout_s``
    seconds -> per server rank, None when it answered, else the error (``"CODE: message"``).

    Over gRPC the calls go on new channels with no retry (the same endpoints and security), closed
    before this returns; an ``InProcessTransport`` is called as it is. Never raises for a server's
    failure; returns within about ``timeout_s`` seconds."""
    fresh = isinstance(transport, GrpcTransport)
    t = GrpcTransport(transport.endpoints, retries=0, security=transport.security,
                      dead_after_s=max(timeout_s, 1.0)) if fresh else transport
    out: list[str | None] = [None] * t.num_servers

    def ask(s: int) -> None:
        try:
            t.call(s, "Health", pb.Empty(request_id=f"reach-probe.{s}"), timeout_s)
        except RemoteError as e:
            out[s] = f"{e.code}: {e.message}"
        except Exception as e:  # noqa: BLE001 - a diagnosis: any failure is the answer
            out[s] = f"{type(e).__name__}: {e}"
    threads = [threading.Thread(target=ask, args=(s,), daemon=True, name=f"reach-probe-{s}")
               for s in range(t.num_servers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout_s + 5.0)
    for s, th in enumerate(threads):
        if th.is_alive():
            out[s] = f"DEADLINE_EXCEEDED: no answer within {timeout_s:g}s"
    if fresh:
        t.close()
    return out


def describe(endpoints: list[str], lost: str, reach: list[str | None]) -> str:
    """One sentence on where the failure lies, from ``probe``'s answers ``reach`` (per server rank) just
    after this host lost server ``lost`` (its endpoint):

    - no server answers: this host's own network, or every server's host, failed (and this host's own
      link or route when an error says "Network is unreachable": no route at all here); not ``lost`` alone;
    - ``lost`` fails while others answer: the path between this host and it (a partial partition; the
      server may be alive and serving the others);
    - ``lost`` answers again: the failure was transient.
    Servers that fail besides ``lost`` are listed with their errors."""
    failing = [(endpoints[s], why) for s, why in enumerate(reach) if why is not None]
    answering = [endpoints[s] for s, why in enumerate(reach) if why is None]
    # gRPC puts the cause last ("... error: Network is unreachable"): a long error keeps its end
    listed = "; ".join(f"{ep}: {why if len(why) <= 160 else '...' + why[-120:]}" for ep, why in failing)
    if lost not in endpoints:           # no one server was named (a fan-out's own timeout)
        if not failing:
            return "every server answers from this host now"
        if answering:
            return (f"from this host now, {', '.join(ep for ep, _ in failing)} fail(s) while "
                    f"{', '.join(answering)} answer(s) ({listed})")
        lost = "any one of them"
    if not answering:
        if any("Network is unreachable" in why for _, why in failing):
            return (f"no server answers from this host now, and this host has no route to them ({listed}): "
                    f"this host's own link or route is down, not server {lost} alone")
        if len(endpoints) == 1:
            return f"it does not answer from this host now ({listed})"
        return (f"no server answers from this host now ({listed}): this host's own network, or every server's "
                f"host, failed; not server {lost} alone")
    if any(ep == lost for ep, _ in failing):
        others = [ep for ep, _ in failing if ep != lost]
        return (f"server {lost} is unreachable from this host while {', '.join(answering)} answer"
                + ("s" if len(answering) == 1 else "")
                + (f" (also failing: {', '.join(others)})" if others else "")
                + ": a network failure between this host and it, or that server's host is down "
                  "(it may still serve the other roles)")
    return (f"server {lost} answers again now" + (f" (failing now: {listed})" if failing else "")
            + ": the network failure was transient")
