"""How many rows per second the spill stores of one server can absorb for good: RocksDB alone, no server.

Deliberate, never in CI (it writes ~10 GB at full size). A budgeted table at the end of
``bench/scale_bench.py``'s growth writes every new key to RocksDB once it leaves the RAM tier, so RocksDB
must keep up with the new-key rate or stall the writes (and the requests behind them). This bench
measures that ceiling on this machine, with nothing else running: ``--shards`` spill stores
(``sparse_tables.spill.SpillStore``, the server's 4 local shards by default) under one
``MemoryBudget`` of ``--budget-gb`` (the scale bench's 4 GB: a shared block cache, a write-buffer
manager, 15.6 MB memtables per shard) take batches of 25,000 fresh random keys per shard through
``SpillStore.put`` (sorted write batches, write stalls waited out as in the server), rows of dim 16 with
Adagrad (96 bytes). The rows are the embedding rows of the newest base checkpoint under
``--checkpoint`` (``make train`` writes ``runs/ckpt``) under fresh keys when there is one, else
synthetic rows (values N(0, 0.01), ``"records": "synthetic"``). One ``spill_ingest`` row every 10% of
``--rows``::

    rows              rows written so far
    rows_per_s        rows written per second in the interval (wall)
    cpu_cores         the process's cores in the interval: ``rocksdb`` (its flush and compaction threads,
                      named ``rocksdb:*``) and ``writer`` (the rest: the Python thread building batches)
    cpu_us_per_row    CPU microseconds per row written in the interval (both parts)
    level0_files, pending_compaction_bytes, stall_s
                      RocksDB's state at the end of the interval (summed over the stores) and the seconds
                      writes waited out stalls so far

and a final ``spill_ingest_summary``: the rate and CPU per row over the last 10%, the seconds stalled,
RocksDB's bytes written by compaction and flushes over the bytes ingested (``write_amplification``,
from ``rocksdb.stats``), and the disk bytes per row. ``--background-jobs`` and ``--subcompactions``
override the spill store's settings (``spill.BACKGROUND_JOBS``, ``spill.SUBCOMPACTIONS``) to compare, and
``--compaction universal`` (``--universal-max-amp`` percent of space amplification) measures RocksDB's
tiered compaction against the stores' leveled one.

    python bench/spill_ingest_bench.py [--rows 100000000] [--shards 4] [--budget-gb 4]
                                       [--background-jobs N] [--subcompactions N] [--work DIR]
                                       [--compaction level|universal] [--universal-max-amp PERCENT]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _procstat import cpu_s, threads_cpu_s  # noqa: E402

DIM = 16
PER_SHARD = 25_000          # rows per store per step: a 100k-key batch over 4 shards


def rows_for(n_pool: int, checkpoint: Path, rng) -> tuple[np.ndarray, str]:
    """uint32[n, 24] records to draw rows from: real ones (a base checkpoint of a dim-16 Adagrad table)
    or synthetic ones, and which."""
    from sparse_tables.config import RowLayout
    layout = RowLayout(DIM, 1)
    try:
        from rocksdb_bench import real_records
        real, dim = real_records(checkpoint)
        if dim == DIM and real.shape[1] == layout.stride:
            return real, "real"
    except SystemExit:
        pass
    rec = np.zeros((n_pool, layout.stride), np.uint32)
    rec[:, layout.values:layout.values + DIM] = rng.normal(0, 0.01, (n_pool, DIM)).astype(np.float32).view(np.uint32)
    rec[:, layout.state] = np.abs(rng.normal(0, 0.1, n_pool)).astype(np.float32).view(np.uint32)
    return rec, "synthetic"


def compaction_bytes(db) -> tuple[float, float]:
    """(bytes written by compaction, bytes flushed) of one store, from ``rocksdb.stats``."""
    stats = db.property_value("rocksdb.stats") or ""
    comp = re.search(r"Cumulative compaction: ([\d.]+) GB write", stats)
    flush = re.search(r"Flush\(GB\): cumulative ([\d.]+)", stats)
    return (float(comp.group(1)) * 2**30 if comp else 0.0, float(flush.group(1)) * 2**30 if flush else 0.0)


def main(argv=None) -> int:
    from sparse_tables import spill
    from sparse_tables.budget import MemoryBudget
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=float, default=100e6)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--budget-gb", type=float, default=4.0)
    ap.add_argument("--background-jobs", type=int, default=spill.BACKGROUND_JOBS)
    ap.add_argument("--subcompactions", type=int, default=spill.SUBCOMPACTIONS)
    ap.add_argument("--compaction", choices=("level", "universal"), default="level")
    ap.add_argument("--universal-max-amp", type=int, default=spill.UNIVERSAL_MAX_AMP_PERCENT,
                    help="universal compaction's max_size_amplification_percent")
    ap.add_argument("--checkpoint", default=str(REPO / "runs" / "ckpt"))
    ap.add_argument("--work", default=str(REPO / "runs" / "spill_ingest_bench"))
    args = ap.parse_args(argv)
    total = int(args.rows)
    spill.BACKGROUND_JOBS, spill.SUBCOMPACTIONS = args.background_jobs, args.subcompactions
    spill.UNIVERSAL_MAX_AMP_PERCENT = args.universal_max_amp
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if shutil.disk_usage(work).free < total * 130:
        print(f"spill_ingest_bench: {work} has too little free disk for {total} rows (~130 bytes each)",
              file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    pool, kind = rows_for(1 << 16, Path(args.checkpoint), rng)
    stride = pool.shape[1]
    budget = MemoryBudget(int(args.budget_gb * 1e9), args.shards, 4 * stride)
    stores = [spill.SpillStore(str(work / f"shard{i}"), stride, budget, args.compaction) for i in range(args.shards)]
    common = {"shards": args.shards, "budget_bytes": budget.budget_bytes, "records": kind,
              "background_jobs": args.background_jobs, "subcompactions": args.subcompactions,
              "compaction": args.compaction,
              **({"universal_max_amp_percent": args.universal_max_amp} if args.compaction == "universal" else {}),
              "cpus_granted": len(os.sched_getaffinity(0))}
    me = os.getpid()

    def cpu() -> tuple[float, float]:
        rocks = threads_cpu_s(me, "rocksdb:")
        return rocks, cpu_s(f"/proc/{me}/stat") - rocks

    new = np.ones(PER_SHARD, np.bool_)
    done, mark = 0, total // 10
    t0 = last_t = time.perf_counter()
    last_done, last_cpu = 0, cpu()
    last_row = None
    try:
        while done < total:
            for st in stores:
                keys = rng.integers(1, 2**64 - 1, PER_SHARD, dtype=np.uint64)
                rec = pool[rng.integers(0, len(pool), PER_SHARD)]
                rec[:, 0] = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
                rec[:, 1] = (keys >> np.uint64(32)).astype(np.uint32)
                st.put(keys, rec, new)
            done += PER_SHARD * len(stores)
            if done >= mark or done >= total:
                now, c = time.perf_counter(), cpu()
                span, rows = now - last_t, done - last_done
                state = [s.compaction() for s in stores]
                last_row = {"bench": "spill_ingest", "rows": done, "rows_per_s": round(rows / span),
                            "cpu_cores": {"rocksdb": round((c[0] - last_cpu[0]) / span, 3),
                                          "writer": round((c[1] - last_cpu[1]) / span, 3)},
                            "cpu_us_per_row": round(1e6 * (sum(c) - sum(last_cpu)) / rows, 2),
                            "level0_files": sum(x["level0_files"] for x in state),
                            "pending_compaction_bytes": sum(x["pending_compaction_bytes"] for x in state),
                            "stall_s": round(sum(s.stall_s for s in stores), 1),
                            "elapsed_s": round(now - t0, 1), **common}
                print(json.dumps(last_row), flush=True)
                last_t, last_done, last_cpu = now, done, c
                mark += total // 10
        written = [compaction_bytes(s._db) for s in stores]
        ingested = done * 4 * stride
        print(json.dumps({
            "bench": "spill_ingest_summary", "rows": done, "elapsed_s": round(time.perf_counter() - t0, 1),
            "rows_per_s": round(done / (time.perf_counter() - t0)),
            "rows_per_s_last_10pct": last_row["rows_per_s"], "cpu_us_per_row_last_10pct": last_row["cpu_us_per_row"],
            "stall_s": last_row["stall_s"],
            "write_amplification": round(sum(a + b for a, b in written) / ingested, 2),
            "disk_bytes_per_row": round(sum(s.disk_bytes() for s in stores) / done, 1), **common}), flush=True)
    finally:
        for s in stores:
            s.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
