"""Sparse-table kernel benchmark: the table's pull against gathers and layout candidates (issue 19).

Measures, in one run, on the same keys and the same row count (default 10M rows of dim 16, batches of
100k uniform random existing keys), keys per second of:

    numpy_gather           ``values[row_ids]``: numpy's fancy-index gather of 64-byte rows from a plain
                           float32[rows, 16] array (the reference of ``bench/table_bench.py``)
    numba_gather_prefetch  a Numba gather over the same array with the table's pipeline: a block of 1024
                           keys is mapped to row ids (an inverse hash: row = unfmix64(key) - 1, no memory
                           access), then rows are prefetched PREFETCH_AHEAD keys ahead and copied. The
                           ceiling for any layout of ours: no index at all
    table_pull             ``SparseTable.pull`` as it is (Adagrad, filled with the rows by push_delta onto
                           zero-initialised rows, so it holds exactly the gathered values)
    aos_current            the current layout imitated: index of uint64 slots ``fp32 << 32 | row`` (linear
                           probing), 96-byte records key + values + Adagrad state + 5 metadata words; the
                           home slot's row is prefetched ahead, then probe, key check, copy (as the table)
    table_kernel_on_aos    the table's own kernel (``_kernels.pull_rows``) run on the aos_current structure
                           (same record layout and lay words): separates kernel code from layout
    aos_fp_ahead           the same structure; the row prefetched ahead is the first fingerprint match of
                           the probe (read from the already prefetched index line) instead of the home slot's
    soa_values             same index; key + state + metadata in 32-byte cold records, values in their own
                           64-byte-aligned float32[rows, 16]; the probe reads slot, cold key, values row
    soa_fp_ahead           soa_values with the fingerprint-match prefetch of aos_fp_ahead
    key_in_slot            16-byte slots (full key, row id), 4 per line; values apart. The index line alone
                           resolves the row, so the row is resolved PREFETCH_AHEAD keys ahead and its
                           values prefetched; a pull touches the index line(s) and one values line
    bucketed               64-byte buckets of 4 (key, row id) entries, linear probing bucket by bucket
                           (a probe stays in one line unless its bucket is full); values apart

Every variant hashes a block of keys and prefetches the index lines first, then prefetches rows ahead
(the table's ``prefetch_homes`` / ``prefetch_row`` pipeline), so the comparison isolates the layout.
Outputs are checked against numpy's gather before timing. Index capacities follow the table's policy
(``_pow2(rows / MAX_LOAD + 1)`` slots, or that many entries in buckets of 4). Structures are built one at
a time from the same keys (row r holds key r) and freed after their measurement, allocated with the
table's ``_big_array`` (mmap, MADV_HUGEPAGE); the values array is shared by the gathers and split layouts.

Each variant is timed in interleaved rounds with ``numpy_gather`` and ``numba_gather_prefetch`` (so a
burst of load from elsewhere hits all alike): a round pulls ``--calls`` batches with each; the rate is the
best of ``--repeats`` rounds, and each variant's ratios use the references timed beside it.

``bytes_per_row`` is the structure's RAM per row beyond the 64-byte values payload: index bytes per row
at its load factor plus the per-row key, optimizer state (4 bytes, Adagrad) and metadata (20 bytes).
key_in_slot and bucketed keep the key only in the index (maintenance scans would walk the index); their
24-byte cold records (state + metadata) are counted but not allocated, since a pull never reads them.

Prints one JSON line per variant (``"bench": "table_kernel"``), then a summary line with the ranking.
Usage: python bench/table_kernel_bench.py [--quick] [--rows N] [--batch N] [--repeats N] [--calls N]
       [--threads 1] [--only aos_current,key_in_slot,...]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numpy as np
from numba import njit

from sparse_tables import SparseTable, TableConfig
from sparse_tables._kernels import (
    EMPTY,
    LOW32,
    PIPELINE_BLOCK,
    PREFETCH_AHEAD,
    fmix64,
    index_hash,
    pull_rows,
)
from sparse_tables._prefetch import prefetch, prefetch_last
from sparse_tables._arena import big_array as _big_array, pow2 as _pow2
from sparse_tables.table import MAX_LOAD

DIM = 16
U64 = np.uint64
AOS_WORDS = 24   # key 2 + values 16 + Adagrad state 1 + metadata 5 (the table's Adagrad record)
COLD_WORDS = 8   # soa: key 2 + state 1 + metadata 5
STATE_META_BYTES = 24
INV_C1 = U64(pow(0xFF51AFD7ED558CCD, -1, 1 << 64))
INV_C2 = U64(pow(0xC4CEB9FE1A85EC53, -1, 1 << 64))
# helpers taking arrays are compiled without reference counting (as the table's ``_jit.borrowed``), so
# calls inside loops cost no NRT atomics
helper = njit(_nrt=False, nogil=True)
VARIANTS = ("table_pull", "aos_current", "table_kernel_on_aos", "aos_fp_ahead", "soa_values", "soa_fp_ahead", "key_in_slot",
            "bucketed")


@njit(inline="always")
def unfmix64(x):  # inverse of fmix64 (each xor-shift by 33 and each odd multiplication undone)
    x ^= x >> U64(33)
    x *= INV_C2
    x ^= x >> U64(33)
    x *= INV_C1
    x ^= x >> U64(33)
    return x


@njit(nogil=True)
def make_keys(n):
    """Keys of rows 0..n-1: fmix64(r + 1), distinct and uniform-looking 64-bit keys."""
    return np.array([fmix64(U64(r + 1)) for r in range(n)], np.uint64)


# ------------------------------------------------------------------------------------ builders
@helper
def insert_fp(index, key, r):
    mask = U64(index.shape[0] - 1)
    h = index_hash(key)
    i = h & mask
    while index[i] != EMPTY:
        i = (i + U64(1)) & mask
    index[i] = ((h >> U64(32)) << U64(32)) | U64(r)


@njit(nogil=True)
def build_aos(keys, values, index, arena_u, arena_f):
    for r in range(keys.shape[0]):
        arena_u[r, 0] = np.uint32(keys[r] & LOW32)
        arena_u[r, 1] = np.uint32(keys[r] >> U64(32))
        for j in range(DIM):
            arena_f[r, 2 + j] = values[r, j]
        for w in range(2 + DIM, AOS_WORDS):
            arena_u[r, w] = 0
        insert_fp(index, keys[r], r)


@njit(nogil=True)
def build_soa(keys, index, cold):
    for r in range(keys.shape[0]):
        cold[r, 0] = np.uint32(keys[r] & LOW32)
        cold[r, 1] = np.uint32(keys[r] >> U64(32))
        for w in range(2, COLD_WORDS):
            cold[r, w] = 0
        insert_fp(index, keys[r], r)


@njit(nogil=True)
def build_bucketed(keys, buckets):
    """buckets : uint64[n_buckets, 2 * entries] all EMPTY; entry e of a bucket is words (2e, 2e + 1) =
    (key, row); linear probing bucket by bucket. key_in_slot is the case of one entry per bucket."""
    mask = U64(buckets.shape[0] - 1)
    for r in range(keys.shape[0]):
        b = index_hash(keys[r]) & mask
        done = False
        while not done:
            for e in range(buckets.shape[1] // 2):
                if buckets[b, 2 * e + 1] == EMPTY:
                    buckets[b, 2 * e] = keys[r]
                    buckets[b, 2 * e + 1] = U64(r)
                    done = True
                    break
            b = (b + U64(1)) & mask


# ------------------------------------------------------------------------------------ pull kernels
@njit(nogil=True)
def gather_prefetch(values, keys, out):
    """The ceiling: rows of a block from the key (no memory access), prefetch ahead, copy."""
    n = keys.shape[0]
    rows = np.empty(min(n, PIPELINE_BLOCK), np.int64)
    for start in range(0, n, PIPELINE_BLOCK):
        m = min(n, start + PIPELINE_BLOCK) - start
        for i in range(m):
            rows[i] = np.int64(unfmix64(keys[start + i]) - U64(1))
        for b in range(m):
            if b + PREFETCH_AHEAD < m:
                prefetch(values, rows[b + PREFETCH_AHEAD])
            r = rows[b]
            for j in range(DIM):
                out[start + b, j] = values[r, j]


@helper
def ahead_row(index, home, fp, mask, fp_ahead):
    """Row to prefetch for a key whose index line is in cache: the home slot's (the table), or the first
    fingerprint match of the probe (``fp_ahead``); -1 for none."""
    s = index[home]
    if not fp_ahead:
        return np.int64(-1) if s == EMPTY else np.int64(s & LOW32)
    i = home
    while s != EMPTY:
        if (s >> U64(32)) == fp:
            return np.int64(s & LOW32)
        i = (i + U64(1)) & mask
        s = index[i]
    return np.int64(-1)


@njit(nogil=True)
def pull_aos(index, arena_u, arena_f, keys, out, fp_ahead):
    n = keys.shape[0]
    mask = U64(index.shape[0] - 1)
    homes = np.empty(min(n, PIPELINE_BLOCK), np.uint64)
    for start in range(0, n, PIPELINE_BLOCK):
        m = min(n, start + PIPELINE_BLOCK) - start
        for i in range(m):
            h = index_hash(keys[start + i]) & mask
            homes[i] = h
            prefetch(index, h)
        for b in range(m):
            if b + PREFETCH_AHEAD < m:
                fp = index_hash(keys[start + b + PREFETCH_AHEAD]) >> U64(32)
                r = ahead_row(index, homes[b + PREFETCH_AHEAD], fp, mask, fp_ahead)
                if r >= 0:
                    prefetch(arena_u, r)
                    prefetch_last(arena_u, r)
            key = keys[start + b]
            h = index_hash(key)
            fp = h >> U64(32)
            i = h & mask
            found = -1
            while True:
                s = index[i]
                if s == EMPTY:
                    break
                if (s >> U64(32)) == fp:
                    r = np.int64(s & LOW32)
                    if (U64(arena_u[r, 0]) | (U64(arena_u[r, 1]) << U64(32))) == key:
                        found = r
                        break
                i = (i + U64(1)) & mask
            if found < 0:
                for j in range(DIM):
                    out[start + b, j] = 0.0
            else:
                for j in range(DIM):
                    out[start + b, j] = arena_f[found, 2 + j]


@njit(nogil=True)
def pull_soa(index, cold, values, keys, out, fp_ahead):
    n = keys.shape[0]
    mask = U64(index.shape[0] - 1)
    homes = np.empty(min(n, PIPELINE_BLOCK), np.uint64)
    for start in range(0, n, PIPELINE_BLOCK):
        m = min(n, start + PIPELINE_BLOCK) - start
        for i in range(m):
            h = index_hash(keys[start + i]) & mask
            homes[i] = h
            prefetch(index, h)
        for b in range(m):
            if b + PREFETCH_AHEAD < m:
                fp = index_hash(keys[start + b + PREFETCH_AHEAD]) >> U64(32)
                r = ahead_row(index, homes[b + PREFETCH_AHEAD], fp, mask, fp_ahead)
                if r >= 0:
                    prefetch(cold, r)
                    prefetch(values, r)
            key = keys[start + b]
            h = index_hash(key)
            fp = h >> U64(32)
            i = h & mask
            found = -1
            while True:
                s = index[i]
                if s == EMPTY:
                    break
                if (s >> U64(32)) == fp:
                    r = np.int64(s & LOW32)
                    if (U64(cold[r, 0]) | (U64(cold[r, 1]) << U64(32))) == key:
                        found = r
                        break
                i = (i + U64(1)) & mask
            if found < 0:
                for j in range(DIM):
                    out[start + b, j] = 0.0
            else:
                for j in range(DIM):
                    out[start + b, j] = values[found, j]


@helper
def find_bucketed(buckets, home, key, mask):
    b = home
    while True:
        for e in range(buckets.shape[1] // 2):
            if buckets[b, 2 * e + 1] == EMPTY:
                return np.int64(-1)
            if buckets[b, 2 * e] == key:
                return np.int64(buckets[b, 2 * e + 1])
        b = (b + U64(1)) & mask


@njit(nogil=True)
def pull_resolved(table, values, keys, out):
    """key_in_slot / bucketed: the index line alone resolves a row, so rows are resolved and their values
    prefetched PREFETCH_AHEAD keys ahead of the copy."""
    n = keys.shape[0]
    mask = U64(table.shape[0] - 1)
    block = min(n, PIPELINE_BLOCK)
    homes = np.empty(block, np.uint64)
    rows = np.empty(block, np.int64)
    for start in range(0, n, PIPELINE_BLOCK):
        m = min(n, start + PIPELINE_BLOCK) - start
        for i in range(m):
            h = index_hash(keys[start + i]) & mask
            homes[i] = h
            prefetch(table, h)
        for t in range(m + PREFETCH_AHEAD):
            if t < m:
                r = find_bucketed(table, homes[t], keys[start + t], mask)
                rows[t] = r
                if r >= 0:
                    prefetch(values, r)
            b = t - PREFETCH_AHEAD
            if b >= 0:
                r = rows[b]
                if r < 0:
                    for j in range(DIM):
                        out[start + b, j] = 0.0
                else:
                    for j in range(DIM):
                        out[start + b, j] = values[r, j]


# ------------------------------------------------------------------------------------ harness
def huge_kb() -> int:  # AnonHugePages of this process (kB): how much got transparent huge pages
    with open("/proc/self/smaps_rollup") as f:
        return next((int(ln.split()[1]) for ln in f if ln.startswith("AnonHugePages:")), -1)


def machine() -> dict:
    def read(path):
        with open(path) as f:
            return f.read().strip()
    return {"bench": "table_kernel_machine", "os_cpu_count": os.cpu_count(),
            "sched_getaffinity_cpus": len(os.sched_getaffinity(0)),
            "transparent_hugepage_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "transparent_hugepage_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "loadavg_1min": round(os.getloadavg()[0], 2), "numpy": np.__version__}


def threaded(fn, threads: int, pool):
    """fn(keys, ids) -> float32[n, DIM]; on ``threads`` threads each pulls a contiguous part."""
    if threads <= 1:
        return fn

    def call(keys, ids):
        bounds = np.linspace(0, len(keys), threads + 1).astype(np.int64)
        futs = [pool.submit(fn, keys[a:b], ids[a:b]) for a, b in pairwise(bounds)]
        return [f.result() for f in futs]
    return call


def out_of(fn):
    def call(keys, ids):
        out = np.empty((len(keys), DIM), np.float32)   # a fresh result per call, as numpy and the table
        fn(keys, out)
        return out
    return call


def interleaved(fns: dict, batches: list, calls: int, repeats: int) -> dict:
    """Best keys/s of each function over ``repeats`` rounds; a round times ``calls`` batches per function.

    Parameters
    ----------
    fns : dict name -> callable(keys, ids)
    batches : list of (keys uint64[b], row ids int64[b])

    Returns
    -------
    dict name -> keys_per_s
    """
    for fn in fns.values():   # warm-up: JIT, caches
        fn(*batches[0])
    best = {name: float("inf") for name in fns}
    n_keys = sum(len(batches[c % len(batches)][0]) for c in range(calls))
    for rnd in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for c in range(calls):
                fn(*batches[(rnd * calls + c) % len(batches)])
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: n_keys / dt for name, dt in best.items()}


def build(variant: str, keys: np.ndarray, values: np.ndarray, threads: int):
    """(pull fn(keys, ids), bytes_per_row beyond the 64-byte values) of one variant's structure."""
    n = len(keys)
    slots = _pow2(int(n / MAX_LOAD) + 1)   # the table's index capacity for n rows
    if variant == "table_pull":
        table = SparseTable(TableConfig(dim=DIM, optimizer="adagrad", initializer="zeros",
                                        num_threads=threads), initial_rows=n)
        for s in range(0, n, 1_000_000):
            table.push_delta(keys[s:s + 1_000_000], values[s:s + 1_000_000])
        st = table.stats()
        extra = st["index_slots"] * 8 / n + table.layout.row_bytes - 4 * DIM
        return (lambda k, ids: table.pull(k)), extra
    if variant.startswith("aos") or variant == "table_kernel_on_aos":
        index = _big_array((slots,), np.uint64)
        index.fill(EMPTY)
        arena_u = _big_array((n, AOS_WORDS), np.uint32)
        arena_f = arena_u.view(np.float32)
        build_aos(keys, values, index, arena_u, arena_f)
        fp_ahead = variant == "aos_fp_ahead"
        if variant == "table_kernel_on_aos":
            lay = np.array([DIM, 2, 2 + DIM, 3 + DIM, AOS_WORDS], np.int64)   # dim, values, state, meta, stride
            return out_of(lambda k, o: pull_rows(index, arena_u, arena_f, lay, k, o, 1, False,
                                                 np.empty(len(k), np.int64))), \
                slots * 8 / n + 4 * (AOS_WORDS - DIM)
        return out_of(lambda k, o: pull_aos(index, arena_u, arena_f, k, o, fp_ahead)), \
            slots * 8 / n + 4 * (AOS_WORDS - DIM)
    if variant.startswith("soa"):
        index = _big_array((slots,), np.uint64)
        index.fill(EMPTY)
        cold = _big_array((n, COLD_WORDS), np.uint32)
        build_soa(keys, index, cold)
        fp_ahead = variant == "soa_fp_ahead"
        return out_of(lambda k, o: pull_soa(index, cold, values, k, o, fp_ahead)), \
            slots * 8 / n + 4 * COLD_WORDS
    if variant == "key_in_slot":
        table = _big_array((slots, 2), np.uint64)
        table.fill(EMPTY)
        build_bucketed(keys, table)
        return out_of(lambda k, o: pull_resolved(table, values, k, o)), \
            slots * 16 / n + STATE_META_BYTES
    if variant == "bucketed":
        table = _big_array((slots // 4, 8), np.uint64)   # the same number of entries as key_in_slot
        table.fill(EMPTY)
        build_bucketed(keys, table)
        return out_of(lambda k, o: pull_resolved(table, values, k, o)), \
            slots * 16 / n + STATE_META_BYTES
    raise SystemExit(f"unknown variant {variant!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1M rows")
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the best counts")
    ap.add_argument("--calls", type=int, default=10, help="batches per function per round")
    ap.add_argument("--threads", type=int, default=1, help="threads per pull (each pulls a part)")
    ap.add_argument("--only", default=",".join(VARIANTS))
    args = ap.parse_args()
    rows = 1_000_000 if args.quick else args.rows
    print(json.dumps(machine()), flush=True)

    t0 = time.perf_counter()
    keys = make_keys(rows)
    values = np.random.default_rng(3).random((rows, DIM), dtype=np.float32)
    rng = np.random.default_rng(2)
    batches = []
    for _ in range(8):
        ids = rng.integers(0, rows, args.batch)
        batches.append((keys[ids], ids))
    pool = ThreadPoolExecutor(max(args.threads, 1))
    numpy_gather = threaded(lambda k, ids: values[ids], args.threads, pool)
    ceiling_1 = out_of(lambda k, o: gather_prefetch(values, k, o))
    ceiling = threaded(ceiling_1, args.threads, pool)
    for k, ids in batches[:2]:
        assert np.array_equal(ceiling_1(k, ids), values[ids]), "numba_gather_prefetch differs from numpy"
    print(json.dumps({"bench": "table_kernel_setup", "rows": rows, "setup_s": round(time.perf_counter() - t0, 1),
                      "anon_huge_pages_kb": huge_kb()}), flush=True)
    results = []
    refs = {"numpy_gather": [], "numba_gather_prefetch": []}
    for variant in [v for v in VARIANTS if v in args.only.split(",")]:
        t1 = time.perf_counter()
        pull1, extra = build(variant, keys, values, args.threads)
        build_s = time.perf_counter() - t1
        hp = huge_kb()
        for k, ids in batches[:2]:
            assert np.array_equal(pull1(k, ids), values[ids]), f"{variant} differs from numpy's gather"
        pull = pull1 if variant == "table_pull" else threaded(pull1, args.threads, pool)
        rates = interleaved({"numpy_gather": numpy_gather, "numba_gather_prefetch": ceiling, variant: pull},
                            batches, args.calls, args.repeats)
        for name, vals in refs.items():
            vals.append(rates[name])
        rec = {"bench": "table_kernel", "variant": variant, "rows": rows, "dim": DIM, "batch": args.batch,
               "threads": args.threads, "keys_per_s": round(rates[variant]),
               "ratio_vs_numpy_gather": round(rates[variant] / rates["numpy_gather"], 3),
               "ratio_vs_ceiling": round(rates[variant] / rates["numba_gather_prefetch"], 3),
               "bytes_per_row": round(extra, 1), "bytes_per_row_beyond_values_and_state": round(extra - 4, 1),
               "numpy_gather_keys_per_s": round(rates["numpy_gather"]),
               "ceiling_keys_per_s": round(rates["numba_gather_prefetch"]),
               "build_s": round(build_s, 1), "anon_huge_pages_kb": hp, "cpus_granted": len(os.sched_getaffinity(0))}
        results.append(rec)
        print(json.dumps(rec), flush=True)
        pull1 = pull = None
        gc.collect()   # free the structure before building the next
    ranking = sorted(results, key=lambda r: -r["keys_per_s"])
    table_rate = next((r["keys_per_s"] for r in results if r["variant"] == "table_pull"), None)
    aos_rate = next((r["keys_per_s"] for r in results if r["variant"] == "aos_current"), None)
    print(json.dumps({
        "bench": "table_kernel_summary", "rows": rows, "threads": args.threads,
        "ranking_fields": (fields := ["variant", "keys_per_s", "ratio_vs_numpy_gather", "ratio_vs_ceiling",
                                      "bytes_per_row"]),
        "ranking": [[r[f] for f in fields] for r in ranking],
        "aos_current_vs_table_pull": round(aos_rate / table_rate, 3) if table_rate and aos_rate else None,
        "numpy_gather_keys_per_s_best": round(max(refs["numpy_gather"])) if results else None,
        "ceiling_keys_per_s_best": round(max(refs["numba_gather_prefetch"])) if results else None,
        "cpus_granted": len(os.sched_getaffinity(0)), "loadavg_1min_end": round(os.getloadavg()[0], 2),
    }), flush=True)
    pool.shutdown()

if __name__ == "__main__":
    main()
