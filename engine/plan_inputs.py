"""The inputs of ``engine plan``: a JSON-lines file of benchmark results, read into ``Figure`` objects
that carry their source (file, line, bench and field), and the error that names a missing or malformed one.

The bench scripts print one JSON object per line with a ``bench`` field; ``SOURCES`` says which rows of
which script the plan reads. Formulas: ``engine.plan``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import EngineError


class PlanInputError(EngineError, ValueError):
    """A plan input is missing or malformed: a bench results file or line, a figure the plan needs, a
    flag value, or training data to measure. The message names the file, line, bench, field or flag."""


@dataclass(frozen=True)
class Figure:
    """One number of a plan and its source. ``kind``: ``measured`` (a bench result), ``config``, ``flag``,
    ``default`` (a flag's default, e.g. this machine), ``assumption``, ``computed`` or ``code`` (a constant
    of the engine's source)."""

    name: str
    value: float
    unit: str
    kind: str
    source: str


# ------------------------------------------------------------------------------------ bench results
def _ps(r: dict) -> bool:           # ps_bench's pull/push carry the cluster shape; table_bench's do not
    return "servers" in r


_TABLE, _CKPT = "python bench/table_bench.py --only", "python bench/ckpt_bench.py --backends local"
#: what the plan reads: name -> (bench, which rows (said in errors), rows it takes, script that writes them)
SOURCES = {
    "bytes_per_row": ("bytes_per_row", "", None, f"{_TABLE} bytes_per_row"),
    "table_pull": ("pull", "of bench/table_bench.py", lambda r: not _ps(r), f"{_TABLE} pull"),
    "table_push": ("push", "of bench/table_bench.py", lambda r: not _ps(r), f"{_TABLE} push"),
    "spill": ("spill", "", None, f"{_TABLE} spill"),
    "ps_pull": ("pull", "of bench/ps_bench.py (with 'servers')", _ps, "python bench/ps_bench.py"),
    "ps_push": ("push", "of bench/ps_bench.py (with 'servers')", _ps, "python bench/ps_bench.py"),
    "ckpt_save": ("ckpt_base_save", "with backend 'local'", lambda r: r.get("backend", "local") == "local", _CKPT),
    "ckpt_restore": ("ckpt_base_restore", "with backend 'local'", lambda r: r.get("backend", "local") == "local",
                     _CKPT),
    "scale_summary": ("scale_summary", "", None, "python bench/scale_bench.py"),
    "machine": ("machine", "", None, f"{_TABLE} machine"),
}


@dataclass(frozen=True)
class Where:
    """Rows whose ``field`` equals ``value``, a row without the field counting as ``default``;
    ``text`` says so in sources and errors (e.g. ``with compaction 'level'``)."""

    field: str
    value: object
    default: object = None

    def test(self, row: dict) -> bool:
        return row.get(self.field, self.default) == self.value

    @property
    def text(self) -> str:
        return f"with {self.field} {self.value!r}"


class BenchResults:
    """The rows of a JSON-lines bench results file, by bench.

    Each non-blank line is one JSON object with a string ``bench`` field (lines starting with ``#`` are
    comments, e.g. the date and commit of a run). Where several rows of one kind exist, the last one in
    the file is used and its figure says so.

    Raises
    ------
    PlanInputError
        From ``read``: the file cannot be read, or a line is not such an object (``FILE:LINE`` named).
    """

    def __init__(self, path: str | Path, rows: list[tuple[int, dict]]):
        self.path = str(path)
        self.rows = rows

    @classmethod
    def read(cls, path: str | Path) -> BenchResults:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise PlanInputError(f"bench results {path}: cannot read ({e.strerror or e}); write it from the "
                                 f"bench scripts' output (one JSON object per line) or pass --bench-results"
                                 ) from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:      # a binary or mis-encoded file: name the line, not a traceback
            line = data.count(b"\n", 0, e.start) + 1
            raise PlanInputError(f"{path}:{line}: not UTF-8 text (byte "
                                 f"{data[e.start]:#04x}); the bench scripts print JSON lines") from None
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            try:
                row = json.loads(s)
            except json.JSONDecodeError as e:
                raise PlanInputError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict) or not isinstance(row.get("bench"), str):
                raise PlanInputError(f"{path}:{n}: expected a JSON object with a string 'bench' field, "
                                     f"got {s[:80]!r}")
            rows.append((n, row))
        return cls(path, rows)

    def latest(self, source: str, where: Where | None = None) -> tuple[int, dict, int] | None:
        """``(line, row, matching rows)`` of the last row of ``SOURCES[source]`` (and of ``where``), or None."""
        bench, _, pick, _ = SOURCES[source]
        found = [(n, r) for n, r in self.rows if r["bench"] == bench and (pick is None or pick(r))
                 and (where is None or where.test(r))]
        return (*found[-1], len(found)) if found else None

    def figure(self, source: str, key: str, *, unit: str, name: str = "", need: str = "",
               required: bool = True, positive: bool = True, where: Where | None = None) -> Figure | None:
        """The number ``key`` of the latest row of ``source`` (of those ``where`` admits) as a measured
        ``Figure``.

        Raises
        ------
        PlanInputError
            ``required`` and no such row or field, naming the bench, the field and the script to run;
            or the field is not a finite number (> 0 when ``positive``), naming the line.
        """
        bench, which, _, script = SOURCES[source]
        if where is not None:
            which = f"{which} {where.text}".strip()
        hit = self.latest(source, where)
        if hit is None or key not in hit[1] or (hit[1][key] is None and not required):
            if not required:
                return None
            what = (f"no '{bench}' row{' ' + which if which else ''}" if hit is None
                    else f"the latest '{bench}' row (line {hit[0]}) has no field '{key}'")
            raise PlanInputError(f"bench results {self.path}: {what}; the plan needs {bench}.{key}"
                                 f"{' (' + need + ')' if need else ''}. Produce it with `{script}` and "
                                 f"append its output to {self.path}")
        n, row, count = hit
        v = row[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                positive and v <= 0):
            raise PlanInputError(f"{self.path}:{n}: {bench}.{key} must be a finite number"
                                 f"{' > 0' if positive else ''}, got {v!r}")
        src = (f"{self.path}:{n} {bench}.{key}" + (f" ({where.text})" if where is not None else "")
               + (f" (latest of {count} rows)" if count > 1 else ""))
        return Figure(name or f"{bench}.{key}", float(v), unit, "measured", src)
