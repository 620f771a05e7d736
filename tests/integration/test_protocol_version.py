"""Roles of two engine versions in one job (a rolling upgrade) are refused when they connect, naming both
protocol versions (``engine.ps.protocol``), instead of training with fields the other side does not know.

Found with real mixed clusters (``engine train CONFIG --role server|worker`` from this tree and from a
worktree of commit 69a1645, 2026-11-29): an old coordinator against a new server had its first delta
refused mid-job as "delta parent mismatch ... another coordinator saved or loaded since" (the old Save
names no parent), and new workers against an old server trained on with the delta-parent check silently
off. The tests below rebuild what the old side sends, so they need no old code:

* an old client sends no ``engine-protocol`` metadata: a raw gRPC stub without it is what it was;
* an old server's ``Health`` answer has no ``protocol`` field: a gRPC server answering the JSON that
  69a1645's ``PSServer.Health`` wrote (its keys, copied) is what it was.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from engine.errors import ProtocolVersionError
from engine.ps import PSClient, PSServer, codec
from engine.ps import ps_pb2 as pb
from engine.ps import ps_pb2_grpc as pb_grpc
from engine.ps.grpc_service import serve
from engine.ps.protocol import PROTOCOL_VERSION
from sparse_tables import TableConfig
from tests.faults import protocol_channel

REPO = Path(__file__).resolve().parents[2]
DIM = 4
KEYS = np.arange(1, 6, dtype=np.uint64)


@pytest.fixture
def server():
    core = PSServer({"emb": TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros")},
                    local_shards=1)
    srv, port = serve(core, "127.0.0.1", 0, threads=4)
    yield f"127.0.0.1:{port}", core
    srv.stop(0).wait()
    core.close()


def _push(rid: str) -> pb.PushRequest:
    return pb.PushRequest(table="emb", request_id=rid, keys=codec.encode(KEYS),
                          grads=codec.encode(np.ones((len(KEYS), DIM), np.float32)))


def test_a_client_of_an_older_engine_is_refused_naming_both_versions_and_nothing_is_applied(server):
    ep, core = server
    with grpc.insecure_channel(ep) as ch:       # an old client: no protocol metadata
        old = pb_grpc.ParameterServerStub(ch)
        health = json.loads(old.Health(pb.Empty(request_id="h"), timeout=10).json)     # still answered
        assert health["protocol"] == PROTOCOL_VERSION and health["ready"]
        for call, req in ((old.Push, _push("old-1")), (old.Pull, pb.PullRequest(table="emb", request_id="old-2",
                                                                                 keys=codec.encode(KEYS)))):
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            msg = e.value.details()
            assert "protocol version mismatch" in msg and "no protocol version" in msg
            assert f"this server speaks protocol {PROTOCOL_VERSION}" in msg and "nothing was applied" in msg
        with pytest.raises(grpc.RpcError) as e:      # another version, named
            old.Push(_push("old-3"), timeout=10, metadata=(("engine-protocol", "1"),))
        assert "the client speaks protocol 1" in e.value.details()
        json.loads(old.Stats(pb.Empty(request_id="s"), timeout=10).json)    # monitoring stays open
    assert len(core.sparse["emb"].shards[0]) == 0                           # the old pushes changed nothing
    with PSClient([ep], retries=0) as c:        # this version's client is served
        c.push("emb", KEYS, np.ones((len(KEYS), DIM), np.float32))
        np.testing.assert_array_equal(c.pull("emb", KEYS), -np.ones((len(KEYS), DIM), np.float32))
    ch = protocol_channel(ep)                   # ... and so is a raw stub that names the version
    try:
        # 60 s: the first push without show counts may compile its kernel (a cold Numba cache in a fresh
        # clone), which took over 10 s on a loaded CI machine (DEADLINE_EXCEEDED, 2026-11-30)
        pb_grpc.ParameterServerStub(ch).Push(_push("new-1"), timeout=60)
    finally:
        ch.close()


#: the keys of 69a1645's ``PSServer.Health`` answer (2026-11-29): no ``protocol``
_OLD_HEALTH = {"ready": True, "live": True, "failed": None, "preempting": False, "stuck": None, "restored": None,
               "restoring": None, "generation": 1796000000000000000, "fresh": True, "writers": [], "clients": [],
               "writers_dropped": 0, "clients_dropped": 0, "fenced": None, "fenced_from": None,
               "checkpoint_floor": None, "server": 0, "num_servers": 1, "num_vshards": 1024,
               "max_message_bytes": 64 << 20, "sparse": {"emb": {"dim": DIM}}, "dense": {}}


@pytest.fixture
def old_server():
    """A server of an engine before protocol versions: its Health as 69a1645 answered it, and a Pull that
    answers zeros (which a client without the check would have trained on)."""
    pulls = []

    def health(request, context):
        return pb.JsonResponse(request_id=request.request_id, json=json.dumps(_OLD_HEALTH))

    def pull(request, context):
        pulls.append(request.request_id)
        n = np.frombuffer(request.keys.data, np.uint64).size
        return pb.PullResponse(request_id=request.request_id, values=codec.encode(np.zeros((n, DIM), np.float32)))

    srv = grpc.server(ThreadPoolExecutor(2))
    handlers = {"Health": grpc.unary_unary_rpc_method_handler(health, pb.Empty.FromString,
                                                              pb.JsonResponse.SerializeToString),
                "Pull": grpc.unary_unary_rpc_method_handler(pull, pb.PullRequest.FromString,
                                                            pb.PullResponse.SerializeToString)}
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("engine.ps.ParameterServer", handlers),))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", pulls
    srv.stop(0).wait()


def test_a_server_of_an_older_engine_is_refused_before_any_data_request(old_server):
    ep, pulls = old_server
    with PSClient([ep], retries=0) as c:
        for what in (c.health, lambda: c.pull("emb", KEYS)):
            with pytest.raises(ProtocolVersionError) as e:
                what()
            msg = str(e.value)
            assert f"server 0 ({ep}) speaks no protocol version" in msg
            assert f"this client speaks protocol {PROTOCOL_VERSION}" in msg and "same engine version" in msg
    assert pulls == []


def test_a_worker_role_meeting_an_older_server_exits_2_with_one_line(old_server, tmp_path):
    """``engine train --role worker``: the refusal is one line naming both versions, exit code 2 (a
    scheduler restarting the role would meet the same server)."""
    ep, pulls = old_server
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {kind: logreg}\ncluster: {servers: 1, workers: 1, warm_up: false, "
                   "startup_timeout_s: 20}\n")
    env = {"ENGINE_SERVERS": ep, "ENGINE_NUM_WORKERS": "1", "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "engine", "train", str(cfg), "--role", "worker", "--rank", "0"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("engine train: protocol version mismatch: server 0") and "Traceback" not in p.stderr
    assert pulls == []
