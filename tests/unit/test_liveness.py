"""A role-mode worker's liveness port (``engine.liveness``), through a real gRPC health channel: SERVING
in its start-up, while it steps and inside an announced phase within its deadline; NOT_SERVING once its
start-up, its loop or a phase stalls past the rule (``progress.stalled``), and SERVING again when it
moves; nothing at all once closed."""
from __future__ import annotations

import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import progress
from engine.liveness import WorkerLiveness


def status(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


@pytest.fixture
def live():
    made = []

    def make(reporter, dead_after_s):
        made.append(WorkerLiveness(reporter, "127.0.0.1", 0, dead_after_s, "worker 1"))
        return made[-1]
    yield make
    for w in made:
        w.close()


def test_serving_while_it_steps_and_not_once_the_loop_stalls(live, caplog):
    reporter = progress.Progress(None, startup_s=1.0)
    w = live(reporter, 1.0)
    assert status(w.port) == "SERVING"                     # start-up, within its deadline
    time.sleep(1.1)
    with caplog.at_level(logging.ERROR, "engine.liveness"):
        assert "'start-up' has run" in w.check()
    assert status(w.port) == "NOT_SERVING"
    reporter.step(256)
    assert w.check() is None and status(w.port) == "SERVING"
    time.sleep(1.1)                                        # no step: a hang
    assert "no training step for" in w.check() and status(w.port) == "NOT_SERVING"
    assert w.check() and caplog.text.count("liveness NOT_SERVING") == 2    # once per stall, not at every look
    with reporter.phase("checkpoint at 0:8", 2.0):         # a phase with its own deadline
        assert w.check() is None and status(w.port) == "SERVING"
        time.sleep(2.1)
        assert "'checkpoint at 0:8' has run" in w.check() and status(w.port) == "NOT_SERVING"
    assert w.check() is None                               # the phase ended: the loop resumes now


def test_the_watch_thread_updates_the_status_without_being_asked(live):
    reporter = progress.Progress(None)
    reporter.step()
    w = live(reporter, 0.2)
    deadline = time.monotonic() + 10
    while status(w.port) == "SERVING" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status(w.port) == "NOT_SERVING" and "no training step" in w.why


def test_closed_it_answers_nothing(live):
    w = live(progress.Progress(None), 5)
    port = w.port
    w.close()
    with pytest.raises(grpc.RpcError) as e:
        status(port)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_a_port_in_use_is_refused_naming_it(live):
    """gRPC binds with SO_REUSEPORT by default: a second worker on the same port would have split the
    probes with the first, each answering for the other."""
    w = live(progress.Progress(None), 5)
    with pytest.raises(RuntimeError, match=f"cannot bind 127.0.0.1:{w.port}"):
        WorkerLiveness(progress.Progress(None), "127.0.0.1", w.port, 5, "worker 2")


def test_a_worker_waiting_inside_a_bounded_call_is_not_stalled(live):
    """A server that froze holds the worker's calls: the worker finds it itself within the call's bound
    (and exits 76, not counted by a Job's backoffLimit); a liveness restart must not come first. Past
    the bound it is stalled again; after a long call the stall is measured from the call's end."""
    from engine.ps import inflight
    calls = inflight.InFlight()
    reporter = progress.Progress(None)
    reporter.step()
    w = WorkerLiveness(reporter, "127.0.0.1", 0, 0.5, "worker 0", in_flight=calls)
    try:
        token = calls.enter(1, "Pull", 1.5)
        time.sleep(0.7)
        assert w.check() is None and status(w.port) == "SERVING"
        assert w.waiting.startswith("Pull to server 1 for ")
        time.sleep(1.0)                                     # past the call's bound: a hang inside it
        assert "no training step" in w.check() and status(w.port) == "NOT_SERVING"
        calls.exit(token)                                   # it returned (a long call): the loop resumes
        assert calls.long_call_ended > 0 and w.check() is None
        time.sleep(0.6)
        assert "no training step" in w.check()              # and stalls again with no step after it
        short = calls.enter(0, "Push", 60)
        calls.exit(short)                                   # a short call is not a wait: still stalled
        assert w.check() and calls.waiting() is None
    finally:
        w.close()


def test_the_start_up_deadline_counts_outside_the_phases_announced_inside_it():
    """A role-mode worker's start-up announces its long waits (the servers, their agreement, a roll-back):
    when one ends, the start-up's deadline runs again from there, so a long roll-back is not followed by
    a NOT_SERVING start-up the moment it ends."""
    reporter = progress.Progress(None, startup_s=1.0)
    with reporter.phase("roll-back to X", 60):
        time.sleep(1.2)
        assert progress.stalled(reporter.report(), time.time(), 1.0, 0.0) is None
    assert progress.stalled(reporter.report(), time.time(), 1.0, 0.0) is None
    time.sleep(1.1)
    assert "'start-up' has run 1s" in progress.stalled(reporter.report(), time.time(), 1.0, 0.0)
