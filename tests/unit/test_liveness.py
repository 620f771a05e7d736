"""A role-mode worker's liveness port (``engine.liveness``), through a real gRPC health channel: SERVING
in its start-up, while it steps and inside an announced phase within its deadline; NOT_SERVING once its
start-up, its loop or a phase stalls past the rule (``progress.stalled``), and SERVING again when it
moves; nothing at all once closed.

Time passes by ``elapse``, which moves the report's timestamps back, so that a loaded machine (CI runs
the tests on two busy cores) cannot make a deadline pass between two looks; one test waits for real
time, for the watch thread. For the same reason the liveness judges on an ``AwakeClock`` that never
counts a stall: the process's own clock leaves out the time its ticker thread was starved (1.2 s seen in
CI), which took a second off the 1 s margins of ``elapse`` (``tests/unit/test_awake_clock.py`` tests
that rule)."""
from __future__ import annotations

import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import awake, progress
from engine.liveness import WorkerLiveness
from engine.ps import inflight

DEAD_AFTER_S = 30.0


def status(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def elapse(reporter: progress.Progress, seconds: float, calls: inflight.InFlight | None = None) -> None:
    """As if ``seconds`` passed since every timestamp of the report (and of the calls in flight)."""
    with reporter._lock:
        reporter._state["step_mono"] -= seconds
        for ph in reporter._phases:
            ph["started_mono"] -= seconds
    if calls is not None:
        calls._calls = {t: (c[0] - seconds, *c[1:]) for t, c in calls._calls.items()}
        calls.long_call_ended -= seconds if calls.long_call_ended else 0.0


@pytest.fixture
def live(monkeypatch):
    monkeypatch.setattr(awake, "_clock", awake.AwakeClock(stall_s=float("inf"), start=False))
    made = []

    def make(reporter, dead_after_s=DEAD_AFTER_S, calls=None):
        made.append(WorkerLiveness(reporter, "127.0.0.1", 0, dead_after_s, "worker 1", in_flight=calls))
        return made[-1]
    yield make
    for w in made:
        w.close()


def test_serving_while_it_steps_and_not_once_the_loop_stalls(live, caplog):
    reporter = progress.Progress(None, startup_s=60.0)
    w = live(reporter)
    assert w.check() is None and status(w.port) == "SERVING"          # start-up, within its deadline
    elapse(reporter, 61)
    with caplog.at_level(logging.ERROR, "engine.liveness"):
        assert "'start-up' has run 61s" in w.check()
        assert status(w.port) == "NOT_SERVING"
        reporter.step(256)
        assert w.check() is None and status(w.port) == "SERVING"
        elapse(reporter, 31)                                           # no step: a hang
        assert "no training step for 31s" in w.check() and status(w.port) == "NOT_SERVING"
        assert w.check() and caplog.text.count("liveness NOT_SERVING") == 2    # once per stall, not per look
    reporter.step()
    with reporter.phase("checkpoint at 0:8", 120.0):                   # a phase with its own deadline
        elapse(reporter, 100)
        assert w.check() is None and status(w.port) == "SERVING"
        elapse(reporter, 21)
        assert "'checkpoint at 0:8' has run 121s" in w.check() and status(w.port) == "NOT_SERVING"
    assert w.check() is None                                           # the phase ended: the loop resumes now


def test_the_watch_thread_updates_the_status_without_being_asked(live):
    reporter = progress.Progress(None)
    reporter.step()
    w = live(reporter, dead_after_s=0.2)
    deadline = time.monotonic() + 30
    while status(w.port) == "SERVING" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status(w.port) == "NOT_SERVING" and "no training step" in w.why


def test_closed_it_answers_nothing(live):
    w = live(progress.Progress(None))
    port = w.port
    w.close()
    with pytest.raises(grpc.RpcError) as e:
        status(port)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_a_port_in_use_is_refused_naming_it(live):
    """gRPC binds with SO_REUSEPORT by default: a second worker on the same port would have split the
    probes with the first, each answering for the other."""
    w = live(progress.Progress(None))
    with pytest.raises(RuntimeError, match=f"cannot bind 127.0.0.1:{w.port}"):
        WorkerLiveness(progress.Progress(None), "127.0.0.1", w.port, 5, "worker 2")


def test_a_worker_waiting_inside_a_bounded_call_is_not_stalled(live):
    """A server that froze holds the worker's calls: the worker finds it itself within the call's bound
    (and exits 76, not counted by a Job's backoffLimit); a liveness restart must not come first. Past
    the bound it is stalled again; after a long call the stall is measured from the call's end."""
    calls = inflight.InFlight()
    reporter = progress.Progress(None)
    reporter.step()
    w = live(reporter, calls=calls)
    token = calls.enter(1, "Pull", 365.0)
    elapse(reporter, 40, calls)
    assert w.check() is None and status(w.port) == "SERVING"
    assert w.waiting == "Pull to server 1 for 40s, at most 365s"
    elapse(reporter, 330, calls)                                       # past the call's bound: a hang inside it
    assert "no training step" in w.check() and status(w.port) == "NOT_SERVING"
    calls.exit(token)                                                  # it returned (a long call): the loop resumes
    assert calls.long_call_ended > 0 and w.check() is None
    elapse(reporter, 31, calls)
    assert "no training step" in w.check()                             # and stalls again with no step after it
    short = calls.enter(0, "Push", 60)
    calls.exit(short)                                                  # a short call is not a wait: still stalled
    assert w.check() and calls.waiting() is None


def test_the_start_up_deadline_counts_outside_the_phases_announced_inside_it():
    """A role-mode worker's start-up announces its long waits (the servers, their agreement, a roll-back):
    when one ends, the start-up's deadline runs again from there, so a long roll-back is not followed by
    a NOT_SERVING start-up the moment it ends."""
    reporter = progress.Progress(None, startup_s=60.0)
    with reporter.phase("roll-back to X", 3600):
        elapse(reporter, 300)
        assert progress.stalled(reporter.report(), time.monotonic(), DEAD_AFTER_S, 0.0) is None
    assert progress.stalled(reporter.report(), time.monotonic(), DEAD_AFTER_S, 0.0) is None
    elapse(reporter, 61)
    assert "'start-up' has run 61s" in progress.stalled(reporter.report(), time.monotonic(), DEAD_AFTER_S, 0.0)


def test_moving_without_a_step_is_not_a_stall():
    """The batches a resumed position skips are read, not trained: ``moved`` keeps the loop live."""
    reporter = progress.Progress(None, startup_s=60.0)
    for _ in range(3):
        elapse(reporter, 50)
        reporter.moved()
        assert progress.stalled(reporter.report(), time.monotonic(), DEAD_AFTER_S, 0.0) is None
    elapse(reporter, 61)
    assert "'start-up' has run 61s" in progress.stalled(reporter.report(), time.monotonic(), DEAD_AFTER_S, 0.0)
