"""What one request may make a server hold or do, checked on a real ``PSServer`` (``handle``, the
method every transport calls): the size of a dense table a client initializes, the names a refused
request leaves behind, unknown push kinds, metric accumulators, held sync pushes and barrier arrivals,
the length of request ids and of the client strings an error echoes, and a Fence that names no
generation."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engine.config import DenseTableConfig
from engine.ps import PSServer, codec
from engine.ps import ps_pb2 as pb
from engine.ps.server import ServerError
from sparse_tables import TableConfig

DIM = 4


@pytest.fixture
def core():
    c = PSServer({"emb": TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros")},
                 {"d": DenseTableConfig(optimizer="sgd", learning_rate=1.0)}, local_shards=2,
                 max_dense_floats=1 << 20)
    yield c
    c.close()


def refused(core, method: str, request) -> ServerError:
    with pytest.raises(ServerError) as e:
        core.handle(method, request)
    return e.value


def dense_init(size: int, n: int, rid: str = "w@1:1") -> pb.DenseRequest:
    return codec.Wire(pb.DenseRequest(table="d", request_id=rid, op=pb.DENSE_INIT, block=0, size=size),
                      values=np.zeros(n, np.float32))


# ---------------------------------------------------------------------------------------- dense size
def test_a_dense_init_over_the_limit_allocates_nothing_and_the_real_one_then_succeeds(core):
    e = refused(core, "Dense", dense_init(1 << 31, codec.DENSE_BLOCK))
    assert e.code == "INVALID_ARGUMENT"
    assert "size: 2147483648 floats is more than server.max_dense_floats = 1048576" in str(e)
    assert core.dense["d"].size is None and core.dense["d"].blocks == {}
    e = refused(core, "Dense", dense_init(-10, 1, "w@1:4"))
    assert e.code == "INVALID_ARGUMENT" and "size: a dense table has >= 1 floats, got -10" in str(e)
    assert core.handle("Dense", dense_init(1000, 1000, "w@1:2")).msg.applied      # the job's own init
    assert core.dense["d"].size == 1000
    e = refused(core, "Dense", dense_init(2000, 2000, "w@1:3"))
    assert "size: init with size 2000, but the table was initialized with size 1000" in str(e)


def test_setting_a_dense_state_over_the_limit_is_refused(core):
    req = codec.Wire(pb.DenseRequest(table="d", request_id="a@1:1", op=pb.DENSE_STATE_SET, block=0, size=1 << 21),
                     values=np.zeros(codec.DENSE_BLOCK, np.float32))
    e = refused(core, "Dense", req)
    assert e.code == "INVALID_ARGUMENT" and "more than server.max_dense_floats = 1048576" in str(e)
    assert core.dense["d"].size is None


def test_an_allocation_that_fails_half_way_leaves_the_table_uninitialized(tmp_path):
    """Under an address-space limit the blocks of a 4 GiB table cannot all be allocated: MemoryError
    half-way. Before, the table had taken the size first, so it was left sized with blocks missing and
    the job's real init was refused for its size."""
    script = textwrap.dedent("""
        import resource, sys
        import numpy as np
        from engine.config import DenseTableConfig
        from engine.ps import PSServer, codec
        from engine.ps import ps_pb2 as pb
        from engine.ps.server import ServerError
        core = PSServer({}, {"d": DenseTableConfig(optimizer="adam")}, local_shards=2, max_dense_floats=1 << 31)
        used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (used + (400 << 20), resource.RLIM_INFINITY))
        def init(size, n):
            return core.handle("Dense", codec.Wire(pb.DenseRequest(table="d", request_id=f"w@1:{size}",
                               op=pb.DENSE_INIT, block=0, size=size), values=np.zeros(n, np.float32)))
        try:
            init(1 << 30, codec.DENSE_BLOCK)
            print("ALLOCATED")
        except ServerError as e:
            print("REFUSED", e.code)
        print("SIZE", core.dense["d"].size, len(core.dense["d"].blocks))
        print("REAL", init(1000, 1000).msg.applied)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["REFUSED INTERNAL", "SIZE None 0", "REAL True"], out.stdout


# ---------------------------------------------------------------------------------------- clients, ids
def pull(rid: str, table: str = "emb") -> codec.Wire:
    return codec.Wire(pb.PullRequest(table=table, request_id=rid), keys=np.arange(1, 4, dtype=np.uint64))


def clients(core) -> list[str]:
    return json.loads(core.handle("Health", pb.Empty(request_id="h")).json)["clients"]


def test_a_refused_request_does_not_make_its_sender_a_client(core):
    """A worker whose first request failed on a config error (an unknown table) took no part: restarted,
    it must not find its name in ``clients`` (``roles._agreed`` would say it was restarted within the
    attempt, and fence the running job)."""
    assert refused(core, "Pull", pull("worker1@abc:1", "no-such-table")).code == "NOT_FOUND"
    assert refused(core, "Push", codec.Wire(pb.PushRequest(table="emb", request_id="worker1@abc:2"),
                                            keys=np.arange(3, dtype=np.uint64),
                                            grads=np.ones((3, 2), np.float32))).code == "INVALID_ARGUMENT"
    assert clients(core) == []
    core.handle("Pull", pull("worker1@abc:3"))
    assert clients(core) == ["worker1"]


def test_long_request_ids_are_refused_and_client_strings_are_clipped_in_errors(core):
    e = refused(core, "Pull", pull("w" * 300 + "@abc:1"))
    assert e.code == "INVALID_ARGUMENT"
    assert "request_id: 306 characters, more than the 256 a server accepts" in str(e)
    assert clients(core) == [] and len(str(e)) < 800
    e = refused(core, "Pull", pull("w@abc:2", "t" * 20000))
    assert e.code == "NOT_FOUND" and "...(20000 characters)" in str(e) and len(str(e)) < 1000


def test_over_grpc_a_long_table_name_is_still_not_found(core):
    """A 20 KB string echoed whole made the error's metadata too large: gRPC answered RESOURCE_EXHAUSTED,
    which a PSClient retries as an overload for client.timeout_s."""
    from engine.errors import RemoteError
    from engine.ps import serve
    from engine.ps.transport import GrpcTransport
    server, port = serve(core, "127.0.0.1", 0, threads=2)
    transport = GrpcTransport([f"127.0.0.1:{port}"], retries=0)
    try:
        for rid, table, code in (("w@1:1", "t" * 20000, "NOT_FOUND"), ("w" * 20000, "emb", "INVALID_ARGUMENT")):
            with pytest.raises(RemoteError) as e:
                transport.call(0, "Pull", pb.PullRequest(table=table, request_id=rid), 10.0)
            assert e.value.code == code, e.value
    finally:
        transport.close()
        server.stop(0).wait()


# ---------------------------------------------------------------------------------------- push kind
def test_a_push_of_an_unknown_kind_is_refused_naming_the_field(core):
    key = np.array([12345], np.uint64)
    for i, kind in enumerate((2, 7, 1000)):      # proto3 keeps them; they were applied as gradients
        wire = codec.Wire(pb.PushRequest(table="emb", request_id=f"w@1:{i}", kind=kind), keys=key,
                          grads=np.ones((1, DIM), np.float32))
        req = codec.parse(codec.serialize(wire), codec.REQUEST["Push"])      # as it arrives
        e = refused(core, "Push", req)
        assert e.code == "INVALID_ARGUMENT" and f"kind: {kind} is no PushKind (GRAD = 0, DELTA = 1)" in str(e)
    reply = core.handle("Pull", codec.Wire(pb.PullRequest(table="emb", request_id="w@1:9"), keys=key))
    assert not reply.arrays["values"].any()      # nothing applied (zeros initializer, SGD lr 1)
    assert core.sparse["emb"].stats()["push_keys"] == 0


# ---------------------------------------------------------------------------------------- fence
def test_a_fence_that_names_no_generation_is_refused(core):
    """Generation 0 means "any" to the generation check: an empty FenceRequest ended the running attempt.
    ``PSClient.fence`` always names the generation it read from Health."""
    before = json.loads(core.handle("Health", pb.Empty(request_id="h")).json)
    e = refused(core, "Fence", pb.FenceRequest(request_id="x@1:1", reason="no generation"))
    assert e.code == "INVALID_ARGUMENT" and "generation: a Fence must name the generation it ends" in str(e)
    after = json.loads(core.handle("Health", pb.Empty(request_id="h")).json)
    assert after["generation"] == before["generation"] and after["fenced"] is None
    fenced = core.handle("Fence", pb.FenceRequest(request_id="x@1:2", generation=before["generation"], reason="ok"))
    assert json.loads(fenced.json)["fenced"] == "ok"
