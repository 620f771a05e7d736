"""How a hybrid world's ranks ended, as the local launcher reads it (``engine.launch.mpi.World``): real
``mpiexec`` worlds of 2 ranks, each rank a small MPI program under the module's rank shim.

When one rank is killed, hydra kills the other with the same signal at once. The launcher named the
first death from the order its pidfd watcher saw the two ends, and when both were seen in one wake-up
(a loaded machine) or pidfds were refused (a seccomp profile) it named rank 0 for a SIGKILLed rank 1
(``test_hybrid.py``'s killed-worker test failed so once in CI). The shim's record of its own worker's
end makes the answer exact: these tests refuse pidfds to the launcher, so only the record can tell."""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.launch import mpi

RANK_PROGRAM = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    how, ready = sys.argv[1], Path(sys.argv[2])
    if how == "exit3-before-init" and os.environ["PMI_RANK"] == "1":
        sys.exit(3)                       # before mpi4py's import initializes MPI
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    a, b = np.ones(4), np.zeros(4)
    for step in range(100_000):
        req = comm.Iallreduce(a, b)
        while not req.Test():
            time.sleep(0.001)
        if step == 5:
            ready.with_name(f"ready-{rank}").touch()
        if how == "abort5" and rank == 1 and step == 20:
            comm.Abort(5)
        if how == "finish" and step == 20:
            break
        time.sleep(0.01)
""")


def start(tmp_path: Path, how: str) -> mpi.World:
    prog = tmp_path / "rank.py"
    prog.write_text(RANK_PROGRAM)
    ranks = [{"cmd": [sys.executable, str(prog), how, str(tmp_path / "ready")], "env": {},
              "log": str(tmp_path / f"worker-{r}.log"), "pid": str(tmp_path / f"worker-{r}.pid"),
              "exit": str(tmp_path / f"worker-{r}.exit.json")} for r in range(2)]
    return mpi.World(mpi.world_command(sys.executable, tmp_path, ranks), env=mpi.loopback_env(dict(os.environ)),
                     run_dir=tmp_path, pid_paths=[Path(x["pid"]) for x in ranks],
                     rank_logs=[Path(x["log"]) for x in ranks], exit_paths=[Path(x["exit"]) for x in ranks])


def end(world: mpi.World, timeout: float = 60) -> dict[int, int]:
    """Wait for the world to end -> its codes; on a timeout, kill it all first."""
    deadline = time.monotonic() + timeout
    try:
        while world.codes() is None:
            assert time.monotonic() < deadline, f"the world did not end: {world.tail()}"
            time.sleep(0.02)
        return world.codes()
    finally:
        if world.proc.poll() is None:
            kill(world)
            world.proc.wait(10)
        world._remove_topology()


def kill(world: mpi.World) -> None:
    """SIGKILL as the launcher's shutdown sends it: to each started worker's group, and to mpiexec's
    for a rank whose worker has not started yet (on a loaded machine rank 0's may not have been: its
    world was left waiting for ever)."""
    world.signal_all(signal.SIGKILL)
    for r in range(2):
        pid = world.rank_pid(r)
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def no_pidfds(monkeypatch):
    """The launcher's pidfd watcher refused, as under a seccomp profile: the order it saw is no help."""
    def refused(pid, flags=0):
        raise PermissionError(1, "refused by the test")
    monkeypatch.setattr(os, "pidfd_open", refused)


def wait_ready(tmp_path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all((tmp_path / f"ready-{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "the ranks never all-reduced"
        time.sleep(0.02)


def test_a_sigkilled_rank_1_is_named_and_its_peer_reports_0(tmp_path, no_pidfds):
    world = start(tmp_path, "loop")
    wait_ready(tmp_path)
    victim = world.rank_pid(1)
    os.kill(victim, signal.SIGKILL)
    codes = end(world)
    assert codes == {0: 0, 1: -signal.SIGKILL}, (codes, world.tail(20))
    rec = world.exit_record(1)
    assert rec["pid"] == victim and rec["code"] == -signal.SIGKILL
    assert world.exit_record(0).get("code") is None     # rank 0 was killed by hydra: no code of its own
    assert mpi.RankProcess(world, 1).ended_at == rec["ended"]
    # the worker is the rank's child of the shim, in a group of its own (the launcher signals it so)
    assert rec["shim_pid"] != victim


def test_an_aborting_rank_is_named_with_its_code(tmp_path, no_pidfds):
    world = start(tmp_path, "abort5")
    codes = end(world)
    assert codes == {0: 0, 1: 5}, (codes, world.tail(20))


def test_a_rank_that_exits_before_mpi_init_is_seen_at_once(tmp_path, no_pidfds):
    """hydra leaves such a world running (rank 0 waits in MPI_Init for ever): the rank's own code is
    what the launcher acts on, before the world ends."""
    world = start(tmp_path, "exit3-before-init")
    try:
        deadline = time.monotonic() + 60
        while mpi.RankProcess(world, 1).poll() is None:
            assert time.monotonic() < deadline and world.proc.poll() is None, world.tail(20)
            time.sleep(0.02)
        assert mpi.RankProcess(world, 1).poll() == 3 and mpi.RankProcess(world, 0).poll() is None
    finally:
        kill(world)
    assert end(world)[1] == 3


def test_a_world_that_finishes_reports_0_and_a_forwarded_sigterm_reaches_the_worker(tmp_path):
    (tmp_path / "a").mkdir()
    world = start(tmp_path / "a", "finish")
    assert end(world) == {0: 0, 1: 0}
    assert all(world.exit_record(r)["code"] == 0 for r in range(2))
    # SIGTERM to a shim (as hydra forwards mpiexec's) ends its worker by SIGTERM, and the shim alike
    (tmp_path / "b").mkdir()
    world = start(tmp_path / "b", "loop")
    wait_ready(tmp_path / "b")
    os.kill(world.exit_record(1)["shim_pid"], signal.SIGTERM)
    codes = end(world)
    assert codes[1] == -signal.SIGTERM and codes[0] == 0, (codes, world.tail(20))
