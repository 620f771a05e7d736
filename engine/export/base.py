"""What the exporter reads: the :class:`ExportSource` interface and its implementations.

The exporter never looks inside a checkpoint or a server. It asks a source for three things::

    model_description() -> dict             what model, which input columns, how keys were hashed
    dense()             -> float32[P]       flat dense parameters (layout of models' get_dense())
    embedding_batches() -> Iterator[RecordBatch]   every sparse row once, any order:
                               key    uint64
                               values fixed_size_list<float32>[width]     (width = model.sparse_width)
                               show   float32                             (needed for min_show)
                               ... any other column (state, click, last_seen) is ignored
    source_uri : str                         where the parameters came from (recorded in model.json)

Model description (worked example, CTR-DNN on Criteo)::

    {"model": {"kind": "ctr_dnn", "num_slots": 26, "dim": 10, "dense_dim": 13,
               "hidden": [400, 400, 400], "seed": 0, "dtype": "float32"},   # models' config()
     "slots": ["C1", ..., "C26"],          # input column of each model slot, in model order
     "slot_ids": {"C1": 1, ..., "C26": 26}, # key slot id (high 16 bits) of each column
     "dense_column": "dense",              # fixed_size_list<float32>[dense_dim] input column
     "label_column": "label",
     "hash_version": 1,                    # streaming.keys.HASH_VERSION the keys were made with
     "num_vshards": 1024,                  # the table's vshard count (engine.ps.routing)
     "checkpoint": {...} or null}          # free-form: the checkpoint's id, step, parent

Implementations here: :class:`RowBatchSource` (row batches + dense + description: the tested
reference, and what any other source reduces to) and :class:`TableSource` (in-process
``sparse_tables.SparseTable`` shards). Built on them: :class:`~engine.export.checkpoint_source.CheckpointSource`
(an ``engine.checkpoint`` chain replayed); :mod:`engine.export.source` opens one for a URI
(``open_source``) or makes one from a live cluster (``snapshot_cluster``).

Layering: this module is the bottom of the export package's sources; it imports no other source module,
so ``checkpoint_source`` and ``source`` both build on it without importing each other in a circle.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import pyarrow as pa

from .errors import ExportError

__all__ = ["ExportSource", "RowBatchSource", "TableSource", "describe_model", "check_description"]

_MODEL_KEYS = ("kind", "num_slots", "dim", "dense_dim", "hidden")


@runtime_checkable
class ExportSource(Protocol):
    """The exporter's input (module docstring). ``embedding_batches`` may be called once."""

    source_uri: str

    def model_description(self) -> dict: ...

    def dense(self) -> np.ndarray: ...

    def embedding_batches(self) -> Iterator[pa.RecordBatch]: ...


def describe_model(model, slots: Sequence[str], *, slot_ids: Mapping[str, int] | None = None,
                   hash_version: int | None = None, num_vshards: int = 1024,
                   dense_column: str = "dense", label_column: str = "label",
                   checkpoint: Mapping[str, Any] | None = None) -> dict:
    """The model description of a ``models`` CTR model (module docstring).

    Parameters
    ----------
    model : models.CTRModelBase
    slots : sequence of str
        Input column of each model slot, in model order (``len == model.num_slots``).
    slot_ids : mapping str -> int, optional
        Key slot id of each column; default: Criteo's (``C<j>`` -> ``j``).
    hash_version : int, optional
        Default ``streaming.keys.HASH_VERSION``.

    Raises
    ------
    ExportError
        ``slots`` does not match the model, or a slot id is missing.
    """
    from streaming import keys
    from streaming.criteo import SLOT_IDS
    ids = dict(SLOT_IDS if slot_ids is None else slot_ids)
    desc = {"model": model.config(), "slots": list(slots), "slot_ids": {s: ids.get(s) for s in slots},
            "dense_column": dense_column, "label_column": label_column,
            "hash_version": keys.HASH_VERSION if hash_version is None else int(hash_version),
            "num_vshards": int(num_vshards), "checkpoint": dict(checkpoint) if checkpoint else None}
    return check_description(desc)


def check_description(desc: Any, where: str = "model description") -> dict:
    """Validate a model description; returns a normalized copy.

    Raises
    ------
    ExportError
        A missing or mistyped key; the message names it (``model description: slots: ...``).
    """
    if not isinstance(desc, Mapping):
        raise ExportError(f"{where}: expected a JSON object, got {type(desc).__name__}")
    out = dict(desc)
    model = out.get("model")
    if not isinstance(model, Mapping) or any(k not in model for k in _MODEL_KEYS):
        raise ExportError(f"{where}: model: expected an object with keys {list(_MODEL_KEYS)} "
                          f"(models' config()), got {model!r}")
    out["model"] = dict(model)
    kind = model["kind"]
    slots = out.get("slots")
    if kind in ("ctr_dnn", "deepfm"):
        if not isinstance(slots, list) or not all(isinstance(s, str) for s in slots) \
                or len(slots) != model["num_slots"]:
            raise ExportError(f"{where}: slots: expected a list of {model['num_slots']} column names "
                              f"(model.num_slots), got {slots!r}")
        ids = out.get("slot_ids")
        if not isinstance(ids, Mapping) or any(not isinstance(ids.get(s), int) for s in slots):
            raise ExportError(f"{where}: slot_ids: expected an int slot id for every column of "
                              f"slots, got {ids!r}")
    for key, typ in (("hash_version", int), ("num_vshards", int)):
        if not isinstance(out.get(key), typ) or isinstance(out.get(key), bool) or out[key] < 1:
            raise ExportError(f"{where}: {key}: expected an int >= 1, got {out.get(key)!r}")
    out.setdefault("dense_column", "dense")
    out.setdefault("label_column", "label")
    out.setdefault("checkpoint", None)
    return out


class RowBatchSource:
    """A source from row batches already in hand.

    Parameters
    ----------
    description : dict
        Model description (module docstring).
    dense : float32[P]
    batches : iterable of RecordBatch, or a callable returning one
        Rows in the row schema (``key``, ``values``, optional ``show``; other columns ignored).
    source_uri : str
        Recorded in ``model.json`` as where the parameters came from.

    Examples
    --------
    >>> src = RowBatchSource(describe_model(model, slots), model.get_dense(),   # doctest: +SKIP
    ...                      [table.rows() for table in shards], "memory://trainer")
    """

    def __init__(self, description: Mapping, dense: np.ndarray,
                 batches: Iterable[pa.RecordBatch] | Callable[[], Iterable[pa.RecordBatch]],
                 source_uri: str = "memory://"):
        self._desc = check_description(description)
        self._dense = np.asarray(dense)
        self._batches = batches
        self.source_uri = source_uri

    def model_description(self) -> dict:
        return dict(self._desc)

    def dense(self) -> np.ndarray:
        return self._dense

    def embedding_batches(self) -> Iterator[pa.RecordBatch]:
        src = self._batches() if callable(self._batches) else self._batches
        for b in src:
            if isinstance(b, pa.Table):
                yield from b.to_batches()
            else:
                yield b


class TableSource(RowBatchSource):
    """In-process sparse table shards (``sparse_tables.SparseTable``), e.g. a single-process trainer
    or the tables inside an in-process PS. Rows are read with ``table.rows()`` (a consistent snapshot
    per shard, RAM and spilled rows).

    Parameters
    ----------
    description : dict
    dense : float32[P]
    tables : sequence of SparseTable
    """

    def __init__(self, description: Mapping, dense: np.ndarray, tables: Sequence, source_uri: str = "memory://tables"):
        tables = list(tables)
        super().__init__(description, dense, lambda: (b for t in tables for b in t.rows()), source_uri)
