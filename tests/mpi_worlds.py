"""Real ``mpiexec`` worlds in tests, without leaving hydra's topology files behind.

MPICH's hydra writes the machine's topology for the ranks to ``/tmp/hydra_hwloc_xmlfile_*`` once they
initialize MPI; its proxy holds the file open, and mpiexec removes it when it ends, but not when it ends
for an ``MPI_Abort`` or a SIGKILL. ``run_mpiexec`` notes the file while the world runs and removes it after.
"""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

PREFIX = "hydra_hwloc_xmlfile_"
LOOK_S = 0.25          # seconds between looks while the world runs


def topology_files(mpiexec: int) -> list[Path]:
    """The topology files that the hydra proxies under the mpiexec ``mpiexec`` (a pid) hold open."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != mpiexec:
                continue
            for fd in (d / "fd").iterdir():
                target = os.readlink(fd)
                if os.path.basename(target).startswith(PREFIX):
                    found.append(Path(target))
        except OSError:           # gone meanwhile
            continue
    return found


def run_mpiexec(cmd: list[str], *, timeout: float, **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` for a command that is or
    execs mpiexec (same pid); the world's topology file is removed once it ended, however it ended.

    Raises
    ------
    subprocess.TimeoutExpired
        The world outlived ``timeout`` seconds (it is killed first).
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kw)
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
            proc.kill()
            proc.communicate()
            raise
    finally:
        done.set()
        watcher.join()
        for f in found:
            f.unlink(missing_ok=True)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
