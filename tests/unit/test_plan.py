"""``engine plan``: bench results parsing, the sizing arithmetic against hand computation, the binding
resource, named errors for missing figures and bad lines, ``--json``, and unique keys per batch measured
from the shared Criteo rows.

The bench rows below have the fields the bench scripts print (``bench/table_bench.py``, ``ps_bench.py``,
``ckpt_bench.py``) with figures of the order the README reports for this 2-core machine."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.cli import main
from engine.config import load_config
from engine.errors import ConfigError
from engine.plan import (
    BenchResults,
    PlanInputError,
    busiest_share,
    make_plan,
    measure_unique_keys,
    servers_for,
)

REPO = Path(__file__).resolve().parents[2]
CTR = str(REPO / "configs" / "ctr.yaml")

ROWS = [
    {"bench": "machine", "os_cpu_count": 2, "sched_getaffinity_cpus": 2, "loadavg_1min": 0.4},
    {"bench": "pull", "rows": 10_000_000, "dim": 16, "batch": 100_000, "keys_per_s_1_thread": 8_030_000,
     "keys_per_s_2_threads": 14_700_000},
    {"bench": "push", "rows": 10_000_000, "dim": 16, "batch": 100_000, "optimizer": "adagrad", "threads": 1,
     "keys_per_s": 9_000_000},
    {"bench": "spill", "zipf_s": 1.05, "memory_rows": 2_000_000, "universe": 20_000_000, "keys_per_s": 3_600_000,
     "in_memory_keys_per_s": 8_700_000, "ratio_vs_in_memory": 0.414},
    {"bench": "bytes_per_row", "rows": 10_000_000, "dim": 16, "optimizer": "adagrad", "payload_bytes_per_row": 68,
     "bytes_per_row": 44.0},
    {"bench": "pull", "servers": 1, "clients": 2, "dim": 16, "batch_keys": 100_000, "keys_per_s": 6_500_000},
    {"bench": "push", "servers": 1, "clients": 2, "dim": 16, "batch_keys": 100_000, "keys_per_s": 5_000_000},
    {"bench": "ckpt_base_save", "backend": "local", "rows": 5_000_000, "dim": 16, "optimizer": "adagrad",
     "servers": 1, "seconds": 1.772, "mb_per_s": 250.0, "bytes": 443_000_000, "bytes_per_row": 88.6,
     "raw_bytes_per_row": 88},
    {"bench": "ckpt_base_restore", "backend": "local", "rows": 5_000_000, "seconds": 1.477, "mb_per_s": 300.0},
]

# one server in the hand-computed case: 16 GB RAM, 100 GB disk, 4 cores, 20 Gb/s
SERVER = {"server_ram_bytes": 16e9, "server_disk_bytes": 100e9, "server_cores": 4, "network_gbps": 20}


def write_bench(tmp_path, rows=ROWS, extra_lines=()) -> Path:
    path = tmp_path / "bench.jsonl"
    path.write_text("# a test file\n" + "".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


def bench(tmp_path, rows=ROWS) -> BenchResults:
    return BenchResults.read(write_bench(tmp_path, rows))


@pytest.fixture(scope="module")
def ctr():
    return load_config(CTR)


def plan_1e9(cfg, b, **kw):
    args = dict(keys=1e9, examples_per_s=1e5, unique_keys_per_batch=1500, ram_fraction=0.25, **SERVER)
    args.update(kw)
    return make_plan(cfg, b, **args)


# ------------------------------------------------------------------------------------ vshard shares
def naive_servers_for(demand, capacity, v):
    """Smallest n whose busiest server (ceil(v / n) of v vshards) fits, by trying every n."""
    for n in range(1, v + 1):
        if -(-v // n) / v * demand <= capacity:
            return n
    return math.ceil(demand / capacity)


@pytest.mark.parametrize("v", [1, 7, 1024])
def test_servers_for_matches_a_search_over_every_server_count(v):
    for demand in [0.0, 0.5, 1.0, 1.01, 2.0, 3.0, 9.99, 33.3, 512.0, 700.0, 1023.5, 1024.0, 5000.0]:
        assert servers_for(demand, 1.0, v) == naive_servers_for(demand, 1.0, v), (demand, v)


def test_busiest_share_counts_the_server_with_most_vshards():
    assert busiest_share(3, 1024) == 342 / 1024     # 1024 = 342 + 341 + 341
    assert busiest_share(700, 1024) == 2 / 1024
    assert busiest_share(2048, 1024) == 1 / 2048    # beyond num_vshards: an even split


# ------------------------------------------------------------------------------------ arithmetic
def test_plan_matches_hand_computation(tmp_path, ctr):
    p = plan_1e9(ctr, bench(tmp_path))
    r = {x.name: x for x in p.resources}
    # row: dim 10 + row-wise Adagrad's 1 float -> 44 overhead + 4 * 11 = 88 B in RAM; arena record
    # 4 * (2 + 10 + 1 + 5) = 72 B; on disk (8 + 72) * 1.2 = 96 B (no scale_summary: the assumption)
    # RAM: 0.25e9 rows * 88 B + 0.75e9 spilled rows * 10 bits of Bloom filter = 22.9375e9 B
    assert r["ram"].demand == pytest.approx(22.9375e9)
    assert r["ram"].servers == 2                  # 16e9 B per server: 512 of 1024 vshards fit, 1024 do not
    assert r["disk"].demand == pytest.approx(0.75e9 * 96)
    assert r["disk"].servers == 1
    # 1e5 / 128 = 781.25 steps/s x 1500 keys; capacity 6.5M (pull) and 5M (push) keys/s x 4 / 2 cores
    # x spill factor 3.6 / 8.7
    assert r["pull"].demand == pytest.approx(1_171_875)
    assert r["pull"].capacity == pytest.approx(6.5e6 * 2 * 3.6 / 8.7)
    assert r["push"].capacity == pytest.approx(5e6 * 2 * 3.6 / 8.7)
    assert r["pull+push"].demand == pytest.approx(1_171_875 * 8.7 / 3.6 * (1 / 13e6 + 1 / 10e6))
    # network: CTR-DNN's 430,801 dense floats both ways each step; sparse 1500 x (8 + 8 + 40 + 8) out
    dense = 4 * 430_801
    d = p.deployment
    assert d["network_per_step_per_worker_bytes"] == {"to_servers": pytest.approx(1500 * 64 + dense),
                                                      "from_servers": pytest.approx(1500 * 40 + dense)}
    assert r["network"].servers == 1
    assert p.servers == 2 and p.binding == ["ram"] and p.feasible
    # 2 servers hold 512 vshards each: 5e8 keys, a quarter in RAM
    assert d["keys_per_server"] == pytest.approx(5e8)
    assert d["ram_per_server_bytes"] == pytest.approx(1.25e8 * 88 + 3.75e8 * 1.25)
    assert d["disk_per_server_bytes"] == pytest.approx(3.75e8 * 96)
    assert d["disk_total_bytes"] == pytest.approx(7.5e8 * 96)
    # one server carries the whole dense table (1 block of 2^19 floats) and half the sparse traffic
    assert d["network_per_server_bytes_per_s"] == pytest.approx(781.25 * (0.5 * 1500 * 64 + dense))
    # checkpoint: 88.6 file bytes per 88 record bytes at dim 16 -> 88.6 * 64 / 88 per row here
    ck = d["checkpoint"]
    assert ck["base_bytes"] == pytest.approx(1e9 * 88.6 * 64 / 88)
    assert ck["base_save_s"] == pytest.approx(0.5 * ck["base_bytes"] / 250e6)
    assert ck["restore_s"] == pytest.approx(0.5 * ck["base_bytes"] / 300e6)


def test_dense_traffic_over_the_network_is_infeasible_whatever_the_servers(tmp_path, ctr):
    # 10 Gb/s = 1.25e9 B/s < 781.25 steps/s x 1.72 MB of dense parameters on the one server holding them
    p = plan_1e9(ctr, bench(tmp_path), network_gbps=10)
    net = next(x for x in p.resources if x.name == "network")
    assert net.servers is None and not p.feasible
    assert "dense" in net.note and "dense_merge_steps" in net.note
    assert p.servers == 2                         # the other resources still plan


def test_hybrid_sends_no_dense_tower_to_the_servers_and_notes_the_all_reduce(tmp_path):
    # mode hybrid: the workers all-reduce the dense tower over MPI; the servers see the sparse traffic only
    p = plan_1e9(load_config(CTR, ["mode=hybrid", "cluster.workers=4"]), bench(tmp_path), network_gbps=10)
    d = p.deployment
    assert d["network_per_step_per_worker_bytes"] == {"to_servers": pytest.approx(1500 * 64),
                                                      "from_servers": pytest.approx(1500 * 40)}
    assert d["network_per_server_bytes_per_s"] == pytest.approx(781.25 * 0.5 * 1500 * 64)
    assert p.feasible        # async's dense tower alone overran 10 Gb/s (the test above)
    ring_mb = 2 * 3 / 4 * 4 * 430_801 / 1e6
    (note,) = [n for n in p.notes if n.startswith("mode hybrid")]
    assert f"{ring_mb:.3g} MB each way per worker step at cluster.workers=4" in note



def test_admission_sketches_are_part_of_the_checkpoint(tmp_path, ctr):
    """With admission each local shard saves its count-min sketch in every base (4 x 2^20 int32 counters,
    16 MiB): the plan's checkpoint bytes and the busiest server's save time count them."""
    b = bench(tmp_path)
    plain = plan_1e9(ctr, b).deployment["checkpoint"]
    cfg = load_config(CTR, ["tables.sparse.embedding.min_count=2"])
    p = plan_1e9(cfg, b)
    ck, n = p.deployment["checkpoint"], p.servers
    per_server = 4 * 4 * 2**20 * 4                     # local_shards x sketch_depth x sketch_width x 4 bytes
    assert ck["sketch_bytes"] == n * per_server
    assert ck["base_bytes"] == pytest.approx(plain["base_bytes"] + n * per_server)
    assert ck["base_save_s"] == pytest.approx(plain["base_save_s"] + per_server / 250e6)
    assert ck["restore_s"] == pytest.approx(plain["restore_s"] + per_server / 300e6)
    assert {f.name: f.value for f in p.inputs}["ckpt_sketch_bytes_per_server"] == per_server
    assert plain["sketch_bytes"] == 0

@pytest.mark.parametrize("overrides, binding", [
    ({"server_ram_bytes": 1e9}, "ram"),
    ({"server_disk_bytes": 1e9}, "disk"),
    ({"examples_per_s": 1e7, "server_cores": 1, "network_gbps": 2000}, "pull+push"),
])
def test_binding_resource_is_the_one_needing_most_servers(tmp_path, ctr, overrides, binding):
    p = plan_1e9(ctr, bench(tmp_path), **overrides)
    counts = {x.name: x.servers for x in p.resources}
    assert p.servers == max(counts.values())
    assert p.binding == [binding]
    assert sorted(counts.values())[-2] < p.servers    # strictly: the others need fewer


def test_budget_mode_uses_memory_rows_per_server(tmp_path):
    cfg = load_config(CTR, [f"tables.sparse.embedding.spill_path={tmp_path / 'spill'}"])
    p = plan_1e9(cfg, bench(tmp_path), ram_fraction=None, server_disk_bytes=1e9)
    rows = {f.name: f.value for f in p.inputs}
    assert rows["ram_rows_per_server"] == 10_000_000 * 4          # memory_rows x cluster.local_shards
    # each server holds 4e7 rows in RAM + 1e9 / 96 on disk; 1e9 keys: 51 vshards fit -> 21 servers
    disk = next(x for x in p.resources if x.name == "disk")
    assert disk.servers == 21 == p.servers


def test_memory_rows_servers_fit_the_spill_filters_of_their_keys_in_ram(tmp_path):
    # disk alone fits 1e12 keys on 3 servers, but each would keep 3.3e11 keys' filters (1.25 bytes each)
    # beside its 1e9-row RAM tier: 510 GB on a 100 GB server, planned as fitting
    cfg = load_config(CTR, [f"tables.sparse.embedding.spill_path={tmp_path / 'spill'}",
                            "tables.sparse.embedding.memory_rows=250000000"])
    p = plan_1e9(cfg, bench(tmp_path), keys=1e12, ram_fraction=None, server_ram_bytes=100e9,
                 server_disk_bytes=38e12, examples_per_s=1e3)
    ram = next(x for x in p.resources if x.name == "ram")
    most = 1e9 + (100e9 - 1e9 * 88) / 1.25                   # RAM tier 1e9 x 88 B; filters of the rest
    assert ram.capacity == pytest.approx(most)
    assert ram.servers == naive_servers_for(1e12, most, 1024) == p.servers and p.binding == ["ram"]
    assert p.deployment["ram_per_server_bytes"] <= 100e9
    # a RAM tier alone over the server's RAM: no number of servers fits
    p = plan_1e9(cfg, bench(tmp_path), keys=1e12, ram_fraction=None, server_ram_bytes=80e9,
                 server_disk_bytes=38e12, examples_per_s=1e3)
    ram = next(x for x in p.resources if x.name == "ram")
    assert ram.servers is None and not p.feasible and "lower memory_rows" in ram.note


def test_memory_bytes_budget_bounds_the_keys_a_server_holds(tmp_path):
    cfg = load_config(CTR, [f"tables.sparse.embedding.spill_path={tmp_path / 'spill'}",
                            "tables.sparse.embedding.memory_bytes=4000000000"])
    p = plan_1e9(cfg, bench(tmp_path), keys=1e10, ram_fraction=None, server_disk_bytes=1e13)
    ram = next(x for x in p.resources if x.name == "ram")
    # MemoryBudget(4e9 B, 4 shards, 72 B records): RocksDB 250e6 cache + 8 x 15.625e6 memtables, an index of
    # 4 x 2^24 slots x 8 B, a 2% reserve; free 3,008,129,088 B less 4 x (2^17 + 2^15 + 1024) records, at
    # 10 bits of spill filter per key
    assert ram.unit == "keys" and ram.capacity == pytest.approx((3_008_129_088 - 4 * 164_864 * 72) / 1.25)
    assert ram.servers == 5 == p.servers          # 1e10 keys: 242 of 1024 vshards fit one server
    d = p.deployment
    assert d["ram_per_server_bytes"] == 4e9
    # the RAM tier holds what the filters of the server's 2.05e9 keys leave
    left = 3_008_129_088 - int(d["keys_per_server"] * 1.25)
    assert d["rows_in_ram_per_server"] == 4 * (left // 72 // 4 - 2**17 - 2**15)


def test_memory_bytes_leaving_no_ram_tier_is_a_config_error(tmp_path):
    # MemoryBudget accepts 120 MB for 4 shards, but nothing is left beside its headroom rows for a filter:
    # max_keys_per_server was negative and servers_for raised a bare ValueError (a traceback)
    cfg = load_config(CTR, [f"tables.sparse.embedding.spill_path={tmp_path / 'spill'}",
                            "tables.sparse.embedding.memory_bytes=120000000"])
    with pytest.raises(ConfigError, match=r"tables.sparse.embedding.memory_bytes: 120000000 leaves no room"):
        plan_1e9(cfg, bench(tmp_path), keys=1e6, ram_fraction=None)


def test_scale_summary_replaces_the_disk_assumption(tmp_path, ctr):
    rows = ROWS + [{"bench": "scale_summary", "target_keys": 200_000_000, "keys_held": 200_000_000,
                    "budget_bytes": 4_000_000_000, "rss_max_over_budget": 1.3, "disk_bytes_per_row": 120.0,
                    "record_bytes": 96, "base_save_s": 180.0, "restore_s": 150.0, "shrink_s": 40.0,
                    "cpus_granted": 2}]
    p = plan_1e9(ctr, bench(tmp_path, rows))
    assert "space_amplification" not in {f.name for f in p.inputs}
    assert not any("RocksDB's block cache" in n for n in p.notes)
    r = {x.name: x for x in p.resources}
    # rescaled by record; no ram_rows_at_full: per key as measured; leveled compaction's peak assumed
    assert r["disk"].demand == pytest.approx(0.75e9 * 120 * (8 + 72) / (8 + 96) * 1.111)
    assert any("neither disk_bytes_per_spilled_row nor ram_rows_at_full" in n for n in p.notes)
    assert next(f for f in p.inputs if f.name == "disk_peak_over_live").kind == "assumption"
    assert r["ram"].demand == pytest.approx((0.25e9 * 88 + 0.75e9 * 1.25) * 1.3)
    assert any("extrapolated" in n for n in p.notes)           # 5e8 keys per server > 2e8 held


SCALE = {"bench": "scale_summary", "keys_held": 100_000_000, "ram_rows_at_full": 20_000_000,
         "rss_max_over_budget": 1.1, "disk_bytes_per_row": 88.0, "record_bytes": 96}


def disk_demand(p) -> float:
    return next(x for x in p.resources if x.name == "disk").demand


def test_disk_is_sized_per_spilled_row_at_compactions_peak(tmp_path, ctr):
    # bytes per key over all keys -> per spilled row: 88 x 100M / 80M = 110; measured peak 1.25
    p = plan_1e9(ctr, bench(tmp_path, ROWS + [dict(SCALE, disk_peak_over_live=1.25)]))
    assert disk_demand(p) == pytest.approx(0.75e9 * 110 * 80 / 104 * 1.25)
    assert {f.name: f.kind for f in p.inputs}["disk_peak_over_live"] == "measured"
    # the bench's own per-spilled-row figure wins over the one computed from the RAM tier's rows
    p = plan_1e9(ctr, bench(tmp_path, ROWS + [dict(SCALE, disk_peak_over_live=1.25,
                                                   disk_bytes_per_spilled_row=104.0)]))
    assert disk_demand(p) == pytest.approx(0.75e9 * 104 * 80 / 104 * 1.25)
    # a peak below the end of the growth's bytes (a backlog compacted later) sizes no less than the end
    p = plan_1e9(ctr, bench(tmp_path, ROWS + [dict(SCALE, disk_peak_over_live=0.9)]))
    assert disk_demand(p) == pytest.approx(0.75e9 * 110 * 80 / 104)


def test_scale_rows_of_the_tables_compaction_style_are_used(tmp_path):
    level = dict(SCALE, disk_peak_over_live=1.2, rss_max_over_budget=1.08)          # no field: leveled
    universal = dict(SCALE, compaction="universal", disk_peak_over_live=1.9, rss_max_over_budget=1.09)
    b = bench(tmp_path, ROWS + [level, universal])
    lv = plan_1e9(load_config(CTR), b)
    un = plan_1e9(load_config(CTR, ["tables.sparse.embedding.spill_compaction=universal"]), b)
    assert disk_demand(lv) == pytest.approx(0.75e9 * 110 * 80 / 104 * 1.2)
    assert disk_demand(un) == pytest.approx(0.75e9 * 110 * 80 / 104 * 1.9)
    src = {f.name: f.source for f in un.inputs}
    assert "bench.jsonl:12" in src["disk_peak_over_live"] and "with compaction 'universal'" in src[
        "disk_peak_over_live"]
    assert "with compaction 'level'" in {f.name: f.source for f in lv.inputs}["scale_summary.rss_max_over_budget"]
    # universal measured nowhere: leveled's RSS and bytes with a note, universal's peak from RocksDB's figures
    only_level = bench(tmp_path, ROWS + [level])
    un = plan_1e9(load_config(CTR, ["tables.sparse.embedding.spill_compaction=universal"]), only_level)
    assert any("no scale_summary row was measured with tables.sparse.embedding.spill_compaction 'universal'"
               in n for n in un.notes)
    peak = next(f for f in un.inputs if f.name == "disk_peak_over_live")
    assert peak.kind == "assumption" and peak.value == 2.0
    assert disk_demand(un) == pytest.approx(0.75e9 * 110 * 80 / 104 * 2.0)
    # nothing measured: the assumed space amplification stands for leveled; universal's peak scales it
    un = plan_1e9(load_config(CTR, ["tables.sparse.embedding.spill_compaction=universal"]), bench(tmp_path))
    assert disk_demand(un) == pytest.approx(0.75e9 * 96 * 2.0 / 1.111)
    # the extrapolation note's keys_held comes from the style's own row too
    held = [f for f in lv.inputs if f.name == "scale_summary.keys_held"]
    assert len(held) == 1 and "bench.jsonl:11" in held[0].source


def test_unmeasured_rss_factor_is_left_out_not_refused(tmp_path, ctr):
    rows = ROWS + [{"bench": "scale_summary", "keys_held": 10, "rss_max_over_budget": None}]
    p = plan_1e9(ctr, bench(tmp_path, rows))
    assert next(x for x in p.resources if x.name == "ram").demand == pytest.approx(0.25e9 * 88 + 0.75e9 * 1.25)


def test_latest_row_of_a_bench_is_used_and_named(tmp_path, ctr):
    newer = dict(ROWS[5], keys_per_s=4_000_000)
    p = plan_1e9(ctr, bench(tmp_path, ROWS + [newer]))
    fig = next(f for f in p.inputs if f.name == "ps_pull_keys_per_s")
    assert fig.value == 4_000_000
    assert "bench.jsonl:11" in fig.source and "latest of 2 rows" in fig.source


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("drop, needle", [
    (6, "push.keys_per_s"),
    (4, "bytes_per_row.bytes_per_row"),
    (8, "ckpt_base_restore.mb_per_s"),
    (3, "spill.keys_per_s"),
])
def test_missing_figure_names_bench_field_and_script(tmp_path, ctr, drop, needle):
    rows = [r for i, r in enumerate(ROWS) if i != drop]
    with pytest.raises(PlanInputError) as e:
        plan_1e9(ctr, bench(tmp_path, rows))
    script = {"push": "bench/ps_bench.py", "bytes_per_row": "bench/table_bench.py",
              "ckpt_base_restore": "bench/ckpt_bench.py", "spill": "bench/table_bench.py --only spill"}
    assert needle in str(e.value) and script[needle.split(".")[0]] in str(e.value)


def test_spill_figures_are_not_needed_when_every_row_is_in_ram(tmp_path, ctr):
    rows = [r for r in ROWS if r["bench"] != "spill"]
    p = plan_1e9(ctr, bench(tmp_path, rows), ram_fraction=1.0)
    assert next(x for x in p.resources if x.name == "disk").demand == 0


@pytest.mark.parametrize("line, needle", [
    ("{not json\n", "bench.jsonl:11: not JSON"),
    ('{"rows": 3}\n', "bench.jsonl:11: expected a JSON object with a string 'bench'"),
    ("[1, 2]\n", "bench.jsonl:11: expected a JSON object"),
])
def test_malformed_line_is_named_with_file_and_line(tmp_path, line, needle):
    with pytest.raises(PlanInputError, match=needle):
        BenchResults.read(write_bench(tmp_path, extra_lines=[line]))


def test_non_utf8_file_is_named_with_its_line(tmp_path):
    # a binary or Latin-1 file ended in a UnicodeDecodeError traceback
    path = write_bench(tmp_path)
    path.write_bytes(path.read_bytes() + b'{"bench": "pull", "note": "caf\xe9"}\n')
    with pytest.raises(PlanInputError, match=r"bench.jsonl:11: not UTF-8 text \(byte 0xe9\)"):
        BenchResults.read(path)


def test_non_numeric_figure_is_named_with_its_line(tmp_path, ctr):
    rows = [dict(r, keys_per_s="fast") if r["bench"] == "pull" and "servers" in r else r for r in ROWS]
    with pytest.raises(PlanInputError, match=r"bench.jsonl:7: pull.keys_per_s must be a finite number"):
        plan_1e9(ctr, bench(tmp_path, rows))


@pytest.mark.parametrize("fields, needle", [
    ({"dim": "sixteen"}, r"bench.jsonl:11: scale_summary.dim must be a finite number > 0, got 'sixteen'"),
    ({"dim": None}, r"bench.jsonl:11: scale_summary.dim must be a finite number > 0, got None"),
    ({"dim": 16.5}, r"bench.jsonl:11: scale_summary.dim must be a whole number"),
    ({"dim": 16, "optimizer": "adamw"}, r"bench.jsonl:11: scale_summary.optimizer must be one of .*'adamw'"),
])
def test_bad_scale_summary_row_shape_is_named_with_its_line(tmp_path, ctr, fields, needle):
    # without record_bytes the bench row's record is rebuilt from its dim and optimizer: a malformed one
    # ended in a ValueError, TypeError or KeyError traceback
    row = {k: v for k, v in SCALE.items() if k != "record_bytes"} | fields
    with pytest.raises(PlanInputError, match=needle):
        plan_1e9(ctr, bench(tmp_path, ROWS + [row]))
    ok = plan_1e9(ctr, bench(tmp_path, ROWS + [row | {"dim": 16, "optimizer": "adagrad"}]))
    assert disk_demand(ok) == pytest.approx(0.75e9 * 110 * 80 / 104 * 1.111)


def test_unique_keys_above_batch_times_slots_is_refused(tmp_path, ctr):
    with pytest.raises(PlanInputError, match="batch_size x slots = 128 x 26"):
        plan_1e9(ctr, bench(tmp_path), unique_keys_per_batch=128 * 26 + 1)


def test_word2vec_needs_a_table_and_the_unique_keys(tmp_path):
    cfg = load_config(REPO / "configs" / "word2vec.yaml")
    with pytest.raises(ConfigError, match=r"\['syn0', 'syn1neg'\].*--table"):
        plan_1e9(cfg, bench(tmp_path))
    with pytest.raises(PlanInputError, match="--unique-keys-per-batch"):
        plan_1e9(cfg, bench(tmp_path), table="syn0", unique_keys_per_batch=None)


# ------------------------------------------------------------------------------------ the CLI
def cli_args(path, *more):
    return ["plan", CTR, "--keys", "1e9", "--examples-per-s", "1e5", "--unique-keys-per-batch", "1500",
            "--bench-results", str(path), "--ram-fraction", "0.25", "--server-ram-gb", "16",
            "--server-disk-gb", "100", "--server-cores", "4", "--network-gbps", "20", *more]


def test_cli_prints_the_plan_with_its_sources(tmp_path, capsys):
    path = write_bench(tmp_path)
    assert main(cli_args(path, "--workers", "8")) == 0
    out = capsys.readouterr().out
    assert "binding: ram -> 2 servers" in out
    assert f"{path}:7 pull.keys_per_s" in out                     # the figure beside its source
    assert "space_amplification" in out and "assumption" in out
    assert "network per worker" in out


def test_cli_json_round_trips(tmp_path, capsys, ctr):
    path = write_bench(tmp_path)
    assert main(cli_args(path, "--json")) == 0
    got = json.loads(capsys.readouterr().out)
    want = plan_1e9(ctr, BenchResults.read(path)).to_dict()
    want["config"] = CTR
    assert got == json.loads(json.dumps(want))
    assert got["servers"] == 2 and got["binding"] == ["ram"] and got["feasible"] is True


def test_cli_bad_input_exits_2_with_one_named_line(tmp_path, capsys):
    assert main(cli_args(tmp_path / "missing.jsonl")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("engine plan: bench results") and "missing.jsonl" in err[0]
    for keys in ("0", "0.5"):                                    # 0.5 rows planned a table of half a row
        assert main(cli_args(write_bench(tmp_path), "--keys", keys)) == 2
        assert f"--keys must be >= 1 (a count of rows), got {float(keys)}" in capsys.readouterr().err
    for flag, value in (("--keys", "inf"), ("--examples-per-s", "inf"), ("--keys", "nan")):
        assert main(cli_args(write_bench(tmp_path), flag, value)) == 2      # inf ended in a traceback
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag} must be " in err[0] and "(a finite number)" in err[0], err


# ------------------------------------------------------------------------------------ real data
def test_unique_keys_measured_from_the_shared_criteo_rows(shared_data, monkeypatch, ctr):
    if not (shared_data / "criteo" / "train.txt").is_file():
        pytest.skip("no shared Criteo rows")
    monkeypatch.chdir(REPO)                                       # the config's data path is relative
    fig = measure_unique_keys(ctr, batches=5)
    B, S = ctr.model.params.batch_size, len(ctr.model.params.slots)
    assert fig.kind == "measured" and "mean of 5 batches of 128 rows" in fig.source
    # every slot has its own key prefix, so a batch has at least S unique keys; repeats keep it below B x S
    assert S < fig.value < B * S


def test_measured_factors_never_plan_for_less_than_the_budget_or_more_than_ram_speed(tmp_path, ctr):
    """An RSS below its budget (a run whose RAM tier never filled) shrank the planned RAM, and a spill run
    faster than its in-memory twin (noise) raised the planned throughput past RAM speed."""
    fast_spill = dict(ROWS[3], keys_per_s=9_000_000, in_memory_keys_per_s=8_700_000)
    rows = [r for r in ROWS if r is not ROWS[3]] + [fast_spill, dict(SCALE, rss_max_over_budget=0.8)]
    p = plan_1e9(ctr, bench(tmp_path, rows))
    assert next(f for f in p.inputs if f.name == "spill_factor").value == 1.0
    assert any("rss_max_over_budget 0.8 < 1 is taken as 1" in n for n in p.notes)
    ram = next(x for x in p.resources if x.name == "ram").demand
    same_at_1 = plan_1e9(ctr, bench(tmp_path, rows[:-1] + [dict(SCALE, rss_max_over_budget=1.0)]))
    assert ram == pytest.approx(next(x for x in same_at_1.resources if x.name == "ram").demand)


@pytest.mark.parametrize("kw, needle", [
    ({"server_disk_bytes": -1e9}, "--server-disk-gb must be > 0, got -1.0"),
    ({"server_ram_bytes": -2.5e9}, "--server-ram-gb must be > 0, got -2.5"),
    ({"network_gbps": -10.0}, "--network-gbps must be > 0, got -10.0"),
])
def test_a_bad_machine_flag_shows_the_value_as_given(tmp_path, ctr, kw, needle):
    """``--server-disk-gb -1`` said "got -1000000000.0" (the bytes it became), not what was typed."""
    with pytest.raises(PlanInputError) as e:
        plan_1e9(ctr, bench(tmp_path), **kw)
    assert str(e.value) == needle


def test_a_criteo_file_on_a_store_is_not_copied_whole_to_measure_a_few_batches(ctr):
    """Training copies a criteo_path URI whole into the cache (ctr_data); engine plan reads a few lines and
    said 'not found (from <cwd>)' for a URI, as if it were a missing local path."""
    import dataclasses
    d = dataclasses.replace(ctr.model.params.data, source="criteo", criteo_path="s3://bucket/criteo/train.txt")
    cfg = dataclasses.replace(ctr, model=dataclasses.replace(
        ctr.model, params=dataclasses.replace(ctr.model.params, data=d)))
    with pytest.raises(PlanInputError, match=r"criteo_path s3://bucket/criteo/train.txt is on a store: measure on "
                                             r"a local copy of its first lines"):
        measure_unique_keys(cfg, batches=5)
