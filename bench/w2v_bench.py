"""Word2Vec through the parameter server vs gensim, measured in the same run on the same machine and data.

Prints one JSON object per measurement, each with a ``bench`` field:

* ``w2v_ps_train``: ``engine train configs/word2vec.yaml`` (1 server + 2 workers, GEO; issue 5's settings:
  dim 100, window 5, negative 5, min_count 5, sample 1e-3) — ``effective_words_per_s`` and
  ``words_per_s`` from its final line (all workers' words / the longest worker's training time: reading,
  training and GEO exchanges included; process start-up, vocabulary loading and evaluation excluded),
  ``wall_seconds`` of the whole command, and the evaluation figures (analogy, WordSim-353, SimLex-999);
* ``w2v_gensim_train`` (when gensim is installed): gensim 4 ``Word2Vec(sg=1, workers=2, seed=1)`` with
  the same settings and vocabulary on the same converted sentences held in memory; effective words/s as
  its ``train()`` reports them, and the same evaluation;
* ``w2v_ratio``: ``ratio_vs_gensim`` = ours / gensim's effective words/s, and the acceptance checks
  (analogy >= 0.20, WordSim >= 0.65, SimLex >= 0.35, ratio >= 1.0).

Effective words are the words trained after the out-of-vocabulary drop and subsampling, counted the
same way by both. Not run by the tests. Usage::

    python bench/w2v_bench.py [--quick] [--epochs 5] [--no-gensim] [--set KEY=VALUE ...]

``--quick`` trains one epoch (the accuracy figures are then below the 5-epoch acceptance).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.word2vec import Vocab, Word2VecParams  # noqa: E402
from models.word2vec_eval import evaluate_all  # noqa: E402
from models.word2vec_reference import load_corpus  # noqa: E402
from streaming.text import convert_text, text_arrow_is_current  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "text"
FIGURES = ("analogy_accuracy", "analogy_evaluated", "analogy_skipped", "wordsim353_spearman", "simlex999_spearman")
log = logging.getLogger("w2v_bench")


def emit(**kw):
    print(json.dumps(kw), flush=True)


def run_ours(args, epochs: int, tmp: str) -> dict:
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs" / "word2vec.yaml"),
           "--run-dir", os.path.join(tmp, "run"), "--set", f"model.epochs={epochs}",
           "--set", f"model.corpus={args.corpus}", "--set", f"model.arrow_dir={args.arrow_dir}",
           "--set", f"checkpoint.root={os.path.join(tmp, 'ckpt')}",
           "--set", f"model.metrics_dir={os.path.join(tmp, 'metrics')}", "--set", f"model.eval_data_dir={DATA}"]
    for s in args.set:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"engine train failed with exit code {proc.returncode}")
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    final["wall_seconds"] = wall
    return final


def gensim_sentences(vocab: Vocab, corpus):
    import numpy as np
    words = np.array(vocab.words, dtype=object)
    toks = words[corpus.tokens]
    return [toks[a:b].tolist() for a, b in zip(corpus.offsets[:-1], corpus.offsets[1:])]


def run_gensim(arrow_dir: str, params: Word2VecParams, threads: int) -> dict:
    from gensim.models import Word2Vec
    vocab = Vocab.from_arrow(arrow_dir)
    corpus = load_corpus(arrow_dir)
    sentences = gensim_sentences(vocab, corpus)
    m = Word2Vec(vector_size=params.dim, window=params.window, negative=params.negative, hs=0, sg=1,
                 sample=params.sample, min_count=1, workers=threads, seed=params.seed, alpha=params.alpha,
                 min_alpha=params.min_alpha)
    m.build_vocab_from_freq(dict(zip(vocab.words, vocab.counts.tolist())))
    t0 = time.perf_counter()
    eff, raw = m.train(sentences, total_examples=len(sentences), total_words=int(len(corpus.tokens)),
                       epochs=params.epochs)
    secs = time.perf_counter() - t0
    import numpy as np
    vecs = np.stack([m.wv[w] for w in vocab.words])
    res = evaluate_all(vocab.words, vecs, DATA)
    return {"effective_words_per_s": eff / secs, "words_per_s": raw / secs, "train_seconds": secs,
            "effective_words": eff, "words": raw, **{k: res[k] for k in FIGURES}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(DATA / "corpus.txt.gz"))
    ap.add_argument("--arrow-dir", default=str(REPO / "runs" / "cache" / "text-corpus"))
    ap.add_argument("--quick", action="store_true", help="one epoch")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--gensim-workers", type=int, default=2)
    ap.add_argument("--no-gensim", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine train override")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    epochs = 1 if args.quick else args.epochs
    args.corpus, args.arrow_dir = os.path.abspath(args.corpus), os.path.abspath(args.arrow_dir)
    if not text_arrow_is_current(args.corpus, args.arrow_dir, min_count=5):
        t0 = time.perf_counter()
        r = convert_text(args.corpus, args.arrow_dir, min_count=5)
        emit(bench="w2v_convert", tokens=r.total_tokens, vocab_size=r.vocab_size,
             seconds=time.perf_counter() - t0, tokens_per_s=r.tokens_per_s)
    with tempfile.TemporaryDirectory(prefix="w2v-bench-") as tmp:
        ours = run_ours(args, epochs, tmp)
    emit(bench="w2v_ps_train", mode=ours["mode"], servers=1, workers=2, epochs=epochs,
         effective_words_per_s=ours["effective_words_per_s"], words_per_s=ours["words_per_s"],
         train_seconds=ours["train_seconds"], wall_seconds=ours["wall_seconds"],
         effective_words=ours["effective_words"], words=ours["words"], loss=ours["loss"],
         **{k: ours.get(k) for k in FIGURES})
    gen = None
    if not args.no_gensim:
        try:
            import gensim  # noqa: F401
        except ImportError:
            log.warning("gensim is not installed: no reference measurement (pip install gensim)")
        else:
            gen = run_gensim(args.arrow_dir, Word2VecParams(epochs=epochs), args.gensim_workers)
            emit(bench="w2v_gensim_train", workers=args.gensim_workers, epochs=epochs, **gen)
    ratio = ours["effective_words_per_s"] / gen["effective_words_per_s"] if gen else None
    checks = {"analogy_ge_0.20": (ours.get("analogy_accuracy") or 0) >= 0.20,
              "wordsim_ge_0.65": (ours.get("wordsim353_spearman") or 0) >= 0.65,
              "simlex_ge_0.35": (ours.get("simlex999_spearman") or 0) >= 0.35,
              "ratio_ge_1.0": None if ratio is None else ratio >= 1.0}
    emit(bench="w2v_ratio", epochs=epochs, ratio_vs_gensim=ratio,
         ours_effective_words_per_s=ours["effective_words_per_s"],
         gensim_effective_words_per_s=gen["effective_words_per_s"] if gen else None,
         acceptance=checks, load_avg_1m=os.getloadavg()[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
