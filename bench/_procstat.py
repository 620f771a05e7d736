"""CPU seconds of processes and their threads from /proc, for the benches that split a machine's cores
between RocksDB's background threads, the rest of a server and its clients (Linux only)."""
from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(stat_path: str) -> float:
    """User + system CPU seconds from a /proc ``stat`` file (fields 14 and 15, proc(5)); the comm field
    may hold spaces, so the fields are counted from its closing parenthesis.

    Raises
    ------
    OSError
        The process or thread is gone.
    """
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def threads_cpu_s(pid: int, prefix: str) -> float:
    """CPU seconds of the live threads of ``pid`` whose name (``comm``) starts with ``prefix``, e.g.
    ``"rocksdb:"`` for RocksDB's flush and compaction threads (``rocksdb:low``, ``rocksdb:high``)."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().startswith(prefix):
                    total += cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue            # the thread ended
    return total


def cpu_split(server: int, clients: list[int], last: dict | None = None) -> dict:
    """Cumulative CPU seconds: ``server_rocksdb`` (the server's RocksDB background threads),
    ``server_rest`` (the process total, exited threads included, minus those) and ``clients``. A
    client already gone counts what ``last`` ({pid: CPU seconds}, updated here) last saw of it, or 0."""
    last = {} if last is None else last
    out = {"server_rocksdb": 0.0, "server_rest": 0.0, "clients": 0.0}
    try:
        total = cpu_s(f"/proc/{server}/stat")
        out["server_rocksdb"] = threads_cpu_s(server, "rocksdb:")
        out["server_rest"] = total - out["server_rocksdb"]
    except OSError:
        pass
    for pid in clients:
        try:
            last[pid] = cpu_s(f"/proc/{pid}/stat")
        except OSError:
            pass
        out["clients"] += last.get(pid, 0.0)
    return out
