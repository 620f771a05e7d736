"""Score Arrow record batches with a serving bundle alone: no servers, no checkpoint.

::

    bundle = load_bundle("s3://serve/ctr/base")        # base, or a delta (its chain is applied)
    bundle.apply_delta("s3://serve/ctr/0100")           # hourly patch, in order
    probs = bundle.predict(record_batch)                # float32[B]

Per batch (``S`` = slots, ``w`` = row width, ``nnz`` = key occurrences, ``B*S`` for Criteo)::

    columns C1..C26 (uint64 | list<uint64> | string)  ──▶ keys uint64[nnz], cells int32[nnz]
                                                          (cell = example * S + slot; a null value,
                                                          list or list element: no key)
    keys ──hash index lookup──▶ rows of the bundle, float32[nnz, w] (unknown keys: zeros, as the
                                                          trainer's inference pull)
    model.predict(rows, arange(nnz), cells, dense float32[B, D]) ──▶ probabilities float32[B]

The embedding lookup is an open-addressing hash index built when the bundle is loaded
(:mod:`engine.export._kernels`); the forward pass is the ``models`` one, so predictions equal the
trainer's on the same parameters.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pyarrow as pa

from hdfs_io import StorageOptions
from streaming.values import dense_values, label_problem

from . import _kernels as K
from .bundle import BundleInfo, chain_group, open_bundle, resolve_chain
from .errors import BundleError

__all__ = ["Bundle", "load_bundle"]

log = logging.getLogger(__name__)

_UINT64_LISTS = (pa.list_(pa.uint64()), pa.large_list(pa.uint64()))


def _raw_strings(t: pa.DataType) -> bool:
    """A slot column of raw strings, hashed as training hashes them (``streaming.keys.is_raw_strings``:
    views and dictionary-encoded columns too)."""
    from streaming.keys import is_raw_strings
    return is_raw_strings(t)


class Bundle:
    """A loaded bundle: embedding rows in memory behind a hash index, and the model.

    Use :func:`load_bundle`. Calls are serialized by a lock (the model reuses scratch buffers); use
    one ``Bundle`` per thread for parallel scoring.

    Attributes
    ----------
    uri : str
        The last bundle applied (base or delta).
    meta : dict
        Its ``model.json``.
    export_id : str
    model : models.CTRDNN or models.DeepFM
        Dense parameters loaded.
    slots : list of str
        Input column of each model slot.
    keys : uint64[N]
        Keys held, in storage order (not sorted).
    values : float32[N, w] or float16[N, w]
        Their rows, in the bundle's dtype.
    """

    def __init__(self, chain: list[BundleInfo], *, max_batch: int = 8192):
        from models import build_model
        last = chain[-1]
        self._set_meta(last)
        cfg = dict(self.meta["model"])
        kind = cfg.pop("kind")
        cfg["dtype"] = "float32"
        self.model = build_model(kind, **cfg)
        if self.model.sparse_width != self.width:
            raise BundleError(f"{last.uri}/model.json: embedding.width is {self.width}, the model needs "
                              f"{self.model.sparse_width}")
        self.model.set_dense(last.read_dense())
        t0 = time.perf_counter()
        parts = [chain_group(chain, g) for g in range(self.meta["embedding"]["vshard_groups"])]
        self.keys = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.uint64)
        self.values = np.concatenate([p[1] for p in parts]) if parts else np.empty((0, self.width))
        del parts
        self._index()
        self.max_batch = int(max_batch)
        self._lock = threading.RLock()   # predict/pooled/lookup; apply_delta swaps under it
        self._patch_lock = threading.Lock()
        self._rows_scratch = np.empty(0, np.int64)
        self.last_hits = 0
        log.info("loaded bundle %s: %d rows of width %d (%s), %d bundle(s) applied, %.2f s", self.uri,
                 len(self.keys), self.width, self.dtype, len(chain), time.perf_counter() - t0)

    def _set_meta(self, info: BundleInfo) -> None:
        self.uri, self.meta, self.export_id = info.uri, info.meta, info.export_id
        inp, emb = self.meta["input"], self.meta["embedding"]
        self.slots = list(inp["slots"])
        self.slot_ids = dict(inp["slot_ids"])
        self.dense_column = inp["dense_column"]
        self.label_column = inp["label_column"]
        self.hash_version = _check_hash_version(info)
        self.width = int(emb["width"])
        self.dtype = emb["dtype"]

    def _index(self) -> None:
        self._slots, self._raw, self._half = _build_index(self.keys, self.values, self.dtype, self.uri)

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"Bundle({self.uri!r}, rows={len(self)}, model={self.model!r}, dtype={self.dtype})"

    # -------------------------------------------------------------------------------------- lookup
    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Embedding rows of ``keys : uint64[n]`` -> ``float32[n, w]``; unknown keys read zeros."""
        keys = np.ascontiguousarray(keys, np.uint64)
        with self._lock:        # index and rows of one state (apply_delta swaps them together)
            out = np.empty((len(keys), self.width), self._raw.dtype)
            self.last_hits = K.lookup_gather(keys, self._slots, self._raw, out)
        return out.view(np.float16).astype(np.float32) if self.dtype == "float16" else out

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys uint64[N] sorted, values [N, w])``: the rows held, in key order (for comparisons)."""
        order = np.argsort(self.keys, kind="stable")
        return self.keys[order], self.values[order]

    # -------------------------------------------------------------------------------------- input
    def inputs(self, batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Model input of one record batch.

        Parameters
        ----------
        batch : pyarrow.RecordBatch
            One column per slot of ``self.slots`` (uint64 keys, ``list<uint64>`` for multi-valued
            slots, or raw strings hashed with ``streaming.keys``; a null or empty string is the slot's
            missing key, as in training; a null key, a null list and a null element of a list mean no
            key: that slot of the example pools zeros for it) and, when the
            model has dense features, ``self.dense_column`` as ``fixed_size_list<float32>[D]`` without
            nulls, NaN or infinities.

        Returns
        -------
        keys : uint64[nnz]
        cells : int32[nnz]
            ``example * S + slot`` of each key occurrence.
        dense : float32[B, D]

        Raises
        ------
        BundleError
            A missing or mistyped column, keys hashed with another ``hash_version``, or a null, NaN or
            infinite dense value (column and row of ``batch`` named).
        """
        batch, cols, simple = self._slot_columns(batch)
        n, S = batch.num_rows, len(self.slots)
        if simple:
            keys = self._fixed_keys(cols, n)
            cells = np.arange(n * S, dtype=np.int32)
        else:
            ks, cs = [], []
            for j, c in enumerate(cols):
                if isinstance(c, tuple):
                    ks.append(c[0])
                    cs.append(c[1] * S + j)
                else:
                    ks.append(c)
                    cs.append(np.arange(n, dtype=np.int64) * S + j)
            keys = np.concatenate(ks).astype(np.uint64, copy=False)
            cells = np.concatenate(cs).astype(np.int32)
        return keys, cells, self._dense_of(batch, n)

    def _slot_columns(self, batch):
        """(batch as a RecordBatch, per-slot keys, simple): ``simple`` when every slot column is uint64
        without nulls (one key per cell), the per-slot entries then being uint64[B] arrays; otherwise
        an entry is uint64[B] or (keys, example index) for multi-valued / nullable / string slots."""
        if isinstance(batch, pa.Table):
            batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else \
                pa.RecordBatch.from_pylist([], schema=batch.schema)
        md = batch.schema.metadata or {}
        hv = md.get(b"hash_version")
        if hv is not None and int(hv) != self.hash_version:
            raise BundleError(f"input keys use hash_version {int(hv)}, bundle {self.uri} was trained on "
                              f"hash_version {self.hash_version}; re-convert the input")
        n = batch.num_rows
        names = batch.schema.names
        cols = []
        simple = True
        for j, name in enumerate(self.slots):
            if name not in names:
                raise BundleError(f"input: missing slot column {name!r} (bundle slots {self.slots}); "
                                  f"present: {names}")
            col = batch.column(name)
            if col.type == pa.uint64() and col.null_count == 0:
                cols.append(col.to_numpy())
            else:
                simple = False
                cols.append(self._slot_keys_of(col, j, n))
        return batch, cols, simple

    @staticmethod
    def _fixed_keys(cols, n: int) -> np.ndarray:
        """uint64[B*S] example-major keys of one-key-per-cell slot columns."""
        keys = np.empty((n, len(cols)), np.uint64)
        for j, c in enumerate(cols):
            keys[:, j] = c
        return keys.reshape(-1)

    def _slot_keys_of(self, col: pa.Array, j: int, n: int):
        name = self.slots[j]
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        if col.type == pa.uint64():
            valid = np.asarray(col.is_valid())
            return col.fill_null(0).to_numpy()[valid], np.flatnonzero(valid)
        if col.type in _UINT64_LISTS:
            # a null list or a null element is no key: they are masked out here, never read as a float
            # NaN cast to uint64 (garbage keys; every key of the column rounded to float64 with them)
            offs = col.offsets.to_numpy()
            lengths = np.diff(offs)
            vals = col.values.slice(offs[0], offs[-1] - offs[0])
            example = np.repeat(np.arange(n), lengths)
            if not col.null_count and not vals.null_count:
                return np.ascontiguousarray(vals.to_numpy(), np.uint64), example
            keep = np.asarray(vals.is_valid())
            if col.null_count:   # a null list's offsets may still span values
                keep &= np.repeat(np.asarray(col.is_valid()), lengths)
            keys = vals.fill_null(0).to_numpy()
            return np.ascontiguousarray(keys[keep], np.uint64), example[keep]
        if _raw_strings(col.type):
            from streaming import keys as Kk
            if Kk.HASH_VERSION != self.hash_version:
                raise BundleError(f"input: column {name!r} holds raw strings, but this engine hashes with "
                                  f"hash_version {Kk.HASH_VERSION} and the bundle expects {self.hash_version}")
            # as training reads raw strings (ArrowSource's string_slots) and engine convert writes an
            # empty field: a null or empty string is the slot's missing key, whose row was trained; it
            # was no key here (a null) and the hash of "" (an empty string), rows training never had
            return Kk.hash_array(int(self.slot_ids[name]), col, empty_is_missing=True), np.arange(n)
        raise BundleError(f"input: column {name!r}: expected uint64, list<uint64> or string keys, "
                          f"got {col.type}")

    def _dense_of(self, batch: pa.RecordBatch, n: int) -> np.ndarray:
        D = self.model.dense_dim
        if D == 0:
            return np.zeros((n, 0), np.float32)
        name = self.dense_column
        if name not in batch.schema.names:
            raise BundleError(f"input: missing dense column {name!r} (fixed_size_list<float32>[{D}])")
        col = batch.column(name)
        t = col.type
        if not pa.types.is_fixed_size_list(t) or t.list_size != D or not pa.types.is_floating(t.value_type):
            raise BundleError(f"input: column {name!r}: expected fixed_size_list<float32>[{D}], got {t}")
        flat, bad = dense_values(col, D)
        if bad is not None:
            row, reason = bad
            raise BundleError(f"input: column {name!r}, row {row} of the batch (0-based): {reason}")
        return np.ascontiguousarray(flat.reshape(n, D), np.float32)

    def check_values(self, batch: pa.RecordBatch) -> tuple[str, int, str] | None:
        """The first value of ``batch`` this bundle cannot score, as ``(column, row, reason)`` (``row``
        0-based in ``batch``), or None: the ``check`` of ``streaming.source.ArrowSource``, which then
        raises ``DataFormatError`` naming the file, its row and the column (``engine predict`` and
        ``engine eval`` pass it).

        Refused: a missing slot or dense column, or one of a type :meth:`inputs` cannot read (``row`` 0:
        the first row of ``batch``); a null, NaN or infinite value of the dense column, or a null list
        there; when the label column is present, a non-numeric label column, or a null, NaN or label
        outside [0, 1]. Slot values are not checked: their nulls mean no key (see :meth:`inputs`). Reads
        only the bundle's input description: safe to call from a reader thread while another thread
        scores.
        """
        names = batch.schema.names
        D = self.model.dense_dim
        for name in self.slots:
            if name not in names:
                return (name, 0, f"expected a slot column (uint64, list<uint64> or string keys), but the "
                                 f"column is missing (bundle slots {', '.join(self.slots)})")
            t = batch.schema.field(name).type
            if t != pa.uint64() and t not in _UINT64_LISTS and not _raw_strings(t):
                return (name, 0, f"expected uint64, list<uint64> or string keys, got {t}")
        if D:
            if self.dense_column not in names:
                return (self.dense_column, 0, f"expected fixed_size_list<float32>[{D}], but the column is missing")
            t = batch.schema.field(self.dense_column).type
            if not pa.types.is_fixed_size_list(t) or t.list_size != D or not pa.types.is_floating(t.value_type):
                return (self.dense_column, 0, f"expected fixed_size_list<float32>[{D}], got {t}")
            bad = dense_values(batch.column(self.dense_column), D)[1]
            if bad is not None:
                return (self.dense_column, *bad)
        if self.label_column in names:
            bad = label_problem(batch.column(self.label_column))
            if bad is not None:
                return (self.label_column, *bad)
        return None

    # -------------------------------------------------------------------------------------- scoring
    def pooled(self, batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
        """The ONNX model's inputs for ``batch``.

        Returns
        -------
        pooled : float32[B, S*w]
            ``pooled[b, s*w + c] = sum over the keys k of example b in slot s of row(k)[c]``
            (``w`` = ``sparse_width``: ``dim`` for CTR-DNN, ``dim + 1`` for DeepFM with column 0 the
            first-order weight); an empty slot or unknown key adds zeros.
        dense : float32[B, D]
        """
        with self._lock:
            batch, cols, simple = self._slot_columns(batch)
            n = batch.num_rows
            out = np.zeros((n, len(self.slots) * self.width), np.float32)
            if simple and n:
                self._lookup_pool(self._fixed_keys(cols, n), out)
            elif n:
                keys, cells, _ = self.inputs(batch)
                np.add.at(out.reshape(n * len(self.slots), self.width), cells, self.lookup(keys))
            return out, self._dense_of(batch, n)

    def _lookup_pool(self, keys: np.ndarray, out: np.ndarray) -> None:
        """Fused lookup + pooling of one-key-per-cell ``keys : uint64[B*S]`` (example-major) into
        ``out : float32[B, >= S*w]`` (columns ``0 .. S*w - 1``)."""
        if len(self._rows_scratch) < len(keys):
            self._rows_scratch = np.empty(len(keys), np.int64)
        self.last_hits = K.lookup_pool_fixed(keys, len(self.slots), self._slots, self._raw, self._half,
                                             out, self._rows_scratch)

    def predict(self, batch: pa.RecordBatch) -> np.ndarray:
        """Click probabilities of a record batch, ``float32[B]``, in row order.

        Parameters
        ----------
        batch : pyarrow.RecordBatch or Table
            See :meth:`inputs`. Large batches are scored in chunks of ``max_batch`` rows.

        Raises
        ------
        BundleError
            Bad input columns (named), or a null, NaN or infinite dense value (column and row of
            ``batch`` named).
        """
        n = batch.num_rows
        out = np.empty(n, np.float32)
        with self._lock:
            for s in range(0, n, self.max_batch):
                part = batch.slice(s, self.max_batch) if n > self.max_batch else batch
                part, cols, simple = self._slot_columns(part)
                m = part.num_rows
                if m == 0:
                    continue
                dense = self._dense_of(part, m)
                if simple:   # one key per cell: look up and pool straight into the model's input
                    x = self.model.pooled_input(m)
                    self._lookup_pool(self._fixed_keys(cols, m), x)
                    out[s:s + m] = self.model.predict_pooled(x, dense)
                else:
                    keys, cells, dense = self.inputs(part)
                    emb = self.lookup(keys)
                    rows = np.arange(len(keys), dtype=np.int32)
                    out[s:s + m] = self.model.predict(emb, rows, cells, dense)
        return out

    # -------------------------------------------------------------------------------------- patches
    def apply_delta(self, uri: str, storage_options: StorageOptions | None = None) -> None:
        """Apply a delta bundle exported on top of the one currently loaded.

        All of the delta is read and checked before the bundle changes; the new rows, index, dense
        parameters and metadata then replace the old ones at once under the lock :meth:`predict` holds.
        On any error the bundle is left as it was (the same delta can be applied again).

        Raises
        ------
        BundleError
            ``uri`` is not a delta, its parent is not the bundle currently loaded (deltas must be
            applied in order), or it was written with another ``hash_version`` than this engine's.
        hdfs_io.NotPublishedError
            The delta has no ``_SUCCESS`` marker.
        hdfs_io.CheckpointCorruptError
            A file of the delta is missing, truncated or fails its CRC-32 (named).
        """
        with self._patch_lock:      # one patch at a time; predict() keeps scoring while it is built
            info = open_bundle(uri, storage_options)
            _check_hash_version(info)
            if not info.is_delta:
                raise BundleError(f"{info.uri}: a full bundle, not a delta; load it with load_bundle")
            parent = info.meta["parent"]["export_id"]
            if parent != self.export_id:
                raise BundleError(f"{info.uri}: a delta of export {parent}, but the loaded bundle is "
                                  f"{self.export_id} ({self.uri}); apply deltas in order")
            emb = info.meta["embedding"]
            if emb["width"] != self.width or emb["dtype"] != self.dtype:
                raise BundleError(f"{info.uri}: embedding {emb['dtype']}[{emb['width']}] does not match the "
                                  f"loaded {self.dtype}[{self.width}]")
            t0 = time.perf_counter()
            # everything is read, checked and built into locals first: a failure (a damaged file) leaves
            # the bundle as it was, so the same delta can be applied again once repaired
            parts = [info.read_group(g) for g in range(emb["vshard_groups"])]
            up_k = np.concatenate([p[0] for p in parts])
            up_v = np.concatenate([p[1] for p in parts])
            del parts
            drop = np.concatenate([info.read_deleted(), up_k])
            dense = info.read_dense()
            if len(dense) != self.model.dense_size:
                raise BundleError(f"{info.uri}/{info.meta['dense']['file']}: {len(dense)} dense values, the "
                                  f"loaded model has {self.model.dense_size}")
            rows = np.empty(len(drop), np.int64)
            K.find_rows(drop, self._slots, rows)
            keep = np.ones(len(self.keys), bool)
            keep[rows[rows >= 0]] = False
            keys = np.concatenate([self.keys[keep], up_k])
            values = np.concatenate([self.values[keep], up_v])
            index = _build_index(keys, values, self.dtype, info.uri)
            with self._lock:        # a concurrent predict() scores wholly before or wholly after the swap
                self.keys, self.values = keys, values
                self._slots, self._raw, self._half = index
                self.model.set_dense(dense)
                self._set_meta(info)
            log.info("applied delta %s: %d rows upserted, %d deleted, %d rows now, %.2f s", info.uri,
                     len(up_k), emb["deleted"], len(self.keys), time.perf_counter() - t0)


def _build_index(keys: np.ndarray, values: np.ndarray, dtype: str, uri: str):
    """``(hash index slots, raw rows, half table)`` of ``keys``/``values`` (see :meth:`Bundle.lookup`).

    Raises
    ------
    BundleError
        A key is stored twice (named, with ``uri``).
    """
    slots = K.new_index(len(keys))
    dup = K.build_index(keys, slots)
    if dup >= 0:
        raise BundleError(f"{uri}: key {int(keys[dup])} is stored twice (corrupt bundle)")
    raw = values.view(np.uint16) if dtype == "float16" else values
    half = K.half_table() if dtype == "float16" else np.empty(0, np.float32)
    return slots, raw, half


def _check_hash_version(info: BundleInfo) -> int:
    """The bundle's ``hash_version``; BundleError unless it is this engine's."""
    from streaming.keys import HASH_VERSION
    hv = int(info.meta["hashing"]["hash_version"])
    if hv != HASH_VERSION:
        raise BundleError(f"{info.uri}: the bundle was written with hash_version {hv} and this engine hashes "
                          f"with version {HASH_VERSION}: its keys cannot match this engine's inputs; score it "
                          f"with an engine of hash_version {hv}")
    return hv


def load_bundle(uri: str, storage_options: StorageOptions | None = None, *, max_batch: int = 8192) -> Bundle:
    """Load a bundle for scoring; a delta URI loads its whole chain (base first).

    Parameters
    ----------
    uri : str
        Bundle directory on any :mod:`hdfs_io` backend.
    max_batch : int
        Rows per forward pass (bounds scratch memory).

    Returns
    -------
    Bundle

    Raises
    ------
    hdfs_io.NotPublishedError
        No ``_SUCCESS``: the message names the marker's path.
    hdfs_io.CheckpointCorruptError
        A file is missing, truncated or fails its checksum (named).
    BundleError
        ``model.json`` malformed or of another format, or the bundle's ``hash_version`` is not this
        engine's (``streaming.keys.HASH_VERSION``).
    """
    return Bundle(resolve_chain(uri, storage_options), max_batch=max_batch)
