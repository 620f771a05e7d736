"""The JIT warm-up compiles every kernel a job runs: after ``engine.ps.warmup.warm_up``, ``Mode.warm_up``
and the program's own ``warm_up`` (as ``engine.roles.run_worker`` and the programs call them), a whole
training run (steps, evaluation, metrics merge) adds no Numba specialization. Each case runs in a fresh
interpreter, so kernels compiled by other tests in this process cannot hide a miss; the jobs use the
shipped configs' tables and a server with its 4 local shards, reached through the wire codec (read-only
arrays, as over gRPC)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from pathlib import Path
import numpy as np
from numba.core.registry import CPUDispatcher
from engine.config import load_config
from engine.modes import make_mode
from engine.programs import ctr, word2vec
from engine.ps.client import PSClient
from engine.ps.server import PSServer
from engine.ps.transport import InProcessTransport
from engine.ps.warmup import warm_up
from engine.roles import WorkerContext
from streaming.criteo import generate_criteo

repo, tmp, program, mode, pipeline, spill = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:7]

def specializations():
    out = {}
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in ("engine", "models", "sparse_tables", "streaming"):
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, CPUDispatcher):
                    out[f"{obj.py_func.__module__}.{obj.__name__}"] = len(obj.signatures)
    return out

common = [f"mode={mode}", "checkpoint.root=", "cluster.workers=1", f"model.metrics_dir={tmp}/m",
          f"observability.tensorboard_dir={tmp}/tb"]
if spill == "spill":    # a table that moves rows to RocksDB past 2,000 rows per shard
    common += [f"tables.sparse.embedding.spill_path={tmp}/spill", "tables.sparse.embedding.memory_rows=2000"]
elif spill == "admission":  # a key becomes a row at its second occurrence (the warm-up's growth push admits
    common += ["tables.sparse.embedding.min_count=2", "cluster.local_shards=1"]   # none); one shard grows
if program == "ctr":
    g = generate_criteo(tmp / "gen.txt", 3000, 5)
    cfg = ctr.prepare(load_config(repo / "configs" / "ctr.yaml", common + [
        f"model.pipeline={pipeline}", "model.data.source=criteo", f"model.data.criteo_path={g.path}",
        f"model.data.cache_dir={tmp}/cache", "model.batch_size=64"]))
    trainer_of = ctr.CTRTrainer
else:
    rng = np.random.default_rng(3)
    (tmp / "corpus.txt").write_text("\n".join(" ".join(f"w{i}" for i in rng.zipf(1.3, 200) % 300)
                                              for _ in range(300)) + "\n")
    cfg = word2vec.prepare(load_config(repo / "configs" / "word2vec.yaml", common + [
        f"model.corpus={tmp}/corpus.txt", f"model.arrow_dir={tmp}/arrow", "model.epochs=1",
        "model.batch_words=4000", "model.eval_after_train=false", "model.dim=16",
        "tables.sparse.syn0.dim=16", "tables.sparse.syn0.init_range=0.03125",
        "tables.sparse.syn1neg.dim=16", "model.min_count=1"]))
    trainer_of = word2vec.Word2VecTrainer
warm_up(cfg.sparse_tables, cfg.dense_tables, local_shards=cfg.cluster.local_shards)
server = PSServer.from_config(cfg, 0)
client = PSClient(InProcessTransport([server]))
mode = make_mode(cfg, client, rank=0, num_workers=1)
mode.warm_up(c.dim for c in cfg.sparse_tables.values())      # as engine.roles.run_worker
trainer = trainer_of(WorkerContext(cfg, 0, 1, client, mode))
trainer.warm_up()
before = specializations()
out = trainer.run()
after = specializations()
client.close()
server.close()
spilled = sum(h.stats()["evictions"] for h in server.sparse.values()) if spill == "spill" else None
largest_shard = max(max(h.stats()["rows_per_shard"]) for h in server.sparse.values())
print(json.dumps({"steps": out["steps"], "spilled": spilled, "largest_shard": largest_shard,
                  "compiled_in_job": {k: after[k] - before.get(k, 0) for k in after
                                      if after[k] != before.get(k, 0)}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("program,mode,pipeline,spill", [
    ("ctr", "async", "exact", "-"), ("ctr", "async", "sequential", "-"), ("ctr", "sync", "exact", "-"),
    ("ctr", "geo", "exact", "-"), ("ctr", "async", "exact", "spill"), ("ctr", "async", "stale", "admission"),
    ("word2vec", "geo", "-", "-"), ("word2vec", "async", "-", "-")])
def test_no_kernel_compiles_after_the_warm_up(tmp_path, program, mode, pipeline, spill):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO), str(tmp_path), program, mode, pipeline, spill],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["steps"] > 3, res
    if spill == "spill":
        assert res["spilled"] > 0, res       # the job did move rows to RocksDB
    if spill == "admission":
        assert res["largest_shard"] > 0.8 * 2048, res    # a shard's index outgrew its first 2,048 slots
    assert res["compiled_in_job"] == {}, res["compiled_in_job"]
