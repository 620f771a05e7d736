"""A whole cluster in one process (InProcessTransport): the client's dedup, routing, chunking and
reassembly against a single SparseTable; server-side rejection; dense tables; barriers; modes."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.config import DenseTableConfig
from engine.errors import BarrierTimeoutError, PSTimeoutError, ProtocolError, RemoteError, RequestRejectedError, ShardUnavailableError
from engine.modes import AsyncMode, GeoMode, SyncMode
from engine.ps import InProcessTransport, PSClient, PSServer, codec
from engine.ps import ps_pb2 as pb
from engine.ps.transport import Transport
from models.optim import Adam
from sparse_tables import SparseTable, TableConfig

DIM = 4
SGD1 = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros")


def cluster(n=2, sparse=None, dense=None, local_shards=3, **client_kw):
    sparse = sparse or {"emb": SGD1}
    servers = [PSServer(sparse, dense or {}, index=i, num_servers=n, local_shards=local_shards)
               for i in range(n)]
    return servers, PSClient(InProcessTransport(servers), **client_kw)


def test_pull_push_match_a_single_table_with_duplicates_and_any_order():
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, initializer="uniform", seed=3)
    servers, client = cluster(3, {"emb": cfg})
    ref = SparseTable(cfg)
    rng = np.random.default_rng(0)
    for _ in range(5):
        keys = rng.integers(0, 500, 2000).astype(np.uint64)
        grads = rng.normal(size=(2000, DIM)).astype(np.float32)
        # duplicates are summed in another order than the table's, so equal up to float rounding
        np.testing.assert_allclose(client.pull("emb", keys, init_missing=True),
                                   ref.pull(keys, init_missing=True), rtol=1e-5, atol=1e-6)
        client.push("emb", keys, grads)
        ref.push(keys, grads)
    keys = rng.permutation(np.arange(600, dtype=np.uint64))
    np.testing.assert_allclose(client.pull("emb", keys), ref.pull(keys), rtol=1e-6, atol=1e-7)
    assert sum(s["sparse"]["emb"]["rows"] for s in client.stats()) == len(ref)


def test_push_sums_duplicates_and_shows(monkeypatch):
    monkeypatch.setattr(codec, "CHUNK_BYTES", 200)   # force many chunks per server
    servers, client = cluster(2)
    keys = np.array([5, 6, 5, 7, 5] * 20, np.uint64)
    client.push("emb", keys, np.ones((100, DIM), np.float32))
    out = client.pull("emb", np.array([7, 5, 6, 8], np.uint64))
    np.testing.assert_array_equal(out[:, 0], [-20, -60, -20, 0])
    big = np.arange(1000, dtype=np.uint64)
    client.push("emb", big, np.ones((1000, DIM), np.float32))
    np.testing.assert_array_equal(client.pull("emb", big[::-1])[:, 1], -np.ones(1000) - (big[::-1] == 5) * 60
                                  - np.isin(big[::-1], [6, 7]) * 20)
    # shows and clicks of duplicate keys are summed too (and the gradient is scaled by 1 / shows)
    keys = np.array([2005, 2006, 2005, 2007, 2005] * 20, np.uint64)
    shows = np.tile(np.array([1, 2, 3, 1, 4], np.float32), 20)
    clicks = np.tile(np.array([1, 0, 1, 1, 0], np.float32), 20)
    client.push("emb", keys, np.ones((100, DIM), np.float32), shows=shows, clicks=clicks)
    rows = {r["key"]: r for sv in servers for sh in sv.sparse["emb"].shards for b in sh.rows()
            for r in b.to_pylist() if r["key"] >= 2005}
    assert {k: (r["show"], r["click"]) for k, r in rows.items()} == {2005: (160, 40), 2006: (40, 0), 2007: (20, 20)}
    np.testing.assert_allclose(client.pull("emb", np.array([2005, 2006, 2007], np.uint64))[:, 0],
                               [-60 / 160, -20 / 40, -20 / 20], rtol=1e-6)


def test_client_rejects_bad_arguments_before_sending():
    _, client = cluster(1)
    with pytest.raises(ProtocolError, match="uint64"):
        client.pull("emb", np.array([1, 2]))
    with pytest.raises(ProtocolError, match=r"float32\[2, 4\]"):
        client.push("emb", np.array([1, 2], np.uint64), np.ones((2, 3), np.float32))
    with pytest.raises(ProtocolError, match="NaN"):
        client.push("emb", np.array([1], np.uint64), np.full((1, DIM), np.nan, np.float32))
    with pytest.raises(RequestRejectedError, match="unknown sparse table 'nope'"):
        client.pull("nope", np.array([1], np.uint64))


def raw_push(server, keys, grads, table="emb", rid="raw-1"):
    return server.handle("Push", pb.PushRequest(table=table, request_id=rid, keys=codec.encode(keys),
                                                grads=codec.encode(grads)))


def test_server_rejects_bad_requests_and_keeps_tables_unchanged():
    servers, client = cluster(1)
    keys = np.arange(50, dtype=np.uint64)
    client.push("emb", keys, np.ones((50, DIM), np.float32))
    before = client.pull("emb", keys)
    s = servers[0]
    transport = client.transport
    grads = np.ones((50, DIM), np.float32)
    grads[37, 2] = np.nan
    cases = [
        (pb.PushRequest(table="emb", request_id="r-nan", keys=codec.encode(keys), grads=codec.encode(grads)),
         "INVALID_ARGUMENT", "not finite"),
        (pb.PushRequest(table="emb", request_id="r-dim", keys=codec.encode(keys),
                        grads=codec.encode(np.ones((50, 3), np.float32))), "INVALID_ARGUMENT", "expected shape"),
        (pb.PushRequest(table="emb", request_id="r-dtype", keys=codec.encode(keys.astype(np.int64)),
                        grads=codec.encode(np.ones((50, DIM), np.float32))), "INVALID_ARGUMENT", "dtype <u8"),
        (pb.PushRequest(table="zzz", request_id="r-table", keys=codec.encode(keys)), "NOT_FOUND", "zzz"),
        (pb.PushRequest(table="emb", request_id="r-short", keys=pb.Tensor(dtype="<u8", shape=[50], data=b"x" * 399),
                        grads=codec.encode(np.ones((50, DIM), np.float32))), "INVALID_ARGUMENT", "truncated"),
    ]
    for req, code, text in cases:
        with pytest.raises(RemoteError) as ei:
            transport.call(0, "Push", req, 5.0)
        assert ei.value.code == code and text in str(ei.value)
        assert req.request_id in str(ei.value) and "server 0/1" in str(ei.value) and "shard" in str(ei.value)
    np.testing.assert_array_equal(client.pull("emb", keys), before)
    assert s.Stats(pb.Empty()).json   # still serving


def test_server_rejects_keys_routed_to_another_server():
    servers, client = cluster(2)
    keys = np.arange(100, dtype=np.uint64)
    with pytest.raises(Exception, match="not routed to this server"):
        raw_push(servers[0], keys, np.ones((100, DIM), np.float32))
    assert sum(s["sparse"]["emb"]["rows"] for s in client.stats()) == 0


def test_dense_table_adam_matches_models_optim_across_blocks(monkeypatch):
    monkeypatch.setattr(codec, "DENSE_BLOCK", 7)
    from engine.ps import dense_host, server
    monkeypatch.setattr(dense_host, "DENSE_BLOCK", 7)
    _, client = cluster(3, dense={"d": DenseTableConfig(optimizer="adam", learning_rate=0.01)})
    rng = np.random.default_rng(2)
    p0 = rng.normal(size=30).astype(np.float32)
    with pytest.raises(RequestRejectedError, match="not initialized"):
        client.pull_dense("d")
    assert client.init_dense("d", p0)
    assert not client.init_dense("d", np.zeros(30, np.float32))   # first writer wins
    ref, opt = p0.copy(), Adam(30, 0.01)
    for _ in range(4):
        g = rng.normal(size=30).astype(np.float32)
        client.push_dense("d", g)
        opt.step(ref, g)
    np.testing.assert_allclose(client.pull_dense("d"), ref, rtol=1e-6, atol=1e-7)
    client.push_dense_delta("d", np.ones(30, np.float32))
    np.testing.assert_allclose(client.pull_dense("d"), ref + 1, rtol=1e-6, atol=1e-6)


def run_workers(n, fn):
    errors = []

    def wrap(rank):
        try:
            fn(rank)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def test_sync_mode_applies_one_mean_update_per_step():
    servers, client = cluster(2, dense={"d": DenseTableConfig(optimizer="sgd", learning_rate=1.0)})
    keys = np.arange(20, dtype=np.uint64)
    seen = {}

    def worker(rank):
        mode = SyncMode(client, rank=rank, num_workers=3, barrier_timeout_s=30)
        mode.init_dense("d", np.zeros(2, np.float32))
        for step in range(3):
            before = mode.pull_sparse("emb", keys).copy()
            mode.push_sparse_grads("emb", keys, np.full((20, DIM), rank + 1, np.float32))
            mode.push_dense_grads("d", np.full(2, 2.0 * (rank + 1), np.float32))
            assert np.array_equal(mode.pull_sparse("emb", keys), before)   # held until the barrier
            mode.end_step()
            seen[(rank, step)] = mode.pull_sparse("emb", keys)[0, 0]
        mode.finish()
    run_workers(3, worker)
    for (rank, step), v in seen.items():
        assert v == pytest.approx(-2.0 * (step + 1), rel=1e-6)    # mean of 1, 2, 3 per step
    np.testing.assert_allclose(client.pull_dense("d"), [-12.0, -12.0], rtol=1e-6)


def test_async_queue_merges_and_flush_waits():
    servers, client = cluster(2, async_queue=4)
    mode = AsyncMode(client, rank=0, num_workers=1)
    keys = np.array([1, 2, 3], np.uint64)
    for _ in range(50):
        mode.push_sparse_grads("emb", keys, np.ones((3, DIM), np.float32))
    mode.finish()
    np.testing.assert_array_equal(client.pull("emb", keys)[:, 0], [-50, -50, -50])
    client.close()


def test_geo_deltas_add_and_local_copy_is_bounded():
    dense = {"d": DenseTableConfig(optimizer="sgd", learning_rate=1.0)}   # GEO steps d with this (SGD, lr 1)
    servers, client = cluster(2, dense=dense)
    modes = [GeoMode(client, rank=r, num_workers=2, k_steps=2, learning_rate=1.0, dense_tables=dense,
                     evict_after_steps=4) for r in range(2)]

    def worker(rank):
        m = modes[rank]
        m.init_dense("d", np.zeros(1, np.float32))
        for step in range(8):
            keys = np.array([0, 100 + step], np.uint64)    # key 0 always, one new key per step
            m.pull_sparse("emb", keys)
            m.push_sparse_grads("emb", keys, np.ones((2, DIM), np.float32))
            m.push_dense_grads("d", np.ones(1, np.float32))
            m.end_step()
        m.finish()
    run_workers(2, worker)
    # each worker moved key 0 by -8 locally; deltas are divided by 2 workers and added: -8 in total
    np.testing.assert_allclose(client.pull("emb", np.array([0], np.uint64))[0], -8.0, rtol=1e-6)
    np.testing.assert_allclose(client.pull("emb", np.array([103], np.uint64))[0], -1.0, rtol=1e-6)
    np.testing.assert_allclose(client.pull_dense("d"), [-8.0], rtol=1e-6)
    assert all(m.local_rows("emb") < 9 for m in modes)   # old per-step keys were dropped


class Flaky(Transport):
    def __init__(self, inner, failures):
        self.inner, self.failures, self.endpoints = inner, failures, inner.endpoints

    def call(self, server, method, request, timeout):
        if self.failures > 0 and method == "Pull":
            self.failures -= 1
            raise RemoteError("UNAVAILABLE", "connection refused", "flaky")
        return self.inner.call(server, method, request, timeout)


def test_retries_unavailable_with_backoff_then_gives_up():
    servers, _ = cluster(1)
    ok = PSClient(Flaky(InProcessTransport(servers), 2), retries=3, backoff_s=0.001)
    assert ok.pull("emb", np.array([1], np.uint64)).shape == (1, DIM)
    bad = PSClient(Flaky(InProcessTransport(servers), 10), retries=2, backoff_s=0.001)
    with pytest.raises(ShardUnavailableError, match="after 3 attempts"):
        bad.pull("emb", np.array([1], np.uint64))


class Late(Transport):
    """Server 1 answers a Push with DEADLINE_EXCEEDED (a stuck server: no retry of a non-idempotent call)."""
    def __init__(self, inner):
        self.inner, self.endpoints = inner, ["s0:1", "s1:1"]

    def call(self, server, method, request, timeout):
        if server == 1 and method == "Push":
            raise RemoteError("DEADLINE_EXCEEDED", "Deadline Exceeded", self.endpoints[server])
        return self.inner.call(server, method, request, timeout)


def test_a_fan_out_raises_a_servers_timeout_as_it_is_naming_the_server():
    """A call's own PSTimeoutError (a TimeoutError too) from another thread of the fan-out: before, it
    was caught as the fan-out's own wait and said "fan-out did not finish in 35.0s", naming no server."""
    servers, _ = cluster(2)
    client = PSClient(Late(InProcessTransport(servers)), retries=0)
    keys = np.arange(1, 200, dtype=np.uint64)       # both servers' keys: one call on a pool thread
    with pytest.raises(PSTimeoutError) as e:
        client.push("emb", keys, np.zeros((len(keys), DIM), np.float32))
    assert e.value.endpoint == "s1:1" and "fan-out" not in str(e.value), str(e.value)


def test_save_on_two_servers_loads_onto_three(tmp_path):
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, initializer="uniform")
    dense = {"d": DenseTableConfig()}
    _, c2 = cluster(2, {"emb": cfg}, dense)
    keys = np.arange(3000, dtype=np.uint64)
    c2.push("emb", keys, np.random.default_rng(0).normal(size=(3000, DIM)).astype(np.float32))
    c2.init_dense("d", np.arange(5, dtype=np.float32))
    from engine.checkpoint import CheckpointManager
    m = CheckpointManager(str(tmp_path), "job").save(c2, "base")
    assert m["tables"]["sparse"]["emb"]["rows"] == 3000
    _, c3 = cluster(3, {"emb": cfg}, dense)
    assert CheckpointManager(str(tmp_path), "job").restore(c3)["name"] == m["name"]
    np.testing.assert_array_equal(c3.pull("emb", keys), c2.pull("emb", keys))
    np.testing.assert_array_equal(c3.pull_dense("d"), np.arange(5, dtype=np.float32))


def test_barrier_times_out_with_a_clear_error():
    _, client = cluster(1)
    with pytest.raises(BarrierTimeoutError, match="only 1 of 2 callers arrived"):    # a peer's fault, not a server's
        client.barrier("lonely", 2, timeout=0.2)


@pytest.mark.parametrize("serialize", [True, False])
@pytest.mark.parametrize("n_servers", [1, 2])
def test_chunked_pull_push_reassemble_in_caller_order(monkeypatch, serialize, n_servers):
    """Many chunks per server (slices with one server, index gathers with two), duplicates, and the
    in-process transport with and without the wire codec all give the single-table answer."""
    monkeypatch.setattr(codec, "CHUNK_BYTES", 1000)
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, initializer="uniform", seed=5)
    servers = [PSServer({"emb": cfg}, index=i, num_servers=n_servers, local_shards=3) for i in range(n_servers)]
    client = PSClient(InProcessTransport(servers, serialize=serialize))
    ref = SparseTable(cfg)
    rng = np.random.default_rng(4)
    for unique in (True, False):
        keys = (rng.permutation(3000)[:1500] if unique else rng.integers(0, 800, 1500)).astype(np.uint64)
        grads = rng.normal(size=(len(keys), DIM)).astype(np.float32)
        shows = rng.integers(1, 4, len(keys)).astype(np.float32)
        np.testing.assert_allclose(client.pull("emb", keys, init_missing=True),
                                   ref.pull(keys, init_missing=True), rtol=1e-6, atol=1e-7)
        client.push("emb", keys, grads, shows=shows)
        ref.push(keys, grads, shows=shows)
        np.testing.assert_allclose(client.pull("emb", keys), ref.pull(keys), rtol=1e-5, atol=1e-6)
    client.close()


@pytest.mark.parametrize("serialize", [False, True])
@pytest.mark.parametrize("n_servers", [1, 2])
def test_push_delta_returning_values_equals_push_then_pull(monkeypatch, serialize, n_servers):
    """One round trip (GEO sync): the reply holds every key's value after the update, in the caller's
    order, duplicates included, across chunks and servers; new rows start from their initial value."""
    monkeypatch.setattr(codec, "CHUNK_BYTES", 1000)
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="uniform", seed=2)
    servers = [PSServer({"emb": cfg}, index=i, num_servers=n_servers, local_shards=3) for i in range(n_servers)]
    client = PSClient(InProcessTransport(servers, serialize=serialize))
    ref = SparseTable(cfg)
    rng = np.random.default_rng(8)
    for _ in range(3):
        keys = rng.integers(0, 700, 900).astype(np.uint64)
        deltas = rng.normal(size=(len(keys), DIM)).astype(np.float32)
        got = client.push_delta("emb", keys, deltas, return_values=True)
        ref.push_delta(keys, deltas)
        assert got.shape == (len(keys), DIM)
        np.testing.assert_allclose(got, ref.pull(keys), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got, client.pull("emb", keys))
    assert client.push_delta("emb", np.empty(0, np.uint64), np.empty((0, DIM), np.float32),
                             return_values=True).shape == (0, DIM)
    with pytest.raises(RemoteError, match="cannot return values"):
        client.transport.call(0, "Push", pb.PushRequest(
            table="emb", request_id="r-acc", keys=codec.encode(np.arange(3, dtype=np.uint64)),
            grads=codec.encode(np.ones((3, DIM), np.float32)), accumulate=True, return_values=True), 5.0)
    client.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_dense_step_with_a_non_finite_gradient_is_rejected_and_changes_nothing(bad):
    """DENSE_STEP writes the fresh parameters straight into its reply: a rejected step (a non-finite
    gradient anywhere, a block out of range) must still leave the table and the reply path untouched."""
    dense = {"mlp": DenseTableConfig(optimizer="adam", learning_rate=0.01)}
    servers, client = cluster(2, dense=dense)
    size = codec.DENSE_BLOCK + 1000                        # two blocks, one per server
    params = np.linspace(-1, 1, size).astype(np.float32)
    client.init_dense("mlp", params)
    fresh = client.push_pull_dense("mlp", np.full(size, 0.5, np.float32))
    assert fresh.shape == (size,) and (fresh < params).all()
    for pos in (0, codec.DENSE_BLOCK - 1, size - 1):
        grad = np.full(size, 0.5, np.float32)
        grad[pos] = bad
        with pytest.raises(ProtocolError, match="NaN or Inf"):          # the client checks first ...
            client.push_pull_dense("mlp", grad)
        block = pos // codec.DENSE_BLOCK
        length = codec.DENSE_BLOCK if block == 0 else 1000
        g = np.full(length, 0.5, np.float32)
        g[pos - block * codec.DENSE_BLOCK] = bad
        req = pb.DenseRequest(table="mlp", request_id="r-bad", op=pb.DENSE_STEP, block=block,
                              values=codec.encode(g))
        with pytest.raises(RemoteError, match="not finite"):             # ... and so does the server
            client.transport.call(block % 2, "Dense", req, 5.0)
    req = pb.DenseRequest(table="mlp", request_id="r-range", op=pb.DENSE_STEP, block=7,
                          values=codec.encode(np.ones(10, np.float32)))
    with pytest.raises(RemoteError, match="block 7 out of range: the table has 2 blocks"):
        client.transport.call(0, "Dense", req, 5.0)
    np.testing.assert_array_equal(client.pull_dense("mlp"), fresh)


@pytest.mark.nojit
def test_all_finite_kernel_finds_any_nan_or_inf():
    from engine.ps import _kernels
    a = np.ones((300, 7), np.float32)
    assert _kernels.all_finite(a) and _kernels.all_finite(a[:, ::2]) and _kernels.all_finite(a[:0])
    for bad in (np.nan, np.inf, -np.inf):
        for i, j in ((0, 0), (150, 3), (299, 6)):
            b = a.copy()
            b[i, j] = bad
            assert not _kernels.all_finite(b) and not _kernels.all_finite(b.T)
            assert _kernels.first_non_finite(b.reshape(-1)) == i * 7 + j
