"""``model.eval_after_train`` (default true) never fails a job that has trained.

A missing benchmark file of ``model.eval_data_dir`` is a config error before anything starts (exit 2,
one line naming the key and the file); it crashed rank 0 after training, and the supervisor restarted
the whole job ``cluster.max_restarts`` times before exiting 1 without a final line. A benchmark that
cannot score (none of its questions or pairs in the vocabulary) is a WARNING and null figures
(``evaluate_vectors``); the rest are scored as before (``evaluate_all``'s figures).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from engine.cli import main
from engine.config import load_config
from engine.errors import ConfigError
from engine.programs.word2vec import prepare_data
from models.word2vec_eval import evaluate_all

REPO = Path(__file__).resolve().parents[2]
W2V = str(REPO / "configs" / "word2vec.yaml")
WORDS = [f"w{i}" for i in range(30)]
EVAL_FILES = ("questions-words.txt", "wordsim353.tsv", "simlex999.txt")


def _bench(d: Path, *, oov_pairs: bool = False, oov_questions: bool = False) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    a, b = ("zz", "yy") if oov_pairs else ("w1", "w2")
    pairs = f"{a}\t{b}\t3.0\nw3\tw4\t1.0\nw5\tw6\t2.0\n" if not oov_pairs else "zz\tyy\t1.0\nxx\tw1\t2.0\n"
    (d / "wordsim353.tsv").write_text("# word1\tword2\tscore\n" + pairs)
    (d / "simlex999.txt").write_text("word1\tword2\tSimLex999\nw1\tw2\t3.0\nw3\tw4\t1.0\nw7\tw8\t2.0\n")
    q = "zz yy xx ww\n" if oov_questions else "w1 w2 w3 w4\nw5 w6 w7 w8\n"
    (d / "questions-words.txt").write_text(": s\n" + q)
    return d


def _sets(tmp_path: Path, **extra) -> list[str]:
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(WORDS) + "\n")
    sets = {"model.corpus": corpus, "model.arrow_dir": tmp_path / "arrow", "model.min_count": 1,
            "model.metrics_dir": tmp_path / "metrics", "checkpoint.root": tmp_path / "ckpt", **extra}
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


@pytest.mark.parametrize("missing", EVAL_FILES)
def test_a_missing_benchmark_file_is_a_config_error_before_anything_starts(tmp_path, capsys, missing):
    ev = _bench(tmp_path / "ev")
    (ev / missing).unlink()
    assert main(["train", W2V, "--run-dir", str(tmp_path / "run"),
                 *_sets(tmp_path, **{"model.eval_data_dir": ev})]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"engine train: config error: model.eval_data_dir: {ev / missing} not found "
                              "(model.eval_after_train is true"), err[-1]
    assert not (tmp_path / "run").exists() and not (tmp_path / "metrics").exists()   # nothing started


def test_the_check_follows_eval_after_train(tmp_path):
    from engine.programs.word2vec import check_eval_files
    cfg = load_config(W2V, _sets(tmp_path, **{"model.eval_data_dir": tmp_path / "none"})[1::2])
    p = prepare_data(cfg.model.params)                  # converts; paths made absolute
    with pytest.raises(ConfigError, match=r"model.eval_data_dir: .*/none/questions-words.txt not found"):
        check_eval_files(p)
    check_eval_files(dataclasses.replace(p, eval_after_train=False))         # off: nothing is read
    with pytest.raises(ConfigError, match=r"model.eval_data_dir: empty while model.eval_after_train is true"):
        check_eval_files(dataclasses.replace(p, eval_data_dir=""))
    check_eval_files(dataclasses.replace(p, eval_data_dir=str(_bench(tmp_path / "ev"))))


def test_benchmarks_that_cannot_score_give_null_figures_and_warnings(tmp_path, caplog):
    from engine.programs.word2vec import evaluate_vectors
    vecs = np.random.default_rng(0).normal(size=(len(WORDS), 5)).astype(np.float32)
    good = _bench(tmp_path / "good")
    assert evaluate_vectors(WORDS, vecs, good) == evaluate_all(WORDS, vecs, good)   # same figures when all score
    bad = _bench(tmp_path / "bad", oov_pairs=True, oov_questions=True)
    with caplog.at_level(logging.WARNING, logger="engine.programs.word2vec"):
        res = evaluate_vectors(WORDS, vecs, bad)
    assert res["analogy_accuracy"] is None and res["analogy_evaluated"] == 0 and res["analogy_skipped"] == 1
    assert res["wordsim353_spearman"] is None and res["wordsim353_pairs"] is None
    assert res["simlex999_pairs"] == 3 and res["simlex999_spearman"] is not None      # this one scores
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no question has its four words in the vocabulary" in m for m in warned)
    assert any("wordsim353.tsv: no pair could be evaluated" in m and "the wordsim353 figures are null" in m
               for m in warned)
    (bad / "simlex999.txt").unlink()                       # gone after prepare checked it: null, not a crash
    assert evaluate_vectors(WORDS, vecs, bad)["simlex999_spearman"] is None
    json.dumps(res)                                        # the final line carries them as null
