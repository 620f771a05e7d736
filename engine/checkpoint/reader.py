"""Server side of a restore: one server loads the rows it owns from one published checkpoint.

The coordinator calls this once per checkpoint of the chain, base first, then each delta in order. A
server reads only the part files whose vshard group overlaps its own vshard range (every file when the
checkpoint was cut with another ``num_vshards``), keeps the rows routed to it and hands each local
shard its rows: a checkpoint written by N servers loads onto M.

Every file is checked against its manifest entry (size and CRC-32) before it is parsed, then its
columns against the table's row schema; a missing, short, corrupt, truncated or misfit file raises
``hdfs_io.CheckpointCorruptError`` naming the file. When a server reads every file of a table, their
rows must add up to the manifest's count.

All or nothing:

* a **base** goes into empty shards the caller made for it (``SparseHost.fresh_shards``) and swaps in
  only when this returns; on any error the caller drops them and its live tables never changed;
* a **delta** applies on top of the live shards, so it is verified completely first (every file read
  and checked, the row count each shard would reach compared with its ``max_rows``) and only then read
  again and applied: a damaged or oversized delta changes no row.

The admission sketches (``sketch_parts``) are read and checked before any row changes, and set last.

Row limits. A shard with ``TableConfig.max_rows`` never receives more rows than that: a base stops
filling a table once a shard's share is exceeded (and keeps counting, so the error gives the row count
the checkpoint would have reached), a delta is refused before it applies. Both raise
``CheckpointCapacityError`` naming the table, the limit and the row count.
"""
from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from hdfs_io import CheckpointCorruptError, FileEntry, Storage, file_entries
from hdfs_io.arrow_io import open_ipc_batches
from sparse_tables import SparseTable, TableFullError, TableInputError
from sparse_tables.rows import existed_column

from ..sharding import routing
from .manifest import read_checkpoint_manifest
from .part_files import check_columns as _check_columns, read_part as _read
from .sketch_parts import SKETCH_RE, read_sketches
from .writer import DENSE_SCHEMA, TOMBSTONE_SCHEMA, DenseBlockState, group_of

__all__ = ["load_server_parts", "CheckpointMismatchError", "CheckpointCapacityError"]

log = logging.getLogger(__name__)

_SPARSE_RE = re.compile(r"^sparse/([^/]+)/g(\d+)-s(\d+)-j(\d+)\.arrow$")
_TOMB_RE = re.compile(r"^tombstones/([^/]+)/s(\d+)\.arrow$")
_DENSE_RE = re.compile(r"^dense/([^/]+)/s(\d+)\.arrow$")


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the tables it is loaded into (missing table, other dim/optimizer,
    other hash version). The message names the table and both values."""


class CheckpointCapacityError(CheckpointMismatchError):
    """Loading the checkpoint would take a table past its ``max_rows``. ``table``, ``limit`` (this
    server's, summed over its shards) and ``rows`` (what the table would hold) are attributes."""

    def __init__(self, message: str, table: str = "", limit: int = 0, rows: int = 0):
        super().__init__(message)
        self.table, self.limit, self.rows = table, limit, rows


@dataclass
class _Plan:
    """What one server reads of one checkpoint."""

    ckpt: Storage
    manifest: dict
    num_vshards: int
    local_owner: np.ndarray
    sparse: dict
    sparse_files: list = field(default_factory=list)    # (table, file name, FileEntry)
    tomb_files: list = field(default_factory=list)
    dense_files: list = field(default_factory=list)
    sketch_files: dict = field(default_factory=dict)    # table -> [(server, j, file name, FileEntry)]
    tables: list = field(default_factory=list)          # sparse tables of the checkpoint hosted here
    every_file: set = field(default_factory=set)        # ... of which this server reads every file

    def uri(self, fname: str) -> str:
        return self.ckpt.uri_of(fname)


def _file_group(fname: str) -> int:
    """The vshard group of a sparse part file's name (``writer._part_name``)."""
    return int(_SPARSE_RE.match(fname).group(2))


def _group_range(g: int, groups: int, ckpt_vshards: int) -> tuple[int, int]:
    """Vshards [lo, hi) of group ``g``: those with ``v * groups // ckpt_vshards == g`` (``writer.group_of``)."""
    return -(-g * ckpt_vshards // groups), -(-(g + 1) * ckpt_vshards // groups)


def _group_overlaps(g: int, groups: int, ckpt_vshards: int, local_owner: np.ndarray) -> bool:
    lo, hi = _group_range(g, groups, ckpt_vshards)
    return bool((local_owner[lo:hi] >= 0).any())


def _plan(ckpt: Storage, manifest: dict, num_vshards: int, local_owner: np.ndarray, sparse: dict) -> _Plan:
    """Check the checkpoint's tables against this server's and list the files to read."""
    ck_tables = manifest["tables"].get("sparse", {})
    for name, meta in ck_tables.items():
        if name not in sparse:
            raise CheckpointMismatchError(f"checkpoint {ckpt.uri} has sparse table {name!r}, which this "
                                          f"server does not host (tables here: {sorted(sparse)})")
        shard = sparse[name][0]
        have = (shard.layout.dim, shard.config.optimizer)
        want = (meta.get("dim"), meta.get("optimizer"))
        if have != want:
            raise CheckpointMismatchError(f"sparse table {name!r}: checkpoint {ckpt.uri} has dim/optimizer "
                                          f"{want}, this server's table has {have}")
    for name in sparse:
        if name not in ck_tables:
            log.warning("sparse table %r is not in checkpoint %s; no rows of it are loaded", name, ckpt.uri)
    plan = _Plan(ckpt, manifest, num_vshards, local_owner, sparse)
    same_cut = manifest["num_vshards"] == num_vshards
    groups = manifest["groups"]
    plan.tables = [name for name in ck_tables if name in sparse]
    plan.every_file = set(plan.tables)
    for fname, entry in file_entries(manifest).items():
        if m := _SPARSE_RE.match(fname):
            name = m.group(1)
            if name not in sparse:
                continue
            if not same_cut or _group_overlaps(_file_group(fname), groups, num_vshards, local_owner):
                plan.sparse_files.append((name, fname, entry))
            else:
                plan.every_file.discard(name)
        elif m := _TOMB_RE.match(fname):
            if m.group(1) in sparse:
                plan.tomb_files.append((m.group(1), fname, entry))
        elif m := _DENSE_RE.match(fname):
            plan.dense_files.append((m.group(1), fname, entry))
        elif m := SKETCH_RE.match(fname):
            if m.group(1) in sparse:
                plan.sketch_files.setdefault(m.group(1), []).append((int(m.group(2)), int(m.group(3)), fname, entry))
    return plan


def _read_rows(plan: _Plan, name: str, fname: str, entry: FileEntry) -> Iterator[pa.RecordBatch]:
    """The checked batches of a sparse part file, one at a time (``open_ipc_batches``: a large file is
    checksummed by a streaming pass, then read a batch at a time, never held whole)."""
    try:
        batches = open_ipc_batches(plan.ckpt, fname, expected=entry)
    except FileNotFoundError as exc:
        uri = plan.ckpt.uri_of(fname)
        raise CheckpointCorruptError(f"{uri}: listed in the manifest but missing", uri=uri) from exc
    schema, uri, what = plan.sparse[name][0].schema, plan.uri(fname), f"rows do not fit table {name!r}"
    _check_columns(batches.schema.empty_table(), schema, uri, what)
    at = 0
    for batch in batches:
        _check_columns(batch, schema, uri, what)
        try:
            existed_column(batch)       # a delta's (sparse_tables.rows.delta_schema), checked when present
        except TableInputError as exc:
            raise CheckpointCorruptError(f"{uri}: rows {at}..{at + batch.num_rows - 1}: {exc}", uri=uri) from exc
        at += batch.num_rows
        yield batch


def _read_tombstones(plan: _Plan, name: str, fname: str, entry: FileEntry) -> tuple[np.ndarray, bool]:
    """(keys : uint64[k], at_parent): at_parent when the writer vouches that every key had a row at the
    parent (schema metadata, ``writer``; older deltas do not)."""
    table = _read(plan.ckpt, fname, entry)
    _check_columns(table, TOMBSTONE_SCHEMA, plan.uri(fname), f"tombstones of table {name!r}")
    at_parent = (table.schema.metadata or {}).get(b"at_parent") == b"1"
    return np.ascontiguousarray(table.column("key").to_numpy()), at_parent


def _apply_tombstones(plan: _Plan, tomb_keys: list, tables) -> dict:
    """Delete each tombstone file's keys (``(table, (keys, at_parent))`` items) from the shards they
    route to; returns rows deleted by table (each of ``tables``, names, at least 0)."""
    tombs = {name: 0 for name in tables}
    for name, (keys, at_parent) in tomb_keys:
        local = routing.lookup(keys, plan.num_vshards, plan.local_owner)
        for j, shard in enumerate(plan.sparse[name]):
            mine = keys[local == j]
            if len(mine):
                tombs[name] = tombs.get(name, 0) + shard.delete(mine, tombstones=True, at_parent=at_parent)
    return tombs


def _parent_uri(uri: str, manifest: dict) -> str | None:
    """URI of a delta's parent checkpoint: ``uri`` (the delta's own) ends with the manifest's ``name``,
    which the parent's name replaces; None when it does not (a checkpoint moved and renamed)."""
    uri, name, parent = uri.rstrip("/"), manifest.get("name"), manifest.get("parent")
    if not name or not parent or not uri.endswith("/" + name):
        return None
    return uri[:-len(name)] + parent


def _check_row_counts(plan: _Plan, rows_read: dict, tombs_read: dict) -> None:
    """Where this server read every file of a table, the files' rows must add up to the manifest's."""
    meta = plan.manifest["tables"].get("sparse", {})
    for name in plan.every_file:
        for what, got in (("rows", rows_read.get(name, 0)), ("tombstones", tombs_read.get(name, 0))):
            want = meta.get(name, {}).get(what)
            if want is not None and int(want) != got:
                uri = plan.ckpt.uri_of("manifest.json")
                raise CheckpointCorruptError(f"{uri}: table {name!r}: the manifest counts {want} {what}, its "
                                             f"files hold {got}", uri=uri)


def _limits(shards: list[SparseTable]) -> np.ndarray:
    return np.array([sh.config.max_rows for sh in shards], np.int64)


def _capacity_error(plan: _Plan, name: str, rows: np.ndarray, state: str) -> CheckpointCapacityError:
    limits = _limits(plan.sparse[name])
    total, limit = int(rows.sum()), int(limits.sum())
    j = int(np.argmax(rows - limits))
    return CheckpointCapacityError(
        f"sparse table {name!r}: checkpoint {plan.ckpt.uri} would leave {total} rows on this server, past "
        f"its max_rows of {limit} (local shard {j} would hold {int(rows[j])} rows, its share is "
        f"{int(limits[j])}); {state}. Raise max_rows or restore onto more servers",
        table=name, limit=limit, rows=total)


class _BaseBudget:
    """A base into empty shards: counts the rows routed to each shard of the tables with ``max_rows``
    and stops loading a table once one of its shards would pass its share; counting goes on, so the
    error can give the row count the whole checkpoint reaches."""

    def __init__(self, sparse: dict):
        self.limits = {n: _limits(s) for n, s in sparse.items() if _limits(s).any()}
        self.rows = {n: np.array([len(sh) for sh in sparse[n]], np.int64) for n in self.limits}
        self.over: set[str] = set()
        self._lock = threading.Lock()

    def take(self, name: str, local: np.ndarray) -> bool:
        """Count rows routed to shards (``local : int32[n]``, -1: another server); False once the table
        is over its limit (load nothing more of it)."""
        if name not in self.limits:
            return True
        counts = np.bincount(local[local >= 0], minlength=len(self.limits[name]))
        with self._lock:
            self.rows[name] += counts
            lim = self.limits[name]
            if ((lim > 0) & (self.rows[name] > lim)).any():
                self.over.add(name)
            return name not in self.over


def _check_group(plan: _Plan, fname: str, keys: np.ndarray, g: int, groups: int, ck_vshards: int, at: int) -> None:
    """Every key of part file ``g...`` must fall in vshard group ``g`` of the checkpoint's cut: that is
    what makes each key live in one file (a base loads with ``bulk_load(distinct=True)``), and what lets a
    server read only the files of its groups. ``at``: the file's row of ``keys[0]``.

    Raises
    ------
    CheckpointCorruptError
        Naming the file, the first row out of place, its key and vshard, and the group's range.
    """
    bad = np.flatnonzero(group_of(keys, ck_vshards, groups) != g)
    if len(bad):
        i = int(bad[0])
        lo, hi = _group_range(g, groups, ck_vshards)
        v = int(routing.vshard_of(keys[i:i + 1], ck_vshards)[0])
        uri = plan.uri(fname)
        raise CheckpointCorruptError(f"{uri}: row {at + i}: key {int(keys[i])} is in vshard {v}, outside "
                                     f"this file's group {g} (vshards [{lo}, {hi}) of {ck_vshards}); "
                                     f"{len(bad)} row(s) read with it are misplaced", uri=uri)


def _load_rows(plan: _Plan, threads: int, budget: _BaseBudget | None) -> tuple[dict, dict]:
    """Read the sparse files and load the rows routed here into the shards. Returns (rows loaded,
    rows read) by table."""

    ck_vshards, groups = plan.manifest["num_vshards"], plan.manifest["groups"]

    def load_one(item):
        name, fname, entry = item
        shards = plan.sparse[name]
        g = _file_group(fname)
        n, at = 0, 0
        for batch in _read_rows(plan, name, fname, entry):
            keys = np.ascontiguousarray(batch.column(0).to_numpy())
            _check_group(plan, fname, keys, g, groups, ck_vshards, at)
            at += len(keys)
            local = routing.lookup(keys, plan.num_vshards, plan.local_owner)
            if budget is not None and not budget.take(name, local):
                continue
            first = int(local[0]) if len(local) else -1
            try:
                if first >= 0 and (local == first).all():
                    n += shards[first].load_rows([batch])
                    continue
                for j in range(len(shards)):
                    mask = local == j
                    if mask.any():
                        n += shards[j].load_rows([batch.filter(pa.array(mask))])
            except TableInputError as exc:
                uri = plan.uri(fname)
                raise CheckpointCorruptError(f"{uri}: rows do not fit table {name!r}: {exc}", uri=uri) from exc
            except TableFullError as exc:      # only when rows arrived meanwhile (the counts were checked)
                raise CheckpointCapacityError(f"sparse table {name!r}: loading {plan.ckpt.uri} stopped at "
                                              f"{plan.uri(fname)}: {exc}; the table holds part of it",
                                              table=name, limit=exc.limit, rows=exc.rows) from exc
        return name, n, at

    rows = {name: 0 for name in plan.tables}
    read = dict(rows)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-load") as pool:
        for name, n, m in pool.map(load_one, plan.sparse_files):
            rows[name] += n
            read[name] += m
    return rows, read


def _verify_delta(plan: _Plan, threads: int) -> None:
    """Read and check every file of a delta (checksums, columns, row counts) and the row count each
    limited shard would reach; raises before anything changes."""
    limited = {n for n, s in plan.sparse.items() if _limits(s).any()}
    new = {n: np.zeros(len(plan.sparse[n]), np.int64) for n in limited}

    def per_shard(name, keys, present: bool) -> np.ndarray:
        """Keys routed to each shard of ``name`` that are (present=True) or are not in it now."""
        local = routing.lookup(keys, plan.num_vshards, plan.local_owner)
        out = np.zeros(len(plan.sparse[name]), np.int64)
        for j, shard in enumerate(plan.sparse[name]):
            mine = keys[local == j]
            if len(mine):
                have = shard.contains(mine)
                out[j] = int(np.count_nonzero(have if present else ~have))
        return out

    def check_one(item):
        name, fname, entry = item
        parts = [np.ascontiguousarray(b.column("key").to_numpy()) for b in _read_rows(plan, name, fname, entry)]
        keys = np.concatenate(parts) if parts else np.empty(0, np.uint64)
        _check_group(plan, fname, keys, _file_group(fname), plan.manifest["groups"],
                     plan.manifest["num_vshards"], 0)            # before any row changes, not midway
        fresh = per_shard(name, keys, present=False) if name in limited else None
        return name, len(keys), fresh

    read = {name: 0 for name in plan.tables}
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-verify") as pool:
        for name, m, fresh in pool.map(check_one, plan.sparse_files):
            read[name] += m
            if fresh is not None:
                new[name] += fresh
    tombs = {name: 0 for name in plan.tables}
    for name, fname, entry in plan.tomb_files:
        keys, _ = _read_tombstones(plan, name, fname, entry)
        tombs[name] = tombs.get(name, 0) + len(keys)
        if name in limited:
            new[name] -= per_shard(name, keys, present=True)
    _check_row_counts(plan, read, tombs)
    for name in sorted(limited):
        after = np.array([len(sh) for sh in plan.sparse[name]], np.int64) + new[name]
        lim = _limits(plan.sparse[name])
        if ((lim > 0) & (after > lim)).any():
            raise _capacity_error(plan, name, after, "nothing was loaded, the table is unchanged")


def _read_dense(plan: _Plan, dense_owns: Callable[[str, int], bool]) -> dict:
    dense: dict = {}
    for name, fname, entry in plan.dense_files:
        table = _read(plan.ckpt, fname, entry)
        uri = plan.uri(fname)
        _check_columns(table, DENSE_SCHEMA, uri, f"dense table {name!r}")
        try:
            size = int((table.schema.metadata or {}).get(b"size", b"0"))
        except ValueError:
            raise CheckpointCorruptError(f"{uri}: dense table {name!r}: schema metadata 'size' is not an "
                                         f"integer", uri=uri) from None
        got = dense.setdefault(name, (size, {}))[1]
        cols = table.to_pydict()
        for i, block in enumerate(cols["block"]):
            if not dense_owns(name, int(block)):
                continue
            arr = lambda v: None if v is None else np.asarray(v, np.float32)  # noqa: E731
            got[int(block)] = DenseBlockState(arr(cols["params"][i]), arr(cols["m"][i]), arr(cols["v"][i]),
                                              cols["t"][i])
    return dense


def load_server_parts(ckpt: Storage, *, num_vshards: int, local_owner: np.ndarray,
                      sparse: dict[str, list[SparseTable]],
                      dense_owns: Callable[[str, int], bool] | None = None,
                      manifest: dict | None = None, threads: int = 2,
                      check_dense: Callable[[dict], None] | None = None) -> tuple[dict, dict, dict]:
    """Load this server's rows of one checkpoint (base or delta) into its local shards.

    A base is read once, straight into ``sparse`` (which should be empty shards made for it; on an
    error they hold part of the base and the caller drops them). A delta is read twice: a verifying
    pass that changes nothing, then the applying pass (the checksums are checked again; a file that
    changed in between, which a published checkpoint never should, leaves the delta partly applied
    and raises). See the module docstring.

    Parameters
    ----------
    ckpt : Storage
        Rooted at the checkpoint directory.
    num_vshards : int
        This cluster's vshard count.
    local_owner : int32[num_vshards]
        Local shard of each vshard on this server, -1 where another server owns it
        (``engine.sharding.routing.local_shard_owners``).
    sparse : dict of str -> list of SparseTable
        This server's shards: empty ones for a base, the live ones for a delta.
    dense_owns : callable (table, block) -> bool, optional
        Whether this server holds a dense block; None skips dense tables.
    manifest : dict, optional
        Already read manifest of ``ckpt`` (read here otherwise).
    threads : int
        Files read concurrently.
    check_dense : callable (dense) -> None, optional
        Called with the dense part (as returned) once it is read and, for a delta, the sparse files
        are verified, before any live row changes: whatever it raises leaves every table unchanged.

    Returns
    -------
    (rows, tombstones, dense)
        rows : dict table -> rows loaded; tombstones : dict table -> keys deleted;
        dense : dict table -> (size, {block: DenseBlockState}) of the blocks this server owns (read and
        column-checked; the caller installs them).

    Raises
    ------
    hdfs_io.NotPublishedError
        The checkpoint has no ``_SUCCESS``.
    hdfs_io.CheckpointCorruptError
        A file is missing, has the wrong size or checksum, is not a readable Arrow file, lacks a
        column or has the wrong type (named); or the files' rows do not add up to the manifest's.
    CheckpointMismatchError
        A checkpoint table is not hosted here, or has another dim / optimizer.
    CheckpointCapacityError
        A table would pass its ``max_rows`` (names the table, the limit and the row count).
    """
    if manifest is None:
        manifest = read_checkpoint_manifest(ckpt, "")
    plan = _plan(ckpt, manifest, num_vshards, local_owner, sparse)
    base = manifest["kind"] == "base"
    dense = _read_dense(plan, dense_owns) if dense_owns is not None else {}
    if check_dense is not None:
        check_dense(dense)
    sketches = {name: read_sketches(ckpt, manifest, plan.sketch_files.get(name, []), name, sparse[name],
                                    num_vshards, local_owner) for name in plan.tables}
    if base:
        budget = _BaseBudget(sparse)
        with ExitStack() as bulk:   # fresh shards: RocksDB's write stalls raised while the base loads
            for shards in sparse.values():
                for shard in shards:
                    bulk.enter_context(shard.bulk_load(distinct=True))   # fresh shards, keys checked below
            rows, read = _load_rows(plan, threads, budget)
        for name in sorted(budget.over):
            raise _capacity_error(plan, name, budget.rows[name], "the tables in use were not changed")
        tomb_keys = [(name, _read_tombstones(plan, name, fname, entry)) for name, fname, entry in plan.tomb_files]
        _check_row_counts(plan, read, {n: sum(len(k) for t, (k, _) in tomb_keys if t == n) for n in plan.every_file})
        tombs = _apply_tombstones(plan, tomb_keys, rows)
    else:
        _verify_delta(plan, threads)
        parent = _parent_uri(ckpt.uri, manifest)
        with ExitStack() as trust:  # shards holding exactly the parent take its rows' ``existed`` as true
            for shards in sparse.values():
                for shard in shards:
                    trust.enter_context(shard.delta_load(parent))
            # tombstones before rows: no key is both (a tombstone had a row at the parent and has none
            # at the delta), and a full table (max_rows) whose expiry made room for new keys needs the
            # room back before they load; rows first passed max_rows midway and the delta did not load
            tomb_keys = [(name, _read_tombstones(plan, name, fname, entry)) for name, fname, entry in plan.tomb_files]
            tombs = _apply_tombstones(plan, tomb_keys, plan.tables)
            rows, _ = _load_rows(plan, threads, None)
    for name, counts in sketches.items():   # admission counts as saved (``sketch_parts``)
        for shard, c in zip(sparse[name], counts or ()):
            if c is not None:
                shard.restore_sketch(c)
    for name, shards in sparse.items():     # restored state is the new "clean" point for the next delta
        for shard in shards:
            if name in plan.tables:             # ... and, with no traffic meanwhile, exactly this checkpoint
                shard.finish_restore(ckpt.uri)
            else:
                shard.clear_dirty()
    log.info("loaded %s %s: rows %s, tombstones %s, dense %s", manifest["kind"], ckpt.uri, rows, tombs,
             {k: len(v[1]) for k, v in dense.items()})
    return rows, tombs, dense
