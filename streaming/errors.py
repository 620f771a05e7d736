"""Typed errors raised where data enters the engine (converters, stream readers).

Both are ``ValueError`` subclasses so callers that only know "bad input" can catch ``ValueError``; the
CLI maps them to exit code 2. Every message names the file and the line/row and field/column at fault.
"""
from __future__ import annotations

__all__ = ["ConvertError", "DataFormatError", "SchemaError"]


class DataFormatError(ValueError):
    """A raw input line does not follow its format (wrong field count, non-integer, non-hex, bad label),
    or a row of an Arrow input holds a value its column may not (a null, NaN or infinity, a label
    outside [0, 1]).

    Parameters
    ----------
    path : str
        The input file.
    line : int
        1-based physical line number in ``path`` (after decompression), or with ``unit="row"`` the
        1-based row of an Arrow file (counted over all its record batches).
    field : str
        The field or column at fault (``"label"``, ``"I3"``, ``"C7"``) or ``"fields"`` for a wrong
        field count.
    reason : str
        What was wrong, in "expected X, got Y" form.
    unit : {"line", "row"}
        What ``line`` counts.
    """

    def __init__(self, path: str, line: int, field: str, reason: str, *, unit: str = "line"):
        self.path = str(path)
        self.line = int(line)
        self.field = field
        self.reason = reason
        self.unit = unit
        where = f"{self.path}:{self.line}" if unit == "line" else f"{self.path}: {unit} {self.line}"
        super().__init__(f"{where}: field {field}: {reason}")

    def __reduce__(self):   # picklable across processes (prefetch threads, Ray) with its keyword
        return _rebuild_format_error, (self.path, self.line, self.field, self.reason, self.unit)


def _rebuild_format_error(path, line, field, reason, unit):
    return DataFormatError(path, line, field, reason, unit=unit)


class SchemaError(ValueError):
    """An Arrow input lacks an expected column or has it with the wrong type.

    Parameters
    ----------
    path : str
        The input file (``"<stdin>"`` or ``"<stream>"`` for non-file inputs).
    column : str
        The column at fault.
    expected : str
        The expected Arrow type (``"uint64"``).
    actual : str or None
        The type found, or ``None`` when the column is missing.
    """

    def __init__(self, path: str, column: str, expected: str, actual: str | None, present=()):
        self.path = str(path)
        self.column = column
        self.expected = expected
        self.actual = actual
        if actual is None:
            msg = (f"column {column!r}: expected {expected}, but the column is missing "
                   f"(file {self.path}; columns present: {', '.join(present) or 'none'})")
        else:
            msg = f"column {column!r}: expected {expected}, got {actual} (file {self.path})"
        super().__init__(msg)


class ConvertError(ValueError):
    """A conversion that cannot run or finish for a reason other than a malformed line: an input that
    cannot be read (truncated or corrupt gzip, an empty file) or an output directory that cannot take the
    result (a regular file, a URI, a directory holding other files). ``str()`` is ``"<path>: <what>"``;
    the output directory is left as it was.

    Parameters
    ----------
    path : str
        The input file or output directory at fault, as the caller named it.
    reason : str
    """

    def __init__(self, path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")

    def __reduce__(self):   # picklable across processes with both arguments
        return type(self), (self.path, self.reason)
