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


def test_a_phase_excuses_at_most_its_cap():
    """A checkpoint blocked on the lock of a shard whose pull hangs runs for ever: it excuses the pull's
    time for its first ``excuse_cap_s`` only (300 s), so the hang is found after the cap plus the bound,
    not after the phase's hour."""
    clock = Clock()
    w = RequestWatchdog(10.0, 3600.0, 300.0, clock=clock)
    w.enter("Pull", "worker0@3")
    clock.t += 2.0
    save = w.enter("Save", "worker0@4")
    w.running(save)
    clock.t += 300.0 + 7.5              # 2 s before, 300 excused, 7.5 after the cap: 9.5 s of its own
    assert w.stuck() is None
    clock.t += 1.0
    assert w.stuck().startswith("Pull request worker0@3 in flight for 310.5s")


def test_a_write_stall_is_excused_like_a_phase(dog):
    w, clock = dog
    w.enter("Push", "worker1@9")
    stall = w.wait_began()
    clock.t += 200.0
    assert w.stuck() is None and w.oldest_s() == 0.0
    w.wait_ended(stall)
    clock.t += 9.0
    assert w.stuck() is None and w.oldest_s() == pytest.approx(9.0)
    clock.t += 2.0
    assert "Push request worker1@9" in w.stuck()


def test_a_stall_reported_by_a_table_reaches_the_servers_watchdog():
    """``sparse_tables.waits``: what ``SpillStore._write`` calls around a write stall reaches every
    registered watchdog, and none after ``unwatch``."""
    from sparse_tables import waits
    clock = Clock()
    w = RequestWatchdog(10.0, clock=clock)
    waits.watch(w)
    try:
        w.enter("Push")
        handles = waits.began()
        clock.t += 50.0
        assert w.stuck() is None
        waits.ended(handles)
    finally:
        waits.unwatch(w)
    assert w not in waits._watchers
    clock.t += 11.0
    assert w.stuck() is not None


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="request_bound_s=0"):
        RequestWatchdog(0)
    with pytest.raises(ValueError, match="phase_bound_s=-1"):
        RequestWatchdog(1, -1)


def test_the_oldest_requests_time_leaves_out_phases_and_running_phases(dog):
    w, clock = dog
    assert w.oldest_s() == 0.0
    pull = w.enter("Pull")
    clock.t += 4.0
    save = w.enter("Save")
    w.running(save)
    clock.t += 30.0
    assert w.oldest_s() == pytest.approx(4.0)       # the running Save itself is not a request's wait
    w.exit(save)
    clock.t += 1.0
    assert w.oldest_s() == pytest.approx(5.0) and w.in_flight() == 1
    w.exit(pull)
    assert w.oldest_s() == 0.0


def test_a_sync_barriers_apply_is_a_phase_not_a_hang(monkeypatch):
    """The last arrival at a sync barrier applies every worker's held updates inside its Barrier request
    (as long as all their pushes together): a phase. A real in-process server, bound 0.3 s, an apply of
    1 s: never stuck. Before, the server said stuck, and a liveness probe would have restarted it."""
    import threading
    import time

    from engine.ps import InProcessTransport, PSClient, PSServer
    from sparse_tables import TableConfig

    core = PSServer({"emb": TableConfig(dim=4, optimizer="sgd", learning_rate=1.0)}, request_bound_s=0.3)
    host = core.sparse["emb"]
    applied = host.apply_pending
    monkeypatch.setattr(host, "apply_pending", lambda world: (time.sleep(1.0), applied(world)))
    said, done = [], threading.Event()

    def watch():
        while not done.is_set():
            said.append(core.watchdog.stuck())
            time.sleep(0.05)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        with PSClient(InProcessTransport([core])) as c:
            c.barrier("sync:step", 1, apply_pending=True, timeout=60)
    finally:
        done.set()
        t.join(5)
        core.close()
    assert len(said) > 10 and not any(said), [s for s in said if s][:1]
