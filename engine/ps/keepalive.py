"""HTTP/2 keepalive for the parameter-server channels: how a silent peer is found.

A host that loses power or its network sends no RST: without pings a connection to it stays "ready"
until the kernel gives up on TCP (about 15 minutes), every call on it waits for its deadline, and a
replacement server at a new address is never tried. gRPC core's keepalive (``doc/keepalive.md``,
design A8) closes such a connection; ``GrpcTransport`` and ``serve`` both use it.
"""
from __future__ import annotations

#: shortest keepalive ping interval a channel uses, seconds; servers accept pings twice as often
#: (``server_keepalive_options``), so a ping is never a "ping strike" that makes a server hang up
MIN_KEEPALIVE_S = 1.0
#: longest keepalive ping interval, seconds (a ping is an HTTP/2 frame of 17 bytes)
MAX_KEEPALIVE_S = 10.0
#: shortest wait for a ping's acknowledgement, seconds: gRPC's own threads answer it, but on a loaded
#: machine they can wait seconds for a core, and a live connection closed for that costs its calls a
#: retry (gRPC's default is 20 s)
MIN_ACK_TIMEOUT_S = 10.0


def keepalive_times(dead_after_s: float) -> tuple[float, float]:
    """(ping interval, acknowledgement timeout), seconds, for ``dead_after_s`` (``client.dead_after_s``).

    The interval is ``dead_after_s / 6`` within [``MIN_KEEPALIVE_S``, ``MAX_KEEPALIVE_S``] and the
    timeout the rest of ``dead_after_s``, at least ``MIN_ACK_TIMEOUT_S``: a ping goes out after an
    interval without a frame from the peer, so a connection is given up once its peer has been silent
    for about ``dead_after_s`` (interval + timeout; at least 11 s), and a shorter silence (a network
    that heals, a long pause of the peer's machine) is ridden out, as the launcher's ``Health`` watch
    rides it out. At the default ``dead_after_s`` of 30 s: a ping after 5 s, given up after 25 more."""
    interval = min(MAX_KEEPALIVE_S, max(MIN_KEEPALIVE_S, float(dead_after_s) / 6))
    return interval, max(MIN_ACK_TIMEOUT_S, float(dead_after_s) - interval)


def keepalive_options(dead_after_s: float) -> list[tuple[str, int]]:
    """gRPC channel arguments (gRPC core's keepalive guide, ``doc/keepalive.md``; design A8) that close a
    connection whose peer has been silent for ``dead_after_s`` seconds (``keepalive_times``).

    The pings go on with no call in flight and during a long call whose reply is still coming (a
    restore's ``Load``), which gRPC's default of two pings without data would stop. A live process
    answers pings from gRPC's own threads, without the GIL, so a busy server is not taken for a dead
    one; a stopped one (SIGSTOP) is. After a closed connection the server's name is resolved again
    after at most one ping interval (gRPC's default waits 30 s), so a replacement at a new address is
    found. Servers must accept pings this often (``server_keepalive_options``)."""
    interval, timeout = keepalive_times(dead_after_s)
    return [("grpc.keepalive_time_ms", int(1000 * interval)), ("grpc.keepalive_timeout_ms", int(1000 * timeout)),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.dns_min_time_between_resolutions_ms", int(1000 * interval))]


def server_keepalive_options(dead_after_s: float) -> list[tuple[str, int]]:
    """gRPC server arguments: accept the clients' keepalive pings (``keepalive_options``) down to every
    ``MIN_KEEPALIVE_S / 2`` seconds (gRPC's default, 5 minutes, would answer the pings with GOAWAY
    "too_many_pings" and drop the calls in flight), and ping the clients the same way, so a connection
    from a worker host that went silent is closed after about ``dead_after_s`` instead of held open for the
    kernel's TCP timeout (about 15 minutes) or, idle, for ever."""
    # gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; an unknown name is ignored
    # without a word (the thirty-first session's "min_recv_ping_interval_without_data_ms" was, and idle
    # clients were sent GOAWAY after two pings: tests/unit/test_keepalive.py)
    return keepalive_options(dead_after_s) + [
        ("grpc.http2.min_ping_interval_without_data_ms", int(1000 * MIN_KEEPALIVE_S / 2))]

