"""Single-process reference training of Word2Vec SGNS: whole in-memory tables (local id = word id), Hogwild
threads running the nogil kernels of :class:`models.word2vec.SkipGramNS`, as gensim's workers do. It
defines the quality and speed the parameter-server trainer must reproduce.

Input is a corpus converted by ``streaming.text.convert_text`` (``load_corpus``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from .errors import ModelConfigError
from .word2vec import SGStats, SkipGramNS, Vocab, Word2VecParams, batch_arrays, new_state

__all__ = ["TokenCorpus", "load_corpus", "job_bounds", "train_reference", "ReferenceResult"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TokenCorpus:
    """A converted corpus in memory: ``tokens : uint32[n]``, ``offsets : int64[d + 1]``,
    ``raw_len : int64[d]`` (tokens per document before the OOV drop)."""

    tokens: np.ndarray
    offsets: np.ndarray
    raw_len: np.ndarray

    @property
    def raw_words(self) -> int:
        return int(self.raw_len.sum())


def load_corpus(paths, max_raw_words: int | None = None) -> TokenCorpus:
    """Read converted corpus parts (``streaming.text``) into memory.

    Parameters
    ----------
    paths : str, PathLike or list of them
        A conversion directory (its ``corpus/`` parts are read in order) or part files.
    max_raw_words : int, optional
        Stop after the first documents holding at least this many raw tokens.
    """
    from streaming.text import corpus_files  # streaming and models are siblings; import on use

    if isinstance(paths, (str, Path)):
        paths = corpus_files(paths) if Path(paths).is_dir() else [paths]
    toks, lens, raws, seen = [], [], [], 0
    for path in paths:
        with pa.OSFile(str(path), "r") as mm:      # read, not mapped (no SIGBUS on a cut file)
            for rb in pa.ipc.open_stream(mm):
                t, offs, _ = batch_arrays(rb)
                toks.append(t.copy())
                lens.append(np.diff(offs))
                raws.append(rb.column("raw_tokens").to_numpy().astype(np.int64))
                seen += int(raws[-1].sum())
                if max_raw_words is not None and seen >= max_raw_words:
                    break
        if max_raw_words is not None and seen >= max_raw_words:
            break
    lens_a = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    raw = np.concatenate(raws) if raws else np.zeros(0, np.int64)
    if max_raw_words is not None and len(raw):
        keep = int(np.searchsorted(np.cumsum(raw), max_raw_words)) + 1
        lens_a, raw = lens_a[:keep], raw[:keep]
    offsets = np.zeros(len(lens_a) + 1, np.int64)
    np.cumsum(lens_a, out=offsets[1:])
    tokens = np.concatenate(toks)[:offsets[-1]] if toks else np.zeros(0, np.uint32)
    return TokenCorpus(tokens.astype(np.uint32, copy=False), offsets, raw)


def job_bounds(raw_len: np.ndarray, batch_words: int) -> np.ndarray:
    """Document boundaries ``int64[J + 1]`` of gensim's jobs over documents of ``raw_len : int[d]`` raw
    words: add a document while the job's raw words stay <= ``batch_words``, else start a new job with it
    (a longer document is a job alone)."""
    bounds, size = [0], 0
    for d, n in enumerate(raw_len.tolist()):
        if d > bounds[-1] and size + n > batch_words:
            bounds.append(d)
            size = 0
        size += n
    if bounds[-1] != len(raw_len):
        bounds.append(len(raw_len))
    return np.asarray(bounds, np.int64)


_jobs = job_bounds   # former private name


@dataclasses.dataclass
class ReferenceResult:
    """Output of ``train_reference``: ``syn0``, ``syn1neg : float32[V, dim]``, summed ``stats``, and
    ``seconds`` of training (excluding set-up)."""

    syn0: np.ndarray
    syn1neg: np.ndarray
    stats: SGStats
    seconds: float

    @property
    def words_per_s(self) -> float:
        return self.stats.raw_words / self.seconds if self.seconds > 0 else 0.0

    @property
    def effective_words_per_s(self) -> float:
        return self.stats.effective_words / self.seconds if self.seconds > 0 else 0.0


def train_reference(corpus: TokenCorpus, vocab: Vocab, params: Word2VecParams = Word2VecParams(), *,
                    threads: int = 2, report_every_s: float = 5.0) -> ReferenceResult:
    """Single-process SGNS training on whole in-memory tables (no parameter server).

    Jobs of about ``params.batch_words`` raw words are handed to ``threads`` Hogwild threads, each running
    the nogil kernels (``prepare`` then ``train`` with local id = word id). Job ``k`` of epoch ``e`` uses
    random state ``new_state(seed, e, k)`` and a learning rate moving linearly from
    ``alpha_at(words before it / planned)`` to ``alpha_at(words through it / planned)``, where planned =
    ``epochs * corpus.raw_words``; so with ``threads=1`` a run is a pure function of its inputs.

    Returns
    -------
    ReferenceResult
    """
    if threads < 1:
        raise ModelConfigError(f"threads: expected an int >= 1, got {threads}")
    sg = SkipGramNS(vocab, params)
    V, dim = len(vocab), params.dim
    syn0 = sg.init_input_vectors(np.arange(V, dtype=np.uint64))
    syn1neg = np.zeros((V, dim), np.float32)
    bounds = job_bounds(corpus.raw_len, params.batch_words)
    raw_cum = np.concatenate([[0], np.cumsum(corpus.raw_len)])
    planned = max(params.epochs * corpus.raw_words, 1)
    n_jobs = len(bounds) - 1
    total = [SGStats() for _ in range(threads)]
    counter = itertools.count()
    errors: list = []

    def run(tid):
        work = np.empty(dim, np.float32)
        try:
            while True:
                k = next(counter)
                if k >= params.epochs * n_jobs:
                    return
                e, j = divmod(k, n_jobs)
                d0, d1 = bounds[j], bounds[j + 1]
                offs = corpus.offsets[d0:d1 + 1]
                toks = corpus.tokens[offs[0]:offs[-1]]
                done0 = e * corpus.raw_words + raw_cum[d0]
                done1 = e * corpus.raw_words + raw_cum[d1]
                batch = sg.prepare(toks, offs - offs[0], new_state(params.seed, e, j))
                st = sg.train(batch, batch.words, batch.words, batch.negs, syn0, syn1neg,
                              sg.alpha_at(done0 / planned), sg.alpha_at(done1 / planned), work)
                st.raw_words = int(raw_cum[d1] - raw_cum[d0])
                total[tid] = total[tid] + st
        except BaseException as ex:  # surfaced in the caller's thread
            errors.append(ex)

    # compile outside the timed region
    sg.train(sg.prepare(np.zeros(0, np.uint32), np.zeros(1, np.int64), new_state(0)),
             np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint32), syn0, syn1neg, 0.0)
    t0 = time.perf_counter()
    workers = [threading.Thread(target=run, args=(t,), name=f"w2v-{t}", daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    last = t0
    for w in workers:
        while w.is_alive():
            w.join(timeout=0.2)
            now = time.perf_counter()
            if now - last >= report_every_s:
                s = sum(total, SGStats())
                log.info("progress %.1f%%: %.0f words/s, %.0f effective words/s, loss/pair %.4f",
                         100.0 * s.raw_words / planned, s.raw_words / (now - t0),
                         s.effective_words / (now - t0), s.loss / max(s.pairs, 1))
                last = now
    if errors:
        raise errors[0]
    seconds = time.perf_counter() - t0
    stats = sum(total, SGStats())
    log.info("trained %d raw / %d effective words in %.1f s: %.0f words/s, %.0f effective words/s",
             stats.raw_words, stats.effective_words, seconds, stats.raw_words / seconds,
             stats.effective_words / seconds)
    return ReferenceResult(syn0, syn1neg, stats, seconds)
