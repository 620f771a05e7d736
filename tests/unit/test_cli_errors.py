"""CLI bad-input contract: ``engine convert`` and ``engine train`` end with exit code 2 and one clear
error line naming the path, key or column (run in-process through ``engine.cli.main``)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.cli import main

REPO = Path(__file__).resolve().parents[2]
CTR = str(REPO / "configs" / "ctr.yaml")


def _err(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("engine ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_convert_missing_input(tmp_path, capsys):
    assert main(["convert", "criteo", str(tmp_path / "nope.txt"), str(tmp_path / "out")]) == 2
    assert "nope.txt" in _err(capsys)


def test_convert_malformed_line_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    good = "\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 26)
    bad.write_text(good + "\n" + "1\t2\n")
    assert main(["convert", "criteo", str(bad), str(tmp_path / "out")]) == 2
    msg = _err(capsys)
    assert "bad.txt:2" in msg and "40 tab-separated fields" in msg


def test_convert_binary_line_is_one_clean_error(tmp_path, capsys):
    """A line that is not UTF-8 (and not 40 fields) printed pyarrow's "Exception ignored" traceback and then
    an error line holding the raw binary bytes."""
    bad = tmp_path / "bin.txt"
    good = "\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 26)
    bad.write_bytes((good + "\n").encode() + b"\xff\xfe\x00\x01garbage\x1b[2J\n" + (good + "\n").encode())
    assert main(["convert", "criteo", str(bad), str(tmp_path / "out"), "--max-bad-rows", "3"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("engine ")]
    assert lines == [f"engine convert: {bad}: line 2: not UTF-8 text (a binary file?), and 1 tab-separated fields "
                     f"where 40 are expected"], err
    assert not (tmp_path / "out").exists()


def test_convert_skips_bad_rows_when_allowed(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    good = "\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 26)
    bad.write_text(good + "\n" + "1\t2\n" + good + "\n")
    assert main(["convert", "criteo", str(bad), str(tmp_path / "out"), "--max-bad-rows", "1"]) == 0
    assert '"rows": 2' in capsys.readouterr().out


def test_convert_bad_argument(tmp_path, capsys):
    assert main(["convert", "criteo", "x", str(tmp_path), "--batch-size", "0"]) == 2
    assert "--batch-size" in _err(capsys)


def test_convert_batch_size_past_its_buffers_is_refused(tmp_path, capsys):
    """``--batch-size 4611686018427387904`` ended in numpy's "array is too big" naming nothing; the engine
    train path (model.data.convert_batch_size) has the same bound."""
    from streaming.criteo import MAX_BATCH_SIZE
    good = tmp_path / "good.txt"
    good.write_text("\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 26) + "\n")
    assert main(["convert", "criteo", str(good), str(tmp_path / "out"), "--batch-size", str(1 << 62)]) == 2
    assert _err(capsys) == (f"engine convert: --batch-size must be <= {MAX_BATCH_SIZE} (rows per record batch, whose "
                            f"buffers are allocated up front), got {1 << 62}")
    assert main(["train", CTR, "--set", f"model.data.convert_batch_size={MAX_BATCH_SIZE + 1}"]) == 2
    assert f"model.data.convert_batch_size must be <= {MAX_BATCH_SIZE}" in _err(capsys)


@pytest.mark.parametrize("override, needle", [
    ("model.bogus=1", "model: unknown key(s) ['bogus']"),
    ("model.batch_size=0", "model.batch_size must be >= 1, got 0"),
    ("model.data.source=parquet", "model.data.source must be one of"),
    ("mode=fast", "mode must be one of"),
    ("tables.sparse.embedding.dim=7", "tables.sparse.embedding.dim must be 10"),
    ("model.slots=[C1,X9]", "model.slots: unknown column(s) ['X9']"),
])
def test_train_bad_config(override, needle, capsys):
    assert main(["train", CTR, "--set", override]) == 2
    assert needle in _err(capsys)


@pytest.mark.parametrize("kind, learns", [("ctr_dnn", "only the output bias learns"),
                                           ("deepfm", "only the first-order weights learn")])
def test_zero_initialized_embeddings_without_dense_features_are_refused(kind, learns, capsys):
    """Every input of the tower is 0 and ReLU'(0) = 0: no gradient ever reaches the embeddings (checked on
    the models: ctr_dnn's gradients are all 0 but the output bias's, deepfm's but the first-order weights')."""
    config = CTR if kind == "ctr_dnn" else str(REPO / "configs" / "deepfm.yaml")
    assert main(["train", config, "--set", "tables.sparse.embedding.initializer=zeros",
                 "--set", "model.dense_dim=0"]) == 2
    msg = _err(capsys)
    assert "tables.sparse.embedding.initializer: zeros with model.dense_dim=0 cannot train" in msg and learns in msg


def test_resume_fallback_without_resume_is_refused(capsys):
    """It was accepted and did nothing: the job started fresh, which the flag's user did not mean."""
    assert main(["train", CTR, "--resume-fallback"]) == 2
    assert "--resume-fallback: only with --resume" in _err(capsys)


@pytest.mark.parametrize("flags, needle", [
    (["--port", "99999"], "--port must be in [0, 65535] (0: a free port), got 99999"),
    (["--port", "-5"], "--port must be in [0, 65535] (0: a free port), got -5"),
    (["--health-port", "-7"], "--health-port must be in [-1, 65535] (-1: off, 0: a free port), got -7"),
    (["--ready-file", "/nonexistent-dir/ready"], "--ready-file /nonexistent-dir/ready: its directory /nonexistent-dir "
                                                 "does not exist"),
    (["--result-file", "/nonexistent-dir/r.json"], "--result-file /nonexistent-dir/r.json: its directory"),
])
def test_train_flags_out_of_range_are_refused(flags, needle, capsys):
    """A server given ``--port 99999`` listened on 34463 (gRPC takes the port modulo 2^16) without a word,
    ``--health-port -7`` was taken as off, and a ready or result file in a missing directory ended the role
    with a FileNotFoundError traceback once it was listening (or had trained)."""
    assert main(["train", str(REPO / "configs" / "logreg_demo.yaml"), *flags]) == 2
    assert needle in _err(capsys)


@pytest.mark.parametrize("size", ["0", "-1"])
def test_predict_batch_size_below_one_is_refused(tmp_path, size, capsys):
    """It reached ArrowSource's ValueError once the bundle had loaded: a traceback, exit 1."""
    assert main(["predict", str(tmp_path / "bundle"), str(tmp_path / "data.arrow"), "--batch-size", size]) == 2
    assert _err(capsys) == f"engine predict: --batch-size must be >= 1, got {size}"


@pytest.mark.parametrize("flags, needle", [
    (["--interval", "nan"], "engine status: --interval must be in (0, 2147483] seconds, got nan"),
    (["--interval", "1e308"], "engine status: --interval must be in (0, 2147483] seconds, got 1e+308"),
    (["--timeout", "0"], "engine status: --timeout must be in (0, 2147483] seconds, got 0"),
])
def test_status_interval_and_timeout_out_of_range_are_refused(flags, needle, capsys):
    """``--interval nan`` and ``--interval 1e308`` passed the "> 0" check and ended in a ValueError and an
    OverflowError traceback from time.sleep (exit 1)."""
    assert main(["status", "127.0.0.1:1", "--once", "--json", *flags]) == 2
    assert _err(capsys) == needle


@pytest.mark.parametrize("argv, needle", [
    (["certs", "", "--hosts", "localhost"], "engine certs: OUT_DIR is empty; name the directory to write the "
                                            "credentials into"),
    (["k8s", str(REPO / "configs" / "logreg_demo.yaml"), "--out", "", "--image", "x",
      "--set", "security.insecure=true", "--set", "checkpoint.root=s3://b/ckpt"],
     "engine k8s: --out is empty; name the directory to write the manifests into"),
])
def test_an_empty_output_directory_is_refused(tmp_path, monkeypatch, argv, needle, capsys):
    """``engine certs '' --hosts ''`` wrote the CA key, certificates and tokens into the current directory (a
    repository checkout, here), exit 0; ``engine k8s --out ''`` wrote the manifests there and printed
    ``kubectl apply -f ''``."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert _err(capsys) == needle
    assert list(tmp_path.iterdir()) == []


def test_train_run_dir_that_cannot_be_made_is_refused(tmp_path, capsys):
    """A --run-dir (or cluster.run_root) that is a file ended in a FileExistsError traceback from the
    launcher, exit 1."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    demo = str(REPO / "configs" / "logreg_demo.yaml")
    assert main(["train", demo, "--run-dir", str(afile)]) == 2
    assert _err(capsys) == f"engine train: config error: --run-dir {afile}: exists and is not a directory"
    assert main(["train", demo, "--set", f"cluster.run_root={afile}/runs"]) == 2
    assert _err(capsys) == (f"engine train: config error: cluster.run_root {afile}/runs: cannot create it: "
                            f"Not a directory")


def test_bad_role_environment_is_one_line_and_breaks_no_other_command(monkeypatch, capsys):
    """``ENGINE_RANK=x`` raised a ValueError while building the parser, so every ``engine`` command (status,
    plan, ...) died with a traceback; ``ENGINE_ROLE=serve`` ran the launcher without a word."""
    demo = str(REPO / "configs" / "logreg_demo.yaml")
    monkeypatch.setenv("ENGINE_RANK", "x")
    assert main(["status", "h:99999", "--once"]) == 2                      # its own error, not the variable's
    assert "h:99999" in _err(capsys)
    assert main(["train", demo, "--role", "worker"]) == 2
    assert _err(capsys) == "engine train: config error: ENGINE_RANK must be an int, got 'x'"
    monkeypatch.delenv("ENGINE_RANK")
    monkeypatch.setenv("ENGINE_ROLE", "serve")
    assert main(["train", demo]) == 2
    assert _err(capsys) == ("engine train: config error: ENGINE_ROLE must be server or worker (or empty: the "
                            "launcher), got 'serve'")


def test_train_missing_data_path(tmp_path, capsys):
    assert main(["train", CTR, "--set", "model.data.source=criteo",
                 "--set", f"model.data.criteo_path={tmp_path}/missing.txt"]) == 2
    msg = _err(capsys)
    assert "model.data.criteo_path" in msg and "missing.txt" in msg
    assert main(["train", CTR, "--set", "model.data.source=arrow",
                 "--set", f"model.data.train_path={tmp_path}/nodir"]) == 2
    msg = _err(capsys)
    assert "model.data.train_path" in msg and "nodir" in msg


def test_train_wrong_schema_arrow(tmp_path, capsys):
    path = tmp_path / "bad.arrow"
    t = pa.table({"label": pa.array(np.zeros(4), pa.float32()),
                  "dense": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(52), pa.float32()), 13),
                  **{f"C{j}": pa.array(np.arange(4), pa.uint64()) for j in range(1, 27) if j != 5},
                  "C5": pa.array([1.5, 2.5, 3.5, 4.5], pa.float64())})   # raw strings would be hashed
    with pa.ipc.new_stream(str(path), t.schema) as w:
        w.write_table(t)
    assert main(["train", CTR, "--set", "model.data.source=arrow", "--set", f"model.data.train_path={path}",
                 "--set", f"model.data.test_path={path}"]) == 2
    msg = _err(capsys)
    assert "'C5'" in msg and "uint64" in msg and "double" in msg and "bad.arrow" in msg
