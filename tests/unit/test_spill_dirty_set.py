"""The set of spilled dirty keys holds each key once (``_kernels.F_LISTED``).

A row evicted while dirty has its key added to ``SparseTable._spilled_dirty`` (a ``SortedKeySet``) until
the next delta checkpoint clears it. A row read back dirty and evicted dirty again added its key again:
duplicates that only a merge of runs drops, and runs frozen at ``MAX_RUN`` keys never merge, so a table
whose dirty keys outnumber ``MAX_RUN`` (4M; 25M per shard at 10^8 keys a server) grew the set with every
dirty eviction, not with its keys (no checkpoint, scaled to 128k-key runs: 2.2 -> 9.6 entries per
spilled row over 200 hours, and growing), and every promotion searched one more run.
"""
from __future__ import annotations

import numpy as np
import pytest

from sparse_tables import SparseTable, TableConfig, keysets

DIM = 4


@pytest.fixture
def small_runs(monkeypatch):
    monkeypatch.setattr(keysets.SortedKeySet, "MAX_RUN", 1 << 11)
    monkeypatch.setattr(keysets.SortedKeySet, "TAIL", 1 << 8)


def test_dirty_keys_evicted_again_are_not_added_again(tmp_path, small_runs):
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=1_000,
                      spill_path=str(tmp_path / "spill"), num_threads=1)
    ram = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", num_threads=1)
    rng = np.random.default_rng(0)
    with SparseTable(cfg) as t, SparseTable(ram) as ref:
        for r in range(40):
            keys = np.unique(rng.integers(1, 12_001, 2_500).astype(np.uint64))
            g = np.full((len(keys), DIM), 1.0 + r % 3, np.float32)
            t.push(keys, g)
            ref.push(keys, g)
        entries = sum(len(run) for run in t._spilled_dirty.runs())
        assert entries <= len(t), (entries, len(t))      # each key at most once (before: ~3 times)
        # every changed row once, as the RAM-only table has it
        batches, deleted = t.dirty_rows(clear=True)
        keys = np.concatenate([b.column("key").to_numpy() for b in batches])
        assert len(keys) == len(np.unique(keys)) == len(ref) and len(deleted) == 0
        order = np.argsort(keys)
        np.testing.assert_array_equal(t.pull(keys[order]), ref.pull(keys[order]))
        # cleared: nothing is dirty any more, and the next changes are found again
        assert t.stats()["memory"]["dirty_keys"] == 0
        again = np.arange(1, 3_001, dtype=np.uint64)
        t.push(again, np.ones((len(again), DIM), np.float32))
        t.pull(np.arange(5_001, 12_001, dtype=np.uint64))         # evicts the rows just pushed
        batches, _ = t.dirty_rows(clear=True)
        got = np.sort(np.concatenate([b.column("key").to_numpy() for b in batches]))
        np.testing.assert_array_equal(got, again[t.contains(again)])


@pytest.mark.parametrize("root", ["", None])
def test_a_server_that_saves_no_checkpoint_clears_the_dirty_state_at_each_expiry_pass(tmp_path, root):
    """``checkpoint.root: ""``: nothing ever reads the dirty state, which held every key ever evicted
    dirty (expired ones too: a churning table grew it by 3.1 MB a day for 880k keys on disk). A server
    that may save (a root; None: unconfined) keeps it for its next delta."""
    from engine.ps import InProcessTransport, PSClient, PSServer
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=500,
                      spill_path=str(tmp_path / "spill"), num_threads=1)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=64, local_shards=2,
                      checkpoint_root=root)
    try:
        with PSClient(InProcessTransport([server])) as client:
            keys = np.arange(1, 20_001, dtype=np.uint64)
            client.push("emb", keys, np.ones((len(keys), DIM), np.float32))
            dirty = lambda: client.stats()[0]["sparse"]["emb"]["memory"]["dirty_keys"]   # noqa: E731
            assert dirty() > 0
            client.shrink("emb")
            if root == "":
                assert dirty() == 0
            else:
                assert dirty() >= 8 * (len(keys) - 2 * 500)
            np.testing.assert_array_equal(client.pull("emb", keys), -np.ones((len(keys), DIM), np.float32))
    finally:
        server.close()
