"""Typed errors raised by sparse tables. All are ValueError or RuntimeError subclasses so callers that
only know the standard hierarchy still catch them."""
from __future__ import annotations


class TableError(Exception):
    """Base class of every error a sparse table raises."""


class TableConfigError(TableError, ValueError):
    """A TableConfig field has a bad value; the message names the field."""


class TableInputError(TableError, ValueError):
    """A pull/push argument has the wrong dtype, shape or contents; the table is unchanged."""


class SpillError(TableError, RuntimeError):
    """The RocksDB tier failed or holds a record that cannot be decoded."""


class SpillFailedError(SpillError):
    """A shard's RocksDB store stopped writing for good: a flush or compaction failed (a full disk, its
    directory removed, an I/O error) and RocksDB refuses every write from then on; freeing space does
    not bring it back. The table then refuses every call that reads or changes rows, since the call
    that met the failure may have applied its update in part: close the table (a server restarts from
    its newest checkpoint). ``path`` is the spill directory, ``cause`` RocksDB's error."""

    def __init__(self, message: str, path: str = "", cause: str = ""):
        super().__init__(message)
        self.path = path
        self.cause = cause


class SpillDirError(TableConfigError):
    """A spill directory cannot be used: it holds files this engine did not create (they are left
    untouched), or another table or process holds its lock. ``path`` is the directory; the message
    names it and says what to do."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path


class TableFullError(TableError, RuntimeError):
    """Loading rows would take a table past its ``max_rows``; the rows of that call were not applied.
    ``limit`` and ``rows`` (the row count the load would reach, at least) are attributes."""

    def __init__(self, message: str, limit: int = 0, rows: int = 0):
        super().__init__(message)
        self.limit = limit
        self.rows = rows
