"""A Word2Vec checkpoint knows which vocabulary it was trained with.

Its manifest's ``sources.train.vocab`` holds the conversion's fingerprint
(``streaming.text.conversion_fingerprint``: words, bytes and CRC-32 of ``vocab.arrow``, raw tokens of the
corpus). Re-converting a changed corpus into the same ``model.arrow_dir`` (done automatically when the
corpus file changes) would otherwise shift every exported vector onto another word: ``engine export
--format word2vec`` and ``engine eval`` refuse a ``vocab.arrow`` whose fingerprint differs (exit 2, one
line naming both), ``--resume`` refuses the changed conversion (``check_resumed_corpus``: ConfigError
naming ``model.arrow_dir`` and what changed), and a checkpoint written before fingerprints were recorded
is accepted with a WARNING. Checkpoints here are written by an in-process parameter server, as the
trainer writes them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from engine.checkpoint import CheckpointManager
from engine.cli import main
from engine.config import DenseTableConfig, from_dict
from engine.errors import ConfigError
from engine.export import ExportError
from engine.export.checkpoint_source import CheckpointSource
from engine.export.w2v import export_word2vec
from engine.ps import InProcessTransport, PSClient, PSServer
from models.word2vec_io import load_word2vec_format
from sparse_tables import TableConfig
from streaming.keys import make_keys
from streaming.text import convert_text, read_vocab

REPO = Path(__file__).resolve().parents[2]
W2V = REPO / "configs" / "word2vec.yaml"
DIM = 4


def _config(arrow: Path, root: Path, **model) -> dict:
    data = yaml.safe_load(W2V.read_text())
    data["model"].update(arrow_dir=str(arrow), dim=DIM, **model)
    data["tables"]["sparse"]["syn0"].update(dim=DIM, init_range=0.5 / DIM)
    data["tables"]["sparse"]["syn1neg"]["dim"] = DIM
    data["checkpoint"].update(root=str(root), job="w2v")
    return data


def _convert(tmp: Path, text: str, arrow: Path) -> None:
    corpus = tmp / "corpus.txt"
    corpus.write_text(text)
    convert_text(corpus, arrow, min_count=1)


def _fingerprint(arrow: Path) -> dict:
    """The conversion's fingerprint from first principles: ``_meta.json``'s counts, ``vocab.arrow``'s bytes."""
    meta = json.loads((arrow / "_meta.json").read_text())
    data = (arrow / "vocab.arrow").read_bytes()
    crc = 0
    for part in meta["files"]:                   # every record batch: its token ids, then its raw lengths
        with pa.ipc.open_stream(str(arrow / part)) as r:
            for rb in r:
                crc = zlib.crc32(rb.column("tokens").values.to_numpy().astype("<u4"), crc)
                crc = zlib.crc32(rb.column("raw_tokens").to_numpy().astype("<u4"), crc)
    return {"vocab_words": meta["vocab_size"], "vocab_bytes": len(data), "vocab_crc32": f"{zlib.crc32(data):08x}",
            "total_tokens": meta["total_tokens"], "tokens_crc32": f"{crc:08x}"}


def _checkpoint(arrow: Path, root: Path, *, record: bool = True) -> str:
    """A base checkpoint of a word2vec job trained on ``arrow`` (vector of word i = i + 1 everywhere),
    with the trainer's ``sources.train`` (``record=False``: as written before fingerprints existed)."""
    words, _ = read_vocab(arrow)
    tables = {t: TableConfig(dim=DIM, optimizer="sgd") for t in ("syn0", "syn1neg")}
    server = PSServer(tables, {"progress": DenseTableConfig()}, index=0, num_servers=1, num_vshards=16, local_shards=1,
                      checkpoint_groups=1)
    client = PSClient(InProcessTransport([server]))
    try:
        client.init_dense("progress", np.zeros(1, np.float32))
        ids = np.arange(len(words), dtype=np.uint64)
        keys = make_keys(1, ids)
        now = client.pull("syn0", keys, init_missing=True)
        client.push_delta("syn0", keys, np.repeat(ids[:, None] + 1.0, DIM, 1).astype(np.float32) - now)
        train = {"epoch": 1, "batch": 0, "workers": 1, "batch_words": 50000, "seed": 1, "arrow_dir": str(arrow)}
        if record:
            train["vocab"] = _fingerprint(arrow)
        mgr = CheckpointManager(str(root), "w2v")
        m = mgr.save(client, "base", sources={"train": train}, config=_config(arrow, root))
        return mgr.uri_of(m["name"])
    finally:
        client.close()


@pytest.fixture
def trained(tmp_path):
    """(arrow_dir, checkpoint URI) of a job trained on one corpus."""
    arrow = tmp_path / "arrow"
    _convert(tmp_path, "the cat sat on the mat\nthe dog sat\n", arrow)
    return arrow, _checkpoint(arrow, tmp_path / "ckpt")


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


def test_the_fingerprint_follows_the_conversion(tmp_path):
    from streaming.text import conversion_fingerprint, vocab_fingerprint
    arrow = tmp_path / "arrow"
    _convert(tmp_path, "the cat sat\nthe cat\n", arrow)
    fp = conversion_fingerprint(arrow)
    assert fp == _fingerprint(arrow) and fp["vocab_words"] == 3 and fp["total_tokens"] == 5
    assert vocab_fingerprint(arrow / "vocab.arrow") == vocab_fingerprint(arrow) == {
        "vocab_bytes": fp["vocab_bytes"], "vocab_crc32": fp["vocab_crc32"]}
    _convert(tmp_path, "the cat sat\nthe cat\n", arrow)        # the same text again: the same conversion
    assert conversion_fingerprint(arrow) == fp
    _convert(tmp_path, "the cat sat\ncat cat\n", arrow)        # same words and tokens, other order of ids
    assert conversion_fingerprint(arrow)["vocab_crc32"] != fp["vocab_crc32"]
    _convert(tmp_path, "the cat\nthe cat sat\n", arrow)        # the lines reordered: same vocabulary and count
    moved = conversion_fingerprint(arrow)
    assert moved == _fingerprint(arrow) and moved["tokens_crc32"] != fp["tokens_crc32"]
    assert {k: v for k, v in moved.items() if k != "tokens_crc32"} == {k: v for k, v in fp.items() if k != "tokens_crc32"}
    with pytest.raises(FileNotFoundError, match="_meta.json"):
        conversion_fingerprint(tmp_path / "nothing")


def test_export_refuses_a_vocabulary_re_converted_since(trained, tmp_path, capsys):
    arrow, uri = trained
    out = tmp_path / "vec.txt"
    assert main(["export", uri, str(out), "--format", "word2vec"]) == 0
    words, vecs = load_word2vec_format(out, binary=False)
    assert words == read_vocab(arrow)[0] and np.array_equal(vecs[:, 0], np.arange(1, len(words) + 1))
    recorded = _fingerprint(arrow)
    capsys.readouterr()

    # the corpus changed and was re-converted into the same arrow_dir: "the" is no longer word 0
    _convert(tmp_path, "a cat sat on a mat\na a dog sat\n", arrow)
    now = _fingerprint(arrow)
    out.unlink()
    assert main(["export", uri, str(out), "--format", "word2vec"]) == 2
    err = _err(capsys)
    assert err.startswith(f"engine export: {arrow}/vocab.arrow: not the vocabulary {uri} was trained with")
    assert f"{now['vocab_bytes']} bytes, crc32 {now['vocab_crc32']}" in err
    assert f"{recorded['vocab_bytes']} bytes, crc32 {recorded['vocab_crc32']}" in err
    assert not out.exists()
    # the vocabulary it was trained with, kept elsewhere, is accepted by --vocab
    keep = tmp_path / "kept"
    _convert(tmp_path, "the cat sat on the mat\nthe dog sat\n", keep)
    assert main(["export", uri, str(out), "--format", "word2vec", "--vocab", str(keep / "vocab.arrow")]) == 0
    assert load_word2vec_format(out, binary=False)[0][0] == "the"


def test_eval_refuses_a_vocabulary_re_converted_since(trained, tmp_path, capsys):
    arrow, uri = trained
    ev = tmp_path / "ev"                     # benchmarks whose words are in both vocabularies
    ev.mkdir()
    pairs = "cat\tdog\t1.0\nsat\tmat\t2.0\ncat\ton\t3.0\n"
    (ev / "wordsim353.tsv").write_text(pairs)
    (ev / "simlex999.txt").write_text(pairs)
    (ev / "questions-words.txt").write_text(": s\ncat dog sat mat\n")
    sets = ["--set", f"model.arrow_dir={arrow}", "--set", f"model.eval_data_dir={ev}"]
    assert main(["eval", str(W2V), "--checkpoint", uri, *sets]) == 0
    capsys.readouterr()
    _convert(tmp_path, "a cat sat on a mat\na a dog sat\n", arrow)
    assert main(["eval", str(W2V), "--checkpoint", uri, *sets]) == 2
    err = _err(capsys)
    assert err.startswith(f"engine eval: {arrow}/vocab.arrow: not the vocabulary {uri} was trained with"), err
    assert capsys.readouterr().out == ""


def test_a_checkpoint_without_a_fingerprint_is_exported_with_a_warning(tmp_path, caplog):
    arrow = tmp_path / "arrow"
    _convert(tmp_path, "the cat sat\n", arrow)
    uri = _checkpoint(arrow, tmp_path / "ckpt", record=False)
    source = CheckpointSource(uri)
    try:
        assert source.model_description()["vocab_fingerprint"] is None
        with caplog.at_level(logging.WARNING, logger="engine.export.w2v"):
            res = export_word2vec(source, str(tmp_path / "vec.txt"), vocab=str(arrow))
    finally:
        source.close()
    assert res["words"] == 3
    assert any("records no fingerprint of the vocabulary" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_a_resume_refuses_a_changed_conversion(trained, tmp_path, caplog):
    from engine.programs.word2vec import check_resumed_corpus
    from streaming.text import conversion_fingerprint
    arrow, uri = trained
    data = _config(arrow, tmp_path / "ckpt")
    cfg = from_dict(data)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, restored=uri))
    check_resumed_corpus(cfg, str(arrow), conversion_fingerprint(arrow))        # unchanged: accepted
    was = conversion_fingerprint(arrow)
    _convert(tmp_path, "the cat sat on the mat\nthe dog sat\nthe end\n", arrow)   # more text, one word more
    now = conversion_fingerprint(arrow)
    with pytest.raises(ConfigError) as e:
        check_resumed_corpus(cfg, str(arrow), now)
    msg = str(e.value)
    assert msg.startswith(f"model.arrow_dir: {arrow} holds another corpus conversion than the one checkpoint "
                          f"{uri} was trained on")
    assert f"vocab_words was {was['vocab_words']}, now {now['vocab_words']}" in msg
    assert f"total_tokens was {was['total_tokens']}, now {now['total_tokens']}" in msg
    assert f"vocab_crc32 was {was['vocab_crc32']}, now {now['vocab_crc32']}" in msg
    _convert(tmp_path, "the dog sat\nthe cat sat on the mat\n", arrow)   # the trained lines, reordered
    moved = conversion_fingerprint(arrow)
    assert (moved["vocab_crc32"], moved["total_tokens"]) == (was["vocab_crc32"], was["total_tokens"])
    with pytest.raises(ConfigError, match=f"tokens_crc32 was {was['tokens_crc32']}, now {moved['tokens_crc32']}"):
        check_resumed_corpus(cfg, str(arrow), moved)
    # a checkpoint written before fingerprints were recorded: accepted, with a warning
    old = _checkpoint(arrow, tmp_path / "old", record=False)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, restored=old))
    with caplog.at_level(logging.WARNING, logger="engine.programs.word2vec"):
        check_resumed_corpus(cfg, str(arrow), now)
    assert any("cannot verify that model.arrow_dir" in r.getMessage() for r in caplog.records)


def test_the_trainers_checkpoints_record_the_fingerprint():
    """``VocabCheckpoints.sources`` adds ``train.vocab`` beside the position and its identity."""
    from engine.programs.word2vec import VocabCheckpoints
    from engine.programs.ctr_positions import Position

    class _T:
        ctx = type("ctx", (), {"config": from_dict(dict(yaml.safe_load(W2V.read_text()),
                                                        checkpoint={"root": ""}))})()
        rank, num_workers = 1, 2

    fp = {"vocab_words": 3, "vocab_bytes": 10, "vocab_crc32": "0000abcd", "total_tokens": 7}
    ck = VocabCheckpoints(_T(), identity={"workers": 2, "arrow_dir": "/a"}, fingerprint=fp)
    assert ck.sources(Position(1, 4)) == {"train": {"epoch": 1, "batch": 4, "workers": 2, "arrow_dir": "/a",
                                                    "vocab": fp}}
    assert json.loads(json.dumps(ck.sources(Position()))) == ck.sources(Position())
