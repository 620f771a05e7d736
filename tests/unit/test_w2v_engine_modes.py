"""In-place row updates through the modes (what the word2vec worker uses), on an in-process cluster:
``push_sparse_delta`` in GEO (local copy, sent at the sync) and async (sent at once), sync refusing it;
GEO replicas (dense local copy trained in place; changed rows found, pushed, refreshed); ``delta_scale``
mean vs sum, checked algebraically."""
from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ConfigError
from engine.modes import AsyncMode, GeoMode, SyncMode
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

DIM = 3
UNIF = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="uniform", init_range=0.5, seed=4)


def cluster(n=2):
    servers = [PSServer({"emb": UNIF}, {}, index=i, num_servers=n, local_shards=2) for i in range(n)]
    return PSClient(InProcessTransport(servers))


def test_push_sparse_delta_async_adds_at_once_and_sync_refuses():
    client = cluster()
    keys = np.array([3, 9, 4], np.uint64)
    init = client.pull("emb", keys, init_missing=True)
    mode = AsyncMode(client, rank=0, num_workers=1)
    mode.push_sparse_delta("emb", keys, np.full((3, DIM), 0.25, np.float32))
    np.testing.assert_allclose(client.pull("emb", keys), init + 0.25, rtol=1e-6)
    with pytest.raises(ConfigError, match="mode sync cannot"):
        SyncMode(client, rank=0, num_workers=1).push_sparse_delta("emb", keys, np.zeros((3, DIM), np.float32))


@pytest.mark.parametrize("scale,factor", [("mean", 0.5), ("sum", 1.0)])
def test_geo_push_sparse_delta_goes_to_the_local_copy_until_the_sync(scale, factor):
    client = cluster()
    keys = np.array([11, 12], np.uint64)
    init = client.pull("emb", keys, init_missing=True)
    modes = [GeoMode(client, rank=r, num_workers=2, k_steps=2, delta_scale=scale) for r in range(2)]
    for m in modes:
        before = m.pull_sparse("emb", keys)
        np.testing.assert_array_equal(before, init)           # a new row starts at the server's init
        m.push_sparse_delta("emb", keys, np.ones((2, DIM), np.float32))
        np.testing.assert_allclose(m.pull_sparse("emb", keys), init + 1, rtol=1e-6)
        m.end_step()
    assert client.pull("emb", keys).tolist() == np.zeros((2, DIM)).tolist()   # nothing sent yet
    for m in modes:
        m.end_step()                                           # step 2: sync
    np.testing.assert_allclose(client.pull("emb", keys), init + 2 * factor, rtol=1e-6)


@pytest.mark.parametrize("scale,factor", [("mean", 0.5), ("sum", 1.0)])
def test_geo_replica_is_trained_in_place_and_synced(scale, factor):
    client = cluster()
    keys = np.arange(100, 110, dtype=np.uint64)
    init = client.pull("emb", keys, init_missing=True)
    a, b = (GeoMode(client, rank=r, num_workers=2, k_steps=1, delta_scale=scale, evict_after_steps=1000)
            for r in range(2))
    ra, rb = a.sparse_replica("emb", keys), b.sparse_replica("emb", keys)
    np.testing.assert_array_equal(ra, init)
    assert a.sparse_replica("emb", keys) is ra
    ra[2] += 1.0                          # worker a trains row 2, worker b rows 2 and 7
    rb[2] += 2.0
    rb[7] -= 1.0
    a.end_step()                          # a pushes row 2 only, and refreshes it
    np.testing.assert_allclose(ra[2], init[2] + factor, rtol=1e-6)
    b.end_step()
    server = client.pull("emb", keys, init_missing=True)
    np.testing.assert_allclose(server[2], init[2] + 3 * factor, rtol=1e-6)
    np.testing.assert_allclose(server[7], init[7] - factor, rtol=1e-6)
    np.testing.assert_allclose(rb, server, rtol=1e-6)      # b touched 2 and 7: both fresh
    np.testing.assert_allclose(ra[7], init[7])              # a did not touch 7: stale until a refresh
    np.testing.assert_allclose(a.pull_sparse("emb", keys[[7, 2]]), ra[[7, 2]])
    a.push_sparse_delta("emb", keys[[0]], np.ones((1, DIM), np.float32))
    assert ra[0].tolist() == (init[0] + 1).tolist()
    with pytest.raises(ConfigError, match="not in the replica"):
        a.pull_sparse("emb", np.array([5], np.uint64))
    with pytest.raises(ConfigError, match="another key set"):
        a.sparse_replica("emb", keys[:3])


def test_geo_replica_refreshes_every_row_after_evict_after_steps():
    client = cluster(1)
    keys = np.arange(4, dtype=np.uint64)
    a, b = (GeoMode(client, rank=r, num_workers=2, k_steps=1, delta_scale="sum", evict_after_steps=2)
            for r in range(2))
    ra, rb = a.sparse_replica("emb", keys), b.sparse_replica("emb", keys)
    rb[1] += 5.0
    b.end_step()
    a.end_step()                        # step 1: a has nothing to push; row 1 stays stale
    assert not np.allclose(ra[1], rb[1])
    a.end_step()                        # step 2: full refresh
    np.testing.assert_allclose(ra, client.pull("emb", keys, init_missing=True))
