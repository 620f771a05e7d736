"""Word-vector evaluation with gensim's protocols: analogies (``KeyedVectors.evaluate_word_analogies``) and
word-pair similarity (``KeyedVectors.evaluate_word_pairs``), computed over arrays in float32 batches.

Analogies (Mikolov et al. 2013, "Efficient Estimation of Word Representations in Vector Space"): a line
``a b c d`` of ``questions-words.txt`` asks for ``d`` given ``a : b :: c : ?``. The prediction is 3CosAdd:
the word among the ``restrict_vocab`` most frequent maximizing ``cos(x, b̂ + ĉ - â)`` (vectors
unit-normalized), excluding ``a``, ``b`` and ``c`` themselves (so the four words are distinct). With
``case_insensitive`` every word is upper-cased and a word stands for the first (most frequent) vocabulary
entry with that upper-case form. A question with any of its four words outside the first
``restrict_vocab`` words is skipped and counted. Accuracy = correct / evaluated.

Word pairs: for each ``word1 <tab> word2 <tab> score`` line (``#`` lines are comments), the model's score
is the cosine of the two vectors; pairs with a word outside ``restrict_vocab`` are skipped and counted.
The figure is the Spearman rank correlation (average ranks for ties) between human and model scores.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from .errors import ModelInputError

__all__ = ["evaluate_analogies", "evaluate_word_pairs", "evaluate_all", "spearman", "rankdata"]

log = logging.getLogger(__name__)


def _ok_vocab(words, restrict_vocab: int, case_insensitive: bool) -> dict:
    """``key → index`` over the first ``restrict_vocab`` words; the first word with a key wins."""
    ok = {}
    for i, w in enumerate(words[:restrict_vocab]):
        ok.setdefault(w.upper() if case_insensitive else w, i)
    return ok


def _unit(vectors: np.ndarray) -> np.ndarray:
    v = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    norms[norms == 0] = 1
    return v / norms


def evaluate_analogies(words, vectors, path, *, restrict_vocab: int = 300_000, case_insensitive: bool = True,
                       chunk: int = 256) -> dict:
    """Analogy accuracy with 3CosAdd (the module docstring gives the protocol).

    Parameters
    ----------
    words : sequence of str, length V
        Sorted by descending frequency.
    vectors : float[V, dim]
    path : str or PathLike
        ``questions-words.txt`` format: ``: section`` lines, then ``a b c d`` lines.
    restrict_vocab : int
    case_insensitive : bool
    chunk : int
        Questions scored per matrix product.

    Returns
    -------
    dict
        ``accuracy`` (fraction, 0 when nothing was evaluated), ``correct``, ``evaluated``, ``skipped``
        (questions with a word outside ``restrict_vocab``), ``invalid`` (lines without 4 words), and
        ``sections``: a list of ``{"section", "correct", "evaluated", "accuracy"}`` in file order.

    Raises
    ------
    ModelInputError
        If a question precedes the first section header.
    """
    ok = _ok_vocab(words, restrict_vocab, case_insensitive)
    n_ok = min(len(words), restrict_vocab)
    names, quads, sec_of = [], [], []
    skipped = invalid = 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f):
            if line.startswith(": "):
                names.append(line.lstrip(": ").strip())
                continue
            if not names:
                raise ModelInputError(f"{path}:{line_no + 1}: expected a ': section' header before questions")
            parts = [w.upper() if case_insensitive else w for w in line.split()]
            if len(parts) != 4:
                invalid += 1
                continue
            idx = [ok.get(w) for w in parts]
            if any(i is None for i in idx):
                skipped += 1
                continue
            quads.append(idx)
            sec_of.append(len(names) - 1)
    q = np.asarray(quads, dtype=np.int64).reshape(-1, 4)
    sec_of = np.asarray(sec_of, dtype=np.int64)
    correct = np.zeros(len(q), bool)
    if len(q):
        unit = _unit(np.asarray(vectors)[:n_ok])
        # canonical index of every candidate's key: excluding canon in {a, b, c} drops their case variants
        canon = np.array([ok[w.upper() if case_insensitive else w] for w in words[:n_ok]], np.int64)
        variants = np.flatnonzero(canon != np.arange(n_ok))
        for s in range(0, len(q), chunk):
            qq = q[s:s + chunk]
            target = unit[qq[:, 1]] + unit[qq[:, 2]] - unit[qq[:, 0]]
            target /= np.maximum(np.linalg.norm(target, axis=1, keepdims=True), np.float32(1e-30))
            scores = target @ unit.T
            rows = np.arange(len(qq))
            for col in range(3):
                scores[rows, qq[:, col]] = -np.inf
            for k in variants:  # only with case variants in the vocabulary
                hit = np.any(qq[:, :3] == canon[k], axis=1)
                scores[hit, k] = -np.inf
            pred = np.argmax(scores, axis=1)
            correct[s:s + chunk] = canon[pred] == qq[:, 3]
    sections = []
    for j, name in enumerate(names):
        m = sec_of == j
        n_sec, c_sec = int(m.sum()), int(correct[m].sum())
        sections.append({"section": name, "correct": c_sec, "evaluated": n_sec,
                         "accuracy": c_sec / n_sec if n_sec else 0.0})
        log.info("%s: %.1f%% (%d/%d)", name, 100.0 * c_sec / max(n_sec, 1), c_sec, n_sec)
    n_eval, n_corr = len(q), int(correct.sum())
    acc = n_corr / n_eval if n_eval else 0.0
    log.info("analogy accuracy %.4f (%d/%d), %d questions skipped (word outside the top %d)",
             acc, n_corr, n_eval, skipped, restrict_vocab)
    return {"accuracy": acc, "correct": n_corr, "evaluated": n_eval, "skipped": skipped,
            "invalid": invalid, "sections": sections}


def rankdata(x) -> np.ndarray:
    """Ranks ``float64[n]`` starting at 1, ties given their average rank (scipy's ``method="average"``)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    boundaries = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1], True])
    ranks = np.empty(len(x), np.float64)
    for lo, hi in zip(boundaries[:-1], boundaries[1:]):
        ranks[order[lo:hi]] = (lo + 1 + hi) / 2.0
    return ranks


def spearman(x, y) -> float:
    """Spearman rank correlation of two samples: Pearson's r of their average ranks; NaN if either is
    constant or there are fewer than 2 points."""
    if len(x) < 2:
        return float("nan")
    rx, ry = rankdata(x), rankdata(y)
    rx -= rx.mean()
    ry -= ry.mean()
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else float("nan")


def evaluate_word_pairs(words, vectors, path, *, restrict_vocab: int = 300_000, delimiter: str = "\t",
                        case_insensitive: bool = True) -> dict:
    """Spearman correlation between human similarity scores and vector cosines.

    Parameters
    ----------
    words : sequence of str, length V
    vectors : float[V, dim]
    path : str or PathLike
        Lines ``word1<delimiter>word2<delimiter>score``; lines starting with ``#`` are skipped.

    Returns
    -------
    dict
        ``spearman``, ``pairs`` (evaluated), ``skipped`` (a word outside ``restrict_vocab``), ``invalid``
        (lines not of 3 fields or with a non-numeric score).

    Raises
    ------
    ModelInputError
        If no pair could be evaluated.
    """
    ok = _ok_vocab(words, restrict_vocab, case_insensitive)
    gold, ia, ib = [], [], []
    skipped = invalid = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line or line.startswith("#"):
                continue
            parts = line.split(delimiter)
            if len(parts) != 3:
                invalid += 1
                continue
            a, b = (w.upper() if case_insensitive else w for w in parts[:2])
            try:
                sim = float(parts[2])
            except ValueError:
                invalid += 1
                continue
            if a not in ok or b not in ok:
                skipped += 1
                continue
            gold.append(sim)
            ia.append(ok[a])
            ib.append(ok[b])
    if not gold:
        raise ModelInputError(f"{path}: no pair could be evaluated ({skipped} with out-of-vocabulary words, "
                              f"{invalid} malformed lines)")
    unit = _unit(np.asarray(vectors)[np.r_[ia, ib]])
    n = len(ia)
    model = np.einsum("ij,ij->i", unit[:n], unit[n:])
    rho = spearman(gold, model)
    log.info("%s: Spearman %.4f over %d pairs, %d skipped", Path(path).name, rho, n, skipped)
    return {"spearman": rho, "pairs": n, "skipped": skipped, "invalid": invalid}


def evaluate_all(words, vectors, data_dir, *, restrict_vocab: int = 300_000) -> dict:
    """All three benchmarks from ``data_dir`` (``questions-words.txt``, ``wordsim353.tsv``,
    ``simlex999.txt``), as one flat dict for the final JSON line.

    Returns
    -------
    dict
        ``analogy_accuracy``, ``analogy_correct``, ``analogy_evaluated``, ``analogy_skipped``,
        ``analogy_sections`` (list of dicts), ``wordsim353_spearman``, ``wordsim353_pairs``,
        ``wordsim353_skipped``, ``simlex999_spearman``, ``simlex999_pairs``, ``simlex999_skipped``.
    """
    d = Path(data_dir)
    an = evaluate_analogies(words, vectors, d / "questions-words.txt", restrict_vocab=restrict_vocab)
    out = {"analogy_accuracy": an["accuracy"], "analogy_correct": an["correct"],
           "analogy_evaluated": an["evaluated"], "analogy_skipped": an["skipped"],
           "analogy_sections": an["sections"]}
    for name, fname in (("wordsim353", "wordsim353.tsv"), ("simlex999", "simlex999.txt")):
        r = evaluate_word_pairs(words, vectors, d / fname, restrict_vocab=restrict_vocab)
        out[f"{name}_spearman"] = r["spearman"]
        out[f"{name}_pairs"] = r["pairs"]
        out[f"{name}_skipped"] = r["skipped"]
    return out
