"""A budgeted server's malloc (``engine.ps._malloc``) and memory governor (``engine.ps.governor``) in a
real ``--role server`` process: its arena limit takes effect however many threads serve it, and glibc's
account of the heap and the governor's reading reach ``Stats``, the budget and the Prometheus scrape."""
from __future__ import annotations

import threading

import numpy as np

from engine.ps import PSClient
from engine.ps._malloc import BUDGET_ARENAS

from .test_observability import role_server, scrape


def _traffic(ep: str, rank: int, rounds: int, errors: list) -> None:
    try:
        rng = np.random.default_rng(rank)
        with PSClient([ep], timeout_s=60, retries=1, name=f"malloc-{rank}") as c:
            for _ in range(rounds):
                keys = rng.integers(1, 1 << 40, 20_000, dtype=np.uint64)
                c.push("embedding", keys, np.full((len(keys), 10), 0.01, np.float32))
                c.pull("embedding", keys)
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(f"client {rank}: {e!r}")


def test_a_budgeted_server_keeps_its_malloc_arenas_bounded_under_concurrent_calls(tmp_path):
    """Eight clients at once on a server with eight RPC threads and a spilling table: glibc would give
    each allocating thread an arena (up to 8 per core); the server asked for ``BUDGET_ARENAS`` before it
    started any thread, and ``Stats``/metrics report glibc's own count and heap."""
    with role_server(tmp_path, "cluster.server_threads=8", "tables.sparse.embedding.memory_bytes=200000000",
                     f"tables.sparse.embedding.spill_path={tmp_path / 'spill'}") as (proc, ep, url):
        errors: list[str] = []
        threads = [threading.Thread(target=_traffic, args=(ep, r, 15, errors)) for r in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        with PSClient([ep], timeout_s=20, retries=1) as c:
            (stats,) = c.stats()
            m = stats["malloc"]
            assert 1 <= m["arenas"] <= BUDGET_ARENAS, m
            assert m["heap_bytes"] >= m["in_use_bytes"] > 1 << 20 and m["free_bytes"] >= 0, m
            assert stats["sparse"]["embedding"]["rows_spilled"] > 0      # the RocksDB tier worked too
            g = stats["memory_governor"]          # engine.ps.governor: reads RSS every second
            assert 0 < g["baseline_bytes"] < g["rss_bytes"] and g["counted_bytes"] > 0, g
            assert g["high_water_bytes"] >= g["unaccounted_bytes"] >= 0, g
            budget = stats["sparse"]["embedding"]["memory_budget"]
            assert budget["reserve"] == max(budget["unaccounted"], 4_000_000)      # 2% of 200 MB
            for _ in range(5):          # the only table: its share is all (unless a step fell between)
                if budget["unaccounted"] == g["high_water_bytes"]:
                    break
                (again,) = c.stats()
                g, budget = again["memory_governor"], again["sparse"]["embedding"]["memory_budget"]
            assert budget["unaccounted"] == g["high_water_bytes"], (budget, g)
            got = scrape(url)
            assert got["engine_ps_memory_governor_bytes", (("part", "baseline"),)] == g["baseline_bytes"]
            assert got["engine_ps_malloc_arenas", ()] == m["arenas"]
            assert got["engine_ps_malloc_bytes", (("state", "in_use"),)] > 0
            c.stop()
        proc.wait(timeout=30)
