"""Role mode as a scheduler without a launcher runs it (Kubernetes Jobs): the plaintext health port
answers the standard gRPC health checking protocol (SERVING, NOT_SERVING while preempting) and serves
nothing else; with ``cluster.stop_servers_at_end`` the workers' job-end protocol stops the servers, and
every process exits 0."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.ps import ps_pb2 as pb
from tests.integration.test_multihost import engine
from tests.integration.test_role_resume import free_ports
from tests.integration.test_status import status
from tests.waiting import until

pytestmark = pytest.mark.slow

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def health(port: int, service: str = "") -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def wait_health(port: int, want: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = health(port)
            if last == want:
                return
        except grpc.RpcError as e:
            last = e.code().name
        time.sleep(0.1)
    raise AssertionError(f"health never {want}: {last}")


def test_health_port_and_the_job_end_protocol(tmp_path, loopback_reference):
    _, resolved = loopback_reference
    ports = free_ports(4)
    env = {**os.environ, "ENGINE_SERVERS": f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", "ENGINE_NUM_WORKERS": "2"}
    sets = ["--set", f"checkpoint.root={tmp_path / 'ckpt-role'}", "--set", "cluster.stop_servers_at_end=true"]
    procs = []
    try:
        for r in range(2):
            procs.append(subprocess.Popen(engine(resolved, "--role", "server", "--rank", r, "--port", ports[r],
                                                 "--health-port", ports[2 + r], *sets), cwd=REPO, env=env,
                                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"s{r}.log", "w"),
                                          start_new_session=True))
        for r in range(2):
            wait_health(ports[2 + r], "SERVING")
            assert health(ports[2 + r], "engine.ps.ParameterServer") == "SERVING"
        with grpc.insecure_channel(f"127.0.0.1:{ports[2]}") as ch:     # the health port serves nothing else
            with pytest.raises(grpc.RpcError) as ei:
                ch.unary_unary("/engine.ps.ParameterServer/Stop")(pb.Empty(request_id="x").SerializeToString(),
                                                                   timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
        workers = [subprocess.Popen(engine(resolved, "--role", "worker", "--rank", w, *sets), cwd=REPO, env=env,
                                    stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"w{w}.log", "w"),
                                    start_new_session=True) for w in range(2)]
        procs += workers
        for w, p in enumerate(workers):
            assert p.wait(timeout=300) == 0, (tmp_path / f"w{w}.log").read_text()[-3000:]
        for r in range(2):     # the job ended: worker 0 stopped the servers, which exit 0
            assert procs[r].wait(timeout=60) == 0, (tmp_path / f"s{r}.log").read_text()[-3000:]
        assert "the job ended; stopping the servers" in (tmp_path / "w0.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def test_a_preempting_server_says_not_serving(tmp_path, loopback_reference):
    _, resolved = loopback_reference
    ports = free_ports(2)
    env = {**os.environ, "ENGINE_SERVERS": f"127.0.0.1:{ports[0]}"}
    p = subprocess.Popen(engine(resolved, "--role", "server", "--rank", 0, "--port", ports[0], "--health-port", ports[1],
                                "--set", "cluster.servers=1", "--set", "cluster.preempt_timeout_s=10"),
                         cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        wait_health(ports[1], "SERVING")
        p.send_signal(signal.SIGTERM)             # preempted: keeps serving its job, but is NOT_SERVING
        # NOT_SERVING lasts until preempt_timeout_s passes (10 s: a loaded machine's late polls still see it)
        wait_health(ports[1], "NOT_SERVING", timeout=9)
        assert health(ports[1], "liveness") == "SERVING"     # unready, but alive: no liveness restart
        assert p.wait(timeout=40) == 75           # preempt_timeout_s passed: resumable exit
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)



def test_a_stuck_server_says_not_serving_and_its_worker_exits_76(tmp_path, loopback_reference):
    """A server whose request handler hangs while the process lives (the failpoints ``server.pull``,
    ``server.push`` and ``server.step`` hold the first request of each kind 15 s, as a deadlock would
    hold it for ever), under a role worker. Once that request is in flight past ``client.timeout_s`` (2 s; ``engine.ps.watchdog``) the server
    answers NOT_SERVING on its health port, so a liveness probe would restart it, and says why in
    ``Health`` (``stuck``) and once in its log. The worker's call runs past its deadline: it exits 76 (not
    counted by a scheduler) with one line naming the server. Before, the server stayed SERVING, and the
    worker printed a traceback and exited 1. When the request returns, the server is SERVING again."""
    import json

    from engine.ps import PSClient

    _, resolved = loopback_reference
    ports = free_ports(2)
    env = {**os.environ, "ENGINE_SERVERS": f"127.0.0.1:{ports[0]}", "ENGINE_NUM_WORKERS": "1"}
    sets = ["--set", "cluster.servers=1", "--set", "cluster.workers=1", "--set", "client.timeout_s=2",
            "--set", "client.retries=0", "--set", f"checkpoint.root={tmp_path / 'ckpt'}"]
    log = tmp_path / "server.log"
    hang = ";".join(f"server.{m}=sleep:15@1" for m in ("pull", "push", "step"))
    p = subprocess.Popen(engine(resolved, "--role", "server", "--rank", 0, "--port", ports[0], "--health-port", ports[1],
                                *sets), cwd=REPO, env={**env, "ENGINE_FAILPOINTS": hang},
                         stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)
    worker = None
    try:
        wait_health(ports[1], "SERVING")
        worker = subprocess.Popen(engine(resolved, "--role", "worker", "--rank", 0, *sets), cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        wait_health(ports[1], "NOT_SERVING", timeout=60)
        assert health(ports[1], "liveness") == "NOT_SERVING"     # the liveness probe's service too
        with PSClient([f"127.0.0.1:{ports[0]}"], timeout_s=30, retries=0) as c:
            stuck = json.loads(c.transport.call(0, "Health", pb.Empty(request_id="probe"), 5).json)["stuck"]
            assert " request worker0@" in stuck and "beyond client.timeout_s = 2s" in stuck, stuck
            shown = status(f"127.0.0.1:{ports[0]}", "--once", "--timeout", "10")     # engine status, in red
            assert shown.returncode == 0 and "server 0 (127.0.0.1:" in shown.stdout and " stuck: " in shown.stdout, \
                shown.stdout[-2000:]
            _, err = worker.communicate(timeout=60)
            assert worker.returncode == 76, err[-3000:]
            assert "Traceback" not in err, err[-3000:]
            assert f"worker 0: no answer in time from 127.0.0.1:{ports[0]} (" in err, err[-3000:]
            wait_health(ports[1], "SERVING", timeout=30)        # the hung request returned
            assert health(ports[1], "liveness") == "SERVING"
            assert json.loads(c.transport.call(0, "Health", pb.Empty(request_id="probe"), 5).json)["stuck"] is None
    finally:
        for q in (p, worker):
            if q is not None and q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
                q.wait(10)
    text = log.read_text()
    assert text.count("server 0: stuck: ") == 1, text[-3000:]
    assert "health port NOT_SERVING: a liveness probe restarts this server" in text
    assert "no longer stuck (it moved after: " in text


@pytest.fixture
def one_server(tmp_path):
    """A started ``LocalCluster`` of one real server process (the job-end protocol's tests run the
    workers' side in threads); stopped after the test."""
    from engine.config import from_dict
    from engine.launch.local import LocalCluster
    cfg = from_dict({"cluster": {"servers": 1, "workers": 1, "startup_timeout_s": 60, "warm_up": False},
                     "tables": {"sparse": {"emb": {"dim": 1}}}})
    cluster = LocalCluster(cfg, tmp_path / "run")
    try:
        cluster.start_servers()
        yield cluster
    finally:
        cluster.stop_servers()
        cluster.shutdown()


def run_workers(worker, n: int, timeout_s: float) -> dict[int, str]:
    """``worker(rank)`` for ranks 0..n-1, each on its own thread -> per rank "ok", or the exception it
    raised as "Type: message" (what the worker would exit with)."""
    import threading
    out: dict[int, str] = {}

    def run(rank: int) -> None:
        try:
            worker(rank)
            out[rank] = "ok"
        except Exception as e:  # noqa: BLE001 - what the worker would exit with
            out[rank] = f"{type(e).__name__}: {e}"
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out


def test_a_worker_whose_last_arrival_reply_is_lost_as_the_servers_stop_exits_as_finished(one_server):
    """The job-end protocol (``roles._end_job``) of 3 workers against a real server process; worker 2
    reaches it through a real gRPC proxy that drops the replies to its "seen" arrival (applied, then
    lost) and to its first retry, so its next retry finds the server that rank 0 stopped meanwhile.
    Every worker ends without an error. Before, worker 2 raised ShardUnavailableError: it exited 76 (roll
    back) after the job had ended, and a scheduler restarted it against servers that were gone."""
    from engine.ps import PSClient
    from engine.roles import _end_job
    from tests.faults import DroppingProxy

    # worker 2 arrives last at the job-end barrier: its call 0 opens it, calls 1 and 2 are its "seen"
    # arrival and the first retry of it
    endpoint = one_server.endpoints[0]
    proxy = DroppingProxy(endpoint, lambda method, n: method == "Barrier" and n in (1, 2))

    def worker(rank: int) -> None:
        with PSClient([proxy.endpoint if rank == 2 else endpoint], name=f"worker{rank}", retries=2,
                      backoff_s=0.05) as c:
            if rank == 2:
                until(lambda: c.stats()[0]["barriers"].get("engine-job-end", {}).get("arrived") == 2,
                      "workers 0 and 1 at the job-end barrier", timeout_s=30, every_s=0.02)
            _end_job(c, rank, 3, 60.0)
    try:
        out = run_workers(worker, 3, 90)
        assert proxy.dropped.get("Barrier", 0) >= 1, proxy.dropped
    finally:
        proxy.close()
    assert out == {0: "ok", 1: "ok", 2: "ok"}, out


def test_rank_0_ends_a_finished_job_when_a_worker_never_says_it_saw_the_end(one_server):
    """The job-end protocol of 3 workers against a real server process; worker 2 meets the others at the
    job-end barrier, then dies before its "seen" arrival. Rank 0 waits for it until the barrier's timeout,
    then stops the servers all the same: every worker had finished. Before, rank 0 raised
    BarrierTimeoutError (exit 1: a finished job counted as a failure) and left the servers running."""
    from engine.ps import PSClient
    from engine.roles import _end_job

    def worker(rank: int) -> None:
        with PSClient(one_server.endpoints, name=f"worker{rank}", retries=1) as c:
            if rank == 2:            # meets the others, then is gone
                c.barrier("engine-job-end", 3, timeout=30)
            else:
                _end_job(c, rank, 3, 3.0)
    out = run_workers(worker, 3, 60)
    assert out == {0: "ok", 1: "ok", 2: "ok"}, out
    server = one_server.servers[0]
    until(lambda: server.proc.poll() is not None, "the server stopped by rank 0", timeout_s=20)
    assert server.proc.returncode == 0
