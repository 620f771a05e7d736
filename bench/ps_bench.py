"""Parameter-server benchmark. Prints one JSON object per measurement, each with a ``bench`` field.

1. ``pull`` / ``push``: 1 server process, 2 client processes, dim 16, batches of 100k unique keys
   (table pre-filled with ``--rows`` keys, adagrad). ``keys_per_s`` is the aggregate of both clients;
   ``ratio_vs_in_process`` compares it with the same operations on the same table in one process
   (one SparseTable with the server's config, 2 threads calling it, no RPC). The machine may be
   shared, so the two are measured alternately ``--repeats`` times (the clients wait at a barrier
   while the in-process run goes) and each side reports its best repeat; ``ratio_median`` is the
   median of the per-repeat ratios.
2. ``pull_latency``: 2 server processes, one client, p50 / p99 milliseconds of a CTR-sized pull
   (26 slots x 512 rows = 13,312 keys drawn from the filled key space).

    python bench/ps_bench.py [--rounds 20] [--rows 1000000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

DIM = 16
BATCH = 100_000
TABLE = {"dim": DIM, "optimizer": "adagrad", "learning_rate": 0.05, "initializer": "uniform"}


def cluster_config(servers: int):
    from engine.config import from_dict
    return from_dict({"cluster": {"servers": servers, "workers": 2}, "tables": {"sparse": {"emb": TABLE}}})


def batches(rows: int, rounds: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.choice(rows, BATCH, replace=False).astype(np.uint64) for _ in range(rounds)]


def fill(push, rows: int) -> None:
    keys = np.arange(rows, dtype=np.uint64)
    for s in range(0, rows, 200_000):
        k = keys[s:s + 200_000]
        push(k, np.full((len(k), DIM), 0.01, np.float32))


def client_main(args) -> None:
    """One client process: per repeat and operation, wait at a barrier (with the other client and the
    bench process), time its batches, and meet again when done."""
    from engine.ps import PSClient
    c = PSClient(args.endpoints.split(","), name=f"bench{args.rank}")
    data = batches(args.rows, args.rounds, seed=100 + args.rank)
    grads = np.full((BATCH, DIM), 0.001, np.float32)
    c.pull("emb", data[0])                                   # warm-up
    c.push("emb", data[0][:1000], grads[:1000])
    out = []
    for rep in range(args.repeats):
        times = {}
        for op in ("pull", "push"):
            c.barrier(f"bench-{rep}-{op}", 3, timeout=600)
            t0 = time.perf_counter()
            for keys in data:
                c.pull("emb", keys) if op == "pull" else c.push("emb", keys, grads)
            times[op] = (t0, time.perf_counter())
            c.barrier(f"bench-{rep}-{op}-done", 3, timeout=600)
        out.append(times)
    c.close()
    print(json.dumps(out))


class InProcess:
    """The reference: one SparseTable with the server's table config, 2 threads, no RPC."""

    def __init__(self, rows: int, rounds: int):
        from sparse_tables import SparseTable, TableConfig
        self.t = SparseTable(TableConfig(**TABLE))
        fill(self.t.push, rows)
        self.data = [batches(rows, rounds, seed=100 + r) for r in range(2)]
        self.grads = np.full((BATCH, DIM), 0.001, np.float32)
        self.run("pull")                                     # warm-up (JIT, caches)

    def run(self, op: str) -> float:
        t, grads = self.t, self.grads

        def work(r):
            for keys in self.data[r]:
                t.pull(keys) if op == "pull" else t.push(keys, grads)
        threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return sum(len(d) for d in self.data) * BATCH / (time.perf_counter() - t0)


def throughput(args) -> None:
    from engine.launcher import LocalCluster
    from engine.ps import PSClient
    ref = InProcess(args.rows, args.rounds)
    with LocalCluster(cluster_config(1), tempfile.mkdtemp(prefix="ps-bench-")) as cl:
        eps = cl.start_servers()
        with PSClient(eps) as c:
            fill(lambda k, g: c.push("emb", k, g), args.rows)
            procs = [subprocess.Popen([sys.executable, __file__, "--client", "--rank", str(r), "--endpoints",
                                       ",".join(eps), "--rows", str(args.rows), "--rounds", str(args.rounds),
                                       "--repeats", str(args.repeats)],
                                      stdout=subprocess.PIPE, text=True) for r in range(2)]
            local = {"pull": [], "push": []}
            for rep in range(args.repeats):
                for op in ("pull", "push"):
                    local[op].append(ref.run(op))
                    c.barrier(f"bench-{rep}-{op}", 3, timeout=600)       # clients run now
                    c.barrier(f"bench-{rep}-{op}-done", 3, timeout=600)
            outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        cl.stop_servers()
    ref.t.close()
    for op in ("pull", "push"):
        remote = []
        for rep in range(args.repeats):
            start = min(o[rep][op][0] for o in outs)
            end = max(o[rep][op][1] for o in outs)
            remote.append(2 * args.rounds * BATCH / (end - start))
        kps, ip = max(remote), max(local[op])
        print(json.dumps({"bench": op, "servers": 1, "clients": 2, "dim": DIM, "batch_keys": BATCH,
                          "rounds_per_client": args.rounds, "repeats": args.repeats, "keys_per_s": round(kps),
                          "in_process_keys_per_s": round(ip), "ratio_vs_in_process": round(kps / ip, 3),
                          "ratio_median": round(float(np.median(np.array(remote) / np.array(local[op]))), 3)}),
              flush=True)


def latency(args) -> None:
    from engine.launcher import LocalCluster
    from engine.ps import PSClient
    with LocalCluster(cluster_config(2), tempfile.mkdtemp(prefix="ps-bench-")) as cl:
        eps = cl.start_servers()
        with PSClient(eps) as c:
            fill(lambda k, g: c.push("emb", k, g), args.rows)
            rng = np.random.default_rng(7)
            samples = []
            for i in range(args.latency_pulls + 20):
                keys = rng.integers(0, args.rows, 26 * 512).astype(np.uint64)
                t0 = time.perf_counter()
                c.pull("emb", keys, init_missing=True)
                if i >= 20:
                    samples.append((time.perf_counter() - t0) * 1e3)
        cl.stop_servers()
    s = np.array(samples)
    print(json.dumps({"bench": "pull_latency", "servers": 2, "keys": 26 * 512, "dim": DIM,
                      "pulls": len(s), "p50_ms": round(float(np.percentile(s, 50)), 3),
                      "p99_ms": round(float(np.percentile(s, 99)), 3)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20, help="100k-key batches per client and operation")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the table")
    ap.add_argument("--latency-pulls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3, help="alternating gRPC / in-process measurements")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.client:
        client_main(args)
        return
    throughput(args)
    latency(args)


if __name__ == "__main__":
    main()
