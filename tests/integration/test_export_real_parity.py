"""Serving parity on the real shared Criteo rows (issue 7): CTR-DNN and DeepFM trained by ``engine train``
with the shipped configs (1 server + 2 workers, async); the checkpoint is exported as float32 and float16
bundles and as ONNX; ``engine predict`` on the test split must equal the trainer's own forward pass on the
same checkpoint (the PS restored from it, the worker's dedup → pull → ``model.predict`` evaluation path):
to 1e-5 (float32) and 1e-2 (float16), the test AUC to 1e-4 (float32), and onnxruntime's output on the same
pooled inputs to 1e-5. Skipped when ``../shared/data`` is absent."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.ipc as ipc
import pytest

from engine.checkpoint import CheckpointManager
from engine.config import from_dict
from engine.export import load_bundle
from engine.metrics import BinaryMetrics
from engine.programs.ctr_data import dedup_batch, to_batch
from engine.ps import InProcessTransport, PSClient, PSServer
from models import build_model
from streaming.source import ArrowSource

REPO = Path(__file__).resolve().parents[2]
CRITEO = REPO.parent / "shared" / "data" / "criteo" / "train.txt"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not CRITEO.is_file(), reason=f"{CRITEO} absent (the shared data sets)")]


def _engine(*args: str, cwd: Path = REPO) -> dict:
    proc = subprocess.run([sys.executable, "-m", "engine", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _trainer_forward(ckpt: str):
    """(probs, labels, test path) of the trainer's evaluation path on the PS restored from ``ckpt``."""
    manifest = json.loads(Path(ckpt, "manifest.json").read_text())
    cfg = from_dict(manifest["config"])
    p = cfg.model.params
    servers = [PSServer.from_config(cfg, i) for i in range(cfg.cluster.servers)]
    client = PSClient(InProcessTransport(servers))
    try:
        CheckpointManager(str(Path(ckpt).parents[2]), manifest["job"]).restore(client, ckpt)
        model = build_model(cfg.model.kind, num_slots=len(p.slots), dim=p.dim, dense_dim=p.dense_dim,
                            hidden=p.hidden, seed=p.seed)
        model.set_dense(client.pull_dense(p.dense_table))
        probs, labels = [], []
        for rb in ArrowSource(p.data.test_path, batch_size=1000, prefetch=0).batches(0):
            batch = to_batch(rb, p.slots, p.dense_dim)
            uniq, rows, segments, _, _ = dedup_batch(batch)
            emb = client.pull(p.sparse_table, uniq)         # unknown keys read zeros, as in evaluation
            probs.append(model.predict(emb, rows, segments, batch.dense))
            labels.append(batch.labels)
    finally:
        client.close()
    return np.concatenate(probs), np.concatenate(labels), p.data.test_path


def _predict(bundle: Path, data: str, out: Path) -> tuple[dict, np.ndarray]:
    res = _engine("predict", str(bundle), data, "--out", str(out))
    return res, ipc.open_file(str(out)).read_all().column("prob").to_numpy()


@pytest.mark.parametrize("config, kind", [("configs/ctr.yaml", "ctr_dnn"),
                                          pytest.param("configs/deepfm.yaml", "deepfm", marks=pytest.mark.long)])
def test_predict_equals_trainer_forward_on_shared_criteo(config, kind, tmp_path):
    final = _engine("train", str(REPO / config), "--run-dir", str(tmp_path / "run"),
                    "--set", f"model.data.cache_dir={tmp_path / 'cache'}",
                    "--set", f"model.metrics_dir={tmp_path / 'metrics'}",
                    "--set", f"observability.tensorboard_dir={tmp_path / 'tb'}",
                    "--set", f"checkpoint.root={tmp_path / 'ckpt'}")
    assert final["model"] == kind and final["checkpoint"]
    want, labels, test_path = _trainer_forward(final["checkpoint"])
    assert len(want) == 4121                       # the canonical split's test rows (i % 5 == 4)
    ref = BinaryMetrics()
    ref.update(want, labels)
    assert ref.auc() == pytest.approx(final["test_auc"], abs=1e-4)   # the job's own evaluation

    _engine("export", final["checkpoint"], str(tmp_path / "f32"))
    res, got = _predict(tmp_path / "f32", test_path, tmp_path / "p32.arrow")
    assert res["rows"] == len(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert res["auc"] == pytest.approx(ref.auc(), abs=1e-4)

    _engine("export", final["checkpoint"], str(tmp_path / "f16"), "--dtype", "float16")
    _, got16 = _predict(tmp_path / "f16", test_path, tmp_path / "p16.arrow")
    np.testing.assert_allclose(got16, want, rtol=0, atol=1e-2)

    ort = pytest.importorskip("onnxruntime")
    _engine("export", final["checkpoint"], str(tmp_path / "onnx"), "--format", "onnx")
    onnx_files = sorted((tmp_path / "onnx").rglob("*.onnx"))
    assert onnx_files, "no .onnx file in the onnx export"
    sess = ort.InferenceSession(str(onnx_files[0]), providers=["CPUExecutionProvider"])
    bundle = load_bundle(str(tmp_path / "f32"))
    outs = []
    for rb in ArrowSource(test_path, batch_size=1000, prefetch=0).batches(0):
        pooled, dense = bundle.pooled(rb)
        outs.append(sess.run(None, {"pooled": pooled, "dense": dense})[0].reshape(-1))
    np.testing.assert_allclose(np.concatenate(outs), want, rtol=0, atol=1e-5)
