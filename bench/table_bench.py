"""Sparse-table benchmark: one JSON object per measurement on stdout, each with a ``bench`` field.

    pull           10M rows of dim 16 in RAM, pulls of 100k random existing keys: keys_per_s and
                   ratio_vs_numpy_gather (ours / ``arena[row_ids]`` on a plain float32[10M, 16] array)
    push           the same table, Adagrad pushes of 100k random existing keys on one thread: keys_per_s
    spill          20M distinct keys drawn Zipf(1.05), pushes of 100k keys, memory_rows = 2M:
                   keys_per_s, ratio_vs_in_memory (same draws, memory_rows large enough for all),
                   peak_rss_bytes and the target limit 2 x (2M x row bytes) + 1 GB
    bytes_per_row  RAM per row beyond its value and optimizer floats, measured as RSS growth while
                   inserting 10M rows (and the table's own accounting, for comparison)

Each measurement runs in a fresh subprocess so its peak RSS is its own. ``--quick`` divides sizes by 10.
Usage: python bench/table_bench.py [--quick] [--only pull,push,spill,bytes_per_row]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

BATCH = 100_000
DIM = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def random_keys(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**64 - 1, n, dtype=np.uint64)


def fill(table, keys: np.ndarray, chunk: int = 1_000_000) -> None:
    for s in range(0, len(keys), chunk):
        k = keys[s:s + chunk]
        table.push_delta(k, np.zeros((len(k), table.layout.dim), np.float32))


def best_rate(fn, n_keys: int, repeats: int) -> float:
    fn()  # warm-up (JIT, caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # the best of the repeats (timeit's convention): on a shared machine interference only adds time
    return n_keys / float(np.min(times))


def bench_pull_push(scale: int) -> list[dict]:
    from sparse_tables import SparseTable, TableConfig

    n_rows = 10_000_000 // scale
    keys = random_keys(n_rows, 1)
    table = SparseTable(TableConfig(dim=DIM, optimizer="adagrad", num_threads=os.cpu_count() or 2),
                        initial_rows=n_rows)
    fill(table, keys)
    rng = np.random.default_rng(2)
    batches = [keys[rng.integers(0, n_rows, BATCH)] for _ in range(8)]
    it = iter(range(10**9))

    def pull():
        table.pull(batches[next(it) % len(batches)])

    ours = best_rate(pull, BATCH, 20)
    threads = table.config.num_threads
    config = table.config
    table.config = dataclasses.replace(config, num_threads=1)  # same rows, calling thread only
    ours_1 = best_rate(pull, BATCH, 20)
    table.config = config
    arena = np.random.default_rng(3).random((n_rows, DIM), dtype=np.float32)
    row_ids = [rng.integers(0, n_rows, BATCH) for _ in range(8)]

    def gather():
        arena[row_ids[next(it) % len(row_ids)]]

    ref = best_rate(gather, BATCH, 20)
    del arena
    table.config  # keep the table alive for push
    grads = np.random.default_rng(4).standard_normal((BATCH, DIM)).astype(np.float32) * 0.01
    unique_batches = [np.unique(b) for b in batches]

    def push():
        b = unique_batches[next(it) % len(unique_batches)]
        table.push(b, grads[:len(b)])

    push_rate = best_rate(push, int(np.mean([len(b) for b in unique_batches])), 20)
    return [
        {"bench": "pull", "rows": n_rows, "dim": DIM, "batch": BATCH, "keys_per_s": round(ours),
         "numpy_gather_keys_per_s": round(ref), "ratio_vs_numpy_gather": round(ours / ref, 3),
         "threads": threads, "keys_per_s_1_thread": round(ours_1),
         "thread_speedup": round(ours / ours_1, 3), "target_ratio": 1.0},
        {"bench": "push", "rows": n_rows, "dim": DIM, "batch": BATCH, "optimizer": "adagrad",
         "threads": 1, "keys_per_s": round(push_rate), "target_keys_per_s": 5_000_000},
    ]


def zipf_ranks(n: int, universe: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Ranks in [0, universe) with P(k) ~ (k+1)^-s, by inverting the continuous power-law CDF."""
    u = rng.random(n)
    a = 1.0 - s
    x = ((universe + 1.0) ** a - 1.0) * u + 1.0
    return np.minimum(np.floor(x ** (1.0 / a)).astype(np.int64) - 1, universe - 1)


def bench_spill_run(scale: int, in_memory: bool) -> dict:
    from sparse_tables import SparseTable, TableConfig
    from sparse_tables._kernels import splitmix64

    universe = 20_000_000 // scale
    memory_rows = 2_000_000 // scale
    n_batches = 200 // scale if scale > 1 else 200
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        cfg = TableConfig(dim=DIM, optimizer="adagrad", memory_rows=memory_rows,
                          spill_path=None if in_memory else f"{tmp}/spill")
        table = SparseTable(cfg, initial_rows=memory_rows)
        grads = (rng.standard_normal((BATCH, DIM)) * 0.01).astype(np.float32)
        # draws are generated outside the timed region, batch by batch, to keep RSS honest
        elapsed = 0.0
        total = 0
        for b in range(n_batches):
            ranks = zipf_ranks(BATCH, universe, 1.05, rng)
            keys = np.unique(ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1))
            t0 = time.perf_counter()
            table.push(keys, grads[:len(keys)])
            elapsed += time.perf_counter() - t0
            total += len(keys)
        stats = table.stats()
        table.close()
    row_bytes = stats["row_bytes"]
    return {"keys_per_s": total / elapsed, "rows": stats["rows"], "rows_in_ram": stats["rows_in_ram"],
            "rows_spilled": stats["rows_spilled"], "evictions": stats["evictions"],
            "promotions": stats["promotions"], "memory_rows": memory_rows, "universe": universe,
            "keys_pushed": total, "row_bytes": row_bytes, "peak_rss_bytes": peak_rss_bytes()}


def bench_bytes_per_row(scale: int) -> dict:
    from sparse_tables import SparseTable, TableConfig

    n_rows = 10_000_000 // scale
    table = SparseTable(TableConfig(dim=DIM, optimizer="adagrad"))
    keys = random_keys(n_rows, 11)
    table.push_delta(keys[:1000], np.zeros((1000, DIM), np.float32))  # JIT warm-up before measuring
    base = rss_bytes()
    fill(table, keys[1000:], chunk=250_000)
    grown = rss_bytes() - base
    stats = table.stats()
    payload = 4 * (DIM + 1)  # values + row-wise Adagrad accumulator
    keys_bytes = keys.nbytes  # allocated before `base`, not part of the growth
    return {"bench": "bytes_per_row", "rows": stats["rows"], "dim": DIM, "optimizer": "adagrad",
            "payload_bytes_per_row": payload,
            "bytes_per_row": round(grown / stats["rows"] - payload, 2),
            "accounted_bytes_per_row": round(stats["ram_bytes"] / stats["rows"] - payload, 2),
            "index_slots": stats["index_slots"], "target": 48, "excluded_input_keys_bytes": keys_bytes}


def run_child(name: str, scale: int) -> list[dict]:
    if name == "pull_push":
        return bench_pull_push(scale)
    if name in ("spill", "spill_in_memory"):
        return [bench_spill_run(scale, in_memory=name == "spill_in_memory")]
    if name == "bytes_per_row":
        return [bench_bytes_per_row(scale)]
    raise SystemExit(f"unknown measurement {name!r}")


def spawn(name: str, scale: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", name, "--scale", str(scale)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes / 10")
    ap.add_argument("--only", default="pull,push,spill,bytes_per_row")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        for rec in run_child(args.child, args.scale):
            print(json.dumps(rec), flush=True)
        return
    scale = 10 if args.quick else 1
    only = set(args.only.split(","))
    if only & {"pull", "push"}:
        for rec in spawn("pull_push", scale):
            if rec["bench"] in only:
                print(json.dumps(rec), flush=True)
    if "spill" in only:
        spill = spawn("spill", scale)[0]
        ram = spawn("spill_in_memory", scale)[0]
        limit = 2 * spill["memory_rows"] * spill["row_bytes"] + (1 << 30)
        print(json.dumps({"bench": "spill", "zipf_s": 1.05, **spill,
                          "in_memory_keys_per_s": round(ram["keys_per_s"]),
                          "keys_per_s": round(spill["keys_per_s"]),
                          "ratio_vs_in_memory": round(spill["keys_per_s"] / ram["keys_per_s"], 3),
                          "in_memory_peak_rss_bytes": ram["peak_rss_bytes"],
                          "peak_rss_limit_bytes": limit, "target_ratio": 0.3}), flush=True)
    if "bytes_per_row" in only:
        for rec in spawn("bytes_per_row", scale):
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
