"""What one cold point read costs in a big spill store, and whether RocksDB's table layout can lower it.
Deliberate, never in CI.

A promotion of a spilled row at 100M keys reads one random row of a database far larger than its block
cache (``bench/scale_bench.py``: a promoted row cost 80-111 us of a server thread, RocksDB's read 24-33 us
of CPU, against ~5 us a key for the same multi-get on a small database). This benchmark isolates that
read, in one process, with nothing beside it:

- one shard's share of a 100M-key server at ``memory_bytes`` = 4 GB over 4 shards: ``--rows`` (default
  25M) real trained rows (``rocksdb_bench.real_records``: the newest base checkpoint under
  ``--checkpoint``, repeated under fresh random keys) in a store opened with the spill store's own options
  (``sparse_tables.spill.rocksdb_options``) under a budget whose block cache and memtables are that share
  (1 GiB over 1 shard: 64 MiB of cache and 2 x 16 MiB of memtables charged to it, as 4 GiB over 4);
- written as evictions write them (sorted write batches of 8192 random keys, WAL off), then left until
  compaction is done;
- read as promotions read (multi-gets of ``SPARSE_PROBE`` present keys drawn at random, in key order),
  ``--calls`` calls per measurement, alternating block cache fill on / off.

One ``cold_read`` JSON line per layout and fill setting: ``cpu_us_per_key`` (the reading thread's CPU),
``wall_us_per_key``, ``ratio_vs_warm`` (the same reads on a ``--warm-rows`` database that fits in the
cache, measured in the same run) and RocksDB's statistics for the reads: block cache misses of index,
filter and data blocks, bytes they put in the cache, blocks decompressed. Layouts: the shipped one
(``BLOCK_SIZE`` blocks, one index and filter block per file), a two-level index with partitioned filters,
and 2 KiB and 1 KiB blocks (partitioned: a flat index of 1 KiB blocks would be 4x the shipped one).

    python bench/rocksdb_cold_read_bench.py [--rows 25000000] [--calls 200] [--checkpoint runs/ckpt]
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from rocksdb_bench import SPARSE_PROBE, key_bytes, keyed_records, real_records, sst_bytes  # noqa: E402

BATCH = 8192          # rows per eviction write batch (sparse_tables.spill.WRITE_BATCH_ROWS)
LAYOUTS = {           # name: (block size in bytes or None for BLOCK_SIZE, partitioned index and filters)
    "shipped": (None, False),
    "partitioned": (None, True),
    "partitioned_2k": (2048, True),
    "partitioned_1k": (1024, True),
}
STATS = ("block.cache.index.miss", "block.cache.index.bytes.insert", "block.cache.filter.miss",
         "block.cache.filter.bytes.insert", "block.cache.data.miss", "block.cache.data.hit",
         "number.block.decompressed")


def statistics(opts) -> dict:
    """RocksDB's ticker counts (``Options.enable_statistics``) -> {name without ``rocksdb.``: count}."""
    out = {}
    for line in (opts.get_statistics() or "").splitlines():
        p = line.split()
        if len(p) >= 4 and p[0].startswith("rocksdb.") and p[1] == "COUNT":
            out[p[0][len("rocksdb."):]] = int(p[3])
    return out


def build(path: str, layout: str, keys: np.ndarray, records: np.ndarray):
    """A spill store's database with ``layout``, written as evictions write, compaction finished ->
    (db, options, seconds)."""
    from rocksdict import Rdict, WriteBatch, WriteOptions

    from sparse_tables import spill
    from sparse_tables.budget import MemoryBudget
    budget = MemoryBudget(1 << 30, 1, 4 * records.shape[1])
    opts = spill.rocksdb_options(budget)
    block, partitioned = LAYOUTS[layout]
    opts.set_block_based_table_factory(spill.table_options(budget, block_size=block, partitioned=partitioned))
    opts.enable_statistics()
    db = Rdict(path, opts)
    wo = WriteOptions()
    wo.disable_wal = True
    stride = records.shape[1]
    t0 = time.perf_counter()
    for a in range(0, len(keys), BATCH):
        order = np.argsort(keys[a:a + BATCH])
        wb = WriteBatch(raw_mode=True)
        vals = np.ascontiguousarray(records[a:a + BATCH][order]).view(f"V{4 * stride}").ravel().tolist()
        collections.deque(map(wb.put, key_bytes(keys[a:a + BATCH][order]), vals), maxlen=0)
        db.write(wb, wo)
    db.flush()
    while (int(db.property_value("rocksdb.estimate-pending-compaction-bytes") or 0)
           or int(db.property_value("rocksdb.num-files-at-level0") or 0) >= spill.L0_TRIGGERS[0]
           or int(db.property_value("rocksdb.num-running-compactions") or 0)):
        time.sleep(2)
    return db, opts, time.perf_counter() - t0


def read(db, keys: np.ndarray, calls: int, rng, fill: bool) -> tuple[float, float]:
    """``calls`` multi-gets of ``SPARSE_PROBE`` random present keys in key order -> (CPU us, wall us) a key."""
    from rocksdict import ReadOptions
    ro = ReadOptions()
    ro.fill_cache(fill)
    probes = [key_bytes(np.sort(rng.choice(keys, SPARSE_PROBE))) for _ in range(calls)]
    c0, w0 = time.thread_time(), time.perf_counter()
    for kb in probes:
        got = db.get(kb, read_opt=ro)
        if any(v is None for v in got):
            raise SystemExit("rocksdb_cold_read_bench: a present key read as absent")
    n = calls * SPARSE_PROBE
    return 1e6 * (time.thread_time() - c0) / n, 1e6 * (time.perf_counter() - w0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=25_000_000)
    ap.add_argument("--warm-rows", type=int, default=300_000)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--checkpoint", default=str(REPO / "runs" / "ckpt"))
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"rocksdb_cold_read_bench: --layouts: unknown {unknown}; known: {sorted(LAYOUTS)}")
    real, dim = real_records(Path(args.checkpoint))
    work = Path(tempfile.mkdtemp(prefix="rocksdb-cold-read-"))
    free = shutil.disk_usage(work).free
    if free < args.rows * 250:
        raise SystemExit(f"rocksdb_cold_read_bench: {free / 1e9:.1f} GB free under {work}, need about "
                         f"{args.rows * 250 / 1e9:.1f} GB for {args.rows} rows")
    rng = np.random.default_rng(0)
    try:
        wk, wr = keyed_records(real, args.warm_rows, rng)
        db, _, _ = build(str(work / "warm"), "shipped", wk, wr)
        read(db, wk, 20, rng, True)
        warm = min(read(db, wk, args.calls, rng, True)[0] for _ in range(2))
        db.close()
        del wk, wr
        print(json.dumps({"bench": "cold_read_warm", "rows": args.warm_rows, "cpu_us_per_key": round(warm, 2)}),
              flush=True)
        keys, records = keyed_records(real, args.rows, rng)
        for layout in layouts:
            path = str(work / layout)
            db, opts, build_s = build(path, layout, keys, records)
            props = db.property_value("rocksdb.aggregated-table-properties") or ""
            layout_figures = {
                "build_s": round(build_s, 1), "disk_bytes_per_row": round(sst_bytes(path) / args.rows, 1),
                "index_bytes": int(props.split("index block size")[1].split("=")[1].split(";")[0])
                if "index block size" in props else None}
            read(db, keys, 20, rng, True)
            for rep in range(4):
                fill = rep % 2 == 0
                before = statistics(opts)
                cpu, wall = read(db, keys, args.calls, rng, fill)
                after = statistics(opts)
                print(json.dumps({
                    "bench": "cold_read", "layout": layout, "fill_cache": fill, "rows": args.rows,
                    "record_bytes": 4 * records.shape[1], "dim": dim,
                    "cpu_us_per_key": round(cpu, 2), "wall_us_per_key": round(wall, 2),
                    "ratio_vs_warm": round(cpu / warm, 2), **layout_figures,
                    "per_1k_keys": {k: round(1000 * (after.get(k, 0) - before.get(k, 0)) / (args.calls * SPARSE_PROBE), 1)
                                    for k in STATS}}), flush=True)
            db.close()
            shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
