"""The servers accept their clients' keepalive pings (``engine.ps.keepalive``): a real gRPC server and an
idle channel pinging every second keep their connection. With a misspelt server option (gRPC ignores
unknown names) the server kept its default of one ping per 5 minutes and answered the third ping with
GOAWAY "too_many_pings" after 3 s: every idle connection was dropped, and the client doubled its ping
interval, so a silent server was found later than ``client.dead_after_s`` promises."""
from __future__ import annotations

import threading
import time

import grpc

from engine.ps import PSServer, serve
from engine.ps import ps_pb2 as pb
from engine.ps.keepalive import keepalive_options, keepalive_times
from sparse_tables import TableConfig


def test_an_idle_client_pinging_every_second_keeps_its_connection():
    dead_after_s = 6.0
    assert keepalive_times(dead_after_s)[0] == 1.0
    core = PSServer({"e": TableConfig(dim=2)}, index=0, num_servers=1, num_vshards=16)
    server, port = serve(core, "127.0.0.1", 0, dead_after_s=dead_after_s)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=keepalive_options(dead_after_s))
    states: list[grpc.ChannelConnectivity] = []
    ready = threading.Event()

    def seen(state: grpc.ChannelConnectivity) -> None:
        states.append(state)
        if state == grpc.ChannelConnectivity.READY:
            ready.set()

    channel.subscribe(seen, try_to_connect=True)
    try:
        health = channel.unary_unary("/engine.ps.ParameterServer/Health",
                                     request_serializer=pb.Empty.SerializeToString,
                                     response_deserializer=pb.JsonResponse.FromString)
        health(pb.Empty(), timeout=10)
        assert ready.wait(10)
        time.sleep(5.0)            # 5 pings without data; the default policy hangs up at the third
        after = states[states.index(grpc.ChannelConnectivity.READY):]
        assert after == [grpc.ChannelConnectivity.READY], [s.name for s in states]
        health(pb.Empty(), timeout=10)
    finally:
        channel.unsubscribe(seen)
        channel.close()
        server.stop(0)
        core.close()
