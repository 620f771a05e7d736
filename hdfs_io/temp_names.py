"""Names of temporary files and directories written beside an output, and finding those a killed
process left: ``.{name}.{tag}-{host}-{boot}-{pidns}-{pid}-{hex}``.

An output written under a temporary name and moved into place at the end (``engine predict --out``, the
staged directory of ``engine convert``) leaves that temporary behind when its process is killed with
SIGKILL: no handler runs. The next run for the same output removes the ones made by a process that no
longer exists on its own host, since the same boot, in its own PID namespace (``stale``): a pid means
nothing across hosts, reboots or PID namespaces (containers sharing a host name and a directory). Those
of another host, boot or namespace, or of a process still running (or a pid reused since), are left
alone: nothing here can tell whether they are still being written.

Worked example::

    >>> n = temp_name("pred.arrow", "tmp")                    # doctest: +SKIP
    '.pred.arrow.tmp-worker7-9c1e0f3a-4026531836-4242-3fa2c1d0'
    >>> stale([n, "pred.arrow"], "pred.arrow", "tmp")         # after process 4242 died: [n]   # doctest: +SKIP
"""
from __future__ import annotations

import os
import secrets
import socket
from typing import Iterable

__all__ = ["temp_name", "stale"]


def _host() -> str:
    return socket.gethostname() or "localhost"


def _boot() -> str:
    """The first 8 hex digits of this boot's id (Linux), "0" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:8] or "0"
    except OSError:
        return "0"


def _pidns() -> str:
    """The inode of this process's PID namespace (Linux), "0" where there is none."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _origin() -> str:
    return f"{_host()}-{_boot()}-{_pidns()}"


def temp_name(name: str, tag: str) -> str:
    """A temporary name beside ``name`` (a base name, no directory) for this process."""
    return f".{name}.{tag}-{_origin()}-{os.getpid()}-{secrets.token_hex(4)}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # another user's process: it exists
        return True
    return True


def stale(entries: Iterable[str], name: str, tag: str) -> list[str]:
    """Of ``entries`` (base names in the output's directory), the temporaries of ``name`` and ``tag``
    made on this host, boot and PID namespace by processes that no longer run, sorted."""
    prefix = f".{name}.{tag}-{_origin()}-"
    out = []
    for e in entries:
        if not e.startswith(prefix):
            continue
        parts = e[len(prefix):].split("-")
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        if pid != os.getpid() and not _running(pid):
            out.append(e)
    return sorted(out)
