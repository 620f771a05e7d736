"""A restore checks the dense tables' names as it checks the sparse ones' (``checkpoint_handlers``).

Found with a real job: ``engine train --resume`` of a CTR-DNN checkpoint under a config whose dense table
was renamed (``model.dense_table: tower``) restored the embeddings, skipped the checkpoint's ``dense``
without a word and evaluated a fresh random MLP (test AUC 0.652 -> 0.629, exit 0); a renamed sparse table
is refused. Now the hosted table the checkpoint neither holds nor declares is refused, naming it and the
checkpoint's tables, before anything changes; a checkpoint's extra dense table (the ``metrics`` table
of checkpoints of before 2026-11-25) is logged and not loaded. In-process servers, real checkpoints on
disk."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from engine.config import DenseTableConfig
from engine.errors import RequestRejectedError
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

ADAM = DenseTableConfig(optimizer="adam", learning_rate=0.01)
KEYS = np.arange(1, 9, dtype=np.uint64)


def cluster(*dense: str) -> tuple[PSServer, PSClient]:
    srv = PSServer({"emb": TableConfig(dim=4, optimizer="sgd", learning_rate=1.0, initializer="zeros")},
                   {name: ADAM for name in dense}, local_shards=1)
    return srv, PSClient(InProcessTransport([srv]))


@pytest.fixture
def saved(tmp_path):
    """A base holding sparse rows and the trained dense tables ``dense`` and ``metrics``; its config
    snapshot declares a third, ``pending``, that was never initialized (so holds no parameters)."""
    srv, c = cluster("dense", "metrics")
    try:
        c.push("emb", KEYS, np.ones((len(KEYS), 4), np.float32))
        for name in ("dense", "metrics"):
            c.init_dense(name, np.linspace(-1, 1, 50).astype(np.float32))
            c.push_dense(name, np.ones(50, np.float32))
        want = c.pull_dense("dense")
        m = CheckpointManager(str(tmp_path), "job").save(
            c, "base", when=0.0, config={"tables": {"dense": {"dense": {}, "metrics": {}, "pending": {}}}})
    finally:
        c.close()
        srv.close()
    return str(tmp_path / "job" / m["name"]), want


def test_a_hosted_dense_table_the_checkpoint_lacks_is_refused_and_nothing_changes(saved, tmp_path):
    uri, _ = saved
    srv, c = cluster("tower")
    try:
        c.push("emb", KEYS, np.full((len(KEYS), 4), 5.0, np.float32))
        with pytest.raises(RequestRejectedError) as e:
            CheckpointManager(str(tmp_path), "job").restore(c, uri)
        msg = str(e.value)
        assert "dense table 'tower'" in msg and uri in msg and "its dense tables: ['dense', 'metrics']" in msg
        np.testing.assert_array_equal(c.pull("emb", KEYS), np.full((len(KEYS), 4), -5.0, np.float32))   # unchanged
    finally:
        c.close()
        srv.close()


def test_the_same_names_restore_and_an_extra_checkpoint_table_is_logged(saved, tmp_path, caplog):
    uri, want = saved
    srv, c = cluster("dense")                   # hosts no 'metrics', as engines since 2026-11-25
    try:
        with caplog.at_level(logging.WARNING, "engine.ps.checkpoint_handlers"):
            CheckpointManager(str(tmp_path), "job").restore(c, uri)
        np.testing.assert_array_equal(c.pull_dense("dense"), want)
        np.testing.assert_array_equal(c.pull("emb", KEYS), -np.ones((len(KEYS), 4), np.float32))
        assert any("dense table 'metrics' of checkpoint" in r.getMessage() and "not loaded" in r.getMessage()
                   for r in caplog.records)
    finally:
        c.close()
        srv.close()


def test_a_declared_table_that_was_not_initialized_when_saved_is_accepted(saved, tmp_path):
    """The config snapshot declares it: it had no parameters yet (the workers initialize it)."""
    uri, _ = saved
    srv, c = cluster("dense", "pending")        # declared in the snapshot, never initialized
    try:
        CheckpointManager(str(tmp_path), "job").restore(c, uri)
        np.testing.assert_array_equal(c.pull("emb", KEYS), -np.ones((len(KEYS), 4), np.float32))
    finally:
        c.close()
        srv.close()
    srv, c = cluster("dense", "late")
    try:
        with pytest.raises(RequestRejectedError, match="dense table 'late'"):     # declared nowhere
            CheckpointManager(str(tmp_path), "job").restore(c, uri)
    finally:
        c.close()
        srv.close()
