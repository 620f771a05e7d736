"""Which worker the local launcher names when a lockstep job stalls (``LocalCluster._frozen_peer``): a
worker that beats but has not stepped waits for a peer; the peer that stopped beating is the one named
(the hybrid audit: worker 1 SIGSTOPped, the launcher reported worker 0 hung, three runs out of three)."""
from __future__ import annotations

from types import SimpleNamespace

from engine.launch.local import LocalCluster
from engine.progress import stalled


def test_a_waiting_worker_is_not_named_when_a_peer_stopped_beating():
    now = 1000.0
    w0, w1, w2 = (SimpleNamespace(name=f"worker {r}") for r in range(3))
    reports = {id(w0): {"mono": now - 0.3, "step_mono": now - 31.0, "step": 14},      # beats, waits
               id(w1): {"mono": now - 29.8, "step_mono": now - 30.2, "step": 14},     # frozen
               id(w2): {"mono": now - 0.2, "step_mono": now - 30.9, "step": 14}}
    why = stalled(reports[id(w0)], now, 30.0, 0.0)
    assert why.startswith("no training step for 31s")
    c, reason = LocalCluster._frozen_peer([w0, w1, w2], reports, now, w0, why)
    assert c is w1 and reason.startswith("no heartbeat for 30s (stopped or frozen process; worker 0 waits: "
                                         "no training step for 31s")


def test_a_hang_with_every_peer_beating_names_the_worker_found():
    now = 1000.0
    w0, w1 = SimpleNamespace(name="worker 0"), SimpleNamespace(name="worker 1")
    reports = {id(w0): {"mono": now - 0.3, "step_mono": now - 31.0, "step": 14},
               id(w1): {"mono": now - 0.4, "step_mono": now - 30.5, "step": 14}}
    why = stalled(reports[id(w0)], now, 30.0, 0.0)
    assert LocalCluster._frozen_peer([w0, w1], reports, now, w0, why) == (w0, why)
    frozen = "no heartbeat for 31s (stopped or frozen process)"      # already the frozen one: kept
    assert LocalCluster._frozen_peer([w0, w1], reports, now, w1, frozen) == (w1, frozen)


def test_a_rank_without_a_log_line_shows_the_end_of_mpiexecs_log(tmp_path):
    """A hybrid rank that failed before it wrote a line was reported with "(no log)"; the reason is in
    hydra's ``mpiexec.log`` beside it (the hybrid audit)."""
    from engine.launch.local import Child
    from engine.launch.mpi import MPIEXEC_LOG
    (tmp_path / MPIEXEC_LOG).write_text("start\n[proxy:0@host] HYDU_create_process: execvp error on file x\n")
    worker = Child("worker", 1, None, tmp_path / "worker-1.log")
    assert worker.tail().endswith("execvp error on file x") and "mpiexec.log" in worker.tail()
    (tmp_path / "worker-1.log").write_text("its own line\n")
    assert worker.tail() == "its own line"
    assert Child("server", 0, None, tmp_path / "server-0.log").tail() == "(no log)"
