"""Offline CTR jobs resume at their exact data position (issue 6): a checkpoint written at an aligned
point mid-epoch records every worker's (epoch, batch); ``engine train --resume`` of that checkpoint
restores the model and skips exactly the batches already trained.

Deterministic check: one worker (sync, or async with the stale pipeline and merged dense steps) trains
the same way every run, so a job resumed from a mid-epoch checkpoint of an uninterrupted run must end
with bit-identical parameters (every embedding row, optimizer state and dense parameter) — a skipped or repeated batch would change them. With two async
workers (not deterministic), the resumed job must train exactly the examples that remained."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.checkpoint import CheckpointManager
from engine.checkpoint.reader import load_server_parts  # noqa: F401  (the format under test)
from engine.config import from_dict
from engine.ps import InProcessTransport, PSClient, PSServer

REPO = Path(__file__).resolve().parents[2]


def _train(tmp: Path, tag: str, *sets: str, resume: str | None = None) -> tuple[dict, list[dict]]:
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp / f"run-{tag}"),
           "--set", "model.data.source=generated", "--set", "model.data.generated_rows=3000",
           "--set", f"model.data.cache_dir={tmp / 'cache'}", "--set", f"model.metrics_dir={tmp / 'metrics'}",
           "--set", f"observability.tensorboard_dir={tmp / 'tb'}",
           "--set", f"checkpoint.root={tmp / ('ckpt-' + tag)}", "--set", "model.hidden=[16]",
           "--set", "model.epochs=2", "--set", "checkpoint.align_steps=4", "--set", "checkpoint.delta_every=0.001s",
           *[a for s in sets for a in ("--set", s)]]
    if resume:
        cmd += ["--resume", resume]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in Path(final["metrics_file"]).read_text().splitlines()]
    return final, events


def _chain(root: Path) -> list[dict]:
    mgr = CheckpointManager(str(root), "ctr_dnn")
    return [mgr.manifest(ref.name) for ref in mgr.list()]


def _state(ckpt: str) -> tuple[dict, dict]:
    """Every sparse row (with optimizer state and counters) and every dense table of a checkpoint."""
    manifest = json.loads(Path(ckpt, "manifest.json").read_text())
    cfg = from_dict(manifest["config"])
    servers = [PSServer.from_config(cfg, i) for i in range(cfg.cluster.servers)]
    client = PSClient(InProcessTransport(servers))
    try:
        CheckpointManager(str(Path(ckpt).parents[2]), "ctr_dnn").restore(client, ckpt)
        sparse = {}
        for srv in servers:
            for name, host in srv.sparse.items():
                for shard in host.shards:
                    for rb in shard.rows():
                        for col in rb.schema.names:
                            if col in ("last_seen", "tick"):      # wall-clock metadata differs
                                continue
                            a = rb.column(col)
                            if pa.types.is_fixed_size_list(a.type):
                                a = a.flatten().to_numpy(zero_copy_only=False).reshape(len(rb), -1)
                            else:
                                a = a.to_numpy(zero_copy_only=False)
                            sparse.setdefault((name, col), []).append(a)
        sparse = {k: np.concatenate(v) for k, v in sparse.items()}
        order = np.argsort(sparse[("embedding", "key")])
        sparse = {k: (v[order] if len(v) == len(order) else v) for k, v in sparse.items()}
        dense = {name: client.pull_dense(name) for name in ("dense",)}
    finally:
        client.close()
    return sparse, dense


def assert_same_model(ckpt_a: str, ckpt_b: str) -> None:
    """Two checkpoints hold the same model, bit for bit: every sparse row with its optimizer state and
    counters, and every dense parameter."""
    a_sparse, a_dense = _state(ckpt_a)
    b_sparse, b_dense = _state(ckpt_b)
    assert a_sparse.keys() == b_sparse.keys()
    for k in a_sparse:
        np.testing.assert_array_equal(a_sparse[k], b_sparse[k], err_msg=str(k))
    np.testing.assert_array_equal(a_dense["dense"], b_dense["dense"])


@pytest.mark.slow
@pytest.mark.parametrize("sets", [
    pytest.param(("mode=sync", "cluster.workers=1", "model.pipeline=sequential"), marks=pytest.mark.long),
    # Paddle-style async (configs/*_bigdata.yaml): with one worker its fixed request order is deterministic,
    # and every aligned point drains the two requests in flight and the merged dense gradients
    # ... with count admission (min_count 2): the keys short of it keep their counts across the resume
    # (the checkpoint's admission sketch), so the same keys become rows at the same steps
    ("mode=async", "cluster.workers=1", "model.pipeline=stale", "model.dense_merge_steps=3",
     "tables.sparse.embedding.min_count=2", "tables.sparse.embedding.sketch_width=65536"),
], ids=["sync", "async-stale-merged-admission"])
def test_resume_mid_epoch_reproduces_the_uninterrupted_run(tmp_path, sets):
    full, full_events = _train(tmp_path, "full", *sets)
    chain = _chain(tmp_path / "ckpt-full")
    positions = [(m["sources"]["train"]["epoch"], m["sources"]["train"]["batch"]) for m in chain]
    assert positions[0] == (0, 4) and positions[-1] == (2, 0)                # aligned points, then done
    assert (1, 0) in positions and any(e == 1 and b > 0 for e, b in positions)
    mid = next(m for m in chain if m["sources"]["train"]["epoch"] == 1 and m["sources"]["train"]["batch"] == 8)
    mid_uri = str(tmp_path / "ckpt-full" / "ctr_dnn" / mid["name"])

    resumed, events = _train(tmp_path, "resumed", *sets, resume=mid_uri)
    start = next(e for e in events if e["event"] == "start")
    assert start is not None
    # the launcher's bar counts the job's examples: the resumed process's count starts at the checkpoint's
    # position, and both runs end at the same count (the resumed one trained only what remained)
    last = [e for e in events if e["event"] == "train"][-1]
    full_last = [e for e in full_events if e["event"] == "train"][-1]
    assert last["examples_job"] == full_last["examples_job"] == full_last["examples_total"] > last["examples_total"]
    assert_same_model(full["checkpoint"], resumed["checkpoint"])
    assert resumed["test_auc"] == full["test_auc"] and resumed["test_logloss"] == full["test_logloss"]


@pytest.mark.long   # make test-long (pyproject.toml): test_chaos_offline's async job counts every example once
@pytest.mark.slow
def test_async_workers_resume_with_exactly_the_remaining_examples(tmp_path):
    full, full_events = _train(tmp_path, "full")
    per_epoch = sum(e["examples"] for e in full_events if e["event"] == "final") // 2   # 2 epochs
    chain = _chain(tmp_path / "ckpt-full")
    mid = next(m for m in chain if m["sources"]["train"]["epoch"] == 0 and m["sources"]["train"]["batch"] == 4)
    resumed, events = _train(tmp_path, "resumed", resume=str(tmp_path / "ckpt-full" / "ctr_dnn" / mid["name"]))
    trained = next(e for e in events if e["event"] == "final")["examples"]
    batch_size = mid["sources"]["train"]["batch_size"]
    assert trained == 2 * per_epoch - 2 * 4 * batch_size          # 2 workers had trained 4 batches each


def test_shards_shorter_than_align_steps_are_named_in_a_warning(tmp_path):
    """The workers meet for a mid-epoch checkpoint only at steps every worker reaches: with a shard of
    fewer batches than ``checkpoint.align_steps`` there is none, and rank 0 says so (it was silent)."""
    _train(tmp_path, "short", "checkpoint.align_steps=100000", "model.epochs=1")
    log = (tmp_path / "run-short" / "worker-0.log").read_text()
    assert "no checkpoint inside an epoch: worker " in log and "fewer than checkpoint.align_steps 100000" in log
    assert [(m["sources"]["train"]["epoch"], m["sources"]["train"]["batch"])
            for m in _chain(tmp_path / "ckpt-short")] == [(1, 0)]          # the epoch's end only
