"""Replay Criteo rows as hourly partitions, published one by one, for the online-learning job.

    python bench/replay_hours.py OUT_URI [--criteo ../shared/data/criteo/train.txt] [--hours 8]
        [--start 2024010100] [--pace-s 0] [--batch-size 512] [--generated-rows 20000]

Cuts the rows (in file order) into ``--hours`` consecutive slices and publishes slice ``h`` as
``OUT_URI/{YYYYMMDD}/{HH}/part-00000.arrow`` (Arrow IPC file, Criteo schema of ``streaming.criteo``)
followed by ``manifest.json`` and ``_SUCCESS`` (``hdfs_io.Publisher``), waiting ``--pace-s`` seconds
between hours. OUT_URI may be a local path or ``s3://`` / ``hdfs://`` (S3 endpoint and credentials from
the standard AWS environment variables). Without the Criteo file, a planted-model Criteo-format file is
generated (logged). One JSON line per published hour goes to stdout.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hdfs_io  # noqa: E402
from streaming.criteo import convert_criteo, generate_criteo  # noqa: E402
from streaming.hourly import partition_name  # noqa: E402
from streaming.source import ArrowSource, list_files  # noqa: E402

log = logging.getLogger("replay_hours")


def load_rows(criteo: Path, batch_size: int, generated_rows: int, work: Path) -> pa.Table:
    """All rows of ``criteo`` (converted to Arrow in ``work``) as one table, in file order."""
    if not criteo.is_file():
        log.warning("%s not found: generating %d planted-model Criteo-format rows instead", criteo, generated_rows)
        criteo = work / "generated.txt"
        generate_criteo(criteo, generated_rows, 20240)
    out = work / "arrow"
    convert_criteo([criteo], out, batch_size=batch_size, progress=False)
    batches = list(ArrowSource(list_files(out), batch_size=batch_size, prefetch=0).batches(0))
    return pa.Table.from_batches(batches)


def publish_hours(table: pa.Table, out_uri: str, *, hours: int, start: dt.datetime, pace_s: float = 0.0,
                  batch_size: int = 512, storage_options=None, first: int = 0, stop: int | None = None,
                  emit=None) -> list[str]:
    """Publish ``hours`` partitions of ``table``'s rows under ``out_uri``; returns their names.

    Parameters
    ----------
    table : pyarrow.Table
    out_uri : str
    hours : int
    start : datetime, UTC
        Hour of the first partition.
    pace_s : float, seconds
        Sleep between partitions.
    first : int
        Publish partitions ``first .. hours-1`` only (resume a replay).
    stop : int, optional
        Publish no partition from ``stop`` on (the names of all ``hours`` are still returned).
    emit : callable(dict), optional
        Called with one record per published hour.
    """
    storage = hdfs_io.Storage.from_uri(out_uri, storage_options=storage_options)
    n = table.num_rows
    names = []
    for h in range(hours):
        name = partition_name(start + dt.timedelta(hours=h))
        names.append(name)
        if h < first or (stop is not None and h >= stop):
            continue
        lo, hi = h * n // hours, (h + 1) * n // hours
        part = table.slice(lo, hi - lo).combine_chunks()
        with hdfs_io.Publisher(storage, name, manifest={"rows": hi - lo, "hour": h}, overwrite=True) as pub:
            pub.write_table("part-00000.arrow", part.to_batches(max_chunksize=batch_size))
        if emit is not None:
            emit({"event": "published", "partition": name, "rows": hi - lo, "uri": storage.uri_of(name),
                  "time": time.time()})
        if pace_s and h < hours - 1:
            time.sleep(pace_s)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="partition root URI")
    p.add_argument("--criteo", default=str(REPO.parent / "shared" / "data" / "criteo" / "train.txt"))
    p.add_argument("--hours", type=int, default=8)
    p.add_argument("--start", default="2024010100", help="first hour, YYYYMMDDHH (UTC)")
    p.add_argument("--pace-s", type=float, default=0.0, help="seconds between published hours")
    p.add_argument("--first", type=int, default=0, help="skip publishing the first N hours")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--generated-rows", type=int, default=20000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.hours < 1:
        p.error("--hours must be >= 1")
    start = dt.datetime.strptime(args.start, "%Y%m%d%H").replace(tzinfo=dt.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="replay-") as work:
        table = load_rows(Path(args.criteo), args.batch_size, args.generated_rows, Path(work))
        publish_hours(table, args.out, hours=args.hours, start=start, pace_s=args.pace_s,
                      batch_size=args.batch_size, first=args.first,
                      emit=lambda rec: print(json.dumps(rec), flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
