"""The memory governor (``engine.ps.governor``) on a real budgeted table: RSS beyond the counted parts
becomes the budget's reserve, the RAM tier gives up rows for it (compacting its arena, losing no row),
and the high-water mark holds that room for its window, then lets it go."""
from __future__ import annotations

import numpy as np

from engine.ps.governor import MemoryGovernor, rss_bytes
from tests.unit.test_memory_budget import DIM, MiB, _budgeted_and_reference, _keys


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rss_beyond_the_parts_becomes_the_reserve_and_the_ram_tier_gives_it_room(tmp_path):
    t, ref = _budgeted_and_reference(tmp_path)
    b = t.budget
    for i in range(5):
        k = _keys(150_000, i)
        t.push(k, np.ones((len(k), DIM), np.float32))
        ref.push(k, np.ones((len(k), DIM), np.float32))
    cap, reserve = b.rows_cap(), b.parts()["reserve"]
    extra = [12 * MiB]             # what RSS shows beyond the parts: allocator fragments, buffers
    baseline = 300 * MiB
    clock = Clock()
    gov = MemoryGovernor(lambda: [b, b], baseline, window_s=60.0,
                         rss=lambda: baseline + b.counted_bytes() + extra[0], clock=clock)
    got = gov.step()
    assert got["unaccounted_bytes"] == got["high_water_bytes"] == 12 * MiB       # one budget, counted once
    assert b.parts()["reserve"] == b.parts()["unaccounted"] == 12 * MiB > reserve
    cap_now = b.rows_cap()
    assert cap_now <= cap - (12 * MiB - reserve) // t.layout.row_bytes
    k = _keys(50_000, 99)
    t.push(k, np.ones((len(k), DIM), np.float32))                # the next call obeys the lower cap
    ref.push(k, np.ones((len(k), DIM), np.float32))
    st = t.stats()
    assert st["rows_in_ram"] <= cap_now and st["compactions"] >= 1
    assert st["memory"]["rows"] <= b.rows_allowed() * st["row_bytes"]
    for seed in (0, 2, 4, 99):                                    # nothing lost on the way
        probe = _keys(150_000, seed) if seed != 99 else k
        np.testing.assert_array_equal(t.pull(probe), ref.pull(probe))

    extra[0] = 0                    # the transient is gone: its room stays for the window ...
    clock.now = 30.0
    assert gov.step()["high_water_bytes"] == 12 * MiB and b.parts()["reserve"] == 12 * MiB
    held = b.rows_cap()
    clock.now = 61.0                # ... and is given back after it
    assert gov.step()["high_water_bytes"] == 0
    assert b.parts()["reserve"] == reserve
    assert abs(b.rows_cap() - held - (12 * MiB - reserve) // t.layout.row_bytes // b.shards) <= 1
    t.close()
    ref.close()


def test_without_budgets_or_rss_the_governor_does_nothing():
    assert MemoryGovernor(lambda: [], 0).step() is None
    assert MemoryGovernor(lambda: [object()], 0, rss=lambda: None).step() is None
    assert rss_bytes() > 10 * MiB


def test_a_deltas_cleared_dirty_keys_stay_counted_until_the_dump_is_closed(tmp_path):
    """``dirty_dump(clear=True)`` empties the dirty-keys set but the dump still holds its runs: the budget
    counts them under the dump until it is closed, so neither the RAM tier nor a governor's reading takes
    that memory for free room or overhead."""
    t, ref = _budgeted_and_reference(tmp_path)
    for i in range(5):
        k = _keys(150_000, i)
        t.push(k, np.ones((len(k), DIM), np.float32))
    dirty = t.stats()["memory"]["dirty_keys"]
    assert dirty > 0, "setup: no row was evicted dirty"
    d = t.dirty_dump(clear=True)
    t.push(_keys(10, 7), np.ones((10, DIM), np.float32))          # the shard reports its parts again
    st = t.stats()
    assert st["memory"]["dirty_keys"] < dirty
    held = st["memory_budget"]["growing"] - st["memory"]["filters"] - st["memory"]["dirty_keys"]
    assert held >= dirty // 2, "the dump's runs are not counted"
    d.close()
    st = t.stats()
    assert st["memory_budget"]["growing"] == st["memory"]["filters"] + st["memory"]["dirty_keys"] + 0
    t.close()
    ref.close()
