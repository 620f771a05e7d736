"""CTR training throughput through the parameter servers vs the MLP's own matrix-product roofline.

A generated Criteo-shaped data set (Zipf-distributed categorical values over the Criteo vocabulary sizes
capped at 1M per slot, 26 slots, 13 dense features, labels from a planted logistic model) of 1.25M rows
is split canonically (row i is test when ``i % 5 == 4``) into 1M train rows and 250k held-out test rows
and converted to Arrow once. ``engine train`` then runs one epoch over the train rows with 1 server + 2
workers (real processes, gRPC on loopback), batch 512, embedding dim 10, and reports ``examples_per_s``
from its final line (training examples of both workers / the longest worker's training time; reading,
dedup, pull, compute and push included, evaluation excluded) and the held-out ``test_auc`` and
``test_logloss``. In the same run, ``roofline_examples_per_s`` times the same MLP's forward + backward
matrix products alone (numpy, same batch, no data, no PS) and ``ratio_vs_roofline`` divides the two.

Measurements (one JSON object per line, each with a ``bench`` field): ``ctr_dnn_async``,
``deepfm_async`` and ``ctr_dnn_geo`` run the configs for data of this size, ``configs/ctr_bigdata.yaml``
and ``configs/deepfm_bigdata.yaml``: Paddle's async semantics, the dense gradients of 4 steps averaged and
sent once (``model.dense_merge_steps: 4``) and a step that does not wait for its own push
(``model.pipeline: stale``). The stricter settings are measured beside them: ``ctr_dnn_async_exact``
(merged steps, but step t+1 waits for t's push, ``model.pipeline: exact``), and the configs for the 16k
shared Criteo rows, where every update counts: ``ctr_dnn_async_shared_config`` (``configs/ctr.yaml``:
exact, a dense step after every batch) and ``deepfm_async_shared_config`` (``configs/deepfm.yaml``:
exact, merged by 4). Besides batch size, dim, one epoch, the data and the cluster size, the bench only turns
off shuffling (the generated rows are in random order), per-epoch evaluation and checkpoints.
``ctr_dnn_hybrid`` and ``deepfm_hybrid`` run the same configs in ``mode: hybrid`` (``engine.modes.hybrid``:
sparse rows through the servers, the dense tower all-reduced among the workers over MPI every step, exact
pipeline, no merging) and add ``ratio_vs_async`` (examples/s over ``ctr_dnn_async``'s, resp.
``deepfm_async``'s, same run) and ``ratio_vs_exact`` (over ``ctr_dnn_async_shared_config``'s, resp.
``deepfm_async_shared_config``'s) when those rows ran before them, and per rank the wall and CPU
milliseconds per step spent completing the all-reduce (``rankN_allreduce_ms_per_step``: the
test-and-yield loop's cost).
Every job's record carries ``cpu_cores_busy`` and ``cpu_ms_per_1k_examples`` (``TreeCPU``: the CPU of its
server, its workers and the rest, sampled with psutil over the middle 80% of training), and each hybrid
ratio a ``_cpu_bound`` twin: the ratio the hybrid job would reach if it kept every core busy at the CPU
per example it used (``cpu_bound``). On a machine whose cores a job saturates, that bounds what any
scheduling of the same work can reach.
Every ratio printed is measured in the run (``ratio_vs_roofline``), never against a remembered constant: the
22,000 examples/s quoted for Paddle 2.6.2's parameter server since 2026-11-21 was never measured by this
repository (no script, log or run produced it), so no record carries it.

Run as root (test hosts from network namespaces, ``bench/ctr_hosts.py``), ``ctr_dnn_async_hosts`` runs
``ctr_dnn_async`` with its server and two workers on three test hosts, mutual TLS and tokens on, right after
the same job on loopback, and reports ``ratio_vs_loopback`` (examples/s across hosts / on loopback).

``ctr_dnn_async_ray`` runs ``ctr_dnn_async`` under the Ray launcher (``--launcher ray``, a local one-node
Ray started by the job) right after the same job under the local launcher, both plaintext on loopback,
and reports ``ratio_vs_local`` (examples/s) and ``startup_s`` of both (command start to the first
training step: Ray's start, the actors, the servers' and workers' start-up and warm-up).

    python bench/ctr_bench.py [--rows N] [--quick] [--only ctr_dnn_async,...] [--work DIR] [--set K=V]
    python bench/ctr_bench.py --observability --only ctr_dnn_async [--repeats 5]   # the overhead of metrics
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.programs.ctr_data import DataConfig, expected_schema, prepare_data  # noqa: E402
from streaming.criteo import SPARSE_COLUMNS as SLOTS, generate_criteo  # noqa: E402

RUNS = {   # name: (config, model, mode, extra overrides)
    "ctr_dnn_async": ("configs/ctr_bigdata.yaml", "ctr_dnn", "async", ()),
    "deepfm_async": ("configs/deepfm_bigdata.yaml", "deepfm", "async", ()),
    "ctr_dnn_geo": ("configs/ctr_bigdata.yaml", "ctr_dnn", "geo", ()),
    "ctr_dnn_async_exact": ("configs/ctr_bigdata.yaml", "ctr_dnn", "async", ("model.pipeline=exact",)),
    "ctr_dnn_async_shared_config": ("configs/ctr.yaml", "ctr_dnn", "async", ()),
    "deepfm_async_shared_config": ("configs/deepfm.yaml", "deepfm", "async", ()),
    # mode hybrid: the dense tower all-reduced among the workers every step (no staleness, no merging)
    "ctr_dnn_hybrid": ("configs/ctr_bigdata.yaml", "ctr_dnn", "hybrid", ("model.pipeline=exact",
                                                                         "model.dense_merge_steps=1")),
    "deepfm_hybrid": ("configs/deepfm_bigdata.yaml", "deepfm", "hybrid", ("model.pipeline=exact",
                                                                          "model.dense_merge_steps=1")),
    # the same with the sparse round trips pipelined as in the async headline (two in flight: a step sees
    # this worker's own sparse updates one step later); the dense step is still all-reduced every step
    "ctr_dnn_hybrid_stale": ("configs/ctr_bigdata.yaml", "ctr_dnn", "hybrid", ("model.pipeline=stale",
                                                                               "model.dense_merge_steps=1")),
    "deepfm_hybrid_stale": ("configs/deepfm_bigdata.yaml", "deepfm", "hybrid", ("model.pipeline=stale",
                                                                                "model.dense_merge_steps=1")),
}
#: hybrid rows: (the headline async row, the exact async row) they are divided by, when measured in the run
HYBRID_VS = {"ctr_dnn_hybrid": ("ctr_dnn_async", "ctr_dnn_async_shared_config"),
             "deepfm_hybrid": ("deepfm_async", "deepfm_async_shared_config"),
             "ctr_dnn_hybrid_stale": ("ctr_dnn_async", "ctr_dnn_async_shared_config"),
             "deepfm_hybrid_stale": ("deepfm_async", "deepfm_async_shared_config")}


def prepare(work: Path, rows: int, seed: int) -> tuple[Path, Path]:
    """Generate ``rows * 5 / 4`` rows once and convert them as ``engine train`` does (``prepare_data``:
    the canonical split, row i is test when ``i % 5 == 4``, reused while current): ``rows`` train rows
    and a held-out quarter as many test rows, both drawn from the same planted model. Returns (train
    dir, test dir)."""
    work.mkdir(parents=True, exist_ok=True)
    total = rows * 5 // 4
    raw = work / f"criteo-{total}-seed{seed}.txt"
    if not raw.is_file():
        t = time.perf_counter()
        tmp = raw.with_suffix(".tmp")
        generate_criteo(tmp, total, seed)
        os.replace(tmp, raw)
        print(f"# generated {total} rows in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    data = prepare_data(DataConfig(source="criteo", criteo_path=str(raw), cache_dir=str(work / "cache"),
                                   convert_batch_size=8192), expected_schema(SLOTS, 13))
    return Path(data.train_path), Path(data.test_path)


def roofline(kind: str, batch: int, dim: int = 10, hidden=(400, 400, 400), slots: int = 26, dense: int = 13,
             repeats: int = 30) -> float:
    """examples/s of the MLP's forward + backward matrix products alone (best of ``repeats`` steps; numpy's
    BLAS with its default threads, i.e. the whole machine). DeepFM's tower is the same MLP."""
    rng = np.random.default_rng(0)
    sizes = [slots * dim + dense, *hidden, 1]
    ws = [rng.standard_normal((a, b)).astype(np.float32) * 0.05 for a, b in zip(sizes[:-1], sizes[1:])]
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        hs = [x]
        for w in ws:
            hs.append(hs[-1] @ w)
        g = np.ones((batch, 1), np.float32)
        for i in range(len(ws) - 1, -1, -1):
            _ = hs[i].T @ g             # weight gradient
            g = g @ ws[i].T             # input gradient (the first one feeds the embedding scatter)
        best = min(best, time.perf_counter() - t)
    return batch / best


def run_sets(name: str, train: Path, test: Path, batch: int, work: Path) -> list[str]:
    """The ``engine train`` overrides of measurement ``name``."""
    config, kind, mode, own = RUNS[name]
    return [f"mode={mode}", "model.data.source=arrow", f"model.data.train_path={train}",
            f"model.data.test_path={test}", f"model.batch_size={batch}", "model.epochs=1",
            "model.dim=10", f"tables.sparse.embedding.dim={11 if kind == 'deepfm' else 10}",
            "model.eval_every_epoch=false", "model.log_every_s=10", "model.shuffle_buffer=0",
            f"model.metrics_dir={work / 'metrics'}", "checkpoint.root=", "cluster.servers=1", "cluster.workers=2", *own]


def run(name: str, train: Path, test: Path, batch: int, work: Path, roof_before: dict,
        extra: list[str] = (), cli: list[str] = ()) -> dict:
    config, kind, mode, own = RUNS[name]
    sets = [*run_sets(name, train, test, batch, work), *extra]
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / config), *cli] + [a for s in sets for a in ("--set", s)]
    t, started = time.perf_counter(), time.time()
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as popen:
        cpu = TreeCPU(popen.pid)
        stdout, stderr = popen.communicate()
        cpu.stop()
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{name}: engine train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    profile = {}
    for line in Path(final["metrics_file"]).read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") == "final" and final.get("train_started_at"):
            profile.update(cpu.busy(final["train_started_at"], ev["train_seconds"], final["examples_per_s"]))
        if ev.get("event") == "profile":
            steps = max(1, ev.get("steps", 0))
            profile[f"rank{ev['rank']}_ms_per_step"] = {k: round(1000 * v / steps, 2)
                                                        for k, v in ev["phase_seconds"].items()}
            if "allreduce" in ev:    # hybrid: completing the all-reduce (test-and-yield loop), per step
                a = ev["allreduce"]
                profile[f"rank{ev['rank']}_allreduce_ms_per_step"] = {
                    "wait": round(1000 * a["wait_s"] / steps, 3), "cpu": round(1000 * a["wait_cpu_s"] / steps, 3)}
            if "exchange" in ev:     # hybrid: sparse round trip, all-reduce wait beyond it, optimizer step
                profile[f"rank{ev['rank']}_exchange_ms_per_step"] = {
                    k.removesuffix("_s"): round(1000 * v / steps, 3) for k, v in ev["exchange"].items()}
    # the machine may be shared: the best of the measurements before the jobs and right after this one
    roof = max(roof_before[kind], roofline(kind, batch, repeats=100))
    out = record(name, final, roof, batch, wall, profile)
    if final.get("train_started_at"):       # command start to the first training step
        out["startup_s"] = round(final["train_started_at"] - started, 2)
    return out


class TreeCPU:
    """CPU seconds (user + system, psutil) of a job's process tree by role, sampled every ``period``
    seconds from the job's start: ``server`` (``--role server``), ``workers`` (``--role worker`` and the MPI
    ranks), ``other`` (the launcher, mpiexec and its proxies). A process that ends takes its CPU out of the
    sum, so only a window in which the tree is stable (training) is read: :meth:`busy`."""

    def __init__(self, pid: int, period: float = 0.25):
        import threading
        self.samples: list[tuple[float, dict[str, float]]] = []    # (wall clock s, {role: CPU s})
        self._pid, self._period, self._stop = pid, period, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _role(cmd: list[str]) -> str:
        if "--role" in cmd:
            return "server" if cmd[cmd.index("--role") + 1] == "server" else "workers"
        if not cmd or "mpiexec" in os.path.basename(cmd[0]) or "--tied-to" in cmd:
            return "other"              # mpiexec, and the shim that execs into it
        return "workers" if "engine.launch.mpi" in cmd else "other"

    def _run(self) -> None:
        import psutil
        procs: dict[int, tuple[psutil.Process, str]] = {}
        try:
            root = psutil.Process(self._pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.wait(self._period):
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            sums = {"server": 0.0, "workers": 0.0, "other": 0.0}
            for p in tree:
                try:
                    proc, role = procs.get(p.pid, (p, "other"))
                    if role == "other":          # new, or it may have exec'd into a role since last seen
                        role = self._role(proc.cmdline())
                        procs[p.pid] = (proc, role)
                    t = proc.cpu_times()
                    sums[role] += t.user + t.system
                except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, IndexError):
                    continue
            self.samples.append((time.time(), sums))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, started_at: float, train_s: float, examples_per_s: float) -> dict:
        """Cores busy per role over the middle 80% of training (``started_at``: wall clock s of the first
        step, ``train_s``: the longest worker's training seconds) and the CPU milliseconds per 1000
        training examples: ``cores_busy / examples_per_s * 1e6``; {} without two samples in the window."""
        lo, hi = started_at + 0.1 * train_s, started_at + 0.9 * train_s
        inside = [s for s in self.samples if lo <= s[0] <= hi]
        if len(inside) < 2:
            return {}
        (t0, a), (t1, b) = inside[0], inside[-1]
        cores = {role: (b[role] - a[role]) / (t1 - t0) for role in a}
        cores["total"] = sum(cores.values())
        return {"cpu_cores_busy": {k: round(v, 3) for k, v in cores.items()},
                "cpu_ms_per_1k_examples": {k: round(v / examples_per_s * 1e6, 2) for k, v in cores.items()}}


def ray_record(train: Path, test: Path, batch: int, work: Path, roof_before: dict, extra: list[str]) -> dict:
    """``ctr_dnn_async_ray``: the local launcher's job, then the same job under the Ray launcher."""
    local = run("ctr_dnn_async", train, test, batch, work, roof_before, extra)
    ray = run("ctr_dnn_async", train, test, batch, work, roof_before, [*extra, "cluster.launcher=ray"])
    ray.update(bench="ctr_dnn_async_ray", launcher="ray (a local one-node Ray started by the job)",
               local_examples_per_s=local["examples_per_s"], local_startup_s=local["startup_s"],
               local_test_auc=local["test_auc"],
               ratio_vs_local=round(ray["examples_per_s"] / local["examples_per_s"], 3))
    return ray


def hosts_record(train: Path, test: Path, batch: int, work: Path, roof_before: dict, extra: list[str]) -> dict:
    """``ctr_dnn_async_hosts``: the loopback job, then the same job across test hosts with TLS."""
    import ctr_hosts
    loop = run("ctr_dnn_async", train, test, batch, work, roof_before, extra)
    config, _, mode, own = RUNS["ctr_dnn_async"]
    final, wall = ctr_hosts.run_hosts(config, [*run_sets("ctr_dnn_async", train, test, batch, work), *extra],
                                      work / "hosts")
    out = record("ctr_dnn_async", final, loop["roofline_examples_per_s"], batch, wall)
    out.update(bench="ctr_dnn_async_hosts", hosts="1 server host + 2 worker hosts (network namespaces, veth)",
               tls="mutual TLS, bearer tokens", loopback_examples_per_s=loop["examples_per_s"],
               loopback_test_auc=loop["test_auc"],
               ratio_vs_loopback=round(final["examples_per_s"] / loop["examples_per_s"], 3))
    return out


def observability_record(name: str, train: Path, test: Path, batch: int, work: Path, roof_before: dict,
                         extra: list[str], repeats: int) -> dict:
    """``{name}_observability``: ``repeats`` runs each without (no Prometheus, no TensorBoard) and with
    everything on (every role's metrics endpoint scraped every second by this process, TensorBoard event
    files), alternating; the medians of examples/s and the loss in percent (target: <= 3)."""
    import statistics
    import threading
    import urllib.request

    def scraped(run_dir: Path, stop: threading.Event, count: list[int]) -> None:
        while not stop.wait(1.0):      # Prometheus scrapes every 15 s by default: this is 15x harsher
            for f in run_dir.glob("*.metrics"):
                try:
                    with urllib.request.urlopen(f.read_text().strip(), timeout=5) as r:
                        r.read()
                    count[0] += 1
                except OSError:
                    pass

    eps: dict[str, list[float]] = {"off": [], "on": []}
    scrapes = 0
    for i in range(repeats):
        for state in ("off", "on"):
            if state == "off":
                out = run(name, train, test, batch, work, roof_before, [*extra, "observability.tensorboard=false"])
            else:
                run_dir = work / f"obs-run-{i}"
                stop, count = threading.Event(), [0]
                t = threading.Thread(target=scraped, args=(run_dir, stop, count), daemon=True)
                t.start()
                try:
                    out = run(name, train, test, batch, work, roof_before,
                              [*extra, "observability.prometheus_port=0", "observability.tensorboard=true",
                               f"observability.tensorboard_dir={work / 'tensorboard'}"], ["--run-dir", str(run_dir)])
                finally:
                    stop.set()
                    t.join()
                scrapes += count[0]
            eps[state].append(out["examples_per_s"])
            print(json.dumps({"bench": f"{name}_observability_{state}", "run": i,
                              "examples_per_s": out["examples_per_s"]}), file=sys.stderr, flush=True)
    off, on = statistics.median(eps["off"]), statistics.median(eps["on"])
    return {"bench": f"{name}_observability", "repeats": repeats, "median_examples_per_s_off": round(off, 1),
            "median_examples_per_s_on": round(on, 1), "loss_pct": round(100 * (off - on) / off, 2),
            "examples_per_s_off": [round(x, 1) for x in eps["off"]],
            "examples_per_s_on": [round(x, 1) for x in eps["on"]], "scrapes": scrapes}


def record(name: str, final: dict, roof: float, batch: int, wall: float, profile: dict | None = None) -> dict:
    """The JSON record of one measurement from ``engine train``'s final line (``examples_per_s``,
    ``test_auc``, ``test_logloss``) and the roofline measured in the same run (examples/s)."""
    _, kind, mode, own = RUNS[name]
    return {"bench": name, "model": kind, "mode": mode, "servers": 1, "workers": 2, "batch_size": batch,
            "dim": 10,
            "examples_per_s": round(final["examples_per_s"], 1), "roofline_examples_per_s": round(roof, 1),
            "ratio_vs_roofline": round(final["examples_per_s"] / roof, 3),
            "test_auc": final.get("test_auc"), "test_logloss": final.get("test_logloss"),
            "job_wall_s": round(wall, 1),
            **({"overrides": list(own)} if own else {}), **(profile or {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="train rows (a quarter as many more are held out)")
    ap.add_argument("--quick", action="store_true", help="a tenth of the rows")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated measurement names")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure the whole list this many times, then print the medians (ctr_bench_medians)")
    ap.add_argument("--work", default=str(REPO / "runs" / "bench"), help="data cache (git-ignored)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra engine train overrides (e.g. model.pipeline=false), repeatable")
    ap.add_argument("--observability", action="store_true",
                    help="each measurement: --repeats runs without and with Prometheus (scraped every second) "
                         "and TensorBoard, alternating; prints the medians and the loss in percent")
    ap.add_argument("--repeats", type=int, default=5, help="with --observability: runs per state")
    args = ap.parse_args(argv)
    rows = args.rows // 10 if args.quick else args.rows
    work = Path(args.work)
    train, test = prepare(work, rows, args.seed)
    import ctr_hosts
    hosts_ok, why = ctr_hosts.available()
    default = list(RUNS) + ["ctr_dnn_async_ray"] + (["ctr_dnn_async_hosts"] if hosts_ok else [])
    if not hosts_ok:
        print(f"# ctr_dnn_async_hosts skipped: {why}", file=sys.stderr)
    names = [n for n in (args.only.split(",") if args.only else default) if n]
    roof_before = {kind: roofline(kind, args.batch_size, repeats=100) for kind in ("ctr_dnn", "deepfm")}
    rounds: list[dict[str, dict]] = []
    for _ in range(max(1, args.rounds)):        # every round measures the whole list, in order
        rounds.append(measure(args, names, train, test, rows, work, roof_before))
    if args.rounds > 1:
        print(json.dumps(medians(rounds)), flush=True)
    return 0


def medians(rounds: list[dict[str, dict]]) -> dict:
    """``ctr_bench_medians``: per measurement, the median over the rounds of examples/s, of the ratios
    (each computed within its own round) and of the held-out AUC."""
    out = {"bench": "ctr_bench_medians", "rounds": len(rounds)}
    for name in rounds[0]:
        recs = [r[name] for r in rounds if name in r]
        out[name] = {k: round(float(np.median([r[k] for r in recs])), 4) for k in
                     ("examples_per_s", "ratio_vs_roofline", "ratio_vs_async", "ratio_vs_exact", "test_auc",
                      "ratio_vs_async_cpu_bound", "ratio_vs_exact_cpu_bound")
                     if all(k in r for r in recs)}
        if all("cpu_ms_per_1k_examples" in r for r in recs):     # the whole job's CPU per 1000 examples
            out[name]["cpu_ms_per_1k_examples"] = round(float(np.median(
                [r["cpu_ms_per_1k_examples"]["total"] for r in recs])), 2)
            out[name]["cpu_cores_busy"] = round(float(np.median([r["cpu_cores_busy"]["total"] for r in recs])), 3)
    return out


def cpu_bound(hybrid: dict, other: dict) -> float:
    """The ratio over ``other``'s examples/s that ``hybrid`` would reach if its processes kept every core of
    this machine busy at the CPU per example they used: cores / (CPU seconds per example) / other's
    examples/s. It is a ceiling on the ratio that no scheduling of the same work can pass on this machine
    (the test-and-yield loop's CPU counts as work here)."""
    cores = len(os.sched_getaffinity(0))
    best = cores / (hybrid["cpu_ms_per_1k_examples"]["total"] / 1e6)
    return round(best / other["examples_per_s"], 3)


def measure(args, names, train, test, rows, work, roof_before) -> dict[str, dict]:
    """One round: every measurement of ``names`` in order, each record printed as it ends."""
    measured: dict[str, dict] = {}
    for name in names:
        if name not in RUNS and name not in ("ctr_dnn_async_hosts", "ctr_dnn_async_ray"):
            raise SystemExit(f"--only: unknown measurement {name!r}; known: {sorted(RUNS)} + "
                             f"ctr_dnn_async_hosts, ctr_dnn_async_ray")
        if args.observability:
            if name not in RUNS:
                raise SystemExit(f"--observability: measure one of {sorted(RUNS)}, not {name!r}")
            out = observability_record(name, train, test, args.batch_size, work, roof_before, args.set, args.repeats)
        elif name == "ctr_dnn_async_ray":
            out = ray_record(train, test, args.batch_size, work, roof_before, args.set)
        elif name == "ctr_dnn_async_hosts":
            out = hosts_record(train, test, args.batch_size, work, roof_before, args.set)
        else:
            out = run(name, train, test, args.batch_size, work, roof_before, args.set)
        out["rows"] = rows
        measured[name] = out
        for key, other in zip(("ratio_vs_async", "ratio_vs_exact"), HYBRID_VS.get(name, ())):
            if other in measured:
                out[key] = round(out["examples_per_s"] / measured[other]["examples_per_s"], 3)
                if "cpu_ms_per_1k_examples" in out:
                    out[key + "_cpu_bound"] = cpu_bound(out, measured[other])
        if args.set:
            out["set"] = args.set
        print(json.dumps(out), flush=True)
    return measured


if __name__ == "__main__":
    sys.exit(main())
