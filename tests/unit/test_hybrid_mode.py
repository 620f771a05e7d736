"""Hybrid mode's dense replica (``engine.modes.hybrid``) against references: one worker's step equals the
servers' dense-table step bit for bit; with 2 and 3 MPI ranks (real ``mpiexec`` worlds running
``tests/hybrid_ranks.py``) the parameters are bit-identical on every rank after every step and match a
single-process reference that averages the same per-rank gradients; model averaging is identical on
every rank at each sync point. Also the config's refusals, naming the keys."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.config import DenseTableConfig, load_config
from engine.errors import ConfigError
from engine.launch.mpi import mpiexec_path
from engine.allreduce import CMA_CVAR, DenseReplica, make_optimizer
from tests import hybrid_ranks as hr
from tests.mpi_worlds import run_mpiexec

REPO = Path(__file__).resolve().parents[2]
SIZE = 200_003           # odd, > 64k floats: MPICH's large-message all-reduce, a ragged last chunk
STEPS = 6


def run_world(tmp_path: Path, ranks: int, sync_steps: int, steps: int = STEPS, size: int = SIZE,
              how: str = "whole") -> dict:
    out = tmp_path / f"w{ranks}-k{sync_steps}-{how}.npz"
    cmd = [mpiexec_path(), "-launcher", "fork", "-n", str(ranks), sys.executable, str(REPO / "tests" / "hybrid_ranks.py"),
           str(out), str(sync_steps), str(steps), str(size), how]
    proc = run_mpiexec(cmd, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref| (a vector's relative error; element-wise ratios blow up near zero)."""
    return float(np.max(np.abs(a.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def test_one_worker_steps_bit_for_bit_like_the_servers_dense_table():
    """The servers' dense table (``engine.ps.dense_host.DenseHost``, two blocks of its own Adam each) and one
    worker's replica take the same steps from the same gradients: equal to the last bit."""
    from mpi4py import MPI

    from engine.ps.codec import DENSE_BLOCK
    from engine.ps.dense_host import DenseHost
    size = DENSE_BLOCK + 1001
    cfg = DenseTableConfig(optimizer="adam", learning_rate=3e-3, beta1=0.9, beta2=0.999, epsilon=1e-8)
    host = DenseHost("dense", cfg, ordinal=0, server=0, num_servers=1)
    init = hr.initial(size)
    for b in range(2):
        host.init(b, size, init[b * DENSE_BLOCK:(b + 1) * DENSE_BLOCK], False)
    rep = DenseReplica(init, cfg, MPI.COMM_SELF)
    for t in range(4):
        g = hr.grad(t, 0, size)
        fresh = np.concatenate([host.step(b, g[b * DENSE_BLOCK:(b + 1) * DENSE_BLOCK]) for b in range(2)])
        rep.step(g)
        assert np.array_equal(bits(rep.params), bits(fresh)), t
    assert rep.steps == 4 and rep.collectives == 0          # a world of one sends nothing


@pytest.mark.parametrize("ranks, how", [(2, "whole"), (3, "whole"), (2, "overlap"), (3, "overlap")])
def test_gradient_allreduce_keeps_ranks_identical_and_matches_the_reference(tmp_path, ranks, how):
    """``whole``: one all-reduce per step after the pass; ``overlap``: range by range beside it (the
    progress thread of ``engine.allreduce.OverlappedDenseStep``, buckets of a quarter of the vector)."""
    got = run_world(tmp_path, ranks, sync_steps=1, how=how)
    params = got["params"]                                   # [step, rank, P]
    assert params.shape == (STEPS, ranks, SIZE)
    ref = hr.initial(SIZE)
    opt = make_optimizer(SIZE, hr.table_config())
    for t in range(STEPS):
        for r in range(1, ranks):
            assert np.array_equal(bits(params[t, r]), bits(params[t, 0])), (t, r)
        mean = hr.grad(t, 0, SIZE)
        for r in range(1, ranks):
            mean = mean + hr.grad(t, r, SIZE)
        mean /= np.float32(ranks)
        opt.step(ref, mean)
        assert rel_err(params[t, 0], ref) <= 1e-7, t
        assert not np.array_equal(params[t, 0], params[t - 1, 0] if t else hr.initial(SIZE))   # it moved
    buckets = 1 if how == "whole" else len(overlap_buckets(SIZE, SIZE // 4))
    assert how == "whole" or buckets > 2
    assert int(got["collectives"]) == STEPS * buckets
    if how == "whole":
        assert float(got["wait_cpu_s"]) <= float(got["wait_s"]) + 0.05    # the wait yields: CPU <= wall


def _under_seccomp(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """``cmd`` run under ``tests/seccomp_exec.py``'s filter (process_vm_readv/writev refused with EPERM)."""
    from tests import seccomp_exec
    if not seccomp_exec.available():
        pytest.skip("libseccomp is not installed: a seccomp profile cannot be applied to the ranks")
    return run_mpiexec([sys.executable, str(REPO / "tests" / "seccomp_exec.py"), *cmd], cwd=REPO, env=env,
                       timeout=120)


def test_the_cma_probe_sees_a_seccomp_profile_that_refuses_process_vm_readv():
    from engine.allreduce import cma_refused
    assert cma_refused() is None, "this process may read its own memory unless a filter refuses the call"
    proc = _under_seccomp([sys.executable, "-c", "from engine.allreduce import cma_refused; "
                           "print(cma_refused())"], dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "EPERM"


def test_ranks_whose_seccomp_profile_refuses_process_vm_readv_all_reduce_without_cma(tmp_path):
    """A container whose seccomp profile refuses ``process_vm_readv``: MPICH's single-copy transfers
    (CMA) fail there, so every all-reduce of a large vector fails, on every restart. First the fault
    itself, with CMA forced on by the user (``world`` obeys a value the user set); then the ranks as a
    worker starts them: the probe switches CMA off with a warning naming the call and the setting, and
    the world trains with the same bits on every rank."""
    env = {k: v for k, v in os.environ.items() if k != CMA_CVAR}
    # each rank's stderr goes to its own file: hydra may drop what a rank wrote just before the abort
    errs = tmp_path / "forced-stderr"
    errs.mkdir()
    one_allreduce = (f"import os; os.dup2(os.open({str(errs)!r} + '/rank-%d' % os.getpid(), os.O_WRONLY | os.O_CREAT), "
                     "2); import numpy as np; from mpi4py import MPI; from engine.allreduce import world; "
                     "comm = world(); comm.Set_errhandler(MPI.ERRORS_ARE_FATAL); x = np.ones(200003, np.float32); "
                     "y = np.empty_like(x); comm.Allreduce(x, y, op=MPI.SUM); print('sum', y[0])")
    forced = _under_seccomp([mpiexec_path(), "-launcher", "fork", "-n", "2", sys.executable, "-c", one_allreduce],
                            {**env, CMA_CVAR: "1"})
    said = forced.stdout + forced.stderr + "".join(f.read_text(errors="replace") for f in errs.iterdir())
    assert forced.returncode != 0, said[-4000:]
    assert "process_vm_readv failed" in said

    cmd = [mpiexec_path(), "-launcher", "fork", "-n", "2", sys.executable, str(REPO / "tests" / "hybrid_ranks.py"),
           str(tmp_path / "probed.npz"), "1", "2", str(SIZE), "whole"]
    probed = _under_seccomp(cmd, env)
    out = probed.stdout[-2000:] + probed.stderr[-3000:]
    assert probed.returncode == 0, out
    assert probed.stderr.count("process_vm_readv is refused in this process (EPERM") == 2, out   # each rank
    assert f"{CMA_CVAR}=0 is set" in probed.stderr, out
    with np.load(tmp_path / "probed.npz") as z:
        params = z["params"]
    assert params.shape == (2, 2, SIZE)
    for t in range(2):
        assert np.array_equal(bits(params[t, 1]), bits(params[t, 0])), t
    assert not np.array_equal(params[1, 0], hr.initial(SIZE))


@pytest.mark.parametrize("how", ["hang-whole", "hang-overlap"])
def test_a_peer_that_stops_answering_times_out_with_a_clear_error(tmp_path, how):
    """Rank 1 of a real 2-rank world sleeps before step 1's all-reduce: rank 0 raises
    ``CollectiveTimeoutError`` after its timeout (2 s here; ``client.barrier_timeout_s`` in a job), on
    the worker's thread also when the collective runs on the overlap's progress thread, and aborts the
    world (as the worker's exit does), instead of waiting forever. The error names the rank it waited
    for and its host (on this one host: "this host"; across hosts ``tests/integration/test_hybrid_hosts.py``
    sees the peer's host named when the network between them is cut); it said "a worker hangs" only."""
    cmd = [mpiexec_path(), "-launcher", "fork", "-n", "2", sys.executable, str(REPO / "tests" / "hybrid_ranks.py"),
           str(tmp_path / "error.txt"), "1", "3", str(SIZE), how]
    proc = run_mpiexec(cmd, cwd=REPO, timeout=60)
    out = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode != 0, out
    assert (tmp_path / "error.txt").is_file(), out
    error = (tmp_path / "error.txt").read_text()
    m = re.search(r"TIMEOUT after ([\d.]+) s: MPI all-reduce of \d+ floats did not complete within 2 s "
                  r"\(client.barrier_timeout_s\), waiting for rank 1 on \S+ \(this host\): a worker hangs, died", error)
    assert m, error + out
    assert 2.0 <= float(m.group(1)) < 10.0


def test_an_error_on_the_overlaps_progress_thread_is_raised_at_once_on_the_workers_thread(tmp_path):
    """Rank 1's optimizer step fails on the progress thread (any error there: MPI's, the step's): its
    ``finish`` raises that error at once (about a second when idle), and the world is aborted. Before,
    the thread died with it, ``finish`` waited ``timeout_s + 60`` s, and the launcher reported a hang,
    not the error."""
    cmd = [mpiexec_path(), "-launcher", "fork", "-n", "2", sys.executable, str(REPO / "tests" / "hybrid_ranks.py"),
           str(tmp_path / "error.txt"), "1", "3", str(SIZE), "fail-overlap"]
    proc = run_mpiexec(cmd, cwd=REPO, timeout=120)
    out = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode != 0, out
    error = (tmp_path / "error.txt").read_text() if (tmp_path / "error.txt").is_file() else ""
    m = re.search(r"ERROR after ([\d.]+) s: RuntimeError: injected optimizer failure", error)
    # well inside the collective's 30 s timeout (the old wait was 90 s); 7.6 s seen on 2 cores at load 10
    assert m and float(m.group(1)) < 20.0, error + out


def overlap_buckets(size: int, smallest: int) -> list[tuple[int, int]]:
    """The collectives the overlap starts for ``hybrid_ranks.ranges``: adjacent ranges gathered until
    ``smallest`` floats."""
    out, cur = [], None
    for lo, hi in hr.ranges(size):
        cur = (lo, cur[1]) if cur is not None and hi == cur[0] else (lo, hi)
        if cur[1] - cur[0] >= smallest:
            out.append(cur)
            cur = None
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("how", ["whole", "attached"])
def test_model_averaging_is_identical_at_every_sync_point(tmp_path, how):
    """``attached``: the replica steps and averages the model's own vector in place (``DenseReplica.attach``)."""
    k, steps, ranks = 3, 7, 2
    got = run_world(tmp_path, ranks, sync_steps=k, steps=steps, how=how)
    refs = [hr.initial(SIZE) for _ in range(ranks)]
    opts = [make_optimizer(SIZE, hr.table_config()) for _ in range(ranks)]
    for t in range(steps):
        for r in range(ranks):
            opts[r].step(refs[r], hr.grad(t, r, SIZE))
        synced = (t + 1) % k == 0
        if synced:
            for name, arrs in (("params", refs), ("m", [o.m for o in opts]), ("v", [o.v for o in opts])):
                mean = (arrs[0] + arrs[1]) / np.float32(ranks)
                for a in arrs:
                    a[...] = mean
        for name, ref in (("params", refs), ("m", [o.m for o in opts]), ("v", [o.v for o in opts])):
            a = got[name][t]
            if synced:
                assert np.array_equal(bits(a[0]), bits(a[1])), (name, t)
            elif t:      # between sync points each rank follows its own gradients
                assert not np.array_equal(a[0], a[1]), (name, t)
            for r in range(ranks):
                assert rel_err(a[r], ref[r]) <= 1e-6, (name, t, r)
    assert int(got["collectives"]) == steps // k


BASE = ["mode=hybrid", "model.dense_merge_steps=1"]


@pytest.mark.parametrize("sets, keys", [
    (["model.dense_merge_steps=4"], ["model.dense_merge_steps", "hybrid.dense_sync_steps"]),
    (["cluster.launcher=ray"], ["cluster.launcher"]),
    (["cluster.host=10.1.2.3"], ["cluster.host", "security.insecure"]),
    (["cluster.endpoints=[10.1.2.3:5000]"], ["cluster.endpoints", "security.insecure"]),
    (["hybrid.dense_sync_steps=0"], ["hybrid.dense_sync_steps"]),
    (["server.max_message_bytes=4194304"], ["server.max_message_bytes"]),
    # the overlap needs k = 1 and a pipelined loop: it was silently ignored (the hybrid audit)
    (["hybrid.bucket_floats=65536", "hybrid.dense_sync_steps=4"], ["hybrid.bucket_floats", "hybrid.dense_sync_steps"]),
    (["hybrid.bucket_floats=65536", "model.pipeline=sequential"], ["hybrid.bucket_floats", "model.pipeline"]),
])
def test_config_refuses_what_hybrid_cannot_do_naming_the_keys(sets, keys):
    from engine.config import HYBRID_MIN_MESSAGE_BYTES
    from engine.ps.codec import DENSE_BLOCK
    assert HYBRID_MIN_MESSAGE_BYTES == 3 * 4 * DENSE_BLOCK + (1 << 20)
    with pytest.raises(ConfigError) as ei:
        load_config(REPO / "configs" / "ctr.yaml", BASE + sets)
    for k in keys:
        assert k in str(ei.value)


def test_config_refuses_word2vec_and_accepts_the_documented_settings():
    with pytest.raises(ConfigError, match="model.kind='word2vec'"):
        load_config(REPO / "configs" / "word2vec.yaml", ["mode=hybrid"])
    cfg = load_config(REPO / "configs" / "ctr.yaml", BASE + ["hybrid.dense_sync_steps=4", "model.pipeline=sequential"])
    assert cfg.mode == "hybrid" and cfg.hybrid.dense_sync_steps == 4
    # stale: the sparse requests overlap the next step; the dense step stays exact (engine.modes.hybrid)
    assert load_config(REPO / "configs" / "ctr_bigdata.yaml", BASE + ["model.pipeline=stale"]).mode == "hybrid"
    assert load_config(REPO / "configs" / "ctr.yaml", BASE + ["cluster.host=10.1.2.3", "security.insecure=true"])
    assert load_config(REPO / "configs" / "ctr.yaml", BASE + ["hybrid.bucket_floats=65536"]).hybrid.bucket_floats == 65536
    assert load_config(REPO / "configs" / "ctr.yaml", BASE).to_dict()["hybrid"] == {"dense_sync_steps": 1, "bucket_floats": 0}
