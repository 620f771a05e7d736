"""Group metrics of CTR evaluation (``model.data.group_column``) through a real job: ``engine train`` of
CTR-DNN (1 server + 2 workers, async) on a generated Arrow data set with a user column and a planted
per-user signal (each user's own click rate, unrelated to what the model sees, plus an item effect the
model learns), so GAUC and AUC differ. The reported GAUC, UAUC and pos/neg order ratio must equal
scikit-learn's per-group AUCs and a brute-force pair count on the trainer's own predictions, recomputed
from the final checkpoint through the evaluation path (PS restored in-process, dedup -> pull ->
``model.predict``, the same rows in the same batches), to 1e-6; the global histogram still covers every
test row once. A group column missing from the data is a one-line config error naming the key and file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from sklearn.metrics import roc_auc_score

from engine.checkpoint import CheckpointManager
from engine.config import from_dict
from engine.group_metrics import owned_mask
from engine.metrics import BinaryMetrics
from engine.programs.ctr_data import dedup_batch, to_batch
from engine.ps import InProcessTransport, PSClient, PSServer
from models import build_model
from streaming.source import ArrowSource

REPO = Path(__file__).resolve().parents[2]
WORKERS = 2
EVAL_BATCH = 256


def write_planted(path: Path, n_users: int, seed: int, user_ids: np.ndarray, base: np.ndarray,
                  item_w: np.ndarray) -> None:
    """Rows of ``n_users`` users (1..24 rows each) as one Arrow IPC file: ``label`` float32, ``C1`` (the
    item: P(click) = sigmoid(base[user] + 1.5 * item_w[item])), ``C2`` (noise) uint64 keys, ``user`` int64."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 25, n_users)
    users = np.repeat(np.arange(n_users), sizes)
    items = rng.integers(0, len(item_w), len(users))
    logit = base[users] + 1.5 * item_w[items]
    labels = (rng.random(len(users)) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    perm = rng.permutation(len(users))                 # users interleaved, as logs are
    table = pa.table({"label": labels[perm], "C1": (items[perm] + 1000).astype(np.uint64),
                      "C2": rng.integers(2000, 2020, len(users)).astype(np.uint64),
                      "user": user_ids[users[perm]]})
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=500)


def make_data(root: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(21)
    n_users = 300
    user_ids = rng.integers(-2**62, 2**62, n_users)           # negative ids too
    base = rng.normal(-1.0, 1.5, n_users)                     # each user's own click rate
    item_w = rng.normal(0.0, 1.0, 60)
    write_planted(root / "train" / "part-0.arrow", n_users, 1, user_ids, base, item_w)
    write_planted(root / "test" / "part-0.arrow", n_users, 2, user_ids, base, item_w)
    return root / "train", root / "test"


def _train(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"),
           "--run-dir", str(tmp_path / "run"), "--set", "model.data.source=arrow",
           "--set", f"model.data.train_path={tmp_path / 'data' / 'train'}",
           "--set", f"model.data.test_path={tmp_path / 'data' / 'test'}",
           "--set", "model.slots=[C1, C2]", "--set", "model.dense_dim=0", "--set", "model.hidden=[16]",
           "--set", f"model.eval_batch_size={EVAL_BATCH}", "--set", f"cluster.workers={WORKERS}",
           "--set", f"model.metrics_dir={tmp_path / 'metrics'}", "--set", f"checkpoint.root={tmp_path / 'ckpt'}",
           "--set", f"observability.tensorboard_dir={tmp_path / 'tb'}",
           *[a for s in sets for a in ("--set", s)]]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)


def trainer_predictions(ckpt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probs float32[n], labels float32[n], users int64[n]) of every test row, computed as the job's
    evaluation did: the PS restored from the final checkpoint (written right before the final evaluation),
    the whole test split in ``eval_batch_size`` batches, each worker's owned rows of a batch scored
    together."""
    manifest = json.loads(Path(ckpt, "manifest.json").read_text())
    cfg = from_dict(manifest["config"])
    p = cfg.model.params
    servers = [PSServer.from_config(cfg, i) for i in range(cfg.cluster.servers)]
    client = PSClient(InProcessTransport(servers))
    probs, labels, users = [], [], []
    try:
        CheckpointManager(str(Path(ckpt).parents[2]), manifest["job"]).restore(client, ckpt)
        model = build_model(cfg.model.kind, num_slots=len(p.slots), dim=p.dim, dense_dim=p.dense_dim,
                            hidden=p.hidden, seed=p.seed)
        model.set_dense(client.pull_dense(p.dense_table))
        for rb in ArrowSource(p.data.test_path, batch_size=p.eval_batch_size, prefetch=0).batches(0):
            groups = rb.column("user").to_numpy()
            for rank in range(WORKERS):
                mask = owned_mask(groups, rank, WORKERS)
                if not mask.any():
                    continue
                batch = to_batch(rb.filter(pa.array(mask)), p.slots, p.dense_dim)
                uniq, rows, segments, _, _ = dedup_batch(batch)
                probs.append(model.predict(client.pull(p.sparse_table, uniq), rows, segments, batch.dense))
                labels.append(batch.labels)
                users.append(groups[mask])
    finally:
        client.close()
        for s in servers:
            s.close()
    return np.concatenate(probs), np.concatenate(labels), np.concatenate(users)


def reference(probs, labels, users) -> dict:
    """GAUC / UAUC from scikit-learn per user; the order ratio by brute force over each user's pairs."""
    weighted, aucs, imps, right, wrong, tied = 0.0, [], 0, 0, 0, 0
    for u in np.unique(users):
        m = users == u
        p, y = probs[m].astype(np.float64), labels[m]
        d = np.subtract.outer(p[y == 1], p[y == 0])
        right, wrong, tied = right + int((d > 0).sum()), wrong + int((d < 0).sum()), tied + int((d == 0).sum())
        if 0 < y.sum() < len(y):
            auc = roc_auc_score(y, p)
            weighted += m.sum() * auc
            imps += int(m.sum())
            aucs.append(auc)
    return {"gauc": weighted / imps, "uauc": float(np.mean(aucs)), "pn_ratio": right / wrong,
            "gauc_groups": len(aucs), "gauc_impressions": imps, "groups": len(np.unique(users)),
            "pairs_right": right, "pairs_wrong": wrong, "pairs_tied": tied}


@pytest.mark.slow
def test_group_metrics_of_a_real_job_equal_sklearn_on_the_trainers_predictions(tmp_path):
    make_data(tmp_path / "data")
    proc = _train(tmp_path, "model.data.group_column=user", "model.epochs=2", "model.batch_size=64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in Path(final["metrics_file"]).read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["epoch"] for e in evals] == [0, 1]
    last = evals[-1]

    probs, labels, users = trainer_predictions(final["checkpoint"])
    n = len(probs)
    assert last["count"] == n and sum(1 for _ in users) == n          # every test row scored once
    ref = reference(probs, labels, users)
    for k, v in ref.items():
        if isinstance(v, int):
            assert last[k] == v, k
        else:
            assert last[k] == pytest.approx(v, abs=1e-6), k
    assert final["test_gauc"] == pytest.approx(ref["gauc"], abs=1e-6)
    assert final["test_uauc"] == pytest.approx(ref["uauc"], abs=1e-6)
    assert final["test_pn_ratio"] == pytest.approx(ref["pn_ratio"], abs=1e-6)
    # the global metrics still come from the merged histograms of all rows (the same predictions)
    hist = BinaryMetrics(1 << 16)
    hist.update(probs, labels)
    assert final["test_auc"] == pytest.approx(hist.auc(), abs=1e-12)
    assert last["accuracy"] == pytest.approx(float(np.mean((probs >= 0.5) == (labels == 1))), abs=1e-12)
    global_auc = roc_auc_score(labels, probs)
    assert final["test_auc"] == pytest.approx(global_auc, abs=2e-3)
    # the planted per-user click rates mix users: the global AUC is well below the per-user one
    assert ref["gauc"] > 0.6 and ref["gauc"] - global_auc > 0.03, (ref["gauc"], global_auc)


def test_missing_group_column_is_a_config_error_naming_the_key_and_file(tmp_path):
    make_data(tmp_path / "data")
    proc = _train(tmp_path, "model.data.group_column=query_id")
    assert proc.returncode == 2, proc.stderr[-3000:]
    msg = proc.stderr.strip().splitlines()[-1]
    assert "model.data.group_column" in msg and "'query_id'" in msg
    assert str(tmp_path / "data" / "test" / "part-0.arrow") in msg and "user" in msg
