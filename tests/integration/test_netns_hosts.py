"""tests/netns.py: hosts in separate network namespaces reach each other by name and by IP over the
switch namespace's bridge, but not the root namespace nor each other's loopback; gRPC resolves the
test host names; and nothing is left behind, also when the body or the setup fails."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests import netns
from tests.netns import TestHosts, list_netns, require_netns

ECHO_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(8)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(1024)); c.close()
"""

ECHO_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
c.sendall(b"ping-" + sys.argv[1].encode()); print(c.recv(1024).decode())
"""

GRPC_SERVER = r"""
import sys, grpc
from concurrent.futures import ThreadPoolExecutor
s = grpc.server(ThreadPoolExecutor(2))
s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
    't.T', {'Echo': grpc.unary_unary_rpc_method_handler(lambda r, c: r)}),))
port = s.add_insecure_port(sys.argv[1] + ':0'); s.start(); print(port, flush=True)
s.wait_for_termination()
"""

GRPC_CLIENT = r"""
import sys, grpc
with grpc.insecure_channel(sys.argv[1]) as ch:
    print(ch.unary_unary('/t.T/Echo')(b'hello-grpc', timeout=5).decode())
"""


def _read_port(p: subprocess.Popen, timeout: float = 10.0) -> int:
    """First stdout line of ``p`` as a port number, or fail with its stderr."""
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if not line.strip().isdigit():
        p.kill()
        pytest.fail(f"server did not print its port: {line!r} {p.stderr.read() if p.stderr else ''}")
    return int(line)


def _start(hosts: TestHosts, name: str, code: str, *args: str) -> tuple[subprocess.Popen, int]:
    p = hosts.popen(name, [sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    return p, _read_port(p)


def _echo_from_root(ip: str, port: int) -> bytes | None:
    """Echo reply from ``ip:port`` reached from this (root) namespace, None when none came in 1 s."""
    try:
        with socket.create_connection((ip, port), timeout=1.0) as s:
            s.sendall(b"ping-root")
            data = s.recv(1024)
    except OSError:
        return None
    return data if data == b"ping-root" else None


def _assert_gone(h: TestHosts) -> None:
    names = set(list_netns())
    assert not [n for n in names if n.startswith(h.prefix)], names
    for ns in h.all_ns():
        assert not os.path.exists(os.path.join(netns.ETC_NETNS, ns)), ns
    assert h.leftovers() == []


def test_tcp_by_name_and_ip_and_isolation(test_hosts):
    h = test_hosts(["a", "b", "c"])
    assert [h.ip(n) for n in "abc"] == [h.subnet.rsplit(".", 1)[0] + f".{i}" for i in (1, 2, 3)]
    _, port = _start(h, "a", ECHO_SERVER, h.ip("a"))

    for target in ("a", h.ip("a")):
        r = h.python("b", ECHO_CLIENT, target, str(port), "3", timeout=10)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"ping-{target}"

    # nothing in the root namespace: no address on the subnet, no route to it but the default one
    addrs = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout)
    assert not any(a["local"] == h.ip(n) for i in addrs for a in i.get("addr_info", []) for n in h.names)
    routes = json.loads(subprocess.run(["ip", "-j", "route", "show", "to", "match", h.ip("a")],
                                       capture_output=True, text=True, check=True).stdout)
    assert all(r["dst"] == "default" for r in routes), routes
    root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert "link-netns " + h.prefix not in root_links and "master br0" not in root_links
    # ... so the root namespace cannot reach the listener. (Its default route may lead to a proxy that
    # accepts any connection, so "reached" means: our echo server answered.)
    t0 = time.monotonic()
    assert _echo_from_root(h.ip("a"), port) is None
    assert time.monotonic() - t0 < 3

    # each host has its own loopback: b's 127.0.0.1 listener is reachable from b only
    _, lport = _start(h, "b", ECHO_SERVER, "127.0.0.1")
    assert h.python("b", ECHO_CLIENT, "127.0.0.1", str(lport), "3", timeout=10).returncode == 0
    r = h.python("c", ECHO_CLIENT, "127.0.0.1", str(lport), "1", timeout=10)
    assert r.returncode != 0 and ("ConnectionRefused" in r.stderr or "timed out" in r.stderr), r.stderr


@pytest.mark.parametrize("resolver", [None, "ares", "native"])
def test_grpc_resolves_host_names(test_hosts, monkeypatch, resolver):
    """gRPC's default resolver (c-ares in grpcio 1.85) reads the bind-mounted /etc/hosts; so does
    the native (getaddrinfo) one."""
    monkeypatch.delenv("GRPC_DNS_RESOLVER", raising=False)
    h = test_hosts(["a", "b"])
    assert h.env_overrides == {}  # no resolver override is needed
    _, port = _start(h, "a", GRPC_SERVER, h.ip("a"))
    env = {} if resolver is None else {"GRPC_DNS_RESOLVER": resolver}
    r = h.python("b", GRPC_CLIENT, f"a:{port}", timeout=15, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hello-grpc"
    # a name that is not in the hosts file does not resolve (so "a" really came from it)
    r = h.python("b", GRPC_CLIENT, f"not-a-test-host:{port}", timeout=15, env=env)
    assert r.returncode != 0 and "UNAVAILABLE" in r.stderr, r.stderr


def test_cleanup_when_body_raises_kills_escaped_processes():
    require_netns()
    h = TestHosts(["a", "b", "c"])
    daemon = ("import os, sys, time\n"
              "if os.fork() == 0:\n"
              "    os.setsid()\n"
              "    if os.fork() == 0:\n"
              "        print(os.getpid(), flush=True)\n"
              "        fd = os.open(os.devnull, os.O_RDWR); os.dup2(fd, 1); os.dup2(fd, 2)\n"
              "        time.sleep(600)\n"
              "    os._exit(0)\n"
              "os.wait()\n")
    with pytest.raises(ZeroDivisionError), h:
        r = h.python("c", daemon, timeout=10)  # its grandchild escapes our process group
        pid = int(r.stdout.split()[0])
        os.kill(pid, 0)  # alive
        assert set(h.all_ns()) <= set(list_netns())
        assert all(os.path.exists(h.etc_dir(n) + "/hosts") for n in h.names)
        raise ZeroDivisionError("body fails")
    _assert_gone(h)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                break  # killed, waiting for init to reap it
        time.sleep(0.02)
    else:
        assert not os.path.exists(f"/proc/{pid}")
    h.close()  # idempotent


def test_cleanup_when_setup_fails_halfway(monkeypatch):
    require_netns()
    real_ip, calls = netns._ip, []

    def failing_ip(*args, check=True):
        calls.append(args)
        if args[:3] == ("-n", h.ns("c"), "link") and args[3] == "add":
            raise RuntimeError("injected failure")
        return real_ip(*args, check=check)

    h = TestHosts(["a", "b", "c"])
    monkeypatch.setattr(netns, "_ip", failing_ip)
    with pytest.raises(RuntimeError, match="injected"), h:
        pass  # pragma: no cover
    monkeypatch.undo()
    assert ("netns", "add", h.ns("c")) in calls
    _assert_gone(h)


def test_popen_run_errors_and_timeout(test_hosts):
    h = test_hosts(["solo"], subnet="10.213.0.0/24")
    assert h.ip("solo") == "10.213.0.1"
    with pytest.raises(KeyError):
        h.ip("nope")
    with pytest.raises(subprocess.TimeoutExpired):
        h.run("solo", ["sleep", "30"], timeout=0.5)
    t0 = time.monotonic()  # bounded even when a descendant outside the group holds the pipes
    with pytest.raises(subprocess.TimeoutExpired):
        h.run("solo", ["sh", "-c", "setsid sleep 30 & sleep 30"], timeout=0.5)
    assert time.monotonic() - t0 < 5
    p = h.popen("solo", ["sleep", "30"])
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert h.run("solo", ["cat", "/etc/hosts"], timeout=5).stdout == "127.0.0.1 localhost\n10.213.0.1 solo\n"
    for bad in ([], ["a", "a"], ["bad_name"], ["localhost"]):
        with pytest.raises(ValueError):
            TestHosts(bad)
    with pytest.raises(ValueError):
        TestHosts(["a"], subnet="10.0.0.0/16")
    with pytest.raises(RuntimeError, match="not entered"):
        TestHosts(["a"]).popen("a", ["true"])


def test_require_netns_fails_under_ENGINE_REQUIRE_NETNS(monkeypatch):
    monkeypatch.setattr(netns, "_probe_cache", (False, "no namespaces here"))
    monkeypatch.delenv("ENGINE_REQUIRE_NETNS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no namespaces here"):
        require_netns()
    monkeypatch.setenv("ENGINE_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match="no namespaces here"):
        require_netns()
