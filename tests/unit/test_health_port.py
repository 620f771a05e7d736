"""The plaintext health port (``engine.ps.health.HealthPort``) through real gRPC channels: calls that
send their headers and never their request, and Watch streams held open, by a caller with no
credentials at all, do not keep a probe's Check from being answered (a pool of two threads was held by
two such calls, and every probe timed out: a liveness probe restarted a healthy server)."""
from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.ps.health import LIVENESS, SERVICE, HealthPort


def check(port: int, service: str = "", timeout: float = 3.0) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


@pytest.fixture
def port():
    p = HealthPort("127.0.0.1", 0, live_services=(LIVENESS,))
    yield p
    p.close()


def test_stalled_calls_and_watch_streams_do_not_starve_the_probe(port):
    port.set(True)
    hold = threading.Event()

    def never():            # a request stream that never sends its message
        hold.wait()
        return
        yield

    channels, calls = [], []
    try:
        for i in range(8):
            ch = grpc.insecure_channel(f"127.0.0.1:{port.port}")
            channels.append(ch)
            stalled = ch.stream_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
            calls.append(stalled.future(never()))
            calls.append(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=LIVENESS)))
        assert check(port.port, LIVENESS) == "SERVING"       # a kubelet's probe: answered at once
        port.set(False, live=True)                           # preempting: unready, alive
        assert check(port.port) == "NOT_SERVING" and check(port.port, SERVICE) == "NOT_SERVING"
        assert check(port.port, LIVENESS) == "SERVING"
    finally:
        hold.set()
        for c in calls:
            c.cancel()
        for ch in channels:
            ch.close()


def test_set_from_many_threads_ends_at_the_last_status(port):
    """The role's loop and a worker's liveness check push from their own threads into the port's loop."""
    def flip(n):
        for i in range(50):
            port.set(i % 2 == 0, live=True)
    threads = [threading.Thread(target=flip, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    port.set(True)
    assert check(port.port) == "SERVING" and check(port.port, LIVENESS) == "SERVING"
    port.set(False, live=False)
    assert check(port.port, LIVENESS) == "NOT_SERVING"


def test_closed_it_answers_nothing_and_close_twice_is_harmless(port):
    number = port.port
    port.close()
    port.close()
    with pytest.raises(grpc.RpcError) as e:
        check(number, timeout=2)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
