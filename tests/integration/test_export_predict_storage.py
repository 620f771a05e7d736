"""``engine export`` and ``engine predict`` reach S3 with a config's ``storage:`` section (``--config``), against
moto's S3 server as a process of its own that checks credentials: a key made in moto's IAM is the only one
it takes. The environment holds another key (``AWS_ACCESS_KEY_ID=wrong``, the endpoint set), so a command
that reached the store with the environment's credentials would be refused.

One moto server per module; one tiny CTR-DNN (slots C1..C3) pushed into an in-process PS cluster and
checkpointed on S3 and on local disk, exported to a bundle on S3 and one on local disk; the inputs are
600 rows as an IPC stream, an IPC file, Parquet, a directory of two streams and Criteo text, on S3 with a
local copy of each. Predictions read from S3 must equal those of the local copy.

Also: a store refusing the credentials is one line naming the side and its URI, exit 2 (checkpoint,
output, bundle, data, predictions; ``engine eval``'s checkpoint); one that does not answer is one line,
exit 1; predict's inputs are read as listed and checked (an object written again after its schema was
checked, or while it is read, is refused by URI and row); a bad value is named by URI, row and column; a word2vec
export's ``--vocab`` on S3 is read with the config's credentials (refused, missing or another corpus's: one
line, exit 2)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

import hdfs_io
from engine.cli import main
from engine.config import DenseTableConfig
from engine.export import CheckpointSource, snapshot_cluster
from engine.export.bundle import export_bundle
from engine.export.cli import PREDICT_CHANGED
from engine.ps import InProcessTransport, PSClient, PSServer
from models import build_model
from sparse_tables import TableConfig
from streaming import keys as K
from streaming.criteo import generate_criteo
from tests.integration.test_predict_bad_input import eval_config_text
from tests.integration.test_remote_inputs_train import _free_port, _moto

REPO = Path(__file__).resolve().parents[2]
SLOTS = ["C1", "C2", "C3"]
N = 600
CONFIG = {"model": {"kind": "ctr_dnn", "slots": SLOTS, "dim": 4, "dense_dim": 13, "hidden": [8], "seed": 0,
                    "sparse_table": "embedding", "dense_table": "dense"}}
CKPT = "s3://ckpts/root/ctr"            # the job root of the checkpoint on S3
BUNDLE = "s3://serving/bundle"
DATA = "s3://serving/data"
#: the inputs on S3 (below DATA) and locally (below the module's directory), by kind
INPUTS = {"stream": "stream.arrows", "file": "file.arrow", "parquet": "rows.parquet", "directory": "dir",
          "criteo text": "rows.txt"}


@dataclass
class Store:
    port: int
    key: str
    secret: str
    dir: Path
    config: Path            # storage: the moto endpoint, the IAM key through access_key_env / secret_key_env
    refused: Path           # storage: the moto endpoint, a key moto does not know
    ckpt_local: str         # the same checkpoint's job root on local disk
    bundle_local: str

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def fs(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(access_key=self.key, secret_key=self.secret, region="us-east-1", scheme="http",
                                 endpoint_override=self.endpoint, allow_bucket_creation=True)

    def options(self) -> hdfs_io.StorageOptions:
        return hdfs_io.StorageOptions(endpoint_override=self.endpoint, scheme="http", region="us-east-1",
                                      access_key=self.key, secret_key=self.secret)

    def env(self) -> dict[str, str]:
        """The environment of every command here: the config's variables, and AWS_* with a key moto refuses."""
        return {"SVC_KEY": self.key, "SVC_SECRET": self.secret, "AWS_ENDPOINT_URL": f"http://{self.endpoint}",
                "AWS_ACCESS_KEY_ID": "wrong", "AWS_SECRET_ACCESS_KEY": "wrong", "AWS_REGION": "us-east-1"}

    def put(self, key: str, data: bytes) -> None:
        with self.fs().open_output_stream(key) as f:
            f.write(data)


def _table(rows=N, seed=0, hash_version=None) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols = {"label": pa.array((rng.random(rows) < 0.3).astype(np.float32)),
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * 13).astype(np.float32)), 13)}
    for j, s in enumerate(SLOTS):
        cols[s] = pa.array(K.make_keys(j + 1, rng.integers(0, 50, rows)))
    t = pa.table(cols)
    return t if hash_version is None else t.replace_schema_metadata({"hash_version": str(hash_version)})


def _stream(t: pa.Table, chunk=100) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, t.schema) as w:
        w.write_table(t, max_chunksize=chunk)
    return sink.getvalue().to_pybytes()


def _file(t: pa.Table, chunk=100) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, t.schema) as w:
        w.write_table(t, max_chunksize=chunk)
    return sink.getvalue().to_pybytes()


def _parquet(t: pa.Table, chunk=200) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink, row_group_size=chunk)
    return sink.getvalue().to_pybytes()


def _iam_key(url: str) -> tuple[str, str]:
    """A user with every right and its key, made in moto's IAM by the 3 requests it takes unchecked
    (INITIAL_NO_AUTH_ACTION_COUNT=3): every later request needs that key."""
    import boto3
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="boot",
                       aws_secret_access_key="boot")
    iam.create_user(UserName="serving")
    iam.put_user_policy(UserName="serving", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    k = iam.create_access_key(UserName="serving")["AccessKey"]
    return k["AccessKeyId"], k["SecretAccessKey"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("export_storage")
    port = _free_port()
    moto = _moto(port, d / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
        key, secret = _iam_key(f"http://127.0.0.1:{port}")
        storage = f"storage: {{endpoint: '127.0.0.1:{port}', scheme: http, region: us-east-1, "
        (d / "config.yaml").write_text(storage + "access_key_env: SVC_KEY, secret_key_env: SVC_SECRET}\n")
        (d / "refused.yaml").write_text(storage + "access_key: AKIAUNKNOWN0000000000, secret_key: wrong}\n")
        s = Store(port, key, secret, d, d / "config.yaml", d / "refused.yaml", str(d / "ckpt" / "ctr"),
                  str(d / "bundle"))
        fs = s.fs()
        fs.create_dir("ckpts")
        fs.create_dir("serving")
        m = build_model("ctr_dnn", num_slots=len(SLOTS), dim=4, dense_dim=13, hidden=(8,))
        servers = [PSServer({"embedding": TableConfig(dim=m.sparse_width, optimizer="adagrad")},
                            {"dense": DenseTableConfig()}, index=0, num_servers=1, num_vshards=16, local_shards=1,
                            checkpoint_groups=2, storage_options=s.options())]
        client = PSClient(InProcessTransport(servers))
        try:
            client.init_dense("dense", m.get_dense())
            keys = np.concatenate([K.make_keys(j + 1, np.arange(50)) for j in range(len(SLOTS))])
            rng = np.random.default_rng(0)
            client.push("embedding", keys, rng.normal(size=(len(keys), m.sparse_width)).astype(np.float32),
                        shows=np.ones(len(keys), np.float32))
            snapshot_cluster(client, "s3://ckpts/root", "ctr", CONFIG, storage_options=s.options())
            local = snapshot_cluster(client, str(d / "ckpt"), "ctr", CONFIG)
        finally:
            client.close()
        export_bundle(local, s.bundle_local)
        export_bundle(CheckpointSource(CKPT, storage_options=s.options()), BUNDLE, storage_options=s.options())
        # the inputs, locally and on S3
        t = _table()
        files = {"stream.arrows": _stream(t), "file.arrow": _file(t), "rows.parquet": _parquet(t),
                 "dir/part-0.arrows": _stream(_table(N // 2, 1)), "dir/part-1.arrows": _stream(_table(N // 2, 2))}
        generate_criteo(d / "rows.txt", rows=N, seed=5)
        files["rows.txt"] = (d / "rows.txt").read_bytes()
        for name, data in files.items():
            (d / name).parent.mkdir(exist_ok=True)
            (d / name).write_bytes(data)
            s.put(f"{DATA.removeprefix('s3://')}/{name}", data)
        yield s
    finally:
        os.killpg(moto.pid, signal.SIGKILL)
        moto.wait(10)


@pytest.fixture
def env(store, monkeypatch):
    """The module's environment in this process (in-process runs of ``engine.cli.main``)."""
    for k, v in store.env().items():
        monkeypatch.setenv(k, v)
    return store


def _last(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def _preds(store: Store, uri: str) -> np.ndarray:
    if uri.startswith("s3://"):
        with store.fs().open_input_file(uri.removeprefix("s3://")) as f:
            return ipc.open_file(f).read_all().column("prob").to_numpy()
    return ipc.open_file(uri).read_all().column("prob").to_numpy()


def test_export_and_predict_reach_s3_with_the_configs_credentials_only(store, tmp_path):
    """The real commands, the config's key in SVC_KEY / SVC_SECRET, the environment's AWS_* key refused.
    Before, neither command took --config (exit 2, usage), and the environment's key was all they had."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **store.env()}
    out = f"s3://serving/exports/{uuid.uuid4().hex}"

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "engine", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=env)

    res = run("export", CKPT, out, "--config", str(store.config))
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["rows"] == 150
    res = run("export", CKPT, out + "-env")     # the environment's key: refused, naming the checkpoint
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1].startswith(f"engine export: checkpoint {CKPT}: access refused (")
    preds = f"s3://serving/preds/{uuid.uuid4().hex}.arrow"
    res = run("predict", out, f"{DATA}/dir", "--out", preds, "--config", str(store.config))
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["rows"] == N
    local = str(tmp_path / "local.arrow")
    assert main(["predict", store.bundle_local, str(store.dir / "dir"), "--out", local]) == 0
    np.testing.assert_array_equal(_preds(store, preds), _preds(store, local))


@pytest.mark.parametrize("kind", list(INPUTS))
def test_predict_reads_each_input_kind_from_s3_as_its_local_copy(env, kind, tmp_path, capsys):
    """Bundle, input and predictions on S3, reached with --config. Criteo text on S3 was read as Arrow
    before ("expected an Arrow IPC file or stream", exit 2): it is now copied, then converted."""
    name = INPUTS[kind]
    preds = f"s3://serving/preds/{kind.replace(' ', '-')}-{uuid.uuid4().hex}.arrow"
    assert main(["predict", BUNDLE, f"{DATA}/{name}", "--out", preds, "--config", str(env.config)]) == 0, \
        capsys.readouterr().err[-3000:]
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["rows"] == N and res["bundle"] == BUNDLE
    local = str(tmp_path / "local.arrow")
    assert main(["predict", env.bundle_local, str(env.dir / name), "--out", local]) == 0
    np.testing.assert_array_equal(_preds(env, preds), _preds(env, local))


@pytest.mark.parametrize("argv, line", [
    (["export", CKPT, "{tmp}/out"], f"engine export: checkpoint {CKPT}: access refused ("),
    (["export", "{ckpt_local}", "s3://serving/refused-out"],
     "engine export: output s3://serving/refused-out: access refused ("),
    (["predict", BUNDLE, "{dir}/stream.arrows"], f"engine predict: bundle {BUNDLE}: access refused ("),
    (["predict", "{bundle_local}", f"{DATA}/dir"], f"engine predict: data {DATA}/dir: access refused ("),
    (["predict", "{bundle_local}", "{dir}/stream.arrows", "--out", "s3://serving/refused.arrow"],
     "engine predict: output s3://serving/refused.arrow: access refused ("),
], ids=["export-checkpoint", "export-output", "predict-bundle", "predict-data", "predict-out"])
def test_credentials_the_store_refuses_are_one_line_naming_the_side_and_uri_exit_2(env, argv, line, tmp_path,
                                                                                   capsys):
    """Before: the checkpoint was "not an exportable checkpoint"; a refused bundle, output or predictions
    file a traceback (exit 1); refused data "storage unavailable: training input ..." (exit 1)."""
    argv = [a.format(tmp=tmp_path, ckpt_local=env.ckpt_local, dir=env.dir, bundle_local=env.bundle_local)
            for a in argv]
    assert main([*argv, "--config", str(env.refused)]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(line) and "no retry mends that" in last, err[-3000:]
    assert "Traceback" not in err and "retrying" not in err
    assert not (tmp_path / "out").exists()


def test_eval_names_a_checkpoint_whose_store_refuses_the_credentials(env, capsys):
    """Before: "not an exportable checkpoint: expected a checkpoint directory ...", exit 2."""
    sets = [f"storage.endpoint={env.endpoint}", "storage.scheme=http", "storage.region=us-east-1",
            "storage.access_key=AKIAUNKNOWN0000000000", "storage.secret_key=wrong"]
    assert main(["eval", str(REPO / "configs" / "word2vec.yaml"), "--checkpoint", CKPT,
                 *[a for s in sets for a in ("--set", s)]]) == 2
    last = _last(capsys)
    assert last.startswith(f"engine eval: checkpoint {CKPT}: access refused (") and "INVALID_ACCESS_KEY_ID" in last


def test_a_store_that_does_not_answer_is_one_line_naming_the_data_exit_1(env, tmp_path, capsys):
    """--config's endpoint, where nothing listens: the retries (hdfs_io.RetryPolicy over the SDK's), then
    one line. Before, --config was not an option (exit 2, usage)."""
    dead = tmp_path / "dead.yaml"
    dead.write_text(env.config.read_text().replace(env.endpoint, f"127.0.0.1:{_free_port()}"))
    assert main(["predict", env.bundle_local, f"{DATA}/dir", "--config", str(dead)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"engine predict: data storage unavailable: {DATA}/dir: stat "
                                                   f"{DATA}/dir failed after 5 attempts"), err[-3000:]


@pytest.mark.long       # make test-long: two rounds of retries, ~9 s (the line existed; --config is new)
def test_export_to_or_from_a_store_that_does_not_answer_names_the_side_exit_1(env, tmp_path, capsys):
    """One round of retries each: the checkpoint's job root listed once (before, its listing was followed by
    a stat through a second round: hdfs_io.Storage.children)."""
    dead = tmp_path / "dead.yaml"
    dead.write_text(env.config.read_text().replace(env.endpoint, f"127.0.0.1:{_free_port()}"))
    assert main(["export", CKPT, str(tmp_path / "out"), "--config", str(dead)]) == 1
    assert _last(capsys).startswith(f"engine export: checkpoint storage unavailable: list {CKPT} failed after 5 "
                                    f"attempts")
    assert main(["export", env.ckpt_local, "s3://serving/out", "--config", str(dead)]) == 1
    assert _last(capsys).startswith("engine export: output storage unavailable (writing s3://serving/out): ")


@pytest.mark.parametrize("argv, needle", [
    (["--set", "storage.endpoint=x"], "--set storage.endpoint=x: --set overrides a value of --config, and no "
                                      "--config was given"),
    (["--config", "{dir}/missing.yaml"], "config file not found: {dir}/missing.yaml"),
    (["--config", "{config}", "--set", "storage.scheme=ftp"], "storage.scheme must be one of"),
    (["--config", "{config}", "--set", "storage.access_key_env=NOT_SET_HERE"],
     "storage.access_key_env names the environment variable 'NOT_SET_HERE', which is not set in this process"),
], ids=["set-without-config", "missing", "bad-value", "unset-variable"])
@pytest.mark.parametrize("command", ["export", "predict"])
def test_a_config_that_does_not_load_is_one_line_exit_2(env, command, argv, needle, tmp_path, capsys):
    argv = [a.format(dir=tmp_path, config=env.config) for a in argv]
    args = [CKPT, str(tmp_path / "out")] if command == "export" else [BUNDLE, f"{DATA}/dir"]
    assert main([command, *args, *argv]) == 2
    last = _last(capsys)
    assert last.startswith(f"engine {command}: ") and needle.format(dir=tmp_path) in last, last


def test_an_object_written_again_after_predict_checked_it_is_refused_not_scored_unchecked(env, monkeypatch,
                                                                                          capsys):
    """``engine predict`` checks every input's schema (its ``hash_version`` against the bundle's, its
    label column) and then reads the inputs. It listed the store twice: once for the check, again to read,
    so an object written again in between was scored as the check never saw it; keys hashed with another
    ``hash_version`` then scored silently (exit 0) with the checked file's metadata. The inputs are now
    read as listed and checked: the new version is refused at its open, naming the URI."""
    import engine.export.cli as cli
    key = f"{DATA.removeprefix('s3://')}/rewritten-{uuid.uuid4().hex}.arrows"
    env.put(key, _stream(_table(hash_version=K.HASH_VERSION)))
    other = _stream(_table(hash_version=K.HASH_VERSION + 1))
    checked = cli._input_schema

    def input_schema(*a, **kw):
        out = checked(*a, **kw)
        env.put(key, other)             # the same size: only the content's tag tells the versions apart
        return out
    monkeypatch.setattr(cli, "_input_schema", input_schema)
    assert main(["predict", BUNDLE, f"s3://{key}", "--config", str(env.config)]) == 2
    last = _last(capsys)
    assert last.startswith(f"engine predict: s3://{key}: row 1: field <record batch 0>: expected the object as the job "
                           f"listed it") and last.endswith(PREDICT_CHANGED), last


def _rewritten_after_the_first_batch(env, monkeypatch, write, tmp_path):
    """``engine predict`` of a 600-row object on S3 written again (other rows) as its first batch of 16 is
    scored; ``(exit code, rows scored, key, --out URI, the old version's local path)``."""
    from engine.export.predictor import Bundle
    suffix = {_stream: "arrows", _file: "arrow", _parquet: "parquet"}[write]
    key = f"{DATA.removeprefix('s3://')}/overwritten-{uuid.uuid4().hex}.{suffix}"
    old, new = write(_table(), 16), write(_table(seed=9), 16)
    assert len(old) == len(new) or write is _parquet      # the same size: only the ETag tells them apart
    env.put(key, old)
    (tmp_path / f"old.{suffix}").write_bytes(old)
    scored = []
    predict = Bundle.predict

    def scoring(self, rb):
        if not scored:
            env.put(key, new)
        scored.append(rb.num_rows)
        return predict(self, rb)
    monkeypatch.setattr(Bundle, "predict", scoring)
    out = f"s3://serving/preds/overwritten-{uuid.uuid4().hex}.arrow"
    code = main(["predict", BUNDLE, f"s3://{key}", "--batch-size", "16", "--out", out, "--config", str(env.config)])
    monkeypatch.setattr(Bundle, "predict", predict)
    return code, sum(scored), key, out, str(tmp_path / f"old.{suffix}")


@pytest.mark.parametrize("write", [_stream, _file], ids=["stream", "file"])
def test_an_object_written_again_while_predict_reads_it_is_refused_before_a_row_of_the_new_version(
        env, monkeypatch, write, tmp_path, capsys):
    """The reads are pinned to the version the first open saw (streaming.inputs, as training's): the old
    version's rows only, then one line naming the URI and the row, exit 2, no predictions file. (Before
    too: this audit found predict reading through the same pinned reader.)"""
    import streaming.inputs
    monkeypatch.setattr(streaming.inputs, "STREAM_BUFFER_BYTES", 4096)     # several ranged GETs per file
    code, scored, key, out, _ = _rewritten_after_the_first_batch(env, monkeypatch, write, tmp_path)
    assert code == 2 and 0 < scored < N
    last = _last(capsys)
    assert last.startswith(f"engine predict: s3://{key}: row ") and "expected the object the read began on" in last \
        and last.endswith(PREDICT_CHANGED), last
    assert not [i for i in env.fs().get_file_info(pafs.FileSelector("serving/preds")) if "overwritten" in i.path]


def test_parquet_written_again_while_predict_reads_it_is_scored_as_the_version_it_opened(env, monkeypatch, tmp_path,
                                                                                          capsys):
    """Parquet is read with pre_buffer: the column chunks of every row group are fetched at the open
    (coalesced, each read checked against the ETag the open saw), so a rewrite after the first batch finds
    nothing left to read: every prediction is the old version's, none of the new one's."""
    code, scored, key, out, old = _rewritten_after_the_first_batch(env, monkeypatch, _parquet, tmp_path)
    assert code == 0 and scored == N, capsys.readouterr().err[-3000:]
    local = str(tmp_path / "local.arrow")
    assert main(["predict", env.bundle_local, old, "--out", local]) == 0
    np.testing.assert_array_equal(_preds(env, out), _preds(env, local))


def test_a_bad_value_on_s3_is_named_by_uri_row_and_column(env, capsys):
    t = _table()
    d = t.column("dense").combine_chunks().flatten().to_numpy().copy()
    d[450 * 13 + 2] = np.nan
    t = t.set_column(t.schema.get_field_index("dense"), "dense", pa.FixedSizeListArray.from_arrays(pa.array(d), 13))
    key = f"{DATA.removeprefix('s3://')}/bad-{uuid.uuid4().hex}.arrows"
    env.put(key, _stream(t))
    assert main(["predict", BUNDLE, f"s3://{key}", "--config", str(env.config)]) == 2
    assert _last(capsys) == f"engine predict: s3://{key}: row 451: field dense: expected a finite number at position " \
                            f"2, got nan"


@pytest.fixture(scope="module")
def w2v(store, tmp_path_factory):
    """``(converted corpus dir, word2vec checkpoint URI on local disk)``; its vocab.arrow on S3 under
    ``s3://serving/w2v/corpus/``, another corpus's under ``s3://serving/w2v/other/``."""
    from tests.unit.test_w2v_vocab_identity import _checkpoint, _convert
    d = tmp_path_factory.mktemp("w2v_vocab")
    _convert(d, "the cat sat on the mat\nthe dog sat\n", d / "arrow")
    _convert(d, "a cat sat on a mat\na a dog sat\n", d / "other")
    store.put("serving/w2v/corpus/vocab.arrow", (d / "arrow" / "vocab.arrow").read_bytes())
    store.put("serving/w2v/other/vocab.arrow", (d / "other" / "vocab.arrow").read_bytes())
    return d / "arrow", _checkpoint(d / "arrow", d / "ckpt")


@pytest.mark.parametrize("vocab", ["s3://serving/w2v/corpus/vocab.arrow", "s3://serving/w2v/corpus"],
                         ids=["file", "directory"])
def test_word2vec_export_reads_its_vocab_from_s3_with_the_configs_credentials(env, w2v, vocab, tmp_path, capsys):
    """Before, --vocab had to be local: an s3:// one was opened as a local path (exit 2, "Failed to open local
    file 's3:/serving/...'"). The file's copy passes the checkpoint's fingerprint; the vectors are the local
    vocabulary's."""
    arrow, ckpt = w2v
    local, out = tmp_path / "local.txt", tmp_path / "s3.txt"
    assert main(["export", ckpt, str(local), "--format", "word2vec", "--vocab", str(arrow / "vocab.arrow")]) == 0
    assert main(["export", ckpt, str(out), "--format", "word2vec", "--vocab", vocab, "--config", str(env.config)]) \
        == 0, capsys.readouterr().err[-3000:]
    assert out.read_bytes() == local.read_bytes()


#: (--vocab, the config it is read with, how the one line after "engine COMMAND: " starts) of a word2vec
#: vocabulary on S3 that engine export and engine eval refuse, exit 2
VOCAB_REFUSALS = pytest.mark.parametrize("vocab, config, line", [
    ("s3://serving/w2v/corpus/vocab.arrow", "refused", "--vocab s3://serving/w2v/corpus/vocab.arrow: access refused ("),
    ("s3://serving/w2v/nothing/vocab.arrow", "config",
     "vocabulary s3://serving/w2v/nothing/vocab.arrow: file not found: s3://serving/w2v/nothing/vocab.arrow"),
    ("s3://serving/w2v", "config", "vocabulary s3://serving/w2v: file not found: s3://serving/w2v/vocab.arrow"),
    ("s3://serving/w2v/other", "config", "s3://serving/w2v/other: not the vocabulary "),
], ids=["refused", "missing", "directory-without-vocab", "another-corpus"])


@VOCAB_REFUSALS
def test_a_word2vec_vocab_on_s3_that_cannot_be_used_is_one_line_exit_2(env, w2v, vocab, config, line, tmp_path,
                                                                       capsys):
    _, ckpt = w2v
    cfg = env.refused if config == "refused" else env.config
    assert main(["export", ckpt, str(tmp_path / "out.txt"), "--format", "word2vec", "--vocab", vocab,
                 "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"engine export: {line}"), err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "out.txt").exists()


def test_eval_names_test_data_whose_store_refuses_the_credentials_in_its_own_words(env, tmp_path, capsys):
    """``engine eval``'s data on a store refusing the config's key: one line naming the data, exit 2. Before,
    "engine eval: training input s3://...": a training job's words for an evaluation's input."""
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(env.refused.read_text() + eval_config_text(tmp_path, f"{DATA}/dir", f"{DATA}/dir"))
    assert main(["eval", str(cfg), "--checkpoint", env.ckpt_local]) == 2
    last = _last(capsys)
    assert last.startswith(f"engine eval: data {DATA}/dir: access refused (") and "no retry mends that" in last, last


def _w2v_eval(cfg: Path, tmp_path: Path, ckpt: str, *more: str) -> int:
    """``engine eval`` of the word2vec config (``configs/word2vec.yaml``) under ``cfg``'s storage section, on
    benchmarks whose words all are in the module's corpus; nothing written into the repository."""
    ev = tmp_path / "ev"
    ev.mkdir(exist_ok=True)
    pairs = "cat\tdog\t1.0\nsat\tmat\t2.0\ncat\ton\t3.0\n"
    (ev / "wordsim353.tsv").write_text(pairs)
    (ev / "simlex999.txt").write_text(pairs)
    (ev / "questions-words.txt").write_text(": s\ncat dog sat mat\n")
    config = tmp_path / f"w2v-{cfg.stem}.yaml"
    config.write_text(cfg.read_text() + (REPO / "configs" / "word2vec.yaml").read_text())
    return main(["eval", str(config), "--checkpoint", ckpt, "--set", f"model.eval_data_dir={ev}",
                 "--set", f"model.arrow_dir={tmp_path / 'no-corpus'}", "--set", f"checkpoint.root={tmp_path / 'ck'}",
                 *more])


@pytest.mark.parametrize("vocab", ["s3://serving/w2v/corpus/vocab.arrow", "s3://serving/w2v/corpus"],
                         ids=["file", "directory"])
def test_word2vec_eval_reads_its_vocab_from_s3_with_the_configs_credentials(env, w2v, vocab, tmp_path, capsys):
    """``engine eval --vocab`` takes a URI, copied with the config's storage section as ``engine export --vocab``
    copies it (``w2v.local_vocab``); the local vocab.arrow the checkpoint records is moved away meanwhile, and the
    scores equal those of an eval on it. Before, eval took a local vocab.arrow only (``os.path.isfile``) and had
    no --vocab: the one the checkpoint records, else model.arrow_dir's."""
    arrow, ckpt = w2v
    assert _w2v_eval(env.config, tmp_path, ckpt) == 0, capsys.readouterr().err[-3000:]
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    os.replace(arrow / "vocab.arrow", tmp_path / "moved.arrow")
    try:
        rc = _w2v_eval(env.config, tmp_path, ckpt, "--vocab", vocab)
    finally:
        os.replace(tmp_path / "moved.arrow", arrow / "vocab.arrow")
    assert rc == 0, capsys.readouterr().err[-3000:]
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got == local and got["words"] == 6 and got["analogy_evaluated"] == 1


@VOCAB_REFUSALS
def test_a_word2vec_eval_vocab_on_s3_that_cannot_be_used_is_one_line_exit_2(env, w2v, vocab, config, line,
                                                                            tmp_path, capsys):
    _, ckpt = w2v
    assert _w2v_eval(env.refused if config == "refused" else env.config, tmp_path, ckpt, "--vocab", vocab) == 2
    cap = capsys.readouterr()
    assert cap.err.strip().splitlines()[-1].startswith(f"engine eval: {line}"), cap.err[-3000:]
    assert "Traceback" not in cap.err and cap.out == ""
