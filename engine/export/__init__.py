"""Offline export for serving: bundles without optimizer state, a predictor, ONNX, word2vec.

::

    engine export CHECKPOINT OUT [--format bundle|onnx|word2vec] [--min-show N] [--dtype float16]
                                 [--delta SINCE]
    engine predict BUNDLE DATA [--out preds.arrow]

Python API::

    export_bundle(source, out_uri, min_show=, dtype=, since=)  -> model.json dict   (bundle)
    export_onnx(source, out_uri, ...)                           bundle + model.onnx  (onnx_export)
    export_word2vec(source, out_uri, vocab=...)                 word2vec text/binary (w2v)
    load_bundle(uri) -> Bundle; Bundle.predict(record_batch) -> float32[B]; Bundle.apply_delta(uri)
    ExportSource (interface), RowBatchSource, TableSource, CheckpointSource, snapshot_cluster

The bundle layout is documented in :mod:`engine.export.bundle`, the source interface in
:mod:`engine.export.base` (``source`` opens a source for a URI; ``checkpoint_source`` replays a checkpoint).
"""
from .bundle import FORMAT, BundleInfo, export_bundle, open_bundle, resolve_chain
from .errors import BundleError, ExportError
from .predictor import Bundle, load_bundle
from .base import ExportSource, RowBatchSource, TableSource, describe_model
from .checkpoint_source import CheckpointSource
from .source import open_source, snapshot_cluster

__all__ = ["FORMAT", "BundleInfo", "export_bundle", "open_bundle", "resolve_chain", "BundleError",
           "ExportError", "Bundle", "load_bundle", "ExportSource", "CheckpointSource", "RowBatchSource",
           "TableSource", "describe_model", "open_source", "snapshot_cluster"]
