"""Word2Vec SGNS kernel benchmark: our single-process reference trainer vs gensim in the same run.

Prints one JSON object per measurement, each with a ``bench`` field:

* ``w2v_convert``: text → Arrow conversion time and tokens/s;
* ``w2v_train``: ``effective_words_per_s`` / ``words_per_s`` of ours and of gensim (``sg=1``, same
  settings, sentences held in memory for both) and ``ratio_vs_gensim`` (effective words/s);
* ``w2v_quality`` (with ``--quality-epochs N``): analogy accuracy, WordSim-353 and SimLex-999 after N
  epochs (ours, and gensim's with ``--gensim-quality``).

Not run by the tests. Usage::

    python bench/w2v_kernel_bench.py [--corpus ../shared/data/text/corpus.txt.gz] [--threads 2]
        [--epochs 1] [--max-words N] [--quality-epochs 5] [--gensim-quality] [--repeat 1] [--reconvert]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.word2vec import Vocab, Word2VecParams  # noqa: E402
from models.word2vec_reference import load_corpus, train_reference  # noqa: E402
from models.word2vec_eval import evaluate_all  # noqa: E402
from streaming.text import convert_text, text_arrow_is_current  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "text"


def emit(**kw):
    print(json.dumps(kw), flush=True)


def gensim_sentences(vocab: Vocab, corpus):
    """The converted corpus as lists of words (OOV already dropped: gensim would drop them the same way)."""
    words = np.array(vocab.words, dtype=object)
    toks = words[corpus.tokens]
    return [toks[a:b].tolist() for a, b in zip(corpus.offsets[:-1], corpus.offsets[1:])]


def run_gensim(sentences, vocab: Vocab, params: Word2VecParams, raw_words: int, threads: int):
    from gensim.models import Word2Vec

    m = Word2Vec(vector_size=params.dim, window=params.window, negative=params.negative, hs=0, sg=1,
                 sample=params.sample, min_count=1, workers=threads, seed=params.seed,
                 alpha=params.alpha, min_alpha=params.min_alpha)
    m.build_vocab_from_freq(dict(zip(vocab.words, vocab.counts.tolist())))
    t0 = time.perf_counter()
    eff, raw = m.train(sentences, total_examples=len(sentences), total_words=raw_words,
                       epochs=params.epochs)
    return m, eff, raw, time.perf_counter() - t0


def quality(words, vectors) -> dict:
    ev = evaluate_all(words, vectors, DATA)
    ev.pop("analogy_sections")
    return ev


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(DATA / "corpus.txt.gz"))
    ap.add_argument("--work-dir", default="/tmp/w2v_bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-words", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-gensim", action="store_true")
    ap.add_argument("--quality-epochs", type=int, default=0)
    ap.add_argument("--gensim-quality", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reconvert", action="store_true", help="convert even when the Arrow form is current")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    if args.reconvert or not text_arrow_is_current(args.corpus, args.work_dir, min_count=5):
        t0 = time.perf_counter()
        rep = convert_text(args.corpus, args.work_dir, min_count=5)
        sec = time.perf_counter() - t0
        emit(bench="w2v_convert", seconds=round(sec, 3), tokens=rep.total_tokens,
             tokens_per_s=round(rep.total_tokens / sec), vocab_size=rep.vocab_size)
    vocab = Vocab.from_arrow(args.work_dir)
    corpus = load_corpus(args.work_dir, max_raw_words=args.max_words)
    params = Word2VecParams(dim=100, window=5, negative=5, sample=1e-3, epochs=args.epochs, seed=args.seed)
    try:
        import gensim  # noqa: F401
        have_gensim = not args.no_gensim
    except ImportError:
        have_gensim = False
    sentences = gensim_sentences(vocab, corpus) if have_gensim else None

    for r in range(args.repeat):
        ours = train_reference(corpus, vocab, params, threads=args.threads)
        rec = dict(bench="w2v_train", repeat=r, threads=args.threads, epochs=args.epochs,
                   raw_words=ours.stats.raw_words, effective_words_per_s=round(ours.effective_words_per_s),
                   words_per_s=round(ours.words_per_s), seconds=round(ours.seconds, 2))
        if have_gensim:
            _, eff, raw, sec = run_gensim(sentences, vocab, params, corpus.raw_words, args.threads)
            rec.update(gensim_effective_words_per_s=round(eff / sec), gensim_words_per_s=round(raw / sec),
                       gensim_seconds=round(sec, 2),
                       ratio_vs_gensim=round(ours.effective_words_per_s / (eff / sec), 3))
        emit(**rec)

    if args.quality_epochs:
        qp = Word2VecParams(dim=100, window=5, negative=5, sample=1e-3, epochs=args.quality_epochs,
                            seed=args.seed)
        ours = train_reference(corpus, vocab, qp, threads=args.threads)
        emit(bench="w2v_quality", model="ours", epochs=args.quality_epochs, seconds=round(ours.seconds, 1),
             effective_words_per_s=round(ours.effective_words_per_s), **quality(vocab.words, ours.syn0))
        if have_gensim and args.gensim_quality:
            m, eff, raw, sec = run_gensim(sentences, vocab, qp, corpus.raw_words, args.threads)
            emit(bench="w2v_quality", model="gensim", epochs=args.quality_epochs, seconds=round(sec, 1),
                 effective_words_per_s=round(eff / sec), **quality(m.wv.index_to_key, m.wv.vectors))


if __name__ == "__main__":
    main()
