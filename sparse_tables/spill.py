"""The RocksDB tier of a shard: cold row records keyed by their uint64 key.

A record is the row's whole arena record (``RowLayout.stride`` little-endian uint32 words: key, values,
optimizer state, show, click, last_seen, tick, flags); the RocksDB key is the uint64 key big-endian, so
iteration runs in key order. Writes go in one ``WriteBatch`` per eviction pass, reads in one multi-get
per call. The tier is a cache of this process's live table, not durable state (checkpoints are):
it is wiped when opened, and its writes skip the write-ahead log.
"""
from __future__ import annotations

import itertools
import logging
import shutil
from pathlib import Path

import numpy as np
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from .errors import SpillError
from .keysets import ScalableBloom

log = logging.getLogger(__name__)


def _key_bytes(keys: np.ndarray) -> list:
    return np.frombuffer(np.ascontiguousarray(keys, dtype=">u8").tobytes(), dtype="V8").tolist()


class SpillStore:
    """Row records in RocksDB, plus a Bloom filter of every key ever written.

    Parameters
    ----------
    path : str
        Directory of the database; its previous contents are deleted.
    stride : int
        Words (uint32) per record.
    """

    def __init__(self, path: str, stride: int):
        self.path = Path(path)
        self.stride = stride
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_max_background_jobs(2)
        opts.set_write_buffer_size(64 << 20)
        try:
            self._db = Rdict(str(self.path), opts)
        except Exception as exc:  # rocksdict raises plain Exception subclasses
            raise SpillError(f"cannot open RocksDB spill store at {self.path}: {exc}") from exc
        self._write_opts = WriteOptions()
        self._write_opts.disable_wal = True
        self._bloom = ScalableBloom()
        self.count = 0  # keys present in the database
        self.reads = 0
        self.writes = 0

    @property
    def bloom_bytes(self) -> int:
        return self._bloom.nbytes

    def put(self, keys: np.ndarray, records: np.ndarray, new_mask: np.ndarray) -> None:
        """Write records in one batch. keys : uint64[m]; records : uint32[m, stride];
        new_mask : bool[m], True where the key was not in the database before (keeps ``count``)."""
        if len(keys) == 0:
            return
        wb = WriteBatch(raw_mode=True)
        vals = np.ascontiguousarray(records, dtype="<u4").view(f"V{4 * self.stride}").ravel().tolist()
        for k, v in zip(_key_bytes(keys), vals):
            wb.put(k, v)
        self._db.write(wb, self._write_opts)
        self._bloom.add(np.ascontiguousarray(keys[new_mask], dtype=np.uint64))
        self.count += int(new_mask.sum())
        self.writes += len(keys)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read the records of the keys that are present, in one multi-get.

        keys : uint64[n] -> (found : int64[m] positions into keys, records : uint32[m, stride]).
        Keys the Bloom filter rules out are not read at all.
        """
        maybe = np.flatnonzero(self._bloom.may_contain(keys))
        if len(maybe) == 0:
            return maybe, np.empty((0, self.stride), np.uint32)
        vals = self._db.get(_key_bytes(keys[maybe]))
        self.reads += len(maybe)
        hit = [i for i, v in enumerate(vals) if v is not None]
        if not hit:
            return np.empty(0, np.int64), np.empty((0, self.stride), np.uint32)
        blob = b"".join([vals[i] for i in hit])
        if len(blob) != 4 * self.stride * len(hit):
            raise SpillError(f"RocksDB spill store {self.path}: record size differs from {4 * self.stride} bytes")
        records = np.frombuffer(blob, dtype="<u4").reshape(len(hit), self.stride).copy()
        return maybe[np.asarray(hit, dtype=np.int64)], records

    def delete(self, keys: np.ndarray) -> None:
        """Delete keys known to be present (one batch)."""
        if len(keys) == 0:
            return
        wb = WriteBatch(raw_mode=True)
        for k in _key_bytes(keys):
            wb.delete(k)
        self._db.write(wb, self._write_opts)
        self.count -= len(keys)

    def snapshot(self):
        """A consistent read view of the database as of now (for ``scan``)."""
        return self._db.snapshot()

    def scan(self, snap, chunk_rows: int = 65536):
        """Yield (keys : uint64[m], records : uint32[m, stride]) from a snapshot, in key order."""
        items = iter(snap.items())
        while True:
            chunk = list(itertools.islice(items, chunk_rows))
            if not chunk:
                break
            keys = np.frombuffer(b"".join([k for k, _ in chunk]), dtype=">u8").astype(np.uint64)
            blob = b"".join([v for _, v in chunk])
            yield keys, np.frombuffer(blob, dtype="<u4").reshape(len(chunk), self.stride).copy()

    def disk_bytes(self) -> int:
        total = 0
        for prop in ("rocksdb.total-sst-files-size", "rocksdb.cur-size-all-mem-tables"):
            try:
                total += int(self._db.property_int_value(prop) or 0)
            except Exception:  # property names vary across RocksDB builds
                log.debug("RocksDB property %s unavailable", prop)
        return total

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
            shutil.rmtree(self.path, ignore_errors=True)
