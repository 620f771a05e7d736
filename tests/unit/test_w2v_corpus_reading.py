"""Word2Vec reads its corpus parts through ``streaming.source.read_batches``: a truncated part (inside a
record batch or between two), a part of another schema or word ids beyond ``vocab.arrow`` are one
``DataFormatError``/``SchemaError`` naming the file, the row and ``model.arrow_dir`` (exit code 2, not
restarted). Before, raw pyarrow gave a traceback without the file's name (exit 1, restarted), a part cut
at a batch boundary was read as a shorter corpus, and a mismatched vocabulary was a ``ModelInputError``
from the kernel. And a table the program does not use (a misspelled name) is a config error."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.errors import ConfigError
from engine.programs.word2vec import check_corpus_files, check_tables, steps_per_epoch, worker_steps
from streaming.errors import DataFormatError, SchemaError
from streaming.text import convert_text, corpus_files
from tests.unit.test_w2v_engine_program import _cfg

REPO = Path(__file__).resolve().parents[2]


def _convert(tmp_path: Path, name: str, words: int, docs: int = 60) -> Path:
    rng = np.random.default_rng(words)
    text = tmp_path / f"{name}.txt"
    text.write_text("".join(" ".join(f"w{i}" for i in rng.integers(0, words, 20)) + "\n" for _ in range(docs)))
    out = tmp_path / name
    convert_text(text, out, min_count=1, batch_tokens=200, file_tokens=10**6)
    return out


def _steps(arrow: Path, vocab_size=None):
    files = corpus_files(arrow)
    return [s for s in worker_steps(files, 0, 1, 10**6, vocab_size, str(arrow))], \
        steps_per_epoch(files, 0, 1, 10**6, vocab_size, str(arrow))


def _batch_ends(path: str) -> list:
    with pa.OSFile(path) as f:
        r = pa.ipc.open_stream(f)
        ends = []
        for _ in r:
            ends.append(f.tell())
    return ends


@pytest.mark.parametrize("cut", ["inside_a_batch", "at_a_boundary"])
def test_a_cut_part_names_the_file_and_batch(tmp_path, cut):
    arrow = _convert(tmp_path, "a", 30)
    part = corpus_files(arrow)[0]
    data, ends = Path(part).read_bytes(), _batch_ends(part)
    assert len(ends) >= 4
    Path(part).write_bytes(data[:ends[2] - 50] if cut == "inside_a_batch" else data[:ends[1]])
    with pytest.raises(DataFormatError) as ei:     # was pyarrow's OSError (inside), or nothing (boundary)
        list(worker_steps(corpus_files(arrow), 0, 1, 10**6))
    assert ei.value.path == part and ei.value.field == "<record batch 2>" and ei.value.line == 21
    with pytest.raises(DataFormatError, match=r"<record batch 2>"):
        _steps(arrow)
    with pytest.raises(DataFormatError, match=rf"{part}: row 21: field <record batch 2>"):
        check_corpus_files(str(arrow))          # before anything starts (prepare)


def test_word_ids_beyond_the_vocabulary_name_file_row_and_arrow_dir(tmp_path):
    arrow = _convert(tmp_path, "a", 30)
    steps, n = _steps(arrow, vocab_size=30)                         # the matching vocabulary: fine
    assert n == len(steps) > 0
    small = _convert(tmp_path, "b", 5)
    shutil.copy(small / "vocab.arrow", arrow / "vocab.arrow")      # another conversion's vocabulary
    part = corpus_files(arrow)[0]
    with pytest.raises(DataFormatError) as ei:
        _steps(arrow, vocab_size=5)
    e = ei.value
    assert (e.path, e.field) == (part, "tokens") and e.line >= 1
    assert str(e).startswith(f"{part}: row {e.line}: field tokens: expected word ids < 5 (the vocab.arrow of "
                             f"model.arrow_dir {arrow} holds 5 words), got ")


def test_a_part_of_another_schema_is_refused_before_anything_starts(tmp_path):
    arrow = _convert(tmp_path, "a", 30)
    part = corpus_files(arrow)[0]
    with pa.OSFile(part) as f:                  # not mapped: the file is rewritten below
        t = pa.ipc.open_stream(f).read_all().drop_columns(["raw_tokens"])
    with pa.OSFile(part, "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t)
    with pytest.raises(SchemaError, match=r"column 'raw_tokens': expected uint32, but the column is missing"):
        check_corpus_files(str(arrow))
    with pytest.raises(SchemaError, match=r"raw_tokens"):
        _steps(arrow)
    Path(part).unlink()
    with pytest.raises(ConfigError, match=r"model.arrow_dir: .*corpus part .*part-00000.arrow .*not found"):
        check_corpus_files(str(arrow))


@pytest.mark.parametrize("key, name", [("sparse", "syn00"), ("dense", "progres")])
def test_a_table_the_program_does_not_use_is_refused(key, name):
    tables = _cfg().to_dict()["tables"]
    extra = dict(tables[key])
    extra[name] = tables[key]["syn0" if key == "sparse" else "progress"]
    with pytest.raises(ConfigError) as ei:
        _cfg(**{f"tables__{key}": extra})
    assert str(ei.value) == (f"tables.{key}.{name}: model.kind word2vec uses no {key} table {name!r} (it uses "
                             f"sparse table(s) 'syn0' (model.input_table), 'syn1neg' (model.output_table); dense "
                             f"table(s) 'progress' (model.progress_table)); a misspelt table name loses its "
                             f"settings: fix the name, or remove the table")


def test_engine_train_on_a_mismatched_vocabulary_exits_2_without_restart(tmp_path):
    """Real processes (1 server, 1 worker): the worker's error is one line naming the part, exit 2, and
    the job is not restarted (it was a ModelInputError traceback, exit 1, restarted)."""
    arrow = _convert(tmp_path, "a", 30)
    shutil.copy(_convert(tmp_path, "b", 5) / "vocab.arrow", arrow / "vocab.arrow")
    sets = {"model.corpus": "", "model.arrow_dir": arrow, "model.min_count": 1, "model.eval_after_train": "false",
            "model.dim": 8, "tables.sparse.syn0.dim": 8, "tables.sparse.syn1neg.dim": 8,
            "tables.sparse.syn0.init_range": 0.0625, "model.metrics_dir": tmp_path / "m",
            "checkpoint.root": tmp_path / "ckpt", "cluster.workers": 1, "cluster.warm_up": "false",
            "observability.tensorboard": "false", "cluster.run_root": tmp_path / "runs", "cluster.max_restarts": 2}
    argv = [sys.executable, "-m", "engine", "train", str(REPO / "configs" / "word2vec.yaml"),
            "--run-dir", str(tmp_path / "run")]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    part = corpus_files(arrow)[0]
    assert f"bad input data: {part}: row " in r.stderr and "field tokens: expected word ids < 5" in r.stderr
    assert "giving up after 1 failure(s)" in r.stderr and "restart 1/" not in r.stderr
    assert "Traceback" not in r.stderr
