"""Real server processes on 127.0.0.1 (2 servers) and real worker processes (3), checked
algebraically; plus malformed requests from a raw gRPC client built from the generated stub."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from engine.config import from_dict
from engine.launch.local import LocalCluster
from engine.ps import PSClient, codec, routing
from engine.ps import ps_pb2 as pb
from engine.ps import ps_pb2_grpc as pb_grpc
from tests.faults import protocol_channel

pytestmark = pytest.mark.slow

N_PUSH = 10
WORKERS = 3
KEYS = np.arange(1000, dtype=np.uint64)

CONFIG = {
    "cluster": {"servers": 2, "workers": WORKERS, "startup_timeout_s": 60},
    "tables": {"sparse": {name: {"dim": 4, "optimizer": "sgd", "learning_rate": 1.0, "initializer": "zeros"}
                          for name in ("emb", "delta", "sync")},
               "dense": {"d": {"optimizer": "sgd", "learning_rate": 1.0}}},
}

WORKER_SCRIPT = r"""
import json, sys
import numpy as np
from engine.ps import PSClient
from engine.modes import SyncMode
a = json.loads(sys.argv[1])
keys = np.arange(1000, dtype=np.uint64)
g = ((keys % 7).astype(np.float32) * 0.25)[:, None].repeat(4, axis=1)
c = PSClient(a["endpoints"], name=f"w{a['rank']}")
out = []
if a["op"] == "push":
    for _ in range(a["n"]):
        c.push("emb", keys, g)
elif a["op"] == "delta":
    for _ in range(a["n"]):
        c.push_delta("delta", keys, g)
elif a["op"] == "sync":
    m = SyncMode(c, rank=a["rank"], num_workers=a["world"], barrier_timeout_s=60)
    for step in range(a["n"]):
        before = m.pull_sparse("sync", keys).copy()
        m.push_sparse_grads("sync", keys, g * np.float32(a["rank"] + 1))
        held = bool(np.array_equal(m.pull_sparse("sync", keys), before))
        m.end_step()
        out.append({"held": held, "after": m.pull_sparse("sync", keys)[:, 0].tolist()})
    m.finish()
c.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(from_dict(CONFIG), tmp_path_factory.mktemp("ps-cluster"))
    try:
        c.start_servers()
        yield c
    finally:
        c.stop_servers()
        c.shutdown()


def run_workers(cluster, op: str, n: int) -> list:
    procs = [subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT,
                               json.dumps({"endpoints": cluster.endpoints, "rank": r, "world": WORKERS,
                                           "op": op, "n": n})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORKERS)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return outs


def g_of(keys):
    return (keys % 7).astype(np.float32) * 0.25


def test_async_pushes_from_three_workers_add_exactly(cluster):
    run_workers(cluster, "push", N_PUSH)
    with PSClient(cluster.endpoints) as c:
        got = c.pull("emb", KEYS)
    expected = -WORKERS * N_PUSH * g_of(KEYS)
    np.testing.assert_array_equal(got, np.repeat(expected[:, None], 4, axis=1))


def test_geo_deltas_add_exactly(cluster):
    run_workers(cluster, "delta", N_PUSH)
    with PSClient(cluster.endpoints) as c:
        got = c.pull("delta", KEYS)
    np.testing.assert_array_equal(got[:, 0], WORKERS * N_PUSH * g_of(KEYS))


def test_sync_mode_applies_one_merged_update_per_step(cluster):
    steps = 3
    outs = run_workers(cluster, "sync", steps)
    g = g_of(KEYS)
    for out in outs:
        for step, rec in enumerate(out):
            assert rec["held"], "a push was applied before the step's barrier"
            # each step: mean over workers of (rank + 1) * g = 2 g, applied once with lr 1
            np.testing.assert_allclose(rec["after"], -2.0 * (step + 1) * g, rtol=1e-6, atol=1e-6)


@pytest.fixture
def stub(cluster):
    channel = protocol_channel(cluster.endpoints[0])
    yield pb_grpc.ParameterServerStub(channel)
    channel.close()


def own_keys(n=10):
    keys = np.arange(10_000, 10_000 + 50 * n, dtype=np.uint64)
    return keys[routing.route(keys, 1024, 2) == 0][:n]


def test_malformed_requests_get_clear_errors_and_the_server_keeps_serving(cluster, stub):
    keys = own_keys()
    good = pb.PushRequest(table="emb", request_id="ok-1", keys=codec.encode(keys),
                          grads=codec.encode(np.ones((len(keys), 4), np.float32)))
    stub.Push(good, timeout=10)
    before = stub.Pull(pb.PullRequest(table="emb", request_id="p-0", keys=codec.encode(keys)), timeout=10)
    nan = np.ones((len(keys), 4), np.float32)
    nan[3, 1] = np.nan
    bad = {
        "truncated": (pb.PushRequest(table="emb", request_id="bad-trunc",
                                     keys=pb.Tensor(dtype="<u8", shape=[len(keys)], data=codec.encode(keys).data[:-1]),
                                     grads=good.grads), grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        "dtype": (pb.PushRequest(table="emb", request_id="bad-dtype", keys=codec.encode(keys.astype(np.float64)),
                                 grads=good.grads), grpc.StatusCode.INVALID_ARGUMENT, "expected dtype <u8"),
        "dim": (pb.PushRequest(table="emb", request_id="bad-dim", keys=good.keys,
                               grads=codec.encode(np.ones((len(keys), 5), np.float32))),
                grpc.StatusCode.INVALID_ARGUMENT, "expected shape"),
        "nan": (pb.PushRequest(table="emb", request_id="bad-nan", keys=good.keys, grads=codec.encode(nan)),
                grpc.StatusCode.INVALID_ARGUMENT, "not finite"),
        "table": (pb.PushRequest(table="nope", request_id="bad-table", keys=good.keys, grads=good.grads),
                  grpc.StatusCode.NOT_FOUND, "unknown sparse table 'nope'"),
    }
    for name, (req, code, text) in bad.items():
        with pytest.raises(grpc.RpcError) as ei:
            stub.Push(req, timeout=10)
        err = ei.value
        assert err.code() == code, name
        assert text in err.details() and req.request_id in err.details(), err.details()
        assert "server 0/2" in err.details() and "shard" in err.details()
    with pytest.raises(grpc.RpcError) as ei:
        stub.Pull(pb.PullRequest(table="emb", request_id="bad-pull", keys=pb.Tensor(dtype="<u8", shape=[2],
                                                                                     data=b"short")), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    step = {"nan": (pb.StepRequest(table="emb", request_id="bad-step-nan", keys=good.keys,
                                   grads=codec.encode(nan), pull_keys=good.keys), "not finite"),
            "routed": (pb.StepRequest(table="emb", request_id="bad-step-route", keys=good.keys, grads=good.grads,
                                      pull_keys=codec.encode(np.arange(10_000, 10_050, dtype=np.uint64))),
                       "not routed to this server"),
            "dense": (pb.StepRequest(table="emb", request_id="bad-step-dense", keys=good.keys, grads=good.grads,
                                     dense_table="nope", blocks=[0],
                                     dense_grads=codec.encode(np.ones(3, np.float32))), "unknown dense table")}
    for name, (req, text) in step.items():     # the push part of each is valid: nothing may be applied
        with pytest.raises(grpc.RpcError) as ei:
            stub.Step(req, timeout=10)
        assert ei.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), name
        assert text in ei.value.details() and req.request_id in ei.value.details(), ei.value.details()
    after = stub.Pull(pb.PullRequest(table="emb", request_id="p-1", keys=codec.encode(keys)), timeout=10)
    assert after.values.data == before.values.data    # no rejected request changed anything
    got = stub.Step(pb.StepRequest(table="emb", request_id="ok-step", keys=good.keys, grads=good.grads,
                                   pull_keys=good.keys), timeout=10)
    assert got.values.data != before.values.data      # a good Step pushes, then pulls what it pushed
    np.testing.assert_array_equal(np.frombuffer(got.values.data, np.float32).reshape(-1, 4),
                                  np.frombuffer(before.values.data, np.float32).reshape(-1, 4) - 1.0)
    assert json.loads(stub.Health(pb.Empty(request_id="h"), timeout=10).json)["ready"]


def test_truncated_raw_frames_get_invalid_argument_with_context(cluster, stub):
    """Bytes that are not a whole message (cut inside an array, or garbage) reach the handler and get
    INVALID_ARGUMENT naming the server, the table and the request id that could be read."""
    keys = own_keys()
    raw = protocol_channel(cluster.endpoints[0])
    try:
        push = raw.unary_unary("/engine.ps.ParameterServer/Push", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        pull = raw.unary_unary("/engine.ps.ParameterServer/Pull", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        before = stub.Pull(pb.PullRequest(table="emb", request_id="p-0", keys=codec.encode(keys)), timeout=10)
        frame = codec.serialize(codec.Wire(pb.PushRequest(table="emb", request_id="cut-1"), keys=keys,
                                           grads=np.ones((len(keys), 4), np.float32)))
        for body, rid in ((frame[:-5], "cut-1"), (frame[:40], "cut-1"), (b"\xff" * 9, "-")):
            with pytest.raises(grpc.RpcError) as ei:
                push(body, timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, body[:20]
            details = ei.value.details()
            assert "server 0/2" in details and f"request {rid}" in details, details
            if rid != "-":
                assert "table 'emb'" in details and "truncated" in details, details
        with pytest.raises(grpc.RpcError) as ei:
            pull(codec.serialize(codec.Wire(pb.PullRequest(table="emb", request_id="cut-2"), keys=keys))[:-1],
                 timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cut-2" in ei.value.details()
        after = stub.Pull(pb.PullRequest(table="emb", request_id="p-1", keys=codec.encode(keys)), timeout=10)
        assert after.values.data == before.values.data
        assert pull(codec.serialize(codec.Wire(pb.PullRequest(table="emb", request_id="ok"), keys=keys)),
                    timeout=10)
    finally:
        raw.close()


def test_an_expiry_pass_longer_than_the_call_timeout_is_waited_for(tmp_path, monkeypatch):
    """An expiry pass over 10^8 keys took 47-89 s on one server, past the client's 60 s per-call
    timeout: ``shrink`` waits like ``save`` and ``load`` do. A failpoint stands for the long pass."""
    monkeypatch.setenv("ENGINE_FAILPOINTS", "server.shrink=sleep:3")
    cfg = from_dict({"cluster": {"servers": 1, "workers": 1, "startup_timeout_s": 60},
                     "tables": {"sparse": {"emb": {"dim": 4, "optimizer": "sgd", "expire_after": 3600}}}})
    with LocalCluster(cfg, tmp_path) as c:
        eps = c.start_servers()
        # the 1 s per-call timeout is for the expiry pass alone; the push and pull around it take the
        # default (a loaded machine can take longer than 1 s to answer them)
        with PSClient(eps) as other, PSClient(eps, timeout_s=1.0, retries=0) as client:
            other.push("emb", KEYS, np.ones((len(KEYS), 4), np.float32))
            t0 = time.monotonic()
            assert client.shrink("emb") == 0          # rows pushed just now do not expire
            assert time.monotonic() - t0 >= 3.0       # the pass did outlast the 1 s per-call timeout
            assert other.pull("emb", KEYS).shape == (len(KEYS), 4)
        c.stop_servers()

