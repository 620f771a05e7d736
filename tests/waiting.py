"""Waiting in tests for a state another thread or process must reach: poll ``ok()`` until it holds, with a
deadline, never a fixed sleep (on a loaded machine a thread or an RPC can take longer than any short
sleep to get there)."""
from __future__ import annotations

import time


def until(ok, what: str, timeout_s: float = 10.0, every_s: float = 0.001) -> None:
    """Return once ``ok()`` is true; poll every ``every_s`` seconds.

    Raises
    ------
    AssertionError
        ``ok()`` was still false after ``timeout_s`` seconds; the message names ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(every_s)


def until_while_running(proc, ok, what: str, tail, timeout_s: float = 60.0, every_s: float = 0.02) -> None:
    """``until`` for a state a running job must reach: fails at once, with ``tail()`` (its logs), when
    ``proc`` (a ``subprocess.Popen``) ends first.

    Raises
    ------
    AssertionError
        ``proc`` ended before ``ok()`` held, or ``ok()`` was still false after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while not ok():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before {what}\n{tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s\n{tail()}")
        time.sleep(every_s)


def killed_after_first_line(code: str, repo) -> str:
    """Run Python ``code`` in a new process (``repo`` on its path), read the first line it prints, then
    SIGKILL it (no handler runs, as when the kernel's OOM killer or ``kill -9`` ends a real run); returns
    that line. The process is always killed and reaped, whatever happens while reading."""
    import os
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=repo, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        return proc.stdout.readline().strip()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
