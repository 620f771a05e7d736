"""``engine eval CONFIG.yaml --checkpoint URI [--vocab URI] [--set key=value ...]``: evaluate a trained checkpoint.

Word2Vec configs (``model.kind: word2vec``): the checkpoint's input vectors (words from ``--vocab``, else
the ``vocab.arrow`` the run recorded, else the config's ``model.arrow_dir``'s: a local file or directory, or
a URI copied with the config's ``storage`` section as ``engine export --vocab`` copies it,
``engine.export.w2v.local_vocab``; refused, exit 2, when it is missing, its store refuses the credentials,
or its size and CRC-32 differ from the fingerprint the checkpoint recorded, i.e. the corpus was
re-converted since: ``engine.export.w2v.check_vocab``) are scored with gensim's
protocols (``models.word2vec_eval``) on the files of ``model.eval_data_dir``: analogy accuracy on
``questions-words.txt`` (3CosAdd, 300,000 most frequent words, case-insensitive), Spearman on
``wordsim353.tsv`` and ``simlex999.txt``. Prints one line per analogy section and the overall, then, as
the last stdout line, one JSON object::

    {"event": "eval", "model": "word2vec", "checkpoint": ..., "analogy_accuracy": 0.2046,
     "analogy_evaluated": 13986, "analogy_skipped": 5558, "wordsim353_spearman": 0.66,
     "simlex999_spearman": 0.37, ...}

CTR configs (``ctr_dnn``, ``deepfm``): the checkpoint is exported to a temporary serving bundle
(``engine.export``) and scores the config's test split (``model.data.test_path``, resolved and converted as
``engine train`` does; listed once, then read as listed and checked: a file written again since is refused,
exit 2; the train split is never read, so neither converted, listed nor checked: a missing or unreachable
``model.data.train_path`` refuses nothing); the last stdout line is ``{"event": "eval", "model": ...,
"auc": ..., "logloss": ..., "copc": ..., "rows": ...}`` (``model``: the kind the checkpoint holds). A
checkpoint of another model than the config's (``model.kind``, ``slots``, ``dim``, ``dense_dim`` or
``hidden`` differ) is refused, exit 2, naming the field and both values; so is a word2vec config's
checkpoint of a CTR model.

``URI`` is a checkpoint directory or a job root (its newest complete checkpoint), as ``engine export``
takes. Exit codes: 0 success, 2 bad config, checkpoint or evaluation files (for CTR: an empty, truncated
or non-Arrow test file, a null or out-of-[0, 1] label, a null, NaN or infinite dense value, named with
the file, row and column), or a store refusing the storage section's credentials (one line naming the
URI), 1 other failures (a store that does not answer through the retries).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

log = logging.getLogger("engine.eval")


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint (word2vec: analogy, WordSim/SimLex; CTR: test AUC/logloss)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config of the run")
    p.add_argument("--checkpoint", required=True, metavar="URI",
                   help="checkpoint directory or job root (the final line's 'checkpoint' of engine train)")
    p.add_argument("--vocab", default=None, metavar="URI",
                   help="word2vec: vocab.arrow (or its directory), local or a URI reached with the config's storage "
                        "section (default: the one the checkpoint records)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.eval_data_dir=DIR")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _bad_input_errors():
    import hdfs_io
    from models.errors import ModelInputError
    from ..checkpoint import CheckpointNotFoundError
    from ..errors import ConfigError
    from ..export.errors import ExportError
    from streaming.errors import DataFormatError, SchemaError
    from ..export.errors import BundleError
    from ..metrics import LabelError
    return (ConfigError, ExportError, BundleError, ModelInputError, hdfs_io.NotPublishedError,
            hdfs_io.CheckpointCorruptError, CheckpointNotFoundError, FileNotFoundError, DataFormatError,
            SchemaError, LabelError)


def evaluate_word2vec(cfg, uri: str, vocab: str | None = None) -> dict:
    """Scores of a word2vec checkpoint (module docstring); ``analogy_sections`` included. ``vocab``
    (``--vocab``): ``vocab.arrow`` or its directory, local or a URI on the store the config's ``storage``
    section reaches; default the one the checkpoint records, else ``model.arrow_dir``'s.

    Raises
    ------
    ConfigError
        The checkpoint holds another model than word2vec (``check_kind``).
    ExportError, CheckpointNotFoundError, hdfs_io.CheckpointCorruptError
        No readable checkpoint at ``uri``, or a vocabulary other than the one it was trained with (both
        fingerprints named).
    FileNotFoundError
        A vocabulary (local, or nothing at its URI) or benchmark file is missing.
    streaming.inputs.InputUnavailableError
        A URI vocabulary's store did not answer, or refused the credentials (``refused`` set).
    """
    from models.word2vec_eval import evaluate_all
    from streaming.inputs import is_uri
    from streaming.text import VOCAB_FILE
    from ..export.source import open_source
    from ..export.w2v import word_vectors
    p = cfg.model.params
    opts = cfg.storage.options()
    source = open_source(uri, storage_options=opts)
    try:
        desc = source.model_description()
        check_kind(desc, "word2vec", source.source_uri)    # before its vocabulary is looked at
        vocab = vocab or desc.get("vocab") or os.path.join(p.arrow_dir, VOCAB_FILE)
        local = None if is_uri(vocab) else os.path.join(vocab, VOCAB_FILE) if os.path.isdir(vocab) else vocab
        if local is not None and not os.path.isfile(local):
            raise FileNotFoundError(f"vocabulary {vocab} not found (the corpus conversion the run trained on; "
                                    f"--vocab names another place, local or a URI)")
        words, vectors, missing = word_vectors(source, vocab, opts)   # a URI copied first (w2v.local_vocab)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    data_dir = p.eval_data_dir or "."
    for name in ("questions-words.txt", "wordsim353.tsv", "simlex999.txt"):
        if not os.path.isfile(os.path.join(data_dir, name)):
            raise FileNotFoundError(f"{os.path.join(data_dir, name)} not found (model.eval_data_dir)")
    res = evaluate_all(words, vectors, data_dir)
    return {"event": "eval", "model": "word2vec", "checkpoint": source.source_uri, "words": len(words),
            "missing": missing, **res}


def check_kind(desc: dict, kind: str, uri: str) -> None:
    """The checkpoint's model description ``desc`` holds a ``kind`` model (``ctr_dnn``, ``deepfm``,
    ``word2vec``; a ``ctr_online`` checkpoint holds its ``model.network``).

    Raises
    ------
    ConfigError
        It holds another: names ``--checkpoint``, ``model.kind`` and both kinds.
    """
    from ..errors import ConfigError
    held = (desc.get("model") or {}).get("kind")
    if held != kind:
        raise ConfigError(f"--checkpoint {uri}: model.kind: the checkpoint holds {held!r}, the config says "
                          f"{kind!r}; evaluate it with the config it was trained with")


def check_model_matches(cfg, desc: dict, uri: str) -> None:
    """The config's CTR model is the one the checkpoint holds: ``model.kind``, ``slots``, ``dim``,
    ``dense_dim`` and ``hidden`` of ``cfg`` equal those of the checkpoint's model description ``desc``
    (``engine.export.checkpoint_source.description_from_config``; a ``ctr_online`` checkpoint holds its
    ``model.network``).

    Raises
    ------
    ConfigError
        The first field that differs, with both values (the checkpoint's and the config's).
    """
    from ..errors import ConfigError
    p = cfg.model.params
    check_kind(desc, cfg.model.kind, uri)
    held = desc.get("model") or {}
    pairs = (("slots", list(desc.get("slots") or []), list(p.slots)),
             ("dim", held.get("dim"), int(p.dim)),
             ("dense_dim", held.get("dense_dim"), int(p.dense_dim)),
             ("hidden", list(held.get("hidden") or []), list(p.hidden)))
    for field, ck, conf in pairs:
        if ck != conf:
            raise ConfigError(f"--checkpoint {uri}: model.{field}: the checkpoint holds {ck!r}, the config "
                              f"says {conf!r}; evaluate it with the config it was trained with")


def evaluate_ctr(cfg, uri: str) -> dict:
    """AUC / logloss / COPC of a CTR checkpoint on the config's test split (module docstring).

    Raises
    ------
    ConfigError, ExportError, CheckpointNotFoundError, hdfs_io.CheckpointCorruptError
        Bad data section, no readable checkpoint at ``uri``, or a checkpoint of another model than the
        config's (``check_model_matches``: the field and both values named).
    streaming.errors.DataFormatError
        A test file is empty, truncated or not Arrow, or holds a value the model cannot score (a null
        or out-of-[0, 1] label, a null, NaN or infinite dense value): file, row and column named.
    streaming.inputs.InputChangedError
        A test file written again after it was listed and checked, or while it is read (named).
    streaming.inputs.InputUnavailableError
        A data store that does not answer, or refuses the storage section's credentials.
    """
    import tempfile
    from streaming.source import ArrowSource
    from ..export.bundle import export_bundle
    from ..export.predictor import load_bundle
    from ..export.source import open_source
    from ..metrics import BinaryMetrics
    from ..programs.ctr_data import expected_schema, prepare_listed
    p = cfg.model.params
    opts = cfg.storage.options()
    # the test split alone (the train split is never read here: neither listed nor checked) listed once: read
    # as listed and checked (a store's objects pinned at the check's open, local files at their listed
    # version), as a trainer reads its listing
    data, listed = prepare_listed(p.data, expected_schema(p.slots, p.dense_dim), opts, splits=("test",))
    files, versions = listed["test"]
    source = open_source(uri, storage_options=opts)
    with tempfile.TemporaryDirectory(prefix="engine-eval-") as tmp:
        try:
            desc = source.model_description()
            check_model_matches(cfg, desc, source.source_uri)
            export_bundle(source, os.path.join(tmp, "bundle"))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        bundle = load_bundle(os.path.join(tmp, "bundle"))
        metrics, rows = BinaryMetrics(), 0
        for rb in ArrowSource(files, batch_size=8192, check=bundle.check_values, versions=versions).batches(0):
            metrics.update(bundle.predict(rb), rb.column(bundle.label_column).to_numpy(zero_copy_only=False))
            rows += rb.num_rows
    s = metrics.summary()
    return {"event": "eval", "model": desc["model"]["kind"], "checkpoint": source.source_uri,
            "test_path": data.test_path, "rows": rows, "auc": s["auc"], "logloss": s["logloss"],
            "copc": s["copc"]}


#: what mends an input's store refusing ``engine eval`` (its data, its --vocab): eval reads them with the
#: config's storage section (not ``--config``, as export and predict do)
EVAL_REFUSED_HINT = ("no retry mends that: once the credentials of the config's storage section and the store's "
                     "policy let this command read it, run it again")
#: what a data file written again means for ``engine eval`` (``InputChangedError.advised``: in place of
#: ``streaming.inputs.CHANGED``, which speaks of a training job's row split and checkpoints)
EVAL_CHANGED = ("it was written again after engine eval listed it, or while it was read; no metrics of a mix of "
                "two versions were reported: run it again to evaluate the version there now")


def run(args) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hdfs_io import StorageUnavailableError
    from streaming.inputs import InputChangedError, InputUnavailableError

    from ..config import load_config
    bad = _bad_input_errors()
    kind = None
    try:
        cfg = load_config(args.config, args.overrides)
        kind = None if cfg.model is None else cfg.model.kind
        if kind in ("ctr_dnn", "deepfm") and args.vocab:
            print(f"engine eval: --vocab names a word2vec model's vocabulary; model.kind is {kind!r}",
                  file=sys.stderr)
            return 2
        if kind in ("ctr_dnn", "deepfm"):
            out = evaluate_ctr(cfg, args.checkpoint)
        elif kind == "word2vec":
            out = evaluate_word2vec(cfg, args.checkpoint, args.vocab)
        else:
            print(f"engine eval: model.kind must be word2vec, ctr_dnn or deepfm, got {kind!r}", file=sys.stderr)
            return 2
    except InputChangedError as e:         # streaming.inputs' advice is a training job's (its row split, --resume)
        print(f"engine eval: {e.advised(EVAL_CHANGED)}", file=sys.stderr)
        return 2
    except InputUnavailableError as e:     # model.data's or the vocabulary's store, not the checkpoint's
        from ..export.cli import input_unavailable
        return input_unavailable("eval", "data" if kind != "word2vec" else "--vocab" if args.vocab else "vocabulary",
                                 e, hint=EVAL_REFUSED_HINT)
    except StorageUnavailableError as e:   # not bad input: the storage did not answer through its retries
        print(f"engine eval: checkpoint storage unavailable: {e}", file=sys.stderr)
        return 1
    except bad as e:
        print(f"engine eval: {e}", file=sys.stderr)
        return 2
    except OSError as e:                   # the checkpoint's store refusing the credentials: named, not a traceback
        from ..export.cli import refused_line
        line = refused_line(e, {"checkpoint": args.checkpoint},
                            hint="no retry mends that: once the credentials of the config's storage section and the "
                                 "store's policy let this command read the checkpoint, run it again")
        if line is None:
            raise
        print(f"engine eval: {line}", file=sys.stderr)
        return 2
    if kind != "word2vec":
        print(f"{out['model']} test AUC {out['auc']:.4f}  logloss {out['logloss']:.4f}  COPC {out['copc']:.3f}  "
              f"({out['rows']} rows)")
        out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}
        print(json.dumps(out), flush=True)
        return 0
    for s in out["analogy_sections"]:
        acc = s["accuracy"]
        print(f"{s['section']:<30} {100 * acc if acc == acc else float('nan'):6.2f}%  "
              f"({s['correct']}/{s['evaluated']})")
    print(f"{'overall':<30} {100 * out['analogy_accuracy']:6.2f}%  ({out['analogy_correct']}/"
          f"{out['analogy_evaluated']}, {out['analogy_skipped']} skipped)")
    print(f"{'wordsim353 spearman':<30} {out['wordsim353_spearman']:.4f}")
    print(f"{'simlex999 spearman':<30} {out['simlex999_spearman']:.4f}")
    out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()
           if k != "analogy_sections"}
    print(json.dumps(out), flush=True)
    return 0
