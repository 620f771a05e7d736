"""Whether a server keeps answering ``Health`` while it restores a big base checkpoint: the launcher
watches its own restore (``LocalCluster.supervised``) and declares a server silent for
``client.dead_after_s`` (default 30 s) dead, so a Load that starved the Health handler would restart
the job forever. Outside CI.

A base of ``--rows`` rows of the CTR config's ``embedding`` table (dim 10, Adagrad) is written by an
in-process server; a real server process (``engine train configs/ctr.yaml --role server``, optionally
spilling with ``--spill``: RocksDB, ``--memory-rows`` per shard in RAM) restores it through the real
Load RPC while the launcher's ``ServerWatch`` polls its Health every second. Prints one JSON line::

    {"bench": "restore_health", "rows": ..., "spill": ..., "restore_s": ..., "max_health_gap_s": ...}

``max_health_gap_s``: the longest time without a Health answer during the restore (1 s = every poll
answered).

    python bench/restore_health_bench.py [--rows 10000000] [--spill] [--memory-rows 250000]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.checkpoint import CheckpointManager  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.connect import connect  # noqa: E402
from engine.launch.local import ServerWatch  # noqa: E402
from engine.ps import InProcessTransport, PSClient, PSServer  # noqa: E402
sys.path.insert(0, str(REPO / "bench"))
from ckpt_bench import fill  # noqa: E402


def write_base(cfg, mgr: CheckpointManager, rows: int) -> None:
    """A base of ``rows`` random rows (values, Adagrad accumulator, show/click) of ``embedding``."""
    tcfg = dataclasses.replace(cfg.sparse_tables["embedding"], spill_path=None)
    srv = PSServer({"embedding": tcfg}, {}, index=0, num_servers=1, num_vshards=cfg.cluster.num_vshards,
                   local_shards=cfg.cluster.local_shards)
    fill([srv], rows, tcfg.dim, table="embedding", num_vshards=cfg.cluster.num_vshards)
    mgr.save(PSClient(InProcessTransport([srv], serialize=False), timeout_s=3600), "base", when=0.0)
    srv.close()


def start_server(work: Path, sets: list[str]) -> tuple[subprocess.Popen, str]:
    """A real server process on a free port it binds itself; returns it and its ``host:port``."""
    ready = work / "server.ready"
    proc = subprocess.Popen([sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"),
                             *[a for s in sets for a in ("--set", s)], "--role", "server", "--rank", "0",
                             "--port", "0", "--ready-file", str(ready)], cwd=REPO,
                            env={**os.environ, "ENGINE_NUM_WORKERS": "2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"the server did not start (exit {proc.poll()})")
        time.sleep(0.1)
    return proc, ready.read_text().strip()


def measure(work: Path, rows: int, spill: bool, memory_rows: int) -> dict:
    sets = [f"checkpoint.root={work / 'ckpt'}"]
    if spill:
        sets += [f"tables.sparse.embedding.spill_path={work / 'spill'}",
                 f"tables.sparse.embedding.memory_rows={memory_rows}"]
    cfg = load_config(REPO / "configs/ctr.yaml", sets)
    mgr = CheckpointManager(str(work / "ckpt"), cfg.checkpoint.job)
    write_base(cfg, mgr, rows)
    proc, ep = start_server(work, sets)
    try:
        with connect(cfg, [ep], name="bench", admin=True) as client:
            client.wait_ready(120)
            watch = ServerWatch([ep], dead_after_s=cfg.client.dead_after_s)
            took: dict = {}

            def restore() -> None:
                t0 = time.monotonic()
                mgr.restore(client)
                took["s"] = time.monotonic() - t0
            t = threading.Thread(target=restore)
            t.start()
            worst = 0.0
            while t.is_alive():
                worst = max(worst, time.monotonic() - max(watch._last_ok))
                time.sleep(0.05)
            t.join()
            watch.close()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return {"bench": "restore_health", "rows": rows, "spill": spill,
            "memory_rows_per_shard": memory_rows if spill else None, "restore_s": round(took["s"], 2),
            "max_health_gap_s": round(worst, 2), "health_poll_every_s": 1.0,
            "dead_after_s": cfg.client.dead_after_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--spill", action="store_true")
    ap.add_argument("--memory-rows", type=int, default=250_000)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    a = ap.parse_args()
    print(json.dumps({"bench": "machine", "os_cpu_count": os.cpu_count(),
                      "sched_getaffinity_cpus": len(os.sched_getaffinity(0))}), flush=True)
    with tempfile.TemporaryDirectory(prefix="restore-health-", dir=a.dir) as tmp:
        print(json.dumps(measure(Path(tmp), a.rows, a.spill, a.memory_rows)), flush=True)


if __name__ == "__main__":
    main()
