"""RocksDB's compaction of a spill store (``TableConfig.spill_compaction``): leveled by default,
universal on request; either keeps every row through flushes and merges."""
from __future__ import annotations

import numpy as np
import pytest

from sparse_tables import SparseTable, TableConfig, TableConfigError

DIM = 4


def _options_text(t: SparseTable) -> str:
    """The newest OPTIONS file RocksDB wrote for the table's spill store (what it really runs with)."""
    (path,) = sorted(t._spill._dir.db_path.glob("OPTIONS-*"))[-1:]
    return path.read_text()


@pytest.mark.parametrize("compaction, style", [("level", "kCompactionStyleLevel"),
                                               ("universal", "kCompactionStyleUniversal")])
def test_a_spill_store_runs_the_compaction_asked_for_and_keeps_every_row_through_merges(tmp_path, compaction, style):
    cfg = dict(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=500,
               spill_path=str(tmp_path / "spill"))
    t = SparseTable(TableConfig(**cfg, spill_compaction=compaction) if compaction != "level"
                    else TableConfig(**cfg))                # the default
    assert f"compaction_style={style}" in _options_text(t)
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 1 << 40, 12_000, dtype=np.uint64))
    rng.shuffle(keys)
    want = (keys[:, None] % np.uint64(997)).astype(np.float32) + np.arange(DIM, dtype=np.float32)
    for part in np.array_split(np.arange(len(keys)), 8):   # 8 batches: each spills, each ends in a flush
        t.push(keys[part], -want[part])                  # sgd, lr 1, from zeros: the row becomes want
        t._spill._db.flush()
    assert len(t) == len(keys) and t.stats()["rows_spilled"] > 0
    t._spill._db.compact_range(None, None)                 # every sorted run merged
    np.testing.assert_array_equal(t.pull(keys), want)
    t.push(keys[:100], np.ones((100, DIM), np.float32))   # updates land on rows read back from RocksDB
    np.testing.assert_array_equal(t.pull(keys[:100]), want[:100] - 1)
    assert len(t) == len(keys)


def test_an_unknown_spill_compaction_is_refused_with_the_field_named(tmp_path):
    with pytest.raises(TableConfigError, match="spill_compaction.*level.*universal"):
        TableConfig(dim=DIM, spill_path=str(tmp_path / "spill"), spill_compaction="fifo")
