"""Word2Vec skip-gram with negative sampling (SGNS) over arrays: the vocabulary tables, the per-batch steps a
parameter-server worker calls, and a single-process reference trainer.

Per batch of documents (what a GEO worker does; ``sg = SkipGramNS(vocab, params)``)::

    tokens, offsets, raw = batch_arrays(record_batch)   # Arrow rows of streaming.text output
    batch = sg.prepare(tokens, offsets, state)     # subsample, reduced windows, negatives (global ids)
    local = sg.remap(batch, scratch)               # unique ids to pull + the batch in local ids
    syn0_l = pull(input_table, local.in_ids)        # float32[u, dim]
    syn1_l = pull(output_table, local.out_ids)      # float32[v, dim]; out_ids[:u] == in_ids
    stats = sg.train(batch, local.words_in, local.words_out, local.negs_out, syn0_l, syn1_l,
                     alpha_start, alpha_end)        # in-place SGD on the local rows
    # GEO: delta = syn0_l - pulled values, etc.; alpha from sg.alpha_at(words_done / planned_words)

``models.word2vec_reference.train_reference`` runs the same steps on whole in-memory tables (local id = word
id, no remap) with Hogwild threads, as gensim does; it defines the quality and speed the distributed trainer
must reproduce.

Sources: Mikolov et al. 2013, "Distributed Representations of Words and Phrases and their
Compositionality" (subsampling, negative sampling with unigram^0.75); gensim 4.4 ``word2vec.py`` /
``word2vec_inner.pyx`` (the exact formulas: ``sample_int``, ``make_cum_table``, ``_get_next_alpha``).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from . import _w2v_kernels as K
from .errors import ModelConfigError, ModelInputError

__all__ = ["Vocab", "Word2VecParams", "SkipGramNS", "SGBatch", "LocalSGBatch", "SGStats", "new_state",
           "batch_arrays"]

log = logging.getLogger(__name__)


def batch_arrays(record_batch: pa.RecordBatch):
    """The documents of an Arrow record batch of the converted corpus (``streaming.text``) as kernel input.

    Parameters
    ----------
    record_batch : pyarrow.RecordBatch
        With ``tokens : list<uint32>`` and, optionally, ``raw_tokens : uint32``.

    Returns
    -------
    tokens : uint32[n]
    offsets : int64[d + 1]
        Starting at 0.
    raw_words : int
        Sum of ``raw_tokens`` (tokens before the OOV drop, what words/s counts), else ``n``.

    Raises
    ------
    ModelInputError
        If ``tokens`` is missing or not ``list<uint32>``.
    """
    if "tokens" not in record_batch.schema.names:
        raise ModelInputError(f"record batch: expected a 'tokens' column, got {record_batch.schema.names}")
    col = record_batch.column("tokens")
    if not pa.types.is_list(col.type) or col.type.value_type != pa.uint32():
        raise ModelInputError(f"tokens: expected list<uint32>, got {col.type}")
    offs = col.offsets.to_numpy().astype(np.int64)
    tokens = col.values.to_numpy(zero_copy_only=False)[offs[0]:offs[-1]].astype(np.uint32, copy=False)
    offs -= offs[0]
    raw = (int(pa.compute.sum(record_batch.column("raw_tokens")).as_py() or 0)
           if "raw_tokens" in record_batch.schema.names else len(tokens))
    return np.ascontiguousarray(tokens), offs, raw


def new_state(seed: int, *stream: int) -> np.ndarray:
    """A fresh LCG state ``uint64[1]`` for ``(seed, *stream)`` (e.g. ``(seed, worker, epoch, batch)``).

    Derived with SplitMix64, so distinct streams are unrelated and a batch's randomness does not depend
    on which thread or process runs it.
    """
    x = _splitmix64(int(seed))
    for s in stream:
        x = _splitmix64(x ^ _splitmix64(int(s)))
    return np.array([x & ((1 << 48) - 1)], np.uint64)


def _splitmix64(x: int) -> int:
    """SplitMix64 finalizer on Python ints (same as ``_w2v_kernels.splitmix64``)."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


@dataclasses.dataclass(frozen=True)
class Word2VecParams:
    """SGNS hyper-parameters (gensim's names and defaults, except ``sg=1``/``negative=5`` being implied).

    Attributes
    ----------
    dim : int
        Vector size.
    window : int
        Maximum distance between center and context; each center uses ``window - b``, ``b`` uniform in
        ``[0, window)``.
    negative : int
        Negatives per (center, context) pair, >= 1.
    sample : float
        Subsampling threshold (0 = off).
    alpha, min_alpha : float
        Learning rate at the start, and the floor it decays to linearly over the planned words.
    ns_exponent : float
        Exponent of the negative-sampling distribution (0.75).
    epochs : int
    seed : int
    batch_words : int
        Raw words per job (gensim's ``batch_words``); a document is never split across jobs.
    compute_loss : bool
    """

    dim: int = 100
    window: int = 5
    negative: int = 5
    sample: float = 1e-3
    alpha: float = 0.025
    min_alpha: float = 1e-4
    ns_exponent: float = 0.75
    epochs: int = 5
    seed: int = 1
    batch_words: int = 10_000
    compute_loss: bool = True

    def __post_init__(self):
        for name in ("dim", "window", "negative", "epochs", "batch_words"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ModelConfigError(f"{name}: expected an int >= 1, got {v!r}")
        if not self.sample >= 0:
            raise ModelConfigError(f"sample: expected a float >= 0, got {self.sample!r}")
        if not (self.alpha > 0 and 0 <= self.min_alpha <= self.alpha):
            raise ModelConfigError(f"alpha, min_alpha: expected alpha > 0 and 0 <= min_alpha <= alpha, "
                                   f"got {self.alpha!r}, {self.min_alpha!r}")


class Vocab:
    """Words and their corpus counts; word id = position (sorted by count desc as ``vocab.arrow``).

    Parameters
    ----------
    words : sequence of str, length V
    counts : int[V]
        Occurrences in the corpus (all >= 1).

    Raises
    ------
    ModelInputError
        If the lengths differ or a count is < 1.
    """

    def __init__(self, words, counts):
        self.words = list(words)
        self.counts = np.asarray(counts, dtype=np.uint64)
        if self.counts.shape != (len(self.words),):
            raise ModelInputError(f"counts: expected uint64[{len(self.words)}], got shape {self.counts.shape}")
        if len(self.counts) and int(self.counts.min()) < 1:
            raise ModelInputError("counts: expected every count >= 1, got a 0")
        self._index = None

    @classmethod
    def from_arrow(cls, path) -> "Vocab":
        """Load ``vocab.arrow`` written by ``streaming.text.convert_text`` (a file or its directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "vocab.arrow"
        with pa.OSFile(str(path), "r") as mm:   # read, not mapped: a file cut while read errs, no SIGBUS
            table = pa.ipc.open_stream(mm).read_all()
        return cls(table.column("word").to_pylist(), table.column("count").to_numpy())

    def __len__(self) -> int:
        return len(self.words)

    @property
    def total(self) -> int:
        """Sum of counts (gensim's ``retain_total``)."""
        return int(self.counts.sum())

    @property
    def index(self) -> dict:
        """``word → id``."""
        if self._index is None:
            self._index = {w: i for i, w in enumerate(self.words)}
        return self._index

    def keep_probabilities(self, sample: float) -> np.ndarray:
        """Probability of keeping each occurrence of each word, ``float64[V]``.

        gensim (``Word2Vec.prepare_vocab``), a variant of Mikolov et al. 2013's
        ``1 - sqrt(t / f)``: with ``T = sample * total`` (or ``int(sample * (3 + sqrt 5) / 2)`` when
        ``sample >= 1``), ``p(w) = min(1, (sqrt(c_w / T) + 1) * T / c_w)``; ``sample == 0`` keeps all.
        """
        c = self.counts.astype(np.float64)
        if not sample:
            return np.ones(len(c))
        t = sample * float(self.total) if sample < 1.0 else float(int(sample * (3 + np.sqrt(5)) / 2))
        with np.errstate(divide="ignore"):
            p = (np.sqrt(c / t) + 1) * (t / c)
        return np.minimum(p, 1.0)

    def sample_ints(self, sample: float) -> np.ndarray:
        """Keep thresholds ``uint32[V] = uint32(p(w) * (2**32 - 1))`` (gensim's ``sample_int``)."""
        return (self.keep_probabilities(sample) * (2**32 - 1)).astype(np.uint32)

    def cum_table(self, ns_exponent: float = 0.75, domain: int = 2**31 - 1) -> np.ndarray:
        """Cumulative negative-sampling table ``uint32[V]`` (gensim's ``make_cum_table``).

        ``cum[i] = round(sum_{k<=i} c_k**e / sum_k c_k**e * domain)``; drawing
        ``bisect_left(cum, r % cum[-1])`` for uniform ``r`` gives word ``i`` with probability
        ``c_i**e / sum c**e`` (Mikolov et al. 2013, e = 0.75).
        """
        if len(self) == 0:
            return np.zeros(0, np.uint32)
        cum = np.cumsum(self.counts.astype(np.float64) ** float(ns_exponent))
        return np.round(cum / cum[-1] * domain).astype(np.uint32)


@dataclasses.dataclass
class SGBatch:
    """A prepared batch (``SkipGramNS.prepare``), global word ids. Shapes as ``prepare_sg_batch``."""

    words: np.ndarray          # uint32[m]
    sent_offsets: np.ndarray   # int64[d + 1]
    reduced: np.ndarray        # int32[m]
    negs: np.ndarray           # uint32[p * negative]
    raw_words: int             # tokens in the batch before subsampling

    @property
    def effective_words(self) -> int:
        return len(self.words)


@dataclasses.dataclass
class LocalSGBatch:
    """The rows a batch needs and the batch in local ids (``SkipGramNS.remap``).

    ``in_ids : uint32[u]`` and ``out_ids : uint32[v]`` are the word ids to pull from the input and output
    tables (``out_ids[:u] == in_ids``); ``words_in``, ``words_out : int32[m]`` and ``negs_out : int32[q]``
    index rows of the pulled arrays (in that order).
    """

    in_ids: np.ndarray
    out_ids: np.ndarray
    words_in: np.ndarray
    words_out: np.ndarray
    negs_out: np.ndarray


@dataclasses.dataclass
class SGStats:
    """Counters of trained batches (summable with ``+``)."""

    raw_words: int = 0
    effective_words: int = 0
    pairs: int = 0
    loss: float = 0.0

    def __add__(self, o: "SGStats") -> "SGStats":
        return SGStats(self.raw_words + o.raw_words, self.effective_words + o.effective_words,
                       self.pairs + o.pairs, self.loss + o.loss)


class SkipGramNS:
    """The per-batch SGNS steps over arrays (``prepare → remap → train``); see the module docstring.

    Parameters
    ----------
    vocab : Vocab
    params : Word2VecParams

    Attributes
    ----------
    sample_int : uint32[V]
    cum_table : uint32[V]
    """

    def __init__(self, vocab: Vocab, params: Word2VecParams = Word2VecParams()):
        if len(vocab) == 0:
            raise ModelInputError("vocab: expected at least one word, got an empty vocabulary")
        self.vocab, self.params = vocab, params
        self.sample_int = vocab.sample_ints(params.sample)
        self.cum_table = vocab.cum_table(params.ns_exponent)
        self.neg_guide = K.make_guide(self.cum_table, K.GUIDE_SHIFT)

    def new_scratch(self) -> np.ndarray:
        """Per-thread ``int32[V]`` scratch of ``remap`` (all ``-1``)."""
        return np.full(len(self.vocab), -1, np.int32)

    def prepare(self, tokens, offsets, state) -> SGBatch:
        """Subsample and draw the batch's randomness (``_w2v_kernels.prepare_sg_batch``).

        Parameters
        ----------
        tokens : uint32[n]
            Word ids of the documents back to back.
        offsets : int64[d + 1]
            Document boundaries in ``tokens``.
        state : uint64[1]
            LCG state (``new_state``), advanced in place.

        Raises
        ------
        ModelInputError
            On a wrong dtype, bad offsets or a word id outside the vocabulary.
        """
        tokens = np.ascontiguousarray(tokens)
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if tokens.dtype != np.uint32 or tokens.ndim != 1:
            raise ModelInputError(f"tokens: expected uint32[n], got {tokens.dtype}{list(tokens.shape)}")
        if (offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(tokens)
                or np.any(np.diff(offsets) < 0)):
            raise ModelInputError(f"offsets: expected non-decreasing int64[d + 1] from 0 to {len(tokens)}")
        if len(tokens) and int(tokens.max()) >= len(self.vocab):
            raise ModelInputError(f"tokens: expected ids < {len(self.vocab)}, got {int(tokens.max())}")
        if state.dtype != np.uint64 or state.shape != (1,):
            raise ModelInputError(f"state: expected uint64[1], got {state.dtype}{list(state.shape)}")
        p = self.params
        words, sent, reduced, negs = K.prepare_sg_batch(tokens, offsets, self.sample_int, self.cum_table,
                                                        self.neg_guide, K.GUIDE_SHIFT, p.window,
                                                        p.negative, p.sample > 0, state)
        return SGBatch(words, sent, reduced, negs, len(tokens))

    def remap(self, batch: SGBatch, scratch: np.ndarray | None = None) -> LocalSGBatch:
        """Unique ids to pull and the batch in local ids (``_w2v_kernels.remap_sg_batch``)."""
        if scratch is None:
            scratch = self.new_scratch()
        return LocalSGBatch(*K.remap_sg_batch(batch.words, batch.negs, scratch))

    def train(self, batch: SGBatch, words_in, words_out, negs, syn0, syn1neg, alpha_start: float,
              alpha_end: float | None = None, work: np.ndarray | None = None) -> SGStats:
        """Run the SGNS updates of ``batch`` on ``syn0``/``syn1neg`` in place (``train_sg_batch``).

        Parameters
        ----------
        batch : SGBatch
        words_in, words_out : int[m]
            Rows of ``syn0`` / ``syn1neg`` of the batch's words (``local.words_in`` on pulled arrays, or
            ``batch.words`` itself on whole tables).
        negs : int[p * negative]
            Rows of ``syn1neg`` of the negatives (``local.negs_out`` or ``batch.negs``).
        syn0 : float32[n_in, dim], C-contiguous
        syn1neg : float32[n_out, dim], C-contiguous
        alpha_start, alpha_end : float
            Learning rate at the batch's first and after its last effective word (``alpha_end``
            defaults to ``alpha_start``).
        work : float32[dim], optional
            Scratch, to avoid an allocation per call.

        Raises
        ------
        ModelInputError
            If the tables are not C-contiguous float32 with ``dim`` columns.
        """
        dim = self.params.dim
        for name, a in (("syn0", syn0), ("syn1neg", syn1neg)):
            if a.dtype != np.float32 or a.ndim != 2 or a.shape[1] != dim or not a.flags.c_contiguous:
                raise ModelInputError(f"{name}: expected C-contiguous float32[n, {dim}], "
                                      f"got {a.dtype}{list(a.shape)}")
        if work is None:
            work = np.empty(dim, np.float32)
        p = self.params
        pairs, loss = K.train_sg_batch(words_in, words_out, batch.sent_offsets, batch.reduced, negs,
                                       syn0, syn1neg, p.window, p.negative, float(alpha_start),
                                       float(alpha_start if alpha_end is None else alpha_end),
                                       K.EXP_TABLE, K.LOG_TABLE, p.compute_loss, work)
        return SGStats(batch.raw_words, batch.effective_words, int(pairs), float(loss))

    def alpha_at(self, progress: float) -> float:
        """Learning rate after ``progress`` (fraction of all planned raw words, epochs included) of
        training: ``max(min_alpha, alpha - (alpha - min_alpha) * progress)`` (gensim ``_get_next_alpha``)."""
        p = self.params
        return max(p.min_alpha, p.alpha - (p.alpha - p.min_alpha) * progress)

    def init_input_vectors(self, ids) -> np.ndarray:
        """Initial input vectors ``float32[n, dim]`` of word ids ``ids``: uniform in
        ``[-0.5/dim, 0.5/dim)``, a pure function of ``(params.seed, id)``. Output vectors start at 0."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        return K.init_input_rows(ids, self.params.seed, np.empty((len(ids), self.params.dim), np.float32))
