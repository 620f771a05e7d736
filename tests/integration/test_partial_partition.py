"""Partial network failures between test hosts (network namespaces, ``tests/netns.py``): a worker that
gives a server up says where the failure lies, seen from its host (``engine.ps.reach``).

Only workers (and a launcher's ``Health`` watch) talk to servers; servers never talk to each other. So
the partial failures that matter are between one worker's host and one server's:

- an asymmetric partition (this worker cannot reach server 1, while the other roles reach every
  server): the line names server 1 and says the others answer, and that server 1 may still serve
  them; before, it named server 1 only, as if it were gone;
- this worker's own link down (or flapping): every server fails with "Network is unreachable", and
  the line says this host's link is down; before, it blamed the first server that failed (server 0,
  alive and serving every other role).

A pair of hosts is cut by giving each the other's address at a MAC address nobody has (a permanent
neighbour entry): their frames are dropped in the network, with no error on either host, as a failed
path between two switches drops them. No iptables or tc is needed.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.config import dump_config, from_dict
from tests.netns import TestHosts, require_netns
from tests.waiting import until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PORT = 7000
NOBODY = "02:00:5e:00:53:01"        # a MAC address of the documentation range: no host has it
CONFIG = {"cluster": {"servers": 2, "workers": 1, "warm_up": False},
          "client": {"dead_after_s": 6.0, "timeout_s": 20.0, "retries": 1},
          "security": {"insecure": True},
          "tables": {"sparse": {"emb": {"dim": 4, "optimizer": "sgd", "learning_rate": 1.0}}}}
ENDPOINTS = f"server0:{PORT},server1:{PORT}"


def cut_pair(hosts: TestHosts, a: str, b: str) -> None:
    """Drop every frame between hosts ``a`` and ``b`` in the network (both directions); the other
    pairs are untouched."""
    for x, y in ((a, b), (b, a)):
        subprocess.run(["ip", "-n", hosts.ns(x), "neigh", "replace", hosts.ip(y), "lladdr", NOBODY, "dev", "eth0",
                        "nud", "permanent"], check=True, timeout=20)


def heal_pair(hosts: TestHosts, a: str, b: str) -> None:
    for x, y in ((a, b), (b, a)):
        subprocess.run(["ip", "-n", hosts.ns(x), "neigh", "del", hosts.ip(y), "dev", "eth0"], check=True, timeout=20)


def link(hosts: TestHosts, host: str, state: str) -> None:
    subprocess.run(["ip", "-n", hosts.ns(host), "link", "set", "eth0", state], check=True, timeout=20)


def start_servers(hosts: TestHosts, cfg: Path, tmp: Path) -> None:
    procs = []
    for r in range(2):
        host, ready = f"server{r}", tmp / f"server{r}.ready"
        procs.append((hosts.popen(host, [sys.executable, "-m", "engine", "train", cfg, "--role", "server", "--rank", r,
                                         "--host", hosts.ip(host), "--port", PORT, "--ready-file", ready],
                                  env={"ENGINE_SERVERS": ENDPOINTS}, stdout=open(tmp / f"{host}.log", "a"),
                                  stderr=subprocess.STDOUT, cwd=REPO), ready, tmp / f"{host}.log"))
    for p, ready, log in procs:
        until(lambda: ready.exists() or p.poll() is not None, f"{ready.name}", timeout_s=120, every_s=0.1)
        assert p.poll() is None, log.read_text()[-3000:]


# the worker's own diagnosis, as run_worker makes it when it gives server LOST up (engine.roles._reach):
# one process on the worker's host answers a line per endpoint read from stdin (one interpreter start)
REACH = """
import sys
import time
from engine.config import load_config
from engine.connect import connect
from engine.roles import _reach
cfg = load_config(sys.argv[1])
with connect(cfg, sys.argv[2].split(","), name="worker0", admin=False) as c:
    print("ready", flush=True)
    for lost in sys.stdin:
        print(_reach(c, cfg, lost.strip()), flush=True)
"""


def test_a_worker_that_loses_a_server_says_whether_the_path_or_its_own_link_failed(tmp_path):
    require_netns()
    cfg = tmp_path / "cluster.yaml"
    dump_config(from_dict(CONFIG), cfg)
    with TestHosts(["server0", "server1", "worker0"]) as hosts:
        worker = hosts.popen("worker0", [sys.executable, "-c", REACH, cfg, ENDPOINTS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
        start_servers(hosts, cfg, tmp_path)
        assert worker.stdout.readline().strip() == "ready"

        def reach(lost: str) -> str:
            worker.stdin.write(lost + "\n")
            worker.stdin.flush()
            return worker.stdout.readline().strip()     # bounded: the probe waits at most 3 s a server

        # nothing failed: the server lost a moment ago answers again
        assert reach(f"server1:{PORT}") == f"server server1:{PORT} answers again now: the network failure was " \
                                           "transient"

        # the asymmetric partition: only worker0 <-> server1 fails; server1 is alive (server0's host still
        # reaches it)
        cut_pair(hosts, "worker0", "server1")
        line = reach(f"server1:{PORT}")
        assert line.startswith(f"server server1:{PORT} is unreachable from this host while server0:{PORT} "
                               "answers: a network failure between this host and it"), line
        assert "may still serve the other roles" in line, line
        hosts.python("server0", "import socket; socket.create_connection(('server1', 7000), 5).close()",
                     timeout=30, check=True)
        heal_pair(hosts, "worker0", "server1")

        # the worker's own link is down: every server fails, and server0 (the first, alive) is not blamed
        link(hosts, "worker0", "down")
        try:
            line = reach(f"server0:{PORT}")
        finally:
            link(hosts, "worker0", "up")
        assert line.startswith("no server answers from this host now, and this host has no route to them"), line
        assert line.endswith(f"this host's own link or route is down, not server server0:{PORT} alone"), line
        assert f"server0:{PORT}: " in line and f"server1:{PORT}: " in line, line
        worker.stdin.close()
        assert worker.wait(timeout=30) == 0


@pytest.mark.long   # make test-long (~90 s): the line's diagnosis is the test above's (make test), and the fence and
#                     roll-back of a worker replaced alone, counting every example once, are test_role_resume's
def test_a_worker_cut_from_one_server_rolls_the_job_back_once_and_every_example_counts_once(tmp_path):
    """An asymmetric partition in a role-mode job (2 servers, 2 workers, async, each worker under a
    scheduler that restarts it): worker 1 cannot reach server 1 while every other pair works. Worker 1
    exits 76 after about ``dead_after_s`` and the retries, saying server 1 is unreachable from its host
    while server 0 answers; restarted, it waits for server 1; once the path heals it fences the servers,
    worker 0 exits 76 and, restarted, rolls the job back once. Every example is counted once."""
    require_netns()
    from engine.programs.ctr import BLAS_ENV
    from engine.roles import EXIT_ROLLBACK
    from tests.integration.test_chaos_offline import args, run
    from tests.integration.test_role_resume import assert_every_example_once, role_cmd
    from tests.pods import Pod

    run(args(tmp_path, "full", "mode=async", "cluster.workers=2", "model.blas_threads=1"))
    here = ("--set", "security.insecure=true", "--set", "client.dead_after_s=6")
    result = tmp_path / "role-result.json"
    with TestHosts(["server0", "server1", "worker0", "worker1"]) as hosts:
        hosts.env_overrides.update({**{var: "1" for var in BLAS_ENV}, "ENGINE_SERVERS": ENDPOINTS,
                                    "ENGINE_NUM_WORKERS": "2",
                                    # 0.1 s a step: the cut lands with most of the training still ahead
                                    "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.1"})
        for r in range(2):
            ready = tmp_path / f"server{r}.ready"
            p = hosts.popen(f"server{r}", role_cmd(tmp_path, "role", "server", r, *here, "--host",
                                                   hosts.ip(f"server{r}"), "--port", str(PORT), "--ready-file",
                                                   str(ready)),
                            stdout=open(tmp_path / f"server{r}.log", "w"), stderr=subprocess.STDOUT, cwd=REPO)
            until(lambda: ready.exists() or p.poll() is not None, f"server {r} ready", timeout_s=120, every_s=0.1)
            assert p.poll() is None, (tmp_path / f"server{r}.log").read_text()[-3000:]
        workers = [Pod(["ip", "netns", "exec", hosts.ns(f"worker{r}"),
                        *role_cmd(tmp_path, "role", "worker", r, *here,
                                  *(("--result-file", str(result)) if r == 0 else ()))],
                       lambda n: hosts.env(), tmp_path / f"worker-{r}.log") for r in range(2)]
        try:
            from engine.checkpoint import CheckpointManager
            mgr = CheckpointManager(str(tmp_path / "ckpt-role"), "ctr_dnn")
            until(lambda: len(mgr.list()) >= 1 or any(w.codes for w in workers), "a checkpoint", timeout_s=180,
                  every_s=0.05)
            assert not any(w.codes for w in workers), [w.codes for w in workers]
            cut_pair(hosts, "worker1", "server1")
            until(lambda: workers[1].codes or workers[0].codes, "worker 1 gives server 1 up", timeout_s=90,
                  every_s=0.1)
            assert workers[1].codes == [EXIT_ROLLBACK] and not workers[0].codes, [w.codes for w in workers]
            time.sleep(5)                           # its restart waits for server 1 meanwhile
            assert len(workers[1].codes) == 1, workers[1].codes
            heal_pair(hosts, "worker1", "server1")
            for w in workers:
                w.thread.join(240)
            assert workers[1].codes == [EXIT_ROLLBACK, 0], workers[1].codes
            assert workers[0].codes == [EXIT_ROLLBACK, 0], workers[0].codes
            probe = hosts.python("worker0", "import json; from engine.ps import PSClient\n"
                                 f"with PSClient({ENDPOINTS.split(',')!r}, name='probe') as c:\n"
                                 " print(json.dumps([h['rollbacks'] for h in c.health()]))", timeout=60, check=True)
            assert json.loads(probe.stdout) == [1, 1], probe.stdout     # one roll-back of the job
        finally:
            for w in workers:
                w.stop()
    log1, log0 = (tmp_path / "worker-1.log").read_text(), (tmp_path / "worker-0.log").read_text()
    assert (f"server server1:{PORT} is unreachable from this host while server0:{PORT} answers" in log1
            and "exiting with code 76" in log1), log1[-3000:]
    assert "fenced 2 of 2 server(s)" in log1, log1[-3000:]
    assert "rolling every server back to" in log0 and "Traceback" not in log0 + log1, log0[-3000:]
    assert_every_example_once(result)


@contextlib.contextmanager
def _one_server_and_client(tmp_path):
    """Hosts server0 and worker0 (netns), test_partition's one-server cluster on server0 and its calling
    client on worker0, past its first calls: yields (hosts, client); the hosts are removed after."""
    require_netns()
    from tests.integration.test_partition import CONFIG as ONE_SERVER
    from tests.integration.test_partition import Client, start_server
    cfg = tmp_path / "cluster.yaml"
    dump_config(from_dict(ONE_SERVER), cfg)
    with TestHosts(["server0", "worker0"]) as hosts:
        start_server(hosts, "server0", cfg, tmp_path)
        client = Client(hosts, "worker0", cfg, tmp_path, "client")
        client.wait_ok(6, 0.0, "first calls")
        yield hosts, client


@pytest.mark.long   # make test-long (~40 s): test_ps_exactly_once's proxy drops replies after the server applied the
#                     requests (make test), and test_partition counts the pushes around a full cut
def test_replies_lost_one_way_past_dead_after_s_leave_every_push_applied_once(tmp_path):
    """One-directional loss: the server's frames to the worker's host are dropped while the worker's
    requests still arrive. A push caught by it is applied, its reply lost; the connection is given up
    after about ``dead_after_s`` and the push resent on a new one, which connects once the path heals,
    and the reply window answers it without applying it again. The rows count every push exactly
    once, and no call fails (the loss is shorter than the retries)."""
    from tests.integration.test_partition import SILENT_S, first_call_across
    with _one_server_and_client(tmp_path) as (hosts, client):
        caught = None
        for _ in range(3):          # until the loss catches a push in flight (most often the first time)
            client.wait_ok(2, time.time(), "calls before the loss")
            subprocess.run(["ip", "-n", hosts.ns("server0"), "neigh", "replace", hosts.ip("worker0"), "lladdr",
                            NOBODY, "dev", "eth0", "nud", "permanent"], check=True, timeout=20)
            in_force = time.time()
            time.sleep(SILENT_S + 4)                # past the keepalive's give-up
            subprocess.run(["ip", "-n", hosts.ns("server0"), "neigh", "del", hosts.ip("worker0"), "dev", "eth0"],
                           check=True, timeout=20)
            client.wait_ok(4, time.time(), "calls after the heal", timeout_s=120)
            caught = first_call_across(client.records(), in_force)
            if caught["op"] == "push":
                break
        records = client.finish()
        stats = hosts.python("worker0", "from engine.ps import PSClient\n"
                             f"with PSClient(['server0:{PORT}'], name='probe') as c:\n"
                             " print(c.stats()[0]['reply_window']['hits'])", timeout=60, check=True)
    calls = [r for r in records if r["op"] != "final"]
    assert all(r["ok"] for r in calls), [r for r in calls if not r["ok"]]
    assert caught["op"] == "push" and caught["t1"] - caught["t0"] > SILENT_S, caught   # resent on a new connection
    final = records[-1]
    assert "rows" in final and len(set(final["rows"])) == 1, final
    assert -final["rows"][0] == sum(r["op"] == "push" for r in calls), (final["rows"][0], len(calls))
    assert int(stats.stdout) >= 1, stats.stdout        # the resent push was answered from the reply window


@pytest.mark.long   # make test-long (~50 s): test_partition's short cut (make test) is one such outage ridden out
def test_a_worker_link_flapping_faster_than_dead_after_s_fails_no_call_and_applies_every_push_once(tmp_path):
    """The worker host's link goes down and up 10 times (2 s down, 2 s up; ``dead_after_s`` 6 s): its
    connections outlive each outage (TCP retransmits), so no call fails, and the rows count every push
    exactly once."""
    from tests.integration.test_partition import SILENT_S
    with _one_server_and_client(tmp_path) as (hosts, client):
        flaps = time.time()
        for _ in range(10):
            link(hosts, "worker0", "down")
            time.sleep(2.0)
            link(hosts, "worker0", "up")
            time.sleep(2.0)
        client.wait_ok(4, time.time(), "calls after the flaps")
        records = client.finish()
    calls = [r for r in records if r["op"] != "final"]
    assert all(r["ok"] for r in calls), [r for r in calls if not r["ok"]]
    assert sum(r["t0"] > flaps for r in calls) >= 20, len(calls)     # calls kept going through the flaps
    assert max(r["t1"] - r["t0"] for r in calls) < SILENT_S, max(r["t1"] - r["t0"] for r in calls)
    final = records[-1]
    assert "rows" in final and len(set(final["rows"])) == 1, final
    assert -final["rows"][0] == sum(r["op"] == "push" for r in calls), (final["rows"][0], len(calls))


# the launcher's watch of one server (engine.launch.local.ServerWatch), dead_after_s 2 s: the line the launcher
# fails the attempt with once the server is silent, or a timeout
WATCH = """
import time
from engine.launch.local import ServerWatch
w = ServerWatch(["server0:%d"], 2.0, every_s=0.2)
print("watching", flush=True)
input()                                         # the test cut the path
for _ in range(300):
    time.sleep(0.1)
    if w.silent():
        rank, silent = w.silent()[0]
        print(w.silent_reason(rank, silent), flush=True)
        break
else:
    print("never silent", flush=True)
w.close()
""" % PORT


def test_a_server_the_launcher_alone_cannot_reach_is_not_called_hung(tmp_path):
    """The launcher's host loses its path to a server that every worker still reaches (under Ray the
    driver polls every server's Health from its own node). The launcher gives the server up after
    ``dead_after_s`` (it cannot supervise it), and its line says the server is hung, its host down, or
    the path from the launcher's host failed, with the last poll's error; before, it said "hung" of a
    live server."""
    require_netns()
    cfg = tmp_path / "cluster.yaml"
    dump_config(from_dict({**CONFIG, "cluster": {**CONFIG["cluster"], "servers": 1}}), cfg)
    with TestHosts(["server0", "launcher", "worker0"]) as hosts:
        watch = hosts.popen("launcher", [sys.executable, "-c", WATCH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
        ready = tmp_path / "server0.ready"
        server = hosts.popen("server0", [sys.executable, "-m", "engine", "train", cfg, "--role", "server", "--rank",
                                         0, "--host", hosts.ip("server0"), "--port", PORT, "--ready-file", ready],
                             stdout=open(tmp_path / "server0.log", "a"), stderr=subprocess.STDOUT, cwd=REPO)
        until(lambda: ready.exists() or server.poll() is not None, "server ready", timeout_s=120, every_s=0.1)
        assert watch.stdout.readline().strip() == "watching"
        time.sleep(1.0)                             # a poll answered
        cut_pair(hosts, "launcher", "server0")
        watch.stdin.write("\n")
        watch.stdin.flush()
        line = watch.stdout.readline().strip()      # bounded: the watch gives up after 30 s
        hosts.python("worker0", f"import socket; socket.create_connection(('server0', {PORT}), 5).close()",
                     timeout=30, check=True)        # the server is alive, and reached from elsewhere
        assert watch.wait(timeout=30) == 0
    assert line.startswith("answered no Health call from the launcher's host for "), line
    assert "last error: DEADLINE_EXCEEDED" in line or "last error: UNAVAILABLE" in line, line
    assert line.endswith("hung, its host down, or the network between the launcher's host and it failed"), line
