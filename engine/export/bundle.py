"""The serving bundle: write one from an :class:`~engine.export.base.ExportSource`, read one back.

Layout of a full bundle (published atomically through :class:`hdfs_io.Publisher`)::

    OUT/
      model.json                        what the bundle is (below)
      dense.npz                         one array per dense layer ("fc0.weight": float32[273, 400], ...)
      embeddings/group-00000-of-00016.arrow   rows of vshard group 0, sorted by key
      ...                                     (zstd Arrow IPC file: key uint64,
      embeddings/group-00015-of-00016.arrow    values fixed_size_list<float32|float16>[width])
      model.onnx                        only with --format onnx (see engine.export.onnx_export)
      manifest.json                     sizes and CRC-32 of every file above (hdfs_io)
      _SUCCESS                          written last; a bundle without it does not exist

``group = vshard_of(key, num_vshards) * vshard_groups // num_vshards`` (``engine.ps.routing``), so a
serving system sharded by vshard ranges loads only its own files. There is no optimizer state and no
show/click metadata: ``min_show`` filtering happens at export time.

A delta bundle has the same layout, but its group files hold only the rows that differ from its
parent export (new keys, or values that changed in the stored dtype), plus ``deleted.arrow``
(``key uint64``, sorted: keys of the parent that are gone, by expiry or by falling under
``min_show``). Applying the chain base → delta 1 → ... → delta n (:func:`apply_rows`) gives exactly
the full export of the source delta n was made from. Deltas are computed by diffing the source against
the parent's reconstructed state, one vshard group at a time, so any source works and nothing depends
on the source tracking dirty rows.

``model.json`` (worked example, a float16 delta of CTR-DNN)::

    {"format": "engine-bundle/1", "bundle": "delta", "export_id": "20240101T0200Z-3fa2c1d0",
     "sequence": 2,                                     # 0 for the base, then 1, 2, ...
     "parent": {"uri": "s3://serve/ctr/0100", "export_id": "20240101T0100Z-..."},
     "chain": [{"uri": "s3://serve/ctr/base", "export_id": ...}, {"uri": ".../0100", ...}],
     "exported_at": "2024-01-01T02:00:05Z", "source": {"uri": "...", "checkpoint": {...}},
     "model": {"kind": "ctr_dnn", "num_slots": 26, "dim": 10, "dense_dim": 13,
               "hidden": [400, 400, 400], "seed": 0, "dtype": "float32"},
     "input": {"slots": ["C1", ...], "slot_ids": {"C1": 1, ...}, "dense_column": "dense",
               "label_column": "label"},
     "hashing": {"hash_version": 1, "slot_bits": 16, "layout": "slot << 48 | xxh64(raw) & (2**48-1)"},
     "embedding": {"width": 10, "dtype": "float16", "min_show": 0.0, "num_vshards": 1024,
                   "vshard_groups": 16, "rows": 5321, "deleted": 12,
                   "files": [{"name": "embeddings/group-00000-of-00016.arrow", "group": 0, "rows": 333}, ...]},
     "dense": {"file": "dense.npz", "size": 270801,
               "layout": [{"name": "fc0.weight", "offset": 0, "shape": [273, 400]}, ...]}}
"""
from __future__ import annotations

import datetime as _dt
import io
import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

import hdfs_io
import hdfs_io.temp_names
from hdfs_io import Publisher, Storage, StorageOptions

from .errors import BundleError, ExportError
from .base import ExportSource, check_description

__all__ = ["FORMAT", "MODEL_FILE", "DENSE_FILE", "DELETED_FILE", "export_bundle", "open_bundle",
           "BundleInfo", "resolve_chain", "apply_rows", "chain_group", "emb_schema", "split_uri",
           "DEFAULT_GROUPS"]

log = logging.getLogger(__name__)

FORMAT = "engine-bundle/1"
MODEL_FILE = "model.json"
DENSE_FILE = "dense.npz"
DELETED_FILE = "deleted.arrow"
DEFAULT_GROUPS = 16
_DTYPES = {"float32": np.float32, "float16": np.float16}


def emb_schema(width: int, dtype: str) -> pa.Schema:
    """Schema of an embedding file: ``key uint64``, ``values fixed_size_list<dtype>[width]``."""
    vt = pa.float16() if dtype == "float16" else pa.float32()
    return pa.schema([pa.field("key", pa.uint64(), nullable=False),
                      pa.field("values", pa.list_(vt, width), nullable=False)],
                     metadata={"width": str(width), "dtype": dtype})


def _group_file(g: int, groups: int) -> str:
    return f"embeddings/group-{g:05d}-of-{groups:05d}.arrow"


def split_uri(uri: str, storage_options: StorageOptions | None = None) -> tuple[Storage, str]:
    """``(Storage rooted at the parent, name)`` for a bundle URI (``s3://b/serve/ctr`` -> ``s3://b/serve``,
    ``ctr``); plain paths are made absolute."""
    if "://" not in uri:
        uri = os.path.abspath(uri)
    uri = uri.rstrip("/")
    parent, _, name = uri.rpartition("/")
    if not name or not parent or parent.endswith(":/"):
        raise BundleError(f"{uri}: expected a bundle directory below a root (e.g. s3://bucket/serve/ctr)")
    return Storage.from_uri(parent, storage_options=storage_options), name


def _canonical_uri(uri: str) -> str:
    return uri.rstrip("/") if "://" in uri else os.path.abspath(uri)


# ------------------------------------------------------------------------------------------ reading
@dataclass
class BundleInfo:
    """A published bundle directory: its manifest and ``model.json``; files are read on demand."""

    uri: str
    storage: Storage
    name: str
    manifest: dict
    meta: dict

    @property
    def export_id(self) -> str:
        return self.meta["export_id"]

    @property
    def is_delta(self) -> bool:
        return self.meta["bundle"] == "delta"

    def _entry(self, rel: str):
        entries = hdfs_io.file_entries(self.manifest)
        if rel not in entries:
            raise BundleError(f"{self.uri}/{rel}: not listed in the bundle's manifest.json")
        return entries[rel]

    def read_table(self, rel: str) -> pa.Table:
        return hdfs_io.read_ipc_file(self.storage, f"{self.name}/{rel}", expected=self._entry(rel))

    def read_group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of vshard group ``g``: ``keys : uint64[n]`` (sorted), ``values : T[n, width]``
        (``T`` = the bundle's dtype)."""
        emb = self.meta["embedding"]
        rel = _group_file(g, emb["vshard_groups"])
        t = self.read_table(rel)
        return _table_arrays(t, emb["width"], emb["dtype"], f"{self.uri}/{rel}")

    def read_deleted(self) -> np.ndarray:
        """Tombstones of a delta, ``uint64[k]`` sorted; empty for a full bundle."""
        if not self.is_delta:
            return np.empty(0, np.uint64)
        t = self.read_table(DELETED_FILE)
        return np.ascontiguousarray(t.column("key").to_numpy(), np.uint64)

    def read_dense(self) -> np.ndarray:
        """The flat dense parameters ``float32[P]`` in the layout of ``model.json``."""
        d = self.meta["dense"]
        raw = self.storage.read_buffer(f"{self.name}/{d['file']}")
        hdfs_io.arrow_io.check_entry(self.storage, f"{self.name}/{d['file']}", raw, self._entry(d["file"]))
        out = np.empty(d["size"], np.float32)
        with np.load(io.BytesIO(raw.to_pybytes())) as z:
            for e in d["layout"]:
                n = int(np.prod(e["shape"]))
                arr = z.get(e["name"])
                if arr is None or arr.size != n:
                    raise BundleError(f"{self.uri}/{d['file']}: array {e['name']!r}: expected "
                                      f"{e['shape']}, got {None if arr is None else arr.shape}")
                out[e["offset"]:e["offset"] + n] = arr.reshape(-1)
        return out


def _table_arrays(t: pa.Table, width: int, dtype: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    expected = emb_schema(width, dtype)
    for f in expected:
        i = t.schema.get_field_index(f.name)
        if i < 0 or not t.schema.field(i).type.equals(f.type):
            got = None if i < 0 else t.schema.field(i).type
            raise BundleError(f"{where}: column {f.name!r}: expected {f.type}, got {got}")
    t = t.combine_chunks()
    n = t.num_rows
    keys = np.ascontiguousarray(t.column("key").to_numpy(), np.uint64) if n else np.empty(0, np.uint64)
    vals = t.column("values")
    flat = vals.chunk(0).flatten().to_numpy(zero_copy_only=False) if n else np.empty(0, _DTYPES[dtype])
    return keys, np.ascontiguousarray(flat, _DTYPES[dtype]).reshape(n, width)


def open_bundle(uri: str, storage_options: StorageOptions | None = None) -> BundleInfo:
    """Open a published bundle (full or delta): manifest and ``model.json``, checked.

    Raises
    ------
    hdfs_io.NotPublishedError
        No ``_SUCCESS`` marker: the bundle is incomplete or still being written (the path is named).
    hdfs_io.CheckpointCorruptError
        ``manifest.json`` or ``model.json`` missing, truncated or corrupt.
    BundleError
        ``model.json`` of another format or malformed.
    """
    uri = _canonical_uri(uri)
    storage, name = split_uri(uri, storage_options)
    try:
        manifest = hdfs_io.read_manifest(storage, name)
    except hdfs_io.NotPublishedError as e:
        raise hdfs_io.NotPublishedError(
            f"bundle {uri} is not loadable: no {hdfs_io.SUCCESS_NAME} marker at "
            f"{storage.uri_of(name)}/{hdfs_io.SUCCESS_NAME} (export incomplete or still running)",
            uri=e.uri) from None
    entries = hdfs_io.file_entries(manifest)
    if MODEL_FILE not in entries:
        raise BundleError(f"{uri}/{MODEL_FILE}: missing from the manifest (not a bundle?)")
    raw = storage.read_buffer(f"{name}/{MODEL_FILE}")
    hdfs_io.arrow_io.check_entry(storage, f"{name}/{MODEL_FILE}", raw, entries[MODEL_FILE])
    try:
        meta = json.loads(raw.to_pybytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{uri}/{MODEL_FILE}: not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise BundleError(f"{uri}/{MODEL_FILE}: format: expected {FORMAT!r}, "
                          f"got {meta.get('format') if isinstance(meta, dict) else meta!r}")
    for key in ("bundle", "export_id", "model", "input", "hashing", "embedding", "dense"):
        if key not in meta:
            raise BundleError(f"{uri}/{MODEL_FILE}: missing key {key!r}")
    return BundleInfo(uri, storage, name, manifest, meta)


def resolve_chain(uri: str, storage_options: StorageOptions | None = None) -> list[BundleInfo]:
    """The bundles to apply in order to obtain the state of ``uri``: ``[base, delta 1, ..., uri]``.

    Raises
    ------
    BundleError
        A link of the chain was moved or re-exported (its ``export_id`` differs from the recorded one).
    """
    last = open_bundle(uri, storage_options)
    if not last.is_delta:
        return [last]
    chain = []
    for link in last.meta["chain"]:
        info = open_bundle(link["uri"], storage_options)
        if info.export_id != link["export_id"]:
            raise BundleError(f"{link['uri']}: export_id is {info.export_id}, but delta {uri} was made "
                              f"on {link['export_id']} (the bundle was overwritten or moved)")
        chain.append(info)
    return chain + [last]


def apply_rows(keys: np.ndarray, values: np.ndarray, deleted: np.ndarray, up_keys: np.ndarray,
               up_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One delta step on sorted rows: drop ``deleted`` keys, insert or overwrite ``up_keys``.

    Parameters
    ----------
    keys : uint64[n], sorted, unique
    values : T[n, w]
    deleted : uint64[k]
    up_keys : uint64[m], unique
    up_values : T[m, w]

    Returns
    -------
    keys : uint64[n'] sorted, values : T[n', w]
    """
    drop = np.concatenate([deleted, up_keys]) if len(deleted) else up_keys
    keep = ~np.isin(keys, drop, assume_unique=False) if len(drop) else np.ones(len(keys), bool)
    k = np.concatenate([keys[keep], up_keys])
    v = np.concatenate([values[keep], up_values.astype(values.dtype, copy=False)])
    order = np.argsort(k, kind="stable")
    return k[order], v[order]


def chain_group(chain: Sequence[BundleInfo], g: int) -> tuple[np.ndarray, np.ndarray]:
    """State of vshard group ``g`` after applying ``chain`` (base first)."""
    keys, vals = chain[0].read_group(g)
    groups, nv = chain[0].meta["embedding"]["vshard_groups"], chain[0].meta["embedding"]["num_vshards"]
    for info in chain[1:]:
        uk, uv = info.read_group(g)
        dele = info.read_deleted()
        if len(dele):
            dele = dele[_groups_of(dele, nv, groups) == g]
        keys, vals = apply_rows(keys, vals, dele, uk, uv)
    return keys, vals


def _groups_of(keys: np.ndarray, num_vshards: int, groups: int) -> np.ndarray:
    from ..ps.routing import vshard_of
    return (vshard_of(np.ascontiguousarray(keys, np.uint64), num_vshards).astype(np.int64)
            * groups) // num_vshards


# ------------------------------------------------------------------------------------------ writing
def _check_rows(rb: pa.RecordBatch, width: int, need_show: bool, where: str):
    names = rb.schema.names
    if "key" not in names or not rb.schema.field("key").type.equals(pa.uint64()):
        raise ExportError(f"{where}: column 'key': expected uint64, got "
                          f"{rb.schema.field('key').type if 'key' in names else None}")
    vt = pa.list_(pa.float32(), width)
    if "values" not in names or not rb.schema.field("values").type.equals(vt):
        raise ExportError(f"{where}: column 'values': expected {vt} (model sparse_width {width}), got "
                          f"{rb.schema.field('values').type if 'values' in names else None}")
    n = rb.num_rows
    keys = np.ascontiguousarray(rb.column("key").to_numpy(zero_copy_only=False), np.uint64)
    vcol = rb.column("values")
    flat = vcol.flatten().to_numpy(zero_copy_only=False) if n else np.empty(0, np.float32)
    vals = flat.reshape(n, width)
    show = None
    if need_show:
        if "show" not in names or not rb.schema.field("show").type.equals(pa.float32()):
            raise ExportError(f"{where}: column 'show': expected float32 (min_show filtering needs the "
                              f"show counts), got {rb.schema.field('show').type if 'show' in names else None}")
        show = rb.column("show").to_numpy(zero_copy_only=False)
    return keys, vals, show


def _dense_npz(model, dense: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{name: dense[off:off + int(np.prod(shape))].reshape(shape)
                     for name, off, shape in model.dense_layout.entries})
    return buf.getvalue()


def _build(desc: dict):
    from models import build_model
    cfg = dict(desc["model"])
    kind = cfg.pop("kind")
    if kind not in ("ctr_dnn", "deepfm"):
        raise ExportError(f"model description: model.kind: the bundle format holds ctr_dnn or deepfm, "
                          f"got {kind!r} (word2vec tables export with --format word2vec)")
    cfg["dtype"] = "float32"
    try:
        return build_model(kind, **cfg)
    except Exception as e:  # ModelConfigError and friends, named
        raise ExportError(f"model description: model: {e}") from None


def _since_options(chain: list[BundleInfo], width: int, model_cfg: dict, dtype: str | None,
                   min_show: float | None, groups: int | None) -> tuple[str, float, int]:
    emb = chain[-1].meta["embedding"]
    uri = chain[-1].uri
    got = {"dtype": dtype, "min_show": min_show, "vshard_groups": groups}
    for key, val in got.items():
        if val is not None and val != emb[key]:
            raise ExportError(f"--delta {uri}: {key} is {emb[key]!r} there, got {val!r} (a delta keeps the "
                              f"options of its base)")
    if emb["width"] != width:
        raise ExportError(f"--delta {uri}: embedding width is {emb['width']} there, the source has {width}")
    old = {k: v for k, v in chain[-1].meta["model"].items() if k not in ("seed", "dtype")}
    new = {k: v for k, v in model_cfg.items() if k not in ("seed", "dtype")}
    if old != new:
        raise ExportError(f"--delta {uri}: model differs: {old} there, {new} in the source")
    return emb["dtype"], float(emb["min_show"]), int(emb["vshard_groups"])


def export_bundle(source: ExportSource, out_uri: str, *, min_show: float | None = None,
                  dtype: str | None = None, since: str | None = None, groups: int | None = None,
                  storage_options: StorageOptions | None = None, overwrite: bool = False,
                  extra_files: Mapping[str, bytes] | None = None) -> dict:
    """Write a serving bundle (module docstring) from ``source``.

    Parameters
    ----------
    source : ExportSource
    out_uri : str
        Bundle directory on any :mod:`hdfs_io` backend (``/local``, ``s3://``, ``hdfs://``).
    min_show : float, default 0
        Drop rows with ``show < min_show`` (Paddle's save threshold); needs a ``show`` column. Finite, >= 0.
    dtype : {"float32", "float16"}, default "float32"
        Stored embedding dtype (float16 halves the values).
    since : str, optional
        URI of an earlier export (full or delta): write a delta against it. Options default to (and
        must equal) the ones of that export.
    groups : int, default 16
        Vshard groups = embedding files, in ``[1, num_vshards]``; each is a contiguous vshard range.
    overwrite : bool
        Replace a published bundle at ``out_uri``. Only a bundle is ever replaced (``engine.export.target``:
        a file, a checkpoint or a directory holding other names never is), and only once every input
        was read and checked (the ``since`` chain's files and CRC-32s included). On a local disk the new
        bundle is published beside ``out_uri`` and swapped in, so a failure keeps the old one; elsewhere
        (S3, HDFS) the old one is deleted at the publish, so a failure from then on leaves none there.
    extra_files : mapping name -> bytes
        More files to publish inside the bundle (``model.onnx``).

    Returns
    -------
    dict
        The ``model.json`` written.

    Raises
    ------
    ExportError
        Bad description, rows of the wrong schema, duplicate keys, dense size mismatch, a ``min_show`` that
        is negative or not finite, a ``groups`` outside [1, num_vshards], options that contradict the delta's
        base; ``out_uri`` is a file or a directory that is not a bundle (a few of
        its foreign names quoted), is, contains or is inside the source checkpoint's job root, or is
        ``since`` or a link of its chain. Nothing at ``out_uri`` was changed.
    FileExistsError
        ``out_uri`` is published and ``overwrite`` is false.
    hdfs_io.NotPublishedError, hdfs_io.CheckpointCorruptError
        A bundle of the ``since`` chain is unpublished, or one of its files is missing or damaged (named);
        nothing at ``out_uri`` was changed.
    """
    from . import target as T
    t0 = time.perf_counter()
    storage, name = split_uri(out_uri, storage_options)
    # nothing at OUT is touched before every check below has passed (a failed export loses nothing)
    T.check_not_source(out_uri, getattr(source, "source_uri", None))
    state = T.check_bundle_target(storage, name, overwrite=overwrite)
    desc = check_description(source.model_description())
    model = _build(desc)
    width = model.sparse_width
    dense = np.asarray(source.dense())
    if dense.shape != (model.dense_size,) or dense.dtype.kind != "f":
        raise ExportError(f"dense: expected float32[{model.dense_size}] for {model!r}, got "
                          f"{dense.dtype}{list(dense.shape)}")
    dense = dense.astype(np.float32, copy=False)
    chain: list[BundleInfo] = []
    if since is not None:
        chain = resolve_chain(since, storage_options)
        for link in chain:
            if T.same_place(link.uri, out_uri):
                raise ExportError(f"--delta {since}: the output {out_uri} is "
                                  f"{'that bundle' if link is chain[-1] else 'a link of its chain'}; a delta "
                                  f"cannot replace a bundle it is made on: export it to a new directory")
        dtype, min_show, groups = _since_options(chain, width, desc["model"], dtype, min_show, groups)
    dtype = dtype or "float32"
    min_show = 0.0 if min_show is None else float(min_show)
    groups = DEFAULT_GROUPS if groups is None else int(groups)
    if dtype not in _DTYPES:
        raise ExportError(f"dtype: expected float32 or float16, got {dtype!r}")
    if not (math.isfinite(min_show) and min_show >= 0):     # nan kept every row, inf none (a bundle of 0 rows)
        raise ExportError(f"min_show: expected a finite number >= 0 (rows shown fewer times are dropped), "
                          f"got {min_show}")
    nv = desc["num_vshards"]
    if not 1 <= groups <= nv:
        raise ExportError(f"groups: expected an int in [1, num_vshards={nv}], got {groups}")

    # 1. partition every row by vshard group (filtered by min_show, still float32)
    pieces: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(groups)]
    seen = dropped = 0
    for i, rb in enumerate(source.embedding_batches()):
        keys, vals, show = _check_rows(rb, width, min_show > 0, f"{source.source_uri}: row batch {i}")
        seen += len(keys)
        if show is not None:
            keep = show >= min_show
            dropped += int((~keep).sum())
            keys, vals = keys[keep], vals[keep]
        grp = _groups_of(keys, nv, groups)
        order = np.argsort(grp, kind="stable")
        bounds = np.searchsorted(grp[order], np.arange(groups + 1))
        for g in range(groups):
            sel = order[bounds[g]:bounds[g + 1]]
            if len(sel):
                pieces[g].append((keys[sel], vals[sel]))

    # 2. per group: sort, cast, (delta: diff against the parent's state, reading and checking every file
    #    of the chain): all of it before the publish, which is the first step that changes OUT
    outputs: list[tuple[np.ndarray, np.ndarray]] = []
    deleted_all, rows_out, nonfinite = [], 0, 0
    for g in range(groups):
        part = pieces[g]
        pieces[g] = []
        keys = np.concatenate([p[0] for p in part]) if part else np.empty(0, np.uint64)
        vals = np.concatenate([p[1] for p in part]) if part else np.empty((0, width), np.float32)
        del part
        order = np.argsort(keys, kind="stable")
        keys, vals = keys[order], vals[order].astype(_DTYPES[dtype])
        dup = np.flatnonzero(keys[1:] == keys[:-1])
        if len(dup):
            raise ExportError(f"{source.source_uri}: key {int(keys[dup[0]])} appears more than once "
                              f"in the rows (a source must yield each row once)")
        nonfinite += int((~np.isfinite(vals)).any(axis=1).sum())
        if chain:
            keys, vals, gone = _diff(chain, g, keys, vals)
            deleted_all.append(gone)
        outputs.append((keys, vals))
        rows_out += len(keys)
    deleted = np.sort(np.concatenate(deleted_all)) if deleted_all else np.empty(0, np.uint64)
    dense_bytes = _dense_npz(model, dense)

    # 3. publish. A published bundle replaced on a local disk is staged beside OUT and swapped in once
    #    complete (the old one stays until then); elsewhere (S3: no directory rename) it is deleted
    #    first, so a failure from here on leaves no bundle at OUT, never a half one that looks complete.
    stage = state == "bundle" and storage.is_local
    if stage:
        T.remove_stale_stages(storage, name)
    target = hdfs_io.temp_names.temp_name(name, T.STAGE_TAG) if stage else name
    export_id = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]
    schema = emb_schema(width, dtype)
    files = []
    try:
        with Publisher(storage, target, overwrite=overwrite and not stage,
                       manifest={"bundle_format": FORMAT, "export_id": export_id}) as pub:
            for g in range(groups):
                keys, vals = outputs[g]
                outputs[g] = None
                rel = _group_file(g, groups)
                pub.write_table(rel, _rows_table(keys, vals, schema), schema=schema)
                files.append({"name": rel, "group": g, "rows": int(len(keys))})
            if chain:
                pub.write_table(DELETED_FILE, pa.table({"key": pa.array(deleted, pa.uint64())}))
            pub.write_bytes(DENSE_FILE, dense_bytes)
            for fname, data in (extra_files or {}).items():
                pub.write_bytes(fname, data)
            meta = _model_json(desc, model, source, export_id, chain, dtype, min_show, groups, files,
                               rows_out, len(deleted), sorted(extra_files or {}))
            pub.write_bytes(MODEL_FILE, json.dumps(meta, indent=1, sort_keys=True).encode())
        if stage:
            T.swap_in(storage, target, name)
    except BaseException:
        if stage:
            try:
                storage.delete(target, missing_ok=True)
            except Exception as exc:  # noqa: BLE001 - the error that brought us here matters more
                log.warning("could not remove the staged bundle %s: %s", storage.uri_of(target), exc)
        raise
    if nonfinite:
        log.warning("%d exported rows hold inf/nan values (dtype %s)", nonfinite, dtype)
    log.info("exported %s bundle %s: %d of %d rows (%d under min_show %g), %d deleted, %s, %.1f s",
             meta["bundle"], out_uri, rows_out, seen, dropped, min_show, len(deleted), dtype,
             time.perf_counter() - t0)
    meta["stats"] = {"rows_seen": seen, "rows_below_min_show": dropped, "seconds": time.perf_counter() - t0}
    return meta


def _rows_table(keys: np.ndarray, vals: np.ndarray, schema: pa.Schema) -> pa.Table:
    vt = schema.field("values").type
    flat = pa.array(np.ascontiguousarray(vals).reshape(-1), type=vt.value_type)
    return pa.Table.from_arrays([pa.array(keys, pa.uint64()),
                                 pa.FixedSizeListArray.from_arrays(flat, vt.list_size)], schema=schema)


def _diff(chain, g, keys, vals):
    """Rows of (keys, vals) that differ from the chain's state of group g, and the keys gone from it."""
    pk, pv = chain_group(chain, g)
    pos = np.searchsorted(pk, keys)
    pos_c = np.minimum(pos, max(len(pk) - 1, 0))
    found = (pos < len(pk)) & (pk[pos_c] == keys) if len(pk) else np.zeros(len(keys), bool)
    changed = ~found
    if found.any():
        bits = np.uint16 if vals.dtype == np.float16 else np.uint32
        same = (pv[pos_c[found]].view(bits) == vals[found].view(bits)).all(axis=1)
        changed[np.flatnonzero(found)[~same]] = True
    gone = pk[~np.isin(pk, keys)] if len(pk) else np.empty(0, np.uint64)
    return keys[changed], vals[changed], gone


def _model_json(desc, model, source, export_id, chain, dtype, min_show, groups, files, rows, deleted,
                extra) -> dict[str, Any]:
    from streaming import keys as K
    now = time.time()
    parent = {"uri": chain[-1].uri, "export_id": chain[-1].export_id} if chain else None
    return {
        "format": FORMAT, "bundle": "delta" if chain else "full", "export_id": export_id,
        "sequence": (chain[-1].meta["sequence"] + 1) if chain else 0,
        "parent": parent,
        "chain": [{"uri": c.uri, "export_id": c.export_id} for c in chain],
        "exported_at": _dt.datetime.fromtimestamp(now, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "exported_unix_s": now,
        "source": {"uri": source.source_uri, "checkpoint": desc.get("checkpoint")},
        "model": {**model.config(), "seed": desc["model"].get("seed", 0)},
        "input": {"slots": desc["slots"], "slot_ids": desc["slot_ids"], "dense_column": desc["dense_column"],
                  "label_column": desc["label_column"]},
        "hashing": {"hash_version": desc["hash_version"], "slot_bits": K.SLOT_BITS,
                    "layout": "slot << 48 | xxh64(raw bytes, seed 0) & (2**48 - 1) (streaming.keys)"},
        "embedding": {"width": model.sparse_width, "dtype": dtype, "min_show": min_show,
                      "num_vshards": desc["num_vshards"], "vshard_groups": groups,
                      "group_of_vshard": "group = vshard * vshard_groups // num_vshards",
                      "rows": int(rows), "deleted": int(deleted), "files": files},
        "dense": {"file": DENSE_FILE, "size": model.dense_size,
                  "layout": [{"name": n, "offset": o, "shape": list(s)} for n, o, s in model.dense_layout.entries]},
        "extra_files": extra,
    }
