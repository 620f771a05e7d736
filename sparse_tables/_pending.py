"""Pending deletes of a ``SpillStore``: keys whose rows are dead but whose RocksDB delete was refused.

An expiry pass removes its expired rows from RAM before it deletes their RocksDB copies; when that
write fails (disk full, a write stall past ``STALL_TIMEOUT_S``), the copies stay on disk. Forgetting
them would bring the deleted rows back on the next pull. The store keeps their keys here instead:
every read of the store treats them as absent, and every later write batch carries their deletes
ahead of its own operations, the set emptying when such a write succeeds.

The set is one sorted ``uint64`` array, never changed in place: a change makes a new array, so a read
view of the database (``SpillStore.snapshot`` / ``seek_view``) keeps the array of its instant and
filters exactly the keys that were dead then, whatever writes happen while it is read. Memory: 8 bytes
per key (a failed delete of an expiry pass of 10M disk rows: 80 MB until the next write succeeds; a
backlog over ``WRITE_BATCH_ROWS`` keys is then written in batches of its own).
"""
from __future__ import annotations

import numpy as np

from .keysets import in_sorted

EMPTY = np.empty(0, np.uint64)
EMPTY.flags.writeable = False


class PendingDeletes:
    """The sorted, immutable-array set of a store's pending deletes (see the module docstring).

    Attributes
    ----------
    keys : uint64[p]
        Sorted, unique, read-only; replaced (never modified) on every change, so a reference taken
        now keeps the set of now.
    """

    def __init__(self):
        self.keys = EMPTY

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes

    def add(self, keys: np.ndarray) -> int:
        """Add keys : uint64[n] (any order, repeats allowed). Returns how many were not pending yet."""
        if len(keys) == 0:
            return 0
        before = len(self.keys)
        merged = np.union1d(self.keys, np.asarray(keys, np.uint64))
        merged.flags.writeable = False
        self.keys = merged
        return len(merged) - before

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """keys : uint64[n] -> bool[n], True where the key is pending."""
        return in_sorted(self.keys, keys)

    def forget_first(self, n: int) -> None:
        """Forget the ``n`` smallest keys (their deletes were written)."""
        rest = self.keys[n:]
        rest.flags.writeable = False
        self.keys = rest if len(rest) else EMPTY

    def clear(self) -> None:
        """Forget every key (their deletes were written)."""
        self.keys = EMPTY
