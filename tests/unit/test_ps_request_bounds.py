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
import time

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


# ---------------------------------------------------------------------------------------- held state
def metric_add(name: str, counts, sums=(0.0,), rid: str = "w@1:1"):
    return codec.Wire(pb.MetricRequest(table=name, request_id=rid, op=pb.METRIC_ADD),
                      counts=np.asarray(counts, np.int64), sums=np.asarray(sums, np.float64))


def metric_read(core, name: str) -> list[int]:
    r = core.handle("Metric", pb.MetricRequest(table=name, request_id="r", op=pb.METRIC_READ))
    return r.arrays["counts"].tolist()


def test_metric_counts_never_wrap_around(core):
    """A count's sum wrapped around int64 silently; a negative count is legitimate (the online job's
    decisions add END = -1: ``engine.programs.online_next``)."""
    big = np.iinfo(np.int64).max - 1
    core.handle("Metric", metric_add("m", [big, -big, -1], rid="w@1:1"))
    e = refused(core, "Metric", metric_add("m", [5, 0, 0], rid="w@1:2"))
    assert e.code == "OUT_OF_RANGE" and "at index 0 holds 9223372036854775806; adding 5 would pass" in str(e)
    e = refused(core, "Metric", metric_add("m", [0, -big, 0], rid="w@1:3"))
    assert e.code == "OUT_OF_RANGE" and "at index 1 holds -9223372036854775806" in str(e)
    assert metric_read(core, "m") == [big, -big, -1]                          # nothing changed
    core.handle("Metric", metric_add("m", [1, -1, -1], rid="w@1:4"))          # up to the ends: fine
    assert metric_read(core, "m") == [big + 1, -big - 1, -2]
    e = refused(core, "Metric", metric_add("n" * 300, [1], rid="w@1:5"))
    assert e.code == "INVALID_ARGUMENT" and "at most 256 characters, got 300" in str(e)


def test_metric_accumulators_are_capped_in_number_and_bytes(core, monkeypatch):
    from engine.ps import metric_sums
    for i in range(1024):                                                       # MAX_ACCUMULATORS
        core.handle("Metric", metric_add(f"m{i}", [1], rid=f"w@1:{i}"))
    e = refused(core, "Metric", metric_add("one-more", [1], rid="w@2:1"))
    assert e.code == "FAILED_PRECONDITION" and "would pass 1024 accumulators or 67108864 bytes" in str(e)
    core.handle("Metric", metric_add("m0", [1], rid="w@2:2"))                   # existing ones still add
    assert metric_read(core, "m0") == [2]
    core.handle("Metric", pb.MetricRequest(table="m1", request_id="w@2:3", op=pb.METRIC_RESET))
    core.handle("Metric", metric_add("one-more", [1], rid="w@2:4"))             # a reset frees its place
    monkeypatch.setattr(metric_sums, "MAX_BYTES", 1 << 20, raising=False)                      # a 2 MiB accumulator: too big
    core.metric_sums.clear()
    e = refused(core, "Metric", metric_add("big", np.ones(1 << 18), rid="w@2:5"))
    assert e.code == "FAILED_PRECONDITION" and "a new one of 2097160 bytes would pass" in str(e)


def test_held_sync_pushes_are_capped_until_the_applying_barrier(core, monkeypatch):
    from engine.ps import hosts
    monkeypatch.setattr(hosts, "MAX_PENDING_BYTES", 100, raising=False)                         # one push: 24 + 48 bytes

    def push(i):
        return codec.Wire(pb.PushRequest(table="emb", request_id=f"w@1:{i}", accumulate=True),
                          keys=np.arange(1, 4, dtype=np.uint64), grads=np.ones((3, DIM), np.float32))
    core.handle("Push", push(1))
    e = refused(core, "Push", push(2))
    assert e.code == "FAILED_PRECONDITION" and "72 bytes of sync pushes are held" in str(e)
    assert "pass the 100 a server holds per table" in str(e)
    r = core.handle("Barrier", pb.BarrierRequest(request_id="w@1:3", name="sync:step", world=1, apply_pending=True))
    assert r.released
    core.handle("Push", push(4))                                                # applied: room again


def test_barriers_forget_arrivals_never_polled_again_and_are_capped(monkeypatch):
    from engine.ps import barrier
    from engine.ps.barrier import BarrierError, Barriers
    monkeypatch.setattr(barrier, "PRUNE_EVERY_S", 0.0, raising=False)
    b = Barriers(lease_s=0.05, prune_after_s=0.1, linger_s=0)
    assert not b.arrive("left", "t1", 2, 10.0).released       # its caller never polls again
    time.sleep(0.3)
    b.arrive("other", "t2", 1, 10.0)
    assert "left" not in b.stats()                             # the arrival went stale, then the barrier
    with pytest.raises(BarrierError) as e:
        b.arrive("n" * 300, "t3", 1, 10.0)
    assert e.value.code == "INVALID_ARGUMENT" and "at most 256 characters, got 300" in str(e.value)
    monkeypatch.setattr(barrier, "MAX_BARRIERS", 3, raising=False)
    held = Barriers(lease_s=60, prune_after_s=600, linger_s=0)
    for i in range(3):
        held.arrive(f"b{i}", f"t{i}", 2, 10.0)
    with pytest.raises(BarrierError) as e:
        held.arrive("b3", "t3", 2, 10.0)
    assert e.value.code == "FAILED_PRECONDITION" and "holds 3 barriers, the most it keeps" in str(e.value)
    assert held.arrive("b0", "t9", 2, 10.0).released          # an existing one is served (its 2nd arrival opens it)


def test_all_barriers_held_forgets_the_ones_idle_for_a_lease_instead_of_refusing(monkeypatch):
    """The online job uses four barriers per hourly partition: catching up on more than MAX_BARRIERS / 4
    small hours within ``prune_after_s`` (600 s) was refused FAILED_PRECONDITION (a real server refused
    its 4,097th barrier 3.3 s into a loop of released ones), and the job restarted. Now a full table
    forgets the idle barriers last used ``lease_s`` ago; one still waited at stays."""
    from engine.ps import barrier
    from engine.ps.barrier import BarrierError, Barriers
    monkeypatch.setattr(barrier, "MAX_BARRIERS", 4, raising=False)
    b = Barriers(lease_s=0.1, prune_after_s=600, linger_s=0)
    assert not b.arrive("waited", "w0", 2, 10.0).released      # a caller waiting at it (polling)
    for i in range(3):
        assert b.arrive(f"trained-{i}", f"t{i}", 1, 10.0).released     # released: nobody waits any more
    with pytest.raises(BarrierError) as e:
        b.arrive("trained-3", "t3", 1, 10.0)                   # all four used just now: refused
    assert e.value.code == "FAILED_PRECONDITION" and "holds 4 barriers, the most it keeps" in str(e.value)
    time.sleep(0.15)
    b.arrive("waited", "w0", 2, 10.0)                           # its caller polls: it stays
    assert b.arrive("trained-3", "t3", 1, 10.0).released       # the idle ones are forgotten
    assert set(b.stats()) == {"waited", "trained-3"}
    assert b.arrive("waited", "w1", 2, 10.0).released          # the waited one still opens
