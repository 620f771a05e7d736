"""The counts a row keeps (show, click) and admission count occurrences the same way in every mode, so
the same data gives the same expiry score, export filter and admission step whether trained async or
GEO. Before, a GEO delta carried no counts: each sync added one show per key per worker and no click
(a row with 16 shows and 8 clicks in async had 2 and 0 in GEO, an expiry score of 0.2 against 8.8), and
admission counted pushes, not the occurrences a merged push stands for."""
from __future__ import annotations

import numpy as np
import pytest

from engine.modes import AsyncMode, GeoMode
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

DIM = 4
KEY = np.array([5], np.uint64)


def cluster(cfg: TableConfig) -> tuple[list[PSServer], PSClient]:
    servers = [PSServer({"emb": cfg}, {}, index=i, num_servers=2, local_shards=2) for i in range(2)]
    return servers, PSClient(InProcessTransport(servers))


def counts(servers, key: int) -> tuple[float, float] | None:
    for s in servers:
        for shard in s.sparse["emb"].shards:
            for b in shard.rows():
                for row in b.to_pylist():
                    if row["key"] == key:
                        return row["show"], row["click"]
    return None


def train(mode_cls, cfg: TableConfig, steps: int, **kw):
    """One worker: every step the key occurs in 2 examples, 1 clicked (a merged push: show 2, click 1)."""
    servers, client = cluster(cfg)
    mode = mode_cls(client, rank=0, num_workers=1, **kw)
    for _ in range(steps):
        mode.pull_sparse("emb", KEY)
        mode.push_sparse_grads("emb", KEY, np.full((1, DIM), 2.0, np.float32), shows=np.array([2], np.float32),
                               clicks=np.array([1], np.float32))
        mode.end_step()
    mode.drain()
    return servers, client


@pytest.mark.parametrize("mode_cls, kw", [(AsyncMode, {}), (GeoMode, {"k_steps": 4, "learning_rate": 0.1})],
                         ids=["async", "geo"])
def test_show_and_click_are_the_datas_in_every_mode(mode_cls, kw):
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=0.1, initializer="zeros")
    servers, client = train(mode_cls, cfg, 8, **kw)
    assert counts(servers, 5) == (16.0, 8.0)
    np.testing.assert_allclose(client.pull("emb", KEY), np.full((1, DIM), -0.8), rtol=1e-6)


@pytest.mark.parametrize("mode_cls, kw", [(AsyncMode, {}), (GeoMode, {"k_steps": 2, "learning_rate": 0.1})],
                         ids=["async", "geo"])
def test_admission_counts_occurrences_in_every_mode(mode_cls, kw):
    """min_count 4: 2 occurrences a step, so the row exists from the second step's push (async) or the
    sync that carries the second step (GEO, k_steps 2), and all 8 steps' updates land in both modes.
    Before: async waited for the 4th push; GEO for the 4th sync, and the updates before were lost."""
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=0.1, initializer="zeros", min_count=4)
    servers, client = train(mode_cls, cfg, 8, **kw)
    # async: step 1's push (2 occurrences) is refused, step 2's admits the key and lands: 7 of 8 steps;
    # GEO: the first sync carries 4 occurrences and both steps' delta: 8 of 8
    expect = -0.1 * 7 if mode_cls is AsyncMode else -0.1 * 8
    np.testing.assert_allclose(client.pull("emb", KEY), np.full((1, DIM), expect), rtol=1e-5)
