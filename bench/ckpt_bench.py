"""Checkpoint save / restore throughput on the local filesystem and on a moto S3 endpoint; with ``--jobs``,
what checkpointing every N steps costs a real training job.

    python bench/ckpt_bench.py [--rows 5000000] [--dim 16] [--backends local,s3] [--servers 1]
    python bench/ckpt_bench.py --jobs configs/ctr.yaml,configs/deepfm.yaml [--every 0,meet,200,50] [--reps 2]

A sparse table of ``--rows`` rows of ``--dim`` float32 with row-wise Adagrad state is filled directly
(bit patterns of random rows) on in-process parameter servers; then, through the real Save/Load RPCs
and ``engine.checkpoint.CheckpointManager``:

* ``ckpt_base_save``     base checkpoint: rows_per_s, mb_per_s (bytes written / s), bytes_per_row
* ``ckpt_base_restore``  restore onto fresh servers: rows_per_s, mb_per_s (bytes read / s)
* ``ckpt_delta``         after pushing gradients to 1% of the rows: the delta's size and save time as
                         ratios of the base's (targets: local save and restore >= 1M rows/s; delta time
                         <= 5% of base time)

``--jobs``: each config is trained with ``engine train`` (its own launcher, servers and workers, on the
shared Criteo rows ``--criteo``) for ``--epochs`` epochs, once per ``--every`` value and repetition
(alternating, after one unrecorded warm-up run). ``--every`` values: ``0`` = no checkpoints
(``checkpoint.root: ""``); ``meet`` = the aligned meetings (every ``--align`` steps) without writing
anything (``delta_every: 0``, ``final: false``); ``N`` = ``delta_every: Nsteps`` with ``align_steps:
--align`` and the final checkpoint. Records:

* ``ckpt_job_run``    wall_s (the whole ``engine train``), train_s (rank 0's ``train_seconds``: its epochs,
                      including the aligned meetings within them), save_s (rank 0's checkpoint writes,
                      from its log), checkpoints written
* ``ckpt_job_base``   first repetition: the job's base (its first checkpoint): step, sparse rows and bytes,
                      dense bytes, save_s
* ``ckpt_job_delta``  first repetition, per delta: the same, and ``size_ratio`` (all bytes),
                      ``sparse_size_ratio`` and ``rows_ratio`` against the base. A delta holds the sparse
                      rows changed since the previous checkpoint and every dense table in full

One JSON object per line on stdout, each with a ``bench`` field. Heavy (GBs of RAM); never run by tests.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hdfs_io  # noqa: E402
from engine.checkpoint import CheckpointManager  # noqa: E402
from engine.ps import InProcessTransport, PSClient, PSServer, routing  # noqa: E402
from sparse_tables import TableConfig  # noqa: E402

NV = 1024


def make_cluster(n: int, cfg: TableConfig, storage_options, threads: int):
    servers = [PSServer({"emb": cfg}, {}, index=i, num_servers=n, num_vshards=NV, local_shards=4,
                        storage_options=storage_options, checkpoint_threads=threads) for i in range(n)]
    return servers, PSClient(InProcessTransport(servers, serialize=False), timeout_s=3600)


def fill(servers, rows: int, dim: int, seed: int = 0, *, table: str = "emb", num_vshards: int = NV) -> np.ndarray:
    """Load ``rows`` random rows (values, Adagrad accumulator, show/click) of ``table`` straight into the
    shards of ``servers`` (in-process ``PSServer``s of ``num_vshards`` vshards); returns the keys."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 1 << 62, int(rows * 1.01), dtype=np.uint64))[:rows]
    rng.shuffle(keys)
    n_srv = len(servers)
    srv = routing.route(keys, num_vshards, n_srv)
    chunk = 1 << 18
    for s, server in enumerate(servers):
        host = server.sparse[table]
        mine = keys[srv == s]
        local = routing.lookup(mine, num_vshards, host.local_owner)
        for j, shard in enumerate(host.shards):
            k = mine[local == j]
            for a in range(0, len(k), chunk):
                kk = k[a:a + chunk]
                m = len(kk)
                vals = rng.normal(0, 0.01, (m, dim)).astype(np.float32)
                cols = [pa.array(kk), pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1)), dim),
                        pa.FixedSizeListArray.from_arrays(pa.array(rng.random(m, np.float32)), 1),
                        pa.array(rng.integers(1, 100, m).astype(np.float32)),
                        pa.array(rng.integers(0, 5, m).astype(np.float32)),
                        pa.array(np.full(m, 1_700_000_000, np.uint32))]
                shard.load_rows([pa.RecordBatch.from_arrays(cols, schema=shard.schema)])
    return keys


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def run_backend(backend: str, root: str, opts, args, cfg: TableConfig) -> None:
    servers, client = make_cluster(args.servers, cfg, opts, args.threads)
    keys = fill(servers, args.rows, args.dim)
    mgr = CheckpointManager(root, "bench", storage_options=opts)
    t0 = time.perf_counter()
    base = mgr.save(client, "base", when=0.0)
    t_base = time.perf_counter() - t0
    nbytes = sum(e["size"] for e in base["files"].values())
    emit({"bench": "ckpt_base_save", "backend": backend, "rows": args.rows, "dim": args.dim,
          "optimizer": cfg.optimizer, "servers": args.servers, "seconds": round(t_base, 3),
          "rows_per_s": round(args.rows / t_base), "mb_per_s": round(nbytes / t_base / 1e6, 1),
          "bytes": nbytes, "bytes_per_row": round(nbytes / args.rows, 2),
          "raw_bytes_per_row": servers[0].sparse["emb"].shards[0].layout.row_bytes - 8})
    for s in servers:
        s.close()
    del servers, client
    servers2, client2 = make_cluster(args.servers, cfg, opts, args.threads)
    t0 = time.perf_counter()
    CheckpointManager(root, "bench", storage_options=opts).restore(client2)
    t_load = time.perf_counter() - t0
    got = sum(s.sparse["emb"].stats()["rows"] for s in servers2)
    emit({"bench": "ckpt_base_restore", "backend": backend, "rows": got, "seconds": round(t_load, 3),
          "rows_per_s": round(got / t_load), "mb_per_s": round(nbytes / t_load / 1e6, 1)})
    # delta after touching 1% of the rows (the restored cluster continues the chain)
    mgr2 = CheckpointManager(root, "bench", storage_options=opts)
    mgr2.head = base["name"]
    rng = np.random.default_rng(1)
    touched = rng.choice(keys, args.rows // 100, replace=False)
    client2.push("emb", touched, rng.normal(size=(len(touched), args.dim)).astype(np.float32))
    t0 = time.perf_counter()
    delta = mgr2.save(client2, "delta", when=3600.0)
    t_delta = time.perf_counter() - t0
    dbytes = sum(e["size"] for e in delta["files"].values())
    emit({"bench": "ckpt_delta", "backend": backend, "touched_rows": len(touched),
          "delta_rows": delta["tables"]["sparse"]["emb"]["rows"], "seconds": round(t_delta, 3),
          "bytes": dbytes, "size_ratio": round(dbytes / nbytes, 4), "time_ratio": round(t_delta / t_base, 4)})
    for s in servers2:
        s.close()


_SAVED = re.compile(r"checkpoint (\S+) published: (base|delta), (\d+) row\(s\), \d+ file\(s\), ([\d.]+) s")


def _manifests(job_root: Path) -> list[dict]:
    out = [json.loads(f.read_text()) for f in job_root.glob("*/*/manifest.json")]
    return sorted(out, key=lambda m: (m["step"], m["name"]))


def _sizes(m: dict) -> tuple[int, int]:
    """(sparse bytes, dense bytes) of a checkpoint's files."""
    dense = sum(e["size"] for k, e in m["files"].items() if k.startswith("dense/"))
    return sum(e["size"] for e in m["files"].values()) - dense, dense


def run_job(config: str, every: str, rep: int, tmp: Path, args, *, out=emit) -> None:
    """One ``engine train`` of ``config``; hands its records to ``out`` (checkpoint sizes on rep 0 only)."""
    name = f"{Path(config).stem}-{every}-{rep}"
    run_dir, ck_root = tmp / name / "run", tmp / name / "ckpt"
    sets = [f"model.epochs={args.epochs}", f"model.data.criteo_path={args.criteo}",
            f"model.metrics_dir={tmp / name / 'metrics'}", f"checkpoint.job={name}"]
    if every == "0":
        sets += ['checkpoint.root=""']
    elif every == "meet":
        sets += [f"checkpoint.root={ck_root}", "checkpoint.delta_every=0", "checkpoint.final=false",
                 f"checkpoint.align_steps={args.align}"]
    else:
        sets += [f"checkpoint.root={ck_root}", f"checkpoint.delta_every={int(every)}steps",
                 f"checkpoint.align_steps={args.align}"]
    cmd = [sys.executable, "-m", "engine", "train", config, "--run-dir", str(run_dir)]
    for kv in sets + list(args.set):
        cmd += ["--set", kv]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads((run_dir / "worker-0.result.json").read_text())
    saves = [(m.group(2), int(m.group(3)), float(m.group(4)))
             for m in _SAVED.finditer((run_dir / "worker-0.log").read_text())]
    out({"bench": "ckpt_job_run", "config": config, "every": every, "align_steps": args.align,
          "epochs": args.epochs, "rep": rep, "steps": result["steps"], "wall_s": round(wall, 2),
          "train_s": round(result["train_seconds"], 3), "save_s": round(sum(s[2] for s in saves), 3),
          "checkpoints": len(saves), "test_auc": round(result.get("test", {}).get("auc", float("nan")), 4)})
    if not saves or rep > 0:
        return
    ms = _manifests(ck_root / name)           # in write order, as the log's saves
    secs = [sv[2] for sv in saves] if len(saves) == len(ms) else [None] * len(ms)
    base = ms[0]
    b_sparse, b_dense = _sizes(base)
    b_rows = sum(t["rows"] for t in base["tables"]["sparse"].values())
    out({"bench": "ckpt_job_base", "config": config, "step": base["step"], "rows": b_rows,
          "sparse_bytes": b_sparse, "dense_bytes": b_dense, "save_s": secs[0]})
    for m, sec in zip(ms[1:], secs[1:]):
        sp, de = _sizes(m)
        rows = sum(t["rows"] for t in m["tables"]["sparse"].values())
        out({"bench": f"ckpt_job_{m['kind']}", "config": config, "every": every, "step": m["step"],
              "rows": rows, "sparse_bytes": sp, "dense_bytes": de, "save_s": sec,
              "size_ratio": round((sp + de) / (b_sparse + b_dense), 4),
              "sparse_size_ratio": round(sp / b_sparse, 4), "rows_ratio": round(rows / b_rows, 4)})


def run_jobs(args) -> None:
    if not Path(args.criteo).is_file():
        raise SystemExit(f"--criteo {args.criteo}: no such file (the shared Criteo rows)")
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-jobs-"))
    try:
        for config in args.jobs.split(","):
            run_job(config, "0", -1, tmp, args, out=lambda rec: None)  # warm-up: data conversion, JIT caches
            for rep in range(args.reps):
                for every in args.every.split(","):
                    run_job(config, every, rep, tmp, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=5_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="checkpoint threads per server")
    p.add_argument("--backends", default="local,s3")
    p.add_argument("--jobs", default="", help="configs to train instead (comma-separated), e.g. configs/ctr.yaml")
    p.add_argument("--every", default="0,meet,200,50",
                   help="--jobs: delta_every in steps; 0 = no checkpoints; meet = meetings only")
    p.add_argument("--align", type=int, default=10, help="--jobs: checkpoint.align_steps")
    p.add_argument("--epochs", type=int, default=4, help="--jobs: model.epochs (~64 steps per worker each)")
    p.add_argument("--reps", type=int, default=2, help="--jobs: repetitions of each setting")
    p.add_argument("--criteo", default=str(REPO.parent / "shared/data/criteo/train.txt"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--jobs: more overrides")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.jobs:
        run_jobs(args)
        return 0
    cfg = TableConfig(dim=args.dim, optimizer="adagrad", num_threads=2, memory_rows=1 << 30)
    for backend in args.backends.split(","):
        if backend == "local":
            tmp = tempfile.mkdtemp(prefix="ckpt-bench-")
            try:
                run_backend("local", tmp, None, args, cfg)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        elif backend == "s3":
            from moto.server import ThreadedMotoServer
            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            try:
                host, port = server.get_host_and_port()
                opts = hdfs_io.StorageOptions(endpoint_override=f"{host}:{port}", scheme="http",
                                              region="us-east-1", access_key="testing", secret_key="testing")
                import pyarrow.fs as pafs
                pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                                  endpoint_override=f"{host}:{port}", allow_bucket_creation=True).create_dir("bench")
                run_backend("s3", "s3://bench/ckpt", opts, args, cfg)
            finally:
                server.stop()
        else:
            p.error(f"unknown backend {backend!r}; use local and/or s3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
