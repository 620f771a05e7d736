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

import subprocess
import sys
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
