"""The data clock (``server.expiry_clock: data``, ``engine.ps.data_clock``): rows' ``last_seen`` and the
expiry pass count the time of the data the job trains, not the servers' wall clock. On the wall clock a
job stopped for a while expired at its resume rows a steady job keeps, and a catch-up over old hours
expired nothing; the server's rules (forward only, never past its wall clock + 1 h, unset by a load)
keep a client from expiring anything sooner than the wall clock would."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine.config import load_config
from engine.errors import ConfigError, RequestRejectedError
from engine.ps import InProcessTransport, PSClient, PSServer
from engine.ps.data_clock import MAX_AHEAD_S, DataClock
from sparse_tables import TableConfig

DAY = 86400.0
T0 = 1704067200.0          # 2024-01-01 00:00 UTC
WALL = T0 + 30 * DAY       # the servers' wall clock in these tests: a month after the data


def cluster(expiry_clock: str, n: int = 2):
    cfg = TableConfig(dim=2, optimizer="sgd", learning_rate=0.1, initializer="zeros", expire_after=DAY)
    servers = [PSServer({"emb": cfg}, {}, index=i, num_servers=n, local_shards=2, clock=lambda: WALL,
                        expiry_clock=expiry_clock) for i in range(n)]
    return servers, PSClient(InProcessTransport(servers))


def push(client, keys) -> None:
    keys = np.asarray(keys, np.uint64)
    client.pull("emb", keys)
    client.push("emb", keys, np.ones((len(keys), 2), np.float32))


def last_seen(servers) -> dict[int, int]:
    return {row["key"]: row["last_seen"] for s in servers for shard in s.sparse["emb"].shards
            for b in shard.rows() for row in b.to_pylist()}


def test_the_clock_moves_forward_only_and_never_past_the_wall_clock():
    clock = DataClock(lambda: WALL)
    assert clock.value is None and clock() == 0.0
    assert clock.advance(T0) == T0 and clock() == T0
    assert clock.advance(T0 - 3600) == T0                        # earlier: unchanged
    assert clock.advance(WALL + 10 * DAY) == WALL + MAX_AHEAD_S   # clamped
    for bad in (0, -1.0, math.nan, math.inf, "x"):
        with pytest.raises(ValueError, match="advance_to"):
            clock.advance(bad)
    assert clock() == WALL + MAX_AHEAD_S
    clock.reset()
    assert clock.value is None


def test_rows_expire_after_expire_after_seconds_of_data_time():
    servers, client = cluster("data")
    assert [h["expiry_clock"] for h in client.health()] == ["data", "data"]
    assert client.advance_clock(T0 + 3600) == [T0 + 3600] * 2          # hour 00 trained
    push(client, [1, 2, 3])
    assert client.advance_clock(T0 + 2 * DAY) == [T0 + 2 * DAY] * 2     # two days of data later
    push(client, [3, 4])
    assert last_seen(servers) == {1: T0 + 3600, 2: T0 + 3600, 3: T0 + 2 * DAY, 4: T0 + 2 * DAY}
    assert client.shrink() == 2                                         # 1 and 2: unseen for > 1 day of data
    assert sorted(last_seen(servers)) == [3, 4]


def test_on_the_wall_clock_the_same_data_expires_nothing():
    servers, client = cluster("wall")
    assert client.health()[0]["data_time"] is None
    push(client, [1, 2, 3])
    push(client, [3, 4])
    assert set(last_seen(servers).values()) == {WALL}
    assert client.shrink() == 0
    with pytest.raises(RequestRejectedError, match="wall clock"):       # nothing to advance
        client.advance_clock(T0)


def test_an_unset_clock_refuses_the_expiry_pass_and_a_load_unsets_it(tmp_path):
    servers, client = cluster("data")
    with pytest.raises(RequestRejectedError, match="data clock .* is not set"):
        client.shrink()
    client.advance_clock(T0 + 3600)
    push(client, [1, 2])
    from engine.checkpoint import CheckpointManager
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job")
    m = mgr.save(client, "base")
    mgr.restore(client, m["name"])                                       # a Load on every server
    assert client.advance_clock(0) == [None, None]                       # 0 reads it: unset
    assert [h["data_time"] for h in client.health()] == [None, None]
    with pytest.raises(RequestRejectedError, match="not set since this server started, loaded a checkpoint"):
        client.shrink()
    assert last_seen(servers) == {1: T0 + 3600, 2: T0 + 3600}           # restored stamps are data time
    client.advance_clock(T0 + 3 * 3600)
    assert client.shrink() == 0


@pytest.mark.parametrize("bad", [-5.0, math.nan, math.inf])
def test_a_bad_advance_is_refused_and_changes_nothing(bad):
    _, client = cluster("data")
    client.advance_clock(T0)
    with pytest.raises(RequestRejectedError, match="advance_to"):
        client.advance_clock(bad)
    assert client.advance_clock(0) == [T0, T0]


def test_data_clock_is_for_the_online_job_only(tmp_path):
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match="server.expiry_clock: data needs model.kind: ctr_online"):
        load_config(repo / "configs" / "ctr.yaml", overrides=["server.expiry_clock=data"])
    cfg = load_config(repo / "configs" / "ctr_online.yaml", overrides=["server.expiry_clock=data"])
    assert cfg.server.expiry_clock == "data"
    with pytest.raises(ConfigError, match="expiry_clock"):
        load_config(repo / "configs" / "ctr_online.yaml", overrides=["server.expiry_clock=data_time"])
