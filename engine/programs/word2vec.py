"""``word2vec``: skip-gram with negative sampling trained through the parameter servers (GEO by default).

Tables (declared in the config's ``tables`` section, checked by ``prepare``)::

    sparse  model.input_table   input vectors, key make_keys(input_slot, word_id), dim = model.dim,
                                initializer uniform, init_range 0.5 / dim (word2vec.c / gensim's init,
                                a pure function of (table seed, key), created by the servers)
    sparse  model.output_table  output (negative-sampling) vectors, key make_keys(output_slot, word_id),
                                initializer zeros
    dense   model.progress_table  one float: raw words trained by all workers (drives the learning rate)

The data is a corpus converted by ``streaming.text`` (``engine convert text``); ``prepare`` converts
``model.corpus`` into ``model.arrow_dir`` when the Arrow form is missing or stale. Workers split it: record
batch ``i`` of the corpus parts (in order, about 100k tokens each) goes to worker ``i % num_workers``;
each record batch is cut into steps of at most ``model.batch_words`` raw words (documents whole, as
gensim's jobs).

One worker step (``models.word2vec.SkipGramNS``; randomness ``new_state(seed, rank, epoch, step)``)::

    read      record batch → tokens uint32[n], offsets int64[d + 1], raw words
    prepare   subsampling, reduced windows, negatives (global word ids)
    train     GEO: in place on the mode's replicas of both tables (local id = word id; no per-step
              pull or push: the mode pushes the changed rows' deltas every geo.k_steps steps, summed
              over workers with geo.delta_scale: sum, and refreshes them);
              async: remap → pull the step's rows → train on the copies → push_sparse_delta(after - before)
    progress  push this step's raw words to the progress table, pull the global total

Learning rate: linear from ``alpha`` to ``min_alpha`` over the planned words = epochs × the corpus's raw
words (all workers'); a step runs from ``alpha_at(done / planned)`` to
``alpha_at((done + num_workers × its raw words) / planned)``, ``done`` being the global total pulled
from the progress table (the other workers advance it meanwhile).

Reports (metrics file ``model.metrics_file``, JSON lines; the launcher shows them live): ``train`` events
per worker every ``log_every_s`` with raw and effective words/s (effective = after subsampling and the
OOV drop, as gensim counts), loss per (center, context) pair and alpha; the ``final`` event (also the
last stdout line) with ``words_per_s``, ``effective_words_per_s`` and, with ``eval_after_train``, the
evaluation figures of rank 0 (``models.word2vec_eval``'s benchmarks on the servers' input vectors; a
benchmark that cannot score, e.g. none of its pairs in the vocabulary, is a WARNING and null figures).
``prepare`` refuses a missing benchmark file of ``model.eval_data_dir`` before anything starts.

Checkpoints record the conversion they were trained on (``sources.train.vocab``:
``streaming.text.conversion_fingerprint``, i.e. the vocabulary's words, bytes and CRC-32 and the corpus's
raw tokens): ``--resume`` refuses a ``model.arrow_dir`` whose conversion differs (its word ids would name
other words), and ``engine export`` / ``engine eval`` refuse a ``vocab.arrow`` other than the recorded one.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from streaming.errors import DataFormatError, SchemaError

from ..program_configs import Word2VecConfig as Config
from .. import job_checkpoints as ckpt_job
from .. import observability
from ..errors import ConfigError
from .ctr_positions import AlignedCheckpoints, Position
from .ctr_report import Follower, MetricsFile, now_stamp

#: rank 0 writes the checkpoints at aligned points with exact data positions (``AlignedCheckpoints``)
WRITES_CHECKPOINTS = True

log = logging.getLogger(__name__)

EVAL_KEYS = ("analogy_accuracy", "analogy_evaluated", "analogy_skipped", "wordsim353_spearman",
             "simlex999_spearman")
#: the benchmark files of ``model.eval_data_dir`` (``models.word2vec_eval``'s formats)
EVAL_FILES = ("questions-words.txt", "wordsim353.tsv", "simlex999.txt")


def params_of(p: Config):
    """``models.word2vec.Word2VecParams`` of a model section.

    Raises
    ------
    ConfigError
        A combination the model refuses (e.g. ``min_alpha > alpha``).
    """
    from models import ModelConfigError
    from models.word2vec import Word2VecParams
    try:
        return Word2VecParams(dim=p.dim, window=p.window, negative=p.negative, sample=p.sample, alpha=p.alpha,
                              min_alpha=p.min_alpha, ns_exponent=p.ns_exponent, epochs=p.epochs, seed=p.seed,
                              batch_words=p.batch_words)
    except ModelConfigError as e:
        raise ConfigError(f"model: {e}") from None


# ---------------------------------------------------------------------------------- launcher side
def check_tables(cfg) -> None:
    """The tables the program needs exist with the right shape and initializers (a declared table it does
    not use is refused earlier, by ``engine.config.from_dict`` through ``Word2VecConfig.used_tables``).

    Raises
    ------
    ConfigError
        Naming the table key path: a needed table missing or misconfigured.
    """
    p: Config = cfg.model.params
    if p.input_slot == p.output_slot and p.input_table == p.output_table:
        raise ConfigError("model.input_slot and model.output_slot must differ when both vectors share a table")
    want = {p.input_table: ("uniform", 0.5 / p.dim), p.output_table: ("zeros", None)}
    for name, (init, rng) in want.items():
        t = cfg.sparse_tables.get(name)
        kp = f"tables.sparse.{name}"
        if t is None:
            raise ConfigError(f"{kp}: missing (model names it); declared sparse tables: {sorted(cfg.sparse_tables)}")
        if t.dim != p.dim:
            raise ConfigError(f"{kp}.dim must be model.dim = {p.dim}, got {t.dim}")
        if t.initializer != init:
            raise ConfigError(f"{kp}.initializer must be {init} for word2vec, got {t.initializer!r}")
        if rng is not None and not math.isclose(t.init_range, rng, rel_tol=1e-6):
            raise ConfigError(f"{kp}.init_range must be 0.5 / model.dim = {rng:g} (word2vec.c's input "
                              f"vectors), got {t.init_range!r}")
        if t.min_count > 1 or t.admit_probability < 1:
            raise ConfigError(f"{kp}: admission (min_count, admit_probability) must be off for word2vec")
    if p.progress_table not in cfg.dense_tables:
        raise ConfigError(f"tables.dense.{p.progress_table}: missing (model.progress_table names it; one "
                          f"float summing the workers' words); declared dense tables: {sorted(cfg.dense_tables)}")
    if cfg.mode == "sync":
        raise ConfigError("mode must be geo or async for word2vec (its kernel updates rows in place), got sync")


def prepare_data(p: Config, storage_options=None) -> Config:
    """Resolve the paths to absolute ones and convert ``corpus`` into ``arrow_dir`` when needed. A corpus
    named by URI (``s3://bucket/corpus.txt.gz``, ``hdfs://...``) is copied first, with
    ``storage_options`` (the config's ``storage`` section), beside ``arrow_dir``
    (``streaming.inputs.fetch``: again only when the object's size or modification time changed), and
    converted as a local file is.

    Raises
    ------
    ConfigError
        Neither a corpus nor a finished conversion, bad conversion knobs, a corpus that cannot be read
        (e.g. truncated gzip) or whose vocabulary would be empty (naming ``model.corpus`` and
        ``model.min_count``), or an ``arrow_dir`` that cannot take the conversion.
    streaming.errors.DataFormatError
        The corpus is not valid UTF-8 text.
    """
    from streaming.text import ConvertError, EmptyVocabularyError, convert_text, text_arrow_is_current
    arrow = os.path.abspath(p.arrow_dir)
    corpus = _local_corpus(p.corpus, arrow, storage_options) if p.corpus else ""
    max_vocab = p.max_vocab or None
    if corpus:
        if not os.path.isfile(corpus):
            if not (Path(arrow) / "_meta.json").is_file():
                raise ConfigError(f"model.corpus: {corpus} not found and model.arrow_dir {arrow} holds no "
                                  f"converted corpus")
            log.warning("model.corpus %s not found; training on the existing conversion in %s", corpus, arrow)
        elif not text_arrow_is_current(corpus, arrow, min_count=p.min_count, max_vocab=max_vocab):
            log.info("converting %s into %s (min_count %d, max_vocab %s)", corpus, arrow, p.min_count, max_vocab)
            try:
                convert_text(corpus, arrow, min_count=p.min_count, max_vocab=max_vocab)
            except EmptyVocabularyError as e:
                raise ConfigError(f"model.corpus: {e.path}: {e.explain('model.min_count')}") from None
            except ConvertError as e:
                raise ConfigError(f"{'model.corpus' if e.path == corpus else 'model.arrow_dir'}: {e}") from None
    elif not (Path(arrow) / "_meta.json").is_file():
        raise ConfigError(f"model.arrow_dir: {arrow} holds no converted corpus (run `engine convert text "
                          f"CORPUS {p.arrow_dir}` or set model.corpus)")
    if corpus_meta(arrow).get("vocab_size") == 0:     # converted before empty vocabularies were refused
        raise ConfigError(f"model.arrow_dir: {arrow} holds a conversion with an empty vocabulary (of "
                          f"model.corpus {corpus or '(unset)'}, model.min_count {p.min_count}): nothing to train")
    eval_dir = os.path.abspath(p.eval_data_dir) if p.eval_data_dir else ""
    return dataclasses.replace(p, arrow_dir=arrow, corpus=corpus, eval_data_dir=eval_dir)


def check_eval_files(p: Config) -> None:
    """With ``eval_after_train``, the benchmark files (``EVAL_FILES``) are in ``eval_data_dir``.

    Raises
    ------
    ConfigError
        ``eval_data_dir`` empty, or one of the files missing (its path named).
    """
    if not p.eval_after_train:
        return
    if not p.eval_data_dir:
        raise ConfigError(f"model.eval_data_dir: empty while model.eval_after_train is true; name the "
                          f"directory holding {', '.join(EVAL_FILES)}, or set model.eval_after_train: false")
    for name in EVAL_FILES:
        path = os.path.join(p.eval_data_dir, name)
        if not os.path.isfile(path):
            raise ConfigError(f"model.eval_data_dir: {path} not found (model.eval_after_train is true: rank 0 "
                              f"reads {', '.join(EVAL_FILES)} there after training); set model.eval_data_dir "
                              f"to the directory holding them, or model.eval_after_train: false")


def _local_corpus(corpus: str, arrow: str, storage_options) -> str:
    """The local path of ``model.corpus``: itself made absolute, or for a URI its copy in
    ``{arrow}.download/`` under the URI's last name, fetched unless current; a URI with
    nothing there is returned as it is (``prepare_data`` then names it as not found)."""
    from streaming.inputs import fetch, is_uri
    if not is_uri(corpus):
        return os.path.abspath(corpus)
    try:
        return fetch(corpus, arrow.rstrip("/") + ".download", storage_options)
    except FileNotFoundError:
        return corpus


def check_corpus_files(arrow_dir: str) -> None:
    """Every corpus part of the conversion in ``arrow_dir`` is there, readable, ends with its end-of-stream
    marker and has the corpus columns (``check_corpus_schema``), before any process starts; reads each
    part's schema and a few bytes (word ids are checked as the workers read them: ``corpus_batches``).

    Raises
    ------
    streaming.errors.DataFormatError, streaming.errors.SchemaError
        A truncated, unreadable or mistyped part (names the file).
    ConfigError
        A part that ``_meta.json`` lists is missing (names ``model.arrow_dir``).
    """
    from streaming.source import read_schema
    from streaming.text import corpus_files
    for f in corpus_files(arrow_dir):
        if not os.path.isfile(f):
            raise ConfigError(f"model.arrow_dir: {arrow_dir}: corpus part {f} (listed in _meta.json) not found")
        check_corpus_schema(read_schema(f, check_end=True), f)


def corpus_meta(arrow_dir: str) -> dict:
    """``_meta.json`` of a conversion (``total_tokens`` = raw words of one epoch)."""
    return json.loads((Path(arrow_dir) / "_meta.json").read_text())


def prepare(cfg):
    """Launcher hook: check tables, convert the corpus if needed, check the evaluation files, pick the
    metrics file.

    Raises
    ------
    ConfigError
        Bad tables or model knobs, no usable corpus (``prepare_data``), or a missing evaluation file
        (``check_eval_files``).
    streaming.errors.DataFormatError, streaming.errors.SchemaError
        A corpus part that is truncated, unreadable or mistyped (``check_corpus_files``).
    """
    check_tables(cfg)
    p: Config = cfg.model.params
    params_of(p)
    p = prepare_data(p, cfg.storage.options())
    check_corpus_files(p.arrow_dir)
    check_eval_files(p)
    metrics_file = p.metrics_file or os.path.abspath(
        os.path.join(p.metrics_dir, f"word2vec-{cfg.mode}-{now_stamp()}-{os.getpid()}.jsonl"))
    p = dataclasses.replace(p, metrics_file=metrics_file)
    meta = corpus_meta(p.arrow_dir)
    MetricsFile(metrics_file).write({
        "event": "start", "model": "word2vec", "mode": cfg.mode, "workers": cfg.cluster.workers,
        "servers": cfg.cluster.servers, "arrow_dir": p.arrow_dir, "vocab_size": meta.get("vocab_size"),
        "raw_words_per_epoch": meta.get("total_tokens"), "epochs": p.epochs, "time": time.time()})
    log.info("metrics file: %s", metrics_file)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, params=p))


class _W2VFollower(Follower):
    """The metrics file live, counted in raw words."""

    def _show(self, ev: dict) -> None:
        if ev.get("event") != "train":
            return
        self._examples[ev.get("rank", 0)] = ev.get("words_total", 0)
        if self._bar is not None:
            self._bar.update(sum(self._examples.values()) - self._bar.n)
            self._bar.set_postfix(loss=f"{ev.get('loss') or 0:.4f}", refresh=False)
            return
        log.info("train rank %s epoch %s: %.1f%% done, %.0f words/s, %.0f effective words/s, loss %.4f, "
                 "alpha %.5f", ev.get("rank"), ev.get("epoch"), 100 * (ev.get("progress") or 0),
                 ev.get("words_per_s") or 0, ev.get("effective_words_per_s") or 0, ev.get("loss") or 0,
                 ev.get("alpha") or 0)


def follow(cfg) -> Follower:
    """Launcher hook: show the workers' progress while the job runs."""
    p: Config = cfg.model.params
    total = int(corpus_meta(p.arrow_dir).get("total_tokens", 0)) * p.epochs
    return _W2VFollower(p.metrics_file, total)


def final(cfg, results: list[dict]) -> dict:
    """Launcher hook: the ``final`` event. Words/s = all workers' words / the longest training time."""
    p: Config = cfg.model.params
    raw = sum(r.get("raw_words", 0) for r in results)
    eff = sum(r.get("effective_words", 0) for r in results)
    pairs = sum(r.get("pairs", 0) for r in results)
    loss = sum(r.get("loss_sum", 0.0) for r in results)
    seconds = max([r.get("train_seconds", 0.0) for r in results] + [1e-9])
    ev = next((r.get("eval") for r in results if r.get("rank") == 0), None) or {}
    event = {"event": "final", "model": "word2vec", "mode": cfg.mode, "epochs": p.epochs,
             "words": raw, "effective_words": eff, "train_seconds": seconds,
             "words_per_s": raw / seconds, "effective_words_per_s": eff / seconds,
             "loss": loss / max(pairs, 1), **{k: ev.get(k) for k in EVAL_KEYS},
             "metrics_file": p.metrics_file,
             "checkpoint": next((r.get("checkpoint") for r in results if r.get("rank") == 0), None)}
    MetricsFile(p.metrics_file).write({**event, "analogy_sections": ev.get("analogy_sections")})
    event["tensorboard_dir"] = observability.record_final(cfg, p.metrics_file, event)   # final/* scalars
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in event.items()}


# ---------------------------------------------------------------------------------- worker side
class VocabCheckpoints(AlignedCheckpoints):
    """``AlignedCheckpoints`` whose manifests' ``sources.train`` also record the conversion trained on:
    ``vocab`` = ``streaming.text.conversion_fingerprint`` (``vocab_words``, ``vocab_bytes``,
    ``vocab_crc32``, ``total_tokens``). It is not part of the position's identity (which maps or
    restarts an epoch): a resume on another conversion is refused outright (``check_resumed_corpus``)."""

    def __init__(self, trainer, identity: dict, fingerprint: dict):
        self.fingerprint = dict(fingerprint)
        super().__init__(trainer, identity=identity)

    def sources(self, pos: Position) -> dict:
        """The manifest's ``sources``: position, identity and ``train.vocab``."""
        out = super().sources(pos)
        out["train"]["vocab"] = dict(self.fingerprint)
        return out


def check_resumed_corpus(config, arrow_dir: str, fingerprint: dict, rank: int = 0) -> None:
    """The checkpoint ``--resume`` restored (``config.checkpoint.restored``; nothing to check without
    one) was trained on the conversion in ``arrow_dir``, whose ``conversion_fingerprint`` is
    ``fingerprint``. A checkpoint written before fingerprints were recorded cannot be checked: a
    WARNING (rank 0), and it is accepted.

    Raises
    ------
    ConfigError
        The checkpoint's ``sources.train.vocab`` differs: names ``model.arrow_dir``, the checkpoint and
        every field that changed (was, now).
    """
    uri = config.checkpoint.restored
    if not uri:
        return
    mgr, target = ckpt_job.manager_for(config, uri)
    manifest = mgr.manifest(mgr.resolve(target))
    recorded = ((manifest.get("sources") or {}).get("train") or {}).get("vocab")
    if not isinstance(recorded, dict):
        if rank == 0:
            log.warning("checkpoint %s records no fingerprint of the corpus conversion it was trained on "
                        "(written before they were recorded): cannot verify that model.arrow_dir %s holds it; "
                        "resuming on it as it is", uri, arrow_dir)
        return
    changed = [f"{k} was {recorded[k]}, now {v}" for k, v in fingerprint.items()
               if k in recorded and recorded[k] != v]
    if changed:
        raise ConfigError(
            f"model.arrow_dir: {arrow_dir} holds another corpus conversion than the one checkpoint {uri} was "
            f"trained on ({'; '.join(changed)}: re-converted since?): its word ids would name other words. "
            f"Resume with the conversion it was trained on (model.arrow_dir, model.corpus), or train afresh "
            f"without --resume")


def evaluate_vectors(words, vectors, data_dir) -> dict:
    """``models.word2vec_eval.evaluate_all``'s figures, each benchmark on its own: one that cannot score
    (no analogy question or word pair with all its words in the vocabulary, a file missing, unreadable or
    malformed) is logged as a WARNING and its figures are None (null in the final line).

    Parameters
    ----------
    words : list of str, length V
        By descending count (word id order).
    vectors : float32[V, dim]
    data_dir : str
        Holds ``EVAL_FILES``.

    Returns
    -------
    dict
        ``analogy_accuracy`` (None when no question was evaluated), ``analogy_correct``,
        ``analogy_evaluated``, ``analogy_skipped``, ``analogy_sections``, and per pair benchmark
        (``wordsim353``, ``simlex999``) ``{name}_spearman``, ``{name}_pairs``, ``{name}_skipped``.
    """
    from models.errors import ModelInputError
    from models.word2vec_eval import evaluate_analogies, evaluate_word_pairs
    cannot = (ModelInputError, OSError, UnicodeDecodeError)
    d = Path(data_dir)
    out: dict = dict.fromkeys(("analogy_accuracy", "analogy_correct", "analogy_evaluated", "analogy_skipped",
                               "analogy_sections"))
    path = d / EVAL_FILES[0]
    try:
        an = evaluate_analogies(words, vectors, path)
    except cannot as e:
        log.warning("evaluation: %s (%s): the analogy figures are null", e, type(e).__name__)
    else:
        out.update(analogy_correct=an["correct"], analogy_evaluated=an["evaluated"],
                   analogy_skipped=an["skipped"], analogy_sections=an["sections"])
        if an["evaluated"]:
            out["analogy_accuracy"] = an["accuracy"]
        else:
            log.warning("evaluation: %s: no question has its four words in the vocabulary (%d skipped): "
                        "analogy_accuracy is null", path, an["skipped"])
    for name, fname in (("wordsim353", EVAL_FILES[1]), ("simlex999", EVAL_FILES[2])):
        path = d / fname
        try:
            r = evaluate_word_pairs(words, vectors, path)
        except cannot as e:
            log.warning("evaluation: %s (%s): the %s figures are null", e, type(e).__name__, name)
            r = {}
        for k in ("spearman", "pairs", "skipped"):
            out[f"{name}_{k}"] = r.get(k)
    return out


def corpus_batches(files, vocab_size: int | None = None, arrow_dir: str = ""):
    """``(path, first_row, record_batch)`` of the corpus parts in order, read through
    ``streaming.source.read_batches`` and checked: ``tokens : list<uint32>`` and ``raw_tokens : uint32``
    present, without nulls, and every word id below ``vocab_size`` (None: not checked).

    ``first_row``: 0-based row (document) of the part where the batch starts.

    Raises
    ------
    streaming.errors.DataFormatError
        A part that is truncated (inside a record batch, or between two: no end-of-stream marker),
        corrupt or not Arrow, or a batch holding a null or a word id outside the vocabulary (a corpus
        and ``vocab.arrow`` of different conversions): names the file, its row and the column, and
        ``model.arrow_dir``.
    streaming.errors.SchemaError
        A part without ``tokens`` or ``raw_tokens``, or with another type (names the file and column).
    """
    from streaming.source import read_batches
    where = f" of model.arrow_dir {arrow_dir}" if arrow_dir else ""
    for path in files:
        path = str(path)
        row = 0
        for rb in read_batches(path):
            _check_corpus_batch(rb, path, row, vocab_size, where)
            yield path, row, rb
            row += rb.num_rows


def check_corpus_schema(schema: pa.Schema, path: str) -> None:
    """A corpus part's schema has ``tokens : list<uint32>`` and ``raw_tokens : uint32``.

    Raises
    ------
    streaming.errors.SchemaError
        Names the column and ``path``.
    """
    names = schema.names
    for col, want in (("tokens", "list<uint32>"), ("raw_tokens", "uint32")):
        if col not in names:
            raise SchemaError(path, col, want, None, names)
    t = schema.field("tokens").type
    if not pa.types.is_list(t) or t.value_type != pa.uint32():
        raise SchemaError(path, "tokens", "list<uint32>", str(t))
    if schema.field("raw_tokens").type != pa.uint32():
        raise SchemaError(path, "raw_tokens", "uint32", str(schema.field("raw_tokens").type))


def _check_corpus_batch(rb, path: str, row: int, vocab_size, where: str) -> None:
    """What ``models.word2vec``'s ``batch_arrays`` and ``SkipGramNS.prepare`` would refuse with a
    ModelInputError naming neither the file nor the row (``corpus_batches``)."""
    check_corpus_schema(rb.schema, path)
    tokens = rb.column("tokens")
    offs = tokens.offsets.to_numpy()
    offs = offs - offs[0]
    values = tokens.flatten()           # the word ids of the documents, back to back
    for col, arr, per_word in (("tokens", tokens, False), ("tokens", values, True),
                               ("raw_tokens", rb.column("raw_tokens"), False)):
        if arr.null_count:
            i = int(np.flatnonzero(~np.asarray(arr.is_valid()))[0])
            if per_word:                # the document holding the null word id
                i = int(np.searchsorted(offs, i, side="right")) - 1
            raise DataFormatError(path, row + i + 1, col, f"expected no nulls in the corpus{where}, got one",
                                  unit="row")
    if vocab_size is None or not len(values):
        return
    ids = values.to_numpy()
    if int(ids.max()) >= vocab_size:
        k = int(np.argmax(ids >= vocab_size))
        doc = int(np.searchsorted(offs, k, side="right")) - 1
        raise DataFormatError(
            path, row + doc + 1, "tokens",
            f"expected word ids < {vocab_size} (the vocab.arrow{where} holds {vocab_size} "
            f"word{'s' * (vocab_size != 1)}), got {int(ids[k])}: the corpus part and the vocabulary come "
            f"from different conversions; convert the corpus again (engine convert text)", unit="row")


def steps_per_epoch(files, rank: int, num_workers: int, batch_words: int, vocab_size: int | None = None,
                    arrow_dir: str = "") -> int:
    """How many steps ``worker_steps`` yields (every batch checked as ``corpus_batches`` does).

    Raises
    ------
    streaming.errors.DataFormatError, streaming.errors.SchemaError
        As ``corpus_batches``.
    """
    from models.word2vec_reference import job_bounds
    n = 0
    for i, (_path, _row, rb) in enumerate(corpus_batches(files, vocab_size, arrow_dir)):
        if i % num_workers == rank and rb.num_rows:
            n += len(job_bounds(rb.column("raw_tokens").to_numpy().astype(np.int64), batch_words)) - 1
    return n


def worker_steps(files, rank: int, num_workers: int, batch_words: int, vocab_size: int | None = None,
                 arrow_dir: str = ""):
    """This worker's steps: ``(tokens uint32[n], offsets int64[d + 1], raw_words)`` of at most
    ``batch_words`` raw words each (a longer document is one step), from record batches
    ``i % num_workers == rank`` of the corpus parts in order.

    Raises
    ------
    streaming.errors.DataFormatError, streaming.errors.SchemaError
        As ``corpus_batches`` (every batch is checked, this worker's or not).
    """
    from models.word2vec import batch_arrays
    from models.word2vec_reference import job_bounds
    for i, (_path, _row, rb) in enumerate(corpus_batches(files, vocab_size, arrow_dir)):
        if i % num_workers != rank or rb.num_rows == 0:
            continue
        tokens, offs, _ = batch_arrays(rb)
        raw_len = rb.column("raw_tokens").to_numpy().astype(np.int64)
        bounds = job_bounds(raw_len, batch_words)
        for a, b in zip(bounds[:-1], bounds[1:]):
            o = offs[a:b + 1]
            yield tokens[o[0]:o[-1]], o - o[0], int(raw_len[a:b].sum())


class Word2VecTrainer:
    """The worker loop of one rank (module docstring).

    Parameters
    ----------
    ctx : engine.roles.WorkerContext
    """

    def __init__(self, ctx):
        from models.word2vec import SkipGramNS, Vocab
        from streaming.keys import make_keys
        from streaming.text import conversion_fingerprint, corpus_files
        self.ctx, self.mode, self.client = ctx, ctx.mode, ctx.client
        self.cfg: Config = ctx.config.model.params
        self.rank, self.num_workers = ctx.rank, ctx.num_workers
        p = self.cfg
        for t in (p.input_table, p.output_table):
            if self.client.sparse_dim(t) != p.dim:
                raise ConfigError(f"tables.sparse.{t}.dim is {self.client.sparse_dim(t)} on the servers, "
                                  f"model.dim is {p.dim}")
        # before anything runs: a resume on another conversion is refused (word ids would name other words)
        self.fingerprint = conversion_fingerprint(p.arrow_dir)
        check_resumed_corpus(ctx.config, p.arrow_dir, self.fingerprint, self.rank)
        self.vocab = Vocab.from_arrow(p.arrow_dir)
        self.sg = SkipGramNS(self.vocab, params_of(p))
        self.files = corpus_files(p.arrow_dir)
        self.planned = max(1, int(corpus_meta(p.arrow_dir)["total_tokens"]) * p.epochs)
        ids = np.arange(len(self.vocab), dtype=np.uint64)
        self.keys_in, self.keys_out = make_keys(p.input_slot, ids), make_keys(p.output_slot, ids)
        self.metrics = observability.events(MetricsFile(p.metrics_file or os.path.join(
            p.metrics_dir, "word2vec.jsonl")), ctx.config, self.rank)    # + TensorBoard, Prometheus gauges
        self.work = np.empty(p.dim, np.float32)
        self.scratch = None
        self.global_done = 0.0
        self.steps = 0                # the job's step (restored from the checkpoint, then + 1 per step)
        self.train_seconds = 0.0      # this process's seconds inside training steps (live_counters)
        observability.watch_trainer(self)     # Prometheus reads live_counters at scrape time
        # checkpoints at aligned points (every checkpoint.align_steps steps of an epoch while every
        # rank still has data, and at epoch ends) with the data position (epoch, step of the epoch)
        # (sources.train.vocab: the conversion's fingerprint, checked by a resume, export and eval)
        self.checkpoints = VocabCheckpoints(self, identity={
            "workers": self.num_workers, "batch_words": p.batch_words, "seed": p.seed, "arrow_dir": p.arrow_dir},
            fingerprint=self.fingerprint)

    def _drain(self) -> None:
        """Every update of this worker visible on the servers (GEO deltas, queued async pushes)."""
        self.mode.drain()

    def warm_up(self) -> float:
        """Compile this worker's kernels (subsampling and negatives, the SGNS step on replicas and on
        pulled copies, the remap) on a synthetic batch of vocabulary words, with throwaway vectors and
        read-only tokens as the corpus reader gives them; nothing reaches the servers. Returns seconds."""
        from models.word2vec import new_state
        t0 = time.perf_counter()
        dim, words = self.cfg.dim, len(self.vocab)
        tokens = np.random.default_rng(0).integers(0, min(words, 64), 256).astype(np.uint32)
        tokens.flags.writeable = False
        batch = self.sg.prepare(tokens, np.array([0, 128, 256], np.int64), new_state(0, 0))
        syn = [np.zeros((words, dim), np.float32) for _ in range(2)]
        self.sg.train(batch, batch.words, batch.words, batch.negs, *syn, 0.025, 0.02, self.work)
        local = self.sg.remap(batch, self.sg.new_scratch())
        syn = [np.zeros((len(ids), dim), np.float32) for ids in (local.in_ids, local.out_ids)]
        self.sg.train(batch, local.words_in, local.words_out, local.negs_out, *syn, 0.025, 0.02, self.work)
        return time.perf_counter() - t0

    # -- the step ---------------------------------------------------------------------------------
    def train_replica(self, batch, a0, a1, syn0, syn1):
        """GEO: train on the replicas in place (local id = word id)."""
        return self.sg.train(batch, batch.words, batch.words, batch.negs, syn0, syn1, a0, a1, self.work)

    def train_pulled(self, batch, a0, a1):
        """async: pull the step's rows, train copies, push ``after - before``."""
        p = self.cfg
        if self.scratch is None:
            self.scratch = self.sg.new_scratch()
        local = self.sg.remap(batch, self.scratch)
        k_in, k_out = self.keys_in[local.in_ids], self.keys_out[local.out_ids]
        syn0 = np.array(self.mode.pull_sparse(p.input_table, k_in), np.float32, order="C")
        syn1 = np.array(self.mode.pull_sparse(p.output_table, k_out), np.float32, order="C")
        b0, b1 = syn0.copy(), syn1.copy()
        stats = self.sg.train(batch, local.words_in, local.words_out, local.negs_out, syn0, syn1, a0, a1, self.work)
        self.mode.push_sparse_delta(p.input_table, k_in, syn0 - b0)
        self.mode.push_sparse_delta(p.output_table, k_out, syn1 - b1)
        return stats

    def progress(self, raw_words: int) -> None:
        """Add this step's raw words to the global count and read the total."""
        self.client.push_dense_delta(self.cfg.progress_table, np.array([raw_words], np.float32))
        self.global_done = float(self.client.pull_dense(self.cfg.progress_table)[0])

    # -- loop -------------------------------------------------------------------------------------
    def run(self) -> dict:
        from models.word2vec import SGStats, new_state
        p = self.cfg
        if self.ctx.config.cluster.warm_up:      # every worker starts its first step compiled
            log.info("worker %d: kernels ready in %.1f s", self.rank, self.warm_up())
        start, self.steps = self.checkpoints.restored()
        if self.rank == 0 and not self.ctx.config.checkpoint.restored:   # a restore brought the count back
            self.client.init_dense(p.progress_table, np.zeros(1, np.float32), force=True)
        self.mode.barrier("w2v-progress-init")
        self.global_done = float(self.client.pull_dense(p.progress_table)[0])
        per_epoch = 0
        if self.checkpoints.enabled:
            per_epoch = min(steps_per_epoch(self.files, r, self.num_workers, p.batch_words, len(self.vocab),
                                            p.arrow_dir) for r in range(self.num_workers))
        syn0 = self.mode.sparse_replica(p.input_table, self.keys_in)
        syn1 = self.mode.sparse_replica(p.output_table, self.keys_out) if syn0 is not None else None
        log.info("worker %d: %d words, %s, %d planned raw words (all workers)", self.rank, len(self.vocab),
                 "training on GEO replicas" if syn0 is not None else f"pull/push per step ({self.mode.name})",
                 self.planned)
        total, window = SGStats(), SGStats()
        train_s, t_win = 0.0, time.perf_counter()
        for epoch in range(start.epoch, p.epochs):
            skip = start.batch if epoch == start.epoch else 0
            meetings = set(self.checkpoints.points(skip, per_epoch))
            for k, (tokens, offs, raw) in enumerate(worker_steps(self.files, self.rank, self.num_workers,
                                                                 p.batch_words, len(self.vocab), p.arrow_dir)):
                if k < skip:
                    continue
                t0 = time.perf_counter()
                a0 = self.sg.alpha_at(self.global_done / self.planned)
                a1 = self.sg.alpha_at((self.global_done + raw * self.num_workers) / self.planned)
                batch = self.sg.prepare(tokens, offs, new_state(p.seed, self.rank, epoch, k))
                st = (self.train_replica(batch, a0, a1, syn0, syn1) if syn0 is not None
                      else self.train_pulled(batch, a0, a1))
                st.raw_words = raw
                self.mode.end_step(raw)
                self.progress(raw)
                self.steps += 1
                now = time.perf_counter()
                train_s += now - t0
                self.train_seconds = train_s
                total, window = total + st, window + st
                if now - t_win >= p.log_every_s:
                    self._event(epoch, total, window, now - t_win, a1)
                    window, t_win = SGStats(), now
                if k + 1 in meetings:
                    self.checkpoints.meet(Position(epoch, k + 1))
            self.checkpoints.meet(Position(epoch + 1, 0))
        if self.checkpoints.ck.final:
            self.checkpoints.meet(Position(p.epochs, 0), force=True)
        t0 = time.perf_counter()
        self.mode.finish()
        train_s += time.perf_counter() - t0
        if window.raw_words:
            self._event(p.epochs - 1, total, window, max(time.perf_counter() - t_win, 1e-9), p.min_alpha)
        log.info("worker %d: %d raw / %d effective words in %.1f s (%.0f / %.0f per s)", self.rank,
                 total.raw_words, total.effective_words, train_s, total.raw_words / max(train_s, 1e-9),
                 total.effective_words / max(train_s, 1e-9))
        out = {"rank": self.rank, "steps": self.steps, "checkpoint": self.checkpoints.last_uri,
               "raw_words": total.raw_words,
               "effective_words": total.effective_words, "pairs": total.pairs, "loss_sum": total.loss,
               "train_seconds": train_s}
        if self.rank == 0 and p.eval_after_train:
            out["eval"] = self.evaluate()
        return out

    def live_counters(self) -> dict[str, float]:
        """This process's work since it started, read at scrape time (Prometheus, another thread), as the
        CTR trainers give it: ``examples`` = raw words trained and ``steps`` ended (``Mode.examples`` and
        ``Mode.step``, moved after every step) and ``train_seconds`` inside training steps. A restarted or
        resumed process starts again from 0; the job's step across attempts is the events' ``step``."""
        return {"examples": self.mode.examples, "steps": self.mode.step, "train_seconds": self.train_seconds}

    def _event(self, epoch, total, window, seconds, alpha) -> None:
        self.metrics.write({"event": "train", "rank": self.rank, "epoch": epoch, "step": self.steps,
                            "words_total": total.raw_words, "effective_words_total": total.effective_words,
                            "progress": min(1.0, self.global_done / self.planned),
                            "words_per_s": window.raw_words / seconds,
                            "effective_words_per_s": window.effective_words / seconds,
                            "loss": window.loss / max(window.pairs, 1), "alpha": alpha, "time": time.time()})

    def evaluate(self) -> dict:
        """Benchmarks of the servers' input vectors (every worker has finished: ``mode.finish``); a
        benchmark that cannot score gives null figures and a WARNING (``evaluate_vectors``), never an
        error: the job has trained and written its checkpoint."""
        vecs = self.client.pull(self.cfg.input_table, self.keys_in, init_missing=True)
        res = evaluate_vectors(self.vocab.words, vecs, self.cfg.eval_data_dir)
        log.info("evaluation: analogy %s (%s evaluated, %s skipped), WordSim-353 %s, SimLex-999 %s",
                 _fig(res["analogy_accuracy"]), res["analogy_evaluated"], res["analogy_skipped"],
                 _fig(res["wordsim353_spearman"]), _fig(res["simlex999_spearman"]))
        return res


def _fig(x) -> str:
    return "null" if x is None else f"{x:.4f}"


def run(ctx) -> dict:
    """Worker entry point (``engine.programs`` contract)."""
    return Word2VecTrainer(ctx).run()
