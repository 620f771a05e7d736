"""``engine export`` and ``engine predict``.

``engine export CHECKPOINT_URI OUT_URI [--format bundle|onnx|word2vec] [--min-show N]
[--dtype float16] [--delta SINCE] [--config CONFIG.yaml [--set KEY=VALUE ...]]``: CHECKPOINT_URI is a
checkpoint directory, a job root (its newest complete checkpoint). The last stdout line is
one JSON object ``{"event": "export", "format", "out", "bundle", "rows", "deleted", "export_id"}``.

``engine predict BUNDLE DATA [--out preds.arrow] [--max-bad-rows N] [--config CONFIG.yaml [--set KEY=VALUE
...]]``: DATA is Arrow (IPC files, a directory of them, Parquet, ``-`` for an IPC stream on stdin) or raw
Criteo text (``.txt``, ``.tsv``, ``.gz``; one on a store is copied to a temporary directory first,
``streaming.inputs.fetch``; converted with ``streaming.criteo``: the first malformed line fails the run
naming the file, line and field, unless ``--max-bad-rows N`` lets N of them be skipped, after which
predictions no longer line up with the input's lines). Predictions keep the input's row order (``--out``:
Arrow IPC file, column ``prob : float32``, written under a temporary name beside it and moved over it only
when every row was scored: a failed run leaves an earlier file there untouched). The last stdout line is one
JSON object with ``rows``, ``rows_per_s`` (scoring only, reading included, bundle loading excluded),
``skipped_lines`` for text input and, when the input has labels, ``auc`` and ``logloss``. DATA on a store is
listed once and read as listed (``streaming.inputs``): a file written again after its schema was checked, or
while it is read, is refused naming its URI and row (``InputChangedError``), never scored as another version
or a mix of two.

Storage (``engine export``, ``engine predict``): every ``s3://`` or ``hdfs://`` URI (checkpoint, bundle,
``--delta``, ``--vocab``, DATA, ``--out``) is reached with ``--config``'s ``storage:`` section (endpoint, region,
credentials or the names of the variables holding them, timeouts), as ``engine train`` and ``engine eval``
reach theirs; without ``--config``, with the standard AWS environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...). A store refusing the credentials is one line naming the URI, exit 2; one that
does not answer through ``hdfs_io``'s retries, one line naming the side, exit 1.

Exit codes: 0 success, 2 bad input (missing or unpublished bundle, bad columns, a null, NaN or infinite
dense value, a null label or one outside [0, 1], an empty, truncated or non-Arrow file, a malformed
text line, bad options, a config that does not load, a store refusing the credentials; named with the
file and row where known), 1 other failures (a store that does not answer).
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import re
import sys
import tempfile
import time

log = logging.getLogger("engine.export")

_TEXT_SUFFIXES = (".txt", ".tsv", ".gz", ".csv")


def _help(command: str) -> str:
    """The module docstring's paragraphs about ``command`` (``export`` or ``predict``), storage and the exit
    codes: each command's ``--help`` describes that command only."""
    paras = __doc__.strip().split("\n\n")
    return "\n\n".join(q for q in paras[1:] if q.startswith(f"``engine {command} ")
                       or q.startswith(("Storage", "Exit codes")))


def add_subparsers(sub) -> None:
    """Register ``export`` and ``predict`` on the ``engine`` command's subparsers."""
    p = sub.add_parser("export", help="export a checkpoint for serving (bundle, ONNX, word2vec)",
                       description=_help("export"), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint directory, or a job root (its newest complete checkpoint)")
    p.add_argument("out", help="output bundle directory (or word2vec file) on any storage URI")
    p.add_argument("--format", choices=("bundle", "onnx", "word2vec"), default="bundle")
    p.add_argument("--min-show", type=float, default=None, metavar="N", help="drop rows seen fewer than N times")
    p.add_argument("--dtype", choices=("float32", "float16"), default=None, help="stored embedding dtype")
    p.add_argument("--delta", metavar="SINCE", default=None,
                   help="write a delta against this earlier export (rows changed since + deleted keys)")
    p.add_argument("--groups", type=int, default=None, help="vshard groups = embedding files (default 16)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing export at OUT (only a bundle, or a word2vec file, is ever "
                        "replaced; a directory holding anything else never is)")
    p.add_argument("--vocab", default=None,
                   help="word2vec: vocab.arrow (or its directory), local or a URI reached as the others are "
                        "(--config); default: the one a word2vec checkpoint records")
    p.add_argument("--binary", action="store_true", help="word2vec: binary format")
    _add_config_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(run=run_export)

    q = sub.add_parser("predict", help="score Arrow or Criteo input with a serving bundle",
                       description=_help("predict"), formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("bundle", help="bundle URI (a delta loads its whole chain)")
    q.add_argument("data", help="Arrow IPC/Parquet file or directory, '-' for stdin, or Criteo text")
    q.add_argument("--out", default=None, help="write predictions here (Arrow IPC file, column prob)")
    q.add_argument("--delta", action="append", default=[], metavar="URI",
                   help="apply these delta bundles, in order, after loading")
    q.add_argument("--batch-size", type=int, default=8192, help="rows per forward pass")
    q.add_argument("--max-bad-rows", type=int, default=0, metavar="N",
                   help="Criteo text input: malformed lines to skip (each logged) before failing (default 0: "
                        "fail on the first); skipped lines have no prediction, so rows no longer line up")
    _add_config_arguments(q)
    q.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    q.set_defaults(run=run_predict)


def _add_config_arguments(p) -> None:
    p.add_argument("--config", metavar="CONFIG.yaml", default=None,
                   help="reach s3:// and hdfs:// URIs with this config's storage: section (endpoint, region, "
                        "credentials, timeouts), as engine train and engine eval do; default: the AWS_* "
                        "environment variables")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value of --config, e.g. --set storage.endpoint=http://10.0.0.9:9000")


def storage_options_of(args):
    """The ``hdfs_io.StorageOptions`` of ``--config``'s ``storage`` section (``--set`` applied), as ``engine
    train`` and ``engine eval`` take theirs; None without ``--config`` (the AWS environment variables).

    Raises
    ------
    engine.errors.ConfigError
        The config is missing, not YAML or has a bad value (the key named, as ``load_config`` names it);
        its ``storage`` section names an unset variable; or ``--set`` is given without ``--config``.
    """
    from ..errors import ConfigError
    if args.config is None:
        if args.overrides:
            raise ConfigError(f"--set {args.overrides[0]}: --set overrides a value of --config, and no --config "
                              f"was given")
        return None
    from ..config import load_config
    return load_config(args.config, args.overrides).storage.options()


#: a storage URI in an error's message or notes (``hdfs_io``'s retries note the call: ``stat s3://b/k``)
_URI = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s()'\";,]+")


def _error_chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (``__cause__`` / ``__context__``, at most 8)."""
    out: list[BaseException] = []
    while e is not None and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def error_uri(e: BaseException) -> str | None:
    """The URI a storage error ``e`` is about: the ``uri`` of ``hdfs_io``'s errors, else the first URI its
    message or notes name (pyarrow's own messages name only a bucket and a key; ``hdfs_io`` notes the call
    and the URI), looked for along the exceptions it was raised from; None when none names one."""
    from hdfs_io import described
    for x in _error_chain(e):
        uri = getattr(x, "uri", None)
        if isinstance(uri, str) and uri:
            return uri
        m = _URI.search(described(x))
        if m:
            return m.group(0)
    return None


#: what to do about a store that refuses the credentials (the end of ``refused_line``)
REFUSED_HINT = ("no retry mends that: once the credentials of the storage section (--config; without it the AWS_* "
                "environment variables) and the store's policy let this command reach it, run it again")


def refused_line(e: BaseException, sides: dict[str, str], hint: str = REFUSED_HINT) -> str | None:
    """One line for a store refusing the credentials or the request (``streaming.inputs.refused``: S3's
    AccessDenied, an unknown key, a bad signature, an expired token; ``PermissionError`` on a file system),
    naming the side of ``sides`` (name -> URI, as ``failed_side``) and its URI, else the URI the error
    names; the store's own words (the deepest error, with ``hdfs_io``'s note of the call) in parentheses,
    then ``hint``. None when ``e`` is not such a refusal."""
    from hdfs_io import described
    from streaming.inputs import refused
    if not refused(e):
        return None
    side = failed_side(e, sides)
    what = f"{side} {sides[side]}" if side else (error_uri(e) or "storage")
    return f"{what}: access refused ({described(_error_chain(e)[-1])}); {hint}"


def input_unavailable(command: str, what: str, e, hint: str = REFUSED_HINT) -> int:
    """Print the one line for ``e`` (a ``streaming.inputs.InputUnavailableError``: an input's store refusing
    the credentials, or not answering through its retries) of ``engine COMMAND``'s input ``what`` ("data",
    "--vocab", "vocabulary") and return the exit code: 2 for a refusal (``e.refused``: no retry mends it;
    ``hint`` says what does), 1 for a store that did not answer (the same command runs once it does). The
    error's own ``str()`` is a training job's wording, so the line is built from ``e.uri`` and ``e.reason``."""
    if e.refused:
        print(f"engine {command}: {what} {e.uri}: {e.reason}; {hint}", file=sys.stderr)
        return 2
    print(f"engine {command}: {what} storage unavailable: {e.uri}: {e.reason}", file=sys.stderr)
    return 1


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _bad_input_errors():
    import hdfs_io
    from streaming.errors import ConvertError, DataFormatError, SchemaError
    from ..errors import ConfigError
    from .errors import BundleError, ExportError
    # ConvertError: predict's Criteo text input that cannot be read (a binary line, truncated gzip)
    return (BundleError, ExportError, hdfs_io.NotPublishedError, hdfs_io.CheckpointCorruptError,
            FileNotFoundError, FileExistsError, DataFormatError, SchemaError, ConvertError, ConfigError)


def failed_side(e: OSError, sides: dict[str, str]) -> str | None:
    """The one name in ``sides`` (name -> URI) whose store the storage error ``e`` is about: its URI
    (``error_uri``: ``hdfs_io``'s errors carry it, a raw store error's note names it) is that URI, lies
    under it, or is the file system holding it (an HDFS namenode, an S3 bucket) (``target.same_place`` /
    ``target.inside``); None when no side or more than one matches, or ``e`` names no URI. So a CLI names
    the store that failed: before, ``engine export`` said "checkpoint storage unavailable" when its output
    store did not answer."""
    from .target import inside, same_place
    uri = error_uri(e)
    if not uri:
        return None
    u = uri.removeprefix("file://")
    found = []
    for name, side in sides.items():
        p = (side or "").removeprefix("file://")
        if p and (same_place(u, p) or inside(u, p) or inside(p, u)):
            found.append(name)
    return found[0] if len(found) == 1 else None


def run_export(args) -> int:
    _logging(args.verbose)
    from hdfs_io import StorageUnavailableError
    from models.errors import ModelInputError       # e.g. a word the word2vec format cannot hold
    from streaming.inputs import InputUnavailableError
    bad = _bad_input_errors() + (ModelInputError,)
    try:
        from .source import open_source
        storage = storage_options_of(args)
        source = open_source(args.checkpoint, storage_options=storage)
        opts = dict(min_show=args.min_show, dtype=args.dtype, since=args.delta, groups=args.groups,
                    overwrite=args.overwrite, storage_options=storage)
        if args.format == "word2vec":
            desc = source.model_description()
            kind = (desc.get("model") or {}).get("kind")
            if kind is not None and kind != "word2vec":
                print(f"engine export: --format word2vec: {args.checkpoint} is a {kind} checkpoint, not a "
                      f"word2vec one; export it with --format bundle or onnx", file=sys.stderr)
                return 2
            vocab = args.vocab or desc.get("vocab")
            if not vocab:
                print("engine export: --format word2vec needs --vocab (vocab.arrow of the corpus): the "
                      "checkpoint does not record one", file=sys.stderr)
                return 2
            from .w2v import export_word2vec
            res = export_word2vec(source, args.out, vocab=vocab, binary=args.binary, overwrite=args.overwrite,
                                  storage_options=storage)
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
    except InputUnavailableError as e:  # the vocabulary's store (read as an input: streaming.inputs.fetch)
        # --vocab's, else the one the checkpoint records
        return input_unavailable("export", "--vocab" if args.vocab else "vocabulary", e)
    except StorageUnavailableError as e:   # not bad input: the storage did not answer through its retries
        from .target import job_root_of
        side = failed_side(e, {"output": args.out, "checkpoint": job_root_of(args.checkpoint),
                               "--delta": args.delta})
        what = {"output": f"output storage unavailable (writing {args.out})",
                "checkpoint": "checkpoint storage unavailable", "--delta": f"--delta {args.delta}: storage unavailable"}
        print(f"engine export: {what.get(side, 'storage unavailable')}: {e}", file=sys.stderr)
        return 1
    except FileExistsError as e:       # hdfs_io's message speaks of the library's overwrite=True
        what = "exists" if args.format == "word2vec" else "published"
        print(f"engine export: {e.filename or args.out}: already {what}; pass --overwrite to replace it",
              file=sys.stderr)
        return 2
    except bad as e:
        print(f"engine export: {e}", file=sys.stderr)
        return 2
    except OSError as e:               # a store refusing the credentials: named, not a traceback
        from .target import job_root_of
        line = refused_line(e, {"checkpoint": job_root_of(args.checkpoint), "output": args.out,
                                "--delta": args.delta})
        if line is None:
            raise
        print(f"engine export: {line}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


def _criteo_to_arrow(path: str, tmp: str, max_bad_rows: int) -> tuple[str, int]:
    """Convert Criteo text to Arrow in ``tmp``; returns ``(tmp, malformed lines skipped)``.

    Raises
    ------
    streaming.errors.DataFormatError
        The ``max_bad_rows + 1``-th malformed line (file, line and field named).
    """
    from streaming.criteo import convert_criteo
    rep = convert_criteo(path, tmp, split=None, batch_size=8192, max_bad_rows=max_bad_rows, progress=False)
    if rep.bad_rows:
        log.warning("%s: %d malformed line(s) skipped (--max-bad-rows %d): they have no prediction, so "
                    "predictions no longer line up with the input's lines", path, rep.bad_rows, max_bad_rows)
    return tmp, rep.bad_rows


class _PredictionsFile:
    """``--out``: an Arrow IPC file with column ``prob : float32``, written under a temporary name beside
    ``out_uri`` (any ``hdfs_io`` URI, reached with ``storage_options``: None, the environment's) and moved
    over it by :meth:`commit`; :meth:`abort` (a no-op after a commit) removes the temporary, so a failed
    run leaves an earlier file at ``out_uri`` untouched and no partial file.

    Raises
    ------
    IsADirectoryError
        ``out_uri`` is a directory.
    BundleError
        ``out_uri`` has no parent directory.
    """

    def __init__(self, out_uri: str, storage_options=None):
        import pyarrow as pa
        from hdfs_io import temp_names
        import pyarrow.ipc as ipc
        from .bundle import split_uri
        from .errors import BundleError
        try:
            self.storage, self.name = split_uri(out_uri, storage_options)
        except BundleError:
            raise BundleError(f"--out {out_uri}: expected a file path below a directory") from None
        if self.storage.is_dir(self.name):
            raise IsADirectoryError(errno.EISDIR, "--out names a directory; expected a file path",
                                    self.storage.uri_of(self.name))
        try:        # partial predictions of runs for this --out killed on this host
            for left in temp_names.stale(self.storage.listdir(""), self.name, "tmp"):
                log.warning("removing %s: partial predictions of a run that was killed", self.storage.uri_of(left))
                self.storage.delete(left, missing_ok=True)
        except FileNotFoundError:
            pass
        except OSError as exc:      # another user's leftover in a shared directory: not ours to remove
            log.warning("could not remove partial predictions of a killed run beside %s: %s",
                        self.storage.uri_of(self.name), exc)
        self.tmp = temp_names.temp_name(self.name, "tmp")
        self.schema = pa.schema([pa.field("prob", pa.float32(), nullable=False)])
        self.committed = False
        self._sink = self.storage.open_output_stream(self.tmp)
        try:
            self._writer = ipc.new_file(self._sink, self.schema)
        except BaseException:
            self.abort()
            raise

    def write(self, probs) -> None:
        """Append ``probs : float32[B]``."""
        import pyarrow as pa
        self._writer.write_batch(pa.RecordBatch.from_arrays([pa.array(probs)], schema=self.schema))

    def commit(self) -> None:
        """Finish the file and move it over ``out_uri``."""
        self._writer.close()
        self._sink.close()
        self.storage.move(self.tmp, self.name)
        self.committed = True

    def abort(self) -> None:
        """Remove the temporary (best effort: a failure is logged, never raised)."""
        if self.committed:
            return
        try:
            self._sink.close()
        except Exception:  # noqa: BLE001 - the error that brought us here matters, not this one
            pass
        try:
            self.storage.delete(self.tmp, missing_ok=True)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not remove the partial predictions file %s: %s", self.storage.uri_of(self.tmp), exc)


#: what an input written again means for ``engine predict`` (``InputChangedError.advised``: in place of
#: ``streaming.inputs.CHANGED``, which speaks of a training job's row split and checkpoints)
PREDICT_CHANGED = ("it was written again after engine predict listed it, or while it was read; no rows of another "
                   "version were scored, and no predictions written (an earlier --out file is as it was): run it "
                   "again to score the version there now")


class MixedLabelsError(ValueError):
    """``engine predict`` input files of which some have the bundle's label column and some do not."""


def _input_schema(bundle, data, storage_options=None):
    """``(schema, files)``: the listing of ``data`` (a file or a directory, local or a URI reached with
    ``storage_options``: ``streaming.source.list_files``) that ``engine predict`` then reads, and the
    columns it reads from every file, typed as in the first file: the bundle's slot columns, its dense
    column (a model with dense features) and its label column when the inputs have one; other columns are
    never read, so a later file may lack them. A column the first file lacks is left to
    ``bundle.check_values`` (it names the file, row and column). ``(None, "-")`` for stdin (one stream:
    its first schema is the only one).

    Every file's schema is read first (and a stream's end-of-stream marker tested), so a directory whose
    later file cannot be scored is refused before any row is. A file on a store is read later as this
    listing and these reads saw it (``streaming.inputs.RemoteInput``: its ETag pinned at the first open),
    so one written again after its check is refused, not scored unchecked.

    Raises
    ------
    MixedLabelsError
        Some files have the label column and some do not: metrics over the labelled files alone would
        pass for metrics over every row, so the directory is refused (names one file of each kind).
    BundleError
        A file's keys were hashed with another ``hash_version`` than the bundle's (names the file).
    streaming.errors.DataFormatError
        An empty, truncated or non-Arrow file (names it).
    """
    import pyarrow as pa

    from streaming.source import list_files, read_schema
    from .errors import BundleError
    if data == "-":
        return None, data
    files = list_files(data, storage_options=storage_options)
    schemas = [(f, read_schema(f, check_end=True)) for f in files]
    label = bundle.label_column
    for f, sch in schemas:
        hv = (sch.metadata or {}).get(b"hash_version")
        if hv is not None and int(hv) != bundle.hash_version:
            raise BundleError(f"{f}: input keys use hash_version {int(hv)}, bundle {bundle.uri} was trained on "
                              f"hash_version {bundle.hash_version}; re-convert the input")
    with_label = [f for f, sch in schemas if label in sch.names]
    if with_label and len(with_label) < len(files):
        without = next(f for f, sch in schemas if label not in sch.names)
        has = "has" if len(with_label) == 1 else "have"
        raise MixedLabelsError(
            f"{data}: {len(with_label)} of its {len(files)} files {has} a {label!r} column (e.g. {with_label[0]}) "
            f"and the others do not (e.g. {without}): the metrics would cover only part of the rows; score "
            f"the labelled and the unlabelled files separately, or give every file its {label!r} column")
    first = schemas[0][1]
    wanted = list(bundle.slots) + ([bundle.dense_column] if bundle.model.dense_dim else []) + \
        ([label] if with_label else [])
    return (pa.schema([first.field(c) for c in dict.fromkeys(wanted) if c in first.names], metadata=first.metadata),
            files)


def run_predict(args) -> int:
    _logging(args.verbose)
    from engine.metrics import BinaryMetrics, LabelError
    from hdfs_io import StorageUnavailableError
    bad = _bad_input_errors() + (IsADirectoryError, MixedLabelsError)
    if args.max_bad_rows < 0:
        print(f"engine predict: --max-bad-rows must be >= 0, got {args.max_bad_rows}", file=sys.stderr)
        return 2
    if args.batch_size < 1:             # it reached ArrowSource's ValueError: a traceback, exit 1
        print(f"engine predict: --batch-size must be >= 1, got {args.batch_size}", file=sys.stderr)
        return 2
    from streaming.inputs import InputChangedError, InputUnavailableError, fetch, is_uri
    from streaming.source import ArrowSource
    from .predictor import load_bundle
    tmp = preds = None
    skipped = None
    rows = 0
    sides = {"bundle": args.bundle, "data": args.data, "output": args.out,
             **{f"--delta {d}": d for d in args.delta}}
    try:
        storage = storage_options_of(args)
        t0 = time.perf_counter()
        bundle = load_bundle(args.bundle, storage, max_batch=args.batch_size)
        for d in args.delta:
            bundle.apply_delta(d, storage)
        load_s = time.perf_counter() - t0
        data = args.data
        if data != "-" and data.endswith(_TEXT_SUFFIXES) and (is_uri(data) or os.path.isfile(data)):
            tmp = tempfile.TemporaryDirectory(prefix="engine-predict-")
            if is_uri(data):        # a copy first (the converter reads local files), named by the URI
                data = fetch(data, os.path.join(tmp.name, "text"), storage)
            data, skipped = _criteo_to_arrow(data, os.path.join(tmp.name, "arrow"), args.max_bad_rows)
        elif args.max_bad_rows:
            log.warning("--max-bad-rows applies to Criteo text input only; ignored for %s", data)
        # only the columns the bundle reads (every file's schema checked first), from the files as listed
        # and checked there; the check names the file, its row and the column of a value the bundle cannot score
        schema, files = _input_schema(bundle, data, storage)
        src = ArrowSource(files, batch_size=args.batch_size, prefetch=4, schema=schema, check=bundle.check_values,
                          storage_options=storage)
        metrics = None
        if args.out:
            preds = _PredictionsFile(args.out, storage)
        t1 = time.perf_counter()
        for rb in src.batches(0):
            probs = bundle.predict(rb)
            if bundle.label_column in rb.schema.names:
                if metrics is None:
                    metrics = BinaryMetrics()
                metrics.update(probs, rb.column(bundle.label_column).to_numpy(zero_copy_only=False))
            rows += len(probs)
            if preds is not None:
                preds.write(probs)
        secs = time.perf_counter() - t1
        if preds is not None:
            preds.commit()
    except LabelError as e:             # the source's check names the file; this is the backstop
        print(f"engine predict: {args.data}: column {bundle.label_column!r}, row {rows + e.index + 1} of the "
              f"input (counted over its files in order): {e}", file=sys.stderr)
        return 2
    except InputChangedError as e:      # streaming.inputs' advice is a training job's (its row split, --resume)
        print(f"engine predict: {e.advised(PREDICT_CHANGED)}", file=sys.stderr)
        return 2
    except InputUnavailableError as e:  # DATA's store, refused or silent
        return input_unavailable("predict", "data", e)
    except StorageUnavailableError as e:   # not bad input: the storage did not answer through its retries
        side = failed_side(e, sides)
        what = {"output": f"output storage unavailable (writing {args.out})"}.get(side, f"{side} storage unavailable")
        print(f"engine predict: {what if side else 'storage unavailable'}: {e}", file=sys.stderr)
        return 1
    except bad as e:
        print(f"engine predict: {e}", file=sys.stderr)
        return 2
    except OSError as e:                # a store refusing the credentials: named, not a traceback
        line = refused_line(e, sides)
        if line is None:
            raise
        print(f"engine predict: {line}", file=sys.stderr)
        return 2
    finally:
        if preds is not None:
            preds.abort()               # removes the temporary unless committed
        if tmp is not None:
            tmp.cleanup()
    out = {"event": "predict", "bundle": bundle.uri, "rows": rows, "rows_per_s": rows / max(secs, 1e-9),
           "seconds": secs, "load_seconds": load_s, "out": args.out}
    if skipped is not None:
        out["skipped_lines"] = skipped
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
