"""Criteo ``train.txt`` → Arrow IPC stream files.

Input layout (one example per line, no header, gzip accepted, detected by its magic bytes)::

    label \\t I1 .. I13 \\t C1 .. C26          (40 tab-separated fields; empty field = missing)

    label : "0" or "1"
    I1..I13 : decimal integers (may be negative)
    C1..C26 : hexadecimal strings (8 digits in the real data)

Output: ``OUT_DIR/part-00000.arrow, part-00001.arrow, ...`` in Arrow IPC *stream* format, every record
batch exactly ``batch_size`` rows except the very last one, with the schema of ``criteo_schema()``:

=========  ===============================  ================================================
column     type                             value
=========  ===============================  ================================================
label      float32                          0.0 / 1.0
dense      fixed_size_list<float32>[13]     ``log1p(max(I_j, 0))``; missing → 0
C1..C26    uint64                           ``keys.hash_array(slot=j, raw C_j)``; slot of
                                            ``C<j>`` is ``j`` (1..26); missing → ``missing_key(j)``
=========  ===============================  ================================================

plus ``OUT_DIR/_meta.json`` (written last) recording the sources (path, size, mtime), split, row and bad
row counts, ``hash_version`` and the schema, so ``arrow_is_current`` can tell whether the Arrow form is
stale.

The conversion is written into a new directory beside ``OUT_DIR`` (``.<name>.converting-*``, same
parent) and replaces ``OUT_DIR`` only once complete (``_staged_output``): a conversion that fails leaves
``OUT_DIR`` exactly as it was (a previous conversion there included) and no partial output anywhere.
``OUT_DIR`` is a local directory; a URI (``s3://``, ``hdfs://``) is refused (convert locally, then copy).

Canonical split: data line ``i`` (0-based over all data lines of all inputs in order, malformed lines
included) is **test** when ``i % 5 == 4`` and **train** otherwise.

Worked example (``I1 = 5``, ``I2 = -1``, ``I3`` empty, ``C3 = "68fd1e64"``)::

    "1\\t5\\t-1\\t\\t..."  →  label = 1.0, dense = [log1p(5), 0, 0, ...],
                            C3 = (3 << 48) | (xxh64(b"68fd1e64") & (2**48 - 1))
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import logging
import os
import re
import secrets
import shutil
import stat
import sys
import threading
import time
from pathlib import Path
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
from tqdm.auto import tqdm

from hdfs_io import temp_names

from . import _kernels, keys
from .criteo_synth import GeneratedCriteo, generate_criteo
from .errors import ConvertError, DataFormatError
from .prefetch import prefetch

__all__ = [
    "NUM_DENSE", "NUM_SPARSE", "SPARSE_COLUMNS", "SLOT_IDS", "criteo_schema", "convert_criteo",
    "ConvertReport", "BadRow", "ConvertError", "arrow_is_current", "is_test_row", "generate_criteo",
    "GeneratedCriteo",
]

log = logging.getLogger(__name__)

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_COLUMNS = [f"I{j}" for j in range(1, NUM_DENSE + 1)]
SPARSE_COLUMNS = [f"C{j}" for j in range(1, NUM_SPARSE + 1)]
#: slot id of every categorical column: C1 → 1, ..., C26 → 26
SLOT_IDS = {name: j for j, name in enumerate(SPARSE_COLUMNS, start=1)}
RAW_COLUMNS = ["label"] + DENSE_COLUMNS + SPARSE_COLUMNS
NUM_FIELDS = len(RAW_COLUMNS)
META_FILE = "_meta.json"
FORMAT = "criteo-arrow/1"
_MAX_LOGGED_BAD = 100


def criteo_schema() -> pa.Schema:
    """Arrow schema of converted Criteo data (metadata records ``hash_version`` and slot ids)."""
    fields = [pa.field("label", pa.float32(), nullable=False),
              pa.field("dense", pa.list_(pa.float32(), NUM_DENSE), nullable=False)]
    fields += [pa.field(c, pa.uint64(), nullable=False) for c in SPARSE_COLUMNS]
    meta = {"hash_version": str(keys.HASH_VERSION), "slots": json.dumps(SLOT_IDS), "format": FORMAT}
    return pa.schema(fields, metadata=meta)


def is_test_row(i):
    """Canonical split: data line ``i`` (0-based, file order) is test when ``i % 5 == 4``.

    Parameters
    ----------
    i : int or int64[n]

    Returns
    -------
    bool or bool[n]
    """
    return np.asarray(i) % 5 == 4


@dataclasses.dataclass(frozen=True)
class BadRow:
    """One malformed input line: ``path``, 1-based ``line``, ``field`` and ``reason``."""

    path: str
    line: int
    field: str
    reason: str


@dataclasses.dataclass
class ConvertReport:
    """What ``convert_criteo`` did.

    Attributes
    ----------
    out_dir : str
    files : list of str
        The part files written, in order.
    lines : int
        Data lines read (malformed ones included).
    rows : int
        Rows written (after dropping bad rows and applying the split).
    bad_rows : int
        Malformed lines skipped.
    bad_examples : list of BadRow
        The first 100 malformed lines.
    seconds : float
    """

    out_dir: str
    files: list
    lines: int = 0
    rows: int = 0
    bad_rows: int = 0
    bad_examples: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def lines_per_s(self) -> float:
        return self.lines / self.seconds if self.seconds > 0 else 0.0


def _source_info(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def arrow_is_current(inputs, out_dir, *, split=None) -> bool:
    """True when ``out_dir`` holds a complete conversion of exactly these ``inputs`` (same paths, sizes,
    mtimes), with this ``split`` and the current ``keys.HASH_VERSION``."""
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    try:
        meta = json.loads((Path(out_dir) / META_FILE).read_text())
        sources = [_source_info(os.fspath(p)) for p in inputs]
    except (OSError, ValueError):
        return False
    return (meta.get("format") == FORMAT and meta.get("hash_version") == keys.HASH_VERSION
            and meta.get("split") == split and meta.get("sources") == sources
            and all((Path(out_dir) / f).is_file() for f in meta.get("files", [])))


class _PartWriter:
    """Fills fixed-size column buffers and writes full record batches to rotating IPC stream files."""

    def __init__(self, out_dir: Path, batch_size: int, batches_per_file: int):
        self.out_dir, self.batch_size, self.batches_per_file = out_dir, batch_size, batches_per_file
        self.schema = criteo_schema()
        self.files: list[str] = []
        self.rows = 0
        self._writer = None
        self._sink = None
        self._batches_in_file = 0
        self._label = np.empty(batch_size, np.float32)
        self._dense = np.empty((batch_size, NUM_DENSE), np.float32)
        self._sparse = np.empty((NUM_SPARSE, batch_size), np.uint64)
        self._fill = 0

    def add(self, label, dense, sparse):
        """Append rows: ``label : float32[n]``, ``dense : float32[n, 13]``, ``sparse : uint64[26, n]``."""
        n, pos = len(label), 0
        while pos < n:
            take = min(n - pos, self.batch_size - self._fill)
            f = self._fill
            self._label[f:f + take] = label[pos:pos + take]
            self._dense[f:f + take] = dense[pos:pos + take]
            self._sparse[:, f:f + take] = sparse[:, pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == self.batch_size:
                self._flush()

    def _flush(self):
        n = self._fill
        if n == 0:
            return
        if self._writer is None or self._batches_in_file == self.batches_per_file:
            self._close_file()
            name = f"part-{len(self.files):05d}.arrow"
            self._sink = pa.OSFile(str(self.out_dir / name), "wb")
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
            self.files.append(name)
            self._batches_in_file = 0
        cols = [pa.array(self._label[:n].copy()),
                pa.FixedSizeListArray.from_arrays(pa.array(self._dense[:n].ravel().copy()), NUM_DENSE)]
        cols += [pa.array(self._sparse[j, :n].copy()) for j in range(NUM_SPARSE)]
        self._writer.write_batch(pa.RecordBatch.from_arrays(cols, schema=self.schema))
        self._batches_in_file += 1
        self.rows += n
        self._fill = 0

    def _close_file(self):
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None

    def close(self):
        self._flush()
        self._close_file()


#: bytes of the converter's batch buffers per row: label float32, dense float32[13], keys uint64[26]
ROW_BUFFER_BYTES = 4 + 4 * NUM_DENSE + 8 * NUM_SPARSE
#: most rows per record batch (about 1.1 GB of buffers, allocated when the conversion starts); 2^62 ended
#: in numpy's "array is too big" with nothing naming the batch size
MAX_BATCH_SIZE = 1 << 22


class _LineMapper:
    """Maps ranks of valid rows (as the CSV reader emits them) back to 0-based line indices, given the
    lines the reader rejected (field-count errors), which arrive in line order before the batch that
    follows them. The k-th valid row is on line ``k + #{j : bad_j - j <= k}``."""

    def __init__(self):
        self.pending: list[tuple[int, str, int]] = []  # (line index, text, field count), not consumed
        self.consumed = 0  # rejected lines known to precede the current batch
        self._lock = threading.Lock()  # the handler runs on the reader (prefetch) thread

    def handler(self, row) -> str:
        if row.number is None or row.number < 1:
            raise RuntimeError("pyarrow CSV reader did not report a line number (use_threads must be off)")
        with self._lock:
            self.pending.append((row.number - 1, row.text, row.actual_columns))
        return "skip"

    def map(self, k0: int, n: int):
        """Line indices ``int64[n]`` of valid ranks ``k0..k0+n-1``, and the rejected lines before the
        last of them (popped from ``pending``)."""
        ranks = np.arange(k0, k0 + n, dtype=np.int64)
        with self._lock:
            pending = list(self.pending)
        if not pending:
            return ranks + self.consumed, []
        b = np.fromiter((p[0] for p in pending), dtype=np.int64, count=len(pending))
        gap = b - np.arange(self.consumed, self.consumed + len(b))
        lines = ranks + self.consumed + np.searchsorted(gap, ranks, side="right")
        m = int(np.searchsorted(gap, k0 + n - 1, side="right")) if n else 0
        return lines, self.take(m)

    def take(self, m: int):
        with self._lock:
            done, self.pending = self.pending[:m], self.pending[m:]
        self.consumed += m
        return done


def _open_input(path: str):
    raw = pa.OSFile(path, "r")
    magic = raw.read(2)
    raw.seek(0)
    stream = pa.CompressedInputStream(raw, "gzip") if magic == b"\x1f\x8b" else raw
    return raw, stream


#: pyarrow's error when the invalid-row handler could not take a line: it decodes the line as UTF-8
#: before calling ``_LineMapper.handler``, so a line that is not UTF-8 (binary data) fails there
_UNHANDLED_ROW = re.compile(r"CSV parse error: Row #(\d+): Expected (\d+) columns, got (\d+)")


@contextlib.contextmanager
def _quiet_undecodable_rows():
    """Drop the "Exception ignored" traceback pyarrow prints when a rejected line is not UTF-8 (its
    decoding, before ``_LineMapper.handler``, fails); the parse error it raises next is worded by
    ``_read_error``. Every other unraisable exception goes to the previous hook."""
    previous = sys.unraisablehook

    def hook(u):
        if not (isinstance(u.exc_value, UnicodeDecodeError)
                and isinstance(getattr(u.object, "__self__", None), _LineMapper)):
            previous(u)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _read_error(path: str, e: Exception) -> ConvertError:
    """The ``ConvertError`` naming input ``path`` for an error pyarrow raised while reading it (shared
    with ``streaming.text``)."""
    msg = str(e)
    m = _UNHANDLED_ROW.search(msg)
    if m:       # not the line's text: it is binary, and would be printed raw
        return ConvertError(path, f"line {m.group(1)}: not UTF-8 text (a binary file?), and {m.group(3)} "
                                  f"tab-separated fields where {m.group(2)} are expected")
    if "Truncated compressed stream" in msg:
        return ConvertError(path, "truncated gzip data: the file ends inside its compressed stream (an "
                                  "incomplete copy or download?)")
    if "Empty CSV file" in msg:
        return ConvertError(path, "empty file: no data lines")
    return ConvertError(path, f"cannot read: {msg}")


def _read_guarded(path: str, batches):
    """Iterate ``batches``, turning a read error (``OSError``, ``ArrowInvalid``) into ``_read_error``."""
    it = iter(batches)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except (OSError, pa.ArrowInvalid) as e:
            raise _read_error(path, e) from e
        yield item


def _check_out_dir(out: Path, given: str, owned) -> None:
    """Refuse an ``out`` the swap of ``_staged_output`` would damage (see there)."""
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise ConvertError(given, "exists and is not a directory")
    if os.path.ismount(out):
        raise ConvertError(given, "is a mount point, and a conversion replaces its output directory as a "
                                  "whole: convert into a directory inside it")
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = ""
    if cwd == str(out) or cwd.startswith(str(out) + os.sep):
        raise ConvertError(given, "is (or holds) the current directory, and a conversion replaces its output "
                                  "directory as a whole: run from elsewhere or convert into a new directory")
    with os.scandir(out) as entries:
        foreign = sorted(e.name for e in entries if not owned(e))
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise ConvertError(given, f"holds {', '.join(map(repr, foreign[:3]))}{more}, which a conversion does "
                                  "not write, and a conversion replaces its output directory as a whole: "
                                  "convert into a new or empty directory")


def _swap_in(new: Path, out: Path, given: str) -> None:
    """Put directory ``new`` at ``out`` (same parent): rename a previous ``out`` aside, ``new`` in, then
    delete the old one; if the second rename fails the old one goes back."""
    try:
        if not os.path.lexists(out):
            os.rename(new, out)
            return
        os.chmod(new, stat.S_IMODE(os.stat(out).st_mode))   # keep the directory's permissions
        aside = out.parent / f".{out.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, aside)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(aside, out)
            raise
    except OSError as e:
        raise ConvertError(given, f"cannot put the new conversion in place (the directory was left as it "
                                  f"was): {e}") from e
    try:
        shutil.rmtree(aside)
    except OSError as e:
        log.warning("the new conversion is in %s, but its previous contents (moved to %s) could not be "
                    "removed: %s", out, aside, e)


@contextlib.contextmanager
def _staged_output(out_dir, owned):
    """Yield a new empty directory beside ``out_dir`` (same parent, so the final rename is atomic on a
    local disk) to write a conversion into. On a normal exit it replaces ``out_dir`` (created if missing,
    a previous conversion there removed only once the new one is in place); on an exception it is
    removed, with any parent directories this created, and ``out_dir`` stays as it was. Shared with
    ``streaming.text``.

    Parameters
    ----------
    out_dir : str or PathLike
        A local directory (a symlink to one: its target is replaced).
    owned : callable, os.DirEntry -> bool
        Whether an entry of an existing ``out_dir`` is conversion output; anything else is refused, since
        the swap would delete it.

    Raises
    ------
    ConvertError
        ``out_dir`` is a URI, not a directory, a mount point, (holds) the current directory, holds
        entries ``owned`` rejects, or cannot be created or replaced.
    """
    given = os.fspath(out_dir)
    if "://" in given:
        raise ConvertError(given, "a URI, but a conversion writes a local directory (convert locally, then "
                                  "copy the directory)")
    out = Path(os.path.realpath(given))
    _check_out_dir(out, given, owned)
    missing = [d for d in (out.parent, *out.parent.parents) if not os.path.lexists(d)]  # deepest first
    if not missing:         # staging directories of conversions of out_dir killed on this host
        for left in temp_names.stale(os.listdir(out.parent), out.name, "converting"):
            log.warning("removing %s: the staging directory of a conversion into %s that was killed",
                        out.parent / left, given)
            shutil.rmtree(out.parent / left, ignore_errors=True)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = out.parent / temp_names.temp_name(out.name, "converting")
        stage.mkdir()
    except OSError as e:
        _remove_empty(missing)
        raise ConvertError(given, f"cannot create a directory beside it: {e}") from e
    try:
        yield stage
        _check_out_dir(out, given, owned)   # nothing appeared meanwhile that the swap would delete
        _swap_in(stage, out, given)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_empty(missing)
        raise


def _remove_empty(dirs) -> None:
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass


def _criteo_owned(entry: os.DirEntry) -> bool:
    return (not entry.is_dir(follow_symlinks=False)
            and (fnmatch.fnmatchcase(entry.name, "part-*.arrow") or entry.name in (META_FILE, META_FILE + ".tmp")))


def _describe(value: bytes) -> str:
    return repr(value.decode("utf-8", errors="replace"))


def _reason(code: int, value: bytes) -> tuple[str, str]:
    field = RAW_COLUMNS[code - 1]
    if code == 1:
        return field, f"expected 0 or 1, got {_describe(value)}"
    if code <= 1 + NUM_DENSE:
        if value.isdigit():     # an integer, but beyond float64 (parse_log1p_ints)
            return field, (f"expected an integer below 1.8e308 (its log1p must be finite), got a "
                           f"{len(value)}-digit integer ({value[:12].decode()}...)")
        return field, f"expected an integer, got {_describe(value)}"
    return field, f"expected hexadecimal digits, got {_describe(value)}"


class _BadRowPolicy:
    def __init__(self, max_bad_rows, report: ConvertReport):
        self.max_bad_rows, self.report = max_bad_rows, report

    def __call__(self, bad: BadRow):
        if self.max_bad_rows is not None and self.report.bad_rows >= self.max_bad_rows:
            raise DataFormatError(bad.path, bad.line, bad.field,
                                  bad.reason + f" (more than max_bad_rows={self.max_bad_rows} malformed "
                                  "lines; raise max_bad_rows (engine convert and predict: --max-bad-rows; engine train: "
                                  "model.data.max_bad_rows) to skip them)")
        self.report.bad_rows += 1
        if len(self.report.bad_examples) < _MAX_LOGGED_BAD:
            self.report.bad_examples.append(bad)
            log.warning("skipping malformed line %s:%d: field %s: %s", bad.path, bad.line, bad.field,
                        bad.reason)
            if len(self.report.bad_examples) == _MAX_LOGGED_BAD:
                log.warning("further malformed lines are counted but not logged")


def _convert_batch(rb: pa.RecordBatch, lines_abs, path, split, writer, prefixes, missing, line_base):
    """Parse, hash, validate and write one CSV record batch of raw binary columns."""
    n = rb.num_rows
    status = np.zeros(n, np.int16)
    label = np.empty(n, np.float32)
    dense_t = np.empty((NUM_DENSE, n), np.float32)
    sparse = np.empty((NUM_SPARSE, n), np.uint64)
    bufs = [keys.arrow_buffers(rb.column(c)) for c in range(NUM_FIELDS)]
    mask = np.uint64(keys.HASH_MASK)
    with np.errstate(over="ignore"):
        _kernels.parse_labels(bufs[0][0], bufs[0][1], 1, label, status)
        for j in range(NUM_DENSE):
            _kernels.parse_log1p_ints(bufs[1 + j][0], bufs[1 + j][1], 2 + j, dense_t[j], status)
        for j in range(NUM_SPARSE):
            o, d, v, vb, hv = bufs[1 + NUM_DENSE + j]
            _kernels.hash_values(o, d, v, vb, hv, prefixes[j], mask, missing[j], True, True,
                                 2 + NUM_DENSE + j, sparse[j], status)
    bad_idx = np.flatnonzero(status)
    bad = []
    if len(bad_idx):
        lengths = np.zeros(n, np.int64)
        for b in bufs:
            _kernels.row_byte_lengths(b[0], lengths)
        for i in bad_idx:
            line = int(lines_abs[i]) - line_base + 1
            if lengths[i] == 0:  # pyarrow gives an empty line 40 empty fields: indistinguishable
                bad.append(BadRow(path, line, "label", "expected 0 or 1, got an empty line (or a line "
                                  "of empty fields)"))
            else:
                code = int(status[i])
                field, reason = _reason(code, rb.column(code - 1)[int(i)].as_py())
                bad.append(BadRow(path, line, field, reason))
    keep = status == 0
    if split is not None:
        test = is_test_row(lines_abs)
        keep &= test if split == "test" else ~test
    sel = np.flatnonzero(keep)
    if len(sel) == n:
        writer.add(label, dense_t.T, sparse)
    elif len(sel):
        writer.add(label[sel], dense_t.T[sel], sparse[:, sel])
    return bad


def convert_criteo(inputs, out_dir, *, split: str | None = None, batch_size: int = 8192,
                   rows_per_file: int = 1 << 20, max_bad_rows: int | None = 0,
                   progress: bool | None = None, block_size: int = 1 << 22) -> ConvertReport:
    """Convert Criteo ``train.txt``-layout files into Arrow IPC stream files (see the module docstring).

    Parameters
    ----------
    inputs : str or PathLike, or a sequence of them
        Text files, plain or gzip. Several inputs are read as one concatenated stream (the split's line
        index continues across them).
    out_dir : str or PathLike
        A local directory: created if needed (with its parents), else replaced as a whole once the new
        conversion is complete; it may hold only a previous conversion (``part-*.arrow``, ``_meta.json``).
        On any error it is left as it was.
    split : None, "train" or "test"
        Keep all rows, or only the canonical train (``i % 5 != 4``) or test (``i % 5 == 4``) rows.
    batch_size : int, rows
        Rows per record batch (the last batch of the output may be shorter).
    rows_per_file : int, rows
        Rows per part file, rounded up to a whole number of batches.
    max_bad_rows : int or None
        Malformed lines to skip (each logged and counted) before failing; 0 = fail on the first one,
        None = skip all.
    progress : bool or None
        Show a tqdm progress bar (bytes read); None = only when stderr is a terminal.
    block_size : int, bytes
        CSV reader block size.

    Returns
    -------
    ConvertReport

    Raises
    ------
    DataFormatError
        On the ``max_bad_rows + 1``-th malformed line (naming file, 1-based line and field).
    ConvertError
        An input cannot be read (truncated or corrupt gzip, an empty file), or ``out_dir`` cannot take the
        conversion (a regular file, a URI, a directory holding other files, not writable); names the path.
    FileNotFoundError
        If an input does not exist.
    ValueError
        On bad arguments (``batch_size`` outside [1, ``MAX_BATCH_SIZE``], ``rows_per_file`` below 1, ...).
    OSError
        Writing the output failed (e.g. the disk is full); ``out_dir`` is left as it was.
    """
    t0 = time.perf_counter()
    paths = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    if not paths:
        raise ValueError("convert_criteo needs at least one input file")
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be None, 'train' or 'test', got {split!r}")
    if batch_size < 1 or rows_per_file < 1:
        raise ValueError(f"batch_size and rows_per_file must be >= 1, got {batch_size}, {rows_per_file}")
    if batch_size > MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be <= {MAX_BATCH_SIZE} (its buffers are allocated up front: "
                         f"{ROW_BUFFER_BYTES} bytes per row), got {batch_size}")
    if max_bad_rows is not None and max_bad_rows < 0:
        raise ValueError(f"max_bad_rows must be >= 0 or None, got {max_bad_rows}")
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"Criteo input not found: {p}")
    sources = [_source_info(p) for p in paths]
    report = ConvertReport(out_dir=str(Path(out_dir)), files=[])
    with _staged_output(out_dir, _criteo_owned) as stage:
        writer = _PartWriter(stage, batch_size, -(-rows_per_file // batch_size))
        report.files = writer.files
        show = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(total=sum(s["size"] for s in sources), unit="B", unit_scale=True, disable=not show,
                   desc="convert criteo")
        try:
            report.lines = _convert_inputs(paths, sources, split, writer, _BadRowPolicy(max_bad_rows, report),
                                           bar, block_size)
            writer.close()
        finally:
            bar.close()
            writer._close_file()
        report.rows = writer.rows
        report.seconds = time.perf_counter() - t0
        meta = {"format": FORMAT, "hash_version": keys.HASH_VERSION, "sources": sources, "split": split,
                "lines": report.lines, "rows": report.rows, "bad_rows": report.bad_rows,
                "batch_size": batch_size, "files": writer.files, "slots": SLOT_IDS,
                "schema": criteo_schema().to_string(show_schema_metadata=False)}
        (stage / META_FILE).write_text(json.dumps(meta, indent=1))
    log.info("converted %d lines from %s into %d rows in %d files (%d malformed lines skipped), "
             "%.0f lines/s", report.lines, ", ".join(paths), report.rows, len(writer.files),
             report.bad_rows, report.lines_per_s)
    return report


def _convert_inputs(paths, sources, split, writer: _PartWriter, policy: _BadRowPolicy, bar,
                    block_size: int) -> int:
    """Read every input in order into ``writer``; returns the data lines read."""
    prefixes = [keys.slot_prefix(SLOT_IDS[c]) for c in SPARSE_COLUMNS]
    missing = [keys.missing_key(SLOT_IDS[c]) for c in SPARSE_COLUMNS]
    line_base = 0
    bytes_before = 0
    for path, source in zip(paths, sources):
        mapper = _LineMapper()
        try:
            raw, stream = _open_input(path)
        except OSError as e:
            raise _read_error(path, e) from e
        with raw, _quiet_undecodable_rows():
            try:
                reader = pacsv.open_csv(
                    stream,
                    read_options=pacsv.ReadOptions(column_names=RAW_COLUMNS, block_size=block_size,
                                                   use_threads=False),
                    parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False,
                                                     escape_char=False, newlines_in_values=False,
                                                     ignore_empty_lines=False,
                                                     invalid_row_handler=mapper.handler),
                    convert_options=pacsv.ConvertOptions(
                        column_types={c: pa.binary() for c in RAW_COLUMNS}, strings_can_be_null=False,
                        quoted_strings_can_be_null=False))
            except (OSError, pa.ArrowInvalid) as e:
                raise _read_error(path, e) from e
            k = 0
            last = 0
            # parsing (pyarrow, GIL released) overlaps the Numba kernels below
            with contextlib.closing(prefetch(reader, 2, name="criteo-csv")) as parsed:
                for rb in _read_guarded(path, parsed):
                    lines, rejected = mapper.map(k, rb.num_rows)
                    k += rb.num_rows
                    bad = [BadRow(path, ln + 1, "fields",
                                  f"expected {NUM_FIELDS} tab-separated fields, got {nf}")
                           for ln, _text, nf in rejected]
                    bad += _convert_batch(rb, lines + line_base, path, split, writer, prefixes, missing,
                                          line_base)
                    for b in sorted(bad, key=lambda b: b.line):
                        policy(b)
                    if len(lines):
                        last = int(lines[-1]) + 1
                    bar.update(bytes_before + raw.tell() - bar.n)
            for ln, _text, nf in mapper.take(len(mapper.pending)):  # reader thread has finished
                policy(BadRow(path, ln + 1, "fields", f"expected {NUM_FIELDS} tab-separated fields, "
                              f"got {nf}"))
                last = max(last, ln + 1)
            line_base += last
            bytes_before += source["size"]
    return line_base
