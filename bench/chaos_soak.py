"""Chaos soak (issue 16), outside CI: CTR-DNN on the shared Criteo rows (``configs/ctr.yaml``), 1 server
(or ``--set cluster.servers=N``: a random one is faulted) + 2 workers, checkpoints every 16 steps, and
``--kills`` faults of a random role at random moments (one per attempt: a server or a worker once it
trained a random number of steps, or a server inside a checkpoint write held open by the failpoint
``checkpoint.before_publish``; with ``--early`` also 0-3 s after it started, inside its restore or
warm-up). A fault is kill -9, or with ``--stop-share F`` for that share of them SIGSTOP (a hung role,
which the launcher must find within ``client.dead_after_s``, ``--dead-after-s`` here, and kill). The job
must finish by itself with ``restarts`` equal to the faults injected; its held-out AUC is printed beside
the AUC of an uninterrupted run of the same config measured in the same session.

Prints JSON lines with a ``bench`` field (``machine``, ``reference``, ``chaos_soak``)::

    python bench/chaos_soak.py [--kills 8] [--stop-share 0.25] [--early] [--epochs 6] [--seed 0] [--set KEY=VALUE ...]

``--set`` goes to both jobs (the reference and the soak), e.g. ``--set mode=hybrid`` or a spilling table
(``--set tables.sparse.embedding.spill_path=...``, where a path under the soak's temporary directory is
written ``{work}/spill`` and filled in per job).
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

from engine import progress  # noqa: E402
from engine.launch.procs import processes_of, role_pid  # noqa: E402


def job(work: Path, tag: str, epochs: int, kills: int, sets: tuple[str, ...] = ()) -> list[str]:
    extra = [a for kv in sets for a in ("--set", kv.replace("{work}", str(work / ("files-" + tag))))]
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(work / tag),
            "--set", f"checkpoint.root={work / ('ckpt-' + tag)}", "--set", "checkpoint.align_steps=16",
            "--set", "checkpoint.delta_every=16steps", "--set", f"model.epochs={epochs}",
            "--set", f"model.metrics_dir={work / 'metrics'}", "--set", f"cluster.max_restarts={kills}", *extra]


def wait_report(path: Path, ok, deadline: float) -> bool:
    while time.monotonic() < deadline:
        r = progress.read(path)
        if r is not None and ok(r):
            return True
        time.sleep(0.02)
    return False


def soak(work: Path, epochs: int, kills: int, seed: int, timeout_s: float, sets: tuple[str, ...] = (),
         stop_share: float = 0.0, dead_after_s: float = 5.0, early: bool = False) -> dict:
    servers = next((int(kv.split("=", 1)[1]) for kv in sets if kv.startswith("cluster.servers=")), 1)
    rng = np.random.default_rng(seed)
    if stop_share > 0:
        sets = (*sets, f"client.dead_after_s={dead_after_s}")
    env = {**os.environ, "ENGINE_FAILPOINTS": "checkpoint.before_publish=sleep:0.6"}
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    # the launcher's log goes to files: a pipe read only at the end would fill and block a long soak
    with open(work / "soak.out", "w") as out_f, open(work / "soak.err", "w") as err_f:
        proc = subprocess.Popen(job(work, "soak", epochs, kills, sets), cwd=REPO, stdout=out_f, stderr=err_f,
                                text=True, env=env, start_new_session=True)
    done = []
    try:
        for attempt in range(kills):
            d = work / "soak" if attempt == 0 else work / "soak" / f"restart-{attempt}"
            report = d / "worker-0.progress.json"
            how = rng.choice(["step", "step", "checkpoint", "start"] if early else ["step", "step", "checkpoint"])
            role, rank = (("server", int(rng.integers(0, servers))) if how == "checkpoint" or rng.random() < 0.5
                          else ("worker", int(rng.integers(0, 2))))
            if how == "start":            # while the attempt starts: a restore, the warm-up, the first steps
                at = -1
                role_pid(d, role, rank, 60)
                time.sleep(float(rng.uniform(0.0, 3.0)))
                hit = proc.poll() is None
            elif how == "step":
                at = int(rng.integers(5, 60))
                hit = wait_report(report, lambda r: r["step"] >= at, deadline)
            else:
                at = -1
                hit = wait_report(report, lambda r: (r.get("phase") or {}).get("name", "").startswith("checkpoint"),
                                  deadline)
            if not hit:
                break
            sig = signal.SIGSTOP if rng.random() < stop_share else signal.SIGKILL
            os.kill(role_pid(d, role, rank, 30), sig)
            done.append({"attempt": attempt, "signal": sig.name, "role": f"{role} {rank}", "when": how, "step": at})
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    out, err = (work / "soak.out").read_text(), (work / "soak.err").read_text()
    final = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else {}
    return {"bench": "chaos_soak", "sets": list(sets), "exit": proc.returncode,
            "kills": sum(d["signal"] == "SIGKILL" for d in done), "stops": sum(d["signal"] == "SIGSTOP" for d in done),
            "restarts": final.get("restarts"),
            "examples_replayed": final.get("examples_replayed"), "test_auc": final.get("test_auc"),
            "wall_s": round(time.monotonic() - t0, 1), "kill_plan": done,
            "left_over_processes": len(processes_of(work / "soak")),
            **({} if proc.returncode == 0 else {"stderr_tail": err[-2000:]})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=8, help="faults injected, one per attempt (SIGKILL, or SIGSTOP)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--stop-share", type=float, default=0.0, help="share of the faults that are SIGSTOP (hangs)")
    ap.add_argument("--early", action="store_true",
                    help="also fault roles 0-3 s after they start (inside a restore, the warm-up, the first steps)")
    ap.add_argument("--dead-after-s", type=float, default=5.0, help="client.dead_after_s of the soak when it stops roles")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for both jobs ({work}: a directory of the job's own)")
    a = ap.parse_args()
    sets = tuple(a.sets)
    print(json.dumps({"bench": "machine", "os_cpu_count": os.cpu_count(),
                      "sched_getaffinity_cpus": len(os.sched_getaffinity(0))}), flush=True)
    with tempfile.TemporaryDirectory(prefix="chaos-soak-") as tmp:
        work = Path(tmp)
        ref = subprocess.run(job(work, "reference", a.epochs, 0, sets), cwd=REPO, capture_output=True, text=True,
                             timeout=a.timeout_s)
        ref_final = json.loads(ref.stdout.strip().splitlines()[-1]) if ref.returncode == 0 else {}
        print(json.dumps({"bench": "reference", "sets": list(sets), "exit": ref.returncode, "test_auc": ref_final.get("test_auc"),
                          **({} if ref.returncode == 0 else {"stderr_tail": ref.stderr[-2000:]})}),
              flush=True)
        res = soak(work, a.epochs, a.kills, a.seed, a.timeout_s, sets, a.stop_share, a.dead_after_s, a.early)
        res["reference_test_auc"] = ref_final.get("test_auc")
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
