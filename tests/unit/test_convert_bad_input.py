"""``engine convert`` on bad input: one ``engine convert: <path>: <what>`` line, exit code 2, and the
output directory exactly as it was (a previous conversion kept, no partial output beside it). Runs the
CLI in-process through ``engine.cli.main`` on real files; plus ``engine train`` of word2vec on a corpus
whose vocabulary would be empty."""
from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

from engine.cli import main
from streaming.criteo import ConvertError, arrow_is_current
from streaming.source import ArrowSource
from streaming.text import TEXT_CHECK_BYTES, EmptyVocabularyError, NotTextError, text_arrow_is_current

REPO = Path(__file__).resolve().parents[2]
W2V = str(REPO / "configs" / "word2vec.yaml")


def _err(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("engine ")]
    assert len(lines) == 1, lines
    return lines[0]


def _good(i: int) -> str:
    return "\t".join([str(i % 2)] + [str(i)] * 13 + [f"{i:08x}"] * 26)


def _criteo(path: Path, n: int, bad_at: int | None = None) -> Path:
    lines = [_good(i) for i in range(n)]
    if bad_at is not None:
        lines[bad_at - 1] = lines[bad_at - 1].replace(f"\t{bad_at - 1}\t", "\tx\t", 1)
    path.write_text("\n".join(lines) + "\n")
    return path


def _truncated_gzip(path: Path, text: str) -> Path:
    data = gzip.compress(text.encode())
    path.write_bytes(data[: len(data) // 2])
    return path


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _siblings(d: Path) -> list:
    """Entries beside ``d`` a conversion may have left (its staging or set-aside directories)."""
    return sorted(p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}."))


def _rows(d: Path) -> int:
    return sum(rb.num_rows for rb in ArrowSource(str(d), batch_size=1 << 20, prefetch=0))


def test_truncated_gzip_names_the_file(tmp_path, capsys):
    crit = _truncated_gzip(tmp_path / "trunc.gz", "\n".join(_good(i) for i in range(3000)) + "\n")
    text = _truncated_gzip(tmp_path / "t_trunc.gz", "the cat sat on the mat\n" * 3000)
    for argv, path in ((["criteo", str(crit)], crit), (["text", str(text)], text)):
        out = tmp_path / f"out_{argv[0]}"
        assert main(["convert", *argv, str(out)]) == 2
        msg = _err(capsys)
        assert msg.startswith(f"engine convert: {path}: truncated gzip"), msg
        assert not out.exists() and _siblings(out) == []


def test_empty_criteo_input_names_the_file(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["convert", "criteo", str(empty), str(tmp_path / "out")]) == 2
    assert _err(capsys) == f"engine convert: {empty}: empty file: no data lines"
    # an empty input among good ones is named too
    good = _criteo(tmp_path / "good.txt", 3)
    assert main(["convert", "criteo", str(good), str(empty), str(tmp_path / "out")]) == 2
    assert f"{empty}: empty file" in _err(capsys)
    assert not (tmp_path / "out").exists()


def test_out_dir_a_regular_file(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    good = _criteo(tmp_path / "good.txt", 3)
    corpus = tmp_path / "c.txt"
    corpus.write_text("a b a b\n")
    assert main(["convert", "criteo", str(good), str(afile)]) == 2
    assert _err(capsys) == f"engine convert: {afile}: exists and is not a directory"
    assert main(["convert", "text", str(corpus), str(afile), "--min-count", "1"]) == 2
    assert _err(capsys) == f"engine convert: {afile}: exists and is not a directory"
    assert afile.read_text() == "keep me" and _siblings(afile) == []


def test_failed_criteo_convert_keeps_the_previous_conversion(tmp_path, capsys):
    """The audit's case: a bad line late in the input, after several part files were written."""
    k1 = _criteo(tmp_path / "k1.txt", 100)
    late = _criteo(tmp_path / "late.txt", 300, bad_at=281)
    out = tmp_path / "out_x"
    assert main(["convert", "criteo", str(k1), str(out)]) == 0
    capsys.readouterr()
    before = _snapshot(out)
    assert main(["convert", "criteo", str(late), str(out), "--batch-size", "10", "--rows-per-file", "50"]) == 2
    msg = _err(capsys)
    assert f"{late}:281: field I1" in msg, msg
    assert _snapshot(out) == before and arrow_is_current([k1], out)
    assert _rows(out) == 100 and _siblings(out) == []


def test_successful_convert_replaces_the_previous_one_whole(tmp_path, capsys):
    out = tmp_path / "deep" / "er" / "out"
    big = _criteo(tmp_path / "big.txt", 120)
    small = _criteo(tmp_path / "small.txt", 7)
    assert main(["convert", "criteo", str(big), str(out), "--batch-size", "10", "--rows-per-file", "20"]) == 0
    assert len(list(out.glob("part-*.arrow"))) == 6
    out.chmod(0o750)
    assert main(["convert", "criteo", str(small), str(out)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["files"] == ["part-00000.arrow"]
    assert sorted(p.name for p in out.iterdir()) == ["_meta.json", "part-00000.arrow"]   # no stale parts
    assert _rows(out) == 7 and arrow_is_current([small], out) and not arrow_is_current([big], out)
    assert (out.stat().st_mode & 0o777) == 0o750 and _siblings(out) == []


def test_failed_text_convert_keeps_the_previous_conversion(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat\nthe cat the dog\n")
    out = tmp_path / "w2v"
    assert main(["convert", "text", str(corpus), str(out), "--min-count", "2"]) == 0
    capsys.readouterr()
    before = _snapshot(out)
    trunc = _truncated_gzip(tmp_path / "t.gz", "a b c\n" * 5000)
    nonutf8 = tmp_path / "bad.txt"
    nonutf8.write_bytes(b"caf\xe9 caf\xe9\n")
    for bad, needle in ((trunc, f"{trunc}: truncated gzip"),
                        (nonutf8, f"{nonutf8}:1: field token: expected UTF-8 text, got the bytes b'caf\\xe9'"),
                        (corpus, "no word occurs --min-count=9 times")):
        assert main(["convert", "text", str(bad), str(out), "--min-count", "9" if bad == corpus else "1"]) == 2
        assert needle in _err(capsys)
        assert _snapshot(out) == before and _siblings(out) == []
    assert text_arrow_is_current(corpus, out, min_count=2)


def test_empty_vocabulary_refused(tmp_path, capsys):
    empty = tmp_path / "t_empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    assert main(["convert", "text", str(empty), str(out)]) == 2
    assert _err(capsys) == (f"engine convert: {empty}: empty vocabulary (--min-count=5): the corpus holds no "
                            "words (0 lines)")
    corpus = tmp_path / "c.txt"
    corpus.write_text("a b a\n\nc\n")
    assert main(["convert", "text", str(corpus), str(out), "--min-count", "100000"]) == 2
    assert _err(capsys) == (f"engine convert: {corpus}: empty vocabulary: no word occurs --min-count=100000 "
                            "times or more (the most frequent of its 3 distinct words occurs 2 times, 4 tokens "
                            "in all); lower --min-count")
    assert not out.exists() and _siblings(out) == []


def test_a_binary_file_is_named_not_text_at_its_first_nul_byte(tmp_path, capsys):
    """A binary file (random bytes: each byte string occurs once or twice) was refused as an "empty
    vocabulary: no word occurs --min-count=5 times", as if it were a small text; and one of NUL bytes
    (valid UTF-8) the same. Now the file is named not text, at the byte offset of its first NUL byte."""
    import numpy as np
    rng = np.random.default_rng(0)
    out = tmp_path / "out"
    noise = rng.integers(1, 256, 20000, dtype=np.uint8).tobytes()
    binary = tmp_path / "img.bin"
    binary.write_bytes(b"GIF89a" + noise[:500] + b"\0" + noise)
    nuls = tmp_path / "zeros.dat"
    nuls.write_bytes(b"text first " + b"\0" * 5000)
    packed = tmp_path / "img.bin.gz"
    packed.write_bytes(gzip.compress(binary.read_bytes()))
    suffix = "(a binary file? engine convert text reads UTF-8 text, plain or gzip, one document a line)"
    for path, msg in ((binary, "byte offset 506 holds a NUL byte"),
                      (nuls, "byte offset 11 holds a NUL byte"),
                      (packed, "byte offset 506 of the decompressed text holds a NUL byte")):
        assert main(["convert", "text", str(path), str(out)]) == 2
        assert _err(capsys) == f"engine convert: {path}: not text: {msg} {suffix}"
        assert not out.exists() and _siblings(out) == []
    e = pickle.loads(pickle.dumps(NotTextError("x", 6, gzip=True)))
    assert (e.offset, e.gzip) == (6, True) and "decompressed" in str(e)
    # only the start is checked: a text with a rare NUL byte past it converts as before
    text = tmp_path / "mostly.txt"
    text.write_bytes(b"the cat sat\n" * (TEXT_CHECK_BYTES // 12 + 100) + b"c\0t\n")
    assert main(["convert", "text", str(text), str(out), "--min-count", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 3


def test_out_dir_with_other_files_is_refused_not_emptied(tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    raw = _criteo(out / "train.txt", 5)              # the input inside OUT_DIR: a swap would delete it
    assert main(["convert", "criteo", str(raw), str(out)]) == 2
    msg = _err(capsys)
    assert msg.startswith(f"engine convert: {out}: holds 'train.txt', which a conversion does not write"), msg
    assert sorted(p.name for p in out.iterdir()) == ["train.txt"] and _siblings(out) == []
    assert main(["convert", "criteo", str(raw), "s3://bucket/out"]) == 2
    assert _err(capsys).startswith("engine convert: s3://bucket/out: a URI")


def test_criteo_dir_is_not_text_output(tmp_path, capsys):
    """Each converter owns only its own layout: a text conversion does not replace a Criteo one."""
    out = tmp_path / "o"
    assert main(["convert", "criteo", str(_criteo(tmp_path / "a.txt", 3)), str(out)]) == 0
    capsys.readouterr()
    corpus = tmp_path / "c.txt"
    corpus.write_text("a a\n")
    assert main(["convert", "text", str(corpus), str(out), "--min-count", "1"]) == 2
    assert "holds 'part-00000.arrow'" in _err(capsys)
    assert _rows(out) == 3


def test_errors_pickle_with_their_fields(tmp_path):
    e = pickle.loads(pickle.dumps(ConvertError("x.gz", "truncated")))
    assert (type(e), str(e), e.path) == (ConvertError, "x.gz: truncated", "x.gz")
    v = pickle.loads(pickle.dumps(EmptyVocabularyError("c.txt", 5, 3, 4, 2, 1)))
    assert isinstance(v, ConvertError) and v.explain("model.min_count").startswith(
        "empty vocabulary: no word occurs model.min_count=5 times")


def test_word2vec_train_on_empty_corpus_is_a_config_error(tmp_path, capsys):
    empty = tmp_path / "EMPTY"
    empty.write_text("")
    arrow = tmp_path / "arrow"
    assert main(["train", W2V, "--set", f"model.corpus={empty}", "--set", f"model.arrow_dir={arrow}"]) == 2
    assert _err(capsys) == (f"engine train: config error: model.corpus: {empty}: empty vocabulary "
                            "(model.min_count=5): the corpus holds no words (0 lines)")
    assert not arrow.exists()
    # a conversion with an empty vocabulary made before they were refused is refused too
    arrow.mkdir()
    (arrow / "_meta.json").write_text(json.dumps({"format": "text-arrow/1", "vocab_size": 0, "files": []}))
    assert main(["train", W2V, "--set", f"model.corpus={tmp_path / 'gone.txt'}",
                 "--set", f"model.arrow_dir={arrow}"]) == 2
    msg = _err(capsys)
    assert f"model.arrow_dir: {arrow} holds a conversion with an empty vocabulary" in msg
    assert "model.min_count 5" in msg


def test_out_dir_that_cannot_be_created_is_named(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile / "sub" / "out"                     # its parent is a regular file
    assert main(["convert", "criteo", str(_criteo(tmp_path / "a.txt", 3)), str(out)]) == 2
    assert _err(capsys).startswith(f"engine convert: {out}: cannot create a directory beside it")
    assert afile.read_text() == "keep me"


def test_ctr_train_on_a_truncated_criteo_file_names_it(tmp_path, capsys):
    """The launcher converts ``model.data.criteo_path`` before any process starts: a truncated gzip there
    is one ``bad input data`` line and exit code 2 (it was a traceback, exit 1)."""
    bad = _truncated_gzip(tmp_path / "day.gz", "\n".join(_good(i) for i in range(200)) + "\n")
    assert main(["train", str(REPO / "configs" / "ctr.yaml"), "--set", f"model.data.criteo_path={bad}",
                 "--set", f"model.data.cache_dir={tmp_path / 'cache'}",
                 "--set", f"model.metrics_dir={tmp_path / 'metrics'}"]) == 2
    assert _err(capsys) == (f"engine train: bad input data: {bad}: truncated gzip data: the file ends inside "
                            "its compressed stream (an incomplete copy or download?)")


def test_a_staging_directory_left_by_a_killed_conversion_is_removed_by_the_next(tmp_path, capsys):
    """A conversion killed with SIGKILL runs no handler: its staging directory stays beside OUT_DIR. The
    next conversion into OUT_DIR on this host removes it (its process is gone) and converts."""
    from tests.waiting import killed_after_first_line
    out = tmp_path / "out"
    code = ("import sys, time\nfrom streaming.criteo import _staged_output, _criteo_owned\n"
            f"with _staged_output({str(out)!r}, _criteo_owned) as stage:\n"
            "    (stage / 'part-00000.arrow').write_bytes(b'half')\n    print(stage, flush=True)\n    time.sleep(60)\n")
    stage = killed_after_first_line(code, REPO)
    assert stage and _siblings(out) == [Path(stage).name]            # left behind
    src = _criteo(tmp_path / "in.txt", 500)
    assert main(["convert", "criteo", str(src), str(out)]) == 0
    assert _siblings(out) == [] and _rows(out) == 500

