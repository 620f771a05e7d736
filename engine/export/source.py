"""Where an export's parameters come from: open a source for a URI, or snapshot a live cluster into one.

The source interface (:class:`ExportSource`), the model description and the in-memory sources
(:class:`RowBatchSource`, :class:`TableSource`) are defined in :mod:`engine.export.base` and re-exported
here; :class:`~engine.export.checkpoint_source.CheckpointSource` replays a checkpoint. This module sits
above both: it imports them, neither imports it.
"""
from __future__ import annotations

from typing import Mapping

from .base import ExportSource, RowBatchSource, TableSource, check_description, describe_model
from .checkpoint_source import CheckpointSource, is_checkpoint_uri
from .errors import ExportError

__all__ = ["ExportSource", "RowBatchSource", "TableSource", "describe_model", "check_description",
           "snapshot_cluster", "open_source"]


def snapshot_cluster(client, root: str, job: str, config: Mapping, *, storage_options=None):
    """Export source from a live cluster: the servers write a base checkpoint of their tables
    (``engine.checkpoint.CheckpointManager.save``) under ``{root}/{job}``, which is then read back.

    Parameters
    ----------
    client : engine.ps.PSClient
        Any object with the checkpoint ``Cluster`` shape (``num_servers``, ``save(uri)``).
    root, job : str
        Checkpoint root URI (any :mod:`hdfs_io` backend the servers can write) and job name.
    config : mapping
        The engine config as a dict (``EngineConfig.to_dict()``): its ``model`` section describes the
        model (see :func:`~engine.export.checkpoint_source.description_from_config`).

    Returns
    -------
    engine.export.checkpoint_source.CheckpointSource
    """
    from engine.checkpoint import CheckpointManager
    mgr = CheckpointManager(root, job, storage_options=storage_options)
    manifest = mgr.save(client, "base", config=dict(config))
    return CheckpointSource(mgr.uri_of(manifest["name"]), storage_options=storage_options)


def open_source(uri: str, *, storage_options=None) -> ExportSource:
    """The source behind ``engine export CHECKPOINT_URI``.

    ``uri`` is an ``engine.checkpoint`` checkpoint directory or job root (its newest complete
    checkpoint; :class:`~engine.export.checkpoint_source.CheckpointSource`).

    Raises
    ------
    ExportError
        Nothing exportable at ``uri`` (the message says what was expected).
    """
    if is_checkpoint_uri(uri, storage_options):
        return CheckpointSource(uri, storage_options=storage_options)
    raise ExportError(
        f"{uri}: not an exportable checkpoint: expected a checkpoint directory "
        f"(.../JOB/YYYYMMDD/HHMM-base|delta) or a job root holding a complete checkpoint")
