"""A parameter server stopped (SIGSTOP; a frozen cgroup, a swapping host) and continued does not count
the time it was stopped against its callers (``engine.awake``): its barrier leases
(``engine.ps.barrier``) and its judge of a stuck request (``engine.ps.watchdog``) run on its awake time.

A real server in a child process, with a 1 s barrier lease and a 2 s request bound (the job's are 30 s and
``client.timeout_s``), stopped for 2.5 s. Before: an arrival nobody polls (``PSClient.arrive``: the workers'
"seen" at a job's end) made just before the stop was withdrawn by the first arrival after it, and the
meeting waited out its timeout; and a request in flight at the stop was "stuck" the moment the server ran
again, which the local launcher turns into a restart of the attempt.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.ps import PSClient

REPO = Path(__file__).resolve().parents[2]
LEASE_S, BOUND_S, STOP_S = 1.0, 2.0, 2.5    # the stop: past both, and past engine.awake.STALL_S

SERVER = textwrap.dedent(f"""
    import sys
    from engine.ps import PSServer, serve
    from sparse_tables import TableConfig
    core = PSServer({{"e": TableConfig(dim=2)}}, index=0, num_servers=1, num_vshards=16, request_bound_s={BOUND_S})
    core.barriers.lease_s = {LEASE_S}
    server, port = serve(core, "127.0.0.1", 0, threads=4)
    print(port, flush=True)
    for line in sys.stdin:                  # the test's commands, one a line
        if line.strip() == "enter":         # a request in flight: the test holds it open
            core.watchdog.enter("Pull", "held-by-the-test")
            print("entered", flush=True)
        elif line.strip() == "stuck":
            print("stuck", core.watchdog.stuck(), flush=True)
        else:
            break
    server.stop(0).wait()
""")


@pytest.fixture(scope="module")
def server():
    """(the child process, its endpoint), shared by the tests here (each its own barrier names); killed at
    the end whatever happened."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        port = proc.stdout.readline().strip()
        assert port.isdigit(), proc.stderr.read() if proc.poll() is not None else port
        yield proc, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)


def _stop_and_continue(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(STOP_S)
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def _ask(proc: subprocess.Popen, command: str) -> str:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_an_arrival_nobody_polls_outlives_a_stop_of_the_server_longer_than_its_lease(server):
    proc, endpoint = server
    early, late = PSClient([endpoint], name="early"), PSClient([endpoint], name="late")
    try:
        assert early.arrive("job-end-seen", 2, timeout=30) == 1       # arrives, and never polls
        _stop_and_continue(proc)
        t0 = time.monotonic()
        late.barrier("job-end-seen", 2, timeout=5)        # before: waited 5 s, then BarrierTimeoutError
        assert time.monotonic() - t0 < 3.0
    finally:
        early.close()
        late.close()


def test_a_dead_callers_arrival_is_still_withdrawn_after_the_lease_of_time_awake(server):
    proc, endpoint = server
    dead, live = PSClient([endpoint], name="dead"), PSClient([endpoint], name="live")
    try:
        dead.arrive("meet", 2, timeout=30)
        _stop_and_continue(proc)
        time.sleep(LEASE_S + 1.5)                   # awake past the lease (plus the clock's stall margin)
        assert live.arrive("meet", 2, timeout=30) == 1      # the dead arrival is gone: it does not open
    finally:
        dead.close()
        live.close()


def test_a_request_in_flight_across_a_stop_is_not_stuck_but_one_that_stays_is(server):
    proc, _ = server
    assert _ask(proc, "stuck") == "stuck None"
    assert _ask(proc, "enter") == "entered"
    _stop_and_continue(proc)
    assert _ask(proc, "stuck") == "stuck None"          # before: "Pull request held-by-the-test in flight for 2.5s"
    time.sleep(BOUND_S + 1.5)                           # awake past the bound: a hang is still found
    assert _ask(proc, "stuck").startswith("stuck Pull request held-by-the-test in flight for ")
