"""The word2vec worker program's pieces: the corpus split across workers (every document exactly once, steps
of at most ``batch_words`` raw words), the table checks of ``prepare`` (named key paths), and the
model description a word2vec checkpoint's config gives the exporter."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from engine.config import from_dict
from engine.errors import ConfigError
from engine.export.checkpoint_source import description_from_config
from engine.programs.word2vec import check_tables, worker_steps
from streaming.text import convert_text, corpus_files

CONFIG = yaml.safe_load(open("configs/word2vec.yaml"))


def _cfg(**changes):
    data = yaml.safe_load(yaml.safe_dump(CONFIG))
    for path, value in changes.items():
        node = data
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return from_dict(data)


def test_workers_split_the_corpus_by_record_batch(tmp_path):
    rng = np.random.default_rng(1)
    lines = [" ".join(f"w{i}" for i in rng.integers(0, 50, rng.integers(1, 400))) for _ in range(300)]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    convert_text(tmp_path / "c.txt", tmp_path / "a", min_count=1, batch_tokens=2000, file_tokens=9000)
    files = corpus_files(tmp_path / "a")
    assert len(files) > 2
    seen = []
    for rank in range(3):
        for tokens, offs, raw in worker_steps(files, rank, 3, batch_words=700):
            assert offs[0] == 0 and offs[-1] == len(tokens) == raw       # min_count 1: no OOV
            assert raw <= 700 or len(offs) == 2                         # a longer document is a step alone
            seen += [tuple(tokens[a:b]) for a, b in zip(offs[:-1], offs[1:])]
    every = [tuple(t[a:b]) for t, o, _ in worker_steps(files, 0, 1, batch_words=10**9)
             for a, b in zip(o[:-1], o[1:])]
    assert len(every) == len(lines) and sorted(seen) == sorted(every)   # each document once, across ranks


def test_check_tables_names_the_key():
    check_tables(_cfg())
    with pytest.raises(ConfigError, match=r"tables.sparse.syn0.init_range must be 0.5 / model.dim = 0.005"):
        check_tables(_cfg(tables__sparse__syn0__init_range=0.01))
    with pytest.raises(ConfigError, match=r"tables.sparse.syn1neg.initializer must be zeros"):
        check_tables(_cfg(tables__sparse__syn1neg__initializer="uniform"))
    with pytest.raises(ConfigError, match=r"tables.sparse.syn0.dim must be model.dim = 50"):
        check_tables(_cfg(model__dim=50))
    with pytest.raises(ConfigError, match=r"mode must be geo or async"):
        check_tables(_cfg(mode="sync"))
    with pytest.raises(ConfigError, match=r"tables.dense.progress: missing"):
        check_tables(_cfg(tables__dense={}))


def test_checkpoint_description_of_a_word2vec_config():
    cfg = _cfg(model__arrow_dir="/data/text-corpus").to_dict()
    desc = description_from_config(cfg, hash_version=1, num_vshards=1024)
    assert desc["model"]["kind"] == "word2vec" and desc["model"]["dim"] == 100
    assert desc["tables"] == {"sparse": "syn0", "dense": None}
    assert desc["vocab"] == "/data/text-corpus/vocab.arrow"


def test_prometheus_counts_this_processs_words_steps_and_seconds(tmp_path):
    """Word2Vec exports the live counters the CTR trainers do (this process's ``Mode`` counts): before,
    only ``steps`` (the job's, restored step included: a counter that jumped at every resume) and no
    words or seconds."""
    from pathlib import Path
    from engine.config import load_config
    from engine.modes import make_mode
    from engine.observability.prometheus import TrainerCollector
    from engine.programs import word2vec
    from engine.ps import InProcessTransport, PSClient, PSServer
    from engine.roles import WorkerContext
    repo = Path(__file__).resolve().parents[2]
    rng = np.random.default_rng(3)
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(f"w{i}" for i in rng.zipf(1.3, 200) % 300)
                                                 for _ in range(300)) + "\n")
    cfg = word2vec.prepare(load_config(repo / "configs" / "word2vec.yaml", [
        "checkpoint.root=", "cluster.workers=1", f"model.metrics_dir={tmp_path}/m", "cluster.warm_up=false",
        f"model.corpus={tmp_path}/corpus.txt", f"model.arrow_dir={tmp_path}/arrow", "model.epochs=1",
        "model.batch_words=4000", "model.eval_after_train=false", "model.dim=16", "tables.sparse.syn0.dim=16",
        "tables.sparse.syn0.init_range=0.03125",
        "tables.sparse.syn1neg.dim=16", "model.min_count=1", f"observability.tensorboard_dir={tmp_path}/tb"]))
    server = PSServer.from_config(cfg, 0)
    client = PSClient(InProcessTransport([server]))
    try:
        trainer = word2vec.Word2VecTrainer(WorkerContext(cfg, 0, 1, client, make_mode(cfg, client, rank=0,
                                                                                         num_workers=1)))
        out = trainer.run()
        got = {m.name: m.samples[0].value for m in TrainerCollector(trainer).collect()}
    finally:
        client.close()
        server.close()
    assert got["engine_worker_steps"] == trainer.mode.step == out["steps"] > 0     # a fresh job: the same
    assert got["engine_worker_examples"] == out["raw_words"] > 0
    assert 0 < got["engine_worker_train_seconds"] <= out["train_seconds"]
