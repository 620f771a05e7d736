"""Names of temporary files and directories written beside an output, and finding those a killed
process left: ``.{name}.{tag}-{host}-{pid}-{hex}``.

An output written under a temporary name and moved into place at the end (``engine predict --out``, the
staged directory of ``engine convert``) leaves that temporary behind when its process is killed with
SIGKILL: no handler runs. The next run for the same output removes the ones made on its own host by a
process that no longer exists (``stale``); those of another host, or of a process still running (or a
pid reused since), are left alone: nothing here can tell whether they are still being written.

Worked example::

    >>> n = temp_name("pred.arrow", "tmp")                    # doctest: +SKIP
    '.pred.arrow.tmp-worker7-4242-3fa2c1d0'
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


def temp_name(name: str, tag: str) -> str:
    """A temporary name beside ``name`` (a base name, no directory) for this process."""
    return f".{name}.{tag}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


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
    made on this host by processes that no longer run, sorted."""
    prefix = f".{name}.{tag}-"
    out = []
    for e in entries:
        if not e.startswith(prefix):
            continue
        parts = e[len(prefix):].rsplit("-", 2)
        if len(parts) != 3 or parts[0] != _host() or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid != os.getpid() and not _running(pid):
            out.append(e)
    return sorted(out)
