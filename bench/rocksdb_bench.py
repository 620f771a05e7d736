"""The spill store's RocksDB settings, measured on real rows (what ``sparse_tables.spill.rocksdb_options``
chose). Deliberate, never in CI.

Rows: the embedding rows of the newest base checkpoint under ``--checkpoint`` (default ``runs/ckpt``,
which ``make train`` writes: CTR-DNN trained on the shared Criteo rows, values and Adagrad state as
training left them), as spill records. They are repeated under fresh random keys up to ``--rows``, so
every value in the database is a real one while the key count is large enough for blocks, filters and
levels to matter. One JSON line per measurement:

    compression    for none / lz4 / zstd / lz4 with zstd on the last level x block size 4 / 16 KiB: ``disk_bytes_per_row`` after a full
                   compaction, ``write_rows_per_s`` (sorted WriteBatches of 65536 rows, WAL off, the
                   spill store's path) and ``read_rows_per_s`` (multi-gets of 65536 present keys in key
                   order, a 32 MiB block cache: most reads miss it; ~28 keys per 16 KiB block) and
                   ``sparse_read_rows_per_s`` (multi-gets of 2048 present keys drawn at random, in key
                   order: about one key per 1000 rows, so every read decompresses a block for one row, as
                   a promotion from a big spilled table does)
    bloom          absent keys (new keys, the common case of a training push): ``ns_per_absent_key``
                   through the hand-written ``keysets.ScalableBloom`` (no RocksDB call for a "no") and
                   through RocksDB's own Bloom filter (a multi-get that the filter answers), and the
                   filter bytes per key of each
    restore_path   rows/s of writing all rows as SST files (in key order) and ingesting them, against
                   the spill store's sorted WriteBatches

    python bench/rocksdb_bench.py [--rows 2000000] [--checkpoint runs/ckpt]
"""
from __future__ import annotations

import argparse
import glob
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHUNK = 65536
SPARSE_PROBE = 2048


def real_records(root: Path) -> tuple[np.ndarray, int]:
    """uint32[n, stride] spill records of the newest base checkpoint's first sparse table, and dim."""
    import pyarrow.ipc as ipc

    from sparse_tables.config import RowLayout
    from sparse_tables.rows import batch_to_records
    bases = sorted(glob.glob(str(root / "*" / "*" / "*-base*")))
    if not bases:
        raise SystemExit(f"rocksdb_bench: no base checkpoint under {root}; run `make train` first (it writes "
                         f"runs/ckpt) or pass --checkpoint ROOT")
    tables = sorted(glob.glob(f"{bases[-1]}/sparse/*"))
    parts = []
    layout = None
    for f in sorted(glob.glob(f"{tables[0]}/*.arrow")):
        table = ipc.open_file(f).read_all()
        meta = table.schema.metadata
        layout = RowLayout(int(meta[b"dim"]), int(meta[b"state_width"]))
        for batch in table.to_batches():
            parts.append(batch_to_records(batch, layout))
    return np.concatenate(parts), layout.dim


def keyed_records(real: np.ndarray, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """``n`` fresh random keys (uint64[n]) and the real records repeated under them (uint32[n, stride],
    each record's key words rewritten), so every value stored is a real one at any row count."""
    keys = rng.integers(1, 2**63, n, dtype=np.uint64)
    records = np.tile(real, (-(-n // len(real)), 1))[:n].copy()
    records[:, 0] = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    records[:, 1] = (keys >> np.uint64(32)).astype(np.uint32)
    return keys, records


def key_bytes(keys: np.ndarray) -> list:
    return np.frombuffer(np.ascontiguousarray(keys, dtype=">u8").tobytes(), dtype="V8").tolist()


def open_db(path: str, compression, block_size: int, bloom: bool, bottommost=None):
    from rocksdict import BlockBasedOptions, Cache, Options, Rdict
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    t = BlockBasedOptions()
    if bloom:
        t.set_bloom_filter(10, False)
    t.set_cache_index_and_filter_blocks(True)
    t.set_block_size(block_size)
    t.set_block_cache(Cache(32 << 20))
    opts.set_block_based_table_factory(t)
    opts.set_compression_type(compression)
    if bottommost is not None:
        opts.set_bottommost_compression_type(bottommost)
    opts.set_level_compaction_dynamic_level_bytes(True)
    return Rdict(path, opts)


def fill(db, keys: np.ndarray, records: np.ndarray) -> float:
    """Write in sorted chunks as the spill store does; returns rows/s."""
    from rocksdict import WriteBatch, WriteOptions
    wo = WriteOptions()
    wo.disable_wal = True
    order = np.argsort(keys)
    keys, records = keys[order], records[order]
    stride = records.shape[1]
    t0 = time.perf_counter()
    for a in range(0, len(keys), CHUNK):
        wb = WriteBatch(raw_mode=True)
        put = wb.put
        vals = np.ascontiguousarray(records[a:a + CHUNK]).view(f"V{4 * stride}").ravel().tolist()
        for k, v in zip(key_bytes(keys[a:a + CHUNK]), vals):
            put(k, v)
        db.write(wb, wo)
    return len(keys) / (time.perf_counter() - t0)


def sst_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.sst"))


def main(argv=None) -> int:
    from rocksdict import DBCompressionType

    from sparse_tables.keysets import ScalableBloom
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--checkpoint", default=str(REPO / "runs" / "ckpt"))
    args = ap.parse_args(argv)
    real, dim = real_records(Path(args.checkpoint))
    rng = np.random.default_rng(0)
    keys, records = keyed_records(real, args.rows, rng)
    probe = np.sort(rng.choice(keys, min(len(keys), 4 * CHUNK), replace=False))
    absent = rng.integers(1, 2**63, 4 * CHUNK, dtype=np.uint64)
    sparse_probes = [np.sort(rng.choice(keys, min(len(keys), SPARSE_PROBE), replace=False)) for _ in range(16)]
    common = {"real_rows": len(real), "rows": args.rows, "dim": dim, "record_bytes": 4 * records.shape[1]}
    work = Path(tempfile.mkdtemp(prefix="rocksdb-bench-"))
    try:
        for name, comp in (("none", DBCompressionType.none()), ("lz4", DBCompressionType.lz4()),
                           ("zstd", DBCompressionType.zstd()), ("lz4+zstd_bottommost", DBCompressionType.lz4())):
            for block in (4096, 16384):
                path = str(work / f"{name}-{block}")
                db = open_db(path, comp, block, bloom=True,
                             bottommost=DBCompressionType.zstd() if "bottommost" in name else None)
                w = fill(db, keys, records)
                db.flush()
                db.compact_range(None, None)
                disk = sst_bytes(path)
                t0 = time.perf_counter()
                for a in range(0, len(probe), CHUNK):
                    got = db.get(key_bytes(probe[a:a + CHUNK]))
                    assert all(v is not None for v in got)
                r = len(probe) / (time.perf_counter() - t0)
                t0 = time.perf_counter()
                for sparse in sparse_probes:
                    got = db.get(key_bytes(sparse))
                    assert all(v is not None for v in got)
                sparse_r = sum(map(len, sparse_probes)) / (time.perf_counter() - t0)
                db.close()
                print(json.dumps({"bench": "compression", "compression": name, "block_size": block,
                                  "disk_bytes_per_row": round(disk / args.rows, 1),
                                  "write_rows_per_s": round(w), "read_rows_per_s": round(r),
                                  "sparse_read_rows_per_s": round(sparse_r), **common}),
                      flush=True)
        # absent keys: RocksDB's filter (with and without) against the hand-written one
        for bloom in (True, False):
            p2 = str(work / f"bloom-{bloom}")
            db = open_db(p2, DBCompressionType.none(), 4096, bloom=bloom)
            fill(db, keys, records)
            db.flush()
            db.compact_range(None, None)
            t0 = time.perf_counter()
            for a in range(0, len(absent), CHUNK):
                got = db.get(key_bytes(np.sort(absent[a:a + CHUNK])))
            ns = 1e9 * (time.perf_counter() - t0) / len(absent)
            db.close()
            print(json.dumps({"bench": "bloom", "filter": "rocksdb_bloom_10_bits" if bloom else "none",
                              "ns_per_absent_key": round(ns, 1), "false_hits": sum(v is not None for v in got),
                              **common}), flush=True)
        # restoring a spilled table: SST files written in key order and ingested, against the store's
        # sorted WriteBatches (both run one Python call per row: rocksdict has no bulk put)
        from rocksdict import IngestExternalFileOptions, Options, SstFileWriter
        db = open_db(str(work / "ingest"), DBCompressionType.none(), 4096, bloom=True)
        order = np.argsort(keys)
        sk, sr = keys[order], records[order]
        stride = records.shape[1]
        t0 = time.perf_counter()
        files = []
        for a in range(0, len(sk), 1 << 20):
            w = SstFileWriter(options=Options(raw_mode=True))
            files.append(str(work / f"part-{a}.sst"))
            w.open(files[-1])
            vals = np.ascontiguousarray(sr[a:a + (1 << 20)]).view(f"V{4 * stride}").ravel().tolist()
            for k, v in zip(key_bytes(sk[a:a + (1 << 20)]), vals):
                w[k] = v
            w.finish()
        io = IngestExternalFileOptions()
        io.set_move_files(True)
        db.ingest_external_file(files, io)
        ingest = len(keys) / (time.perf_counter() - t0)
        assert db.get(key_bytes(sk[:1]))[0] is not None
        db.close()
        db = open_db(str(work / "batches"), DBCompressionType.none(), 4096, bloom=True)
        batches = fill(db, keys, records)
        db.close()
        print(json.dumps({"bench": "restore_path", "sst_ingest_rows_per_s": round(ingest),
                          "write_batch_rows_per_s": round(batches), **common}), flush=True)
        sb = ScalableBloom()
        sb.add(keys)
        sb.may_contain(absent[:1000])
        t0 = time.perf_counter()
        maybe = sb.may_contain(absent)
        ns = 1e9 * (time.perf_counter() - t0) / len(absent)
        print(json.dumps({"bench": "bloom", "filter": "blocked_bloom_10_bits (keysets.ScalableBloom)",
                          "ns_per_absent_key": round(ns, 1), "false_positive_rate": round(float(maybe.mean()), 4),
                          "filter_bytes_per_key": round(sb.nbytes / args.rows, 2), **common}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
