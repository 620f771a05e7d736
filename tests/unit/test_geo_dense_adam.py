"""GEO's dense step is the dense table's configured optimizer (Adam), not plain SGD (DESIGN.md: "Dense
parameters live in a dense table on the servers (async/sync) or on the worker (GEO), with Adam").

The worker's local copy is stepped with ``tables.dense.NAME``'s Adam (its lr, betas, eps); the moments
outlive a sync (a sync refreshes the parameters only); the servers get ``(local - synced) / workers``
from each worker; the former plain-SGD key ``geo.dense_learning_rate`` is ignored with a warning naming its
replacement (configs and checkpoint snapshots written before still load).
In-process servers, as the other GEO unit tests."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from engine.config import DenseTableConfig, load_config
from engine.errors import ConfigError
from engine.modes import GeoMode, make_mode
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

REPO = Path(__file__).resolve().parents[2]
# not the defaults, so a step that ignored any of them would show
ADAM = DenseTableConfig(optimizer="adam", learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-6)
INIT = np.array([0.5, -0.25, 0.0, 1.0], np.float32)
GRADS = np.array([[1.0, -2.0, 0.5, 0.0], [0.1, 3.0, -0.5, 2.0], [-4.0, 0.01, 0.5, 1.0],
                  [2.0, -1.0, -3.0, 0.2], [0.3, 0.3, 0.3, -5.0], [-1.0, 2.5, 0.0, 0.7]], np.float32)


def reference_adam(params, grads, cfg=ADAM):
    """Adam (Kingma & Ba 2015, Algorithm 1) in PyTorch's form, as ``models.optim.Adam`` documents it:
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``; float64, every step from t = 1."""
    p = np.asarray(params, np.float64).copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    b1, b2 = cfg.beta1, cfg.beta2
    for t, g in enumerate(np.asarray(grads, np.float64), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p -= cfg.learning_rate / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + cfg.epsilon)
    return p


def cluster():
    server = PSServer({"emb": TableConfig(dim=4)}, {"d": ADAM}, index=0, num_servers=1, local_shards=1)
    client = PSClient(InProcessTransport([server]))
    client.init_dense("d", INIT)
    return client


def test_local_dense_is_stepped_with_the_tables_adam():
    client = cluster()
    m = GeoMode(client, rank=0, num_workers=1, k_steps=100, dense_tables={"d": ADAM})
    np.testing.assert_array_equal(m.pull_dense("d"), INIT)
    for i, g in enumerate(GRADS):
        m.push_dense_grads("d", g)
        m.end_step()
        np.testing.assert_allclose(m.pull_dense("d"), reference_adam(INIT, GRADS[:i + 1]), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(client.pull_dense("d"), INIT)      # nothing sent before the sync
    m.drain()
    np.testing.assert_allclose(client.pull_dense("d"), reference_adam(INIT, GRADS), rtol=0, atol=1e-6)


def test_a_sync_refreshes_the_parameters_and_keeps_the_moments():
    client = cluster()
    m = GeoMode(client, rank=0, num_workers=1, k_steps=2, dense_tables={"d": ADAM})
    m.pull_dense("d")
    for i, g in enumerate(GRADS):                  # syncs after steps 2, 4 and 6
        m.push_dense_grads("d", g)
        m.end_step()
        want = reference_adam(INIT, GRADS[:i + 1])  # one Adam run that never synced
        np.testing.assert_allclose(m.pull_dense("d"), want, rtol=0, atol=1e-6)
        if (i + 1) % 2 == 0:
            np.testing.assert_allclose(client.pull_dense("d"), want, rtol=0, atol=1e-6)
    # had a sync reset the moments, step 3 would have been a first Adam step again (|step| = lr per element)
    restarted = reference_adam(reference_adam(INIT, GRADS[:2]), GRADS[2:3])
    assert np.abs(restarted - reference_adam(INIT, GRADS[:3])).max() > 1e-3


def test_two_workers_the_servers_get_the_mean_delta():
    client = cluster()
    a, b = (GeoMode(client, rank=r, num_workers=2, k_steps=3, dense_tables={"d": ADAM}) for r in range(2))
    a.pull_dense("d")
    b.pull_dense("d")                  # both start from INIT
    for g in GRADS[:3]:
        a.push_dense_grads("d", g)
        a.end_step()                   # a syncs after its 3rd step
    for g in GRADS[3:]:
        b.push_dense_grads("d", -2.0 * g)
        b.end_step()                   # b too, from its own copy (INIT + its steps)
    delta_a = reference_adam(INIT, GRADS[:3]) - INIT
    delta_b = reference_adam(INIT, -2.0 * GRADS[3:]) - INIT
    np.testing.assert_allclose(client.pull_dense("d"), INIT + (delta_a + delta_b) / 2, rtol=0, atol=1e-6)
    # after its sync, b holds the servers' values (a's half delta included)
    np.testing.assert_allclose(b.pull_dense("d"), client.pull_dense("d"), rtol=0, atol=0)


def test_an_sgd_dense_table_steps_with_sgd_at_its_learning_rate():
    sgd = DenseTableConfig(optimizer="sgd", learning_rate=0.5)
    server = PSServer({"emb": TableConfig(dim=4)}, {"d": sgd}, index=0, num_servers=1, local_shards=1)
    client = PSClient(InProcessTransport([server]))
    client.init_dense("d", INIT)
    m = GeoMode(client, rank=0, num_workers=1, k_steps=1, dense_tables={"d": sgd})
    m.push_dense_grads("d", GRADS[0])
    m.end_step()
    np.testing.assert_allclose(client.pull_dense("d"), INIT - 0.5 * GRADS[0], rtol=0, atol=1e-7)


def test_a_dense_table_without_settings_is_refused_naming_it():
    m = GeoMode(cluster(), rank=0, num_workers=1, dense_tables={})
    with pytest.raises(ConfigError, match=r"tables\.dense\.d"):
        m.pull_dense("d")


def test_make_mode_hands_geo_the_dense_tables_and_the_old_sgd_key_is_ignored_with_a_warning(caplog):
    cfg = load_config(REPO / "configs" / "ctr.yaml", ["mode=geo"])
    mode = make_mode(cfg, None, rank=0, num_workers=1)
    assert isinstance(mode, GeoMode) and mode.dense_tables == cfg.dense_tables
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        old = load_config(REPO / "configs" / "ctr.yaml", ["mode=geo", "geo.dense_learning_rate=0.05"])
    assert old == cfg and "dense_learning_rate" not in old.to_dict()["geo"]
    assert any(r.levelno == logging.WARNING and "geo.dense_learning_rate: 0.05" in r.getMessage()
               and "tables.dense.NAME.learning_rate" in r.getMessage() for r in caplog.records)
