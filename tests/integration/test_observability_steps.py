"""The step axis and the live worker counters of CTR jobs (``engine.observability``):

* in a process: a real ``CTRTrainer`` (one in-process server) whose Prometheus counters, read after
  every step, count that step, its examples and the seconds spent so far, and whose ``global_step``
  follows a subclass that moves ``steps`` at its own commit points (as ``ctr_online`` does);
* across attempts: ``engine train`` run twice into one metrics file and one TensorBoard run, the second
  resumed from a mid-epoch checkpoint of the first: the resumed attempt's train, eval and profile
  points, its metrics-file events and the launcher's log lines continue from the checkpoint's step,
  while its Prometheus counters count this process's own steps from 0."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint import CheckpointManager
from engine.config import load_config
from engine.modes import make_mode
from engine.observability import prometheus
from engine.programs import ctr
from engine.ps.client import PSClient
from engine.ps.server import PSServer
from engine.ps.transport import InProcessTransport
from engine.roles import WorkerContext
from tests.integration.test_observability import scrape, wait_file

REPO = Path(__file__).resolve().parents[2]
BATCH = 128
COUNTERS = ("engine_worker_steps_total", "engine_worker_examples_total", "engine_worker_train_seconds_total")


# each of the loops: async's pipelined one, the sequential one (sync runs it too), GEO's prefetching one
@pytest.mark.parametrize("sets", [("mode=async",), ("mode=async", "model.pipeline=sequential"), ("mode=geo",)],
                         ids=["pipelined", "sequential", "geo-prefetch"])
def test_worker_counters_move_every_step_and_global_step_follows_commit_points(tmp_path, monkeypatch, sets):
    cfg = load_config(REPO / "configs/ctr.yaml", [*sets,
        "model.data.source=generated", "model.data.generated_rows=3000", f"model.data.cache_dir={tmp_path}/cache",
        f"model.metrics_dir={tmp_path}/m", f"observability.tensorboard_dir={tmp_path}/tb", "checkpoint.root=",
        "cluster.workers=1", "cluster.warm_up=false", "model.hidden=[16]", f"model.batch_size={BATCH}",
        "model.log_every_s=0.000001", "model.eval_every_epoch=false"])
    m = prometheus.RoleMetrics("worker", 0)
    monkeypatch.setattr(prometheus, "_current", m)
    cfg = ctr.prepare(cfg)
    server = PSServer.from_config(cfg, 0)
    client = PSClient(InProcessTransport([server]))
    try:
        mode = make_mode(cfg, client, rank=0, num_workers=1)
        trainer = ctr.CTRTrainer(WorkerContext(cfg, 0, 1, client, mode))
        seen, end_step = [], mode.end_step

        def end_step_then_scrape(examples: int = 0) -> None:
            end_step(examples)
            seen.append(tuple(m.registry.get_sample_value(n) for n in COUNTERS))
        monkeypatch.setattr(mode, "end_step", end_step_then_scrape)
        out = trainer.run()
        n = out["steps"]
        assert n >= 10 and len(seen) == n
        assert [s for s, _, _ in seen] == list(range(1, n + 1))           # no wait for an aligned point
        assert [e for _, e, _ in seen][-1] == out["examples"]
        assert all(e > 0 and e % BATCH == 0 for _, e, _ in seen[:-1])     # whole batches but the last
        secs = [t for _, _, t in seen]
        assert 0 < secs[0] and all(a < b for a, b in zip(secs, secs[1:])) and secs[-1] <= out["train_seconds"]
        events = [json.loads(line) for line in Path(cfg.model.params.metrics_file).read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "train"] == list(range(1, n + 1))
        (ev,) = [e for e in events if e["event"] == "eval"]
        (profile,) = [e for e in events if e["event"] == "profile"]
        assert ev["step"] == profile["step"] == profile["steps"] == n
        # ctr_online's pattern: the restored step assigned, steps ended, then the partition's count added
        trainer.steps = 1000
        for _ in range(3):
            end_step(BATCH)
        assert trainer.global_step == 1003 and trainer.steps == 1000
        trainer.steps += 3
        assert trainer.global_step == 1003
        end_step(BATCH)
        assert trainer.global_step == 1004
        assert trainer.live_counters()["steps"] == n + 4                  # this process's steps
    finally:
        client.close()
        server.close()


# ------------------------------------------------------------------------------------ across attempts
def _scrape(url: str) -> dict[str, float]:
    """The unlabelled samples of ``url`` by name (``test_observability.scrape``)."""
    return {name: v for (name, labels), v in scrape(url).items() if not labels}


def _steps_by_tag(path: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    out: dict[str, list[int]] = {}
    for ev in EventFileLoader(str(path)).Load():
        for v in ev.summary.value:
            out.setdefault(v.tag, []).append(ev.step)
    return out


@pytest.mark.long   # make test-long (~30 s): the step axis and counters are the test above's, a resumed job's
#                    examples_job test_offline_resume's (make test)
@pytest.mark.slow
def test_a_resumed_attempt_continues_the_step_axis_and_counts_its_own_work(tmp_path):
    ckpt, tb, metrics = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "m" / "run.jsonl"
    sets = ["model.data.source=generated", "model.data.generated_rows=3000", f"model.data.cache_dir={tmp_path}/cache",
            f"model.metrics_file={metrics}", f"observability.tensorboard_dir={tb}", f"checkpoint.root={ckpt}",
            "checkpoint.align_steps=4", "checkpoint.delta_every=0.001s", "cluster.workers=1", "model.epochs=2",
            "model.hidden=[16]", f"model.batch_size={BATCH}", "model.log_every_s=0.000001", "observability.prometheus_port=0"]

    def cmd(tag: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir",
                str(tmp_path / f"run-{tag}"), *[a for s in sets for a in ("--set", s)], *extra]

    first = subprocess.run(cmd("first"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    mgr = CheckpointManager(str(ckpt), "ctr_dnn")
    chain = [mgr.manifest(ref.name) for ref in mgr.list()]
    mid = next(c for c in chain if (c["sources"]["train"]["epoch"], c["sources"]["train"]["batch"]) == (1, 8))
    restored = int(mid["step"])
    epoch_end = next(int(c["step"]) for c in chain if (c["sources"]["train"]["epoch"], c["sources"]["train"]["batch"]) == (1, 0))
    first_files = set(tb.rglob("events.out.tfevents.*"))
    first_lines = len(metrics.read_text().splitlines())

    # slowed steps (0.15 s each) so that the endpoint is scraped while the resumed attempt trains
    env = {**os.environ, "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.15"}
    proc = subprocess.Popen(cmd("second", "--resume", str(ckpt / "ctr_dnn" / mid["name"])), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url_file, scrapes = tmp_path / "run-second" / "worker-0.metrics", []
    try:
        url = wait_file(url_file, proc, 180)
        while proc.poll() is None and len(scrapes) < 3:
            try:
                got = _scrape(url)
            except OSError:                          # the worker ended between the poll and the scrape
                break
            if got.get("engine_worker_steps_total", 0) > 0:
                scrapes.append(got)
            time.sleep(0.1)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    final = json.loads(out.strip().splitlines()[-1])
    total = int(json.loads(Path(final["checkpoint"], "manifest.json").read_text())["step"])
    remaining = total - restored
    assert restored >= 8 and remaining >= 8

    # Prometheus: this process's work, live and consistent, from 0 (not from the restored step)
    assert scrapes, "the resumed worker was never scraped while it trained"
    for got in scrapes:
        steps = got["engine_worker_steps_total"]
        assert 0 < steps <= remaining, (steps, restored, remaining)
        assert got["engine_worker_examples_total"] == pytest.approx(steps * BATCH, abs=BATCH)
        assert got["engine_worker_train_seconds_total"] > 0

    # the metrics file and the launcher's log: the resumed attempt's steps continue from the checkpoint's
    events = [json.loads(line) for line in metrics.read_text().splitlines()[first_lines:]]
    train = [e["step"] for e in events if e["event"] == "train"]
    assert train == list(range(restored + 1, total + 1)), (restored, train)
    assert [e["step"] for e in events if e["event"] in ("eval", "profile")] == [total, total]
    logged = [int(s) for s in re.findall(r"train  rank 0 epoch \d+ step (\d+)", err)]
    assert logged and min(logged) == restored + 1 and max(logged) == total, logged

    # TensorBoard: one new event file, every curve of it past the restored step
    (second_file,) = set(tb.rglob("events.out.tfevents.*.worker0")) - first_files
    (first_file,) = [f for f in first_files if f.name.endswith(".worker0")]
    before, after = _steps_by_tag(first_file), _steps_by_tag(second_file)
    assert before["train/rank0/auc"][-1] == total                        # the first attempt ran to the end
    assert after["train/rank0/auc"] == list(range(restored + 1, total + 1))
    assert after["test/auc"] == [total]
    assert {s for tag, v in after.items() if tag.startswith("profile/") for s in v} == {total}
    assert before["test/auc"] == [epoch_end, total]                     # after epoch 0, and the final one
