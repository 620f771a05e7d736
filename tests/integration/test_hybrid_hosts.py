"""Hybrid mode across test hosts (network namespaces, ``tests/netns.py``): one server on host ps0 and the
two workers on hosts w0 and w1 as one MPI world, started the way README "Hybrid mode" says a multi-host
job is (``mpiexec -launcher ssh -hosts w0,w1 ... engine train CONFIG --role worker --rank $PMI_RANK``,
``ENGINE_SERVERS``), under a gang "scheduler" (``tests.pods.Pod``) that starts the whole world again after
any failure but a config error.

hydra's ssh is a script here that runs hydra's proxy inside the host's namespace as a machine of its
own: its own host name (a UTS namespace) and its own boot id (bound over ``/proc/sys/kernel/random/
boot_id`` in a mount namespace). Without that, UCX sees one machine (one boot id) and moves the ranks'
messages through shared memory: a cut network then stops nothing but hydra's output (checked on
2026-11-30). With it, UCX picks ``tcp/eth0`` between the ranks, as between two real machines.

- A partition between the workers' hosts (the server reachable from both) longer than
  ``client.barrier_timeout_s``: each rank's all-reduce fails after that bound naming the rank it waited
  for on the other host, the world ends (the far rank, whose ``MPI_Abort`` cannot reach ``mpiexec``,
  ends itself after ``ABORT_GRACE_S``), and restarted it trains once the partition heals: the servers
  are rolled back to the newest checkpoint and every example is counted once (the servers' show counts
  equal those of the same job run without a fault).
- A partition of 4 s, shorter than the bound: MPICH's TCP connection rides it out (no restart) with the
  same counts.
- A worker cut from the server only (the sparse path) exits 76 naming the server, which aborts the world;
  started again it trains once the path heals, every example counted once.
- Without ``security.insecure: true`` such a job is refused (every rank exits 2 naming the server's
  address), although the config names no address off loopback: the servers are named in
  ``ENGINE_SERVERS`` only (``engine.allreduce.check_world_confined``; a world across hosts with servers on
  loopback is refused too: ``tests/unit/test_hybrid_world_confined.py``). Before, it trained.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from engine.allreduce import ABORT_GRACE_S
from engine.checkpoint import CheckpointManager
from engine.launch.mpi import mpiexec_path
from tests.integration.test_chaos_offline import args, run
from tests.integration.test_offline_resume import _state
from tests.integration.test_partial_partition import cut_pair, heal_pair
from tests.integration.test_role_resume import role_cmd
from tests.mpi_worlds import topology_files
from tests.netns import TestHosts, require_netns
from tests.pods import Pod
from tests.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.long]   # 1-2 minutes each; make test: test_hybrid_world_confined
PORT = 7000
BOUND_S = 10.0                  # client.barrier_timeout_s: an all-reduce's longest wait
FAULTS = ["--set", "client.dead_after_s=6", "--set", f"client.barrier_timeout_s={BOUND_S:g}"]
INSECURE = ["--set", "security.insecure=true"]
BLAS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same hybrid job (1 server, 2 workers, 3 epochs) on loopback under the local launcher, no fault:
    its resolved config (data converted to Arrow, as role mode needs) and ``shows``, the servers' show
    count in its final checkpoint."""
    tmp = tmp_path_factory.mktemp("hybrid-hosts")
    full = run(args(tmp, "full", "mode=hybrid", "cluster.workers=2", "cluster.servers=1", "model.blas_threads=1",
                    "model.batch_size=16"))
    (tmp / "shows").write_text(str(shows(full["checkpoint"])))
    return tmp


def shows(checkpoint: str) -> float:
    return float(_state(checkpoint)[0][("embedding", "show")].sum())


class HybridHosts:
    """Server on ps0, the workers' world on w0 and w1 (module docstring), in ``tmp``."""

    def __init__(self, hosts: TestHosts, ref: Path, tmp: Path):
        self.hosts, self.ref, self.tmp = hosts, ref, tmp
        self.ssh = tmp / "netns_ssh.sh"
        for h in ("w0", "w1"):
            (tmp / f"boot_id-{h}").write_text(f"{uuid.uuid4()}\n")
        self.ssh.write_text(
            "#!/bin/sh\n# hydra's ssh: ssh [options] HOST COMMAND -> COMMAND on test host HOST as a machine of its own\n"
            'while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done\nhost=$1; shift\n'
            f"exec ip netns exec {hosts.prefix}$host unshare --uts --mount --propagation private sh -c "
            f"\"hostname $host && mount --bind {tmp}/boot_id-$host /proc/sys/kernel/random/boot_id && exec $*\"\n")
        self.ssh.chmod(0o755)
        self.result = tmp / "result-0.json"        # rank 0's (it holds the final checkpoint)
        self.topology: set[Path] = set()
        self._done = threading.Event()

    def watch(self, world: Pod) -> None:
        """Note the hydra topology files (``/tmp/hydra_hwloc_xmlfile_*``) that ``world``'s proxies hold
        while it runs, on every start: a world that ends for an abort leaves them behind (one per host);
        ``remove_topology`` removes them."""
        def look() -> None:
            while not self._done.is_set():
                proc = world.proc
                if proc is not None:
                    self.topology.update(topology_files(proc.pid))
                self._done.wait(0.05)
        threading.Thread(target=look, name="topology-files", daemon=True).start()

    def remove_topology(self) -> None:
        self._done.set()
        time.sleep(0.1)
        for f in self.topology:
            f.unlink(missing_ok=True)

    def start_server(self, *sets: str) -> None:
        ready = self.tmp / "ps0.ready"
        c = role_cmd(self.ref, "unused", "server", 0, "--set", f"checkpoint.root={self.tmp / 'ckpt'}", *sets,
                     "--host", self.hosts.ip("ps0"), "--port", str(PORT), "--ready-file", str(ready))
        p = self.hosts.popen("ps0", c, stdout=open(self.tmp / "ps0.log", "w"), stderr=subprocess.STDOUT)
        until(lambda: ready.exists() or p.poll() is not None, "server ready", timeout_s=120, every_s=0.1)
        assert p.poll() is None, (self.tmp / "ps0.log").read_text()[-3000:]

    def world(self, *sets: str, restarts: int = 3) -> Pod:
        """The workers' world (``mpiexec`` on w0, ranks on w0 and w1) under a gang scheduler; each rank
        appends to ``tmp/wR.log``. A step sleeps 0.1 s, so a fault lands with most of the training ahead."""
        c = role_cmd(self.ref, "unused", "worker", 0, "--set", f"checkpoint.root={self.tmp / 'ckpt'}", *sets,
                     "--result-file", str(self.tmp / "result-@RANK@.json"))
        inner = " ".join(shlex.quote(a) for a in c).replace("--rank 0", "--rank $PMI_RANK").replace("@RANK@", "$PMI_RANK")
        inner += f" >> {self.tmp}/w$PMI_RANK.log 2>&1"
        cmd = [str(self.ssh), "w0", mpiexec_path(), "-launcher", "ssh", "-launcher-exec", str(self.ssh),
               "-hosts", "w0,w1", "-n", "2", "-ppn", "1", "sh", "-c", shlex.quote(inner)]
        env = dict(self.hosts.env(), **BLAS, ENGINE_SERVERS=f"ps0:{PORT}", ENGINE_NUM_WORKERS="2",
                   ENGINE_FAILPOINTS="worker.after_step=sleep:0.1")
        world = Pod(cmd, lambda n: env, self.tmp / "world.log", restarts=restarts)
        self.watch(world)
        return world

    def first_checkpoint(self, world: Pod) -> None:
        mgr = CheckpointManager(str(self.tmp / "ckpt"), "ctr_dnn")
        until(lambda: len(mgr.list()) >= 1 or world.codes, "a checkpoint", timeout_s=180, every_s=0.05)
        assert not world.codes, (world.codes, self.logs())

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in sorted(self.tmp.glob("w?.log")))

    def assert_every_example_once(self) -> None:
        final = json.loads(self.result.read_text())
        assert shows(final["checkpoint"]) == float((self.ref / "shows").read_text()), final


def workers_on(hosts: TestHosts, host: str) -> list[int]:
    """Pids of the engine workers running in ``host``'s namespace."""
    out = subprocess.run(["ip", "netns", "pids", hosts.ns(host)], capture_output=True, text=True, timeout=20).stdout
    found = []
    for pid in out.split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"engine" in argv and b"--role" in argv and state != "Z":
            found.append(int(pid))
    return found


def test_a_partition_between_the_workers_hosts_fails_the_all_reduce_in_its_bound_and_the_world_restarts(
        reference, tmp_path):
    require_netns()
    with TestHosts(["ps0", "w0", "w1"]) as hosts:
        job = HybridHosts(hosts, reference, tmp_path)
        job.start_server(*INSECURE, *FAULTS)
        world = job.world(*INSECURE, *FAULTS)
        try:
            job.first_checkpoint(world)
            time.sleep(1.0)
            cut_at = time.monotonic()
            cut_pair(hosts, "w0", "w1")
            until(lambda: world.codes, "the world ends in the partition", timeout_s=BOUND_S + 60, every_s=0.1)
            ended = time.monotonic() - cut_at
            # the rank on w1 aborted too, and MPI_Abort waits for mpiexec, which it cannot reach: it ends
            # itself after ABORT_GRACE_S (it lived as long as the partition); the restarted world cannot
            # form across the partition meanwhile, so no worker runs on w1 then
            until(lambda: not workers_on(hosts, "w1"), "the aborted rank on w1 ends", timeout_s=ABORT_GRACE_S + 15,
                  every_s=0.1)
            time.sleep(3.0)
            assert not workers_on(hosts, "w1")
            heal_pair(hosts, "w0", "w1")
            world.thread.join(300)
            assert world.codes[-1] == 0 and len(world.codes) == 2, (world.codes, job.logs())
        finally:
            world.stop()
            job.remove_topology()
        logs = {r: (tmp_path / f"w{r}.log").read_text(errors="replace") for r in (0, 1)}
        # each rank's all-reduce gave up after the bound, naming the peer on the other host
        for r, peer in ((0, "rank 1 on w1"), (1, "rank 0 on w0")):
            assert (f"did not complete within {BOUND_S:g} s (client.barrier_timeout_s), waiting for {peer}: a worker "
                    f"hangs, died without ending the world, or is cut off from this host by the network" in logs[r]), \
                logs[r][-3000:]
        assert BOUND_S <= ended < BOUND_S + 30, ended
        assert "rolling every server back to" in logs[0], logs[0][-3000:]
        job.assert_every_example_once()


def test_a_short_partition_is_ridden_out_and_a_world_across_hosts_needs_security_insecure(reference, tmp_path):
    require_netns()
    with TestHosts(["ps0", "w0", "w1"]) as hosts:
        job = HybridHosts(hosts, reference, tmp_path)
        job.start_server(*INSECURE, *FAULTS)
        world = refused = job.world(*FAULTS, restarts=0)      # the workers' config names no address off loopback
        try:
            refused.thread.join(120)
            assert refused.codes == [2], (refused.codes, job.logs())
            for r in (0, 1):
                line = (f"engine train: config error: mode hybrid off loopback (server endpoint 'ps0:{PORT}', from "
                        f"ENGINE_SERVERS or cluster.endpoints) needs security.insecure: true")
                assert line in (tmp_path / f"w{r}.log").read_text(), job.logs()
            world = job.world(*INSECURE, *FAULTS)
            job.first_checkpoint(world)
            time.sleep(1.0)
            cut_pair(hosts, "w0", "w1")
            time.sleep(4.0)
            heal_pair(hosts, "w0", "w1")
            world.thread.join(300)
        finally:
            world.stop()
            job.remove_topology()
        assert world.codes == [0], (world.codes, job.logs())
        assert "CollectiveTimeoutError" not in job.logs()
        job.assert_every_example_once()


def test_a_worker_cut_from_the_server_only_exits_76_naming_it_and_the_world_restarts(reference, tmp_path):
    """The sparse path: w1 cannot reach ps0 while w0 reaches both and the workers reach each other. With
    ``client.barrier_timeout_s`` (60 s here) above ``client.dead_after_s`` and its keepalive grace (6 s,
    ~11 s), as with the defaults, worker 1 gives the server up first, says so and exits 76, which aborts
    the world with code 76; started again, the world waits for the path and trains once it heals, every
    example counted once."""
    require_netns()
    patient = ["--set", "client.barrier_timeout_s=60"]
    with TestHosts(["ps0", "w0", "w1"]) as hosts:
        job = HybridHosts(hosts, reference, tmp_path)
        job.start_server(*INSECURE, *FAULTS)
        world = job.world(*INSECURE, *FAULTS, *patient)
        try:
            job.first_checkpoint(world)
            time.sleep(1.0)
            cut_pair(hosts, "w1", "ps0")
            until(lambda: world.codes, "the world ends", timeout_s=120, every_s=0.1)
            time.sleep(3.0)
            heal_pair(hosts, "w1", "ps0")
            world.thread.join(300)
        finally:
            world.stop()
            job.remove_topology()
        assert world.codes == [76, 0], (world.codes, job.logs())
        w1 = (tmp_path / "w1.log").read_text(errors="replace")
        assert f"worker 1: server ps0:{PORT} is unreachable" in w1 and "exiting with code 76" in w1, w1[-3000:]
        assert "CollectiveTimeoutError" not in job.logs()
        job.assert_every_example_once()
