"""Steps of the wall clock (NTP, a VM resumed after a pause, an operator's ``date -s``) move no checkpoint.

The periods of ``checkpoint.delta_every`` / ``base_every`` of a program without data time (the launcher's
``Periodic`` thread, the offline programs' ``AlignedCheckpoints``) were measured on ``time.time()``: a
backward step of 2 h held every checkpoint back by 2 h (a crash then lost up to 3 h of training, not
1 h), a forward step brought one forward. They are measured on the monotonic clock now; the wall clock
only names the checkpoint. The machine's clock is shared and is never changed here: the modules' own
``time`` is replaced by one whose wall clock runs 2 h behind (or ahead of) the real one, while the
checkpoints are written by a real in-process parameter server to a real directory.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import engine.job_checkpoints as job_checkpoints
import engine.programs.ctr_positions as ctr_positions
from engine.checkpoint import CheckpointManager
from engine.config import load_config
from engine.programs.ctr_positions import AlignedCheckpoints, Position
from engine.ps import InProcessTransport, PSClient, PSServer

REPO = Path(__file__).resolve().parents[2]


class _SteppedTime:
    """``time`` whose wall clock is the real one plus ``offset_s`` once ``step`` is called."""

    def __init__(self):
        self.offset_s = 0.0

    def step(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def time(self) -> float:
        return time.time() + self.offset_s

    def __getattr__(self, name):           # monotonic, sleep, perf_counter: the real ones
        return getattr(time, name)


def _config(tmp_path, delta_every: str):
    cfg = load_config(REPO / "configs" / "ctr.yaml", [
        "cluster.workers=1", "model.slots=[C1]", f"checkpoint.root={tmp_path / 'ckpt'}",
        f"checkpoint.delta_every={delta_every}"])
    return cfg


@pytest.fixture
def cluster(tmp_path):
    cfg = _config(tmp_path, "0.3s")
    server = PSServer.from_config(cfg, 0)
    client = PSClient(InProcessTransport([server]))
    client.init_dense("dense", np.zeros(4, np.float32))
    try:
        yield cfg, server, client
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("offset_s", [-7200.0, 7200.0])
def test_periodic_checkpoints_keep_their_period_across_a_wall_clock_step(cluster, monkeypatch, offset_s):
    cfg, server, _ = cluster
    clock = _SteppedTime()
    monkeypatch.setattr(job_checkpoints, "time", clock)
    monkeypatch.setattr(job_checkpoints, "_client", lambda c, e: PSClient(InProcessTransport([server])))
    t0 = time.time()
    periodic = job_checkpoints.Periodic(cfg, ["in-process"], poll_s=0.05)
    try:
        clock.step(offset_s)                 # right after the schedule started
        deadline = time.monotonic() + 8.0
        while len(periodic.written) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        periodic.stop()
    # every 0.3 s of real time, as without the step (before: none for 2 h after a backward step)
    assert len(periodic.written) >= 2, periodic.written
    # named after the (stepped) wall clock, in UTC
    days = {time.strftime("%Y%m%d", time.gmtime(t + offset_s)) for t in (t0, time.time())}
    assert periodic.written[0].split("/")[-2] in days, (periodic.written, days)


def test_aligned_checkpoints_keep_their_period_across_a_backward_wall_clock_step(cluster, monkeypatch):
    cfg, _, client = cluster
    clock = _SteppedTime()
    monkeypatch.setattr(ctr_positions, "time", clock)
    trainer = SimpleNamespace(ctx=SimpleNamespace(config=cfg), cfg=cfg.model.params, rank=0, num_workers=1,
                              client=client, steps=0, _drain=lambda: None,
                              mode=SimpleNamespace(name="async", barrier=lambda name: None,
                                                       barrier_until=lambda name, timeout_s: None))
    ck = AlignedCheckpoints(trainer)
    ck.meet(Position(0, 0), force=True)      # the first checkpoint: a base
    clock.step(-7200.0)
    time.sleep(0.35)                         # past delta_every (0.3 s) of real time
    trainer.steps = 256
    ck.meet(Position(0, 256))
    names = [r.name for r in CheckpointManager(cfg.checkpoint.root, "ctr_dnn").list()]
    assert len(names) == 2 and names[1].split("-")[1].startswith("delta"), names
    # the stepped-back wall clock names the delta before the base: the manager keeps names ordered
    assert names[0] < names[1]


def test_the_schedule_itself_is_clock_agnostic():
    """The schedule compares the times it is given; its callers choose the clock (module docstring)."""
    from engine.checkpoint.schedule import CheckpointConfig, Schedule
    s = Schedule(dataclasses.replace(CheckpointConfig(), delta_every="1h"), start_s=100.0)
    assert s.due(100.0 + 3599) is None and s.due(100.0 + 3600) == "delta"


def test_a_backward_wall_clock_step_is_no_server_restart_in_engine_status(cluster, monkeypatch):
    """``engine status`` takes a server whose ``uptime_s`` went down for a restarted one and shows no rate,
    and divides its rates by the interval between its samples: both were on the wall clock (a backward
    step made the uptime negative and the interval negative: no rates). Now on the monotonic clock."""
    import engine.observability.status as status
    import engine.ps.server as server_mod
    _, server, client = cluster
    table = next(iter(server.sparse))
    server_clock, status_clock = _SteppedTime(), _SteppedTime()
    monkeypatch.setattr(server_mod, "time", server_clock)
    monkeypatch.setattr(status, "time", status_clock)
    target = status.Target(endpoints=["in-process"])

    def sample():
        return {"time": status_clock.time(), "mono": time.monotonic(), "workers": {},
                "servers": [{"ok": True, "stats": client.stats()[0]}]}
    prev = sample()
    time.sleep(0.05)
    server_clock.step(-7200.0)
    status_clock.step(-7200.0)
    for _ in range(5):
        client.pull(table, np.arange(1, 9, dtype=np.uint64))
    assert client.stats()[0]["uptime_s"] >= 0
    row = status.table(target, sample(), prev)["servers"][0]
    assert row["requests_per_s"] is not None and row["requests_per_s"] > 0, row


def test_a_resumed_online_job_measures_base_every_from_its_bases_data_time_not_its_name(cluster):
    """Names only grow: a base of 2024-01-01 10:00 (data time) written beside a newer checkpoint of
    2024-01-03 09:00 (a job resumed from an older checkpoint) is named after the newer one. The online job
    restarted from it measured ``base_every`` from the name's time, two days of data late; it reads the
    manifest's ``train_time`` now. A real in-process server saves both checkpoints."""
    import datetime as dt

    from engine.programs.ctr_online import OnlineTrainer
    cfg, _, client = cluster

    def at(day, hour):
        return dt.datetime(2024, 1, day, hour, tzinfo=dt.timezone.utc).timestamp()
    mgr = CheckpointManager(cfg.checkpoint.root, "ctr_online")
    mgr.save(client, "base", when=at(3, 9))
    m = CheckpointManager(cfg.checkpoint.root, "ctr_online").save(client, "base", when=at(1, 10))
    assert m["name"] == "20240103/0900-base.1"                      # named after the newest
    assert OnlineTrainer._base_time(m["name"], m) == at(1, 10)       # its data time
    assert OnlineTrainer._base_time("20240103/0900-base", None) == at(3, 9)   # no manifest: the name
