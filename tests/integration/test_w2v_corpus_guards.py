"""``engine train`` of Word2Vec through real processes (1 server + 2 workers, a tiny corpus), then the
corpus changes under the run's ``model.arrow_dir``, as it does when the corpus file is edited (``engine
train`` re-converts it by itself).

* Benchmarks none of whose pairs or questions are in the vocabulary: the job ends 0 with its final line,
  the figures null, no restart (rank 0 crashed after training; the supervisor restarted the job
  ``cluster.max_restarts`` times and it exited 1 without a final line).
* The checkpoint records the conversion's fingerprint (``sources.train.vocab``).
* ``--resume`` on the re-converted corpus: exit 2, one error naming ``model.arrow_dir`` and what changed
  (it continued silently on the other corpus, every word id meaning another word); ``engine export
  --format word2vec``: exit 2 naming both fingerprints (it wrote every vector under another word).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from tests.unit.test_w2v_vocab_identity import _fingerprint as conversion_fingerprint

REPO = Path(__file__).resolve().parents[2]
DIM = 8


def _engine(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "engine", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.long   # make test-long (~45 s): the fingerprint rule is tests/unit/test_w2v_vocab_identity.py's
@pytest.mark.slow
def test_null_figures_then_a_changed_corpus_is_refused(tmp_path):
    rng = np.random.default_rng(3)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(" ".join(f"w{i}" for i in rng.integers(0, 80, 50)) + "\n" for _ in range(400)))
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "wordsim353.tsv").write_text("# word1\tword2\tscore\nzz\tyy\t1.0\n")
    (ev / "simlex999.txt").write_text("word1\tword2\tSimLex999\nzz\tyy\t1.0\n")
    (ev / "questions-words.txt").write_text(": s\nzz yy xx ww\n")
    arrow = tmp_path / "arrow"
    sets = [f"model.corpus={corpus}", f"model.arrow_dir={arrow}", "model.min_count=1",
            f"model.eval_data_dir={ev}", f"model.metrics_dir={tmp_path / 'metrics'}",
            f"checkpoint.root={tmp_path / 'ckpt'}", "model.epochs=1", f"model.dim={DIM}",
            f"tables.sparse.syn0.dim={DIM}", f"tables.sparse.syn0.init_range={0.5 / DIM}",
            f"tables.sparse.syn1neg.dim={DIM}", "cluster.warm_up=false", "model.batch_words=2000",
            "observability.tensorboard=false"]
    sets = [a for s in sets for a in ("--set", s)]
    cfg = REPO / "configs" / "word2vec.yaml"

    proc = _engine("train", cfg, "--run-dir", tmp_path / "run", *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert final["event"] == "final" and final["restarts"] == 0 and final["words"] == 400 * 50
    assert final["analogy_accuracy"] is None and final["analogy_evaluated"] == 0
    assert final["analogy_skipped"] == 1
    assert final["wordsim353_spearman"] is None and final["simlex999_spearman"] is None
    worker0 = (tmp_path / "run" / "worker-0.log").read_text()
    assert "WARNING engine.programs.word2vec: evaluation:" in worker0 and "figures are null" in worker0
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "word2vec")
    manifest = mgr.manifest(mgr.list()[-1].name)
    assert manifest["sources"]["train"]["vocab"] == conversion_fingerprint(arrow)
    was = conversion_fingerprint(arrow)

    # the corpus file is edited: `engine train` re-converts it; the resume is refused before training
    with corpus.open("a") as f:
        f.write("w1 w2 newword\n")
    proc = _engine("train", cfg, "--run-dir", tmp_path / "run2", *sets, "--resume")
    assert proc.returncode == 2, proc.stderr[-3000:]
    now = conversion_fingerprint(arrow)
    assert (now["vocab_words"], now["total_tokens"]) == (was["vocab_words"] + 1, was["total_tokens"] + 3)
    assert (f"config error: model.arrow_dir: {arrow} holds another corpus conversion than the one checkpoint "
            f"{final['checkpoint']} was trained on (vocab_words was {was['vocab_words']}, now "
            f"{now['vocab_words']};") in proc.stderr
    assert f"total_tokens was {was['total_tokens']}, now {now['total_tokens']}" in proc.stderr
    assert proc.stdout.strip() == "" or json.loads(proc.stdout.strip().splitlines()[-1]).get("event") != "final"

    proc = _engine("export", final["checkpoint"], tmp_path / "v.txt", "--format", "word2vec")
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(f"engine export: {arrow}/vocab.arrow: not the vocabulary {final['checkpoint']} was "
                          f"trained with ({now['vocab_bytes']} bytes, crc32 {now['vocab_crc32']}; the "
                          f"checkpoint's sources.train.vocab records {was['vocab_bytes']} bytes, crc32 "
                          f"{was['vocab_crc32']}, {was['vocab_words']} words)"), err
    assert not (tmp_path / "v.txt").exists()
