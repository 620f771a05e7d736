"""``engine predict`` benchmark. Prints one JSON object per measurement, each with a ``bench`` field.

Set-up: a CTR-DNN bundle (26 slots, dim 10, 400-400-400, the shipped config's shape) of ``--keys``
embedding rows (default 10M; float32, and float16 with ``--float16``), and ``--rows`` generated
Criteo-shaped rows (default 1M: label, 13 dense features, 26 uint64 slot keys drawn Zipf-like per
slot, about 5% of the occurrences unknown to the bundle) as Arrow IPC files.

1. ``predict``: ``engine predict BUNDLE DATA --out preds.arrow`` run as a subprocess, as a user runs it:
   ``rows_per_s`` from its last stdout line (reading, lookup, forward pass, writing; bundle loading
   excluded and reported as ``load_s``), ``peak_rss_mb`` of the process (getrusage of children).
2. ``forward_roofline``: the same model's ``predict`` on pre-gathered embeddings, same batch size, in
   this process: the dense tower's cost alone; ``ratio_vs_roofline`` = (1) / (2).
3. ``lookup``: the predictor's input decoding + fused hash-index lookup and pooling alone (``Bundle.pooled``:
   what ``predict`` runs before the forward pass), rows/s.

    python bench/predict_bench.py [--keys 10000000] [--rows 1000000] [--batch-size 8192] [--float16]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

SLOTS = [f"C{j}" for j in range(1, 27)]
DIM = 10
TARGET = 200_000


def _slot_sizes(keys: int) -> np.ndarray:
    """Keys per slot: Criteo-like skew (a few huge slots), summing to ``keys``."""
    from streaming.criteo_synth import CRITEO_VOCAB_SIZES
    w = np.minimum(np.array(CRITEO_VOCAB_SIZES, np.float64), 3e6)
    n = np.maximum((w / w.sum() * keys).astype(np.int64), 1)
    n[np.argmax(n)] += keys - n.sum()
    return n


def _slot_keys(slot: int, ids: np.ndarray) -> np.ndarray:
    from streaming.keys import make_keys
    return make_keys(slot, ids.astype(np.uint64))


def make_bundle(out: str, keys: int, dtype: str, seed: int = 0) -> None:
    from engine.export import RowBatchSource, describe_model, export_bundle
    from models import build_model
    model = build_model("ctr_dnn", num_slots=26, dim=DIM, dense_dim=13, seed=seed)
    sizes = _slot_sizes(keys)
    rng = np.random.default_rng(seed)

    def batches():
        for j, n in enumerate(sizes, start=1):
            for s in range(0, n, 1 << 21):
                ids = np.arange(s, min(n, s + (1 << 21)))
                vals = rng.normal(0, 0.05, (len(ids), DIM)).astype(np.float32)
                yield pa.RecordBatch.from_arrays(
                    [pa.array(_slot_keys(j, ids)), pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1)), DIM)],
                    names=["key", "values"])

    export_bundle(RowBatchSource(describe_model(model, SLOTS), model.get_dense(), batches, "bench://generated"),
                  out, dtype=dtype, overwrite=True)


def make_data(out_dir: str, rows: int, keys: int, seed: int = 1, per_file: int = 1 << 18) -> None:
    from streaming.criteo import criteo_schema
    schema = criteo_schema()
    sizes = _slot_sizes(keys)
    rng = np.random.default_rng(seed)
    os.makedirs(out_dir, exist_ok=True)
    for f, s in enumerate(range(0, rows, per_file)):
        n = min(per_file, rows - s)
        cols = [pa.array((rng.random(n) < 0.25).astype(np.float32)),
                pa.FixedSizeListArray.from_arrays(pa.array(rng.exponential(1.0, n * 13).astype(np.float32)), 13)]
        for j, size in enumerate(sizes, start=1):
            ids = (rng.zipf(1.2, n) - 1).astype(np.int64)
            ids = np.where(ids < size * 1.05, ids, rng.integers(0, size, n))   # ~5% beyond the bundle
            cols.append(pa.array(_slot_keys(j, ids)))
        rb = pa.RecordBatch.from_arrays(cols, schema=schema)
        with ipc.new_stream(os.path.join(out_dir, f"part-{f:05d}.arrow"), schema) as w:
            for off in range(0, n, 8192):
                w.write_batch(rb.slice(off, 8192))


def run_predict(bundle: str, data: str, out: str, batch: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "engine.cli", "predict", bundle, data, "--out", out,
                        "--batch-size", str(batch)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"engine predict failed ({p.returncode}): {p.stderr[-2000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res["peak_rss_mb"] = max(peak, before) / 1024.0
    res["wall_s"] = wall
    return res


def forward_roofline(batch: int, repeats: int = 20) -> float:
    from models import build_model
    m = build_model("ctr_dnn", num_slots=26, dim=DIM, dense_dim=13)
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(batch * 26, DIM)).astype(np.float32)
    idx = np.arange(batch * 26, dtype=np.int32)
    dense = rng.random((batch, 13), dtype=np.float32)
    m.predict(emb, idx, idx, dense)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            m.predict(emb, idx, idx, dense)
        best = min(best, time.perf_counter() - t)
    return repeats * batch / best


def lookup_rate(bundle_uri: str, data: str, batch: int) -> tuple[float, float]:
    from engine.export import load_bundle
    from streaming.source import ArrowSource
    b = load_bundle(bundle_uri, max_batch=batch)
    rows, secs, hits, occ = 0, 0.0, 0, 0
    for rb in ArrowSource(data, batch_size=batch, prefetch=0).batches(0):
        t = time.perf_counter()
        b.pooled(rb)
        secs += time.perf_counter() - t
        rows += rb.num_rows
        hits += b.last_hits
        occ += rb.num_rows * len(b.slots)
        if rows >= 262_144:
            break
    return rows / secs, hits / max(occ, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--float16", action="store_true", help="also measure a float16 bundle")
    ap.add_argument("--workdir", default=None, help="keep generated files here (default: a temp dir)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    tmp = tempfile.TemporaryDirectory(prefix="predict-bench-", dir=args.workdir)
    d = tmp.name
    t = time.perf_counter()
    make_data(f"{d}/data", args.rows, args.keys)
    gen_s = time.perf_counter() - t
    dtypes = ["float32"] + (["float16"] if args.float16 else [])
    roof = forward_roofline(args.batch_size)
    print(json.dumps({"bench": "forward_roofline", "rows_per_s": roof, "batch_size": args.batch_size,
                      "model": "ctr_dnn 26x10 + 13 -> 400-400-400"}), flush=True)
    for dt in dtypes:
        t = time.perf_counter()
        make_bundle(f"{d}/bundle-{dt}", args.keys, dt)
        export_s = time.perf_counter() - t
        res = run_predict(f"{d}/bundle-{dt}", f"{d}/data", f"{d}/preds-{dt}.arrow", args.batch_size)
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(f"{d}/bundle-{dt}") for f in fs)
        print(json.dumps({"bench": "predict", "dtype": dt, "keys": args.keys, "rows": res["rows"],
                          "rows_per_s": res["rows_per_s"], "target_rows_per_s": TARGET,
                          "meets_target": res["rows_per_s"] >= TARGET,
                          "ratio_vs_roofline": res["rows_per_s"] / roof, "load_s": res["load_seconds"],
                          "peak_rss_mb": res["peak_rss_mb"], "bundle_mb": size / 2**20,
                          "export_s": export_s, "data_gen_s": gen_s, "batch_size": args.batch_size}),
              flush=True)
        rate, hit = lookup_rate(f"{d}/bundle-{dt}", f"{d}/data", args.batch_size)
        print(json.dumps({"bench": "lookup", "dtype": dt, "keys": args.keys, "rows_per_s": rate,
                          "keys_per_s": rate * 26, "hit_rate": hit}), flush=True)
    tmp.cleanup()


if __name__ == "__main__":
    main()
