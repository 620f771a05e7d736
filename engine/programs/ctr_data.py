"""Data of the CTR programs: where the train/test Arrow files come from, and the batches a worker reads.

``DataConfig.source`` decides (``prepare_data`` runs once, in the launcher, before any worker starts):

==============  ====================================================================================
shared_criteo   the shared Criteo rows (``criteo_path``, default ``../shared/data/criteo/train.txt``)
                converted with the canonical split (row i is test when ``i % 5 == 4``) into
                ``cache_dir`` unless the Arrow form there is current; when the file is missing and
                ``fallback: generated``, a Criteo-format file drawn from a planted logistic model
                (``generated_rows`` rows, ``generated_seed``) is generated and used instead (logged).
criteo          the same for any Criteo ``train.txt``-layout file; a missing file is an error. A URI
                (``s3://bucket/train.txt``) is copied into ``cache_dir`` first, again only when the
                object changed (``streaming.inputs.fetch``).
generated       always the planted-model file.
arrow           ``train_path`` / ``test_path``: Arrow IPC / Parquet files or directories, used as
                they are (schema-checked); local paths, or URIs (``s3://bucket/train``,
                ``hdfs://nn:8020/data/train``) read from the store directly with the config's
                ``storage`` section (``streaming.inputs``; the functions here take its
                ``storage_options``)
==============  ====================================================================================

After ``prepare_data`` the config the workers see has ``source: arrow`` and absolute paths.

A batch (``CTRBatch``) is the arrays the model needs: ``labels : float32[B]``, ``dense :
float32[B, dense_dim]``, ``keys : uint64[B, S]`` (one key per example and slot: Criteo has exactly one
value per categorical field; a missing value is its slot's ``missing_key``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from streaming.criteo import (SLOT_IDS, SPARSE_COLUMNS, arrow_is_current, convert_criteo, criteo_schema,
                              generate_criteo)
from streaming.inputs import CHANGED, InputChangedError, RemoteInput, fetch, is_uri, list_remote_unread
from streaming.source import (ArrowSource, check_inputs, count_rows, list_files, local_version, open_file,
                              read_schema, row_ranges)
from streaming.values import dense_values, first, label_problem, list_values

from ..program_configs import DataConfig
from ..ps import _kernels as ps_kernels
from ..errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class CTRBatch:
    """One mini-batch as arrays: ``labels : float32[B]``, ``dense : float32[B, D]``,
    ``keys : uint64[B, S]``."""

    labels: np.ndarray
    dense: np.ndarray
    keys: np.ndarray

    @property
    def size(self) -> int:
        return len(self.labels)


def expected_schema(slots, dense_dim: int) -> pa.Schema:
    """The columns a CTR worker reads: ``label``, ``dense`` (if ``dense_dim``), then ``slots``.

    Raises
    ------
    ConfigError
        A slot name that is not a Criteo categorical column or is listed twice, or ``dense_dim`` other
        than 0 or 13.
    """
    full = criteo_schema()
    bad = [s for s in slots if s not in SPARSE_COLUMNS]
    if bad:
        raise ConfigError(f"model.slots: unknown column(s) {bad}; expected names among C1..C26")
    twice = sorted({s for s in slots if list(slots).count(s) > 1})
    if twice:
        raise ConfigError(f"model.slots: {twice} listed more than once; each slot is one column and one "
                          f"embedding per example")
    if dense_dim not in (0, full.field("dense").type.list_size):
        raise ConfigError(f"model.dense_dim must be 0 or {full.field('dense').type.list_size} for Criteo "
                          f"data, got {dense_dim}")
    names = ["label"] + (["dense"] if dense_dim else []) + list(slots)
    return pa.schema([full.field(n) for n in names], metadata=full.metadata)


def to_batch(rb: pa.RecordBatch, slots, dense_dim: int) -> CTRBatch:
    """Arrays of one record batch (columns as in ``expected_schema``; slices handled)."""
    n = rb.num_rows
    labels = np.ascontiguousarray(rb.column("label").to_numpy(), np.float32)
    if dense_dim:
        dense = list_values(rb.column("dense")).to_numpy().reshape(n, dense_dim).astype(np.float32, copy=False)
    else:
        dense = np.zeros((n, 0), np.float32)
    keys = np.empty((n, len(slots)), np.uint64)
    for j, s in enumerate(slots):
        keys[:, j] = rb.column(s).to_numpy()
    return CTRBatch(labels, np.ascontiguousarray(dense), keys)


def check_values(rb: pa.RecordBatch):
    """The first value of a record batch (columns as in ``expected_schema``) that a CTR model cannot
    train on, as ``(column, row, reason)`` (``row`` 0-based in ``rb``), or None. ``ArrowSource``'s
    ``check``: it raises ``DataFormatError`` naming the file and the row of the file.

    Refused (``streaming.values``, as the predictor refuses them): a null label or a label outside
    [0, 1] (NaN included: the logloss needs a probability); a null ``dense`` list or a null, NaN or
    infinite value in one; and here a null key (a slot's missing value has its own key,
    ``streaming.keys.missing_key``, as ``engine convert`` writes and a string slot's hashing gives).
    """
    bad = label_problem(rb.column("label"))
    if bad is not None:
        return ("label", *bad)
    if "dense" in rb.schema.names:
        col = rb.column("dense")
        bad = dense_values(col, col.type.list_size)[1]
        if bad is not None:
            return ("dense", *bad)
    for name in rb.schema.names:
        col = rb.column(name)
        if col.null_count and name not in ("label", "dense"):
            return name, first(col.is_null()), ("expected a key, got null (write the slot's missing key, "
                                                "streaming.keys.missing_key, for an absent feature)")
    return None


def dedup_batch(batch: CTRBatch):
    """Unique keys of a batch and the sparse index into them, in O(B*S) (no sort).

    Returns
    -------
    uniq : uint64[u]
        In first-occurrence order (the model and the servers treat every key on its own, so the
        order changes no result).
    rows : int32[B*S]
        ``uniq[rows[i]]`` is occurrence ``i`` (row-major over (example, slot)).
    segments : int32[B*S]
        Cell of each occurrence: ``example * S + slot``.
    shows : float32[u]
        Occurrences of each unique key.
    clicks : float32[u]
        Sum of the labels of the examples each key occurs in.
    """
    flat = np.ascontiguousarray(batch.keys.reshape(-1))
    n = len(flat)
    uniq = np.empty(n, np.uint64)
    inverse = np.empty(n, np.int64)
    nu = ps_kernels.dedup(flat, uniq, inverse)  # the PS client's O(n) first-occurrence dedup
    shows = np.empty(nu, np.float32)
    clicks = np.empty(nu, np.float32)
    ps_kernels.segment_sum_1d(np.ones(n, np.float32), inverse, shows)  # integer counts: exact
    per_key_labels = np.repeat(batch.labels.astype(np.float32), max(1, batch.keys.shape[1]))
    ps_kernels.segment_sum_1d(per_key_labels, inverse, clicks)
    segments = np.arange(n, dtype=np.int32)
    return uniq[:nu], inverse.astype(np.int32), segments, shows, clicks


def string_slots(schema: pa.Schema) -> dict[str, int]:
    """The slot columns of ``schema`` that may arrive as raw strings -> their slot ids (``SLOT_IDS``:
    ``C<j>`` is slot ``j``). ``ArrowSource`` hashes such a column with ``streaming.keys.hash_array(slot,
    values, empty_is_missing=True)``, the function and slot ids ``engine predict`` hashes a raw string
    column of a bundle with, so a model trained on raw strings scores them alike."""
    return {name: SLOT_IDS[name] for name in schema.names if name in SLOT_IDS}


def make_source(path, *, batch_size: int, schema: pa.Schema, rank: int, num_workers: int,
                shuffle_buffer: int = 0, seed: int = 0, prefetch: int = 4, file_rows=None,
                storage_options=None, versions=None) -> ArrowSource:
    """This worker's shard of ``path`` (a path, a URI, or the inputs as ``list_files`` listed them). With
    ``file_rows`` (``file_rows(path)``: the rows of each input, as the train split is read) a balanced split of
    the rows: worker ``w`` reads rows ``[N*w // W, N*(w+1) // W)`` of the inputs in reading order
    (``streaming.source.row_ranges``), ``N // W`` or ``N // W + 1`` rows whatever the files' sizes and record
    batches, and opens only the files of its range. Without them (the test split: nothing is counted) whole
    files when there are at least as many files as workers, else every ``num_workers``-th record batch. Slot
    columns may hold uint64 keys or raw strings (hashed: ``string_slots``); values are checked
    (``check_values``) when ``schema`` has a label. ``storage_options`` (``hdfs_io.StorageOptions``) reach a URI
    ``path``'s store. ``versions`` (``local_versions`` of the inputs as listed, or as ``check_unchanged`` last
    found them): a local file is read only as that version (``ArrowSource``), never as one written since."""
    files = list_files(path, storage_options=storage_options)
    shard_by = "rows" if file_rows is not None else "files" if len(files) >= num_workers else "batches"
    return ArrowSource(files, batch_size=batch_size, schema=schema, string_slots=string_slots(schema),
                       shuffle_buffer=shuffle_buffer,
                       seed=seed * 1009 + rank if shuffle_buffer else None, prefetch=prefetch,
                       shard=(rank, num_workers), shard_by=shard_by, file_rows=file_rows, versions=versions,
                       check=check_values if "label" in schema.names else None)


def file_rows(path, storage_options=None) -> list[int]:
    """Rows of each input of ``path`` (``list_files`` order): ``int[F]``, from metadata: Parquet's and IPC
    files' footers, IPC streams' message headers (``streaming.source.count_rows``).

    Raises
    ------
    FileNotFoundError, streaming.errors.DataFormatError
        A missing path; an unreadable input (named).
    """
    return [count_rows(f) for f in list_files(path, storage_options=storage_options)]


def shard_sizes(rows_of_files, num_workers: int) -> list[int]:
    """Rows of every worker's shard of the train split (``make_source`` with ``file_rows``):
    ``int[W]``, each ``N // W`` or ``N // W + 1``."""
    return [hi - lo for lo, hi in row_ranges(rows_of_files, num_workers)]


def untrained_rows(sizes, steps: int, batch_size: int) -> int:
    """Rows per epoch that ``steps`` batches of ``batch_size`` leave unread on workers whose shards hold
    ``sizes`` rows (a lockstep mode's count of steps: the smallest shard's)."""
    return sum(max(0, n - steps * batch_size) for n in sizes)


def check_train_split(path: str, schema: pa.Schema, storage_options=None) -> int:
    """Read every row of the train split ``path`` and check every value a worker checks (``check_values``:
    labels, dense values, null keys), before any process starts -> the number of rows. A bad value deep
    in a file then ends the job before anything is trained, not in the middle of an epoch, when a
    repaired file could no longer resume the job's checkpoints (their positions were taken on the file
    as it was). Read: the label and dense columns; the uint64 slot columns of IPC inputs (read whole
    anyway) and of Parquet files whose metadata does not say the column has no null; never a raw string
    slot (a null string is its slot's missing key).

    Raises
    ------
    streaming.errors.DataFormatError, streaming.errors.SchemaError
        The first bad value or input, named with the file, the row and the column.
    """
    return sum(check_train_files(list_files(path, storage_options=storage_options), schema))


def check_train_files(files, schema: pa.Schema) -> list[int]:
    """``check_train_split`` of the inputs as ``list_files`` listed them -> ``int[F]``, the rows of each
    (the same counts as ``file_rows``). Raises as ``check_train_split``."""
    rows = []
    for f in files:
        got = read_schema(f)
        names = [n for n in schema.names if n in ("label", "dense") or got.field(n).type == pa.uint64()]
        if f.endswith((".parquet", ".pq")):
            names = [n for n in names if n in ("label", "dense") or not _parquet_no_nulls(f, n)]
        src = ArrowSource([f], batch_size=1 << 16, schema=pa.schema([schema.field(n) for n in names]),
                          prefetch=0, check=check_values)
        rows.append(sum(rb.num_rows for rb in src.batches(0)))
    return rows


def _parquet_no_nulls(path, column: str) -> bool:
    """Whether the statistics of every row group of the Parquet file ``path`` (a path or a
    ``streaming.inputs.RemoteInput``) say ``column`` holds no null."""
    import pyarrow.parquet as pq
    with open_file(path) as f:
        md = pq.ParquetFile(f).metadata
    leaves = [k for k in range(md.num_columns) if md.schema.column(k).path == column]   # a top-level uint64
    if len(leaves) != 1:
        return False
    j = leaves[0]
    for i in range(md.num_row_groups):
        st = md.row_group(i).column(j).statistics
        if st is None or not st.has_null_count or st.null_count:
            return False
    return True


#: bytes of each end of a file that ``files_fingerprint`` reads
FINGERPRINT_BYTES = 1 << 16
#: blocks between the two ends that ``files_fingerprint`` reads, and the bytes of each: at most 256 KiB
#: more per file, the whole middle of a file up to 384 KiB
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 1 << 12
#: ranged reads of one file on an object store that ``files_fingerprint`` has in flight at once (its 66
#: reads would otherwise cost 66 round trips, ~2 s per file at S3's typical 30 ms)
FINGERPRINT_REQUESTS = 16


def files_fingerprint(path, storage_options=None) -> list[list]:
    """What a data position depends on in the inputs of ``path`` (a file or directory, a URI, or the inputs as
    ``list_files`` listed them; read as ``make_source`` reads it): ``[[name, size, crc, inner], ...]`` in
    reading order, ``name`` relative to the directory (the file name for a file), ``size`` in bytes, ``crc`` the
    CRC-32 (8 hex digits) of the file's first and last ``FINGERPRINT_BYTES`` bytes (the whole file when
    smaller), ``inner`` the CRC-32 of ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES`` bytes spread evenly between
    the two ends (the whole middle when it is no larger; "00000000" when there is none).

    Names and sizes find added, removed, renamed, grown and cut files; the CRC of both ends a rewrite of
    the same size (a re-conversion of other rows in fixed-width columns: other first rows, another last
    batch), and the inner blocks one that changed rows inside the file only (before they were read, a
    file rewritten with other rows in its middle resumed at a position into other data, silently). At
    most 384 KiB and 66 reads per file, whatever its size: a change smaller than the gaps between the
    blocks (a few bytes in a file of many megabytes) can still pass unseen (on an object store, 66 ranged
    GETs per file). Modification times are left out: a copy or a restore from a backup changes them and
    nothing else; so are the URI's scheme and bucket (a copy of the inputs to another store is the same
    inputs).

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist or holds no data files.
    """
    out = []
    for f in list_files(path, storage_options=storage_options):     # a directory's own files, never deeper
        with open_file(f) as fh:
            size = fh.size()
            ranges = _fingerprint_ranges(size)
            if isinstance(f, RemoteInput):      # a ranged GET each: issued together, not one after another
                with ThreadPoolExecutor(FINGERPRINT_REQUESTS) as pool:
                    parts = list(pool.map(lambda r: fh.read_at(r[1] - r[0], r[0]), ranges))
            else:
                parts = [fh.read_at(hi - lo, lo) for lo, hi in ranges]
        crc = zlib.crc32(parts[1], zlib.crc32(parts[0]))
        inner = 0
        for part in parts[2:]:
            inner = zlib.crc32(part, inner)
        out.append([os.path.basename(str(f)), size, f"{crc:08x}", f"{inner:08x}"])
    return out


def local_versions(files) -> list:
    """``(size, mtime_ns, inode)`` of each local file of ``files`` (``list_files`` entries) now; None for a
    store's (``streaming.inputs.RemoteInput`` checks its own version at every open and read)."""
    out = [local_version(f) if isinstance(f, str) else None for f in files]
    gone = [f for f, v in zip(files, out) if v is not None and v[0] < 0]
    if gone:
        raise FileNotFoundError(f"{gone[0]}: listed, then gone")
    return out


def check_unchanged(files, versions: list, fingerprint: list[list]) -> list:
    """Raise unless every local file of ``files`` is the one listed: ``versions`` (``local_versions`` when
    listed) and ``fingerprint`` (``files_fingerprint`` then) -> the versions now. A file whose stat
    changed but whose fingerprint did not (the same bytes copied again, ``touch``) is taken as the same.
    Called before each epoch: the row split and the checkpoints' positions hold for the files as listed,
    and a file written again between two epochs was read with the old row counts (rows left out or read
    twice, silently), as a store's object was before ``streaming.inputs`` pinned its version.

    Raises
    ------
    streaming.inputs.InputChangedError
        A local file deleted, or written again with other content (names it, both versions).
    """
    now = []
    for f, was, fp in zip(files, versions, fingerprint):
        if was is None:
            now.append(None)
            continue
        cur = local_version(f)
        if cur[0] < 0:
            raise InputChangedError(f, f"expected the file as the job listed it ({was[0]} bytes), got none: "
                                       f"deleted", advice=CHANGED, sep="; ")
        if cur != was and (got := files_fingerprint(f)[0]) != fp:
            raise InputChangedError(f, f"expected the file as the job listed it ({was[0]} bytes, fingerprint "
                                       f"{'/'.join(fp[2:])}), got {cur[0]} bytes, fingerprint "
                                       f"{'/'.join(got[2:])}", advice=CHANGED)
        now.append(cur)
    return now


def _fingerprint_ranges(size: int) -> list[tuple[int, int]]:
    """The byte ranges ``files_fingerprint`` reads of a file of ``size`` bytes, as ``[lo, hi)``: the first
    ``FINGERPRINT_BYTES`` (the whole file when smaller), the last ones (an empty range when the first
    covered them), then the middle between the two ends: whole when no larger than ``SAMPLE_BLOCKS`` x
    ``SAMPLE_BYTES``, else ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES`` spread evenly (none when there is
    no middle)."""
    head = (0, min(size, FINGERPRINT_BYTES))
    tail = (max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES), size) if size > FINGERPRINT_BYTES else (0, 0)
    lo, hi = FINGERPRINT_BYTES, size - FINGERPRINT_BYTES
    span = hi - lo
    if span <= 0:
        return [head, tail]
    if span <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return [head, tail, (lo, hi)]
    step = (span - SAMPLE_BYTES) / (SAMPLE_BLOCKS - 1)
    return [head, tail] + [(lo + int(i * step), lo + int(i * step) + SAMPLE_BYTES) for i in range(SAMPLE_BLOCKS)]


def _cache_for(inputs: Path, cache_dir: Path) -> Path:
    tag = hashlib.sha1(str(inputs).encode()).hexdigest()[:10]
    return cache_dir / f"criteo-{inputs.stem}-{tag}"


def _convert(inputs: Path, cfg: DataConfig, key: str, splits=("train", "test")) -> dict[str, str]:
    """``{split: Arrow dir}`` of each of ``splits`` of a Criteo TSV, converted now unless current (a split
    not asked for is neither converted nor looked at).

    Raises
    ------
    ConfigError
        A split without a row (a file of fewer than 5 lines has no test row): names ``key`` (the config
        key that gave ``inputs``), the file and the split, not the cache directory the user never set.
    """
    out = _cache_for(inputs, Path(cfg.cache_dir).resolve())
    dirs = {}
    for split in splits:
        d = out / split
        if arrow_is_current([inputs], d, split=split):
            log.info("%s split of %s: Arrow form in %s is current", split, inputs, d)
        else:
            log.info("converting the %s split of %s into %s", split, inputs, d)
            convert_criteo([inputs], d, split=split, batch_size=cfg.convert_batch_size,
                           max_bad_rows=cfg.max_bad_rows)
        try:
            list_files(d)
        except FileNotFoundError:
            raise ConfigError(f"{key}: {inputs} has no {split} row (the canonical split makes line i a test row "
                              f"when i % 5 == 4, a train row otherwise; malformed lines skipped by "
                              f"model.data.max_bad_rows count too): give it at least 5 well-formed lines, or "
                              f"train on Arrow files of your own (model.data.source: arrow)") from None
        dirs[split] = str(d)
    return dirs


def _criteo_file(cfg: DataConfig, storage_options) -> Path | None:
    """The local Criteo text file of ``criteo_path`` (None when there is none): the path itself, or for a
    URI (``s3://bucket/train.txt``) a copy in ``cache_dir`` (``streaming.inputs.fetch``: taken again
    only when the object's size or modification time changed), which ``_convert`` turns into Arrow as
    it would the file."""
    if not is_uri(cfg.criteo_path):
        path = Path(cfg.criteo_path).resolve()
        return path if path.is_file() else None
    tag = hashlib.sha1(cfg.criteo_path.encode()).hexdigest()[:10]
    d = Path(cfg.cache_dir).resolve() / f"download-{tag}"
    log.info("model.data.criteo_path %s: copying it to %s unless the copy there is current", cfg.criteo_path, d)
    try:
        return Path(fetch(cfg.criteo_path, d, storage_options))
    except FileNotFoundError:
        return None


def _generated(cfg: DataConfig) -> Path:
    cache = Path(cfg.cache_dir).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"generated-criteo-{cfg.generated_rows}-seed{cfg.generated_seed}.txt"
    if path.is_file():
        log.info("using the generated Criteo-format file %s", path)
        return path
    tmp = path.with_suffix(".tmp.txt")
    g = generate_criteo(tmp, cfg.generated_rows, cfg.generated_seed)
    os.replace(tmp, path)
    log.info("generated %d Criteo-format rows from a planted logistic model in %s (seed %d, CTR %.3f, "
             "planted-model test AUC %.4f)", g.rows, path, g.seed, g.ctr, g.planted_auc_test)
    return path


def check_arrow(path: str, schema: pa.Schema, key: str, storage_options=None) -> tuple[list, list]:
    """Raise unless ``path`` exists and every one of its inputs has ``schema``'s columns (a slot column
    may hold raw strings: ``string_slots``) and, an IPC stream, its end-of-stream marker
    (``streaming.source.check_inputs``: each input's schema and last bytes; a whole file only when it
    looks truncated). Files of a directory left unread for their names (no data suffix, not a
    ``_``/``.`` marker or temporary file) are named in a WARNING. A URI ``path`` is read with
    ``storage_options`` (``streaming.inputs``) and listed once (one listing gives the inputs and the names
    left unread).

    Returns
    -------
    (files, versions)
        The inputs as listed and checked (``list_files`` entries: a store's ``RemoteInput``, its version
        pinned at the check's open) and each local file's version when listed (``local_versions``; None for
        a store's): read them with ``ArrowSource(files, versions=versions)`` to read what was checked, as a
        trainer reads its listing, never a file written since.

    Raises
    ------
    ConfigError
        ``path`` is empty or does not exist (``key`` names the config key).
    hdfs_io.StorageUnavailableError, OSError
        A URI's store cannot be reached (after the retries).
    streaming.errors.SchemaError
        A column is missing or has another type (names the column and the file).
    streaming.errors.DataFormatError
        An input is empty, truncated or not Arrow IPC / Parquet (names the file).
    """
    if not path:
        raise ConfigError(f"{key} must name an Arrow file or directory when model.data.source is 'arrow'")
    left = []
    try:
        if is_uri(path):
            files, left = list_remote_unread(path, storage_options)
        else:
            files = list_files(path)
        versions = local_versions(files)
        check_inputs(files, schema, string_slots=string_slots(schema))
    except FileNotFoundError as e:
        raise ConfigError(f"{key}: {e}") from None
    if not is_uri(path) and os.path.isdir(path):
        read = {os.path.basename(f) for f in files}
        left = sorted(e.name for e in os.scandir(path) if e.is_file() and e.name not in read
                      and not e.name.startswith(("_", ".")))
    if left:
        log.warning("%s: %d file(s) of %s are not read, their names lacking a data suffix (.arrow .arrows "
                    ".ipc .feather .parquet .pq; names starting with _ or . are skipped as markers and "
                    "temporary files): %s%s", key, len(left), path, ", ".join(left[:5]),
                    f" and {len(left) - 5} more" if len(left) > 5 else "")
    return files, versions


def group_column_type(path, column: str, storage_options=None) -> pa.DataType:
    """The Arrow type of the grouping column ``column`` (``model.data.group_column``) in every input of
    the test split ``path`` (a path, a URI, or its inputs as ``list_files`` listed them): an integer type, or
    string/binary (hashed to uint64 keys when read).

    Raises
    ------
    ConfigError
        An input lacks the column, or holds it with another type (not integer or string) or with
        different types in different files; the message names ``model.data.group_column`` and the file.
    """
    key = "model.data.group_column"
    try:
        files = list_files(path, storage_options=storage_options)
    except FileNotFoundError as e:
        raise ConfigError(f"model.data.test_path: {e}") from None
    found = None
    for f in files:
        schema = read_schema(f)
        if column not in schema.names:
            raise ConfigError(f"{key}: column {column!r} is missing from the test split file {f} (columns "
                              f"present: {', '.join(schema.names) or 'none'})")
        t = schema.field(column).type
        if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_binary(t) or pa.types.is_large_binary(t)):
            raise ConfigError(f"{key}: column {column!r} of {f} must hold integer or string group ids, "
                              f"got {t}")
        if found is not None and t != found:
            raise ConfigError(f"{key}: column {column!r} is {t} in {f} but {found} in {files[0]}")
        found = t
    return found


def prepare_data(cfg: DataConfig, schema: pa.Schema, storage_options=None) -> DataConfig:
    """Resolve the data section to ``source: arrow`` with absolute (or URI), schema-checked paths;
    converts or generates when needed (see the module docstring). ``storage_options``
    (``hdfs_io.StorageOptions``, the config's ``storage`` section) reach URI inputs' store.
    ``prepare_listed`` gives the listings it checked too.

    Raises
    ------
    ConfigError
        A data path that does not exist (the key is named).
    hdfs_io.StorageUnavailableError, OSError
        A URI input's store cannot be reached (after the retries).
    streaming.errors.DataFormatError
        A malformed Criteo line beyond ``max_bad_rows``.
    streaming.errors.SchemaError
        An Arrow input with a missing or mistyped column.
    """
    return prepare_listed(cfg, schema, storage_options)[0]


def prepare_listed(cfg: DataConfig, schema: pa.Schema, storage_options=None, *,
                   splits=("train", "test")) -> tuple[DataConfig, dict]:
    """``prepare_data`` of ``splits`` (``"train"``, ``"test"``), and what it listed and checked: ``(data config,
    {split: (files, versions)})`` (``check_arrow``'s), so a reader in this process reads the inputs as listed
    and checked without listing them again. ``engine eval`` asks for ``("test",)``, the only split it reads: a
    split not asked for is neither converted, listed nor checked (a missing or bad one refuses nothing), and
    keeps its path as configured. Raises as ``prepare_data``."""
    keys = {"train": "model.data.train_path", "test": "model.data.test_path"}
    if not splits or set(splits) - set(keys):
        raise ValueError(f"splits: expected some of {sorted(keys)}, got {list(splits)!r}")
    if cfg.source == "arrow":
        paths = {"train": cfg.train_path, "test": cfg.test_path}
        for split in splits:
            if paths[split] == "-":
                raise ConfigError(f"{keys[split]}: '-' (stdin) cannot be a split of a CTR job: the launcher counts "
                                  f"and checks the rows before any worker starts, and every worker reads its shard "
                                  f"in every epoch; write the stream to a file or directory and name that")
    else:
        key = "model.data.criteo_path"
        if cfg.source == "generated":
            inputs, key = _generated(cfg), "model.data.generated_rows"
        else:
            inputs = _criteo_file(cfg, storage_options)
            if inputs is None:
                if cfg.source == "shared_criteo" and cfg.fallback == "generated":
                    log.warning("model.data.criteo_path %s not found: training on a GENERATED Criteo-format "
                                "file with a planted logistic model instead (see model.data.fallback)",
                                cfg.criteo_path)
                    inputs, key = _generated(cfg), "model.data.generated_rows"
                else:
                    raise ConfigError(f"model.data.criteo_path: file not found: {cfg.criteo_path}")
        paths = {"train": cfg.train_path, "test": cfg.test_path, **_convert(inputs, cfg, key, splits)}
    listed = {split: check_arrow(paths[split], schema, keys[split], storage_options) for split in splits}
    if cfg.group_column and "test" in listed:
        group_column_type(listed["test"][0], cfg.group_column, storage_options)
    done = {f"{split}_path": _absolute(paths[split]) for split in splits}
    return dataclasses.replace(cfg, source="arrow", **done), listed


def _absolute(path: str) -> str:
    """A local path made absolute (every worker reads it whatever its directory); a URI as it is."""
    return path if is_uri(path) else str(Path(path).resolve())
