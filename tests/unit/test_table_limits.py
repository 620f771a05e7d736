"""Bounds of a table's footprint, through the public API of SparseTable and SparseHost.

* ``max_rows`` (RAM-only tables): past it a new key is refused exactly as a key admission does not
  admit (pull reads it without creating a row, push drops it and counts it); rows already there keep
  training; a load past it is refused before the batch applies.
* spill directories: only a directory this engine created is ever deleted, and one in use by another
  table or process is refused.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engine.ps.hosts import SparseHost
from sparse_tables import SparseTable, SpillDirError, TableConfig, TableConfigError, TableFullError
from sparse_tables import table as table_module


def u64(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def keys_range(a: int, b: int) -> np.ndarray:
    return np.arange(a, b, dtype=np.uint64)


# ------------------------------------------------------------------------------------------ max_rows
def test_max_rows_config_checks():
    with pytest.raises(TableConfigError, match=r"TableConfig.max_rows must be an int >= 0"):
        TableConfig(max_rows=-1)
    with pytest.raises(TableConfigError, match=r"max_rows must be 0 when spill_path is set"):
        TableConfig(max_rows=10, spill_path="/tmp/x")
    assert TableConfig.from_dict({"max_rows": 5}).max_rows == 5


@pytest.mark.nojit
def test_push_past_max_rows_is_refused_like_admission_and_counted(caplog):
    cfg = TableConfig(dim=2, optimizer="sgd", learning_rate=1.0, initializer="uniform", init_range=0.5,
                      max_rows=5, seed=3)
    t = SparseTable(cfg, name="limited-emb")
    g = np.ones((10, 2), np.float32)
    with caplog.at_level(logging.WARNING, logger="sparse_tables.table"):
        t.push(keys_range(1, 11), g)
        t.push(keys_range(1, 11), g)                 # within the same minute: no second warning
    s = t.stats()
    assert len(t) == 5 and s["rows"] == 5 and s["created"] == 5 and s["max_rows"] == 5
    assert s["rows_refused_full"] == 10              # keys 6..10, twice
    warnings = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(warnings) == 1 and "limited-emb" in warnings[0].getMessage()
    assert "max_rows=5" in warnings[0].getMessage()
    # the admitted rows trained twice; refused keys read as keys without a row: their initial value on
    # a training pull, zeros otherwise, and nothing is created by either pull
    init = t.initial_values(keys_range(1, 11))
    np.testing.assert_allclose(t.pull(keys_range(1, 6)), init[:5] - 2, rtol=1e-6)
    np.testing.assert_array_equal(t.pull(keys_range(6, 11), init_missing=True), init[5:])
    np.testing.assert_array_equal(t.pull(keys_range(6, 11)), np.zeros((5, 2), np.float32))
    assert not t.contains(keys_range(6, 11)).any() and len(t) == 5
    # rows of present keys still update when the push also carries refused keys (and duplicates)
    mixed = u64(1, 7, 1, 8)
    t.push(mixed, np.ones((4, 2), np.float32))
    np.testing.assert_allclose(t.pull(u64(1)), init[:1] - 4, rtol=1e-6)
    assert t.stats()["rows_refused_full"] == 12 and len(t) == 5
    # GEO deltas follow the same rule
    t.push_delta(u64(2, 9), np.ones((2, 2), np.float32))
    np.testing.assert_allclose(t.pull(u64(2)), init[1:2] - 1, rtol=1e-6)
    assert t.stats()["rows_refused_full"] == 13
    # deleting rows makes room again
    assert t.delete(u64(3)) == 1
    t.push(u64(9), np.zeros((1, 2), np.float32))
    assert len(t) == 5 and t.contains(u64(9))[0]


@pytest.mark.nojit
def test_max_rows_matches_a_naive_model_across_growth():
    """Many pushes that cross index growth: the table holds exactly the first max_rows distinct keys."""
    rng = np.random.default_rng(0)
    t = SparseTable(TableConfig(dim=3, optimizer="sgd", initializer="zeros", max_rows=3000), initial_rows=16)
    seen: list[int] = []
    refused = 0
    for _ in range(20):
        keys = rng.integers(1, 10_000, 700).astype(np.uint64)
        for k in dict.fromkeys(keys.tolist()):       # unique keys in first-occurrence order
            if k in seen[:3000] or len(seen) < 3000:
                if k not in seen:
                    seen.append(k)
            else:
                refused += 1
        t.push(keys, np.zeros((len(keys), 3), np.float32))
    assert len(t) == 3000 == len(seen)
    assert t.stats()["rows_refused_full"] == refused
    assert t.contains(np.array(seen, np.uint64)).all()


@pytest.mark.nojit
def test_admission_and_max_rows_together():
    t = SparseTable(TableConfig(dim=2, optimizer="sgd", initializer="zeros", min_count=2, max_rows=2))
    g = np.ones((4, 2), np.float32)
    t.push(u64(1, 2, 3, 4), g)                 # first sighting: none admitted
    assert len(t) == 0 and t.stats()["rejected"] == 4 and t.stats()["rows_refused_full"] == 0
    t.push(u64(1, 2, 3, 4), g)                 # admitted up to the limit; the rest refused as full
    s = t.stats()
    assert len(t) == 2 and s["rows_refused_full"] == 2


@pytest.mark.nojit
def test_load_rows_past_max_rows_is_refused_before_the_batch():
    src = SparseTable(TableConfig(dim=2, optimizer="adagrad"))
    src.push(keys_range(1, 21), np.ones((20, 2), np.float32))
    dst = SparseTable(TableConfig(dim=2, optimizer="adagrad", max_rows=10))
    with pytest.raises(TableFullError, match="max_rows=10") as ei:
        dst.load_rows(src.rows())
    assert ei.value.limit == 10 and ei.value.rows == 20 and len(dst) == 0


def _host(cfg: TableConfig, num_local: int = 4, name: str = "emb") -> SparseHost:
    return SparseHost(name, cfg, server=0, num_servers=1, num_vshards=64, num_local=num_local,
                      pool=ThreadPoolExecutor(2))


def test_sparse_host_divides_max_rows_among_its_shards():
    host = _host(TableConfig(dim=2, optimizer="sgd", learning_rate=1.0, initializer="zeros", max_rows=10),
                 num_local=4)
    assert [s.config.max_rows for s in host.shards] == [2, 3, 2, 3]
    keys = keys_range(1, 5001)
    host.push(keys, np.ones((len(keys), 2), np.float32), None, None, delta=False)
    st = host.stats()
    assert st["rows"] == 10 and st["max_rows"] == 10 and st["rows_per_shard"] == [2, 3, 2, 3]
    assert st["rows_refused_full"] == 5000 - 10
    vals = host.pull(keys, True)
    present = np.zeros(len(keys), bool)
    for s in host.shards:
        present |= s.contains(keys)
    assert present.sum() == 10
    np.testing.assert_array_equal(vals[present], -np.ones((10, 2), np.float32))
    np.testing.assert_array_equal(vals[~present], np.zeros((len(keys) - 10, 2), np.float32))
    host.close()
    with pytest.raises(TableConfigError, match=r"table 'emb': max_rows=3 is below the 4 local shards"):
        _host(TableConfig(dim=2, max_rows=3), num_local=4)


def test_full_table_warns_once_per_interval_for_all_shards_of_a_host(caplog, monkeypatch):
    times = iter([0.0, 1.0, 2.0, 100.0, 101.0])
    monkeypatch.setattr(table_module.time, "monotonic", lambda: next(times))
    host = _host(TableConfig(dim=2, optimizer="sgd", initializer="zeros", max_rows=4), num_local=2,
                 name="warned")
    g = np.ones((2000, 2), np.float32)
    with caplog.at_level(logging.WARNING, logger="sparse_tables.table"):
        host.push(keys_range(1, 2001), g, None, None, delta=False)    # both shards refuse: one warning
        host.push(keys_range(1, 2001), g, None, None, delta=False)    # 100 s later: the second
    msgs = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert len(msgs) == 2 and all("'warned' on server 0" in m for m in msgs)
    host.close()


# ------------------------------------------------------------------------------------ spill directories
def _spill_cfg(path) -> TableConfig:
    return TableConfig(dim=2, memory_rows=4, spill_path=str(path))


def test_foreign_directory_is_refused_and_left_untouched(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "precious.txt").write_text("do not delete")
    (d / "sub").mkdir()
    with pytest.raises(SpillDirError, match="not empty and was not created by this engine") as ei:
        SparseTable(_spill_cfg(d))
    assert str(d) in str(ei.value) and ei.value.path == str(d)
    assert sorted(os.listdir(d)) == ["precious.txt", "sub"]
    assert (d / "precious.txt").read_text() == "do not delete"
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(SpillDirError, match="is not a directory"):
        SparseTable(_spill_cfg(f))
    assert f.read_text() == "x"


def test_a_spill_path_the_file_system_refuses_is_a_config_error_naming_it(tmp_path, tmpfs):
    """Read-only, a regular file on the way, no room for RocksDB's files: SpillDirError (a
    TableConfigError: the server exits 2, not restarted) naming the directory and the reason."""
    from tests.tmpfs import leave_free
    ro = tmpfs("ro", 1 << 20, read_only=True)
    (tmp_path / "a-file").write_text("x")
    full = tmpfs("full", 1 << 20)
    leave_free(full, 8192)                 # the marker fits, RocksDB's first files do not
    for path, why in ((ro / "spill" / "t", r"cannot create its parent .*/ro/spill: Read-only file system"),
                      (ro / "t", r"cannot create it: Read-only file system"),
                      (tmp_path / "a-file" / "spill" / "t", r"cannot create its parent .*/a-file/spill: Not a "
                                                            r"directory"),
                      (full / "t", r"RocksDB cannot open a database in it: .*No space left on device")):
        with pytest.raises(SpillDirError, match=rf"spill directory {path}: {why}") as ei:
            SparseTable(_spill_cfg(path))
        assert isinstance(ei.value, TableConfigError) and ei.value.path == str(path)
    assert sorted(os.listdir(full)) == ["filler"]                  # nothing of the refused table is left
    with pytest.raises(SpillDirError, match=r"tables\.sparse\.emb\.spill_path='[^']+/ro': spill directory "
                                            r"\S+/ro/emb-server0-shard0: cannot create it: Read-only"):
        _host(_spill_cfg(ro), num_local=2)


def test_directory_in_use_is_refused_then_reusable_after_close(tmp_path):
    d = tmp_path / "spill"
    first = SparseTable(_spill_cfg(d))
    first.push(keys_range(1, 50), np.ones((49, 2), np.float32))      # rows spill to RocksDB
    assert first.stats()["rows_spilled"] > 0
    marker = json.loads((d / ".sparse-engine-spill").read_text())
    assert marker["pid"] == os.getpid() and "host" in marker and "created" in marker
    with pytest.raises(SpillDirError, match="in use by another table or process") as ei:
        SparseTable(_spill_cfg(d))
    assert str(d) in str(ei.value) and f"pid {os.getpid()}" in str(ei.value)
    before = first.pull(keys_range(1, 50))                         # the first table is unharmed
    np.testing.assert_array_equal(first.pull(keys_range(1, 50)), before)
    assert len(first) == 49
    first.close()
    assert not d.exists()
    second = SparseTable(_spill_cfg(d))                            # free again
    assert len(second) == 0
    second.close()


def test_an_empty_directory_is_borrowed_and_kept(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    t = SparseTable(_spill_cfg(d))
    t.push(keys_range(1, 30), np.ones((29, 2), np.float32))
    t.close()
    assert d.is_dir() and os.listdir(d) == []                      # only our own entries went


CRASH = r"""
import os, sys
import numpy as np
from sparse_tables import SparseTable, TableConfig
t = SparseTable(TableConfig(dim=2, memory_rows=4, spill_path=sys.argv[1]))
t.push(np.arange(1, 50, dtype=np.uint64), np.ones((49, 2), np.float32))
os._exit(0)      # dies without closing: the directory stays, marked, its lock released by the OS
"""


def test_a_marked_directory_left_by_a_dead_process_is_wiped_and_reused(tmp_path):
    d = tmp_path / "crashed"
    subprocess.run([sys.executable, "-c", CRASH, str(d)], check=True, timeout=300)
    assert (d / ".sparse-engine-spill").is_file() and (d / "rocksdb").is_dir()
    t = SparseTable(_spill_cfg(d))
    assert len(t) == 0 and not t.pull(u64(1)).any()
    assert json.loads((d / ".sparse-engine-spill").read_text())["pid"] == os.getpid()
    t.close()
    assert not d.exists()


def test_sparse_host_refused_on_a_used_directory_closes_what_it_opened(tmp_path):
    cfg = _spill_cfg(tmp_path / "root")
    busy = SparseTable(TableConfig(dim=2, memory_rows=4, spill_path=str(tmp_path / "root" / "emb-server0-shard2")))
    with pytest.raises(SpillDirError, match="emb-server0-shard2.*in use"):
        _host(cfg, num_local=4)
    assert sorted(os.listdir(tmp_path / "root")) == ["emb-server0-shard2"]   # shards 0, 1 cleaned up
    busy.close()
    host = _host(cfg, num_local=4)
    assert len(os.listdir(tmp_path / "root")) == 4
    host.close()
    assert os.listdir(tmp_path / "root") == []
