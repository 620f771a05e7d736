"""The claim on a spill directory (``SpillDir``; the layout is described in ``spill``'s docstring): a
marker file says this engine made the directory, an flock held for the table's lifetime says it is in use.
"""
from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from .errors import SpillDirError

log = logging.getLogger("sparse_tables.spill")   # the logger it had inside spill.py

MARKER_NAME = ".sparse-engine-spill"
LOCK_NAME = ".lock"
DB_NAME = "rocksdb"
_CLAIM_ATTEMPTS = 20


class SpillDir:
    """An exclusive claim on a spill directory (see ``spill``'s module docstring).

    Parameters
    ----------
    path : str or Path
        The directory. Its parent is created if needed; the parent itself is never deleted.

    Attributes
    ----------
    path : Path
    db_path : Path
        ``path / "rocksdb"``, empty after the claim.

    Raises
    ------
    SpillDirError
        ``path`` is not a directory, holds files without this engine's marker, or its lock is held by
        another table or process (a second ``SparseTable`` on the same path, or another job with the
        same ``spill_path`` and table names), or the file system refuses to create or use it (read-only,
        a file on the way, no permission, no room).
    """

    def __init__(self, path):
        self.path = Path(path)
        self.db_path = self.path / DB_NAME
        self._fd: int | None = None
        self._owned = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:          # read-only, not a directory on the way, no permission
            raise _unusable(self.path, f"cannot create its parent {self.path.parent}", exc) from None
        for _ in range(_CLAIM_ATTEMPTS):
            if self._try_claim():
                return
            time.sleep(0.01)   # the directory changed under us (its owner was removing it): look again
        raise SpillDirError(f"spill directory {self.path}: could not be claimed after {_CLAIM_ATTEMPTS} "
                            f"attempts (another process keeps creating and removing it)", str(self.path))

    def _try_claim(self) -> bool:
        try:
            self.path.mkdir()
            created = True
        except FileExistsError:
            created = False
            if not self.path.is_dir():
                raise SpillDirError(f"spill directory {self.path} exists and is not a directory; set "
                                    f"spill_path to a directory this engine may own", str(self.path)) from None
        except OSError as exc:
            raise _unusable(self.path, "cannot create it", exc) from None
        if not created:
            try:
                entries = set(os.listdir(self.path))
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise _unusable(self.path, "cannot list it", exc) from None
            if entries - {LOCK_NAME, MARKER_NAME + ".tmp"} and MARKER_NAME not in entries:
                raise SpillDirError(
                    f"spill directory {self.path} is not empty and was not created by this engine (no "
                    f"{MARKER_NAME} marker; {len(entries)} entries, left untouched): choose an empty or new "
                    f"spill_path, or remove the files yourself",
                    str(self.path))
        lock = self.path / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _unusable(self.path, f"cannot open its lock file {lock}", exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SpillDirError(f"spill directory {self.path}: cannot lock {lock}: {exc}",
                                    str(self.path)) from exc
            raise SpillDirError(f"spill directory {self.path} is in use by another table or process "
                                f"({_owner_text(self.path)}); give every table and job its own spill_path",
                                str(self.path)) from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:        # its previous owner removed the directory between our open and our lock
            os.close(fd)
            return False
        self._fd = fd
        try:
            left = None if created else _read_marker(self.path)
            if left is not None:
                log.info("spill directory %s: left by pid %s on %s (its lock is free: that run ended); "
                         "wiping and reusing it", self.path, left.get("pid"), left.get("host"))
            # the directory is this engine's (to delete on release) when we made it or it carries the
            # marker of an earlier run; an empty directory someone else made is only borrowed
            self._owned = created or left is not None
            if not created:
                self._wipe()
            _write_marker(self.path)
        except OSError as exc:
            self.release(remove=self._owned)
            raise SpillDirError(f"spill directory {self.path}: cannot prepare it: {exc}", str(self.path)) from exc
        return True

    def _wipe(self) -> None:
        """Delete everything in the (claimed) directory but its lock file."""
        for name in os.listdir(self.path):
            if name == LOCK_NAME:
                continue
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def release(self, remove: bool = True) -> None:
        """Give the directory up: with ``remove``, delete it (when it is this engine's; in an empty
        directory made by someone else only our own entries go), then drop the lock. Idempotent; raises
        nothing for a directory that is gone or cannot be removed (logged)."""
        if self._fd is None:
            return
        try:
            self._remove(remove)
        except OSError as exc:
            log.warning("spill directory %s could not be removed: %s", self.path, exc)
        finally:
            os.close(self._fd)
            self._fd = None

    def _remove(self, remove: bool) -> None:
        if remove and self._owned:
            # the database first and the marker last: a directory whose removal fails half-way
            # keeps its marker, so the next run recognises it as ours instead of refusing it
            shutil.rmtree(self.db_path, ignore_errors=True)
            try:
                names = os.listdir(self.path)
            except OSError:          # removed from outside meanwhile
                names = []
            for name in names:
                if name not in (MARKER_NAME, LOCK_NAME):
                    p = self.path / name
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
            (self.path / MARKER_NAME).unlink(missing_ok=True)
            (self.path / LOCK_NAME).unlink(missing_ok=True)
            try:
                self.path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                log.warning("spill directory %s could not be removed completely", self.path)
        elif remove:
            shutil.rmtree(self.db_path, ignore_errors=True)
            for name in (MARKER_NAME, LOCK_NAME):
                (self.path / name).unlink(missing_ok=True)


def sweep_dead(parent, pattern) -> list[Path]:
    """Remove the spill directories in ``parent`` whose names match ``pattern`` (a compiled regular
    expression, matched whole) and that a dead run left: each carries the marker and its lock is free.
    One in use (its lock held, by this process too) or without the marker is left as it is. Returns the
    directories removed. Raises nothing (a directory that cannot be claimed or removed is skipped).

    A server's spill directories are reopened, and so wiped, only under the same names: a server killed
    while its shards lived under the other slot name (``{table}-server{S}-shard{J}.1``, after a base
    load), or under a shard number the next run no longer has (fewer local shards), kept its RocksDB files
    on disk until a later run happened to claim those names again (``engine.ps.hosts``)."""
    parent = Path(parent)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    removed = []
    for name in names:
        path = parent / name
        if not pattern.fullmatch(name) or path.is_symlink() or not path.is_dir() \
                or not (path / MARKER_NAME).exists():
            continue
        try:
            claim = SpillDir(path)
        except SpillDirError:       # in use, or changed under us: not ours to remove now
            continue
        claim.release(remove=True)
        if not path.exists():
            removed.append(path)
            log.info("spill directory %s: left by a run that ended; removed", path)
    return removed


def _unusable(path: Path, what: str, exc: OSError) -> SpillDirError:
    """The SpillDirError of a spill directory the file system refuses (read-only, not a directory on the
    way, no permission, full): a configuration to change, not a fault to restart from."""
    return SpillDirError(f"spill directory {path}: {what}: {exc.strerror or exc} (errno {exc.errno}); set "
                         f"spill_path to a writable directory on a file system with room", str(path))


def _write_marker(path: Path) -> None:
    now = time.time()
    info = {"engine": "sparse_tables", "pid": os.getpid(), "host": socket.gethostname(), "created": now,
            "created_utc": _dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(timespec="seconds")}
    tmp = path / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path / MARKER_NAME)


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER_NAME).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _owner_text(path: Path) -> str:
    info = _read_marker(path)
    if not info:
        return f"its lock {path / LOCK_NAME} is held"
    return (f"its lock is held; marker: pid {info.get('pid')} on host {info.get('host')} since "
            f"{info.get('created_utc', info.get('created'))}")
