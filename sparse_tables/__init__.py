"""One shard of a sparse embedding table: a Numba hash index over uint64 keys, rows of embedding values
with their optimizer state and show/click metadata, admission and expiry, and an LRU spill of cold rows
to RocksDB (in a spill directory the table claims with a marker and a lock, never one it did not make).

    >>> from sparse_tables import SparseTable, TableConfig
    >>> t = SparseTable(TableConfig(dim=16, optimizer="adagrad", spill_path=None))
"""
from .config import OPTIMIZERS, RowLayout, TableConfig, optimizer_state_width
from .errors import (SpillDirError, SpillError, SpillFailedError, TableConfigError, TableError, TableFullError,
                     TableInputError)
from .table import SparseTable

__all__ = ["SparseTable", "TableConfig", "RowLayout", "OPTIMIZERS", "optimizer_state_width",
           "TableError", "TableConfigError", "TableInputError", "SpillError", "SpillDirError",
           "SpillFailedError", "TableFullError"]
