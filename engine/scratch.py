"""Throwaway directories that outlive a SIGKILL only until the next one is made.

A process killed with SIGKILL skips every cleanup, so a temporary directory it made stays. A
``ScratchDir`` is held by an flock on its ``.lock`` file for its whole life, and each new one first
removes those of its kind (the same name prefix) whose lock is free: their process is gone (the kernel
drops a dead process's locks, whatever pid namespace it ran in). The warm-up's spill stores
(``engine.ps.warmup``) and the MPI world's record of hydra's topology file (``engine.launch.mpi``) use it.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

LOCK = ".lock"


class ScratchDir:
    """A throwaway directory ``prefix*`` in ``root``, removed by ``close``, or after its process died by
    the next ``ScratchDir`` of the same prefix (``sweep_scratch_dirs``). A directory without a ``.lock``
    (made by an earlier version) or of another user is left alone.

    Parameters
    ----------
    prefix : str
        The kind of directory (e.g. ``"engine-warm-up-"``): only directories of this prefix are swept.
    root : str or Path, optional
        Where to make it (default ``tempfile.gettempdir()``).
    on_sweep : callable(Path) -> None, optional
        Called with each dead process's directory before it is removed (to undo what the directory
        records); any error it raises is logged and the directory removed anyway.

    Attributes
    ----------
    path : Path
    swept : list of Path
        The directories of dead processes this one's creation removed.

    Raises
    ------
    OSError
        The directory or its lock cannot be made.
    """

    def __init__(self, prefix: str, root=None, *, on_sweep: Callable[[Path], None] | None = None):
        root = Path(root if root is not None else tempfile.gettempdir())
        self.swept = sweep_scratch_dirs(root, prefix, on_sweep=on_sweep)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        self._fd: int | None = None
        try:
            new = self.path / (LOCK + ".new")
            self._fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)      # nobody else knows the file yet: never blocks
            os.rename(new, self.path / LOCK)          # a sweeper sees the lock only once it is held
        except BaseException:           # a directory without a lock would never be swept
            shutil.rmtree(self.path, ignore_errors=True)
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            raise

    def close(self) -> None:
        """Remove the directory, then drop the lock. Idempotent."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


def sweep_scratch_dirs(root, prefix: str, *, on_sweep: Callable[[Path], None] | None = None) -> list[Path]:
    """Remove the ``ScratchDir`` directories ``prefix*`` in ``root`` whose lock is free (their process
    died), each after ``on_sweep(directory)`` if given.

    Parameters
    ----------
    root : str or Path
        The directory holding them.
    prefix : str
        Their kind (``ScratchDir``'s ``prefix``).
    on_sweep : callable(Path) -> None, optional
        As for ``ScratchDir``.

    Returns
    -------
    list of Path
        The directories removed. Those whose lock is held, that have no lock file, whose lock is a
        symbolic link or belongs to another user are left alone.
    """
    removed = []
    for d in sorted(Path(root).glob(prefix + "*")):
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():    # a link, a file, not ours
                continue
            fd = os.open(d / LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:                 # no lock file, a link, or not ours to open
            continue
        if os.fstat(fd).st_uid != os.getuid():      # root may open anyone's: only our own are swept
            os.close(fd)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:                 # held: its process is running
            os.close(fd)
            continue
        try:
            if on_sweep is not None:
                try:
                    on_sweep(d)
                except Exception as e:      # noqa: BLE001 - a bad record must not block the sweep or its caller
                    log.warning("%s: could not undo what it records (%s: %s); removing it anyway", d,
                                type(e).__name__, e)
            shutil.rmtree(d, ignore_errors=True)
            if not os.path.lexists(d):
                removed.append(d)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d %s* directories left by processes that died: %s", len(removed), prefix,
                 ", ".join(str(d) for d in removed))
    return removed


__all__ = ["LOCK", "ScratchDir", "sweep_scratch_dirs"]
