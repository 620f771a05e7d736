"""A dense table's whole optimizer state over the wire (``DENSE_STATE_PULL`` / ``DENSE_STATE_SET``,
``PSClient.pull_dense_state`` / ``set_dense_state``) through real in-process servers: a round trip of
params, Adam's m, v and per-block t over blocks spread on two servers, the state the servers then step
from and checkpoint (``snapshot``); garbage refused naming the block and the field with nothing changed;
a retried set applied once; the admin token; and hybrid mode's replica resuming from the servers' state
(``HybridMode.init_dense``) and uploading it (``HybridMode.sync``)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import DenseTableConfig
from engine.errors import AccessDeniedError, ProtocolError, RemoteError
from engine.ps import InProcessTransport, PSClient, PSServer, codec, dense_host
from engine.ps import ps_pb2 as pb
from engine.ps.dense_client import DenseOptimizerState
from models.optim import Adam
from tests.integration.test_security import client as secured_client
from tests.integration.test_security import secured  # noqa: F401  (a fixture)

ADAM = DenseTableConfig(optimizer="adam", learning_rate=0.01)
SIZE = 30          # with blocks of 7 floats: blocks 0..4, block 4 has 2 floats
BLOCK = 7


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(codec, "DENSE_BLOCK", BLOCK)
    monkeypatch.setattr(dense_host, "DENSE_BLOCK", BLOCK)


def cluster(n=2, cfg=ADAM, **kw):
    servers = [PSServer({}, {"d": cfg}, index=i, num_servers=n, **kw) for i in range(n)]
    return servers, PSClient(InProcessTransport(servers), retries=0)


def trained(client, rng, steps=4):
    """Init the table and take ``steps`` server-side Adam steps -> reference (params, Adam)."""
    p0 = rng.normal(size=SIZE).astype(np.float32)
    client.init_dense("d", p0)
    ref, opt = p0.copy(), Adam(SIZE, ADAM.learning_rate)
    for _ in range(steps):
        g = rng.normal(size=SIZE).astype(np.float32)
        client.push_dense("d", g)
        opt.step(ref, g)
    return ref, opt


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def same_state(a: DenseOptimizerState, b: DenseOptimizerState) -> None:
    assert a.optimizer == b.optimizer
    for name in ("params", "m", "v"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert np.array_equal(bits(x), bits(y)), name
    assert (np.asarray(a.t) == np.asarray(b.t)).all(), (a.t, b.t)   # a scalar t: every block


def test_round_trip_over_blocks_spread_on_two_servers(small_blocks):
    servers, client = cluster(2)
    assert [sorted(s.dense["d"].blocks) for s in servers] == [[], []]
    rng = np.random.default_rng(0)
    ref, opt = trained(client, rng)
    assert [sorted(s.dense["d"].blocks) for s in servers] == [[0, 2, 4], [1, 3]]
    st = client.pull_dense_state("d")
    assert st.optimizer == "adam" and st.params.dtype == st.m.dtype == st.v.dtype == np.float32
    assert st.params.shape == st.m.shape == st.v.shape == (SIZE,) and st.t.tolist() == [4] * 5 and st.step == 4
    np.testing.assert_allclose(st.params, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(st.m, opt.m, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(st.v, opt.v, rtol=1e-6, atol=1e-9)

    # another state, with a step count of its own per block, set and read back bit for bit
    new = DenseOptimizerState(rng.normal(size=SIZE).astype(np.float32), rng.normal(size=SIZE).astype(np.float32),
                              rng.random(SIZE).astype(np.float32), np.array([5, 6, 7, 8, 9]), "adam")
    client.set_dense_state("d", new)
    same_state(client.pull_dense_state("d"), new)
    with pytest.raises(ProtocolError, match="stepped unequally"):
        client.pull_dense_state("d").step
    # what a checkpoint saves is that state (dense_host.DenseHost.snapshot)
    for s in servers:
        for bl, b in s.dense["d"].snapshot().blocks.items():
            a, z = bl * BLOCK, min(SIZE, (bl + 1) * BLOCK)
            assert np.array_equal(bits(b.params), bits(new.params[a:z])) and b.t == new.t[bl]
            assert np.array_equal(bits(b.m), bits(new.m[a:z])) and np.array_equal(bits(b.v), bits(new.v[a:z]))
    # and the servers step from it: each block's Adam continues from its own m, v, t
    g = rng.normal(size=SIZE).astype(np.float32)
    fresh = client.push_pull_dense("d", g)
    for bl in range(5):
        a, z = bl * BLOCK, min(SIZE, (bl + 1) * BLOCK)
        o = Adam(z - a, ADAM.learning_rate)
        o.load_state_dict({"m": new.m[a:z].copy(), "v": new.v[a:z].copy(), "t": int(new.t[bl])})
        p = new.params[a:z].copy()
        o.step(p, g[a:z].copy())
        assert np.array_equal(bits(fresh[a:z]), bits(p)), bl

    # a fresh cluster (nothing initialized) takes the whole state: a restore without a checkpoint file
    _, other = cluster(2)
    other.set_dense_state("d", new)
    same_state(other.pull_dense_state("d"), new)


def raw_set(client, block, size=SIZE, t=3, rid="x", **arrays):
    """One DENSE_STATE_SET straight to the block's server (the client's own checks bypassed)."""
    server = block % client.num_servers
    req = pb.DenseRequest(table="d", request_id=rid, block=block, op=pb.DENSE_STATE_SET, size=size, t=t)
    return client.transport.call(server, "Dense", codec.Wire(req, **arrays), 5.0)


@pytest.mark.parametrize("field, arrays, t", [
    ("m", {"m": np.zeros(6, np.float32)}, 3),                          # block 3 holds 7 floats
    ("v", {"v": np.full(7, np.nan, np.float32)}, 3),
    ("v", {"v": np.full(7, -1.0, np.float32)}, 3),                      # a second moment is >= 0
    ("t", {}, -2),
    ("values", {"values": np.full(7, np.inf, np.float32)}, 3),
    ("m", {"m": np.zeros(7, np.float64)}, 3),                           # the wrong dtype
    ("m and v", {"m": None, "v": None}, 3),                             # Adam needs its moments
])
def test_garbage_is_refused_naming_block_and_field_and_nothing_changes(small_blocks, field, arrays, t):
    servers, client = cluster(2)
    trained(client, np.random.default_rng(1))
    before = client.pull_dense_state("d")
    good = {"values": np.ones(7, np.float32), "m": np.ones(7, np.float32), "v": np.ones(7, np.float32)}
    with pytest.raises(RemoteError) as ei:
        raw_set(client, 3, t=t, **{**good, **arrays})
    assert ei.value.code == "INVALID_ARGUMENT", ei.value
    msg = str(ei.value)
    assert "block 3" in msg and field.split()[0] in msg and "table 'd'" in msg, msg
    same_state(client.pull_dense_state("d"), before)
    assert all(s.Health(pb.Empty()).json for s in servers)      # still serving
    # the client refuses the same garbage before sending anything
    bad = DenseOptimizerState(before.params.copy(), before.m.copy(), before.v.copy(), before.t.copy(), "adam")
    if field == "v":
        bad.v[10] = arrays["v"][0]
    elif field == "t":
        bad.t[3] = t
    elif field == "m":
        bad.m = bad.m[:-1] if arrays["m"].dtype == np.float32 else bad.m.astype(np.float64)
    elif field == "values":
        bad.params[10] = np.inf
    else:
        bad.m = bad.v = None
    with pytest.raises(ProtocolError):
        client.set_dense_state("d", bad)
    same_state(client.pull_dense_state("d"), before)


def test_sgd_tables_carry_params_only_and_a_size_mismatch_is_refused(small_blocks):
    servers, client = cluster(2, DenseTableConfig(optimizer="sgd", learning_rate=0.5))
    client.init_dense("d", np.ones(SIZE, np.float32))
    st = client.pull_dense_state("d")
    assert st.optimizer == "sgd" and st.m is None and st.v is None and st.t.tolist() == [0] * 5
    client.set_dense_state("d", DenseOptimizerState(np.full(SIZE, 2, np.float32), None, None, np.int64(0), "sgd"))
    np.testing.assert_array_equal(client.pull_dense("d"), np.full(SIZE, 2, np.float32))
    with pytest.raises(RemoteError, match="block 1: the table's optimizer is sgd"):
        raw_set(client, 1, values=np.ones(7, np.float32), m=np.ones(7, np.float32), v=np.ones(7, np.float32))
    with pytest.raises(RemoteError, match="block 1: size 31 given, the table has 30"):
        raw_set(client, 1, size=31, t=0, rid="y", values=np.ones(7, np.float32))
    with pytest.raises(ProtocolError, match="SGD table has no moments"):
        client.set_dense_state("d", DenseOptimizerState(st.params, st.params, st.params, st.t, "sgd"))
    np.testing.assert_array_equal(client.pull_dense("d"), np.full(SIZE, 2, np.float32))


@pytest.mark.parametrize("window", [64 << 20, 1], ids=["in-window", "evicted"])
def test_a_retried_set_is_applied_once(small_blocks, window):
    """The same request id again (a retry whose reply was lost) changes nothing, even after the table
    moved on, also when its reply was evicted from the reply window (``server.reply_window_bytes``)."""
    servers, client = cluster(2, reply_window_bytes=window)
    trained(client, np.random.default_rng(2))
    arrays = {"values": np.full(7, 3, np.float32), "m": np.full(7, 0.5, np.float32), "v": np.full(7, 0.25, np.float32)}
    assert raw_set(client, 3, t=11, rid="retry-1", **arrays).applied
    client.push_dense("d", np.ones(SIZE, np.float32))               # the table moves on
    after = client.pull_dense_state("d")
    assert after.t[3] == 12
    assert raw_set(client, 3, t=11, rid="retry-1", **arrays).applied
    same_state(client.pull_dense_state("d"), after)
    assert raw_set(client, 3, t=11, rid="retry-1", **arrays).applied
    same_state(client.pull_dense_state("d"), after)


def test_setting_the_state_needs_the_admin_token(secured):  # noqa: F811
    d, sec, ep, core = secured
    with secured_client(ep, sec) as c:
        before = c.pull_dense_state("d")
        assert before.optimizer == "sgd" and before.params.shape == (10,)
        st = DenseOptimizerState(np.ones(10, np.float32), None, None, np.int64(0), "sgd")
        with pytest.raises(AccessDeniedError, match="setting the optimizer state of table 'd' needs the admin token"):
            c.set_dense_state("d", st)
        same_state(c.pull_dense_state("d"), before)
    with secured_client(ep, sec, admin=True) as c:
        c.set_dense_state("d", st)
        same_state(c.pull_dense_state("d"), st)


def test_hybrid_mode_resumes_the_servers_state_and_uploads_its_own(small_blocks):
    """One hybrid worker (an MPI world of one) starts from the servers' params, m, v and t (a restored
    checkpoint) and steps exactly as the servers' table would; its drain uploads the whole state."""
    from mpi4py import MPI

    from engine.modes.hybrid import HybridMode
    rng = np.random.default_rng(3)
    _, client = cluster(2)
    trained(client, rng, steps=3)
    twin_servers, twin = cluster(2)                     # the same state, stepped by the servers
    twin.set_dense_state("d", client.pull_dense_state("d"))
    mode = HybridMode(client, rank=0, num_workers=1, dense_tables={"d": ADAM}, comm=MPI.COMM_SELF)
    start = mode.init_dense("d", np.zeros(SIZE, np.float32))     # not used: the servers hold a state
    same_state(mode.replicas["d"].state(), client.pull_dense_state("d"))
    assert mode.replicas["d"].opt.t == 3 and np.array_equal(start, twin.pull_dense("d"))
    for _ in range(2):
        g = rng.normal(size=SIZE).astype(np.float32)
        mine = mode.push_pull_dense("d", g)
        assert np.array_equal(bits(mine), bits(twin.push_pull_dense("d", g)))
    mode.sync()
    same_state(client.pull_dense_state("d"), twin.pull_dense_state("d"))
    assert client.pull_dense_state("d").t.tolist() == [5] * 5


def test_a_fresh_hybrid_job_starts_from_its_initial_params_with_zero_moments():
    from mpi4py import MPI

    from engine.modes.hybrid import HybridMode
    _, client = cluster(1)
    p0 = np.arange(SIZE, dtype=np.float32)
    mode = HybridMode(client, rank=0, num_workers=1, dense_tables={"d": ADAM}, comm=MPI.COMM_SELF)
    assert np.array_equal(mode.init_dense("d", p0), p0)
    rep = mode.replicas["d"]
    assert rep.opt.t == 0 and not rep.opt.m.any() and not rep.opt.v.any()
