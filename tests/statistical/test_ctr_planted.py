"""CTR-DNN (shipped ``configs/ctr.yaml`` settings) trained through the worker program and a PS cluster
held in this process, on Criteo-format rows drawn from a planted logistic model, reaches a test AUC
within a calibrated margin of the planted model's own AUC on the same test rows.

Calibration (20,000 generated rows, vocabularies capped at 100 values per slot, canonical split, one
epoch, seeds 1-3): planted test AUC 0.8385 / 0.7837 / 0.8139, trained 0.7783 / 0.7277 / 0.7589, gap
0.060 / 0.056 / 0.055. The test asserts a gap below 0.08 (and never above the planted ceiling by more
than noise).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config
from engine.modes import make_mode
from engine.programs import ctr
from engine.ps.client import PSClient
from engine.ps.server import PSServer
from engine.ps.transport import InProcessTransport
from engine.roles import WorkerContext
from streaming.criteo import generate_criteo
from streaming.criteo_synth import CRITEO_VOCAB_SIZES

REPO = Path(__file__).resolve().parents[2]
MAX_GAP = 0.08


@pytest.mark.slow
def test_ctr_dnn_reaches_planted_auc(tmp_path):
    seed = 1
    g = generate_criteo(tmp_path / "gen.txt", 20000, seed, vocab_sizes=[min(v, 100) for v in CRITEO_VOCAB_SIZES])
    cfg = load_config(REPO / "configs" / "ctr.yaml", [
        "model.data.source=criteo", f"model.data.criteo_path={g.path}", f"model.data.cache_dir={tmp_path}/cache",
        f"model.metrics_dir={tmp_path}/metrics", "checkpoint.root=", "cluster.workers=1",
        f"observability.tensorboard_dir={tmp_path}/tb",
        f"model.seed={seed}", f"tables.sparse.embedding.seed={seed}"])
    cfg = ctr.prepare(cfg)
    server = PSServer.from_config(cfg, 0)
    client = PSClient(InProcessTransport([server]))
    try:
        out = ctr.run(WorkerContext(cfg, 0, 1, client, make_mode(cfg, client, rank=0, num_workers=1)))
    finally:
        client.close()
        server.close()
    auc = out["test"]["auc"]
    assert out["test"]["count"] == 4000
    assert -0.01 < g.planted_auc_test - auc < MAX_GAP, (g.planted_auc_test, auc)
