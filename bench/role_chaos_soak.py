"""Role-mode chaos soak, outside CI: the recovery rule without a launcher, as Kubernetes runs a job.

CTR-DNN on generated rows (the offline chaos test's setting: 3000 rows, 2 servers, checkpoints every 8
aligned steps), async, 2 workers, started by hand with ``--role`` as a scheduler starts pods. Each role
has a scheduler of its own (``RoleScheduler``, what a Job controller does for one pod): it starts the
role and starts it again after any exit but 0 and 2, servers with ``--resume`` (the job's newest
checkpoint, as ``engine k8s`` renders them). ``--faults`` times, at a random moment 1-6 s apart (drawn
from ``--seed``), a random role (a server or a worker) is killed with SIGKILL, wherever it is: training,
inside a checkpoint, a roll-back, a fence or its own start.

The job must finish by itself: both workers exit 0, and every training example counted exactly once,
proven by the servers' show counts in the final checkpoint (each example adds one show to each of its 26
keys: more is an example trained twice, less a lost one). Exit codes on the way are the recovery rule's:
76 (roll back), 1 (a call that failed mid-way, counted by a scheduler's backoffLimit) is reported.

Prints one JSON line per seed with a ``bench`` field (``role_chaos_soak``)::

    python bench/role_chaos_soak.py [--faults 6] [--seeds 0 1 2] [--epochs 12] [--timeout-s 900] [--set mode=sync]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.test_chaos_offline import ROWS, SLOTS, args, run  # noqa: E402
from tests.integration.test_offline_resume import _state  # noqa: E402
from tests.integration.test_role_resume import free_ports, role_cmd, role_env  # noqa: E402


class RoleScheduler:
    """Start one role, and start it again after any exit but 0 and 2 (a config error), at most
    ``restarts`` times; ``codes`` lists its exit codes, ``proc`` is the running process."""

    def __init__(self, cmd: list[str], env: dict, log: Path, restarts: int):
        self.cmd, self.env, self.log, self.restarts = cmd, env, log, restarts
        self.codes: list[int] = []
        self.proc: subprocess.Popen | None = None
        self.stopped = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            with self.lock, open(self.log, "a") as log:
                if self.stopped:
                    return
                log.write(f"=== start {len(self.codes)} at {time.time():.3f}\n")
                log.flush()
                self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
                                             stderr=log, start_new_session=True)
            self.codes.append(self.proc.wait())
            if self.codes[-1] in (0, 2) or len(self.codes) > self.restarts:
                return
            time.sleep(0.2)                  # a scheduler's back-off, short

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def kill(self) -> bool:
        """SIGKILL the running process's group; False when none runs."""
        with self.lock:
            p = self.proc
            if p is None or p.poll() is not None:
                return False
            os.killpg(p.pid, signal.SIGKILL)
            return True

    def stop(self) -> None:
        self.stopped = True
        self.kill()
        self.thread.join(30)


def soak(work: Path, seed: int, faults: int, epochs: int, timeout_s: float, extra: tuple[str, ...] = (),
         shows_expected: float | None = None) -> dict:
    """One soak; ``shows_expected``: the show count of an uninterrupted run of the same setting (None:
    every training example of every epoch, which async trains; sync drops each shard's last partial
    batch, so its expected count comes from a reference run, ``faults`` 0)."""
    rng = np.random.default_rng(seed)
    sets = ("mode=async", "cluster.workers=2", "model.blas_threads=1", f"model.epochs={epochs}",
            "cluster.stop_servers_at_end=true")
    if not (work / "run-full" / "config.yaml").exists():
        run(args(work, "full", *sets))          # the resolved config, its data converted to Arrow
    tag = f"soak{seed}"
    ports = free_ports(2)
    env = {**role_env(ports, workers=2), "ENGINE_FAILPOINTS": "worker.after_step=sleep:0.05"}
    logs = work / tag
    logs.mkdir(exist_ok=True)
    result = logs / "result.json"
    # the resolved config of the first soak in ``work`` holds its epochs: this soak's are set again,
    # with the --set values of this run (e.g. mode=sync)
    epochs_set = tuple(a for kv in (f"model.epochs={epochs}", *extra) for a in ("--set", kv))
    servers = [RoleScheduler(role_cmd(work, tag, "server", r, "--port", str(ports[r]), "--resume", *epochs_set),
                             env, logs / f"server-{r}.log", faults + 3) for r in range(2)]
    workers = [RoleScheduler(role_cmd(work, tag, "worker", r, *(("--result-file", str(result)) if r == 0 else ()),
                                      *epochs_set), env, logs / f"worker-{r}.log", faults + 3) for r in range(2)]
    roles = [("server", r, s) for r, s in enumerate(servers)] + [("worker", r, w) for r, w in enumerate(workers)]
    injected: list[dict] = []
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    try:
        while (len(injected) < faults and time.monotonic() < deadline and not all(w.done for w in workers)
               and not any(w.done and w.codes[-1] != 0 for w in workers)):
            time.sleep(float(rng.uniform(1.0, 6.0)))
            role, rank, sched = roles[int(rng.integers(0, len(roles)))]
            if sched.kill():
                injected.append({"role": role, "rank": rank, "at_s": round(time.monotonic() - t0, 1)})
        while time.monotonic() < deadline and not all(w.done for w in workers):
            if any(w.done and w.codes[-1] != 0 for w in workers):     # a worker its scheduler gave up on
                break
            time.sleep(0.2)
        finished = all(w.done for w in workers)
    finally:
        for s in workers + servers:
            s.stop()
    out = {"bench": "role_chaos_soak", "sets": list(extra), "seed": seed, "faults": len(injected), "injected": injected,
           "epochs": epochs, "elapsed_s": round(time.monotonic() - t0, 1), "finished": finished,
           "worker_codes": [w.codes for w in workers], "server_codes": [s.codes for s in servers]}
    text = {p.name: p.read_text(errors="replace") for p in logs.glob("*.log")}
    out["rollbacks"] = sum(t.count("rolling every server back to") for t in text.values())
    out["fences"] = sum(t.count(" server(s): the running workers exit") for t in text.values())
    out["tracebacks"] = {n: t.count("Traceback") for n, t in text.items() if "Traceback" in t}
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
            print(json.dumps(soak(work, seed, a.faults, a.epochs, a.timeout_s, tuple(a.sets), expected)), flush=True)


if __name__ == "__main__":
    main()
