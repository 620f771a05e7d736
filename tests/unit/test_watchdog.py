"""``engine.ps.watchdog``: when a server counts as stuck. A request (not a phase) is stuck after
``request_bound_s`` of its own time in flight, leaving out every moment a phase (Load, Fence, Save,
Shrink) ran; a running phase after ``phase_bound_s``; a phase still waiting for its lock is judged as a
request. A fake clock drives every case."""
from __future__ import annotations

import pytest

from engine.ps.watchdog import RequestWatchdog


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def dog():
    clock = Clock()
    return RequestWatchdog(10.0, 100.0, clock=clock), clock


def test_a_request_is_stuck_after_the_bound_and_not_before(dog):
    w, clock = dog
    t = w.enter("Pull", "worker1@7")
    clock.t += 10.0
    assert w.stuck() is None
    clock.t += 0.5
    why = w.stuck()
    assert why is not None and why.startswith("Pull request worker1@7 in flight for 10.5s")
    assert "client.timeout_s = 10s" in why
    w.exit(t)
    assert w.stuck() is None and w.in_flight() == 0


def test_time_behind_a_running_phase_is_not_counted(dog):
    w, clock = dog
    pull = w.enter("Pull", "worker0@1")
    clock.t += 5.0
    load = w.enter("Load", "launcher@1")
    w.running(load)                 # holds the tables: the pull waits behind it
    clock.t += 50.0
    assert w.stuck() is None        # 55 s old, 5 s of its own
    w.exit(load)
    clock.t += 5.0
    assert w.stuck() is None        # 10 s of its own
    clock.t += 1.0
    assert w.stuck().startswith("Pull request worker0@1 in flight for 61.0s")
    w.exit(pull)


def test_a_request_that_arrives_during_a_phase_counts_from_its_end(dog):
    w, clock = dog
    save = w.enter("Save", "worker0@2")
    w.running(save)
    clock.t += 30.0
    push = w.enter("Push", "worker1@3")
    clock.t += 30.0
    assert w.stuck() is None
    w.exit(save)
    clock.t += 9.0
    assert w.stuck() is None
    clock.t += 2.0
    assert "Push request worker1@3" in w.stuck()
    w.exit(push)


def test_overlapping_phases_are_left_out_once(dog):
    w, clock = dog
    pull = w.enter("Pull")
    a, b = w.enter("Save"), w.enter("Shrink")
    w.running(a)
    clock.t += 20.0
    w.running(b)
    clock.t += 20.0
    w.exit(a)                       # b still runs: the pull still waits
    clock.t += 20.0
    w.exit(b)
    clock.t += 9.0                  # 69 s old, 60 s behind phases, 9 s of its own
    assert w.stuck() is None
    clock.t += 2.0
    assert w.stuck() is not None
    w.exit(pull)


def test_a_running_phase_is_stuck_after_its_own_bound(dog):
    w, clock = dog
    load = w.enter("Load", "launcher@9")
    clock.t += 3.0                  # waiting for the lock: a request's bound, not started yet
    w.running(load)
    clock.t += 100.0
    assert w.stuck() is None
    clock.t += 1.0
    assert w.stuck().startswith("Load request launcher@9 running for 101s, beyond the 100s")
    w.exit(load)
    assert w.stuck() is None


def test_a_phase_waiting_for_its_lock_behind_a_hung_pull_is_stuck_with_it(dog):
    """The deadlock of a pull that never returns: a Load waits for the tables, and every request after
    waits behind the Load; none of that time is excused, because no phase runs."""
    w, clock = dog
    w.enter("Pull", "worker0@5")
    clock.t += 2.0
    w.enter("Load", "launcher@1")       # never gets its lock
    clock.t += 2.0
    w.enter("Push", "worker1@6")
    clock.t += 6.5
    assert w.stuck().startswith("Pull request worker0@5 in flight for 10.5s")


def test_a_hung_pull_is_found_though_checkpoints_run_beside_it(dog):
    """Checkpoints (shared lock) still complete beside a hung pull: they excuse only their own time."""
    w, clock = dog
    w.enter("Pull", "worker0@5")
    for _ in range(5):
        clock.t += 2.0
        s = w.enter("Save")
        w.running(s)
        clock.t += 1.0
        w.exit(s)
    assert w.stuck() is None            # 15 s old, 10 s of its own
    clock.t += 0.5
    assert w.stuck() is not None


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="request_bound_s=0"):
        RequestWatchdog(0)
    with pytest.raises(ValueError, match="phase_bound_s=-1"):
        RequestWatchdog(1, -1)
