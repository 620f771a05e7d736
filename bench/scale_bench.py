"""Scale: one server grows its table to 100M+ keys under a memory budget, through the real gRPC path.

Deliberate, never in CI (it writes ~25 GB at full size). One server process (``engine train --role
server``, local launcher), 2 client processes, one table: dim 16, Adagrad, ``memory_bytes`` = 4 GB
(``--quick``: 10M keys, 1 GB, so the RAM tier still fills). Each client step pulls and then pushes one
batch of 100k keys: 70% drawn Zipf(1.05) over the keys seen so far (rank r is the r-th key ever
made, so old keys are the hot ones) and 30% keys never seen. The Zipf draws are truncated to the keys
seen (``--tail truncated``, the default: P(r) proportional to r^-1.05 for r <= seen, drawn exactly by
rejecting larger ranks). Until 2026-11-27 the bench folded numpy's unbounded draws onto the keys seen
(rank mod seen; ``--tail fold``): 39-45% of the draws land beyond any table size this bench reaches,
so 27-31% of all the traffic was uniform over every key, not Zipf, and most of it missed any RAM tier. Every 10% of the target the bench prints a
``scale`` row:

    keys             distinct keys made so far (both clients)
    rss_bytes        the server's resident set (VmRSS) now
    disk_bytes       the spill directory's bytes on disk (du)
    pull_keys_per_s  keys pulled per second in the interval (both clients, wall time)
    push_keys_per_s  keys pushed per second in the interval
    p99_pull_ms      99th percentile of a pull call in the interval (client side)
    max_pull_ms      the longest pull in the interval (a client's first 5 steps excluded)
    elapsed_s        since the first step
    rows_in_ram      the RAM tier's rows (server Stats)
    promotions_per_pulled_key
                     rows read back from RocksDB in the interval / keys pulled (server Stats): the
                     miss rate of the RAM tier, which sets how far pull throughput falls once it fills
    table_call_ms_per_s
                     where the server's table calls spent their wall time in the interval, thread-ms
                     per second by part (``SparseTable.stats()``'s ``SPILL_TIME_NS`` counters, summed over
                     the shards: lock waits and locked time of pulls that missed RAM and of pushes, the
                     promotions and evictions inside them, and RocksDB's reads and writes inside those)
    us_per_miss      the same per key pulled that missed RAM in the interval (microseconds): what one
                     miss costs the server's threads, and of which part; ``us_per_promotion`` and
                     ``us_per_eviction`` give RocksDB's read and write per row moved
    rocksdb          RocksDB's running compactions, pending compaction bytes, level-0 files and write
                     stalls at the end of the interval: the p99 above is measured while it compacts;
                     ``write_stalls`` / ``write_stall_s``: the writes RocksDB refused for a stall so far
                     and the seconds they waited it out (GIL released), summed over the shards
    malloc           glibc's heap in the server (``Stats``: arenas, heap, in-use, free and mmap bytes):
                     RocksDB's block cache and memtables, request buffers and the fragments between
    governor         the server's memory governor (``engine.ps.governor``): baseline, RSS, counted
                     parts, the unaccounted rest and its high-water mark (the table's reserve), bytes

and at the end one ``scale_summary`` row: ``keys_held`` (the server's rows), ``server_rss_at_start``
(the server process before any row: Python, numpy, Numba's compiled kernels, gRPC; the constant RSS
has beyond the budget), ``rss_max_bytes`` and ``rss_max_over_budget``
(the largest RSS sampled every 0.5 s after the RAM tier first spilled / the budget; target <= 1.1;
``rss_max_over_budget_by_phase`` gives the same for the growth, the base save, the expiry pass and the
restore into a fresh server),
``throughput_ratio_last_vs_first_full`` (pull keys/s of the last row / of the first row after the RAM
tier filled; target >= 0.7), ``max_pull_ms_while_ram_tier_grows`` (the longest pull in the rows before
that one: the RAM tier only grew) and ``max_pull_ms_as_ram_tier_fills`` (the longest in that row's
interval, where eviction and RocksDB's first compactions began), ``disk_bytes_per_row`` (RocksDB's files / keys, compaction's space
amplification included; the record is 96 bytes at dim 16 Adagrad; the issue's definition, all keys counted), ``disk_bytes_per_spilled_row``
(the same over the rows only on disk, ``rows_spilled``: what ``engine plan`` sizes disk by),
``disk_peak_over_live`` (the spill directory's bytes and the server's rows on disk, sampled every 5 s of
every phase: the largest bytes / (rows on disk x ``disk_bytes_per_spilled_row``), where a compaction
held its inputs and outputs at once; with ``disk_peak``, the sample, ``disk_peak_bytes_by_phase`` and
``disk_peak_over_live_by_phase``; the bytes include files under the spill directory that the server holds
open unlinked, as a base save's spool of the RAM tier), ``base_save_s`` and ``restore_s``
(a base checkpoint of the whole table to local disk and its restore into a fresh server; target >= 1M
rows/s each, also given as ``*_rows_per_s``), ``shrink_s`` (an expiry pass over all rows), the delta
path (on the restored server, the same traffic until a tenth of ``--keys`` more new keys, then a delta
checkpoint on top of the base: ``delta_rows``, ``delta_save_s``, ``delta_save_rows_per_s``; then the
base + delta chain restored into a third server: ``chain_restore_s``, of it ``chain_delta_s`` (the
delta's load, also as ``chain_delta_rows_per_s``) with ``chain_delta_point_reads`` (RocksDB point reads
during it), and ``keys_restored_chain``, which must equal ``keys_before_delta``), and the server's memory parts (``memory``, ``memory_budget``) from its
Stats.

The free disk is checked first (a row costs ~115 bytes in RocksDB and a base save as much again); when
it is short the bench says so and stops.

``--growth`` measures only the growth pause, in-process: the longest push (a pull waits for it) while a
RAM tier grows to 30M rows, for a table that grows by doubling (``memory_rows``) and one a budget sized
once (``memory_bytes``): ``scale_growth`` rows with ``max_push_ms``, ``p99_push_ms``, ``max_pull_ms``.

    python bench/scale_bench.py [--quick] [--keys N] [--budget-gb G] [--tail truncated|fold] [--eviction slru|lru]
                                [--compaction level|universal]
                                [--work DIR] [--keep] [--growth]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _procstat import cpu_split  # noqa: E402
from sparse_tables._spill_tier import SPILL_TIME_NS  # noqa: E402

DIM = 16
BATCH = 100_000
NEW_FRACTION = 0.3
WARMUP_STEPS = 5                       # a client's first steps (connections, first-touch) are not timed for max_pull_ms
ZIPF_S = 1.05
DISK_BYTES_PER_KEY = 2 * 115 + 20      # RocksDB + a base save, with room for compaction's files
DISK_SAMPLE_S = 5.0                    # the spill directory's bytes and rows on disk, sampled this often


def key_of(ids: np.ndarray) -> np.ndarray:
    """The uint64 key of each id (splitmix64: ids 0, 1, 2 ... become scattered keys)."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def zipf_ranks(rng, m: int, seen: int, tail: str) -> np.ndarray:
    """m ranks in [0, seen), int64[m], Zipf(ZIPF_S): truncated to the keys seen (exact, by rejection:
    numpy's draws are unbounded) or, with ``tail="fold"``, the unbounded draws folded modulo seen."""
    if tail == "fold":
        return (rng.zipf(ZIPF_S, m) - 1) % seen
    parts, got = [], 0
    while got < m:
        x = rng.zipf(ZIPF_S, 2 * (m - got) + 1024)
        x = x[x <= seen][:m - got]
        parts.append(x)
        got += len(x)
    return np.concatenate(parts) - 1


def client_main(args) -> None:
    """One client: steps until the clients together made ``--keys`` keys; one JSON line per step."""
    from engine.ps import PSClient
    rng = np.random.default_rng(1000 + args.rank + args.offset)
    c = PSClient(args.endpoints.split(","), name=f"scale{args.rank}")
    n_new = int(BATCH * NEW_FRACTION)
    made = 0                     # ids this client made: offset + rank, offset + rank + 2, ...
    offset = args.offset         # ids both clients made before (a later phase goes on from there)
    grads = np.full((BATCH, DIM), 0.001, np.float32)
    mine = args.keys // 2
    step = -1
    while made < mine:
        step += 1
        seen = max(1, offset + 2 * made)
        hot = zipf_ranks(rng, BATCH - n_new, seen, args.tail)         # ranks over ids seen by both
        new = offset + args.rank + 2 * np.arange(made, min(mine, made + n_new))
        made += len(new)
        keys = np.unique(key_of(np.concatenate([hot, new])))
        t0 = time.perf_counter()
        c.pull("emb", keys, init_missing=True)
        t1 = time.perf_counter()
        c.push("emb", keys, grads[:len(keys)])
        t2 = time.perf_counter()
        print(json.dumps({"rank": args.rank, "step": step, "made": int(len(new)), "keys": int(len(keys)), "pull_s": t1 - t0,
                          "push_s": t2 - t1, "t": t2}), flush=True)
    c.close()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_parts(pid: int) -> dict:
    """The server's resident memory by kind (``/proc/PID/smaps_rollup``), bytes: anonymous (heap,
    arena, index, RocksDB's cache), anonymous in transparent huge pages, and file-backed."""
    out = {}
    names = {"Anonymous:": "rss_anon", "AnonHugePages:": "rss_anon_huge", "Rss:": "rss"}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] in names:
                out[names[parts[0]]] = int(parts[1]) * 1024
    out["rss_file"] = out.get("rss", 0) - out.get("rss_anon", 0)
    return out


class PhasePeaks:
    """The largest RSS of a process per phase, sampled every 0.5 s from a thread: ``phase(name)``
    starts a phase (None: not recorded), ``peaks`` holds {phase: bytes}. ``phase(name, pid, endpoints)``
    also switches the process watched (a restore's fresh server) and the server whose rows are counted.

    Every ``DISK_SAMPLE_S`` seconds of a phase it also samples the spill directory's bytes (``spill``)
    and, through the server's Stats, the rows only on disk at that moment: ``disk_samples`` holds
    ``(phase, bytes, rows_spilled)``, from which ``disk_peak`` finds the largest bytes per live row (a
    compaction holds its input files until its output is written: RocksDB's temporary space)."""

    def __init__(self, pid: int, spill: Path | None = None, endpoints: list[str] | None = None):
        self.pid, self.current, self.peaks = pid, None, {}
        self.spill, self.endpoints, self.disk_samples = spill, endpoints, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def phase(self, name: str | None, pid: int | None = None, endpoints: list[str] | None = None) -> None:
        self.pid = pid or self.pid
        self.endpoints = endpoints or self.endpoints
        self.current = name

    def _run(self) -> None:
        from engine.ps import PSClient
        client, client_eps, tick = None, None, 0
        while not self._stop.wait(0.5):
            name = self.current
            if name is None:
                continue
            try:
                r = rss_bytes(self.pid)
            except OSError:
                continue            # the process ended between phases
            self.peaks[name] = max(self.peaks.get(name, 0), r)
            tick += 1
            if self.spill is None or not self.endpoints or tick % int(DISK_SAMPLE_S / 0.5):
                continue
            try:
                if client_eps != self.endpoints:
                    if client is not None:
                        client.close()
                    # a short deadline, no retries: a sample that waits would pair old bytes with new rows
                    client = PSClient(self.endpoints, name="scale-disk", timeout_s=2.0, retries=0)
                    client_eps = self.endpoints
                spilled = table_stats(client)["rows_spilled"]
                size = dir_bytes(self.spill) + unlinked_bytes(self.pid, self.spill)
            except Exception:       # noqa: BLE001 - a server between phases, or a Stats call that timed out
                continue
            self.disk_samples.append((name, size, spilled))
        if client is not None:
            client.close()

    def disk_peak(self, bytes_per_spilled_row: float, min_rows: int) -> dict:
        """The sample with the most bytes per row on disk, against ``bytes_per_spilled_row`` (the end
        of the growth's): ``over_live`` = bytes / (rows_spilled x bytes_per_spilled_row), over samples
        with at least ``min_rows`` rows on disk (a first flush's files over a few rows say nothing of
        a full server); also the largest bytes by phase."""
        by_phase: dict[str, int] = {}
        over_by_phase: dict[str, float] = {}
        best = None
        for name, size, rows in self.disk_samples:
            by_phase[name] = max(by_phase.get(name, 0), size)
            if rows > 0 and rows >= min_rows and bytes_per_spilled_row > 0:
                over = size / (rows * bytes_per_spilled_row)
                over_by_phase[name] = max(over_by_phase.get(name, 0.0), round(over, 3))
                if best is None or over > best["over_live"]:
                    best = {"over_live": round(over, 3), "phase": name, "bytes": size, "rows_spilled": rows}
        return {"peak": best, "bytes_by_phase": by_phase, "over_live_by_phase": over_by_phase,
                "samples": len(self.disk_samples)}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass        # a compaction removed it
    return total


def unlinked_bytes(pid: int, under: Path) -> int:
    """Bytes on disk of the files under ``under`` that process ``pid`` holds open after unlinking them
    (a base save's spool of the RAM tier's rows, ``sparse_tables._snapshot``): ``du`` no longer sees them."""
    files, prefix = {}, str(under.resolve())
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(prefix) and target.endswith(" (deleted)"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                files[(st.st_dev, st.st_ino)] = st.st_blocks * 512      # a file open twice counts once
        except OSError:
            pass            # closed meanwhile
    return sum(files.values())


def call_breakdown(ts: dict, prev: dict, span_s: float) -> dict:
    """The server's table-call time between two ``table_stats`` readings ``span_s`` seconds apart:
    ``table_call_ms_per_s`` (thread-ms per wall second by part), ``us_per_miss`` (the same per pulled key
    that missed RAM), ``us_per_promotion`` (promotion and its RocksDB read per row read back) and
    ``us_per_eviction`` (eviction and its RocksDB write per row written out)."""
    d = {k: ts.get(k, 0) - prev.get(k, 0) for k in SPILL_TIME_NS + ("pull_misses", "promotions", "evictions")}
    parts = [k[:-3] for k in SPILL_TIME_NS]
    misses, promos, evicted = max(1, d["pull_misses"]), max(1, d["promotions"]), max(1, d["evictions"])
    return {"table_call_ms_per_s": {p: round(d[p + "_ns"] / 1e6 / max(span_s, 1e-9), 1) for p in parts},
            "us_per_miss": {p: round(d[p + "_ns"] / 1e3 / misses, 2) for p in parts},
            "us_per_promotion": {p: round(d[p + "_ns"] / 1e3 / promos, 2) for p in ("promote", "promote_read", "promote_read_cpu")},
            "us_per_eviction": {p: round(d[p + "_ns"] / 1e3 / evicted, 2) for p in ("evict", "evict_write", "evict_write_cpu")}}


def table_stats(client) -> dict:
    """The bench table's statistics on server 0 (its Stats RPC)."""
    return client.stats()[0]["sparse"]["emb"]


def interval_row(window: list[dict], keys: int, pid: int, work: Path, budget: int, t_start: float,
                 spilled: bool) -> dict:
    """One ``scale`` row from the client steps of an interval. A client's rate is its keys over the
    time it spent in that call; the row sums the two clients' rates (they call concurrently)."""
    def rate(op: str) -> float:
        total = 0.0
        for r in (0, 1):
            mine = [s for s in window if s["rank"] == r]
            t = sum(s[op] for s in mine)
            total += sum(s["keys"] for s in mine) / t if t > 0 else 0.0
        return total
    warm = [s for s in window if s["step"] >= WARMUP_STEPS]
    return {"bench": "scale", "keys": keys, "rss_bytes": rss_bytes(pid), "disk_bytes": dir_bytes(work / "spill"),
            "pull_keys_per_s": round(rate("pull_s")), "push_keys_per_s": round(rate("push_s")),
            "p99_pull_ms": round(1e3 * float(np.percentile([s["pull_s"] for s in window], 99)), 1)
            if window else None,
            "max_pull_ms": round(1e3 * max(s["pull_s"] for s in warm), 1) if warm else None,
            "elapsed_s": round(time.perf_counter() - t_start, 1), "budget_bytes": budget,
            "ram_tier_spilled": spilled}


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def config(work: Path, budget: int, eviction: str = "slru", compaction: str = "level"):
    from engine.config import from_dict
    return from_dict({
        "cluster": {"servers": 1, "workers": 2},
        "tables": {"sparse": {"emb": {"dim": DIM, "optimizer": "adagrad", "learning_rate": 0.05,
                                      "memory_bytes": budget, "spill_path": str(work / "spill"),
                                      "eviction": eviction, "spill_compaction": compaction}}},
        "checkpoint": {"root": str(work / "ckpt")}})


def client_cmd(eps: list[str], args, rank: int, keys: int, offset: int = 0) -> list[str]:
    """The command line of client ``rank``: it steps until both clients made ``keys`` keys after the
    ``offset`` ids made before."""
    return [sys.executable, __file__, "--client", "--rank", str(rank), "--endpoints", ",".join(eps),
            "--keys", str(keys), "--offset", str(offset), "--tail", args.tail]


def run_clients(eps: list[str], args, keys: int, offset: int) -> None:
    """Run both clients until they made ``keys`` more keys after the ``offset`` ids made before (their
    step lines are not needed here). Raises SystemExit when a client fails."""
    procs = [subprocess.Popen(client_cmd(eps, args, r, keys, offset), stdout=subprocess.DEVNULL)
             for r in range(2)]
    try:
        for p in procs:
            p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"scale_bench: a client exited with {[p.returncode for p in procs]}")


def growth_pause(rows: int, budget: int, work: Path) -> list[dict]:
    """The longest call while a RAM tier grows to ``rows`` rows, in this process: a table that grows
    by doubling (``memory_rows``: arena copies and index rehashes under the lock) against one sized once
    by a budget (``memory_bytes``). A pull waits for the push that holds the lock, so the longest push
    is the longest a pull can wait. Pushes of 100k new keys, a pull of 100k seen keys after each."""
    from sparse_tables import SparseTable, TableConfig
    out = []
    for kind in ("doubling", "budget"):
        extra = ({"memory_rows": rows + (1 << 20)} if kind == "doubling" else {"memory_bytes": budget})
        t = SparseTable(TableConfig(dim=DIM, optimizer="adagrad", spill_path=str(work / f"growth-{kind}"),
                                    **extra))
        grads = np.full((BATCH, DIM), 0.001, np.float32)
        rng = np.random.default_rng(5)
        push_ms, pull_ms = [], []
        for start in range(0, rows, BATCH):
            keys = key_of(np.arange(start, min(rows, start + BATCH)))
            t0 = time.perf_counter()
            t.push(keys, grads[:len(keys)])
            t1 = time.perf_counter()
            t.pull(key_of(rng.integers(0, start + len(keys), BATCH)))
            t2 = time.perf_counter()
            push_ms.append(1e3 * (t1 - t0))
            pull_ms.append(1e3 * (t2 - t1))
        st = t.stats()
        t.close()
        out.append({"bench": "scale_growth", "table": kind, "rows": st["rows_in_ram"],
                    "max_push_ms": round(max(push_ms), 1), "p99_push_ms": round(float(np.percentile(push_ms, 99)), 1),
                    "median_push_ms": round(float(np.median(push_ms)), 1), "max_pull_ms": round(max(pull_ms), 1),
                    "index_slots": st["index_slots"], "budget_bytes": budget if kind == "budget" else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10M keys, a 1 GB budget")
    ap.add_argument("--keys", type=int, default=0, help="target distinct keys (default 100M; quick 10M)")
    ap.add_argument("--budget-gb", type=float, default=0.0, help="memory_bytes in GB (default 4; quick 1)")
    ap.add_argument("--work", default=str(REPO / "runs" / "scale"))
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tail", choices=("truncated", "fold"), default="truncated",
                    help="Zipf draws truncated to the keys seen (default), or folded modulo seen as before "
                         "2026-11-27 (a uniform share of ~30%% of the traffic)")
    ap.add_argument("--eviction", choices=("slru", "lru"), default="slru",
                    help="the table's eviction order (TableConfig.eviction)")
    ap.add_argument("--compaction", choices=("level", "universal"), default="level",
                    help="RocksDB's compaction of the spill store (TableConfig.spill_compaction)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (the base checkpoint under WORK/ckpt: profile a restore of it)")
    ap.add_argument("--growth", action="store_true",
                    help="only the growth pause: a RAM tier of 30M rows (quick: 3M), doubling vs budget")
    args = ap.parse_args(argv)
    args.keys = args.keys or (10_000_000 if args.quick else 100_000_000)
    if args.client:
        client_main(args)
        return 0
    if args.growth:
        work = Path(args.work)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        rows = 3_000_000 if args.quick else 30_000_000
        for rec in growth_pause(rows, int((args.budget_gb or (0.5 if args.quick else 4.0)) * 1e9), work):
            emit(rec)
        shutil.rmtree(work, ignore_errors=True)
        return 0
    budget = int((args.budget_gb or (1.0 if args.quick else 4.0)) * 1e9)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    need = args.keys * DISK_BYTES_PER_KEY
    free = shutil.disk_usage(work).free
    if free < need:
        emit({"bench": "scale_disk_short", "free_bytes": free, "needed_bytes": need, "keys": args.keys,
              "work": str(work)})
        print(f"scale_bench: {work} has {free / 1e9:.1f} GB free; {args.keys} keys need about "
              f"{need / 1e9:.1f} GB (RocksDB ~115 B per key and a base save as much again): choose "
              f"--work on a larger disk or fewer --keys", file=sys.stderr)
        return 1
    from engine.checkpoint import CheckpointManager
    from engine.launch.local import LocalCluster
    from engine.ps import PSClient
    cfg = config(work, budget, args.eviction, args.compaction)
    out = {}
    with LocalCluster(cfg, work / "run") as cl:
        eps = cl.start_servers()
        pid = cl.pids()[0]
        admin = PSClient(eps, name="scale-admin")
        rss_at_start = rss_bytes(pid)
        clients = [subprocess.Popen(client_cmd(eps, args, r, args.keys), stdout=subprocess.PIPE, text=True)
                   for r in range(2)]
        lock = threading.Lock()
        steps: list[dict] = []

        def read(p):
            for line in p.stdout:
                with lock:
                    steps.append(json.loads(line))
        readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in clients]
        for t in readers:
            t.start()
        spilled = False             # whether the RAM tier has spilled: RSS peaks are recorded from then on
        peaks = PhasePeaks(pid, work / "spill", eps)
        t_start = time.perf_counter()
        rows, first_full = [], None
        seen, mark, taken, since, promoted = 0, args.keys // 10, 0, 0, 0
        prev_ts, prev_t = table_stats(admin), time.perf_counter()
        client_cpu: dict[int, float] = {}
        cpu_before, wall_before, seen_before = cpu_split(pid, [p.pid for p in clients], client_cpu), t_start, 0
        while True:
            running = any(p.poll() is None for p in clients)
            with lock:
                new_steps, taken = steps[taken:], len(steps)
            seen += sum(s["made"] for s in new_steps)
            if not spilled and new_steps:
                spilled = table_stats(admin)["rows_spilled"] > 0
                peaks.phase("growth" if spilled else None)
            if seen >= mark or (not running and since < taken):
                with lock:
                    window = steps[since:taken]
                since = taken
                rec = interval_row(window, seen, pid, work, budget, t_start, spilled)
                server = admin.stats()[0]
                ts = server["sparse"]["emb"]
                pulled = sum(s["keys"] for s in window)
                rec.update(rows_in_ram=ts["rows_in_ram"], rocksdb=ts.get("rocksdb"), **rss_parts(pid),
                           malloc=server.get("malloc"), governor=server.get("memory_governor"),
                           promotions_per_pulled_key=round((ts["promotions"] - promoted) / max(1, pulled), 4),
                           table_memory=sum(v for k, v in ts.get("memory", {}).items()
                                            if k not in ("rocksdb_memtables", "rocksdb_table_readers")))
                promoted = ts["promotions"]
                now = time.perf_counter()
                rec.update(call_breakdown(ts, prev_ts, now - prev_t))
                prev_ts, prev_t = ts, now
                # where the machine's cores went in the interval, and the wall rate of new keys (each one
                # is written to RocksDB once it leaves the RAM tier: the ingest compaction has to keep up with)
                cpu_now, wall_now = cpu_split(pid, [p.pid for p in clients], client_cpu), time.perf_counter()
                span = max(1e-9, wall_now - wall_before)
                rec.update(cpu_cores={k: round((cpu_now[k] - cpu_before[k]) / span, 3) for k in cpu_now},
                           new_keys_per_s=round((seen - seen_before) / span))
                cpu_before, wall_before, seen_before = cpu_now, wall_now, seen
                emit(rec)
                rows.append(rec)
                if rec["ram_tier_spilled"] and first_full is None:
                    first_full = rec
                mark = (seen // (args.keys // 10) + 1) * (args.keys // 10)
            if not running and since >= len(steps):
                break
            time.sleep(0.2)
        peaks.phase(None)
        for p in clients:
            if p.wait() != 0:
                raise SystemExit(f"scale_bench: client exited with {p.returncode}")
        table = table_stats(admin)
        out.update(rows_in_ram=table["rows_in_ram"], keys_held=table["rows"], rows_spilled=table["rows_spilled"], memory=table.get("memory"), memory_budget=table.get("memory_budget"),
                   rocksdb=table.get("rocksdb"))
        disk = dir_bytes(work / "spill")
        t0 = time.perf_counter()
        mgr = CheckpointManager(str(work / "ckpt"), "scale")
        peaks.phase("base_save")
        mgr.save(admin, "base", when=0.0)
        out["base_save_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        peaks.phase("shrink")
        out["shrink_rows_deleted"] = admin.shrink("emb")
        out["shrink_s"] = round(time.perf_counter() - t0, 1)
        peaks.phase(None)
        admin.close()
        cl.stop_servers()
    shutil.rmtree(work / "spill", ignore_errors=True)
    cfg2 = config(work, budget, args.eviction, args.compaction)
    delta_keys = args.keys // 10
    with LocalCluster(cfg2, work / "run2") as cl:
        eps = cl.start_servers()
        with PSClient(eps, name="scale-restore") as c:
            t0 = time.perf_counter()
            peaks.phase("restore", cl.pids()[0], eps)
            mgr = CheckpointManager(str(work / "ckpt"), "scale")
            mgr.restore(c)
            out["restore_s"] = round(time.perf_counter() - t0, 1)
            peaks.phase(None)
            restored = table_stats(c)["rows"]
            # the delta path at this size: the same traffic with delta_keys more new keys (their rows and
            # the old rows it updates are the delta), then a delta checkpoint on top of the base
            t0 = time.perf_counter()
            peaks.phase("delta_traffic")
            run_clients(eps, args, delta_keys, offset=args.keys)
            out["delta_traffic_s"] = round(time.perf_counter() - t0, 1)
            out["keys_before_delta"] = table_stats(c)["rows"]
            t0 = time.perf_counter()
            peaks.phase("delta_save")
            manifest = mgr.save(c, "delta", when=3600.0)
            out["delta_save_s"] = round(time.perf_counter() - t0, 1)
            peaks.phase(None)
            out["delta_kind"] = manifest["kind"]
            out["delta_rows"] = sum(t["rows"] for t in manifest["tables"]["sparse"].values())
        cl.stop_servers()
    shutil.rmtree(work / "spill", ignore_errors=True)
    with LocalCluster(config(work, budget, args.eviction, args.compaction), work / "run3") as cl:
        eps = cl.start_servers()
        with PSClient(eps, name="scale-chain") as c:
            t0 = time.perf_counter()
            peaks.phase("chain_restore", cl.pids()[0], eps)
            mgr = CheckpointManager(str(work / "ckpt"), "scale")
            chain = [r.name for r in mgr.list()]        # the base, then the delta (as restore loads them)
            t1, reads = time.perf_counter(), 0
            for i, name in enumerate(chain):
                if i == len(chain) - 1:
                    t1, reads = time.perf_counter(), table_stats(c)["rocksdb"]["point_reads"]
                c.load(mgr.uri_of(name))
            out["chain_restore_s"] = round(time.perf_counter() - t0, 1)
            out["chain_delta_s"] = round(time.perf_counter() - t1, 1)
            peaks.phase(None)
            stats = table_stats(c)
            out["keys_restored_chain"] = stats["rows"]
            out["chain_delta_point_reads"] = stats["rocksdb"]["point_reads"] - reads
        cl.stop_servers()
    peaks.stop()
    last = rows[-1]
    rss_max = peaks.peaks.get("growth", 0)
    per_spilled = disk / out["rows_spilled"] if out["rows_spilled"] else None      # None: nothing spilled
    dpeak = peaks.disk_peak(per_spilled or 0.0, out["rows_spilled"] // 4)
    summary = {
        "bench": "scale_summary", "target_keys": args.keys, "tail": args.tail, "eviction": args.eviction, "compaction": args.compaction, "keys_held": out["keys_held"],
        "keys_restored": restored, "budget_bytes": budget, "server_rss_at_start": rss_at_start,
        "rss_max_bytes": rss_max,
        "rss_max_over_budget": round(rss_max / budget, 3) if rss_max else None,
        # the same during the base save, the expiry pass and the restore (a fresh server)
        "rss_max_over_budget_by_phase": {k: round(v / budget, 3) for k, v in peaks.peaks.items()},
        "throughput_ratio_last_vs_first_full": (round(last["pull_keys_per_s"] / first_full["pull_keys_per_s"], 3)
                                                if first_full else None),
        "first_full_keys": first_full["keys"] if first_full else None,
        # the RAM tier's growth (no rehash or arena copy under a budget): the longest pull in the intervals
        # that ended before it spilled; then the longest in the interval in which it filled and eviction,
        # RocksDB's first flushes and compactions began (until the seventeenth session the first figure
        # took both, and the second set it)
        "max_pull_ms_while_ram_tier_grows": max([(r["max_pull_ms"] or 0) for r in rows[:rows.index(first_full)]]
                                                or [None]) if first_full else None,
        "max_pull_ms_as_ram_tier_fills": first_full["max_pull_ms"] if first_full else None,
        "ram_rows_at_full": out["rows_in_ram"],
        "disk_bytes_per_row": round(disk / max(1, out["keys_held"]), 1), "record_bytes": 96,
        # per row only on disk (rows in RAM keep no copy there, or one counted in RocksDB's files: the plan
        # sizes disk by these rows), and the largest bytes per such row sampled over the whole bench (a
        # compaction's inputs and outputs at once; rows_spilled a quarter of the growth's end at least)
        "rows_spilled": out["rows_spilled"], "disk_bytes_per_spilled_row": round(per_spilled, 1) if per_spilled else None,
        "disk_peak_over_live": dpeak["peak"]["over_live"] if dpeak["peak"] else None,
        "disk_peak": dpeak["peak"], "disk_peak_bytes_by_phase": dpeak["bytes_by_phase"],
        "disk_peak_over_live_by_phase": dpeak["over_live_by_phase"],
        "disk_samples": dpeak["samples"],
        "base_save_s": out["base_save_s"], "base_save_rows_per_s": round(out["keys_held"] / out["base_save_s"]),
        "restore_s": out["restore_s"], "restore_rows_per_s": round(restored / out["restore_s"]),
        "shrink_s": out["shrink_s"],
        # a delta after delta_keys more new keys on the restored server, and the base + delta chain
        # restored into a fresh one (keys_restored_chain must equal keys_before_delta)
        "delta_new_keys": delta_keys, "delta_traffic_s": out["delta_traffic_s"], "delta_kind": out["delta_kind"],
        "delta_rows": out["delta_rows"], "delta_save_s": out["delta_save_s"],
        "delta_save_rows_per_s": round(out["delta_rows"] / max(out["delta_save_s"], 1e-3)),
        "keys_before_delta": out["keys_before_delta"], "keys_restored_chain": out["keys_restored_chain"],
        "chain_restore_s": out["chain_restore_s"], "chain_delta_s": out["chain_delta_s"],
        "chain_delta_rows_per_s": round(out["delta_rows"] / max(out["chain_delta_s"], 1e-3)),
        # RocksDB point reads during the delta's load (a delta's ``existed`` spares them, sparse_tables._delta)
        "chain_delta_point_reads": out["chain_delta_point_reads"],
        "memory": out["memory"], "memory_budget": out["memory_budget"],
        # RocksDB at the end of the growth, summed over the shards: compaction's backlog, and the seconds
        # eviction writes waited out write stalls (GIL released: other requests went on meanwhile)
        "rocksdb_at_end": out["rocksdb"],
        "cpus_granted": len(os.sched_getaffinity(0))}
    emit(summary)
    if out["keys_restored_chain"] != out["keys_before_delta"]:
        print(f"scale_bench: the base + delta chain restored {out['keys_restored_chain']} keys; the server "
              f"held {out['keys_before_delta']} when the delta was written", file=sys.stderr)
        return 1
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
