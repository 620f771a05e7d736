"""Calls that stall on the wire, against a real gRPC PS server (``engine.ps.call_guard``): a caller that
sends a call's headers and never its request held an RPC thread for as long as it kept its connection
open (``server_threads`` of them made every other client time out, with nothing logged), and a reply the
caller never reads (HTTP/2 flow control) stayed in the server's memory until the connection closed. Both
are now cancelled ``client.timeout_s`` after they stalled and logged with the caller's address; refused
requests are logged too, with their caller's address, once a second per status code at most."""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from engine.errors import RemoteError
from engine.ps import PSClient, PSServer, codec, serve
from engine.ps import ps_pb2 as pb
from engine.ps.protocol import metadata as protocol_metadata
from engine.ps.transport import GrpcTransport
from sparse_tables import TableConfig

BOUND_S = 1.0       # the server's client.timeout_s


@pytest.fixture
def server():
    """A PS server with 2 RPC threads whose calls may stall BOUND_S; yields (endpoint, port, core)."""
    core = PSServer({"emb": TableConfig(dim=4, optimizer="sgd", learning_rate=1.0),
                     "wide": TableConfig(dim=256, optimizer="sgd", learning_rate=1.0)},
                    local_shards=2, request_bound_s=BOUND_S)
    srv, port = serve(core, "127.0.0.1", 0, threads=2)
    try:
        yield f"127.0.0.1:{port}", port, core
    finally:
        srv.stop(0).wait()
        core.close()


def test_calls_that_never_send_their_request_are_cancelled_and_named(server, caplog):
    ep, _, core = server
    hold = threading.Event()

    def never():            # headers, then no message
        hold.wait()
        return
        yield

    channel = grpc.insecure_channel(ep)
    stalled = channel.stream_unary("/engine.ps.ParameterServer/Push", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
    try:
        with caplog.at_level(logging.WARNING, "engine.ps.server"):
            calls = [stalled.future(never()) for _ in range(2)]     # both RPC threads
            time.sleep(0.3)
            with PSClient([ep], timeout_s=15, retries=0) as c:      # served once they are cancelled
                t0 = time.monotonic()
                assert c.pull("emb", np.arange(1, 4, dtype=np.uint64)).shape == (3, 4)
                assert time.monotonic() - t0 < 10
                stats = c.stats()[0]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call.result(timeout=10)
            assert e.value.code() == grpc.StatusCode.CANCELLED
        assert stats["calls_cancelled"]["request"] == 2
        line = next(r.getMessage() for r in caplog.records if "cancelled" in r.getMessage())
        assert "Push from ipv4:127.0.0.1:" in line and "no request" in line and "client.timeout_s = 1s" in line
    finally:
        hold.set()
        channel.close()


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(index: int, value: str) -> bytes:
    """An HPACK literal without indexing, its name from the static table (index < 15 + 128)."""
    head = bytes([index]) if index < 15 else bytes([15, index - 15])
    return head + bytes([len(value)]) + value.encode()


def test_a_reply_the_caller_never_reads_is_cancelled(server):
    """A raw HTTP/2 client with a flow-control window of 0 sends a Pull and reads nothing: the server's
    reply (2000 rows of 256 floats, 2 MB) cannot leave. It answers the server's pings, so keepalive keeps
    the connection. The call is cancelled (RST_STREAM) after the bound."""
    ep, port, core = server
    body = codec.serialize(codec.Wire(pb.PullRequest(table="wide", request_id="r@1:1", init_missing=True),
                                      keys=np.arange(2000, dtype=np.uint64)))
    message = b"\x00" + struct.pack(">I", len(body)) + body
    headers = (b"\x83\x86" + _literal(4, "/engine.ps.ParameterServer/Pull") + _literal(1, ep)
               + _literal(31, "application/grpc") + b"\x00\x02te\x08trailers"
               + b"\x00" + b"".join(bytes([len(x)]) + x.encode() for x in protocol_metadata()))   # its version
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, struct.pack(">HI", 4, 0)))  # window 0
        s.sendall(_frame(1, 0x4, 1, headers))
        for off in range(0, len(message), 16384):
            s.sendall(_frame(0, 0x1 if off + 16384 >= len(message) else 0, 1, message[off:off + 16384]))
        buf, reset, deadline = b"", False, time.monotonic() + BOUND_S + 15
        while not reset and time.monotonic() < deadline:
            try:
                data = s.recv(65536)
            except socket.timeout:
                continue
            assert data, "the server closed the connection"
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n, kind, flags, stream = int.from_bytes(buf[:3], "big"), buf[3], buf[4], \
                    int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9:9 + n], buf[9 + n:]
                if kind == 4 and not flags & 1:
                    s.sendall(_frame(4, 1, 0))                      # SETTINGS ack
                elif kind == 6 and not flags & 1:
                    s.sendall(_frame(6, 1, 0, payload))             # PING ack: alive
                elif kind == 3 and stream == 1:
                    reset = True                                    # RST_STREAM: the call is cancelled
    assert reset, "the unread reply was held past the bound"
    with PSClient([ep], timeout_s=10, retries=0) as c:
        assert c.stats()[0]["calls_cancelled"]["reply"] == 1


def test_refused_requests_are_logged_with_the_caller_once_a_second(server, caplog):
    ep, _, core = server
    transport = GrpcTransport([ep], retries=0)
    try:
        with caplog.at_level(logging.WARNING, "engine.ps.server"):
            for i in range(5):
                with pytest.raises(RemoteError):
                    transport.call(0, "Pull", pb.PullRequest(table="nope", request_id=f"w@1:{i}"), 10.0)
            time.sleep(1.1)
            with pytest.raises(RemoteError):
                transport.call(0, "Pull", pb.PullRequest(table="nope", request_id="w@1:9"), 10.0)
    finally:
        transport.close()
    lines = [r.getMessage() for r in caplog.records if "refused NOT_FOUND" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "Pull refused NOT_FOUND to ipv4:127.0.0.1:" in lines[0] and "unknown sparse table 'nope'" in lines[0]
    assert "(4 more NOT_FOUND since the last such line)" in lines[1]
