"""One RAM budget in bytes for the shards of a sparse table on one server (``TableConfig.memory_bytes``).

``memory_rows`` bounds the rows of one shard and leaves everything else unbounded; ``memory_bytes``
bounds what the table costs the server: its shards together, each part below. The fixed parts are sized
once, when the budget is made; the parts that grow with the keys on disk are reported by the shards
after every call that changes them, and the RAM tier gives up rows to keep the total under the budget.

Parts (``SparseTable.stats()["memory"]``, bytes):

========== ===================================================================================== ======
rows       arena rows ever handed out (live and free; ``S_NEXT x row_bytes``): pages once written  grows
           stay resident, so free rows count until an arena compaction gives their pages back
index      the hash index, sized once for the largest RAM tier the budget allows                  fixed
rocksdb    the block cache shared by the shards (data blocks, and RocksDB's index and filter      fixed
           blocks, which live in it) + every shard's memtables (write_buffer_size x
           max_write_buffer_number)
filters    the spill Bloom filters (``keysets.ScalableBloom``): 10 bits per key on disk at the    grows
           last expiry pass (which rebuilds them from the keys it leaves there) and per key
           written since
dirty_keys keys of rows evicted while dirty, and keys deleted since (tombstones), kept until the  grows
           next delta checkpoint clears them
sketch     the admission count-min sketch (when admission is on)                                  fixed
========== ===================================================================================== ======

Sizing rule (chosen for a server whose table spills most of its rows; the RocksDB parts are what
RocksDB's tuning guide calls the block cache and the write buffers):

* block cache: budget / 16, within [32 MiB, 1 GiB];
* memtables: per shard 2 buffers of budget / 64 / shards, within [4 MiB, 64 MiB] each;
* RAM rows: ``(budget - fixed - growing) / row_bytes`` less a reserve for what no part counts
  (Python objects, request buffers, allocator fragments): 2% of the budget, or what the process's owner
  measured beyond the parts when more (``set_unaccounted``; a server's memory governor reads RSS):
  see ``rows_cap``.

The index is sized for the RAM tier at zero growth plus a push's worth of headroom (rows a call may add
before its eviction pass runs), so a budgeted table never rehashes: growth is new arena pages touched,
never a copy under the lock.
"""
from __future__ import annotations

import os
import threading

from .errors import TableConfigError

MiB = 1 << 20
GiB = 1 << 30
INDEX_SLOT_BYTES = 8
MAX_LOAD = 0.8                 # the table's index load limit (table.MAX_LOAD)
HEADROOM_ROWS = 1 << 17        # rows a call may add before its eviction pass (a 100k-key push of new keys)
SLACK_ROWS = 1 << 15           # arena rows past the cap before a compaction runs (not one per call)
RESERVE_FRACTION = 0.02


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (``os.sysconf``), or None where it cannot be read."""
    try:
        n = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return n if n > 0 else None


#: a cgroup memory limit at or above this is "none" (cgroup v1 writes 2**63 rounded down to a page)
_NO_LIMIT = 1 << 62


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                        root: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """The tightest memory limit of this process's cgroup and its ancestors: ``(bytes, file read)``, or
    None when there is none (or cgroups cannot be read). A Kubernetes pod's or a container's limit is
    where its processes are OOM-killed, however much physical memory the host has.

    cgroup v2 (``0::PATH`` in ``/proc/self/cgroup``): ``memory.max`` of ``root/PATH`` and each parent;
    v1 (a line naming the ``memory`` controller): ``memory.limit_in_bytes`` under ``root/memory``. A
    container whose own cgroup is mounted as the root finds it at the root itself (the walk ends there).
    """
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        for i in range(len(parts), -1, -1):
            file = os.path.join(base, *parts[:i], name)
            try:
                with open(file) as f:
                    value = int(f.read().strip())
            except (OSError, ValueError):        # absent here, or "max" (v2: no limit)
                continue
            if 0 < value < _NO_LIMIT:
                found.append((value, file))
    return min(found) if found else None


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def _pow2(n: int) -> int:
    return 1 << max(4, (max(1, n) - 1).bit_length())


class MemoryBudget:
    """The RAM of one table's shards on one server, in bytes.

    Parameters
    ----------
    budget_bytes : int
        ``memory_bytes``: the server's RAM for this table (all its local shards).
    shards : int
        Local shards sharing it (>= 1).
    row_bytes : int
        Bytes of one arena record (``RowLayout.row_bytes``).
    sketch_bytes : int
        Bytes of one shard's admission sketch (0 without admission).

    Raises
    ------
    TableConfigError
        (a ValueError) The budget cannot hold the fixed parts and a RAM tier of at least
        ``HEADROOM_ROWS`` rows per shard; the message, which starts ``memory_bytes=``, gives the least
        budget that can. (A budget for this machine is checked against its RAM by ``check_host``; one
        for a planned server, ``engine plan``, is not.)
    """

    def __init__(self, budget_bytes: int, shards: int, row_bytes: int, sketch_bytes: int = 0):
        self.budget_bytes = int(budget_bytes)
        self.shards = int(shards)
        self.row_bytes = int(row_bytes)
        self.sketch_bytes = int(sketch_bytes) * self.shards
        self.cache_bytes = _clamp(self.budget_bytes // 16, 32 * MiB, GiB)
        self.write_buffer_bytes = _clamp(self.budget_bytes // 64 // self.shards, 4 * MiB, 64 * MiB)
        self.write_buffers = 2
        self.rocksdb_bytes = self.cache_bytes + self.shards * self.write_buffers * self.write_buffer_bytes
        self.reserve_bytes = int(RESERVE_FRACTION * self.budget_bytes)
        fixed = self.rocksdb_bytes + self.sketch_bytes + self.reserve_bytes
        per_shard = (self.budget_bytes - fixed) // self.shards
        self.index_slots, self.max_rows_per_shard = self._index_for(per_shard)
        if self.max_rows_per_shard < HEADROOM_ROWS:
            least = fixed + self.shards * (2 * HEADROOM_ROWS * (self.row_bytes + 2 * INDEX_SLOT_BYTES))
            raise TableConfigError(f"memory_bytes={self.budget_bytes} leaves too little for the RAM tier of "
                             f"{self.shards} shard(s) after RocksDB ({self.rocksdb_bytes} bytes) and the "
                             f"reserve; give at least {least} bytes")
        self.index_bytes = self.shards * self.index_slots * INDEX_SLOT_BYTES
        self._lock = threading.Lock()
        self._growing: dict[int, int] = {}     # shard token -> filters + dirty_keys bytes
        self._rows: dict[int, int] = {}        # shard token -> arena rows handed out (S_NEXT)
        self._unaccounted = 0                  # measured by the process's owner (set_unaccounted)
        self.cache = None                      # the shared RocksDB block cache (made by the spill store)
        self.write_buffer_manager = None       # its memtables, charged to the cache

    def check_host(self, host_bytes: int | None = None) -> None:
        """Refuse a budget larger than this machine's physical memory (``host_bytes``, default
        ``host_memory_bytes``; nothing is checked where it cannot be read) or, when ``host_bytes`` is not
        given, than this process's cgroup memory limit (``cgroup_memory_limit``: a container's or a
        Kubernetes pod's): its arena and index would be mapped past what the server may use (an mmap
        ENOMEM, or pages that swap and an OOM kill later).

        Raises
        ------
        TableConfigError
            The message starts ``memory_bytes=N:`` and gives the host's bytes, or the cgroup's limit and
            the file it was read from.
        """
        host = host_memory_bytes() if host_bytes is None else int(host_bytes)
        if host is not None and self.budget_bytes > host:
            raise TableConfigError(f"memory_bytes={self.budget_bytes}: exceeds this host's {host} bytes of "
                                   f"physical memory (os.sysconf); memory_bytes is one server's RAM for the "
                                   f"table: give at most what the server has beside its other tables")
        limit = cgroup_memory_limit() if host_bytes is None else None
        if limit is not None and self.budget_bytes > limit[0]:
            raise TableConfigError(f"memory_bytes={self.budget_bytes}: exceeds this process's cgroup memory "
                                   f"limit of {limit[0]} bytes ({limit[1]}: a container's or pod's limit, where "
                                   f"it would be OOM-killed); memory_bytes is one server's RAM for the table: "
                                   f"give at most the limit less the server's other tables and its own memory")

    def _index_for(self, per_shard: int) -> tuple[int, int]:
        """(index slots, RAM rows incl. headroom) per shard maximising rows within ``per_shard`` bytes."""
        best = (16, 0)
        slots = 16
        while slots * INDEX_SLOT_BYTES < per_shard:
            rows = min(int(MAX_LOAD * slots), (per_shard - slots * INDEX_SLOT_BYTES) // self.row_bytes)
            if rows > best[1]:
                best = (slots, rows)
            slots *= 2
        return best

    def register(self) -> int:
        """A token for one shard's reports."""
        with self._lock:
            token = len(self._growing)
            while token in self._growing:
                token += 1
            self._growing[token] = 0
            self._rows[token] = 0
            return token

    def report(self, token: int, growing_bytes: int, arena_rows: int) -> None:
        """One shard's bytes that grow with its keys (filters, dirty keys) and its arena rows handed out."""
        with self._lock:
            self._growing[token] = int(growing_bytes)
            self._rows[token] = int(arena_rows)

    def forget(self, token: int) -> None:
        with self._lock:
            self._growing.pop(token, None)
            self._rows.pop(token, None)

    def set_unaccounted(self, nbytes: int) -> None:
        """This table's share of what its process holds beyond every part and the process's own
        baseline (bytes), measured by the process's owner: a server's memory governor
        (``engine.ps.governor``) reads RSS. Allocator fragments, request buffers and RocksDB's memory
        outside its cache show only there. When larger than the fixed reserve it replaces it in
        ``rows_cap`` and ``rows_allowed``, so the RAM tier gives it room."""
        with self._lock:
            self._unaccounted = max(0, int(nbytes))

    def _reserve_locked(self) -> int:
        return max(self.reserve_bytes, self._unaccounted)

    def rows_cap(self) -> int:
        """RAM rows one shard may keep after a call (its eviction pass brings it to this or below).

        ``(budget - rocksdb - index - sketch - reserve - growing) / row_bytes / shards - headroom -
        slack``: what the budget leaves for rows, less the rows a call may add before it evicts and
        the rows handed out that a compaction waits for before it runs. At least 1024.
        """
        with self._lock:
            growing = sum(self._growing.values())
            reserve = self._reserve_locked()
        free = (self.budget_bytes - self.rocksdb_bytes - self.index_bytes - self.sketch_bytes
                - reserve - growing)
        rows = self.rows_allowed(free) - HEADROOM_ROWS - SLACK_ROWS
        return int(max(1024, min(rows, self.max_rows_per_shard - HEADROOM_ROWS)))

    def rows_allowed(self, free: int | None = None) -> int:
        """Arena rows one shard may have handed out (``S_NEXT``) within the budget now: past this the
        shard compacts its arena and gives the pages above it back."""
        if free is None:
            with self._lock:
                growing = sum(self._growing.values())
                reserve = self._reserve_locked()
            free = (self.budget_bytes - self.rocksdb_bytes - self.index_bytes - self.sketch_bytes
                    - reserve - growing)
        return int(free // self.row_bytes // self.shards)

    def parts(self) -> dict:
        """Bytes per part for all shards together (see the module docstring)."""
        with self._lock:
            growing = sum(self._growing.values())
            rows = sum(self._rows.values())
            reserve, unaccounted = self._reserve_locked(), self._unaccounted
        return {"budget": self.budget_bytes, "rows": rows * self.row_bytes, "index": self.index_bytes,
                "rocksdb": self.rocksdb_bytes, "rocksdb_block_cache": self.cache_bytes,
                "rocksdb_memtables": self.rocksdb_bytes - self.cache_bytes, "growing": growing,
                "sketch": self.sketch_bytes, "reserve": reserve, "unaccounted": unaccounted}

    def counted_bytes(self) -> int:
        """The parts this budget counts now (rows handed out, index, RocksDB, growing, sketch): what a
        governor subtracts from RSS to find the unaccounted rest."""
        p = self.parts()
        return p["rows"] + p["index"] + p["rocksdb"] + p["growing"] + p["sketch"]
