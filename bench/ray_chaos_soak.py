"""Ray chaos soak, outside CI: the recovery rule under ``engine train --launcher ray``, many faults per job.

``tests/integration/test_ray_launcher.py`` kills one worker actor once. This soak runs CTR-DNN on the
shared Criteo rows (``configs/ctr.yaml``) on a real two-node Ray cluster started here as that test does
(``ray.cluster_utils.Cluster``, 1 CPU per node, servers pinned to one node and workers to the other, mutual
TLS and tokens since the nodes bind the machine's address), 2 servers + 2 workers, checkpoints every 8
aligned steps, and injects ``--faults`` faults, 2-7 s apart (drawn from ``--seed``), each into a random role
of the running attempt, of a random kind of ``--kinds``:

- ``kill``: SIGKILL of the role process (a crash, an OOM kill inside the actor);
- ``kill_actor``: SIGKILL of the Ray actor process that runs the role (its role dies with it);
- ``stop``: SIGSTOP of the role process (a frozen process: the launcher must find it within
  ``client.dead_after_s``, 5 s here, and restart the job); it is continued at the end should it outlive
  its attempt.

The same job runs first without faults (the reference). The soak passes (``ok``) when the driver exits 0
by itself with ``restarts`` equal to the faults that landed, the final checkpoint's show counts equal the
reference's (each training example adds one show to each of its 26 keys: more is an example trained twice,
fewer a lost one), the held-out AUC is within ``AUC_TOLERANCE`` of the reference's, and no role process
is left. Prints one JSON line per seed with a ``bench`` field (``ray_chaos_soak``), after a ``machine``
line::

    python bench/ray_chaos_soak.py [--faults 6] [--seeds 0 1] [--epochs 3] [--step-sleep-s 0.1]
        [--kinds kill kill_actor stop] [--timeout-s 1200]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.launch.procs import parent_pid  # noqa: E402
from tests.integration.test_offline_resume import _state  # noqa: E402
from tests.integration.test_ray_launcher import (  # noqa: E402
    CLUSTERS,
    _cmdline,
    _end_ray,
    ray_cmd,
    ray_roles,
)

AUC_TOLERANCE = 0.01      # async: a restart replays from the checkpoint in another order
DEAD_AFTER_S = 5.0          # client.dead_after_s when the soak stops roles (default 30 s)
ROLES = [("server", 0), ("server", 1), ("worker", 0), ("worker", 1)]


def start_cluster():
    """``(cluster, address, head node, session dir)`` of a two-node Ray cluster, as the Ray tests make it."""
    from ray.cluster_utils import Cluster
    tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")      # short: Ray's socket paths must stay short
    os.environ["RAY_TMPDIR"] = tmp
    old_tmpdir = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = os.path.join(tmp, "actors")   # the actors' engine-ray-* dirs go with the session
    os.mkdir(os.environ["TMPDIR"])
    cluster = None
    try:
        common = dict(num_cpus=1, object_store_memory=80 << 20, include_dashboard=False)
        cluster = Cluster(initialize_head=True, head_node_args={**common, "resources": {"ps_node": 4}})
        cluster.add_node(**common, resources={"worker_node": 4})
        cluster.wait_for_nodes()
    except BaseException:
        _end_ray(cluster, tmp)
        raise
    finally:
        if old_tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_tmpdir
    CLUSTERS.append(tmp)
    return cluster, cluster.address, cluster.head_node, tmp


def role_pid(role: str, rank: int, exclude: set[int]) -> int | None:
    """pid of the live ``--role role --rank rank`` process of this soak's Ray session, not in ``exclude``."""
    want = f"--role {role} --rank {rank} "
    return next((p for p in ray_roles() if p not in exclude and want in _cmdline(p) + " "), None)


def run_job(work: Path, tag: str, address: str, node_ip: str, epochs: int, sets: tuple[str, ...],
            faults: int, kinds: tuple[str, ...], rng, timeout_s: float, step_sleep_s: float) -> dict:
    """One driver run; injects up to ``faults`` faults. -> its record (exit, final line, faults injected)."""
    cmd = ray_cmd(work, tag, address, node_ip, "mode=async", "checkpoint.align_steps=8",
                  "checkpoint.delta_every=8steps", f"model.epochs={epochs}", "observability.prometheus_port=0",
                  f"cluster.max_restarts={faults + 2}", *sets)
    env = {**os.environ, "ENGINE_FAILPOINTS": f"worker.after_step=sleep:{step_sleep_s:g}"}
    injected, seen, stopped = [], set(), []
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    with open(work / f"{tag}.err", "w+") as err, open(work / f"{tag}.out", "w+") as out:
        driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True,
                                  start_new_session=True)
        try:
            while len(injected) < faults and driver.poll() is None and time.monotonic() < deadline:
                # the attempt's four roles, none of them one an earlier fault hit (a restart starts new ones)
                pids = {r: role_pid(*r, seen) for r in ROLES}
                if any(p is None for p in pids.values()):
                    time.sleep(0.1)
                    continue
                time.sleep(float(rng.uniform(2.0, 7.0)))
                role, rank = ROLES[int(rng.integers(0, len(ROLES)))]
                kind = kinds[int(rng.integers(0, len(kinds)))]
                pid = pids[(role, rank)]
                if driver.poll() is not None or role_pid(role, rank, seen) != pid:
                    continue                  # the job ended, or its attempt restarted under us
                try:
                    target = parent_pid(pid) if kind == "kill_actor" else pid
                    os.kill(target, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
                except (OSError, ValueError, IndexError):
                    continue
                if kind == "stop":
                    stopped.append(target)
                seen.update(pids.values())
                injected.append({"role": f"{role} {rank}", "kind": kind, "at_s": round(time.monotonic() - t0, 1)})
            driver.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait(10)
        out.seek(0)
        err.seek(0)
        lines, text = out.read().strip().splitlines(), err.read()
    final = json.loads(lines[-1]) if driver.returncode == 0 and lines else {}
    rec = {"exit": driver.returncode, "faults": len(injected), "injected": injected,
           "restarts": final.get("restarts"), "test_auc": final.get("test_auc"),
           "wall_s": round(time.monotonic() - t0, 1), "tracebacks": text.count("Traceback")}
    if final.get("checkpoint"):
        sparse, _ = _state(final["checkpoint"])
        rec["shows"] = float(sparse[("embedding", "show")].sum())
    if driver.returncode != 0:
        rec["stderr_tail"] = text[-3000:]
    time.sleep(2.0)                     # the actors' roles end after the driver
    rec["left_over_roles"] = len(ray_roles())
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--step-sleep-s", type=float, default=0.1,
                    help="each worker step sleeps this long (failpoint worker.after_step): ~16 steps an epoch "
                         "per worker on the shared rows, so the faults land in training, not after it")
    ap.add_argument("--kinds", nargs="+", default=["kill", "kill_actor", "stop"],
                    choices=["kill", "kill_actor", "stop"])
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per job")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="extra engine train overrides, for the reference and the soak alike")
    a = ap.parse_args()
    sets = tuple(a.sets) + ((f"client.dead_after_s={DEAD_AFTER_S:g}",) if "stop" in a.kinds else ())
    print(json.dumps({"bench": "machine", "os_cpu_count": os.cpu_count(),
                      "sched_getaffinity_cpus": len(os.sched_getaffinity(0)), "loadavg_1min": os.getloadavg()[0]}),
          flush=True)
    cluster, address, head, tmp = start_cluster()
    try:
        work = Path(tmp) / "soak"
        work.mkdir()
        ref = run_job(work, "reference", address, head.node_ip_address, a.epochs, sets, 0, tuple(a.kinds),
                      np.random.default_rng(0), a.timeout_s, a.step_sleep_s)
        print(json.dumps({"bench": "ray_chaos_reference", **ref}), flush=True)
        for seed in a.seeds:
            rec = run_job(work, f"soak{seed}", address, head.node_ip_address, a.epochs, sets, a.faults,
                          tuple(a.kinds), np.random.default_rng(seed), a.timeout_s, a.step_sleep_s)
            rec["ok"] = (rec["exit"] == 0 and rec["restarts"] == rec["faults"] and rec.get("shows") is not None
                         and rec.get("shows") == ref.get("shows") and rec["left_over_roles"] == 0
                         and ref.get("test_auc") is not None
                         and abs(rec["test_auc"] - ref["test_auc"]) <= AUC_TOLERANCE)
            if rec["test_auc"] is not None and ref.get("test_auc") is not None:
                rec["auc_delta"] = round(rec["test_auc"] - ref["test_auc"], 4)
            print(json.dumps({"bench": "ray_chaos_soak", "seed": seed, "kinds": a.kinds, "epochs": a.epochs,
                              "sets": list(sets), "reference_shows": ref.get("shows"),
                              "reference_auc": ref.get("test_auc"), **rec}), flush=True)
    finally:
        CLUSTERS.remove(tmp)
        _end_ray(cluster, tmp)


if __name__ == "__main__":
    main()
