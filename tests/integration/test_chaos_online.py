"""Chaos, online (issue 16): ``ctr_online`` replays 6 hourly partitions of generated Criteo-format rows
(2 servers, 2 workers, a serving export after every checkpoint) while K = 3 ``kill -9`` land at moments
drawn from a seed, one per attempt, in an order drawn from the same seed:

- training: a worker or a server, once a fresh progress report of rank 0 shows it training (no
  announced phase, a step just done) at or past a drawn step;
- checkpoint write: a server, while rank 0 holds the n-th checkpoint of the attempt open (failpoint
  ``checkpoint.before_publish``: the servers' parts are written, the manifest is not);
- export: worker 0 (the exporter), while it holds the n-th export of the attempt open (failpoint
  ``export.before_publish``: the checkpoint is published, its bundle is not).

The job finishes by itself with ``restarts == 3``, and

- every partition is consumed exactly once: the checkpoint chain's ``consumed`` lists are the
  partitions in order, every complete checkpoint is a link of that chain, and between consecutive
  checkpoints the servers' show counts grow by exactly 26 (one show per key of an example) times the
  rows of the partitions recorded as consumed (``show_click_decay`` 1 and no expiry pass in 6 hours,
  so shows are exact);
- each kill landed where it was aimed (an incomplete checkpoint is left by the checkpoint kill, a
  complete checkpoint without a bundle by the export kill), and no process is left behind;
- the exports, followed in order, give the full export of the final checkpoint, and they are deltas
  applied onto the first full one (a restart does not begin a new chain);
- the restart after the export kill counts no example to train again (its partition was
  checkpointed; the supervisor's count for the other two depends on when the progress reports were
  last written, so only ``examples_replayed > 0`` is checked for them).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

import hdfs_io
from engine import progress
from engine.checkpoint import CheckpointManager, chain_of
from engine.launch.procs import processes_of as leftovers
from engine.launch.procs import role_pid
from tests.waiting import until_while_running

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import replay_hours

pytestmark = pytest.mark.slow

HOURS = 6                       # any seed's plan needs 5: each kill is aimed at the attempt's first two
# partitions, and the attempts before the last one move the chain on by at most 1 (train), 1 (checkpoint)
# and 2 (export) partitions, so the last kill lands by partition 4; the sixth leaves room for a training
# kill that lands a partition late (a loaded machine can miss the fresh progress report it waits for)
ROWS_PER_HOUR = 1600
BATCH = 16                      # rows per record batch = per training step: 50 steps per worker and hour
# (an hour trains for about 0.5 s, the progress report's period, so a report shows training in most hours)
SLOTS = 26
START = dt.datetime(2024, 1, 1, 0, tzinfo=dt.timezone.utc)
UNTIL = (START + dt.timedelta(hours=HOURS)).strftime("%Y%m%d%H")     # stop before hour 6: partitions 00 .. 05
SEED = 1
# failpoint pauses, paid by every checkpoint and export of the job. A kill aimed at one is sent once
# rank 0's log shows the pause began (the line is written just before the sleep, and polled every
# 20 ms), so it has the whole pause, 1.0 s or 0.5 s, to land before the publish
FAILPOINTS = "checkpoint.before_publish=sleep:1.0;export.before_publish=sleep:0.5"


@pytest.fixture(scope="module")
def hours(tmp_path_factory) -> tuple[str, list[str], dict[str, int]]:
    """(partition root, partition names, rows per partition as their manifests record them)."""
    from streaming.criteo import generate_criteo
    work = tmp_path_factory.mktemp("hours")
    generate_criteo(work / "rows.txt", HOURS * ROWS_PER_HOUR, 20240)
    table = replay_hours.load_rows(work / "rows.txt", BATCH, HOURS * ROWS_PER_HOUR, work)
    root = str(work / "hours")
    names = replay_hours.publish_hours(table, root, hours=HOURS, start=START, batch_size=BATCH)
    storage = hdfs_io.Storage.from_uri(root)
    return root, names, {n: int(hdfs_io.read_manifest(storage, n)["rows"]) for n in names}


def _cmd(parts: str, ckpt: Path, exports: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs" / "ctr_online.yaml"),
            "--set", f"model.partitions={parts}", "--set", f"checkpoint.root={ckpt}",
            "--set", f"model.export_root={exports}", "--set", "model.hidden=[16]",
            "--set", "model.poll_interval_s=0.1", "--set", f"model.metrics_dir={run_dir / 'metrics'}",
            "--set", f"observability.tensorboard_dir={run_dir / 'tb'}",
            "--set", "cluster.servers=2", "--set", "cluster.workers=2", "--set", "cluster.warm_up=false",
            "--set", "tables.sparse.embedding.show_click_decay=1", "--until", UNTIL, "--run-dir", str(run_dir)]


def _plan(seed: int) -> list[dict]:
    """Three kills, one per attempt: where (kind), whom (role, rank) and when (step or n-th write)."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in map(str, rng.permutation(["train", "checkpoint", "export"])):
        if kind == "train":             # mid-hour of the attempt's first or second partition
            out.append({"kind": kind, "role": str(rng.choice(["worker", "server"])),
                        "rank": int(rng.integers(0, 2)), "step": int(rng.integers(10, 90))})
        elif kind == "checkpoint":
            out.append({"kind": kind, "role": "server", "rank": int(rng.integers(0, 2)),
                        "nth": int(rng.integers(1, 3))})
        else:
            out.append({"kind": kind, "role": "worker", "rank": 0, "nth": int(rng.integers(1, 3))})
    return out


class Job:
    """The supervised job, its output in files (read at any moment for a failure message)."""

    def __init__(self, cmd: list[str], tmp: Path, run_dir: Path):
        self.run_dir, self.out, self.err = run_dir, tmp / "stdout.txt", tmp / "stderr.txt"
        env = {**os.environ, "PYTHONPATH": str(REPO), "ENGINE_FAILPOINTS": FAILPOINTS}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)

    def tail(self) -> str:
        text = self.err.read_text(errors="replace")[-3000:] if self.err.exists() else ""
        logs = [f"--- {p.relative_to(self.run_dir)}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-12:])
                for p in sorted(self.run_dir.rglob("*.log"))]
        return "--- launcher stderr\n" + text + "\n" + "\n".join(logs)

    def wait_until(self, ok, what: str, timeout: float = 60.0) -> None:
        until_while_running(self.proc, ok, what, self.tail, timeout)


def _failpoint_hits(log: Path, name: str) -> int:
    try:
        return log.read_text(errors="replace").count(f"failpoint {name}:")
    except OSError:
        return 0


def _training_at(d: Path, step: int):
    """True once a fresh report of rank 0 of ``d`` (written within 0.1 s) shows it training at or past
    ``step``: no announced phase, and a step done within 0.1 s of the report (not a barrier wait).
    Rank 0, because the other ranks leave their (empty) checkpoint phase at once and then wait at a
    barrier outside any phase while rank 0 writes the checkpoint."""
    def ok() -> bool:
        r = progress.read(d / "worker-0.progress.json")
        return bool(r and r["step"] >= step and r.get("phase") is None and time.time() - r["beat"] < 0.1
                    and r["beat"] - r["step_time"] < 0.1)
    return ok


def _inside(d: Path, point: str, nth: int):
    """True once rank 0 of ``d`` has logged its ``nth`` hit of failpoint ``point``: it is in that
    hit's pause. The log is read, not the progress report: a report is up to 0.5 s old, half of the
    checkpoint pause, and a kill that came late would miss the write it is aimed at."""
    return lambda: _failpoint_hits(d / "worker-0.log", point) >= nth


def _shows(mgr: CheckpointManager, name: str) -> float:
    """Sum of the show counters of every row of checkpoint ``name`` (its chain replayed)."""
    from engine.export import CheckpointSource
    src = CheckpointSource(mgr.uri_of(name))
    try:
        return float(sum(pc.sum(rb.column("show")).as_py() or 0.0 for rb in src.embedding_batches()))
    finally:
        src.close()


def test_online_job_survives_kills_in_training_checkpoint_and_export(hours, tmp_path):
    from engine.cli import main as engine_main
    from engine.export import load_bundle, open_bundle
    parts, names, rows = hours
    ckpt, exports, run_dir = tmp_path / "ckpt", tmp_path / "exports", tmp_path / "run"
    mgr = CheckpointManager(str(ckpt), "ctr_online")
    plan = _plan(SEED)
    job = Job(_cmd(parts, ckpt, exports, run_dir), tmp_path, run_dir)
    try:
        for attempt, kill in enumerate(plan):
            d = run_dir if attempt == 0 else run_dir / f"restart-{attempt}"
            pid = role_pid(d, kill["role"], kill["rank"])
            if kill["kind"] == "train":
                job.wait_until(_training_at(d, kill["step"]), f"attempt {attempt}: training at step {kill['step']}")
            else:
                point = f"{kill['kind']}.before_publish"
                job.wait_until(_inside(d, point, kill["nth"]), f"attempt {attempt}: failpoint {point} #{kill['nth']}")
            newest = mgr.latest()
            os.kill(pid, signal.SIGKILL)
            kill["newest"] = newest.name if newest else None
        job.proc.wait(120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job did not finish within 120 s of the last kill\n{job.tail()}") from None
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait(10)
    assert job.proc.returncode == 0, f"exit {job.proc.returncode}, plan {plan}\n{job.tail()}"
    final = json.loads(job.out.read_text().strip().splitlines()[-1])
    assert final["restarts"] == 3, (plan, final, job.tail())
    assert final["examples_replayed"] > 0, final
    assert final["last_partition"] == names[-1], final
    assert not leftovers(tmp_path), f"processes left behind: {leftovers(tmp_path)}"

    # every partition consumed exactly once, in order, by the one chain of complete checkpoints
    last = mgr.latest()
    chain = chain_of(mgr.storage, last.name)
    assert [m["name"] for m in chain] == [r.name for r in mgr.list()], "a complete checkpoint off the chain"
    consumed = [p for m in chain for p in m["extra"]["consumed"]]
    assert consumed == names, f"consumed {consumed}, plan {plan}\n{job.tail()}"
    assert final["checkpoint"] == mgr.uri_of(last.name)
    before = 0.0
    for m in chain:
        shows = _shows(mgr, m["name"])
        want = SLOTS * sum(rows[p] for p in m["extra"]["consumed"])
        assert shows - before == want, f"{m['name']} ({m['extra']['consumed']}): shows grew by " \
                                       f"{shows - before}, expected {want}: an example counted twice or lost"
        before = shows

    # each kill landed where it was aimed: the checkpoint kill left an incomplete checkpoint, the export
    # kill a complete checkpoint of the chain whose bundle was never written
    ckpts = [m["name"] for m in chain]
    incomplete = [f"{day}/{n}" for day in mgr.storage.listdir() for n in mgr.storage.listdir(day)
                  if not hdfs_io.is_complete(mgr.storage, f"{day}/{n}")]
    assert incomplete, f"the checkpoint kill landed outside the checkpoint write: {plan}"
    bundles = sorted(f"{day}/{n}" for day in os.listdir(exports) for n in os.listdir(exports / day)
                     if (exports / day / n / hdfs_io.SUCCESS_NAME).exists())
    unexported = next(k["newest"] for k in plan if k["kind"] == "export")
    assert unexported in ckpts and bundles == [c for c in ckpts if c != unexported], \
        f"expected one bundle per checkpoint but {unexported} (its export was killed): {bundles} vs {ckpts}"

    # the exports, followed in order as serving would (a full bundle loaded, a delta applied), give the
    # full export of the final checkpoint
    fulls, served = [], None
    for b in bundles:
        if served is None or open_bundle(str(exports / b)).meta["bundle"] == "full":
            fulls.append(b)
            served = load_bundle(str(exports / b))
        else:
            served.apply_delta(str(exports / b))
    assert engine_main(["export", final["checkpoint"], str(tmp_path / "full")]) == 0
    full = load_bundle(str(tmp_path / "full"))
    for x, y in zip(served.state(), full.state()):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(served.model.get_dense(), full.model.get_dense())
    # ... and they are deltas applied onto the first full export: no restart begins a new chain
    assert fulls == bundles[:1], f"full bundles {fulls} among {bundles}: a restarted job exported a full " \
                                 f"bundle instead of a delta of the previous export (plan {plan})"

    # examples trained twice, as the supervisor counts them at each restart: none for the export kill
    # (its partition was checkpointed, the next one not begun)
    replayed = {int(m[1]): int(m[2]) for m in re.finditer(
        r"restart (\d+)/\d+ from .*? \((\d+) examples to train again\)", job.err.read_text())}
    k = next(i for i, kill in enumerate(plan) if kill["kind"] == "export")
    assert replayed.get(k + 1) == 0, f"restart {k + 1} after the export kill counts {replayed.get(k + 1)} " \
                                     f"examples to train again, expected 0: {replayed}, plan {plan}"
