"""An :class:`~engine.export.base.ExportSource` backed by an ``engine.checkpoint`` checkpoint.

The checkpoint's chain (its base, then each delta in order: ``engine.checkpoint.chain_of``) is replayed
with the checkpoint reader (``engine.checkpoint.load_server_parts``) into in-process
``SparseTable`` shards, as one server owning every vshard would load it; the rows are then read back
with ``SparseTable.rows()``. The dense parameters are the dense blocks of the last checkpoint of the
chain (every checkpoint holds them in full). The model description comes from the engine config
snapshot in the manifest (``config.model``: kind, slots, dim, dense_dim, hidden, seed, table names);
for Word2Vec also the vocabulary fingerprint its ``sources.train.vocab`` records.

``CHECKPOINT_URI`` is a checkpoint directory (``{root}/{job}/YYYYMMDD/HHMM-base|delta[.N]``) or a job
root (``{root}/{job}``: its newest complete checkpoint).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from hdfs_io import StorageOptions

from .errors import ExportError
from .base import TableSource, check_description

__all__ = ["CheckpointSource", "description_from_config", "is_checkpoint_uri"]

log = logging.getLogger(__name__)


def description_from_config(config: Mapping[str, Any], *, hash_version: int, num_vshards: int,
                            checkpoint: Mapping[str, Any] | None = None,
                            sources: Mapping[str, Any] | None = None) -> dict:
    """Model description from an engine config snapshot (``EngineConfig.to_dict()``).

    ``sources`` is the manifest's ``sources`` (Word2Vec: ``train.vocab`` becomes the description's
    ``vocab_fingerprint``).

    Raises
    ------
    ExportError
        ``config.model`` missing or not a CTR model (the key path is named).
    """
    from streaming.criteo import SLOT_IDS
    model = (config or {}).get("model")
    if not isinstance(model, Mapping) or "kind" not in model:
        raise ExportError("checkpoint manifest: config.model: missing; the checkpoint does not say which "
                          "model it holds")
    kind = model["kind"]
    if kind == "ctr_online":            # the online job trains its model.network
        kind = model.get("network", "ctr_dnn")
    if kind == "word2vec":
        return _word2vec_description(model, hash_version=hash_version, num_vshards=num_vshards,
                                     checkpoint=checkpoint, sources=sources)
    if kind not in ("ctr_dnn", "deepfm"):
        raise ExportError(f"checkpoint manifest: config.model.kind: expected ctr_dnn, deepfm, ctr_online or "
                          f"word2vec, got {kind!r}")
    slots = list(model.get("slots") or [])
    desc = {"model": {"kind": kind, "num_slots": len(slots), "dim": int(model.get("dim", 10)),
                      "dense_dim": int(model.get("dense_dim", 13)),
                      "hidden": list(model.get("hidden", [400, 400, 400])), "seed": int(model.get("seed", 0)),
                      "dtype": "float32"},
            "slots": slots, "slot_ids": {s: SLOT_IDS.get(s) for s in slots},
            "dense_column": "dense", "label_column": "label", "hash_version": int(hash_version),
            "num_vshards": int(num_vshards), "checkpoint": dict(checkpoint) if checkpoint else None,
            "tables": {"sparse": model.get("sparse_table", "embedding"),
                       "dense": model.get("dense_table", "dense")}}
    return check_description(desc, "checkpoint manifest: config")


def _word2vec_description(model: Mapping[str, Any], *, hash_version: int, num_vshards: int,
                          checkpoint: Mapping[str, Any] | None, sources: Mapping[str, Any] | None) -> dict:
    """Word2Vec (``engine.programs.word2vec``): the input-vector table is the one exported; ``vocab`` is
    the ``vocab.arrow`` of the converted corpus the run trained on (``model.arrow_dir``), which maps a
    key's word id (``streaming.keys.key_ids``) to its word; ``vocab_fingerprint`` is what the checkpoint
    recorded of it (``sources.train.vocab``: ``vocab_bytes``, ``vocab_crc32``, ... of
    ``streaming.text.conversion_fingerprint``; None for a checkpoint written before they were recorded),
    which ``engine.export.w2v`` checks the file against; no dense table."""
    train = (sources or {}).get("train") if isinstance(sources, Mapping) else None
    recorded = train.get("vocab") if isinstance(train, Mapping) else None
    arrow = model.get("arrow_dir")
    if not isinstance(arrow, str) or not arrow:
        raise ExportError("checkpoint manifest: config.model.arrow_dir: missing; cannot map word ids to words")
    desc = {"model": {"kind": "word2vec", "num_slots": 1, "dim": int(model.get("dim", 100)), "dense_dim": 0,
                      "hidden": [], "seed": int(model.get("seed", 1)), "dtype": "float32"},
            "slots": [], "slot_ids": {"input": int(model.get("input_slot", 1))},
            "hash_version": int(hash_version), "num_vshards": int(num_vshards),
            "checkpoint": dict(checkpoint) if checkpoint else None,
            "tables": {"sparse": model.get("input_table", "syn0"), "dense": None},
            "vocab": f"{arrow.rstrip('/')}/vocab.arrow",
            "vocab_fingerprint": dict(recorded) if isinstance(recorded, Mapping) else None}
    return check_description(desc, "checkpoint manifest: config")


def is_checkpoint_uri(uri: str, storage_options: StorageOptions | None = None) -> bool:
    """True when ``uri`` is a published checkpoint directory or a job root holding one.

    Raises
    ------
    hdfs_io.StorageUnavailableError
        The storage did not answer through its retries (or its client is missing): no verdict on ``uri``.
    OSError
        The storage refused the credentials or the request (``hdfs_io.permanent_failure``: ``EACCES`` or
        ``EPERM``; S3's AccessDenied, an unknown key, a bad signature): no verdict either. Before, that was
        "not an exportable checkpoint", sending the operator to look for a checkpoint that is there.
    """
    from hdfs_io import StorageUnavailableError, permanent_failure
    try:
        _resolve(uri, storage_options)
        return True
    except StorageUnavailableError:
        raise
    except OSError as exc:
        if permanent_failure(exc) in ("EACCES", "EPERM"):
            raise
        return False
    except Exception:  # noqa: BLE001 - any other failure means "not a checkpoint"
        return False


def _resolve(uri: str, storage_options):
    from engine.checkpoint import CheckpointManager
    from engine.checkpoint.manifest import parse_name
    u = uri.rstrip("/")
    parts = u.rsplit("/", 3)
    if len(parts) == 4 and parse_name(f"{parts[2]}/{parts[3]}") is not None:
        root, job, name = parts[0], parts[1], f"{parts[2]}/{parts[3]}"
    else:
        root, _, job = u.rpartition("/")
        name = None
    mgr = CheckpointManager(root, job, storage_options=storage_options)
    return mgr, mgr.resolve(name)


class CheckpointSource(TableSource):
    """The state of a checkpoint (its chain replayed), as an export source.

    Parameters
    ----------
    uri : str
        Checkpoint directory or job root (module docstring).
    storage_options : hdfs_io.StorageOptions, optional
    description : dict, optional
        Model description; default: derived from the manifest's config snapshot.

    Raises
    ------
    engine.checkpoint.CheckpointNotFoundError
        No complete checkpoint at ``uri``.
    hdfs_io.CheckpointCorruptError
        A file of the chain is missing or damaged (named).
    ExportError
        The manifest does not describe an exportable model.
    """

    def __init__(self, uri: str, *, storage_options: StorageOptions | None = None,
                 description: Mapping | None = None):
        from engine.checkpoint import chain_of, load_server_parts
        from sparse_tables import SparseTable, TableConfig
        mgr, name = _resolve(uri, storage_options)
        chain = chain_of(mgr.storage, name)
        last = chain[-1]
        ident = {"uri": mgr.uri_of(name), "name": name, "kind": last["kind"], "base": chain[0]["name"],
                 "step": last.get("step"), "hash_version": last.get("hash_version")}
        if description is None:
            description = description_from_config(last.get("config") or {},
                                                  hash_version=int(last.get("hash_version") or 0),
                                                  num_vshards=int(last["num_vshards"]), checkpoint=ident,
                                                  sources=last.get("sources"))
        tables = dict(description.get("tables") or {"sparse": "embedding", "dense": "dense"})
        sparse_name, dense_name = tables.get("sparse", "embedding"), tables.get("dense", "dense")
        nv = int(last["num_vshards"])
        shards = {}
        for tname, meta in last["tables"].get("sparse", {}).items():
            shards[tname] = [SparseTable(TableConfig(dim=int(meta["dim"]), optimizer=meta["optimizer"]))]
        if sparse_name not in shards:
            raise ExportError(f"{mgr.uri_of(name)}: no sparse table {sparse_name!r} (tables: {sorted(shards)})")
        owner = np.zeros(nv, np.int32)
        dense_state = None
        for m in chain:
            ckpt = mgr.storage.sub(m["name"])
            _, _, dense = load_server_parts(ckpt, num_vshards=nv, local_owner=owner, sparse=shards,
                                            dense_owns=lambda t, b: t == dense_name, manifest=m)
            if dense_name in dense:
                dense_state = dense[dense_name]
        for tname in list(shards):
            if tname != sparse_name:
                for s in shards.pop(tname):
                    s.close()
        if dense_state is None and dense_name:
            raise ExportError(f"{mgr.uri_of(name)}: no dense table {dense_name!r} in the checkpoint chain")
        size, blocks = dense_state if dense_state is not None else (0, {})
        vec = np.concatenate([blocks[b].params for b in sorted(blocks)]) if blocks else np.empty(0, np.float32)
        if len(vec) != size:
            raise ExportError(f"{mgr.uri_of(name)}: dense table {dense_name!r}: blocks hold {len(vec)} values, "
                              f"the table has {size}")
        self.manifest = last
        self.tables_loaded = shards[sparse_name]
        log.info("checkpoint %s replayed for export (base %s + %d delta(s))", mgr.uri_of(name),
                 chain[0]["name"], len(chain) - 1)
        super().__init__(description, vec.astype(np.float32, copy=False), shards[sparse_name],
                         source_uri=mgr.uri_of(name))

    def close(self) -> None:
        """Release the replayed tables."""
        for s in self.tables_loaded:
            s.close()
