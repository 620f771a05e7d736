"""``engine train`` of CTR-DNN with its train and test splits on S3 (moto's server, a real S3 endpoint on
127.0.0.1), read by every process straight from the store with the config's ``storage`` section
(``streaming.inputs``): the job trains every row once and scores every test row; a store that is
unreachable names the input's URI and ends the job before any process starts; and a store lost in the
middle of training (moto's process killed, started again empty, the inputs put back) restarts the job
from its checkpoint (the recovery rule), which then trains every row exactly once."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from streaming.criteo import convert_criteo, generate_criteo
from streaming.source import count_rows, list_files
from tests.contract.storage_fixtures import moto_s3, s3_bucket, s3_storage_options  # noqa: F401
from tests.integration.test_offline_resume import _state

REPO = Path(__file__).resolve().parents[2]
ROWS = 4000
SLOTS = 26                       # configs/ctr.yaml's model.slots


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """Local train/test splits of 4,000 generated Criteo rows, in 4 and 2 IPC stream files."""
    d = tmp_path_factory.mktemp("remote_train")
    generate_criteo(d / "rows.txt", ROWS, 11)
    for split in ("train", "test"):
        convert_criteo([d / "rows.txt"], d / split, split=split, batch_size=256)
    return d


def _s3fs(endpoint: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                             endpoint_override=endpoint, allow_bucket_creation=True)


def _upload(splits: Path, endpoint: str, prefix: str) -> None:
    fs = _s3fs(endpoint)
    fs.create_dir(prefix.split("/")[0])
    for split in ("train", "test"):
        pafs.copy_files(str(splits / split), f"{prefix}/{split}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)


def _cmd(endpoint: str, prefix: str, tmp: Path, *sets: str) -> list[str]:
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp / "run"),
            *[a for s in ("model.data.source=arrow", f"model.data.train_path=s3://{prefix}/train",
                          f"model.data.test_path=s3://{prefix}/test", f"storage.endpoint={endpoint}",
                          "storage.scheme=http", "storage.region=us-east-1", "storage.access_key=testing",
                          "storage.secret_key=testing", f"model.metrics_dir={tmp / 'metrics'}",
                          f"observability.tensorboard_dir={tmp / 'tb'}",
                          f"checkpoint.root={tmp / 'ckpt'}", "model.hidden=[32]", "cluster.workers=2", *sets)
              for a in ("--set", s)]]


def _events(final: dict) -> list[dict]:
    return [json.loads(line) for line in Path(final["metrics_file"]).read_text().splitlines()]


def _test_rows(splits: Path) -> int:
    return sum(count_rows(f) for f in list_files(str(splits / "test")))


def _train_rows(splits: Path) -> int:
    return sum(count_rows(f) for f in list_files(str(splits / "train")))


def test_a_job_trains_and_evaluates_on_splits_read_from_s3(splits, moto_s3, s3_bucket, tmp_path):
    prefix = f"{s3_bucket}/train-from-s3-{os.getpid()}"
    _upload(splits, moto_s3.endpoint, prefix)
    res = subprocess.run(_cmd(moto_s3.endpoint, prefix, tmp_path, "mode=sync", "model.epochs=1"), cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
    assert res.returncode == 0, res.stderr[-3000:]
    final = json.loads(res.stdout.strip().splitlines()[-1])
    events = _events(final)
    start = events[0]
    assert start["train_path"] == f"s3://{prefix}/train" and start["train_rows"] == _train_rows(splits)
    (ev,) = [e for e in events if e["event"] == "eval"]
    assert ev["count"] == _test_rows(splits)                 # every test row scored once, from S3
    assert 0.55 < final["test_auc"] <= 1.0
    # every train row read from S3 once: one show per example and slot (sync mode leaves no row out here:
    # the 2 shards hold equal rows and whole batches)
    shows = _state(final["checkpoint"])[0][("embedding", "show")]
    assert float(shows.sum()) == start["train_rows"] * SLOTS
    # engine eval scores the final checkpoint on the same test split, read from S3 with the same settings
    sets = _cmd(moto_s3.endpoint, prefix, tmp_path)[7:]                # the --set pairs
    res = subprocess.run([sys.executable, "-m", "engine", "eval", str(REPO / "configs/ctr.yaml"), "--checkpoint",
                          final["checkpoint"], *sets], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
    assert res.returncode == 0, res.stderr[-3000:]
    ev = json.loads(res.stdout.strip().splitlines()[-1])
    assert ev["test_path"] == f"s3://{prefix}/test" and ev["rows"] == _test_rows(splits)
    assert abs(ev["auc"] - final["test_auc"]) < 1e-3           # the job merges binned histograms


def test_an_unreachable_store_ends_the_job_before_any_process_starts_naming_the_uri(splits, tmp_path):
    with socket.socket() as s:                          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    res = subprocess.run(_cmd(endpoint, "nobucket/x", tmp_path, "mode=async"), cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("engine train: training input s3://nobucket/x/train: stat s3://nobucket/x/train failed "
                           "after 5 attempts"), res.stderr[-3000:]
    assert "the job did not start; once the storage answers, run it again: engine train" in last
    assert "checkpoint storage" not in last and "--resume" not in last and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").rglob("worker-*.log"))
    assert time.monotonic() - t0 < 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trained_epochs(metrics: Path, epochs: int) -> bool:
    """Whether a worker's train event of the job's metrics file is past ``epochs`` epochs."""
    for f in metrics.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            ev = json.loads(line) if line.endswith("}") else {}
            if ev.get("event") == "train" and ev.get("epoch", 0) >= epochs:
                return True
    return False


def _moto(port: int, log: Path, env: dict | None = None) -> subprocess.Popen:
    """moto's S3 server as a process of its own (``env``: moto's settings, e.g. checking credentials)."""
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    return _listening(proc, port, lambda: f"moto: {log.read_text()[-2000:]}")


def _listening(proc: subprocess.Popen, port: int, what) -> subprocess.Popen:
    """``proc`` once something listens on 127.0.0.1:``port``; killed, and an AssertionError naming
    ``what()``, after 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"nothing listened on {port} within 30 s: {what()}")


#: a TCP relay from 127.0.0.1:argv[1] to 127.0.0.1:argv[2], one pair of pumps per connection: the store's
#: address for the outage test, which kills it to cut the store off while moto keeps what it holds
_RELAY = """
import asyncio, sys

async def pump(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()

async def serve(reader, writer):
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    except OSError:
        writer.close()
        return
    await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def _relay(port: int, target: int) -> subprocess.Popen:
    """The store's address: a relay process to moto on ``target`` (``_RELAY``), listening on ``port``."""
    proc = subprocess.Popen([sys.executable, "-c", _RELAY, str(port), str(target)], start_new_session=True)
    return _listening(proc, port, lambda: "the relay to moto")


def test_credentials_the_store_refuses_end_the_job_at_once_in_one_line_naming_the_uri(tmp_path):
    """moto checking credentials (INITIAL_NO_AUTH_ACTION_COUNT=0) refuses the job's: S3's AccessDenied is
    permanent. Before, the launcher ended in a traceback of pyarrow's OSError (exit 1, the code a restart
    follows); now one line naming the input's URI and the refusal, exit 2 (not restarted), at once."""
    port = _free_port()
    moto = _moto(port, tmp_path / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        t0 = time.monotonic()
        res = subprocess.run(_cmd(f"127.0.0.1:{port}", "inputs/x", tmp_path, "mode=async"), cwd=REPO,
                             capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
        took = time.monotonic() - t0
    finally:
        os.killpg(moto.pid, signal.SIGKILL)
        moto.wait(10)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("engine train: training input s3://inputs/x/train: access refused (") and \
        "ACCESS_DENIED" in last and "no restart mends that" in last, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "retrying" not in res.stderr
    assert took < 30


@pytest.mark.long       # make test-long: ~90 s
def test_a_store_lost_mid_training_and_back_loses_no_row_and_counts_none_twice(splits, tmp_path):
    """The store is gone for 30 s, longer than the retries of a listing or an open (hdfs_io.RetryPolicy's 5
    attempts over the S3 SDK's own, ~8 s here; a shorter outage is waited out, no restart): the workers
    give up, each naming the input (``training input s3://...``), and the launcher restarts the job from
    its newest checkpoint (cluster.max_restarts) until the store answers. Every train row of the 40
    epochs is then counted exactly once in the final model."""
    outage_s = 30
    port, moto_port = _free_port(), _free_port()
    endpoint, prefix = f"127.0.0.1:{port}", "outage/inputs"
    moto = _moto(moto_port, tmp_path / "moto.log")
    relay = _relay(port, moto_port)     # the store's address: cut for the outage, moto keeping the objects
    job = None
    try:
        _upload(splits, endpoint, prefix)
        cmd = _cmd(endpoint, prefix, tmp_path, "mode=async", "model.epochs=40", "checkpoint.delta_every=4steps",
                   "checkpoint.align_steps=4", "cluster.max_restarts=8")
        with open(tmp_path / "job.stdout", "w") as out, open(tmp_path / "job.stderr", "w") as err:
            job = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, start_new_session=True,
                                   env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
        deadline = time.monotonic() + 120
        while not _trained_epochs(tmp_path / "metrics", 2) and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        assert _trained_epochs(tmp_path / "metrics", 2), (tmp_path / "job.stderr").read_text()[-3000:]
        os.killpg(relay.pid, signal.SIGKILL)           # the store is unreachable: connections refused or cut
        relay.wait(10)
        time.sleep(outage_s)
        relay = _relay(port, moto_port)                # and back, with what it held (before, moto itself was
        code = job.wait(300)                           # killed and filled again: a restart listing it in
        err = (tmp_path / "job.stderr").read_text()    # between found no inputs)
        assert code == 0, err[-3000:]
    finally:
        for proc in (job, relay, moto):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    final = json.loads((tmp_path / "job.stdout").read_text().strip().splitlines()[-1])
    logs = err + "".join(p.read_text() for p in (tmp_path / "run").rglob("worker-*.log"))
    assert final["restarts"] >= 1, err[-3000:]
    assert "engine train: training input s3://outage/inputs/" in logs
    shows = _state(final["checkpoint"])[0][("embedding", "show")]
    assert float(shows.sum()) == 40 * _train_rows(splits) * SLOTS     # no row lost, none counted twice


@pytest.mark.long       # make test-long: ~30 s
def test_a_train_object_written_again_between_epochs_ends_the_job_naming_it(splits, moto_s3, s3_bucket, tmp_path):
    """A daily pipeline writes a train file again, with other rows, while a job of many epochs reads the
    prefix. Every worker split the rows by the counts taken when it started: before, the next epoch read
    the new object with those counts (rows left out, others read twice), and the job ended with exit 0.
    Now the object is refused at its next open, naming its URI: the job ends (exit 2), its checkpoints
    kept for a --resume that restarts the epoch on the new files."""
    prefix = f"{s3_bucket}/rewritten-{os.getpid()}"
    _upload(splits, moto_s3.endpoint, prefix)
    first = sorted(p.name for p in (splits / "train").glob("*.arrow"))[0]
    cmd = _cmd(moto_s3.endpoint, prefix, tmp_path, "mode=async", "model.epochs=40", "checkpoint.delta_every=4steps",
               "checkpoint.align_steps=4")

    def rewrite(data: bytes) -> None:
        with _s3fs(moto_s3.endpoint).open_output_stream(f"{prefix}/train/{first}") as f:
            f.write(data)
    logs = _rewritten_after_epoch_1(cmd, tmp_path, splits / "train" / first, rewrite,
                                    env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
    # refused at the next open, or in the middle of a read the write overlapped: named either way
    assert re.search(rf"engine train: bad input data: s3://{prefix}/train/{first}: row \d+: field <record batch "
                     rf"\d+>: expected the object (as the job listed it|the read began on)", logs), logs[-3000:]
    assert "Traceback" not in logs


@pytest.mark.slow       # ~5-10 s
def test_a_local_train_file_written_again_between_epochs_ends_the_job_naming_it(splits, tmp_path):
    """The same rule on a local directory: before, the next epoch read the new file with the row counts of
    the old one (rows left out, others read twice) and the job ended with exit 0; now each epoch's start
    checks the files' stat (a fingerprint settles a changed stat) and the job ends, exit 2, naming it."""
    import shutil
    train = tmp_path / "train"
    shutil.copytree(splits / "train", train)
    first = sorted(p.name for p in train.glob("*.arrow"))[0]
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp_path / "run"),
           *[a for s in ("model.data.source=arrow", f"model.data.train_path={train}",
                         f"model.data.test_path={splits / 'test'}", f"model.metrics_dir={tmp_path / 'metrics'}",
                         f"observability.tensorboard_dir={tmp_path / 'tb'}",
                         f"checkpoint.root={tmp_path / 'ckpt'}", "model.hidden=[32]", "cluster.workers=2",
                         "mode=async", "model.epochs=40") for a in ("--set", s)]]

    def rewrite(data: bytes) -> None:               # written again as writers do: whole, then renamed
        (train / f".{first}.tmp").write_bytes(data)
        os.replace(train / f".{first}.tmp", train / first)
    logs = _rewritten_after_epoch_1(cmd, tmp_path, train / first, rewrite)
    assert re.search(rf"engine train: bad input data: {train / first}: row 1: field <object version>: expected the "
                     rf"file as the job listed it", logs), logs[-3000:]
    assert "Traceback" not in logs


@pytest.mark.long       # make test-long: ~25 s
def test_a_file_added_between_two_workers_listings_ends_every_worker_before_a_step(splits, tmp_path):
    """Real workers list the train directory (one file) at their start; worker 1 lists 15 s after worker 0
    (failpoint ``ctr.before_listing.rank1``), and a file lands in between. The workers' listings differ,
    so they would split the rows by other counts (rows to two workers or to none): both end at the
    barrier ``input-files`` (``ctr_inputs.agree_on_files``), exit 2 with the line naming the worker whose
    listing differs, and nothing is trained. Before only a test over threads showed it."""
    import shutil
    train = tmp_path / "train"
    shutil.copytree(splits / "train", train)
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp_path / "run"),
           *[a for s in ("model.data.source=arrow", f"model.data.train_path={train}",
                         f"model.data.test_path={splits / 'test'}", f"model.metrics_dir={tmp_path / 'metrics'}",
                         f"observability.tensorboard_dir={tmp_path / 'tb'}",
                         f"checkpoint.root={tmp_path / 'ckpt'}", "model.hidden=[32]", "cluster.workers=2",
                         "mode=async", "cluster.max_restarts=0") for a in ("--set", s)]]
    env = {**os.environ, "ENGINE_FAILPOINTS": "ctr.before_listing.rank1=sleep:15"}

    def listed() -> bool:
        return any("worker 0: 1 train file(s) listed under" in p.read_text()
                   for p in (tmp_path / "run").rglob("worker-0.log"))
    logs = _run_until(cmd, tmp_path, listed, lambda: shutil.copy(sorted(train.glob("*.arrow"))[0],
                                                                 train / "part-99999.arrow"), env)   # a new file
    assert ("field <listing>: expected every worker to list the same train files, got 1 of 2 workers (worker 1) "
            "listing other files than worker 0") in logs, logs[-3000:]
    assert not _trained_epochs(tmp_path / "metrics", 0)         # no train event: nothing was trained


def _rewritten_after_epoch_1(cmd: list[str], tmp_path: Path, path: Path, rewrite, env=None) -> str:
    """Run ``cmd`` (a 40-epoch job) until a worker is past epoch 1, then ``rewrite(bytes)`` the train file
    whose local copy is ``path`` with its first half of rows; assert the job exited 2 without a traceback
    -> its launcher's and workers' logs."""
    def half() -> None:
        t = pa.ipc.open_stream(path.read_bytes()).read_all()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, t.schema) as w:
            w.write_table(t.slice(0, t.num_rows // 2), max_chunksize=256)
        rewrite(sink.getvalue().to_pybytes())
    return _run_until(cmd, tmp_path, lambda: _trained_epochs(tmp_path / "metrics", 1), half, env)


def _run_until(cmd: list[str], tmp_path: Path, ready, act, env=None) -> str:
    """Run the job ``cmd`` until ``ready()`` (checked every 0.1 s, for up to 120 s), then ``act()``;
    assert the job then exited 2 without a traceback -> its launcher's and workers' logs."""
    with open(tmp_path / "job.stdout", "w") as out, open(tmp_path / "job.stderr", "w") as err:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.1)
        assert ready(), (tmp_path / "job.stderr").read_text()[-3000:]
        act()
        code = job.wait(300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    err = (tmp_path / "job.stderr").read_text()
    logs = err + "".join(p.read_text() for p in (tmp_path / "run").rglob("worker-*.log"))
    assert code == 2, err[-3000:]
    assert "Traceback" not in logs
    return logs
