"""Server side of a checkpoint save: one server writes its part files into a checkpoint directory.

Every server writes in parallel, each only its own files, then a part report ``_parts/s{SSSS}.json``
(files with size and CRC-32, row and tombstone counts). The coordinator (``engine.checkpoint.
coordinator``) merges the reports into ``manifest.json`` and writes ``_SUCCESS`` once every server's
report is there. A server killed mid-write leaves no report, so no ``_SUCCESS`` is ever written and the
directory does not exist for readers.

Part files (Arrow IPC file format, zstd buffers)::

    sparse/{table}/g{GG}-s{SSSS}-j{JJ}.arrow   rows of vshard group GG held by local shard JJ of server
                                               SSSS; columns = SparseTable.schema (key, values, state,
                                               show, click, last_seen), bit copies of the rows; a
                                               delta's add ``existed`` (sparse_tables.rows.delta_schema:
                                               whether the key held a row at the parent)
    tombstones/{table}/s{SSSS}.arrow           deltas only: key uint64, a row at the parent and none
                                               at the delta (schema metadata "at_parent": "1")
    dense/{table}/s{SSSS}.arrow                block int32, params/m/v list<float32>, t int64;
                                               schema metadata "size" (floats in the whole table)
    sketch/{table}/s{SSSS}-j{JJ}.arrow         tables with count admission: local shard JJ's admission
                                               sketch, copied with its rows (``sketch_parts``)

Group of a row: ``vshard(key) * groups // num_vshards`` (contiguous vshard ranges), so a reader on any
cluster size reads only the groups overlapping its own vshard range.

Consistency. Each local shard is captured at one instant: a base clears the shard's dirty state and
copies its rows in one locked step (``rows(clear=True)``: a push racing with the save is in the next
delta, never in neither, and a delta's ``existed`` describes its parent exactly); a delta
takes ``dirty_dump(clear=True)`` (rows and tombstones captured and the dirty state cleared in one
locked step, so a push racing with the save lands in the next delta). Both stream their rows into the
part files (``_GroupFiles``): neither holds a shard's spilled rows in memory.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import pyarrow as pa

from hdfs_io import IpcFileWriter, Storage, write_ipc_file
from hdfs_io.retry import call_with_retry
from sparse_tables import SparseTable
from sparse_tables.keysets import unique_keys

from ..sharding import routing
from ..sharding._kernels import group as _group
from .sketch_parts import sketch_facts, write_sketch_part

__all__ = ["DenseBlockState", "DenseState", "save_server_parts", "part_report_name", "group_of",
           "TABLE_NAME_RE", "TOMBSTONE_SCHEMA", "DENSE_SCHEMA"]

log = logging.getLogger(__name__)

TABLE_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
TOMBSTONE_SCHEMA = pa.schema([pa.field("key", pa.uint64(), nullable=False)])
DENSE_SCHEMA = pa.schema([pa.field("block", pa.int32(), nullable=False),
                          pa.field("params", pa.list_(pa.float32()), nullable=False),
                          pa.field("m", pa.list_(pa.float32())),
                          pa.field("v", pa.list_(pa.float32())),
                          pa.field("t", pa.int64())])


@dataclass
class DenseBlockState:
    """One dense block: ``params : float32[L]``; Adam's ``m, v : float32[L]`` and step ``t`` (None for SGD)."""

    params: np.ndarray
    m: np.ndarray | None = None
    v: np.ndarray | None = None
    t: int | None = None


@dataclass
class DenseState:
    """The blocks of one dense table held by one server. ``size`` : floats in the whole table."""

    size: int
    blocks: dict[int, DenseBlockState] = field(default_factory=dict)


def part_report_name(server: int) -> str:
    return f"_parts/s{server:04d}.json"


def group_of(keys: np.ndarray, num_vshards: int, groups: int) -> np.ndarray:
    """Vshard group of keys : uint64[n] -> int64[n] in [0, groups)."""
    return routing.vshard_of(keys, num_vshards).astype(np.int64) * groups // num_vshards


def _check_names(names: Iterable[str]) -> None:
    for n in names:
        if not TABLE_NAME_RE.match(n):
            raise ValueError(f"table name {n!r} cannot be a checkpoint path component; "
                             f"use letters, digits, '_', '.', '-'")


def _split_by_group(batches: list[pa.RecordBatch], num_vshards: int, groups: int) -> dict[int, list]:
    """Rows of ``batches`` grouped by vshard group: {group: [RecordBatch, ...]} (O(n) counting sort)."""
    out: dict[int, list] = {}
    for b in batches:
        if b.num_rows == 0:
            continue
        keys = np.ascontiguousarray(b.column(0).to_numpy())
        g = group_of(keys, num_vshards, groups).astype(np.int32)
        first = int(g[0])
        if (g == first).all():
            out.setdefault(first, []).append(b)
            continue
        order = np.empty(len(g), np.int64)
        bounds = np.empty(groups + 1, np.int64)
        _group(g, groups, order, bounds)
        for k in range(groups):         # a copy per group: a slice of one copy would keep it all alive
            if bounds[k + 1] > bounds[k]:
                out.setdefault(k, []).append(b.take(pa.array(order[bounds[k]:bounds[k + 1]])))
    return out


def _part_name(table: str, g: int, server: int, j: int) -> str:
    """A sparse part file: vshard group g of local shard j of server ``server`` (``reader._SPARSE_RE``)."""
    return f"sparse/{table}/g{g:02d}-s{server:04d}-j{j:02d}.arrow"


# rows a group's part file receives at a time in a base or delta save: a shard being saved holds at
# most ``groups`` x this many rows beyond its RAM copy (16 x 16,384 x ~100 bytes ~ 26 MB), not the shard
STREAM_ROWS = 16_384


class _GroupFiles:
    """A shard's part files of a base or delta, one per vshard group, written as its rows stream in: the
    rows of a group wait until ``STREAM_ROWS`` of them, then go to that group's file as one record
    batch, so the save never holds the shard's rows (at 100M keys a server's shards are ~10 GB of
    Arrow). A group's file opens at its first rows. Each file is streamed (``IpcFileWriter``), so a
    storage error fails the attempt: ``abort`` removes the files, and the shard's whole part is written
    again on transient errors (the storage's retry policy: a base dumps the shard afresh, a delta reads
    its instant's rows again); past that the save fails and is never published."""

    def __init__(self, ckpt: Storage, name: str, server: int, j: int, schema: pa.Schema, num_vshards: int,
                 groups: int):
        self.ckpt, self.schema, self.num_vshards, self.groups = ckpt, schema, num_vshards, groups
        self.name, self.server, self.j = name, server, j
        self.rows = 0
        self._pending: dict[int, list[pa.RecordBatch]] = {}
        self._files: dict[int, IpcFileWriter] = {}

    def _name(self, g: int) -> str:
        return _part_name(self.name, g, self.server, self.j)

    def add(self, batch: pa.RecordBatch) -> None:
        for g, parts in _split_by_group([batch], self.num_vshards, self.groups).items():
            pending = self._pending.setdefault(g, [])
            pending.extend(parts)
            if sum(p.num_rows for p in pending) >= STREAM_ROWS:
                self._flush(g)

    def _flush(self, g: int) -> None:
        parts = self._pending.pop(g, [])
        if not parts:
            return
        if g not in self._files:
            self._files[g] = IpcFileWriter(self.ckpt, self._name(g), self.schema)
        self._files[g].write(pa.Table.from_batches(parts, schema=self.schema).combine_chunks())
        self.rows += sum(p.num_rows for p in parts)

    def close(self) -> dict:
        """Write what waits and finish every file; returns {file name: FileEntry json}."""
        for g in sorted(self._pending):
            self._flush(g)
        return {self._name(g): f.close().to_json() for g, f in sorted(self._files.items())}

    def abort(self) -> None:
        for f in self._files.values():
            f.abort()


def _stream_parts(ckpt: Storage, name: str, server: int, j: int, schema: pa.Schema, batches: Iterable,
                  num_vshards: int, groups: int) -> tuple[dict, int]:
    """One attempt at writing a shard's rows into its part files: (file entries, rows). A failed attempt
    removes its files."""
    files = _GroupFiles(ckpt, name, server, j, schema, num_vshards, groups)
    try:
        for batch in batches:
            files.add(batch)
        return files.close(), files.rows
    except BaseException:
        files.abort()
        raise


def _dump_base(ckpt: Storage, name: str, server: int, j: int, shard: SparseTable, num_vshards: int,
               groups: int, sketch: list) -> tuple[dict, int]:
    """One attempt at a shard's part files of a base: (file entries, rows). A failed attempt removes its
    files and releases the dump (its RocksDB iterator); a retry dumps the shard afresh, which is as
    consistent: its dirty marks are cleared again first, so what changed since lands in the next delta.
    ``sketch`` receives the admission sketch's copy of the attempt's instant (the last one counts)."""
    # the dirty marks cleared and the RAM rows copied (then RocksDB's view made) in one locked step: a
    # racing push lands in the next delta only, so that delta's ``existed`` answers for this base
    with contextlib.closing(shard.rows(clear=True, sketch=sketch)) as rows:
        return _stream_parts(ckpt, name, server, j, shard.schema, rows, num_vshards, groups)


def _dense_table(state: DenseState) -> pa.Table:
    blocks = sorted(state.blocks)

    def lists(get):
        vals = [get(state.blocks[b]) for b in blocks]
        return pa.array([None if v is None else np.asarray(v, np.float32) for v in vals],
                        type=pa.list_(pa.float32()))

    cols = [pa.array(blocks, pa.int32()), lists(lambda s: s.params), lists(lambda s: s.m),
            lists(lambda s: s.v), pa.array([state.blocks[b].t for b in blocks], pa.int64())]
    schema = DENSE_SCHEMA.with_metadata({"size": str(state.size)})
    return pa.Table.from_arrays(cols, schema=schema)


def save_server_parts(ckpt: Storage, *, kind: str, server: int, num_servers: int, num_vshards: int,
                      sparse: dict[str, list[SparseTable]], dense: dict[str, DenseState] | None = None,
                      groups: int = 16, threads: int = 2, resumed_with: dict | None = None) -> dict:
    """Write this server's part files and its part report into the checkpoint directory ``ckpt``.

    Parameters
    ----------
    ckpt : Storage
        Rooted at the checkpoint directory (``.../20240101/0100-delta``).
    kind : {"base", "delta"}
    server, num_servers, num_vshards : int
        This server's rank, the cluster size and the routing's vshard count.
    sparse : dict of str -> list of SparseTable
        The local shards of each sparse table.
    dense : dict of str -> DenseState, optional
        The dense blocks this server holds (written in full in bases and deltas alike).
    groups : int
        Vshard groups per table (the manifest records it).
    threads : int
        Local shards captured and written concurrently. A base streams each shard's rows into its part
        files (``_GroupFiles``): memory holds the shard's RAM rows copied at one instant plus
        ``groups x STREAM_ROWS`` rows, never the shard's RocksDB rows; a delta holds its dirty RAM rows
        copied at its instant plus ``groups x STREAM_ROWS`` rows, reading its spilled dirty rows as it
        writes them.
    resumed_with : dict, optional
        ``{"id": ID, "uri": URI}`` of a server started with ``--resume URI --resume-id ID`` (``engine k8s
        --resume URI``): recorded in the report, and by the coordinator in the manifest's
        ``resumed_with``, so a server replaced later with the same arguments restores the job's newest
        checkpoint written since that resume instead of URI again (``job_checkpoints.resumed_since``).

    Returns
    -------
    dict
        The part report (also written to ``_parts/s{SSSS}.json``): ``files`` (name -> {size, crc32}),
        ``rows`` and ``tombstones`` (table -> count), ``tables`` (schema facts), ``dense`` sizes.

    Raises
    ------
    ValueError
        Bad kind or table name.
    OSError
        Storage errors (typed ``hdfs_io.StorageError`` subclasses where hdfs_io raises them).
    sparse_tables.errors.SpillError
        RocksDB reported a read error while a shard's rows were read (not retried: the save fails and
        its files are removed).
    """
    if kind not in ("base", "delta"):
        raise ValueError(f"kind must be 'base' or 'delta', got {kind!r}")
    dense = dense or {}
    _check_names(list(sparse) + list(dense))
    files: dict[str, dict] = {}
    rows: dict[str, int] = {}
    tombs: dict[str, int] = {}

    def one_shard(name: str, j: int, shard: SparseTable):
        sketch: list = []       # the admission sketch, copied in the rows' locked step
        if kind == "base":
            written, n = call_with_retry(
                lambda: _dump_base(ckpt, name, server, j, shard, num_vshards, groups, sketch),
                policy=ckpt.retry, stats=ckpt.retry_stats, uri=ckpt.uri,
                what=f"base of table {name!r} shard {j} to {ckpt.uri}")
            deleted = np.empty(0, np.uint64)
        else:
            # the delta's instant: dirty marks cleared, RAM rows copied and RocksDB's view made at once;
            # a retry (transient storage error) writes the same rows again from that instant
            dump = shard.dirty_dump(clear=True, sketch=sketch)
            try:
                written, n = call_with_retry(
                    lambda: _stream_parts(ckpt, name, server, j, dump.schema, dump, num_vshards, groups),
                    policy=ckpt.retry, stats=ckpt.retry_stats, uri=ckpt.uri,
                    what=f"delta of table {name!r} shard {j} to {ckpt.uri}")
            finally:
                dump.close()
            deleted = dump.deleted
        if sketch:
            written = {**written, **write_sketch_part(ckpt, name, server, j, sketch[-1])}
        return name, written, n, deleted

    jobs = [(name, j, shard) for name, shards in sparse.items() for j, shard in enumerate(shards)]
    deleted_by_table: dict[str, list[np.ndarray]] = {name: [] for name in sparse}
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"ckpt-save-s{server}") as pool:
        for name, written, n, deleted in pool.map(lambda a: one_shard(*a), jobs):
            files.update(written)
            rows[name] = rows.get(name, 0) + n
            deleted_by_table[name].append(deleted)
    for name in sparse:
        rows.setdefault(name, 0)
        keys = unique_keys(np.concatenate(deleted_by_table[name])) if deleted_by_table[name] else \
            np.empty(0, np.uint64)
        tombs[name] = int(len(keys))
        if kind == "delta" and len(keys):
            fname = f"tombstones/{name}/s{server:04d}.arrow"
            # "at_parent": every key had a row at the parent (``sparse_tables._delta``), so a restore
            # that holds the parent deletes them without reading RocksDB; files without it may not
            table = pa.Table.from_arrays([pa.array(keys, pa.uint64())],
                                         schema=TOMBSTONE_SCHEMA.with_metadata({"at_parent": "1"}))
            files[fname] = write_ipc_file(ckpt, fname, table).to_json()
    dense_sizes = {}
    for name, state in dense.items():
        dense_sizes[name] = {"size": state.size}
        if state.blocks:
            fname = f"dense/{name}/s{server:04d}.arrow"
            files[fname] = write_ipc_file(ckpt, fname, _dense_table(state)).to_json()
    tables = {name: {"dim": shards[0].layout.dim, "optimizer": shards[0].config.optimizer,
                     "state_width": shards[0].layout.state_width,
                     **({"sketch": facts} if (facts := sketch_facts(shards)) else {})}
              for name, shards in sparse.items() if shards}
    report = {"server": server, "num_servers": num_servers, "num_vshards": num_vshards, "groups": groups,
              "kind": kind, "files": files, "rows": rows, "tombstones": tombs, "tables": tables,
              "dense": dense_sizes, **({"resumed_with": dict(resumed_with)} if resumed_with else {})}
    ckpt.write_bytes(part_report_name(server), json.dumps(report, sort_keys=True).encode())
    log.info("server %d wrote %s part of %s: %d file(s), %d row(s), %d tombstone(s)", server, kind,
             ckpt.uri, len(files), sum(rows.values()), sum(tombs.values()))
    return report
