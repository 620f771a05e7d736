"""``engine export`` and ``engine predict``.

``engine export CHECKPOINT_URI OUT_URI [--format bundle|onnx|word2vec] [--min-show N]
[--dtype float16] [--delta SINCE]``: CHECKPOINT_URI is a checkpoint directory, a job root (its newest
complete checkpoint). The last stdout line is
one JSON object ``{"event": "export", "format", "out", "bundle", "rows", "deleted", "export_id"}``.

``engine predict BUNDLE DATA [--out preds.arrow]``: DATA is Arrow (IPC files, a directory of them,
Parquet, ``-`` for an IPC stream on stdin) or raw Criteo text (``.txt``, ``.tsv``, ``.gz``; converted
with ``streaming.criteo`` first). Predictions keep the input's row order (``--out``: Arrow IPC file,
column ``prob : float32``). The last stdout line is one JSON object with ``rows``, ``rows_per_s``
(scoring only, reading included, bundle loading excluded) and, when the input has labels, ``auc`` and
``logloss``.

Exit codes: 0 success, 2 bad input (missing or unpublished bundle, bad columns, bad options), 1 other
failures.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time

log = logging.getLogger("engine.export")

_TEXT_SUFFIXES = (".txt", ".tsv", ".gz", ".csv")


def add_subparsers(sub) -> None:
    """Register ``export`` and ``predict`` on the ``engine`` command's subparsers."""
    p = sub.add_parser("export", help="export a checkpoint for serving (bundle, ONNX, word2vec)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint directory, or a job root (its newest complete checkpoint)")
    p.add_argument("out", help="output bundle directory (or word2vec file) on any storage URI")
    p.add_argument("--format", choices=("bundle", "onnx", "word2vec"), default="bundle")
    p.add_argument("--min-show", type=float, default=None, help="drop rows seen fewer than N times")
    p.add_argument("--dtype", choices=("float32", "float16"), default=None, help="stored embedding dtype")
    p.add_argument("--delta", metavar="SINCE", default=None,
                   help="write a delta against this earlier export (rows changed since + deleted keys)")
    p.add_argument("--groups", type=int, default=None, help="vshard groups = embedding files (default 16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export at OUT")
    p.add_argument("--vocab", default=None,
                   help="word2vec: vocab.arrow (or its directory); default: the one a word2vec checkpoint records")
    p.add_argument("--binary", action="store_true", help="word2vec: binary format")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(run=run_export)

    q = sub.add_parser("predict", help="score Arrow or Criteo input with a serving bundle",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("bundle", help="bundle URI (a delta loads its whole chain)")
    q.add_argument("data", help="Arrow IPC/Parquet file or directory, '-' for stdin, or Criteo text")
    q.add_argument("--out", default=None, help="write predictions here (Arrow IPC file, column prob)")
    q.add_argument("--delta", action="append", default=[], metavar="URI",
                   help="apply these delta bundles, in order, after loading")
    q.add_argument("--batch-size", type=int, default=8192, help="rows per forward pass")
    q.add_argument("-v", "--verbose", action="store_true")
    q.set_defaults(run=run_predict)


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _bad_input_errors():
    import hdfs_io
    from streaming.errors import DataFormatError, SchemaError
    from .errors import BundleError, ExportError
    return (BundleError, ExportError, hdfs_io.NotPublishedError, hdfs_io.CheckpointCorruptError,
            FileNotFoundError, FileExistsError, DataFormatError, SchemaError)


def run_export(args) -> int:
    _logging(args.verbose)
    bad = _bad_input_errors()
    try:
        from .source import open_source
        source = open_source(args.checkpoint)
        opts = dict(min_show=args.min_show, dtype=args.dtype, since=args.delta, groups=args.groups,
                    overwrite=args.overwrite)
        if args.format == "word2vec":
            vocab = args.vocab or source.model_description().get("vocab")
            if not vocab:
                print("engine export: --format word2vec needs --vocab (vocab.arrow of the corpus): the "
                      "checkpoint does not record one", file=sys.stderr)
                return 2
            from .w2v import export_word2vec
            res = export_word2vec(source, args.out, vocab=vocab, binary=args.binary)
            out = {"event": "export", "format": "word2vec", "out": args.out, **res}
        else:
            if args.format == "onnx":
                from .onnx_export import export_onnx
                meta = export_onnx(source, args.out, **opts)
            else:
                from .bundle import export_bundle
                meta = export_bundle(source, args.out, **opts)
            out = {"event": "export", "format": args.format, "out": args.out, "bundle": meta["bundle"],
                   "rows": meta["embedding"]["rows"], "deleted": meta["embedding"]["deleted"],
                   "export_id": meta["export_id"], "seconds": meta["stats"]["seconds"]}
    except bad as e:
        print(f"engine export: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


def _criteo_to_arrow(path: str, tmp: str) -> str:
    from streaming.criteo import convert_criteo
    rep = convert_criteo(path, tmp, split=None, batch_size=8192, max_bad_rows=None, progress=False)
    if rep.bad_rows:
        log.warning("%s: %d malformed lines skipped", path, rep.bad_rows)
    return tmp


def _writer(out_uri: str):
    import pyarrow as pa
    import pyarrow.ipc as ipc
    from .bundle import split_uri
    storage, name = split_uri(out_uri)
    sink = storage.open_output_stream(name)
    schema = pa.schema([pa.field("prob", pa.float32(), nullable=False)])
    return sink, ipc.new_file(sink, schema), schema


def run_predict(args) -> int:
    _logging(args.verbose)
    bad = _bad_input_errors()
    import pyarrow as pa
    from engine.metrics import BinaryMetrics
    from streaming.source import ArrowSource
    from .predictor import load_bundle
    tmp = None
    try:
        t0 = time.perf_counter()
        bundle = load_bundle(args.bundle, max_batch=args.batch_size)
        for d in args.delta:
            bundle.apply_delta(d)
        load_s = time.perf_counter() - t0
        data = args.data
        if data != "-" and os.path.isfile(data) and data.endswith(_TEXT_SUFFIXES):
            tmp = tempfile.TemporaryDirectory(prefix="engine-predict-")
            data = _criteo_to_arrow(data, tmp.name)
        src = ArrowSource(data, batch_size=args.batch_size, prefetch=4)
        metrics = None
        writer = None
        if args.out:
            sink, writer, schema = _writer(args.out)
        rows = 0
        t1 = time.perf_counter()
        for rb in src.batches(0):
            probs = bundle.predict(rb)
            rows += len(probs)
            if bundle.label_column in rb.schema.names:
                if metrics is None:
                    metrics = BinaryMetrics()
                metrics.update(probs, rb.column(bundle.label_column).to_numpy(zero_copy_only=False))
            if writer is not None:
                writer.write_batch(pa.RecordBatch.from_arrays([pa.array(probs)], schema=schema))
        secs = time.perf_counter() - t1
        if writer is not None:
            writer.close()
            sink.close()
    except bad as e:
        print(f"engine predict: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            tmp.cleanup()
    out = {"event": "predict", "bundle": bundle.uri, "rows": rows, "rows_per_s": rows / max(secs, 1e-9),
           "seconds": secs, "load_seconds": load_s, "out": args.out}
    if metrics is not None:
        s = metrics.summary()
        out.update(auc=s["auc"], logloss=s["logloss"], copc=s["copc"])
    out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}
    print(f"engine predict: {rows} rows in {secs:.2f} s ({out['rows_per_s']:,.0f} rows/s), bundle loaded in "
          f"{load_s:.2f} s", file=sys.stderr)
    print(json.dumps(out))
    return 0


def run(args) -> int:
    """Dispatch for ``engine.cli``: ``args.run`` was set by :func:`add_subparsers`."""
    return args.run(args)
