"""The JIT warm-up compiles every kernel a CTR job runs: after ``engine.ps.warmup.warm_up``,
``Mode.warm_up`` and ``CTRTrainer.warm_up``, a whole training run (steps, evaluation, metrics merge) adds no Numba
specialization. Each case runs in a fresh interpreter, so kernels compiled by other tests in this
process cannot hide a miss; the job uses the shipped ``configs/ctr.yaml`` tables and a server with
its 4 local shards, reached through the wire codec (read-only arrays, as over gRPC)."""
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
from numba.core.registry import CPUDispatcher
from engine.config import load_config
from engine.modes import make_mode
from engine.programs import ctr
from engine.ps.client import PSClient
from engine.ps.server import PSServer
from engine.ps.transport import InProcessTransport
from engine.ps.warmup import warm_up
from engine.roles import WorkerContext
from streaming.criteo import generate_criteo

repo, tmp, mode, pipeline = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]

def specializations():
    out = {}
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in ("engine", "models", "sparse_tables", "streaming"):
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, CPUDispatcher):
                    out[f"{obj.py_func.__module__}.{obj.__name__}"] = len(obj.signatures)
    return out

g = generate_criteo(tmp / "gen.txt", 3000, 5)
cfg = ctr.prepare(load_config(repo / "configs" / "ctr.yaml", [
    f"mode={mode}", f"model.pipeline={pipeline}", "model.data.source=criteo",
    f"model.data.criteo_path={g.path}", f"model.data.cache_dir={tmp}/cache", f"model.metrics_dir={tmp}/m",
    "checkpoint.root=", "cluster.workers=1", "model.batch_size=64"]))
warm_up(cfg.sparse_tables, cfg.dense_tables, local_shards=cfg.cluster.local_shards)
server = PSServer.from_config(cfg, 0)
client = PSClient(InProcessTransport([server]))
mode = make_mode(cfg, client, rank=0, num_workers=1)
mode.warm_up(c.dim for c in cfg.sparse_tables.values())      # as engine.roles.run_worker
trainer = ctr.CTRTrainer(WorkerContext(cfg, 0, 1, client, mode))
trainer.warm_up()
before = specializations()
out = trainer.run()
after = specializations()
client.close()
server.close()
print(json.dumps({"steps": out["steps"], "auc": out["test"]["auc"],
                  "compiled_in_job": {k: after[k] - before.get(k, 0) for k in after
                                      if after[k] != before.get(k, 0)}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode,pipeline", [("async", "exact"), ("async", "sequential"), ("sync", "exact"),
                                           ("geo", "exact")])
def test_no_kernel_compiles_after_the_warm_up(tmp_path, mode, pipeline):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO), str(tmp_path), mode, pipeline],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["steps"] > 10 and res["auc"] > 0.5
    assert res["compiled_in_job"] == {}, res["compiled_in_job"]
