"""Real ``mpiexec`` worlds in tests, without leaving hydra's topology files behind.

MPICH's hydra writes the machine's topology for the ranks to ``/tmp/hydra_hwloc_xmlfile_*`` once they
initialize MPI; its proxy holds the file open, and mpiexec removes it when it ends, but not when it ends
for an ``MPI_Abort`` or a SIGKILL. ``run_mpiexec`` notes the file while the world runs and removes it after.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

from engine.launch.mpi import topology_file_of

LOOK_S = 0.05          # seconds between looks while the world runs (an abort may follow MPI_Init at once)


def topology_files(mpiexec: int) -> list[Path]:
    """The topology files that the hydra proxies under the mpiexec ``mpiexec`` (a pid) hold open (its
    children, from ``/proc/PID/task/*/children``)."""
    found = []
    try:
        children = [int(c) for t in Path(f"/proc/{mpiexec}/task").iterdir()
                    for c in (t / "children").read_text().split()]
    except (OSError, ValueError):        # gone meanwhile
        return found
    for child in children:
        try:
            held = topology_file_of(child)
        except OSError:                   # gone meanwhile
            continue
        if held is not None:
            found.append(held[0])
    return found


def run_mpiexec(cmd: list[str], *, timeout: float, **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` for a command that is or
    execs mpiexec (same pid), in a session of its own; the world's topology file is removed once it
    ended, however it ended.

    Raises
    ------
    subprocess.TimeoutExpired
        The world outlived ``timeout`` seconds (its whole process group is killed first).
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen_kw)
    found: set[Path] = set()
    done = threading.Event()

    def look() -> None:
        while not done.is_set() and not found:
            found.update(topology_files(proc.pid))
            done.wait(LOOK_S)

    watcher = threading.Thread(target=look, name="topology-files", daemon=True)
    watcher.start()
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)      # mpiexec, its proxy and the ranks: they hold the pipes
            proc.communicate(timeout=10)
            raise
    finally:
        done.set()
        watcher.join()
        for f in found:
            f.unlink(missing_ok=True)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
