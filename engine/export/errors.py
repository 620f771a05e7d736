"""Typed errors of export and serving. Each names the file, column or key that was wrong."""
from __future__ import annotations

from ..errors import EngineError


class ExportError(EngineError, ValueError):
    """The export input is unusable: a malformed model description, a row batch with a missing or
    mistyped column, dense parameters of the wrong size, or options that contradict the base of a
    delta. The message names the column, key or file."""


class BundleError(EngineError, ValueError):
    """A bundle cannot be loaded or patched: ``model.json`` is malformed or of another format version,
    a delta does not follow the bundle it is applied to, or predict input does not match the bundle's
    slots. The message names the file or column. (A bundle without ``_SUCCESS`` raises
    :class:`hdfs_io.NotPublishedError`, which names the path.)"""


__all__ = ["ExportError", "BundleError"]
