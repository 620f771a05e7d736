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
