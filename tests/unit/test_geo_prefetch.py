"""GEO's prefetch (the CTR worker fetches batch t+1's missing rows while step t computes), on an
in-process cluster: prefetched rows are used for keys still missing from the local copy, a key that
entered the copy since keeps its local value, a key the prefetch did not cover is fetched at the pull;
nothing is prefetched for keys already local, for replicas, or in the modes that must pull at the step."""
from __future__ import annotations

import numpy as np

from engine.modes import AsyncMode, GeoMode, SyncMode
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

DIM = 3
UNIF = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="uniform", init_range=0.5, seed=4)


def cluster(n=2):
    servers = [PSServer({"emb": UNIF}, {}, index=i, num_servers=n, local_shards=2) for i in range(n)]
    return PSClient(InProcessTransport(servers))


def u64(*keys):
    return np.array(keys, np.uint64)


def test_pull_takes_prefetched_rows_only_for_keys_still_missing():
    client = cluster()
    geo = GeoMode(client, rank=0, num_workers=1, k_steps=100)
    local2 = geo.pull_sparse("emb", u64(1, 2))[1]
    pre = geo.prefetch_sparse("emb", u64(2, 5, 6, 5))
    assert pre[0].tolist() == [5, 6]                       # sorted, unique, not the local key 2
    np.testing.assert_array_equal(pre[1], client.pull("emb", u64(5, 6), init_missing=True))
    # another worker's delta moves rows 5, 6 and 7 on the servers after the prefetch
    client.push_delta("emb", u64(5, 6, 7), np.ones((3, DIM), np.float32))
    moved = client.pull("emb", u64(5, 6, 7))
    geo.pull_sparse("emb", u64(6))                         # 6 enters the local copy meanwhile
    got = geo.pull_sparse("emb", u64(2, 5, 6, 7, 5), prefetched=pre)
    np.testing.assert_array_equal(got[0], local2)
    np.testing.assert_array_equal(got[1], pre[1][0])       # prefetched: the value before the delta
    np.testing.assert_array_equal(got[4], pre[1][0])
    np.testing.assert_array_equal(got[2], moved[1])        # local since the prefetch: not overwritten
    np.testing.assert_array_equal(got[3], moved[2])        # not prefetched: fetched at the pull
    np.testing.assert_array_equal(geo.pull_sparse("emb", u64(5)), pre[1][:1])   # and it stays local


def test_nothing_to_prefetch():
    client = cluster()
    geo = GeoMode(client, rank=0, num_workers=1)
    assert geo.prefetch_sparse("emb", np.empty(0, np.uint64)) is None
    geo.pull_sparse("emb", u64(1, 2))
    assert geo.prefetch_sparse("emb", u64(2, 1, 2)) is None            # all local
    for mode in (AsyncMode(client, rank=0, num_workers=1), SyncMode(client, rank=0, num_workers=1)):
        assert mode.prefetch_sparse("emb", u64(8, 9)) is None          # pulls must see the step's pushes


def test_replica_tables_are_not_prefetched():
    servers = [PSServer({"emb": UNIF, "rep": UNIF}, {}, index=0, num_servers=1)]
    client = PSClient(InProcessTransport(servers))
    geo = GeoMode(client, rank=0, num_workers=1)
    geo.sparse_replica("rep", u64(1, 2, 3))
    assert geo.prefetch_sparse("rep", u64(1, 2)) is None
    assert geo.prefetch_sparse("emb", u64(1, 2))[0].tolist() == [1, 2]  # no local copy yet: all missing
