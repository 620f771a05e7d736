"""``engine export`` never destroys what it was not asked to replace, and a failed export loses nothing.

Before: any directory at OUT without ``_SUCCESS`` (a user's directory, the checkpoint root) was taken for
the leftovers of a crashed publish and deleted, exit 0; ``--overwrite`` deleted the old bundle before a
damaged ``--delta`` was read (exit 2, bundle gone), and ``--delta b0`` with OUT = b0 destroyed b0; a
kill during ``--overwrite`` left no bundle. Now: OUT must be absent, empty, a crashed export's leftovers
(bundle-layout names only) or, with ``--overwrite``, a bundle; OUT may not overlap the source's
checkpoints; every input is read and checked first; on a local disk the new bundle is staged beside OUT
and swapped in. Also: ``engine eval`` refuses a checkpoint of another model, ``engine predict`` names
the file and row of a missing or mistyped column.

The checkpoint (a small CTR-DNN written by an in-process PS cluster) and its bundle come from the
module fixture of ``test_predict_bad_input``; real ``engine`` processes where the audit used them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.cli import main
from engine.export import load_bundle, open_bundle
from tests.contract.storage_fixtures import moto_s3, s3_bucket, s3_storage_options  # noqa: F401 (fixtures)
from tests.integration.test_predict_bad_input import SLOTS, _eval_config, _table, _write, setup  # noqa: F401 (fixture)
from tests.waiting import killed_after_first_line

REPO = Path(__file__).resolve().parents[2]


def _engine(*argv, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def _last_err(res_or_err) -> str:
    err = res_or_err if isinstance(res_or_err, str) else res_or_err.stderr
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("engine ")]
    assert lines, err
    return lines[-1]


def _tree(p: Path) -> dict[str, bytes]:
    return {q.relative_to(p).as_posix(): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file()}


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


@pytest.fixture
def ckpt(setup, tmp_path):      # noqa: F811 - the fixture imported above
    """A private copy of the checkpoint root: ``(root, job root)``."""
    root = tmp_path / "ck"
    shutil.copytree(setup[1].parent, root)
    return root, root / setup[1].name


def test_a_directory_of_user_files_is_never_replaced(ckpt, tmp_path, capsys):
    _, job = ckpt
    out = tmp_path / "mine"
    (out / "data").mkdir(parents=True)
    (out / "notes.txt").write_text("precious")
    (out / "data" / "x.csv").write_text("1,2\n")
    before = _tree(out)
    res = _engine("export", job, out)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    line = _last_err(res)
    assert line.startswith(f"engine export: {out}: exists and is not a bundle") and "data" in line \
        and "notes.txt" in line, line
    assert main(["export", str(job), str(out), "--overwrite"]) == 2          # --overwrite changes nothing
    assert "is not a bundle" in _last_err(capsys.readouterr().err)
    assert _tree(out) == before
    # a crashed export's leftovers (bundle-layout names only, no _SUCCESS) and an empty directory are replaced
    crashed, empty = tmp_path / "crashed", tmp_path / "empty"
    (crashed / "embeddings").mkdir(parents=True)
    (crashed / "embeddings" / "group-00003-of-00016.arrow").write_bytes(b"half")
    (crashed / "dense.npz").write_bytes(b"")
    empty.mkdir()
    for d in (crashed, empty):
        assert main(["export", str(job), str(d)]) == 0
        assert len(load_bundle(str(d))) > 0


def test_the_checkpoints_are_never_an_output(ckpt, capsys):
    root, job = ckpt
    before = _tree(root)
    ck_dir = next(job.glob("*/*-base"))
    res = _engine("export", job, root)                     # OUT = the checkpoint root: holds the job
    assert res.returncode == 2, res.stderr
    assert _last_err(res) == (f"engine export: {root}: the output contains the source checkpoint's job root "
                              f"{job}; refusing to write there (the publish would replace the checkpoints): "
                              f"export outside {job}")
    for out, extra in ((job, []), (ck_dir, ["--overwrite"]), (job / "bundles" / "b0", []), (ck_dir / "b", [])):
        assert main(["export", str(job), str(out), *extra]) == 2, (out, extra)
        assert "refusing to write there" in _last_err(capsys.readouterr().err)
    assert _tree(root) == before


def test_a_complete_directory_that_is_not_a_bundle_is_never_overwritten(ckpt, tmp_path, capsys):
    _, job = ckpt
    other = tmp_path / "other"                             # a published checkpoint copied elsewhere
    shutil.copytree(next(job.glob("*/*-base")), other)
    before = _tree(other)
    assert main(["export", str(job), str(other), "--overwrite"]) == 2
    line = _last_err(capsys.readouterr().err)
    assert line.startswith(f"engine export: {other}: exists and is not a bundle") and "dense" in line, line
    assert _tree(other) == before
    # a bundle is replaced with --overwrite (staged beside it: nothing else is left in its directory)
    b0 = tmp_path / "out" / "b0"
    assert main(["export", str(job), str(b0)]) == 0
    old = open_bundle(str(b0)).export_id
    capsys.readouterr()
    assert main(["export", str(job), str(b0)]) == 2
    assert _last_err(capsys.readouterr().err) == (f"engine export: {b0}: already published; pass --overwrite "
                                                  f"to replace it")
    assert main(["export", str(job), str(b0), "--overwrite"]) == 0
    assert open_bundle(str(b0)).export_id != old and len(load_bundle(str(b0))) > 0
    assert os.listdir(b0.parent) == ["b0"]


def test_overwrite_reads_and_checks_every_input_before_touching_the_bundle(ckpt, tmp_path, capsys):
    _, job = ckpt
    b0, d1, bad = tmp_path / "b0", tmp_path / "d1", tmp_path / "bad"
    assert main(["export", str(job), str(b0)]) == 0
    assert main(["export", str(job), str(d1), "--delta", str(b0)]) == 0
    capsys.readouterr()
    shutil.copytree(b0, bad)
    _flip(max((bad / "embeddings").iterdir(), key=lambda p: p.stat().st_size))
    keep, old = _tree(b0), open_bundle(str(b0)).export_id
    res = _engine("export", job, b0, "--overwrite", "--delta", bad)
    assert res.returncode == 2, res.stderr
    assert "crc32" in _last_err(res) and str(bad) in _last_err(res)
    assert _tree(b0) == keep and open_bundle(str(b0)).export_id == old
    res = _engine("export", job, b0, "--overwrite", "--delta", b0)          # a delta over its own parent
    assert res.returncode == 2, res.stderr
    assert _last_err(res) == (f"engine export: --delta {b0}: the output {b0} is that bundle; a delta cannot "
                              f"replace a bundle it is made on: export it to a new directory")
    assert main(["export", str(job), str(b0), "--overwrite", "--delta", str(d1)]) == 2    # b0 is in d1's chain
    assert "is a link of its chain" in _last_err(capsys.readouterr().err)
    assert _tree(b0) == keep
    load_bundle(str(d1))                                    # the chain still loads


def test_a_killed_overwrite_leaves_the_old_bundle(ckpt, tmp_path, capsys):
    """SIGKILL while the new bundle is being written (local disk): the old bundle is still at OUT, whole;
    the staged one is removed by the next export to OUT."""
    _, job = ckpt
    b0 = tmp_path / "serve" / "b0"
    assert main(["export", str(job), str(b0)]) == 0
    keep, old = _tree(b0), open_bundle(str(b0)).export_id
    code = ("import sys, time\nimport hdfs_io.publish as P\norig = P.Publisher.write_table\n"
            "def slow(self, *a, **k):\n    r = orig(self, *a, **k)\n    print(self.dir, flush=True)\n"
            "    time.sleep(60)\n    return r\nP.Publisher.write_table = slow\nfrom engine.cli import main\n"
            f"sys.exit(main(['export', {str(job)!r}, {str(b0)!r}, '--overwrite']))\n")
    staged = killed_after_first_line(code, REPO)
    assert staged.startswith(".b0.export-"), staged
    assert _tree(b0) == keep and open_bundle(str(b0)).export_id == old
    assert sorted(os.listdir(b0.parent)) == sorted(["b0", staged])
    capsys.readouterr()
    assert main(["export", str(job), str(b0), "--overwrite"]) == 0
    assert os.listdir(b0.parent) == ["b0"] and open_bundle(str(b0)).export_id != old


def test_s3_a_foreign_prefix_and_a_damaged_delta_change_nothing(s3_bucket, s3_storage_options):  # noqa: F811
    import hdfs_io
    from engine.export import RowBatchSource, describe_model, export_bundle
    from engine.export.errors import ExportError
    from models import build_model
    m = build_model("ctr_dnn", num_slots=3, dim=4, dense_dim=2, hidden=(8,), seed=1)
    rows = pa.RecordBatch.from_arrays(
        [pa.array(np.arange(1, 201, dtype=np.uint64)),
         pa.FixedSizeListArray.from_arrays(pa.array(np.ones(800, np.float32)), 4)], names=["key", "values"])

    def src():
        return RowBatchSource(describe_model(m, SLOTS), m.get_dense(), [rows], "memory://t")
    root = f"s3://{s3_bucket}/safety-{os.getpid()}"
    st = hdfs_io.Storage.from_uri(root, storage_options=s3_storage_options)
    st.write_bytes("mine/report.csv", b"precious")
    with pytest.raises(ExportError, match=r"/mine: exists and is not a bundle \(it holds report.csv\)"):
        export_bundle(src(), f"{root}/mine", overwrite=True, storage_options=s3_storage_options, groups=2)
    assert st.read_bytes("mine/report.csv") == b"precious"
    export_bundle(src(), f"{root}/b0", storage_options=s3_storage_options, groups=2)
    export_bundle(src(), f"{root}/bad", storage_options=s3_storage_options, groups=2)
    name = "bad/embeddings/group-00000-of-00002.arrow"
    data = bytearray(st.read_bytes(name))
    data[len(data) // 2] ^= 0xFF
    st.write_bytes(name, bytes(data))
    old = open_bundle(f"{root}/b0", s3_storage_options).export_id
    with pytest.raises(hdfs_io.CheckpointCorruptError, match="crc32"):
        export_bundle(src(), f"{root}/b0", since=f"{root}/bad", overwrite=True, storage_options=s3_storage_options)
    assert open_bundle(f"{root}/b0", s3_storage_options).export_id == old
    hdfs_io.verify(st, "b0")


def test_eval_refuses_a_checkpoint_of_another_model(setup, tmp_path, capsys):   # noqa: F811
    _, job, good, _ = setup
    res = _engine("eval", _eval_config(tmp_path, good, kind="deepfm"), "--checkpoint", job)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    line = _last_err(res)
    assert line.startswith("engine eval: --checkpoint ") and line.endswith(
        "model.kind: the checkpoint holds 'ctr_dnn', the config says 'deepfm'; evaluate it with the config it "
        "was trained with"), line
    assert main(["eval", str(_eval_config(tmp_path, good, hidden="[16, 8]")), "--checkpoint", str(job)]) == 2
    assert "model.hidden: the checkpoint holds [8], the config says [16, 8]" in _last_err(capsys.readouterr().err)
    # a word2vec config: refused on the kind, before a fingerprint warning and a word id "outside the vocabulary"
    assert main(["eval", str(REPO / "configs" / "word2vec.yaml"), "--checkpoint", str(job)]) == 2
    err = capsys.readouterr().err
    assert _last_err(err).endswith("model.kind: the checkpoint holds 'ctr_dnn', the config says 'word2vec'; "
                                   "evaluate it with the config it was trained with") and "vocab" not in err, err
    assert main(["eval", str(_eval_config(tmp_path, good)), "--checkpoint", str(job)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["model"] == "ctr_dnn"


def test_predict_names_the_file_and_row_of_a_missing_or_mistyped_column(setup, tmp_path, capsys):  # noqa: F811
    bundle = setup[0]
    t = _table()
    cases = {
        "missing_C2": (t.drop(["C2"]), "field C2: expected a slot column (uint64, list<uint64> or string keys), "
                                       "but the column is missing (bundle slots C1, C2, C3)"),
        "float_C1": (t.set_column(t.schema.get_field_index("C1"), "C1", pa.array(np.zeros(len(t)))),
                     "field C1: expected uint64, list<uint64> or string keys, got double"),
        "dense_12": (t.set_column(t.schema.get_field_index("dense"), "dense", pa.FixedSizeListArray.from_arrays(
            pa.array(np.zeros(len(t) * 12, np.float32)), 12)),
                     "field dense: expected fixed_size_list<float32>[13], got fixed_size_list<item: float>[12]"),
    }
    for name, (table, expect) in cases.items():
        bad = _write(tmp_path / f"{name}.arrow", table)
        rc = main(["predict", str(bundle), str(bad)])
        err = capsys.readouterr().err
        assert rc == 2, (name, err)
        assert _last_err(err) == f"engine predict: {bad}: row 1: {expect}", (name, err)
