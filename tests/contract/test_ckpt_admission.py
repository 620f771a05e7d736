"""The admission sketch is checkpointed state: a restore puts back the counts of keys that had no row
yet, so a roll-back does not count the replayed pushes twice and a resume does not start them from zero
(``sparse_tables._admission``, ``engine.checkpoint.sketch_parts``). Real shards and the servers' own
writer / reader, on local storage."""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from hdfs_io import CheckpointCorruptError
from sparse_tables import TableConfig
from tests.contract.test_ckpt_format import ShardCluster

T0 = dt.datetime(2024, 1, 1, 0, 0, tzinfo=dt.timezone.utc)
KEYS = np.arange(1, 401, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def _cfg(tmp_path, spill: bool = False, **kw) -> TableConfig:
    return TableConfig(dim=4, optimizer="adagrad", learning_rate=0.1, min_count=3, sketch_width=4096,
                       sketch_depth=4, memory_rows=100 if spill else 1_000_000,
                       spill_path=str(tmp_path / "spill") if spill else None, num_threads=1, **kw)


def _push(c: ShardCluster, keys=KEYS) -> None:
    c.push("emb", keys, np.full((len(keys), 4), 0.1, np.float32))


def _held(c: ShardCluster, keys=KEYS) -> int:
    """Keys of ``keys`` that have a row (were admitted)."""
    return sum(int(sh.contains(keys).sum()) for t in c.tables for sh in t["emb"])


def _mgr(tmp_path) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "ckpt"), "m")


def _base_of_two_pushes(tmp_path, servers: int, local: int = 2) -> str:
    """Every key pushed twice (one short of min_count) on a cluster saved as a base, then closed (the
    job's processes gone). Returns the base's name."""
    c = ShardCluster(servers, {"emb": _cfg(tmp_path)}, local=local)
    _push(c)
    _push(c)
    base = _mgr(tmp_path).save(c, "base", when=T0)["name"]
    c.close()
    return base


@pytest.mark.parametrize("spill", [False, True])
def test_a_roll_back_to_a_base_restores_the_counts_of_its_instant(tmp_path, spill):
    c = ShardCluster(2, {"emb": _cfg(tmp_path, spill)})
    mgr = _mgr(tmp_path)
    _push(c)                                    # every key seen once: none admitted (min_count 3)
    base = mgr.save(c, "base", when=T0)["name"]
    _push(c)                                    # seen twice; the job then fails and rolls back
    mgr.restore(c, base)
    _push(c)                                    # the replay of that push: twice in all, still short
    assert _held(c) == 0, "the rolled-back push was counted again: keys admitted after 2 pushes"
    _push(c)
    assert _held(c) == len(KEYS)                # the third push admits every key
    c.close()


def test_a_resume_into_fresh_servers_keeps_the_counts_short_of_min_count(tmp_path):
    base = _base_of_two_pushes(tmp_path, 2)
    fresh = ShardCluster(2, {"emb": _cfg(tmp_path)})
    _mgr(tmp_path).restore(fresh, base)
    _push(fresh)
    assert _held(fresh) == len(KEYS), "counts restarted from zero after the resume"
    fresh.close()


def test_the_newest_delta_carries_the_counts_of_its_instant(tmp_path):
    c = ShardCluster(2, {"emb": _cfg(tmp_path, spill=True)})
    mgr = _mgr(tmp_path)
    _push(c, KEYS[:200])
    mgr.save(c, "base", when=T0)
    _push(c)                                    # KEYS[:200] twice, the rest once
    delta = mgr.save(c, "delta", when=T0 + dt.timedelta(hours=1))["name"]
    _push(c)                                    # lost by the failure
    c.close()
    fresh = ShardCluster(2, {"emb": _cfg(tmp_path, spill=True)})
    _mgr(tmp_path).restore(fresh, delta)
    _push(fresh)
    assert _held(fresh, KEYS[:200]) == 200 and _held(fresh, KEYS[200:]) == 0
    fresh.close()


def test_another_layout_restores_counts_no_lower_than_the_true_ones(tmp_path):
    base = _base_of_two_pushes(tmp_path, 2, local=2)
    other = ShardCluster(3, {"emb": _cfg(tmp_path)}, local=1)    # N=2 x 2 -> M=3 x 1
    _mgr(tmp_path).restore(other, base)
    _push(other)
    assert _held(other) == len(KEYS)
    other.close()


def test_a_changed_sketch_shape_is_logged_and_counts_start_from_zero(tmp_path, caplog):
    base = _base_of_two_pushes(tmp_path, 1)
    wider = ShardCluster(1, {"emb": dataclasses.replace(_cfg(tmp_path), sketch_width=8192)})
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.sketch_parts"):
        _mgr(tmp_path).restore(wider, base)
    assert "4 x 4096 counts, this table's is 4 x 8192" in caplog.text
    _push(wider)
    assert _held(wider) == 0
    wider.close()


def test_a_checkpoint_without_sketches_loads_into_admission_tables(tmp_path):
    """A checkpoint of tables without count admission (or of a version that saved no sketch)."""
    plain = dataclasses.replace(_cfg(tmp_path), min_count=1)
    c = ShardCluster(1, {"emb": plain})
    _push(c)
    m = _mgr(tmp_path).save(c, "base", when=T0)
    base = m["name"]
    assert not any(n.startswith("sketch/") for n in m["files"]) and "sketch" not in m["tables"]["sparse"]["emb"]
    c.close()
    counting = ShardCluster(1, {"emb": _cfg(tmp_path)})
    _mgr(tmp_path).restore(counting, base)
    assert _held(counting) == len(KEYS)         # the rows came back; the sketch starts empty
    counting.close()


def test_a_damaged_sketch_file_is_named_and_a_delta_changes_nothing(tmp_path):
    c = ShardCluster(1, {"emb": _cfg(tmp_path)})
    mgr = _mgr(tmp_path)
    _push(c)
    base = mgr.save(c, "base", when=T0)["name"]
    _push(c)
    delta = mgr.save(c, "delta", when=T0 + dt.timedelta(hours=1))["name"]
    m = mgr.manifest(delta)
    assert m["tables"]["sparse"]["emb"]["sketch"] == {"depth": 4, "width": 4096, "local_shards": 2}
    part = sorted(n for n in m["files"] if n.startswith("sketch/"))[0]
    assert part == "sketch/emb/s0000-j00.arrow"
    raw = bytearray(mgr.storage.read_bytes(f"{delta}/{part}"))
    raw[len(raw) // 2] ^= 0xFF
    mgr.storage.write_bytes(f"{delta}/{part}", bytes(raw))
    mgr.restore(c, base)
    before = [sh._sketch.copy() for sh in c.tables[0]["emb"]]
    with pytest.raises(CheckpointCorruptError, match=r"sketch/emb/s0000-j00\.arrow"):
        c.load(mgr.uri_of(delta))
    assert all((sh._sketch == b).all() for sh, b in zip(c.tables[0]["emb"], before))
    c.close()
