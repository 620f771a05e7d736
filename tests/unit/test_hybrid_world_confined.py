"""Hybrid mode refuses MPI traffic off this host unless ``security.insecure: true``, judged by the addresses
really used (``engine.allreduce.check_world_confined``), in real 2-rank ``mpiexec`` worlds.

The config's rule sees ``cluster.host`` and ``cluster.endpoints`` only. A multi-host job as the README
runs it (servers named in ``ENGINE_SERVERS``, the workers one ``mpiexec -hosts a,b`` world) passed it with
``cluster.endpoints`` empty and ``cluster.host`` 127.0.0.1: its workers all-reduced the dense tower over
the hosts' network, unauthenticated and unencrypted, with ``security.insecure: false`` (run across
network-namespace hosts, 2026-11-30: ``tests/integration/test_hybrid_hosts.py``).

A world "on two hosts" is made here without network namespaces: hydra's ssh launcher with a launcher
program that runs the proxy locally, for hosts 127.0.0.2 and 127.0.0.3. hydra's host map then puts each
rank on a host of its own, as on two machines (MPI's shared-memory split sees 1 rank per host).
"""
from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.launch.mpi import LOOPBACK_ONLY, mpiexec_path
from tests.mpi_worlds import run_mpiexec, topology_files
from tests.waiting import until

REPO = Path(__file__).resolve().parents[2]
#: hydra's "ssh": ``ssh [opts] HOST CMD...`` -> CMD here (the proxy starts on this machine)
LOCAL_SSH = '#!/bin/sh\nwhile [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done\nshift\nexec sh -c "$*"\n'
LOOPBACK, REMOTE = "127.0.0.1:7000", "10.9.8.7:7000"
SPANS = "ConfigError: mode hybrid: the workers' MPI world spans 2 hosts (ranks [0] on "
OFF = (f"ConfigError: mode hybrid off loopback (server endpoint '{REMOTE}', from ENGINE_SERVERS or "
       f"cluster.endpoints) needs security.insecure: true")


def world(tmp: Path, cases: list[str], *, hosts: bool) -> list[list[str]]:
    """A 2-rank world (on two "hosts" or one) building the hybrid mode for each ``SETS@ENDPOINT`` case ->
    per rank, per case: ``ok`` or the error."""
    where = ["-launcher", "fork"]
    if hosts:
        ssh = tmp / "local_ssh.sh"
        ssh.write_text(LOCAL_SSH)
        ssh.chmod(0o755)
        where = ["-launcher", "ssh", "-launcher-exec", str(ssh), "-hosts", "127.0.0.2,127.0.0.3", "-ppn", "1"]
    out = tmp / f"got-{hosts}"
    proc = run_mpiexec([mpiexec_path(), *where, "-n", "2", sys.executable, str(REPO / "tests" / "hybrid_ranks.py"),
                        "confined", str(out), ";".join(cases)], cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [Path(f"{out}.{r}").read_text().split("\n") for r in range(2)]


def test_a_world_on_two_hosts_needs_security_insecure(tmp_path):
    for default, insecure, remote in world(tmp_path, [f"@{LOOPBACK}", f"security.insecure=true@{LOOPBACK}",
                                                      f"@{REMOTE}"], hosts=True):
        assert default.startswith(SPANS) and "ranks [1] on " in default, default
        assert "security.insecure: true" in default
        assert insecure == "ok"
        assert remote.startswith(OFF), remote


def test_servers_that_only_engine_servers_names_off_loopback_need_security_insecure(tmp_path):
    """The client's endpoints (ENGINE_SERVERS in role mode, which the config never sees) are checked; a
    world on one host with servers on loopback needs nothing."""
    for default, remote, insecure in world(tmp_path, [f"@{LOOPBACK}", f"@{REMOTE}", f"security.insecure=true@{REMOTE}"],
                                           hosts=False):
        assert default == "ok" and insecure == "ok"
        assert remote.startswith(OFF), remote


def test_a_world_on_one_host_under_the_users_own_mpiexec_listens_on_loopback_only(tmp_path):
    """Role mode on one host (``mpiexec -n 2 ... engine train --role worker``), not the local launcher,
    which sets ``UCX_NET_DEVICES=lo`` itself: each rank's UCX listened on the machine's network address
    too (192.0.2.2 here, 2026-11-30). Now the rank confines itself (``confine_one_host_world``); hydra's
    own control port (0.0.0.0, inherited by the ranks) binds every interface by design (README)."""
    env = {k: v for k, v in os.environ.items() if k not in LOOPBACK_ONLY}
    out = tmp_path / "listen"
    proc = run_mpiexec([mpiexec_path(), "-n", "2", sys.executable, str(REPO / "tests" / "hybrid_ranks.py"),
                        "listeners", str(out)], cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    held = [a for r in range(2) for a in Path(f"{out}.{r}").read_text().split("\n") if a]
    assert any(a.startswith("127.") for a in held), held      # the ranks' own listeners were seen
    off = [a for a in held if not (ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback or a.startswith("0.0.0.0:"))]
    assert not off, f"MPI ranks listen off loopback: {off}"


def test_a_rank_whose_abort_cannot_reach_mpiexec_ends_itself(tmp_path):
    """A failing worker aborts its world (``end_world``); ``MPI_Abort`` then waits for hydra to end the
    process. Across a partition between the hosts hydra's proxy cannot reach ``mpiexec``, and the rank
    stayed alive for as long as the partition lasted (seen across netns hosts, 2026-11-30). Here mpiexec
    is stopped (SIGSTOP) instead, the same for the rank: it must end within ``ABORT_GRACE_S``."""
    from engine.allreduce import ABORT_GRACE_S
    out = tmp_path / "abort"
    proc = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, str(REPO / "tests" / "hybrid_ranks.py"),
                             "abort", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    pid_file = Path(f"{out}.pid")
    held = []
    try:
        until(lambda: (pid_file.exists() and pid_file.read_text()) or proc.poll() is not None, "rank 1 started",
              timeout_s=60, every_s=0.02)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        pid = int(pid_file.read_text())
        held = topology_files(proc.pid)                    # hydra leaves it behind when killed: removed below
        os.kill(proc.pid, signal.SIGSTOP)                  # mpiexec hears nothing from now on
        Path(f"{out}.go").touch()
        t0 = time.monotonic()
        until(lambda: not alive(pid), "the aborting rank ends", timeout_s=ABORT_GRACE_S + 15, every_s=0.05)
        assert time.monotonic() - t0 >= ABORT_GRACE_S - 1      # it waited for mpiexec first
    finally:
        os.killpg(proc.pid, signal.SIGKILL)                # mpiexec, its proxy and the ranks
        proc.communicate(timeout=10)
        for f in held:
            f.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
