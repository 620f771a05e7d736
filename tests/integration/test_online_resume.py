"""The online job (``configs/ctr_online.yaml``) on replayed hourly Criteo partitions, on the local
filesystem and on S3 (moto): kill -9 the whole job mid-hour, resume with ``--resume``, and the
checkpoint chain records every partition as consumed exactly once; the final line names the last
checkpoint. Uses the shared Criteo rows (first 3,000) or the planted-model fallback."""
from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hdfs_io
from engine.checkpoint import CheckpointManager, chain_of
from engine.programs.online_runs import expand
from tests.contract.storage_fixtures import moto_s3, s3_bucket, s3_storage_options  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import replay_hours  # noqa: E402

HOURS = 5
START = dt.datetime(2024, 1, 1, 0, tzinfo=dt.timezone.utc)


@pytest.fixture(scope="module")
def rows(tmp_path_factory, shared_data):
    work = tmp_path_factory.mktemp("replay")
    table = replay_hours.load_rows(shared_data / "criteo" / "train.txt", 256, 4000, work)
    return table.slice(0, 3000)


def _cmd(parts: str, ckpt: str, run_dir: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs" / "ctr_online.yaml"),
            "--set", f"model.partitions={parts}", "--set", f"checkpoint.root={ckpt}",
            "--set", "model.hidden=[16]", "--set", "model.poll_interval_s=0.1",
            "--set", f"model.metrics_dir={run_dir / 'metrics'}", "--set", "cluster.servers=2",
            "--set", f"observability.tensorboard_dir={run_dir / 'tb'}",
            "--set", "cluster.workers=1", "--until", "2024010105", "--run-dir", str(run_dir), *extra]


def _run_until_killed(cmd, env, mgr: CheckpointManager, after: int, log: Path) -> None:
    """Start the job; once ``after`` checkpoints exist, wait a moment (mid next hour) and kill -9 it all."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(mgr.list()) < after:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "job made no progress:\n" + log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _logs(res, run_dir: Path) -> str:
    tails = [f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
             for p in sorted(run_dir.glob("*.log"))]
    return res.stderr[-3000:] + "\n" + "\n".join(tails)


def _check_exactly_once(mgr: CheckpointManager, names: list[str]) -> dict:
    last = mgr.latest()
    chain = chain_of(mgr.storage, last.name)
    consumed = [p for m in chain for p in m["extra"]["consumed"]]
    assert consumed == names, consumed
    assert chain[-1]["sources"]["train"]["partition"] == names[-1]
    return chain[-1]


@pytest.mark.long   # make test-long (pyproject.toml): test_chaos_online kill -9s the job and checks each hour once
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_online_kill9_mid_hour_then_resume_consumes_each_partition_once(backend, rows, tmp_path, request):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    opts = None
    if backend == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        opts = request.getfixturevalue("s3_storage_options")
        env.update(request.getfixturevalue("moto_s3").env())
        prefix = f"s3://{bucket}/online-{os.getpid()}-{time.monotonic_ns()}"
        parts, ckpt = f"{prefix}/hours", f"{prefix}/ckpt"
    else:
        parts, ckpt = str(tmp_path / "hours"), str(tmp_path / "ckpt")
    # only the first hours exist when the job starts, so however fast it runs it cannot get past
    # them before the kill (it is training the third hour or polling for the fourth)
    early = 3
    names = replay_hours.publish_hours(rows, parts, hours=HOURS, start=START, batch_size=256,
                                       storage_options=opts, stop=early)
    mgr = CheckpointManager(ckpt, "ctr_online", storage_options=opts)
    _run_until_killed(_cmd(parts, ckpt, tmp_path / "run1"), env, mgr, 2, tmp_path / "run1.log")
    done = len(mgr.list())
    assert 2 <= done <= early < HOURS, "the job should have been killed before the last hour"
    replay_hours.publish_hours(rows, parts, hours=HOURS, start=START, batch_size=256,
                               storage_options=opts, first=early)
    res = subprocess.run(_cmd(parts, ckpt, tmp_path / "run2", "--resume"), env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, _logs(res, tmp_path / "run2")
    final = json.loads(res.stdout.strip().splitlines()[-1])
    assert expand(final["partitions"], final["partitions_count"]) == names[done:]
    # TensorBoard: the per-hour progressive-validation curve of the hours this run trained
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(final["tensorboard_dir"])
    ea.Reload()
    assert len(ea.Scalars("online/progressive_auc")) == len(names) - done
    last = _check_exactly_once(mgr, names)
    assert final["checkpoint"] == mgr.uri_of(last["name"])
    assert hdfs_io.is_complete(mgr.storage, last["name"])
    if backend == "s3":
        return
    # resuming again with nothing new to do consumes nothing and keeps the chain
    res = subprocess.run(_cmd(parts, ckpt, tmp_path / "run3", "--resume"), env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, _logs(res, tmp_path / "run3")
    assert json.loads(res.stdout.strip().splitlines()[-1])["partitions"] == []
    _check_exactly_once(mgr, names)


def test_online_job_exports_a_bundle_after_every_checkpoint(rows, tmp_path):
    """``model.export_root``: the first export is full, the later ones deltas; applying them in order to
    the first gives exactly the full export of the last checkpoint."""
    from engine.export import load_bundle
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parts, ckpt, exports = str(tmp_path / "hours"), str(tmp_path / "ckpt"), tmp_path / "exports"
    names = replay_hours.publish_hours(rows, parts, hours=3, start=START, batch_size=256)
    cmd = _cmd(parts, ckpt, tmp_path / "run", "--set", f"model.export_root={exports}")
    cmd[cmd.index("2024010105")] = "2024010103"
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    mgr = CheckpointManager(ckpt, "ctr_online")
    ckpts = [ref.name for ref in mgr.list()]
    assert len(ckpts) == len(names) == 3
    bundles = [str(exports / n) for n in ckpts]
    served = load_bundle(bundles[0])
    assert served.meta["bundle"] == "full"
    for b in bundles[1:]:
        served.apply_delta(b)
        assert served.meta["bundle"] == "delta"
    assert main_export(mgr.uri_of(ckpts[-1]), str(tmp_path / "full")) == 0
    full = load_bundle(str(tmp_path / "full"))
    for x, y in zip(served.state(), full.state()):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(served.model.get_dense(), full.model.get_dense())


def main_export(ckpt_uri: str, out: str) -> int:
    from engine.cli import main
    return main(["export", ckpt_uri, out])
