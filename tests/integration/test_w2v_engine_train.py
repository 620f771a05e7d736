"""``engine train configs/word2vec.yaml`` through real processes (1 server + 2 workers) on a small generated
corpus, then ``engine export --format word2vec`` read by gensim and ``engine eval`` on the checkpoint.

The corpus has planted structure: 40 topics of 10 words; a document is a run of 12-word segments, each
drawn from one topic. Words of a topic share contexts, so after training a word's topic mates must be
closer than other words (a smoke check that the deltas of both workers reach the servers; quality on real
text is ``tests/statistical/test_word2vec_ps_quality.py``). The evaluation files are generated from the
topics too: WordSim-style pairs scored 1 (same topic) or 0, and analogy lines of topic words.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
TOPICS, PER_TOPIC, DIM = 40, 10, 16


def _word(t: int, j: int) -> str:
    return f"t{t}w{j}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("w2v-corpus")
    rng = np.random.default_rng(5)
    lines = []
    for _ in range(1200):                       # 1,200 documents x 240 tokens = 288,000 tokens
        segs = []
        for t in rng.integers(0, TOPICS, 20):
            segs += [_word(t, j) for j in rng.integers(0, PER_TOPIC, 12)]
        lines.append(" ".join(segs))
    (d / "corpus.txt").write_text("\n".join(lines) + "\n")
    ev = d / "eval"
    ev.mkdir()
    pairs = [(_word(t, 0), _word(t, 1), 1.0) for t in range(TOPICS)] + \
            [(_word(t, 2), _word((t + 1) % TOPICS, 3), 0.0) for t in range(TOPICS)]
    (ev / "wordsim353.tsv").write_text("# word1\tword2\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in pairs))
    (ev / "simlex999.txt").write_text("word1\tword2\tSimLex999\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in pairs))
    qs = [f"{_word(t, 0)} {_word(t, 1)} {_word(t, 2)} {_word(t, 3)}" for t in range(TOPICS)]
    (ev / "questions-words.txt").write_text(": topics\n" + "\n".join(qs) + "\n: oov\nzz yy xx ww\n")
    return d


def _sets(corpus: Path, tmp_path: Path, mode: str) -> list[str]:
    sets = [f"mode={mode}", f"model.corpus={corpus / 'corpus.txt'}", f"model.arrow_dir={tmp_path / 'arrow'}",
            f"model.eval_data_dir={corpus / 'eval'}", f"model.metrics_dir={tmp_path / 'metrics'}",
            f"observability.tensorboard_dir={tmp_path / 'tb'}",
            f"checkpoint.root={tmp_path / 'ckpt'}", "model.epochs=2", f"model.dim={DIM}", "model.batch_words=8000",
            "model.log_every_s=0.2", "model.sample=0", "geo.k_steps=2",
            f"tables.sparse.syn0.dim={DIM}", f"tables.sparse.syn0.init_range={0.5 / DIM}",
            f"tables.sparse.syn1neg.dim={DIM}"]
    return [a for s in sets for a in ("--set", s)]


def _run(*args, timeout=240) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "engine", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [pytest.param("geo", marks=pytest.mark.long), "async"])
def test_train_export_eval(corpus, tmp_path, mode):
    gensim = pytest.importorskip("gensim")
    cfg = REPO / "configs" / "word2vec.yaml"
    out = _run("train", cfg, "--run-dir", tmp_path / "run", *_sets(corpus, tmp_path, mode))
    final = json.loads(out[-1])
    assert final["event"] == "final" and final["model"] == "word2vec" and final["mode"] == mode
    assert final["words"] == 2 * 288_000          # both workers' raw words, every epoch, none lost
    assert final["effective_words"] == final["words"]   # sample=0, no OOV: every word trains
    assert final["words_per_s"] > 0 and final["effective_words_per_s"] > 0 and final["loss"] > 0
    assert final["analogy_evaluated"] == TOPICS and final["analogy_skipped"] == 1
    for k in ("analogy_accuracy", "wordsim353_spearman", "simlex999_spearman"):
        assert final[k] is not None
    assert final["wordsim353_spearman"] > 0.5    # topic mates closer than other pairs
    ckpt = Path(final["checkpoint"])
    assert (ckpt / "_SUCCESS").is_file()
    events = [json.loads(x) for x in Path(final["metrics_file"]).read_text().splitlines()]
    assert events[0]["event"] == "start" and events[-1]["event"] == "final"
    train = [e for e in events if e["event"] == "train"]
    assert {e["rank"] for e in train} == {0, 1}
    assert all(e["words_per_s"] >= e["effective_words_per_s"] >= 0 and e["loss"] >= 0 for e in train)
    # TensorBoard: loss and words/s per worker, the final evaluation (engine.observability.tensorboard)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(final["tensorboard_dir"])
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/rank0/loss", "train/rank1/words_per_s", "final/analogy_accuracy",
            "final/wordsim353_spearman"} <= tags, sorted(tags)
    assert ea.Scalars("final/wordsim353_spearman")[0].value == pytest.approx(final["wordsim353_spearman"], abs=1e-6)

    # export: gensim reads it; topic structure is there
    vec = tmp_path / "vectors.txt"
    exp = json.loads(_run("export", ckpt, vec, "--format", "word2vec")[-1])
    assert exp == {**exp, "event": "export", "format": "word2vec", "words": TOPICS * PER_TOPIC, "dim": DIM,
                   "missing": 0}
    kv = gensim.models.KeyedVectors.load_word2vec_format(str(vec))
    assert len(kv) == TOPICS * PER_TOPIC and kv.vector_size == DIM
    same = np.mean([kv.similarity(_word(t, 0), _word(t, 5)) for t in range(TOPICS)])
    other = np.mean([kv.similarity(_word(t, 0), _word((t + 7) % TOPICS, 5)) for t in range(TOPICS)])
    assert same > other + 0.2
    binary = tmp_path / "vectors.bin"
    _run("export", ckpt.parent.parent, binary, "--format", "word2vec", "--binary")   # a job root works too
    kb = gensim.models.KeyedVectors.load_word2vec_format(str(binary), binary=True)
    np.testing.assert_allclose(kb.vectors, kv.vectors, atol=1e-5)   # text keeps ~6 significant digits

    # eval: per-section lines, then the JSON line; same vectors as the final line's evaluation
    lines = _run("eval", cfg, "--checkpoint", ckpt, "--set", f"model.eval_data_dir={corpus / 'eval'}",
                 "--set", f"model.arrow_dir={tmp_path / 'arrow'}")
    ev = json.loads(lines[-1])
    assert any(x.startswith("topics") for x in lines[:-1]) and any(x.startswith("overall") for x in lines[:-1])
    for k in ("analogy_accuracy", "analogy_evaluated", "analogy_skipped", "wordsim353_spearman",
              "simlex999_spearman"):
        assert ev[k] == pytest.approx(final[k], abs=1e-9), k


@pytest.mark.slow
@pytest.mark.long   # make test-long (see pyproject.toml): resume at the data position is test_offline_resume's (CTR)
def test_a_resumed_job_trains_exactly_the_words_that_remained(corpus, tmp_path):
    """Word2Vec records its data position (epoch, step of the epoch) at aligned checkpoints, and a job
    resumed from one trains exactly the raw words after it: nothing skipped, nothing twice."""
    from engine.checkpoint import CheckpointManager
    cfg = REPO / "configs" / "word2vec.yaml"
    sets = _sets(corpus, tmp_path, "geo") + ["--set", "checkpoint.align_steps=4", "--set",
                                             "checkpoint.delta_every=4steps", "--set", "model.eval_after_train=false"]
    full = json.loads(_run("train", cfg, "--run-dir", tmp_path / "run", *sets)[-1])
    assert full["words"] == 2 * 288_000
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "word2vec")
    chain = [mgr.manifest(r.name) for r in mgr.list()]
    mid = next(m for m in chain if m["sources"]["train"]["epoch"] == 1 and m["sources"]["train"]["batch"] == 4)
    resumed = json.loads(_run("train", cfg, "--run-dir", tmp_path / "run2", *sets, "--resume",
                              mgr.uri_of(mid["name"]))[-1])
    # the 2 workers had trained epoch 0 and 4 steps of epoch 1 each; a step of at most 8,000 raw words
    # holds 33 whole documents of 240 words = 7,920 words
    per_step = 33 * 240
    assert resumed["words"] == full["words"] - 288_000 - 2 * 4 * per_step, (resumed["words"], full["words"])
