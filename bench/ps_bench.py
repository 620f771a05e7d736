"""Parameter-server benchmark. Prints one JSON object per measurement, each with a ``bench`` field.

1. ``pull`` / ``push``: 1 server process, 2 client processes, dim 16, batches of 100k unique keys
   (table pre-filled with ``--rows`` keys, adagrad). ``keys_per_s`` is the aggregate of both clients;
   ``ratio_vs_in_process`` compares it with the same operations on the same table in one process
   (one SparseTable with the server's config, 2 threads calling it, no RPC).
2. ``pull_latency``: 2 server processes, one client, p50 / p99 milliseconds of a CTR-sized pull
   (26 slots x 512 rows = 13,312 keys drawn from the filled key space).

    python bench/ps_bench.py [--rounds 20] [--rows 1000000]
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
    """One client process: wait for the other at a barrier, then time pulls and pushes."""
    from engine.ps import PSClient
    c = PSClient(args.endpoints.split(","), name=f"bench{args.rank}")
    data = batches(args.rows, args.rounds, seed=100 + args.rank)
    grads = np.full((BATCH, DIM), 0.001, np.float32)
    c.pull("emb", data[0])                                   # warm-up
    out = {}
    for op in ("pull", "push"):
        c.barrier(f"bench-{op}", 2, timeout=120)
        t0 = time.perf_counter()
        for keys in data:
            c.pull("emb", keys) if op == "pull" else c.push("emb", keys, grads)
        out[op] = (t0, time.perf_counter())
    c.close()
    print(json.dumps(out))


def in_process(rows: int, rounds: int) -> dict:
    from sparse_tables import SparseTable, TableConfig
    t = SparseTable(TableConfig(**TABLE))
    fill(t.push, rows)
    data = [batches(rows, rounds, seed=100 + r) for r in range(2)]
    grads = np.full((BATCH, DIM), 0.001, np.float32)
    res = {}
    for op in ("pull", "push"):
        def run(r):
            for keys in data[r]:
                t.pull(keys) if op == "pull" else t.push(keys, grads)
        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        res[op] = 2 * rounds * BATCH / (time.perf_counter() - t0)
    t.close()
    return res


def throughput(args) -> None:
    from engine.launcher import LocalCluster
    from engine.ps import PSClient
    ref = in_process(args.rows, args.rounds)
    with LocalCluster(cluster_config(1), tempfile.mkdtemp(prefix="ps-bench-")) as cl:
        eps = cl.start_servers()
        with PSClient(eps) as c:
            fill(lambda k, g: c.push("emb", k, g), args.rows)
        procs = [subprocess.Popen([sys.executable, __file__, "--client", "--rank", str(r), "--endpoints",
                                   ",".join(eps), "--rows", str(args.rows), "--rounds", str(args.rounds)],
                                  stdout=subprocess.PIPE, text=True) for r in range(2)]
        outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        cl.stop_servers()
    for op in ("pull", "push"):
        start = min(o[op][0] for o in outs)
        end = max(o[op][1] for o in outs)
        kps = 2 * args.rounds * BATCH / (end - start)
        print(json.dumps({"bench": op, "servers": 1, "clients": 2, "dim": DIM, "batch_keys": BATCH,
                          "rounds_per_client": args.rounds, "keys_per_s": round(kps),
                          "in_process_keys_per_s": round(ref[op]),
                          "ratio_vs_in_process": round(kps / ref[op], 3)}), flush=True)


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
