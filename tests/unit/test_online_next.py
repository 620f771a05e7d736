"""Rank 0 chooses the online job's next hourly partition and every worker trains that one
(``engine.programs.online_next``), with real partitions on disk and in-process servers carrying the
decisions. Before, each worker listed the root on its own: an hour published between two listings was
skipped by one worker and trained by the other (both then waited at different barriers until
``barrier_timeout_s`` and the job restarted)."""
from __future__ import annotations

import datetime as dt
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

import hdfs_io
from engine import preempt
from engine.programs.online_next import NextPartition, channel
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig
from streaming.hourly import HourlySource, partition_time


def publish(root, name: str) -> None:
    tbl = pa.table({"label": np.zeros(4, np.float32)})
    with hdfs_io.Publisher(hdfs_io.Storage.from_uri(str(root)), name, overwrite=True) as pub:
        pub.write_table("part-0.arrow", tbl.to_batches())


@pytest.fixture
def client():
    servers = [PSServer({"emb": TableConfig(dim=2)}, {}, index=i, num_servers=2) for i in range(2)]
    return PSClient(InProcessTransport(servers))


def workers(client, root, n=2, **kw):
    return [NextPartition(client, HourlySource(str(root), poll_interval_s=0.02), rank=r, num_workers=n, **kw)
            for r in range(n)]


def test_a_late_hour_is_skipped_by_every_worker_when_rank_0_skipped_it(client, tmp_path):
    lead, follow = workers(client, tmp_path)
    publish(tmp_path, "20240101/00")
    publish(tmp_path, "20240101/02")                      # 01 missing: rank 0 skips it
    assert lead.next(None, []).name == follow.next(None, []).name == "20240101/00"
    assert lead.next("20240101/00", ["20240101/00"]).name == "20240101/02"
    publish(tmp_path, "20240101/01")                      # arrives between rank 0's listing and worker 1's
    own = next(HourlySource(str(tmp_path)).partitions("20240101/00", wait=False))
    assert own.name == "20240101/01"                      # what worker 1 would have trained on its own
    part = follow.next("20240101/00", ["20240101/00"])
    assert part.name == "20240101/02" and part.files == ("part-0.arrow",)
    assert not follow.preempted


def test_a_follower_waits_for_the_decision_and_ends_with_rank_0(client, tmp_path):
    lead, follow = workers(client, tmp_path, until=partition_time("20240101/02"))
    got = []
    t = threading.Thread(target=lambda: got.append(follow.next(None, [])))
    t.start()                                             # before anything is published or decided
    time.sleep(0.2)
    assert t.is_alive()
    publish(tmp_path, "20240101/01")
    publish(tmp_path, "20240101/02")                      # at `until`: never trained
    assert lead.next(None, []).name == "20240101/01"
    t.join(10)
    assert [p.name for p in got] == ["20240101/01"]
    assert lead.next("20240101/01", []) is None           # `until` reached: END for everyone
    assert follow.next("20240101/01", []) is None and not follow.preempted


def test_max_partitions_is_rank_0s_count(client, tmp_path):
    lead, follow = workers(client, tmp_path, max_partitions=1)
    publish(tmp_path, "20240101/00")
    publish(tmp_path, "20240101/01")
    assert lead.next("20240101/00", ["20240101/00"]) is None
    # a follower whose own count says otherwise (a worker replaced alone counts from zero) still stops
    assert follow.next("20240101/00", []) is None and not follow.preempted


def test_a_decision_added_twice_by_a_retried_request_reads_the_same_hour(client, tmp_path):
    lead, follow = workers(client, tmp_path)
    publish(tmp_path, "20240101/03")
    assert lead.next(None, []).name == "20240101/03"
    lead._publish(None, int(partition_time("20240101/03").timestamp()) // 3600)    # the retry's second add
    assert client.read_metric(channel(None))[0].tolist() == [2 * 473355, 2]
    assert follow.next(None, []).name == "20240101/03"


def test_a_preemption_request_while_waiting_stops_every_worker_promptly(client, tmp_path):
    lead, follow = workers(client, tmp_path)
    publish(tmp_path, "20240101/00")
    assert lead.next(None, []).name == follow.next(None, []).name == "20240101/00"
    got = {}

    def run(w, key):
        t0 = time.monotonic()
        got[key] = (w.next("20240101/00", ["20240101/00"]), w.preempted, time.monotonic() - t0)
    threads = [threading.Thread(target=run, args=(w, k)) for w, k in ((lead, "lead"), (follow, "follow"))]
    for t in threads:
        t.start()
    time.sleep(0.3)                                       # both wait: no next hour
    assert all(t.is_alive() for t in threads)
    client.add_metric(preempt.REQUESTS, np.ones(1, np.int64), np.zeros(1, np.float64))   # a worker's SIGTERM
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    for key in ("lead", "follow"):
        part, preempted, waited = got[key]
        assert part is None and preempted, key
        assert waited < 5, (key, waited)
    publish(tmp_path, "20240101/01")                      # too late: the decision stands
    assert follow.next("20240101/00", []) is None and follow.preempted


def test_a_follower_that_cannot_see_the_chosen_hour_names_it(client, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    lead = NextPartition(client, HourlySource(str(tmp_path / "a"), poll_interval_s=0.02), rank=0, num_workers=2)
    follow = NextPartition(client, HourlySource(str(tmp_path / "b"), poll_interval_s=0.02), rank=1,
                           num_workers=2, follow_timeout_s=0.3)
    publish(tmp_path / "a", "20240101/07")
    assert lead.next(None, []).name == "20240101/07"
    with pytest.raises(hdfs_io.NotPublishedError, match=r"rank 0 chose hourly partition 20240101/07 .* after 0.3 s"):
        follow.next(None, [])


def test_partition_hours_round_trip():
    from engine.programs.online_next import _hour, _name
    for name in ("19700101/00", "20240101/05", "20241231/23"):
        assert _name(_hour(name)) == name
    assert _hour("19700101/05") == 5 and dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc).timestamp() // 3600 == 473352


def test_a_fence_while_rank_0_waits_ends_the_wait_with_the_error(client, tmp_path):
    """Rank 0 waiting for the next hour only lists storage; its preemption check is what meets the
    servers. A fence (a worker replaced alone) there must end the wait at once, not at the next hour."""
    from engine.errors import GenerationChangedError
    lead, _ = workers(client, tmp_path)
    publish(tmp_path, "20240101/00")
    assert lead.next(None, []).name == "20240101/00"
    other = PSClient(InProcessTransport(client.transport.servers))
    got = []

    def wait():
        try:
            lead.next("20240101/00", ["20240101/00"])
        except GenerationChangedError as e:
            got.append(e)
    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    other.fence([h["generation"] for h in other.health()], "a worker replaced alone")
    t.join(10)
    assert not t.is_alive() and len(got) == 1


def test_decisions_read_by_everyone_are_retired(client, tmp_path):
    lead, follow = workers(client, tmp_path)
    chosen = []
    lead.on_chosen = lambda p: chosen.append((p.name, len(client.read_metric(channel(None))[0])))
    publish(tmp_path, "20240101/00")
    assert lead.next(None, []).name == follow.next(None, []).name == "20240101/00"
    assert chosen == [("20240101/00", 0)]                         # called before the decision was published
    assert len(client.read_metric(channel(None))[0]) == 2
    lead.retire()                                                 # after the barrier every worker meets
    assert len(client.read_metric(channel(None))[0]) == 0
