"""The admission sketches in a checkpoint: one part file per local shard of a table that admits by count.

Part file (Arrow IPC file format, zstd buffers; written in bases and deltas alike, as the dense blocks)::

    sketch/{table}/s{SSSS}-j{JJ}.arrow    counts large_list<uint32>: one row per sketch row
                                          (sketch_depth rows of sketch_width counts) of local shard JJ
                                          of server SSSS, copied in the same locked step as its rows

The manifest's table facts gain ``sketch: {depth, width, local_shards}`` (from the part reports).

A count-min sketch cannot be split by key, but every count in it comes from keys of the shard's own
vshards. A restore therefore gives each local shard the element-wise maximum of the saved sketches
whose vshards overlap its own (with the same ``num_vshards``; all of them when the cut changed). The
same layout gets back exactly the counts it saved; another layout gets counts that are still at least
each key's true count (the owner's sketch is among those maximized, and a count-min estimate never
undercounts), so no key is admitted later than without the restore. Why the sketch is saved at all:
``sparse_tables._admission``.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import pyarrow as pa

from hdfs_io import CheckpointCorruptError, FileEntry, Storage, write_ipc_file

from ..sharding import routing
from .part_files import check_columns, read_part

__all__ = ["SKETCH_SCHEMA", "SKETCH_RE", "sketch_part_name", "sketch_facts", "write_sketch_part",
           "read_sketches"]

log = logging.getLogger(__name__)

SKETCH_SCHEMA = pa.schema([pa.field("counts", pa.large_list(pa.uint32()), nullable=False)])
SKETCH_RE = re.compile(r"^sketch/([^/]+)/s(\d+)-j(\d+)\.arrow$")


def sketch_part_name(table: str, server: int, j: int) -> str:
    """The part file of local shard ``j`` of ``server``'s admission sketch of ``table``."""
    return f"sketch/{table}/s{server:04d}-j{j:02d}.arrow"


def sketch_facts(shards: list) -> dict | None:
    """``{"depth", "width", "local_shards"}`` of a table's shards (``SparseTable``) for the part report,
    or None when the table has no admission sketch."""
    depth, width = shards[0].sketch_shape
    if not depth:
        return None
    return {"depth": int(depth), "width": int(width), "local_shards": len(shards)}


def write_sketch_part(ckpt: Storage, table: str, server: int, j: int, counts: np.ndarray) -> dict:
    """Write ``counts`` (uint32[depth, width]) as local shard ``j``'s sketch part file; returns its
    file entry ``{name: {size, crc32}}`` for the part report. Storage errors propagate (OSError)."""
    flat = pa.array(np.ascontiguousarray(counts, np.uint32).reshape(-1), pa.uint32())
    offsets = pa.array(np.arange(counts.shape[0] + 1, dtype=np.int64) * counts.shape[1], pa.int64())
    lists = pa.LargeListArray.from_arrays(offsets, flat)
    fname = sketch_part_name(table, server, j)
    return {fname: write_ipc_file(ckpt, fname, pa.Table.from_arrays([lists], schema=SKETCH_SCHEMA)).to_json()}


def _read_counts(ckpt: Storage, fname: str, entry: FileEntry, shape: tuple[int, int]) -> np.ndarray:
    uri = ckpt.uri_of(fname)
    table = read_part(ckpt, fname, entry)
    check_columns(table, SKETCH_SCHEMA, uri, "admission sketch")
    col = table.column("counts")
    arr = col.combine_chunks()
    lengths = np.diff(arr.offsets.to_numpy()) if len(arr) else np.empty(0, np.int64)
    if len(arr) != shape[0] or (lengths != shape[1]).any():
        raise CheckpointCorruptError(f"{uri}: admission sketch: expected {shape[0]} rows of {shape[1]} "
                                     f"counts, got {len(arr)} rows of lengths {sorted(set(lengths.tolist()))}",
                                     uri=uri)
    return arr.flatten().to_numpy(zero_copy_only=False).astype(np.uint32, copy=False).reshape(shape)


def read_sketches(ckpt: Storage, manifest: dict, files: list, table: str, shards: list,
                  num_vshards: int, local_owner: np.ndarray) -> list | None:
    """The admission sketch each of this server's local ``shards`` of ``table`` restores from one
    checkpoint, read and checked before any table changes.

    Parameters
    ----------
    files : list of (server, j, file name, FileEntry)
        The checkpoint's sketch part files of ``table`` (``SKETCH_RE``).
    local_owner : int32[num_vshards]
        Local shard of each vshard on this server, -1 elsewhere.

    Returns
    -------
    list of (uint32[depth, width] or None) per local shard, or None
        None when the checkpoint has no sketch of the table, or this table has none, or their shapes
        differ (logged: those counts are not restored). A shard none of whose vshards a saved shard held
        gets None.

    Raises
    ------
    hdfs_io.CheckpointCorruptError
        A sketch file is missing, damaged (size, CRC-32) or has the wrong column or shape (named).
    """
    facts = manifest["tables"].get("sparse", {}).get(table, {}).get("sketch")
    have = tuple(shards[0].sketch_shape) if shards else (0, 0)
    if not facts or not have[0]:
        return None
    shape = (int(facts["depth"]), int(facts["width"]))
    if shape != have:
        log.warning("sparse table %r: checkpoint %s saved an admission sketch of %d x %d counts, this "
                    "table's is %d x %d (sketch_depth x sketch_width changed): its counts are not "
                    "restored, so keys short of min_count count from zero", table, ckpt.uri, *shape, *have)
        return None
    ck_nv, ck_ns, ck_local = int(manifest["num_vshards"]), int(manifest["num_servers"]), int(facts["local_shards"])
    mine = [local_owner == j for j in range(len(shards))]
    owners: dict[int, np.ndarray] = {}
    out: list = [None] * len(shards)
    for server, j, fname, entry in sorted(files):
        if ck_nv == num_vshards:
            if server not in owners:
                owners[server] = routing.local_shard_owners(ck_nv, ck_ns, server, ck_local)
            theirs = owners[server] == j
            targets = [k for k in range(len(shards)) if (theirs & mine[k]).any()]
        else:       # another cut: a key of any saved shard may be ours
            targets = [k for k in range(len(shards)) if mine[k].any()]
        if not targets:
            continue
        counts = _read_counts(ckpt, fname, entry, shape)
        for k in targets:
            if out[k] is None:
                out[k] = counts.copy()
            else:
                np.maximum(out[k], counts, out=out[k])
    return out
