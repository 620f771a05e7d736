"""Test hosts on Linux network namespaces: each named host is its own network stack, and the hosts talk
over a Linux bridge that lives in a separate "switch" namespace, so nothing is added to the root
namespace (no address, no route, no bridge, no veth end) and no traffic can leave the namespaces.

    with TestHosts(["server0", "worker0"]) as hosts:
        srv = hosts.popen("server0", [sys.executable, "-m", "engine.ps.server", "--host", hosts.ip("server0")])
        hosts.run("worker0", [sys.executable, "-c", "..."], timeout=30)   # reaches "server0:PORT" by name

Names resolve inside every host namespace: ``/etc/netns/<ns>/hosts`` is written, and ``ip netns exec``
bind-mounts it over ``/etc/hosts`` for the child (glibc and gRPC's default c-ares resolver both read it).
Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2; ``netns_available()`` probes for real and
``require_netns()`` skips (or fails, with ENGINE_REQUIRE_NETNS=1) when they are missing.
"""
from __future__ import annotations

import atexit
import ipaddress
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import Self

ETC_NETNS = "/etc/netns"
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_IP_TIMEOUT = 20.0       # bound on any single `ip` call
_KILL_ROUNDS = 50        # bound on "list pids in the namespace, SIGKILL them" rounds per namespace
_probe_cache: tuple[bool, str] | None = None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``; raises RuntimeError with ip's stderr when ``check`` and it fails."""
    cp = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if check and cp.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({cp.returncode}): {cp.stderr.strip()}")
    return cp


def list_netns() -> set[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def netns_available() -> tuple[bool, str]:
    """(True, "") when network namespaces, a bridge and veth pairs can really be created here, else
    (False, reason). Creates and deletes a throwaway namespace once; the answer is cached."""
    global _probe_cache
    if _probe_cache is None:
        _probe_cache = _probe()
    return _probe_cache


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (platform is {sys.platform})"
    if shutil.which("ip") is None:
        return False, "iproute2 `ip` not found on PATH"
    ns = f"engprobe{os.getpid()}{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", ns)
        try:
            _ip("-n", ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", ns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
            _ip("-n", ns, "link", "set", "va", "master", "br0")
        finally:
            _ip("netns", "del", ns, check=False)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return False, f"cannot create network namespaces/bridge/veth here (need root and iproute2): {e}"
    return True, ""


def require_netns() -> None:
    """Skip the calling test when ``netns_available()`` is False, or fail it when the environment has
    ENGINE_REQUIRE_NETNS=1 (so CI cannot pass silently without namespace tests)."""
    ok, reason = netns_available()
    if ok:
        return
    import pytest
    if os.environ.get("ENGINE_REQUIRE_NETNS") == "1":
        pytest.fail(f"ENGINE_REQUIRE_NETNS=1 but network namespaces are unavailable: {reason}")
    pytest.skip(reason)


class TestHosts:
    """Context manager creating one network namespace per name, joined by a bridge in a switch namespace.

    ``TestHosts(names, subnet=None)``: ``names`` are distinct hostnames (letters, digits, '-'), at most
    253; ``subnet`` an IPv4 /24 (default: random 10.200-250.x.0/24); host ``names[i]`` gets address
    ``.i+1`` on ``eth0``. Raises ValueError for bad arguments. Entering raises RuntimeError when an
    ``ip`` command fails, after removing whatever it had created. Leaving kills every process in the
    namespaces and deletes them and their ``/etc/netns`` dirs, also when the body raised; an ``atexit``
    hook does the same as a last resort if the interpreter exits while the hosts still exist.
    """
    __test__ = False  # not a pytest test class despite the name

    def __init__(self, names: list[str], *, subnet: str | None = None):
        names = list(names)
        if not names:
            raise ValueError("TestHosts needs at least one host name")
        for n in names:
            if not isinstance(n, str) or not _NAME_RE.match(n) or n.lower() == "localhost":
                raise ValueError(f"bad host name {n!r}: use letters, digits and '-' (not 'localhost')")
        if len({n.lower() for n in names}) != len(names):
            raise ValueError(f"host names must be distinct: {names}")
        if subnet is None:
            subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/24"
        net = ipaddress.IPv4Network(subnet)
        if net.prefixlen != 24:
            raise ValueError(f"subnet must be a /24, got {subnet}")
        if len(names) > 253:
            raise ValueError(f"at most 253 hosts per subnet, got {len(names)}")
        self.names = names
        self.subnet = str(net)
        self.prefix = f"eng{os.getpid()}{secrets.token_hex(2)}-"
        self.switch_ns = self.prefix + "_switch"  # '_' cannot occur in a host name, so no clash
        self._ips = {n: str(net.network_address + i + 1) for i, n in enumerate(names)}
        self._procs: list[subprocess.Popen] = []
        self._touched_ns: list[str] = []    # namespaces we tried to create (cleanup deletes all of them)
        self._touched_etc: list[str] = []   # /etc/netns/<ns> dirs we tried to create
        self._active = False
        self.env_overrides: dict[str, str] = {}  # added to every child's environment (see module doc)

    # ---- names and addresses -------------------------------------------------------------------
    def ns(self, name: str) -> str:
        """Namespace name of host ``name``; KeyError for an unknown host."""
        if name not in self._ips:
            raise KeyError(f"unknown test host {name!r}; hosts are {self.names}")
        return self.prefix + name

    def ip(self, name: str) -> str:
        """IPv4 address of host ``name`` on its ``eth0``; KeyError for an unknown host."""
        self.ns(name)
        return self._ips[name]

    def all_ns(self) -> list[str]:
        """Every namespace name this instance owns: the hosts' and the switch's."""
        return [self.prefix + n for n in self.names] + [self.switch_ns]

    def etc_dir(self, name: str) -> str:
        """``/etc/netns/<ns>`` of host ``name`` (its ``hosts`` file overrides ``/etc/hosts`` there)."""
        return os.path.join(ETC_NETNS, self.ns(name))

    # ---- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        atexit.register(self.close)
        self._active = True
        try:
            self._setup()
        except BaseException:
            self.close(raise_on_leftovers=False)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_on_leftovers=exc_type is None)

    def _setup(self) -> None:
        sw = self.switch_ns
        self._touched_ns.append(sw)
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        _ip("-n", sw, "link", "set", "br0", "up")
        hosts_file = self._hosts_text(self._ips)
        for i, name in enumerate(self.names):
            ns, peer = self.ns(name), f"v{i}"
            self._touched_ns.append(ns)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # both ends are created directly inside their namespaces: nothing ever exists in the root ns
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", sw)
            _ip("-n", ns, "addr", "add", f"{self._ips[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", sw, "link", "set", peer, "master", "br0")
            _ip("-n", sw, "link", "set", peer, "up")
            self._touched_etc.append(self.etc_dir(name))
            self._write_hosts(self.etc_dir(name), hosts_file)

    def _hosts_text(self, ips: dict[str, str]) -> str:
        return "127.0.0.1 localhost\n" + "".join(f"{ips[n]} {n}\n" for n in self.names)

    @staticmethod
    def _write_hosts(d: str, text: str) -> None:
        for attempt in range(5):  # a concurrent instance may rmdir an empty /etc/netns in between
            try:
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, "hosts"), "w") as f:
                    f.write(text)
                return
            except FileNotFoundError:
                if attempt == 4:
                    raise

    def close(self, raise_on_leftovers: bool = True) -> None:
        """Kill every process in the namespaces, delete the namespaces (hosts first, then the switch)
        and their ``/etc/netns`` dirs. Idempotent. Raises RuntimeError if something could not be
        removed and ``raise_on_leftovers`` (otherwise it writes a warning to stderr)."""
        if not self._active:
            return
        self._active = False
        atexit.unregister(self.close)
        for p in self._procs:  # our own children first, as whole process groups
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        existing = list_netns()
        hosts_first = [n for n in self._touched_ns if n != self.switch_ns] + [self.switch_ns]
        for ns in hosts_first:
            if ns in existing:
                self._kill_all(ns)
                _ip("netns", "del", ns, check=False)
        for p in self._procs:  # reap, so no zombies or ResourceWarnings are left
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        for d in self._touched_etc:
            shutil.rmtree(d, ignore_errors=True)
        try:
            os.rmdir(ETC_NETNS)  # only succeeds when empty, i.e. no other instance is using it
        except OSError:
            pass
        left = self.leftovers()
        if left:
            msg = f"TestHosts {self.prefix}: could not remove {left}"
            if raise_on_leftovers:
                raise RuntimeError(msg)
            print("WARNING: " + msg, file=sys.stderr)

    def leftovers(self) -> list[str]:
        """Namespaces and ``/etc/netns`` dirs of this instance that still exist (empty after close)."""
        left = sorted(self._namespaces_present())
        return left + [d for d in self._touched_etc if os.path.exists(d)]

    def _namespaces_present(self) -> set[str]:
        return {n for n in list_netns() if n.startswith(self.prefix)}

    @staticmethod
    def _kill_all(ns: str) -> None:
        """SIGKILL every process in ``ns`` until ``ip netns pids`` is empty (bounded rounds)."""
        for _ in range(_KILL_ROUNDS):
            pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        print(f"WARNING: processes still alive in namespace {ns} after {_KILL_ROUNDS} kill rounds",
              file=sys.stderr)

    # ---- faults of the network ---------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """Silence host ``name``: its port leaves the switch's bridge, so every frame to or from it is
        dropped with no error and no RST on either side, as for a host that lost power or its cable,
        seen from the others; its own link stays up. ``heal`` undoes it. KeyError for an unknown host."""
        self._check_active()
        _ip("-n", self.switch_ns, "link", "set", "dev", self._port(name), "nomaster")

    def heal(self, name: str) -> None:
        """Put host ``name``'s port back on the bridge (after ``cut``)."""
        self._check_active()
        _ip("-n", self.switch_ns, "link", "set", "dev", self._port(name), "master", "br0")

    def alias(self, name: str, to: str) -> None:
        """Make the name of host ``name`` resolve to host ``to``'s address in every host, as a server
        replaced on another machine keeps its DNS name (a pod of an Indexed Job keeps its hostname). KeyError for unknown hosts."""
        self._check_active()
        text = self._hosts_text(dict(self._ips, **{name: self.ip(to)}))
        for n in self.names:
            self._write_hosts(self.etc_dir(n), text)

    def _port(self, name: str) -> str:
        self.ns(name)
        return f"v{self.names.index(name)}"

    # ---- running commands ----------------------------------------------------------------------
    def _check_active(self) -> None:
        if not self._active:
            raise RuntimeError("TestHosts is not entered (use `with TestHosts(...) as hosts:`)")

    def env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a child gets: a copy of ``os.environ``, then ``env_overrides``, then ``env``."""
        out = dict(os.environ)
        out.update(self.env_overrides)
        out.update(env or {})
        return out

    def popen(self, name: str, argv: list[str], *, env: dict[str, str] | None = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` in host ``name`` (``ip netns exec NS argv...``) in a new session, so
        ``os.killpg(p.pid, ...)`` reaches its whole group. ``env`` entries are added to (override) a copy
        of ``os.environ``. Other keyword arguments go to ``subprocess.Popen``. Raises KeyError for an
        unknown host, RuntimeError when not entered, OSError when ``ip`` cannot be started. The process
        is killed at close if still running."""
        self._check_active()
        popen_kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(name), *map(str, argv)], env=self.env(env),
                             **popen_kwargs)
        self._procs.append(p)
        return p

    def run(self, name: str, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
            input: str | None = None, check: bool = False) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``name`` to completion, capturing stdout/stderr as text. "Completion" is
        EOF on both pipes, so a daemon it leaves holding them keeps ``run`` waiting. On timeout the
        whole process group is SIGKILLed and ``subprocess.TimeoutExpired`` raised (within ~2 s more,
        output dropped if an escaped descendant still holds the pipes); with ``check`` a non-zero exit
        raises ``subprocess.CalledProcessError``. Other errors as ``popen``."""
        p = self.popen(name, argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:  # bounded: a descendant that left the group may still hold the pipes open
                out, err = p.communicate(timeout=2)
            except subprocess.TimeoutExpired:
                out = err = None
                for stream in (p.stdin, p.stdout, p.stderr):
                    if stream is not None:
                        stream.close()
                p.wait()
            raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
        cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp

    def python(self, name: str, code: str, *args: str, timeout: float, env: dict[str, str] | None = None,
               check: bool = False) -> subprocess.CompletedProcess:
        """``run(name, [sys.executable, "-c", code, *args], ...)``: Python code in host ``name``."""
        return self.run(name, [sys.executable, "-c", code, *args], timeout=timeout, env=env, check=check)


def reap_stale(prefix: str = "eng") -> list[str]:
    """Delete namespaces (and ``/etc/netns`` dirs) left by TestHosts instances whose process is dead,
    e.g. after a SIGKILLed test run. Only names ``eng<pid><4 hex>-...`` with a dead ``<pid>`` are
    touched; do not use when other PID namespaces share this network-namespace registry. Returns the
    removed namespace names."""
    removed = []
    pat = re.compile(re.escape(prefix) + r"(\d+)[0-9a-f]{4}-")
    names = set(list_netns()) | (set(os.listdir(ETC_NETNS)) if os.path.isdir(ETC_NETNS) else set())
    for ns in sorted(names):
        m = pat.match(ns)
        if not m or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        TestHosts._kill_all(ns)
        if _ip("netns", "del", ns, check=False).returncode == 0:
            removed.append(ns)
        shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    return removed
