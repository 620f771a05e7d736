"""Small tmpfs mounts for tests of a full or read-only disk (a spill directory that runs out of space, a
spill path on a read-only file system). Mounting needs root (CAP_SYS_ADMIN); where it is not possible
the test is skipped with the reason. The ``tmpfs`` fixture (``tests/conftest.py``) unmounts at the
test's end, whatever happened."""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted(path: Path, size_bytes: int, read_only: bool = False):
    """A tmpfs of ``size_bytes`` (rounded up to pages) at ``path`` (created) for the block; unmounted at
    its end, even when the block fails (lazily when a file on it is still open: the kernel lets go of the
    mount once the file is closed). Skips the test when the mount is refused."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={int(size_bytes)},mode=0755" + (",ro" if read_only else "")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True,
                           text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command here: cannot make a small tmpfs for a full-disk test")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def leave_free(disk: Path, nbytes: int) -> Path:
    """A file ``disk/filler`` that takes the free space of ``disk`` but ``nbytes``; returns its path."""
    st = os.statvfs(disk)
    path = Path(disk) / "filler"
    with open(path, "wb") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - nbytes)))
    return path


def open_files_under(path: Path, pid: int | str = "self") -> list[str]:
    """The files under ``path`` that process ``pid`` holds open (its ``/proc/PID/fd`` links)."""
    out, root = [], str(Path(path))
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir() if fd_dir.is_dir() else ():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target == root or target.startswith(root + "/"):
            out.append(target)
    return sorted(out)
