"""Server side of a restore: one server loads the rows it owns from one published checkpoint.

The coordinator calls this once per checkpoint of the chain, base first (with the server's tables
reset), then each delta in order. A server reads only the part files whose vshard group overlaps its
own vshard range (every file when the checkpoint was cut with another ``num_vshards``), keeps the rows
routed to it and hands each local shard its rows: a checkpoint written by N servers loads onto M.

Every file is checked against its manifest entry (size and CRC-32) before it is parsed; a missing,
short, corrupt or truncated file raises ``hdfs_io.CheckpointCorruptError`` naming the file.
"""
from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import pyarrow as pa

from hdfs_io import CheckpointCorruptError, FileEntry, Storage, file_entries, read_ipc_file
from sparse_tables import SparseTable, TableInputError

from .manifest import read_checkpoint_manifest
from .writer import DenseBlockState

__all__ = ["load_server_parts", "CheckpointMismatchError"]

log = logging.getLogger(__name__)

_SPARSE_RE = re.compile(r"^sparse/([^/]+)/g(\d+)-s(\d+)-j(\d+)\.arrow$")
_TOMB_RE = re.compile(r"^tombstones/([^/]+)/s(\d+)\.arrow$")
_DENSE_RE = re.compile(r"^dense/([^/]+)/s(\d+)\.arrow$")


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the tables it is loaded into (missing table, other dim/optimizer,
    other hash version). The message names the table and both values."""


def _read(ckpt: Storage, name: str, entry: FileEntry) -> pa.Table:
    try:
        return read_ipc_file(ckpt, name, expected=entry)
    except FileNotFoundError as exc:
        uri = ckpt.uri_of(name)
        raise CheckpointCorruptError(f"{uri}: listed in the manifest but missing", uri=uri) from exc


def _group_overlaps(g: int, groups: int, ckpt_vshards: int, local_owner: np.ndarray) -> bool:
    lo, hi = g * ckpt_vshards // groups, (g + 1) * ckpt_vshards // groups
    return bool((local_owner[lo:hi] >= 0).any())


def load_server_parts(ckpt: Storage, *, num_vshards: int, local_owner: np.ndarray,
                      sparse: dict[str, list[SparseTable]],
                      dense_owns: Callable[[str, int], bool] | None = None,
                      manifest: dict | None = None, threads: int = 2) -> tuple[int, dict, dict]:
    """Load this server's rows of one checkpoint (base or delta) into its local shards.

    Parameters
    ----------
    ckpt : Storage
        Rooted at the checkpoint directory.
    num_vshards : int
        This cluster's vshard count.
    local_owner : int32[num_vshards]
        Local shard of each vshard on this server, -1 where another server owns it
        (``routing.local_shard_owners``).
    sparse : dict of str -> list of SparseTable
        This server's shards. For a base they should be empty (the caller resets them).
    dense_owns : callable (table, block) -> bool, optional
        Whether this server holds a dense block; None skips dense tables.
    manifest : dict, optional
        Already read manifest of ``ckpt`` (read here otherwise).
    threads : int
        Files read concurrently.

    Returns
    -------
    (rows, tombstones, dense)
        rows : dict table -> rows loaded; tombstones : dict table -> keys deleted;
        dense : dict table -> (size, {block: DenseBlockState}) of the blocks this server owns.

    Raises
    ------
    hdfs_io.NotPublishedError
        The checkpoint has no ``_SUCCESS``.
    hdfs_io.CheckpointCorruptError
        A file is missing, has the wrong size or checksum, or is not a readable Arrow file (named).
    CheckpointMismatchError
        A checkpoint table is not hosted here, or has another dim / optimizer.
    """
    from ..ps import routing     # here: engine.ps imports this package
    if manifest is None:
        manifest = read_checkpoint_manifest(ckpt, "")
    entries = file_entries(manifest)
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
            log.warning("sparse table %r is not in checkpoint %s; it stays as it is", name, ckpt.uri)
    same_cut = manifest["num_vshards"] == num_vshards
    groups = manifest["groups"]
    sparse_files, tomb_files, dense_files = [], [], []
    for fname, entry in entries.items():
        if m := _SPARSE_RE.match(fname):
            if m.group(1) in sparse and (not same_cut or _group_overlaps(int(m.group(2)), groups,
                                                                       num_vshards, local_owner)):
                sparse_files.append((m.group(1), fname, entry))
        elif m := _TOMB_RE.match(fname):
            if m.group(1) in sparse:
                tomb_files.append((m.group(1), fname, entry))
        elif m := _DENSE_RE.match(fname):
            dense_files.append((m.group(1), fname, entry))

    def load_one(item):
        name, fname, entry = item
        table = _read(ckpt, fname, entry)
        shards = sparse[name]
        n = 0
        for batch in table.to_batches():
            keys = np.ascontiguousarray(batch.column(0).to_numpy())
            local = routing.lookup(keys, num_vshards, local_owner)
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
                uri = ckpt.uri_of(fname)
                raise CheckpointCorruptError(f"{uri}: rows do not fit table {name!r}: {exc}", uri=uri) from exc
        return name, n

    rows = {name: 0 for name in ck_tables if name in sparse}
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-load") as pool:
        for name, n in pool.map(load_one, sparse_files):
            rows[name] += n
    tombs = {name: 0 for name in rows}
    for name, fname, entry in tomb_files:
        keys = np.ascontiguousarray(_read(ckpt, fname, entry).column("key").to_numpy())
        local = routing.lookup(keys, num_vshards, local_owner)
        for j, shard in enumerate(sparse[name]):
            mine = keys[local == j]
            if len(mine):
                tombs[name] += shard.delete(mine)
    for shards in sparse.values():     # restored state is the new "clean" point for the next delta
        for shard in shards:
            shard.clear_dirty()
    dense: dict = {}
    if dense_owns is not None:
        for name, fname, entry in dense_files:
            table = _read(ckpt, fname, entry)
            size = int((table.schema.metadata or {}).get(b"size", b"0"))
            got = dense.setdefault(name, (size, {}))[1]
            cols = table.to_pydict()
            for i, block in enumerate(cols["block"]):
                if not dense_owns(name, int(block)):
                    continue
                arr = lambda v: None if v is None else np.asarray(v, np.float32)  # noqa: E731
                got[int(block)] = DenseBlockState(arr(cols["params"][i]), arr(cols["m"][i]), arr(cols["v"][i]),
                                                  cols["t"][i])
    log.info("loaded %s %s: rows %s, tombstones %s, dense %s", manifest["kind"], ckpt.uri, rows, tombs,
             {k: len(v[1]) for k, v in dense.items()})
    return rows, tombs, dense
