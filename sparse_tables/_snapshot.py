"""The RAM rows of a shard copied at one instant, for dumps (``SparseTable.rows``, ``dirty_dump``).

A dump copies the RAM rows it writes under the table's lock and writes them out after the lock is
released, so pushes wait only for the copy. Held in memory, the copy of a full RAM tier costs as much
RAM as the tier: at 100M keys and a 4 GB budget, 514 MB a shard, two shards saving at once, which took
a budgeted server's RSS from 1.2 to 1.45 times its budget during every base save. A table that spills
has a local disk for RocksDB; there the copy goes, chunk by chunk, into an unlinked temporary file in
the spill directory instead (``O_TMPFILE`` where the filesystem has it; elsewhere ``tempfile`` unlinks it
at once, and a claim of the directory wipes any leftover): gone when closed or when the process dies.
Its pages are the kernel's page cache, not the process's RSS, and the kernel may write them back or
drop them under memory pressure. Reading it back costs a ``pread`` per chunk.

A copy under ``SPOOL_MIN_BYTES``, a table without a spill directory, or a spool file the disk refuses
(full, read-only: logged) stays in memory, as before.
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from . import _kernels as K
from ._inputs import record_keys

log = logging.getLogger("sparse_tables.table")

SPOOL_MIN_BYTES = 64 << 20      # smaller copies stay in RAM: the file is not worth its syscalls
SPOOL_CHUNK_ROWS = 1 << 16      # rows gathered per write (6 MB at 96-byte records)


class RecordSnapshot:
    """uint32[n, stride] records of one instant, in memory or in a spool file; readable many times.

    Attributes
    ----------
    flagged_keys : uint64[k]
        Sorted keys of the records that had ``flag`` (``take``) set, e.g. the RAM rows with a copy in
        RocksDB, which a base dump's scan skips.
    """

    def __init__(self, n: int, stride: int, records: np.ndarray | None, file, flagged_keys: np.ndarray,
                 spool_dir=None):
        self._n, self._stride, self._dir = n, stride, spool_dir
        self._records, self._file = records, file
        self.flagged_keys = flagged_keys

    def __len__(self) -> int:
        return self._n

    def chunks(self, chunk_rows: int) -> Iterator[np.ndarray]:
        """Yield uint32[m, stride] blocks of at most ``chunk_rows`` records, in order (m >= 1).

        Raises
        ------
        RuntimeError
            After ``close``.
        OSError
            The spool file could not be read back.
        """
        if self._records is None and self._file is None:
            raise RuntimeError("RecordSnapshot: read after close()")
        if self._records is not None:
            for start in range(0, self._n, chunk_rows):
                yield self._records[start:start + chunk_rows]
            return
        row_bytes = self._stride * 4
        for start in range(0, self._n, chunk_rows):
            f = self._file
            if f is None:                   # closed while a reader was suspended between chunks
                raise RuntimeError("RecordSnapshot: read after close()")
            m = min(chunk_rows, self._n - start)
            out = np.empty((m, self._stride), np.uint32)
            view, off, need = memoryview(out).cast("B"), start * row_bytes, m * row_bytes
            got = 0
            while got < need:
                k = os.preadv(f.fileno(), [view[got:]], off + got)
                if k <= 0:
                    raise OSError(f"RAM rows spooled in {self._dir}: short read at byte {off + got} of "
                                  f"{self._n * row_bytes}")
                got += k
            yield out

    def close(self) -> None:
        """Drop the copy (the spool file's blocks go back to the disk)."""
        if self._file is not None:
            self._file.close()
        self._records = self._file = None


def take(arena_u: np.ndarray, rows: np.ndarray, flags_w: int, flag: int,
         spool_dir: str | Path | None) -> RecordSnapshot:
    """Copy the records of ``rows`` (int64[n], live arena rows) now; call under the table's lock.

    Parameters
    ----------
    arena_u : uint32[capacity, stride]
        The arena.
    rows : int64[n]
    flags_w : int
        Word of a record holding its flags.
    flag : int
        Flag whose records' keys are collected into ``flagged_keys`` (0: none).
    spool_dir : path or None
        Where a copy of ``SPOOL_MIN_BYTES`` or more goes (the spill directory); None: memory.
    """
    n, stride = len(rows), arena_u.shape[1]
    if spool_dir is not None and n * stride * 4 >= SPOOL_MIN_BYTES:
        try:
            return _spool(arena_u, rows, flags_w, flag, spool_dir)
        except OSError as exc:
            log.warning("RAM rows of a dump could not be spooled to %s (%s); they are copied in memory "
                        "(%d bytes)", spool_dir, exc, n * stride * 4)
    records = np.empty((n, stride), np.uint32)
    K.gather_records(arena_u, rows, records)
    return RecordSnapshot(n, stride, records, None, np.sort(_flagged(records, flags_w, flag)))


def _flagged(records: np.ndarray, flags_w: int, flag: int) -> np.ndarray:
    """Keys of the records with ``flag`` set (none when flag is 0), uint64[k] in record order."""
    if not flag:
        return np.empty(0, np.uint64)
    return record_keys(records)[(records[:, flags_w] & flag) != 0]


def _spool(arena_u, rows, flags_w, flag, spool_dir) -> RecordSnapshot:
    n, stride = len(rows), arena_u.shape[1]
    f = tempfile.TemporaryFile(dir=spool_dir, prefix="dump-", buffering=0)
    try:
        buf = np.empty((min(n, SPOOL_CHUNK_ROWS), stride), np.uint32)
        flagged = []
        for start in range(0, n, SPOOL_CHUNK_ROWS):
            m = min(SPOOL_CHUNK_ROWS, n - start)
            K.gather_records(arena_u, rows[start:start + m], buf[:m])
            flagged.append(_flagged(buf[:m], flags_w, flag))
            view, done = memoryview(buf[:m]).cast("B"), 0
            while done < len(view):
                done += f.write(view[done:])
    except BaseException:
        f.close()
        raise
    keys = np.sort(np.concatenate(flagged)) if flagged else np.empty(0, np.uint64)
    return RecordSnapshot(n, stride, None, f, keys, spool_dir)
