"""Role-mode chaos soak, outside CI: the recovery rule without a launcher, as Kubernetes runs a job.

CTR-DNN on generated rows (the offline chaos test's setting: 3000 rows, 2 servers, checkpoints every 8
aligned steps), async, 2 workers, started by hand with ``--role`` and ``--health-port`` as a scheduler
starts pods. Each role runs in a ``Pod`` (``tests/pods.py``: what a Job
controller and the kubelet do for one pod): it starts the role, restarts it when its liveness probe
fails 3 times in a row (1 s apart, 1 s deadline; SIGTERM, then SIGKILL after 2 s), and starts it again
after any exit but 0 and 2, servers with ``--resume`` (the job's newest checkpoint, as ``engine k8s``
renders them). ``--faults`` times, at a random moment 1-6 s apart (drawn from ``--seed``), a random role
(a server or a worker) gets a fault of a random kind of ``--kinds``, wherever it is: training, inside a
checkpoint, a roll-back, a fence or its own start:

- ``kill``: SIGKILL (a crash, an OOM kill);
- ``stop``: SIGSTOP (a frozen process: its probe stops answering and the kubelet restarts it);
- ``hang`` (workers only): the next start of that worker hangs its training loop at a random step
  (the failpoint ``worker.after_step=...,sleep:600@N``): alive, its heartbeat fine, its steps stopped;
  its liveness port (``engine.liveness``) says NOT_SERVING after ``client.dead_after_s`` (5 s in a
  soak with stops or hangs, so that a stall is found before the next fault lands; 30 s otherwise).

The job must finish by itself: both workers exit 0, and every training example counted exactly once,
proven by the servers' show counts in the final checkpoint (each example adds one show to each of its 26
keys: more is an example trained twice, less a lost one). Exit codes on the way are the recovery rule's:
76 (roll back), 1 (a call that failed mid-way, counted by a scheduler's backoffLimit) is reported, and
so is every liveness restart, with the probe's reason.

Prints one JSON line per seed with a ``bench`` field (``role_chaos_soak``)::

    python bench/role_chaos_soak.py [--faults 6] [--seeds 0 1 2] [--epochs 12] [--kinds kill stop hang]
        [--timeout-s 900] [--set mode=sync] [--reference]
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

from tests.integration.test_chaos_offline import ROWS, SLOTS, args, run  # noqa: E402
from tests.integration.test_offline_resume import _state  # noqa: E402
from tests.pods import Pod  # noqa: E402
from tests.integration.test_role_resume import free_ports, role_cmd, role_env  # noqa: E402

KINDS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
DEAD_AFTER_S = 5.0          # client.dead_after_s of a soak with stops or hangs (default 30 s)


def soak(work: Path, seed: int, faults: int, epochs: int, timeout_s: float, extra: tuple[str, ...] = (),
         shows_expected: float | None = None, kinds: tuple[str, ...] = ("kill",)) -> dict:
    """One soak; ``shows_expected``: the show count of an uninterrupted run of the same setting (None:
    every training example of every epoch, which async trains; sync drops each shard's last partial
    batch, so its expected count comes from a reference run, ``faults`` 0)."""
    rng = np.random.default_rng(seed)
    sets = ("mode=async", "cluster.workers=2", "model.blas_threads=1", f"model.epochs={epochs}")
    if not (work / "run-full" / "config.yaml").exists():
        run(args(work, "full", *sets))          # the resolved config, its data converted to Arrow
    if {"stop", "hang"} & set(kinds):
        # found within the faults' spacing: a worker stalled this long is NOT_SERVING (engine.liveness),
        # and a connection to a frozen server is dropped after max(this, 11 s) (engine.ps.keepalive)
        extra = (f"client.dead_after_s={DEAD_AFTER_S:g}", *extra)
    tag = f"soak{seed}"
    ports, health = free_ports(2), free_ports(4)
    slow = "worker.after_step=sleep:0.05"
    env = {**role_env(ports, workers=2), "ENGINE_FAILPOINTS": slow}
    hangs_due = [0, 0]            # per worker rank: hangs to arm at its next start
    hangs_armed: list[dict] = []

    def worker_env(rank: int):
        def env_of(start: int) -> dict:
            if not hangs_due[rank]:
                return env
            hangs_due[rank] -= 1
            at = int(rng_hang.integers(2, 13))        # a step of this start (a resumed start has fewer)
            hangs_armed.append({"rank": rank, "start": start, "step": at})
            return {**env, "ENGINE_FAILPOINTS": f"{slow},sleep:600@{at}"}
        return env_of
    rng_hang = np.random.default_rng(seed + 10_000)
    logs = work / tag
    logs.mkdir(exist_ok=True)
    result = logs / "result.json"
    # the resolved config of the first soak in ``work`` holds its epochs: this soak's are set again,
    # with the --set values of this run (e.g. mode=sync)
    epochs_set = tuple(a for kv in (f"model.epochs={epochs}", "cluster.stop_servers_at_end=true", *extra)
                       for a in ("--set", kv))
    servers = [Pod(role_cmd(work, tag, "server", r, "--port", str(ports[r]), "--health-port", str(health[r]),
                            "--resume", *epochs_set), lambda n: env, logs / f"server-{r}.log", health[r],
                   restarts=faults + 3) for r in range(2)]
    workers = [Pod(role_cmd(work, tag, "worker", r, "--health-port", str(health[2 + r]),
                            *(("--result-file", str(result)) if r == 0 else ()), *epochs_set), worker_env(r),
                   logs / f"worker-{r}.log", health[2 + r], restarts=faults + 3) for r in range(2)]
    roles = [("server", r, s) for r, s in enumerate(servers)] + [("worker", r, w) for r, w in enumerate(workers)]
    injected: list[dict] = []
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    try:
        while (len(injected) < faults and time.monotonic() < deadline and not all(w.done for w in workers)
               and not any(w.done and w.codes[-1] != 0 for w in workers)):
            time.sleep(float(rng.uniform(1.0, 6.0)))
            role, rank, pod = roles[int(rng.integers(0, len(roles)))]
            kind = kinds[int(rng.integers(0, len(kinds)))]
            if kind == "hang" and role == "worker":      # armed for its next start, which a kill brings now
                hangs_due[rank] += 1
                if pod.signal(signal.SIGKILL):
                    injected.append({"role": role, "rank": rank, "kind": kind,
                                     "at_s": round(time.monotonic() - t0, 1)})
                else:
                    hangs_due[rank] -= 1
            elif kind != "hang" and pod.signal(KINDS[kind]):
                injected.append({"role": role, "rank": rank, "kind": kind, "at_s": round(time.monotonic() - t0, 1)})
        while time.monotonic() < deadline and not all(w.done for w in workers):
            if any(w.done and w.codes[-1] != 0 for w in workers):     # a worker its scheduler gave up on
                break
            time.sleep(0.2)
        finished = all(w.done for w in workers)
    finally:
        for s in workers + servers:
            s.stop()
    out = {"bench": "role_chaos_soak", "sets": list(extra), "kinds": list(kinds), "seed": seed, "faults": len(injected), "injected": injected,
           "epochs": epochs, "elapsed_s": round(time.monotonic() - t0, 1), "finished": finished,
           "worker_codes": [w.codes for w in workers], "server_codes": [s.codes for s in servers],
           "hangs_armed": hangs_armed,
           "probe_restarts": {f"{role}{rank}": pod.restarted for role, rank, pod in roles if pod.restarted}}
    text = {p.name: p.read_text(errors="replace") for p in logs.glob("*.log")}
    out["rollbacks"] = sum(t.count("rolling every server back to") for t in text.values())
    out["fences"] = sum(t.count(" server(s): the running workers exit") for t in text.values())
    out["clears"] = sum(t.count("the job starts again from its beginning") for t in text.values())
    out["tracebacks"] = {n: t.count("Traceback") for n, t in text.items() if "Traceback" in t}
    out["hangs_reached"] = sum(t.count("failpoint worker.after_step: sleep 600 s") for t in text.values())
    out["liveness_not_serving"] = sum(t.count("liveness NOT_SERVING") for t in text.values())
    if shows_expected is None:
        shows_expected = epochs * sum(1 for i in range(ROWS) if i % 5 != 4) * SLOTS
    out["shows_expected"] = shows_expected
    if finished and result.exists():
        sparse, _ = _state(json.loads(result.read_text())["checkpoint"])
        out["shows"] = float(sparse[("embedding", "show")].sum())
    out["ok"] = (finished and all(w.codes and w.codes[-1] == 0 for w in workers)
                 and out.get("shows") == shows_expected)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one, removed)")
    ap.add_argument("--kinds", nargs="+", default=["kill"], choices=["kill", "stop", "hang"],
                    help="the faults drawn from (a hang strikes a worker only; drawn for a server, it is skipped)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config value for the roles, e.g. --set mode=sync")
    ap.add_argument("--reference", action="store_true",
                    help="first run once without faults and expect its show count (needed for mode=sync)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # the roles are stopped on the way out
    with tempfile.TemporaryDirectory(prefix="role-soak-") as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        expected = None
        if a.reference:
            ref = soak(work, 1000, 0, a.epochs, a.timeout_s, tuple(a.sets))      # seed 1000: the reference
            print(json.dumps({**ref, "bench": "role_chaos_soak_reference"}), flush=True)
            expected = ref.get("shows")
        for seed in a.seeds:
            print(json.dumps(soak(work, seed, a.faults, a.epochs, a.timeout_s, tuple(a.sets), expected,
                                  tuple(a.kinds))), flush=True)


if __name__ == "__main__":
    main()
