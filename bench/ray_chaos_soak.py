"""Ray chaos soak, outside CI: the recovery rule under ``engine train --launcher ray``, many faults per job.

``tests/integration/test_ray_launcher.py`` kills one worker actor once. This soak runs CTR-DNN on the
shared Criteo rows (``configs/ctr.yaml``) on a real three-node Ray cluster started here as the Ray tests
start theirs (``ray.cluster_utils.Cluster``, 1 CPU per node): a head that runs no role, a node offering the
custom resource ``ps_node`` (the servers') and one offering ``worker_node`` (the workers'), so that either
role's node can be lost, never the head with the cluster's control store; mutual TLS and tokens since the
nodes bind the machine's address; 2 servers + 2 workers, checkpoints every 8 aligned steps. It injects
``--faults`` faults (drawn from ``--seed``), each into the running attempt, of a random kind of ``--kinds``.
Timed kinds land 2-7 s after the attempt's four roles are up, on a random role:

- ``kill``: SIGKILL of the role process (a crash, an OOM kill inside the actor);
- ``kill_actor``: SIGKILL of the Ray actor process that runs the role (its role dies with it);
- ``stop``: SIGSTOP of the role process (a frozen process: the launcher must find it within
  ``client.dead_after_s``, 5 s here, and restart the job); it is continued at the end should it outlive
  its attempt;
- ``node``: the node of the role (the servers' or the workers' node) is removed at once
  (``Cluster.remove_node(node, allow_graceful=False)``: a preempted VM, its raylet and both roles on it
  end together, one failure of the job); once the driver logs the restart, a replacement offering the same
  custom resource joins 0.5-3 s later (``tests/integration/test_ray_node_loss.py`` does the same once).

Aimed kinds wait for a window that a failpoint (``engine.failpoints``) holds open, seen in the role's own
log on this machine (the file its actor writes, not the driver's forwarded copy, which lags):

- ``ckpt``: worker 0, the checkpoint coordinator, is held ``HOLD_S`` s at every publish of an attempt but
  its first (``checkpoint.before_publish``: the servers wrote their part files, the manifest and
  ``_SUCCESS`` are not written); a random role is SIGKILLed inside the next hold. The checkpoint the
  restart restores must be a complete one (``_SUCCESS``) when the driver names it: the one before, or the
  held one if worker 0 still published it (the killed role was another, and every part file had been
  written);
- ``restore``: each server is held ``HOLD_S`` s inside its ``Load`` (``server.load``), which only a
  restart that restores a checkpoint calls (the workers start after it): drawn only right after a fault
  that landed while the job had a complete checkpoint, it SIGKILLs a held server.

An aimed window not seen within ``WINDOW_TIMEOUT_S`` (the job ended, a restart began from no checkpoint)
is a fault skipped, not counted; every wait is bounded, and the job by ``--timeout-s``.

The same job runs first without faults (the reference, without the aimed failpoints). The soak passes
(``ok``) when the driver exits 0 by itself with ``restarts`` equal to the faults that landed, the final
checkpoint's show counts equal the reference's (each training example adds one show to each of its 26
keys: more is an example trained twice, fewer a lost one), the held-out AUC is within ``AUC_TOLERANCE`` of
the reference's, every restart after a ``ckpt`` fault restored a complete checkpoint, and no role process
is left. Prints one JSON line per seed with a ``bench`` field (``ray_chaos_soak``), after a ``machine``
line::

    python bench/ray_chaos_soak.py [--faults 6] [--seeds 0 1] [--epochs 3] [--step-sleep-s 0.1]
        [--kinds kill kill_actor stop node ckpt restore] [--timeout-s 1200]
"""
from __future__ import annotations

import argparse
import json
import os
import re
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
from hdfs_io import SUCCESS_NAME  # noqa: E402
from tests.integration.test_offline_resume import _state  # noqa: E402
from tests.integration.test_ray_launcher import (  # noqa: E402
    CLUSTERS,
    _cmdline,
    _end_ray,
    ray_cmd,
    ray_roles,
)
from tests.integration.test_ray_node_loss import node_processes, running  # noqa: E402

AUC_TOLERANCE = 0.01      # async: a restart replays from the checkpoint in another order
DEAD_AFTER_S = 5.0          # client.dead_after_s when the soak stops roles (default 30 s)
ROLES = [("server", 0), ("server", 1), ("worker", 0), ("worker", 1)]
KINDS = ["kill", "kill_actor", "stop", "node", "ckpt", "restore"]
RESOURCE = {"server": "ps_node", "worker": "worker_node"}      # what pins each role to its node
NODE = dict(num_cpus=1, object_store_memory=80 << 20, include_dashboard=False)
HOLD_S = 3.0                # how long the aimed failpoints hold a process
WINDOW_TIMEOUT_S = 120.0    # how long an aimed fault waits for its window
GONE_S = 20.0               # how long a removed node's processes may take to end
HOLD_LINE = {"ckpt": "failpoint checkpoint.before_publish: sleep", "restore": "failpoint server.load: sleep"}
RESTART = re.compile(r"; restart (\d+)/\d+ from (\S+)")


def start_cluster():
    """``(cluster, {resource: node}, session dir)``: a Ray cluster whose head offers no custom resource and
    whose two other nodes offer ``ps_node`` and ``worker_node`` (either can be removed and replaced)."""
    from ray.cluster_utils import Cluster
    tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")      # short: Ray's socket paths must stay short
    os.environ["RAY_TMPDIR"] = tmp
    os.mkdir(os.path.join(tmp, "actors"))
    cluster = None
    try:
        with actors_in(tmp):
            cluster = Cluster(initialize_head=True, head_node_args=dict(NODE))
            nodes = {r: cluster.add_node(**NODE, resources={r: 4}) for r in RESOURCE.values()}
            cluster.wait_for_nodes()
    except BaseException:
        _end_ray(cluster, tmp)
        raise
    CLUSTERS.append(tmp)
    return cluster, nodes, tmp


class actors_in:
    """``TMPDIR`` is the session's ``actors`` directory inside the block: the raylets started there give it
    to their actors, whose ``engine-ray-*`` directories then go with the session."""

    def __init__(self, tmp: str):
        self.tmp = tmp

    def __enter__(self):
        self.old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = os.path.join(self.tmp, "actors")

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = self.old


def role_pid(role: str, rank: int, exclude: set[int]) -> int | None:
    """pid of the live ``--role role --rank rank`` process of this soak's Ray session, not in ``exclude``."""
    want = f"--role {role} --rank {rank} "
    return next((p for p in ray_roles() if p not in exclude and want in _cmdline(p) + " "), None)


def role_log(pid: int, role: str, rank: int) -> Path | None:
    """The log file the actor of role process ``pid`` writes (beside the config in its argv), or None."""
    cfg = next((a for a in _cmdline(pid).split() if "engine-ray-" in a and a.endswith("config.yaml")), None)
    return None if cfg is None else Path(cfg).parent / f"{role}{rank}.log"


def holds(path: Path | None, line: str) -> int:
    """How many times the log at ``path`` says ``line`` (0 when it cannot be read)."""
    try:
        return 0 if path is None else path.read_text(errors="replace").count(line)
    except OSError:
        return 0


def restarts_logged(err: Path) -> list[str]:
    """What each restart the driver logged so far restores (a checkpoint's path, or "the")."""
    try:
        return [m.group(2) for m in RESTART.finditer(err.read_text(errors="replace"))]
    except OSError:
        return []


def complete(root: Path) -> list[str]:
    """The checkpoints under ``root`` that have their ``_SUCCESS`` file (a directory removed meanwhile is
    skipped)."""
    return sorted(d for d, _, files in os.walk(root) if SUCCESS_NAME in files)


def wait_for(ok, timeout_s: float, every_s: float = 0.05):
    """``ok()``'s first true value within ``timeout_s`` s, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = ok()
        if v:
            return v
        time.sleep(every_s)
    return None


def lose_node(cluster, nodes: dict, resource: str, tmp: str, err: Path, rng, before: int) -> dict:
    """Remove the node offering ``resource`` at once; once the driver logged its restart ``before + 1``
    (at most ``WINDOW_TIMEOUT_S`` s), a replacement offering it joins 0.5-3 s later. -> what happened."""
    node = nodes[resource]
    procs = node_processes(node)
    cluster.remove_node(node, allow_graceful=False)
    t0 = time.monotonic()
    gone = wait_for(lambda: not any(running(p) for p in procs), GONE_S, 0.1) is not None
    gone_s = round(time.monotonic() - t0, 1)
    restarted = wait_for(lambda: len(restarts_logged(err)) > before, WINDOW_TIMEOUT_S, 0.1) is not None
    time.sleep(float(rng.uniform(0.5, 3.0)))
    with actors_in(tmp):
        nodes[resource] = cluster.add_node(**NODE, resources={resource: 4})
        cluster.wait_for_nodes(timeout=60)
    return {"node": node.node_id[:12], "node_procs_gone": gone, "gone_s": gone_s, "restart_seen": restarted,
            "replaced_after_s": round(time.monotonic() - t0, 1)}


def attempt_roles(seen: set[int], driver) -> dict | str | None:
    """``{(role, rank): pid}`` of the running attempt's four roles (none in ``seen``: an earlier fault hit
    those), None while one is missing, "ended" once the driver ended."""
    if driver.poll() is not None:
        return "ended"
    pids = {r: role_pid(*r, seen) for r in ROLES}
    return pids if all(pids.values()) else None


def restore_after_hold(err: Path, root: Path, logged: int, before: list[str]) -> dict:
    """After a ckpt fault: what the driver's next restart (its ``logged + 1``-th) restores, read as soon as
    it is logged (at most ``WINDOW_TIMEOUT_S`` s), and whether that is a complete checkpoint then
    (``_SUCCESS``; "the" beginning only while none stands), and whether the held one was published
    anyway (worker 0 woke before the launcher stopped it)."""
    got = wait_for(lambda: (r := restarts_logged(err))[logged:] and r[logged], WINDOW_TIMEOUT_S, 0.02)
    now = complete(root)
    ok = got is not None and (Path(got, SUCCESS_NAME).exists() if got != "the" else not now)
    return {"restored": got, "restored_complete": ok, "held_published": bool(set(now) - set(before))}


def aim(kind: str, seen: set[int], driver, timeout_s: float) -> tuple[tuple[str, int], int] | None:
    """Wait for ``kind``'s window: ``ckpt``, worker 0 of the running attempt held before a publish;
    ``restore``, a server of a new attempt held inside its Load (given up once that attempt's workers
    run: its restore is over). -> ((role, rank) held, its pid), or why not ("ended", "missed", "no window
    in time")."""
    count: dict[int, int] = {}

    def held():
        if driver.poll() is not None:
            return "ended"
        if kind == "restore" and any(role_pid("worker", r, seen) for r in (0, 1)):
            return "missed"
        for role, rank in ([("worker", 0)] if kind == "ckpt" else [("server", 0), ("server", 1)]):
            pid = role_pid(role, rank, seen)
            if pid is None:
                continue
            n = holds(role_log(pid, role, rank), HOLD_LINE[kind])
            if n > count.setdefault(pid, n if kind == "ckpt" else 0):
                return (role, rank), pid
        return None
    return wait_for(held, timeout_s, 0.05) or "no window in time"


def run_job(work: Path, tag: str, cluster, nodes: dict, tmp: str, epochs: int, sets: tuple[str, ...],
            faults: int, kinds: tuple[str, ...], rng, timeout_s: float, step_sleep_s: float) -> dict:
    """One driver run; injects up to ``faults`` faults. -> its record (exit, final line, faults injected)."""
    cmd = ray_cmd(work, tag, cluster.address, cluster.head_node.node_ip_address, "mode=async",
                  "checkpoint.align_steps=8", "checkpoint.delta_every=8steps", f"model.epochs={epochs}",
                  "observability.prometheus_port=0", f"cluster.max_restarts={faults + 2}", *sets)
    points = [f"worker.after_step=sleep:{step_sleep_s:g}"]
    if faults and "ckpt" in kinds:
        # from an attempt's second publish: a complete checkpoint of the job stands before each held one
        points.append("checkpoint.before_publish=" + ",".join(f"sleep:{HOLD_S:g}@{n}" for n in range(2, 41)))
    if faults and "restore" in kinds:
        points.append(f"server.load=sleep:{HOLD_S:g}")
    env = {**os.environ, "ENGINE_FAILPOINTS": ";".join(points)}
    err_path, root = work / f"{tag}.err", work / f"ckpt-{tag}"
    injected, seen, stopped, skipped = [], set(), [], []
    restorable = False      # the last fault landed while a complete checkpoint stood: a restore follows
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    load0 = os.getloadavg()[0]
    with open(err_path, "w+") as err, open(work / f"{tag}.out", "w+") as out:
        driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True,
                                  start_new_session=True)
        try:
            for _ in range(faults * 10):
                if len(injected) >= faults or driver.poll() is not None or time.monotonic() >= deadline:
                    break
                now = [k for k in kinds if k != "restore" or restorable]
                kind = now[int(rng.integers(0, len(now)))]
                left = max(0.0, deadline - time.monotonic())
                fault = {"kind": kind}
                if kind == "restore":
                    got = aim("restore", seen, driver, min(WINDOW_TIMEOUT_S, left))
                    if not isinstance(got, tuple):
                        skipped.append({"kind": kind, "why": got, "at_s": round(time.monotonic() - t0, 1)})
                        restorable = False
                        continue
                    (role, rank), pid = got
                    held_at = time.monotonic()
                    pids = {(role, rank): pid}
                    pids.update({r: p for r in ROLES if (p := role_pid(*r, seen)) is not None})
                else:
                    # the attempt's four roles, none of them one an earlier fault hit (a restart starts new ones)
                    pids = wait_for(lambda: attempt_roles(seen, driver), left, 0.1)
                    if not isinstance(pids, dict):
                        continue
                    if kind == "ckpt":
                        got = aim("ckpt", seen, driver, min(WINDOW_TIMEOUT_S, left))
                        if not isinstance(got, tuple):
                            skipped.append({"kind": kind, "why": got, "at_s": round(time.monotonic() - t0, 1)})
                            continue
                        held_at = time.monotonic()
                        before = complete(root)
                    else:
                        time.sleep(float(rng.uniform(2.0, 7.0)))
                    role, rank = ROLES[int(rng.integers(0, len(ROLES)))]
                    pid = pids[(role, rank)]
                    if driver.poll() is not None or role_pid(role, rank, seen) != pid:
                        continue                  # the job ended, or its attempt restarted under us
                if kind in ("ckpt", "restore") and time.monotonic() - held_at > HOLD_S / 2:
                    skipped.append({"kind": kind, "why": "late", "at_s": round(time.monotonic() - t0, 1)})
                    continue                  # the hold may be over by now: not a fault inside it
                had_checkpoint = bool(complete(root))
                logged = len(restarts_logged(err_path))
                fault["at_s"] = round(time.monotonic() - t0, 1)
                if kind == "node":
                    fault.update(lose_node(cluster, nodes, RESOURCE[role], tmp, err_path, rng, logged))
                else:
                    try:
                        target = parent_pid(pid) if kind == "kill_actor" else pid
                        os.kill(target, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
                    except (OSError, ValueError, IndexError):
                        continue
                    if kind == "stop":
                        stopped.append(target)
                    if kind in ("ckpt", "restore"):     # how long after the hold's log line the kill came
                        fault["into_hold_s"] = round(time.monotonic() - held_at, 2)
                    if kind == "ckpt":
                        fault["newest_complete_before"] = before[-1] if before else None
                        fault.update(restore_after_hold(err_path, root, logged, before))
                seen.update(pids.values())
                restorable = had_checkpoint
                injected.append({"role": f"{role} {rank}", **fault})
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
    rec = {"exit": driver.returncode, "faults": len(injected), "injected": injected, "skipped": skipped,
           "restarts": final.get("restarts"), "test_auc": final.get("test_auc"),
           "wall_s": round(time.monotonic() - t0, 1), "tracebacks": text.count("Traceback"),
           "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}
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
    ap.add_argument("--kinds", nargs="+", default=["kill", "kill_actor", "stop"], choices=KINDS)
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per job")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="extra engine train overrides, for the reference and the soak alike")
    a = ap.parse_args()
    sets = tuple(a.sets) + ((f"client.dead_after_s={DEAD_AFTER_S:g}",) if "stop" in a.kinds else ())
    print(json.dumps({"bench": "machine", "os_cpu_count": os.cpu_count(),
                      "sched_getaffinity_cpus": len(os.sched_getaffinity(0)), "loadavg_1min": os.getloadavg()[0]}),
          flush=True)
    cluster, nodes, tmp = start_cluster()
    try:
        work = Path(tmp) / "soak"
        work.mkdir()
        ref = run_job(work, "reference", cluster, nodes, tmp, a.epochs, sets, 0, tuple(a.kinds),
                      np.random.default_rng(0), a.timeout_s, a.step_sleep_s)
        print(json.dumps({"bench": "ray_chaos_reference", **ref}), flush=True)
        for seed in a.seeds:
            rec = run_job(work, f"soak{seed}", cluster, nodes, tmp, a.epochs, sets, a.faults,
                          tuple(a.kinds), np.random.default_rng(seed), a.timeout_s, a.step_sleep_s)
            rec["ok"] = (rec["exit"] == 0 and rec["restarts"] == rec["faults"] and rec.get("shows") is not None
                         and rec.get("shows") == ref.get("shows") and rec["left_over_roles"] == 0
                         and ref.get("test_auc") is not None
                         and abs(rec["test_auc"] - ref["test_auc"]) <= AUC_TOLERANCE
                         and all(f["restored_complete"] for f in rec["injected"] if f["kind"] == "ckpt"))
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
