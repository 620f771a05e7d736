"""A supervisor does not count its own stop as the silence of what it watches (``engine.awake``); nor
does a role-mode worker's liveness count its own stop as its loop's hang.

Before, a launcher stopped (Ctrl-Z and ``fg``, SIGSTOP, its container frozen, its host swapping) for
longer than ``client.dead_after_s`` found every server "silent" the moment it ran again, before its Health
polls could answer, and restarted a healthy job from its last checkpoint (a real job, 6 s dead_after_s,
the launcher stopped 10 s: "server 0 failed (answered no Health call from the launcher's host for 11s)";
restart 1). Here: a real server on loopback and a real ``ServerWatch`` in a child process, which is
stopped with SIGSTOP for longer than its ``dead_after_s`` and continued.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from engine.awake import AwakeClock
from engine.ps import PSServer, serve
from sparse_tables import TableConfig

REPO = Path(__file__).resolve().parents[2]
DEAD_AFTER_S = 2.0      # seconds; the stops below last 1 s longer

WATCHER = textwrap.dedent("""
    import sys, time
    from engine.launch.local import ServerWatch
    watch = ServerWatch([sys.argv[1]], float(sys.argv[2]), every_s=0.2)
    print("ready", flush=True)
    while True:
        print("silent", watch.silent(), flush=True)
        time.sleep(0.05)
""")


def _lines(proc, seconds: float) -> list[str]:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line.strip())
    return out


def test_a_watcher_stopped_longer_than_dead_after_takes_no_live_server_for_silent():
    core = PSServer({"e": TableConfig(dim=2)}, index=0, num_servers=1, num_vshards=16)
    server, port = serve(core, "127.0.0.1", 0, dead_after_s=DEAD_AFTER_S)
    proc = subprocess.Popen([sys.executable, "-c", WATCHER, f"127.0.0.1:{port}", str(DEAD_AFTER_S)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert "ready" in proc.stdout.readline()
        assert all(line == "silent []" for line in _lines(proc, 0.5) if line.startswith("silent"))
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(DEAD_AFTER_S + 1.0)
        os.kill(proc.pid, signal.SIGCONT)
        after = [line for line in _lines(proc, 1.0) if line.startswith("silent")]
        assert after and all(line == "silent []" for line in after), after[:5]
    finally:
        proc.kill()
        proc.wait(10)
        server.stop(0)
        core.close()


LIVE_WORKER = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from engine import progress
    from engine.liveness import WorkerLiveness
    reporter = progress.install(in_memory=True, startup_s=60.0)   # as a worker: start-up until its first step
    live = WorkerLiveness(reporter, "127.0.0.1", 0, float(sys.argv[1]), "worker 0")
    print("ready", flush=True)
    for line in sys.stdin:                 # a training loop: one step per line the test sends
        if line.strip() == "end":
            break
        reporter.step(1)
""")


def test_a_role_mode_worker_stopped_and_continued_does_not_call_itself_hung():
    """``engine.liveness``: continued after a stop longer than ``dead_after_s``, the worker's liveness
    looked before its loop stepped again and went NOT_SERVING ("no training step for 2s ... a hang"),
    which a probe with a failure threshold of 1 turns into a restart. Here the loop steps when the test
    says, so the liveness (every second) always looks first: 1.2 s after the stop, less than
    ``dead_after_s`` of time awake since the last step."""
    proc = subprocess.Popen([sys.executable, "-c", LIVE_WORKER, str(DEAD_AFTER_S)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})

    def steps(n: int) -> None:
        for _ in range(n):
            proc.stdin.write("step\n")
            proc.stdin.flush()
            time.sleep(0.1)
    try:
        assert "ready" in proc.stdout.readline()
        steps(3)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(DEAD_AFTER_S + 1.0)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.2)
        steps(3)
        _, err = proc.communicate("end\n", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err[-2000:]
    assert "NOT_SERVING" not in err, err[-2000:]


def test_ages_leave_out_the_stalls_and_the_one_under_way():
    clock = AwakeClock(tick_s=0.2, stall_s=1.0, start=False)
    t0 = clock._last
    for k in range(1, 6):
        clock.tick(t0 + 0.2 * k)                    # awake for 1 s
    clock.tick(t0 + 31.0)                           # then stopped for 30 s
    assert abs(clock.age(t0, t0 + 31.0) - 1.0) < 1e-9
    for k in range(1, 46):
        clock.tick(t0 + 31.0 + 0.2 * k)             # awake for 9 s more
    assert abs(clock.age(t0 + 31.0, t0 + 40.0) - 9.0) < 1e-9   # a later age does not lose the 30 s
    # stopped again, and asked before the ticker has run: the gap under way is left out too
    assert abs(clock.age(t0, t0 + 71.0) - 10.0) < 1e-9
    report = {"mono": t0 + 0.5, "step_mono": t0 + 0.5, "phase": {"name": "x", "started_mono": t0, "deadline_s": 5}}
    moved = clock.discount(report, t0 + 31.0)
    assert abs((t0 + 31.0) - moved["mono"] - 0.5) < 1e-9 and abs((t0 + 31.0) - moved["phase"]["started_mono"] - 1.0) < 1e-9


def test_now_runs_only_while_the_process_does_and_never_goes_back():
    clock = AwakeClock(tick_s=0.2, stall_s=1.0, start=False)
    t0 = clock._last
    start = clock.now(t0)
    for k in range(1, 6):
        clock.tick(t0 + 0.2 * k)                    # awake for 1 s
    assert abs(clock.now(t0 + 1.0) - start - 1.0) < 1e-9
    assert abs(clock.now(t0 + 31.0) - start - 1.0) < 1e-9      # stopped 30 s, the ticker not run yet
    clock.tick(t0 + 31.0)                           # it ran: the stall is recorded
    assert abs(clock.now(t0 + 31.0) - start - 1.0) < 1e-9
    readings = [clock.now(t0 + 31.0 + 0.1 * k) for k in range(1, 91)]
    for k in range(1, 46):
        clock.tick(t0 + 31.0 + 0.2 * k)
    assert readings == sorted(readings)             # it stood still at most stall_s, never went back
    assert abs(clock.now(t0 + 40.0) - start - 10.0) < 1e-9     # 9 s more awake: the 30 s stay left out
