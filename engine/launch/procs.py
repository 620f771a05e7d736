"""Which processes belong to a run: the roles the local launcher started in a run directory, found by
their command lines in ``/proc`` (Linux). For operators and chaos tooling: kill, stop or inspect one
role of a live job (``bench/recovery_bench.py``, ``bench/chaos_soak.py``, the chaos tests). And
``die_with_parent``, which ties a launcher's child to it, and ``parent_pid``."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path


def die_with_parent(parent: int) -> bool:
    """Ask the kernel to SIGKILL this process when the thread that started it ends (Linux
    ``PR_SET_PDEATHSIG``; kept across ``execve``), then exit at once (code 3) if the parent ``parent``
    (a pid) is already gone. Returns False where ``prctl`` is unavailable (the caller should poll)."""
    ok = False
    if sys.platform.startswith("linux"):
        try:
            ok = ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # PDEATHSIG
        except OSError:
            ok = False
    if os.getppid() != parent:
        os._exit(3)
    return ok


def parent_pid(pid: int) -> int:
    """The parent pid of ``pid`` (``/proc/PID/stat``).

    Raises
    ------
    OSError
        ``pid`` is gone (or ``/proc`` is unavailable).
    ValueError, IndexError
        The stat line cannot be read as one (it changed meanwhile).
    """
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdlines():
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                yield int(d.name), (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue


def role_pid(run_dir: str | os.PathLike, role: str, rank: int, timeout_s: float = 60.0) -> int:
    """pid of the ``--role role --rank rank`` child of the attempt running in ``run_dir`` (the one
    whose config file is ``run_dir/config.yaml``), waiting up to ``timeout_s`` seconds for it.

    Raises
    ------
    TimeoutError
        No such process appeared in time.
    """
    config = str(Path(run_dir) / "config.yaml").encode()
    deadline = time.monotonic() + timeout_s
    while True:
        for pid, cmd in _cmdlines():
            if (config in cmd and b"--role" in cmd and b"--rank" in cmd
                    and cmd[cmd.index(b"--role") + 1] == role.encode()
                    and cmd[cmd.index(b"--rank") + 1] == str(rank).encode()):
                return pid
        if time.monotonic() > deadline:
            raise TimeoutError(f"{role} {rank} of {run_dir} did not appear within {timeout_s:g}s")
        time.sleep(0.05)


def processes_of(run_dir: str | os.PathLike) -> list[int]:
    """pids of every process whose command line mentions ``run_dir`` (left-overs after a job)."""
    key = str(run_dir).encode()
    return [pid for pid, cmd in _cmdlines() if any(key in part for part in cmd)]
