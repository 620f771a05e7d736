"""Reading a CTR train split straight from S3 (``streaming.inputs``) against reading its local copy: the
rows per second a worker's source delivers, the requests an epoch costs, and the start-up reads (row
counts, the resume fingerprint, the launcher's value check).

    python bench/remote_input_bench.py [--rows 1000000] [--files 4] [--formats stream,file,parquet] [--reps 3]

The S3 endpoint is moto's server in a process of its own on 127.0.0.1 (its access log counts the
requests). Planted-model Criteo rows (``streaming.criteo.generate_criteo``, as ``bench/ctr_bench.py``
uses) are converted to ``--files`` Arrow files of each format, uploaded, then read whole, alternating
local and S3, ``--reps`` times after one unrecorded pass each. Records, one JSON object per line:

* ``remote_input_read``      per format and side: rows_per_s, mb_per_s (file bytes / s), median of the reps;
                             on S3 ``requests_per_epoch`` (GETs and HEADs of one pass) and
                             ``mb_per_request``
* ``remote_input_ratio``     per format: ``ratio_vs_local`` = S3 rows/s / local rows/s (same run), and
                             ``ratio_vs_training``: S3 rows/s / ``--train-rows-per-s`` (the job's training
                             rate: above 1 the reads keep ahead of a worker's steps)
* ``remote_input_startup``   per side: seconds of ``file_rows``, ``files_fingerprint`` and
                             ``check_train_split`` (the launcher's full read), and their requests on S3
* ``remote_input_restart``   per format and side: a job's start-up reads of its inputs, the first start
                             (no input records: the launcher's ``check_splits`` of both splits, here the
                             same files, then one worker's rows and fingerprint) against a second start on
                             the same files (``engine.programs.ctr_records``: a version per file, the
                             records); seconds and requests of each, ``ratio_restart_vs_first``

moto is a Python server sharing this machine's cores with the reader, so its figures are a floor for a
real store; the request counts are what a real store charges, whatever its speed. Never run by tests.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hdfs_io  # noqa: E402
from engine.programs.ctr_data import (check_train_split, expected_schema, file_rows, files_fingerprint,  # noqa: E402
                                      make_source)
from streaming.criteo import SPARSE_COLUMNS, convert_criteo, generate_criteo  # noqa: E402

SUFFIX = {"stream": ".arrows", "file": ".arrow", "parquet": ".parquet"}
KEY = SECRET = "bench"


def _moto(log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"moto did not start: {log.read_text()[-2000:]}")


def _requests(log: Path) -> int:
    """GET and HEAD requests in moto's access log so far."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))      # moto colours some lines
    return sum(1 for line in text.splitlines() if '"GET /' in line or '"HEAD /' in line)


def _write(tables: list[pa.Table], d: Path, fmt: str) -> None:
    d.mkdir(parents=True)
    for i, t in enumerate(tables):
        path = str(d / f"part-{i:05d}{SUFFIX[fmt]}")
        if fmt == "parquet":
            pq.write_table(t, path, row_group_size=65536)
            continue
        with pa.OSFile(path, "wb") as f, (pa.ipc.new_stream if fmt == "stream" else pa.ipc.new_file)(f, t.schema) as w:
            w.write_table(t, max_chunksize=65536)


def _read_all(path: str, opts, schema) -> int:
    src = make_source(path, batch_size=4096, schema=schema, rank=0, num_workers=1, prefetch=4, storage_options=opts)
    return sum(rb.num_rows for rb in src.batches(0))


def _restart(fmt: str, side: str, path: str, opts, endpoint: str, tmp: Path, schema, log: Path) -> dict:
    """``remote_input_restart``: two starts of a job on ``path`` (both splits), input records kept in a
    checkpoint root beside the data (a local directory, or the bench bucket)."""
    from engine.config import load_config
    from engine.programs.ctr_inputs import check_splits
    from engine.programs.ctr_records import Listing, Records
    from streaming.source import list_files
    root = f"s3://bench/ckpt-{fmt}" if side == "s3" else str(tmp / f"ckpt-{fmt}")
    store = ([f"storage.endpoint={endpoint}", "storage.scheme=http", "storage.region=us-east-1",
              f"storage.access_key={KEY}", f"storage.secret_key={SECRET}"] if side == "s3" else [])
    cfg = load_config(REPO / "configs" / "ctr.yaml", [
        "model.data.source=arrow", f"model.data.train_path={path}", f"model.data.test_path={path}",
        f"model.slots=[{', '.join(SPARSE_COLUMNS)}]", f"checkpoint.root={root}", *store])
    rec = {"bench": "remote_input_restart", "format": fmt, "side": side}
    for start in ("first", "second"):
        before = _requests(log)
        t0 = time.perf_counter()
        check_splits(cfg, cfg.model.params.data, schema, opts)                  # the launcher
        listing = Listing(Records.of(cfg), "train", list_files(path, storage_options=opts))   # a worker
        if listing.rows is None:
            file_rows(listing.files)
        if listing.fingerprint is None:
            files_fingerprint(listing.files)
        rec[f"{start}_s"] = round(time.perf_counter() - t0, 3)
        if side == "s3":
            rec[f"{start}_requests"] = _requests(log) - before
    rec["ratio_restart_vs_first"] = round(rec["second_s"] / rec["first_s"], 4)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--formats", default="stream,file,parquet")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="read,startup,restart",
                    help="which records to measure: read (and ratio), startup, restart")
    ap.add_argument("--train-rows-per-s", type=float, default=30000.0,
                    help="a worker's training rate to compare with (ctr_bench's ctr_dnn_async per worker)")
    args = ap.parse_args()
    schema = expected_schema(list(SPARSE_COLUMNS), 13)
    print(json.dumps({"bench": "remote_input_machine", "cpus": os.cpu_count(), "rows": args.rows,
                      "files": args.files, "pyarrow": pa.__version__}), flush=True)
    with tempfile.TemporaryDirectory(prefix="remote-input-bench-") as tmp:
        tmp = Path(tmp)
        generate_criteo(tmp / "rows.txt", args.rows, 7)
        convert_criteo([tmp / "rows.txt"], tmp / "conv", batch_size=65536, progress=False)
        (tmp / "rows.txt").unlink()
        whole = pa.concat_tables(pa.ipc.open_stream(str(f)).read_all() for f in sorted((tmp / "conv").iterdir())
                                 if f.suffix == ".arrow")
        n = whole.num_rows
        tables = [whole.slice(n * i // args.files, n * (i + 1) // args.files - n * i // args.files)
                  for i in range(args.files)]
        log = tmp / "moto.log"
        moto, endpoint = _moto(log)
        try:
            opts = hdfs_io.StorageOptions(endpoint_override=endpoint, scheme="http", region="us-east-1",
                                          access_key=KEY, secret_key=SECRET)
            s3 = pafs.S3FileSystem(access_key=KEY, secret_key=SECRET, region="us-east-1", scheme="http",
                                   endpoint_override=endpoint, allow_bucket_creation=True)
            s3.create_dir("bench")
            for fmt in args.formats.split(","):
                local = tmp / fmt
                _write(tables, local, fmt)
                size = sum(f.stat().st_size for f in local.iterdir())
                pafs.copy_files(str(local), f"bench/{fmt}", source_filesystem=pafs.LocalFileSystem(),
                                destination_filesystem=s3)
                uri = f"s3://bench/{fmt}"
                parts = args.parts.split(",")
                if "restart" in parts:
                    for side, path, o in (("local", str(local), None), ("s3", uri, opts)):
                        print(json.dumps(_restart(fmt, side, path, o, endpoint, tmp, schema, log)), flush=True)
                if "read" not in parts and "startup" not in parts:
                    continue
                rates = {"local": [], "s3": []}
                reqs = []
                for rep in range(args.reps + 1 if "read" in parts else 0):
                    for side, path, o in (("local", str(local), None), ("s3", uri, opts)):
                        before = _requests(log)
                        t0 = time.perf_counter()
                        rows = _read_all(path, o, schema)
                        dt = time.perf_counter() - t0
                        assert rows == n, (side, rows, n)
                        if rep:
                            rates[side].append(rows / dt)
                            if side == "s3":
                                reqs.append(_requests(log) - before)
                med = {side: statistics.median(v) for side, v in rates.items() if v}
                for side in ("local", "s3") if "read" in parts else ():
                    rec = {"bench": "remote_input_read", "format": fmt, "side": side, "rows": n,
                           "bytes": size, "rows_per_s": round(med[side]),
                           "mb_per_s": round(med[side] * size / n / 1e6, 1), "reps": args.reps}
                    if side == "s3":
                        rec |= {"requests_per_epoch": statistics.median(reqs),
                                "mb_per_request": round(size / 1e6 / statistics.median(reqs), 2)}
                    print(json.dumps(rec), flush=True)
                if "read" in parts:
                    print(json.dumps({"bench": "remote_input_ratio", "format": fmt,
                                      "ratio_vs_local": round(med["s3"] / med["local"], 3),
                                      "ratio_vs_training": round(med["s3"] / args.train_rows_per_s, 2),
                                      "train_rows_per_s": args.train_rows_per_s}), flush=True)
                for side, path, o in (("local", str(local), None), ("s3", uri, opts)) if "startup" in parts else ():
                    rec = {"bench": "remote_input_startup", "format": fmt, "side": side}
                    for name, fn in (("file_rows", lambda: file_rows(path, o)),
                                     ("files_fingerprint", lambda: files_fingerprint(path, o)),
                                     ("check_train_split", lambda: check_train_split(path, schema, o))):
                        before = _requests(log)
                        t0 = time.perf_counter()
                        fn()
                        rec[f"{name}_s"] = round(time.perf_counter() - t0, 3)
                        if side == "s3":
                            rec[f"{name}_requests"] = _requests(log) - before
                    print(json.dumps(rec), flush=True)
        finally:
            os.killpg(moto.pid, signal.SIGKILL)
            moto.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
