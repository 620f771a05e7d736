"""The fused async step (``PSClient.push_pull``, the Step RPC): one round trip per server that equals a
sparse push, a dense step and a sparse pull made one after the other, and that a bad request leaves
every table unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import DenseTableConfig
from engine.errors import ProtocolError, RemoteError
from engine.ps import InProcessTransport, PSClient, PSServer, codec
from engine.ps import ps_pb2 as pb
from sparse_tables import TableConfig

DIM = 4
SPARSE = {"emb": TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, initializer="uniform", seed=3)}
DENSE = {"mlp": DenseTableConfig(optimizer="adam", learning_rate=0.01)}


def cluster(n: int, serialize: bool = True) -> tuple[list[PSServer], PSClient]:
    servers = [PSServer(SPARSE, DENSE, index=i, num_servers=n, local_shards=3) for i in range(n)]
    return servers, PSClient(InProcessTransport(servers, serialize=serialize))


def steps(rng, size: int, count: int):
    """(push keys with duplicates, grads, shows, clicks, pull keys overlapping the pushed ones, dense grad)"""
    for _ in range(count):
        keys = rng.integers(0, 400, 600).astype(np.uint64)
        pull = np.concatenate([keys[:100], rng.integers(300, 700, 500).astype(np.uint64)])
        yield (keys, rng.normal(size=(600, DIM)).astype(np.float32),
               rng.integers(1, 3, 600).astype(np.float32), rng.integers(0, 2, 600).astype(np.float32),
               pull, rng.normal(size=size).astype(np.float32))


@pytest.mark.parametrize("serialize", [True, False])
@pytest.mark.parametrize("n_servers,blocks", [(1, 1), (2, 3), (3, 2)])
def test_push_pull_equals_push_then_dense_step_then_pull(monkeypatch, serialize, n_servers, blocks):
    """Same rows, same dense parameters and same tables as the three separate calls, across servers,
    dense blocks spread over servers (several on one server), duplicates and keys both pushed and
    pulled (the pull sees the push)."""
    monkeypatch.setattr(codec, "DENSE_BLOCK", 10)
    from engine.ps import dense_host
    monkeypatch.setattr(dense_host, "DENSE_BLOCK", 10)
    size = 10 * blocks - 3
    _, fused = cluster(n_servers, serialize)
    _, separate = cluster(n_servers, serialize)
    p0 = np.linspace(-1, 1, size).astype(np.float32)
    for c in (fused, separate):
        c.init_dense("mlp", p0)
    for keys, grads, shows, clicks, pull, dg in steps(np.random.default_rng(1), size, 3):
        rows, fresh = fused.push_pull("emb", keys, grads, pull, shows=shows, clicks=clicks,
                                      dense_table="mlp", dense_grad=dg)
        separate.push("emb", keys, grads, shows=shows, clicks=clicks)
        want_fresh = separate.push_pull_dense("mlp", dg)
        want_rows = separate.pull("emb", pull, init_missing=True)
        np.testing.assert_array_equal(rows, want_rows)
        np.testing.assert_array_equal(fresh, want_fresh)
    everything = np.arange(800, dtype=np.uint64)
    np.testing.assert_array_equal(fused.pull("emb", everything), separate.pull("emb", everything))
    np.testing.assert_array_equal(fused.pull_dense("mlp"), separate.pull_dense("mlp"))
    assert sum(s["requests"]["Step"] for s in fused.stats()) == 3 * n_servers   # one per server and step


def test_push_pull_parts_may_be_empty_and_without_dense():
    _, c = cluster(2)
    rows, fresh = c.push_pull("emb", np.empty(0, np.uint64), np.empty((0, DIM), np.float32),
                              np.array([5, 5, 9], np.uint64))
    assert fresh is None and rows.shape == (3, DIM)
    np.testing.assert_array_equal(rows, c.pull("emb", np.array([5, 5, 9], np.uint64), init_missing=True))
    rows, fresh = c.push_pull("emb", np.array([5], np.uint64), np.ones((1, DIM), np.float32),
                              np.empty(0, np.uint64))
    assert rows.shape == (0, DIM) and fresh is None
    assert c.push_pull("emb", np.empty(0, np.uint64), np.empty((0, DIM), np.float32),
                       np.empty(0, np.uint64))[0].shape == (0, DIM)


def test_push_pull_too_large_for_one_request_makes_the_three_calls(monkeypatch):
    monkeypatch.setattr(codec, "CHUNK_BYTES", 2000)
    _, fused = cluster(2)
    _, separate = cluster(2)
    for c in (fused, separate):
        c.init_dense("mlp", np.zeros(50, np.float32))
    for keys, grads, shows, clicks, pull, dg in steps(np.random.default_rng(2), 50, 2):
        rows, fresh = fused.push_pull("emb", keys, grads, pull, shows=shows, clicks=clicks,
                                      dense_table="mlp", dense_grad=dg)
        separate.push("emb", keys, grads, shows=shows, clicks=clicks)
        np.testing.assert_array_equal(fresh, separate.push_pull_dense("mlp", dg))
        np.testing.assert_array_equal(rows, separate.pull("emb", pull, init_missing=True))
    assert sum(s["requests"]["Step"] for s in fused.stats()) == 0


def test_client_checks_arguments_before_sending():
    _, c = cluster(1)
    c.init_dense("mlp", np.zeros(8, np.float32))
    k = np.arange(3, dtype=np.uint64)
    g = np.ones((3, DIM), np.float32)
    bad_dense = np.ones(8, np.float32)
    bad_dense[5] = np.nan
    with pytest.raises(ProtocolError, match="dense_grad: contains NaN"):
        c.push_pull("emb", k, g, k, dense_table="mlp", dense_grad=bad_dense)
    with pytest.raises(ProtocolError, match="dense_grad: expected float32"):
        c.push_pull("emb", k, g, k, dense_table="mlp", dense_grad=np.ones(7, np.float32))
    with pytest.raises(ProtocolError, match="keys: expected a uint64"):
        c.push_pull("emb", k, g, k.astype(np.int64))
    assert sum(s["requests"]["Step"] for s in c.stats()) == 0


def test_server_rejects_a_bad_step_and_changes_nothing():
    """Each bad part (sparse gradient, dense gradient, a misrouted pull key, an unknown dense table, a
    repeated block) rejects the whole request: no sparse row and no dense parameter changed."""
    servers, c = cluster(2)
    size = 40
    c.init_dense("mlp", np.linspace(0, 1, size).astype(np.float32))
    keys = np.arange(200, dtype=np.uint64)
    c.push("emb", keys, np.ones((200, DIM), np.float32))
    rows_before, dense_before = c.pull("emb", keys), c.pull_dense("mlp")
    owner = c.info()["owner"]
    from engine.ps import routing
    srv = routing.lookup(keys, c.info()["num_vshards"], owner)
    mine, theirs = keys[srv == 0], keys[srv == 1]
    good = dict(table="emb", keys=codec.encode(mine), grads=codec.encode(np.ones((len(mine), DIM), np.float32)),
                pull_keys=codec.encode(mine), dense_table="mlp", blocks=[0],
                dense_grads=codec.encode(np.ones(size, np.float32)))
    nan_grads = np.ones((len(mine), DIM), np.float32)
    nan_grads[3, 1] = np.nan
    nan_dense = np.ones(size, np.float32)
    nan_dense[-1] = np.inf
    cases = [({"grads": codec.encode(nan_grads)}, "not finite"),
             ({"dense_grads": codec.encode(nan_dense)}, "not finite"),
             ({"pull_keys": codec.encode(theirs)}, "not routed to this server"),
             ({"dense_table": "nope"}, "unknown dense table 'nope'"),
             ({"blocks": [0, 0], "dense_grads": codec.encode(np.ones(2 * size, np.float32))}, "stepped once"),
             ({"dense_grads": codec.encode(np.ones(size - 1, np.float32))}, "expected shape"),
             ({"pull_keys": pb.Tensor(dtype="<u8", shape=[4], data=b"x" * 31)}, "truncated")]
    for i, (change, text) in enumerate(cases):
        req = pb.StepRequest(request_id=f"r-bad-{i}", **{**good, **change})
        with pytest.raises(RemoteError) as ei:
            c.transport.call(0, "Step", req, 5.0)
        assert ei.value.code in ("INVALID_ARGUMENT", "NOT_FOUND") and text in str(ei.value), str(ei.value)
        assert f"r-bad-{i}" in str(ei.value)
    np.testing.assert_array_equal(c.pull("emb", keys), rows_before)
    np.testing.assert_array_equal(c.pull_dense("mlp"), dense_before)
    c.transport.call(0, "Step", pb.StepRequest(request_id="r-good", **good), 5.0)   # still serving
    assert not np.array_equal(c.pull_dense("mlp"), dense_before)
