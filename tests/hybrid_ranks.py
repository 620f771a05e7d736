"""One rank of an MPI world exercising hybrid mode's dense replica (``engine.allreduce.DenseReplica``):
run as ``mpiexec -n W python tests/hybrid_ranks.py OUT.npz SYNC_STEPS STEPS SIZE [whole|overlap]`` by
``tests/unit/test_hybrid_mode.py`` (and ``... hybrid_ranks.py confined OUT CASES`` ``listeners OUT`` and ``abort OUT`` by
``tests/unit/test_hybrid_world_confined.py``). Every rank starts from ``initial(size)`` and steps with its own
gradients ``grad(step, rank, size)`` through the real all-reduce and optimizer (``overlap``: range by
range through ``engine.allreduce.OverlappedDenseStep``'s progress thread, as a backward pass reports
them); rank 0 gathers every rank's parameters (and Adam moments) after every step and saves them as
``params[step, rank, :]``, ``m[...]``, ``v[...]``, with the CPU and wall seconds the test-and-yield loop
spent, for the test to check against a single-process reference built from the same functions."""
from __future__ import annotations

import sys

import numpy as np

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


def initial(size: int) -> np.ndarray:
    return np.random.default_rng(1234).normal(0, 0.1, size).astype(np.float32)


def grad(step: int, rank: int, size: int) -> np.ndarray:
    return np.random.default_rng([step, rank, 7]).normal(0, 1e-2, size).astype(np.float32)


def table_config():
    from engine.config import DenseTableConfig
    return DenseTableConfig(optimizer="adam", learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], epsilon=EPS)


def ranges(size: int) -> list[tuple[int, int]]:
    """How a backward pass would report the gradient (``forward_backward``'s ``on_grad``): from the top
    down, a few big layers and small ones between them, which the overlap gathers into buckets."""
    cuts = sorted({0, size, size // 7, size // 7 + 3, size // 2, size // 2 + 1, size - 401, size - 1})
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:])][::-1]


def hang(out: str, size: int, how: str) -> None:
    """``hang-whole`` / ``hang-overlap``: rank 1 stops answering before step 1's collective (it sleeps);
    rank 0 must raise ``CollectiveTimeoutError`` within its 2 s timeout, write it to ``out`` (hydra may
    drop output forwarded just before an abort) and abort the world."""
    import time

    from mpi4py import MPI

    from engine.allreduce import CollectiveTimeoutError, DenseReplica, OverlappedDenseStep, describe_peers, world_hosts
    comm = MPI.COMM_WORLD
    rep = DenseReplica(initial(size), table_config(), comm, timeout_s=2.0,
                       peers=describe_peers(world_hosts(comm), comm.rank))     # as engine.modes.hybrid does
    ov = OverlappedDenseStep(rep, bucket_floats=size // 4) if how == "hang-overlap" else None
    t0 = time.perf_counter()
    try:
        for t in range(3):
            if comm.rank == 1 and t == 1:
                time.sleep(120)
            g = grad(t, comm.rank, size)
            if ov is None:
                rep.step(g)
            else:
                on_grad = ov.begin()
                for lo, hi in ranges(size):
                    on_grad(g, lo, hi)
                ov.finish()
            if t == 0:
                t0 = time.perf_counter()
    except CollectiveTimeoutError as e:
        with open(out, "w") as f:
            f.write(f"TIMEOUT after {time.perf_counter() - t0:.1f} s: {e}\n")
        comm.Abort(3)


def fail(out: str, size: int) -> None:
    """``fail-overlap``: on rank 1, step 1's optimizer step on the overlap's progress thread raises; rank 1's
    ``finish`` must raise that error at once (not wait out the timeout as for a hang), write it to ``out``
    and abort the world."""
    import time

    from mpi4py import MPI

    from engine.allreduce import DenseReplica, OverlappedDenseStep
    comm = MPI.COMM_WORLD
    rep = DenseReplica(initial(size), table_config(), comm, timeout_s=30.0)
    ov = OverlappedDenseStep(rep, bucket_floats=size // 4)
    t0 = time.perf_counter()
    try:
        for t in range(3):
            if comm.rank == 1 and t == 1:
                def broken(*a, **k):
                    raise RuntimeError("injected optimizer failure")
                rep.opt.step_range = broken
                t0 = time.perf_counter()
            on_grad, g = ov.begin(), grad(t, comm.rank, size)
            for lo, hi in ranges(size):
                on_grad(g, lo, hi)
            ov.finish()
    except RuntimeError as e:
        with open(out, "w") as f:
            f.write(f"ERROR after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {e}\n")
        comm.Abort(3)


def confined(out: str, cases: str) -> None:
    """``confined``: for each case ``SETS@ENDPOINT`` of ``cases`` (``;``-separated; SETS comma-separated
    overrides), build the hybrid mode as a worker does (``engine.modes.make_mode`` over configs/ctr.yaml)
    with a client whose server is at ENDPOINT; write one line per case to ``out.RANK``: ``ok`` or the
    error's type and message."""
    from pathlib import Path
    from types import SimpleNamespace

    from engine.allreduce import world
    from engine.config import load_config
    from engine.modes import make_mode
    comm = world()
    got = []
    for case in cases.split(";"):
        sets, endpoint = case.split("@")
        cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "ctr.yaml",
                          ["mode=hybrid", "model.dense_merge_steps=1", f"cluster.workers={comm.size}",
                           *filter(None, sets.split(","))])
        client = SimpleNamespace(transport=SimpleNamespace(endpoints=[endpoint]))
        try:
            make_mode(cfg, client, rank=comm.rank, num_workers=comm.size)
            got.append("ok")
        except Exception as e:   # noqa: BLE001 - reported to the test
            got.append(f"{type(e).__name__}: {e}")
    Path(f"{out}.{comm.rank}").write_text("\n".join(got))


def listeners(out: str) -> None:
    """``listeners``: start MPI as a worker does (``engine.allreduce.world``), all-reduce once (the ranks
    connect), and write the addresses this rank listens on to ``out.RANK``, one per line."""
    import psutil

    from engine.allreduce import world
    comm = world()
    a = np.ones(1 << 16, np.float32)
    comm.Allreduce(a.copy(), a)
    held = sorted({f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN})
    with open(f"{out}.{comm.rank}", "w") as f:
        f.write("\n".join(held))
    comm.Barrier()


def abort(out: str) -> None:
    """``abort``: rank 1 writes its pid to ``out.pid``, waits for the file ``out.go``, then fails as a
    worker does (``engine.allreduce.end_world``, which aborts the world); rank 0 waits."""
    import os
    import time
    from pathlib import Path

    from engine.allreduce import end_world, world
    comm = world()
    comm.Barrier()
    if comm.rank == 1:
        Path(f"{out}.pid").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not Path(f"{out}.go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        end_world(1, RuntimeError("injected failure"))
    time.sleep(60)


def main(out: str, sync_steps: int, steps: int, size: int, how: str = "whole") -> None:
    from engine.allreduce import DenseReplica, OverlappedDenseStep, world
    if how.startswith("hang"):
        return hang(out, size, how)
    if how == "fail-overlap":
        return fail(out, size)
    comm = world()              # as a worker starts MPI (the CMA probe first)
    rep = DenseReplica(initial(size), table_config(), comm, sync_steps=sync_steps, timeout_s=60)
    live = initial(size) * 0
    ov = None
    if how == "overlap":
        ov = OverlappedDenseStep(rep, bucket_floats=size // 4)
        ov.attach(live)
        assert rep.params is live and np.array_equal(live, initial(size))
    elif how == "attached":             # the pipelined loop: the model's vector is the replica's
        rep.attach(live)
        assert rep.params is live and np.array_equal(live, initial(size))
    keep = {"params": [], "m": [], "v": []}
    for t in range(steps):
        if ov is None:
            rep.step(grad(t, comm.rank, size))
        else:
            on_grad, g = ov.begin(), grad(t, comm.rank, size)
            for lo, hi in ranges(size):
                on_grad(g, lo, hi)
            ov.finish()
        for k, a in (("params", live if how == "attached" else rep.params), ("m", rep.opt.m), ("v", rep.opt.v)):
            got = comm.gather(a.copy(), root=0)
            if comm.rank == 0:
                keep[k].append(np.stack(got))
    if ov is not None:
        ov.close()                      # the progress thread stops (the world then finalizes cleanly)
        assert ov._thread is None
    if comm.rank == 0:
        np.savez(out, **{k: np.stack(v) for k, v in keep.items()}, wait_s=rep.wait_s,
                 wait_cpu_s=rep.wait_cpu_s, collectives=rep.collectives, world=comm.size)


if __name__ == "__main__":
    if sys.argv[1] == "abort":
        sys.exit(abort(sys.argv[2]))
    if sys.argv[1] == "listeners":
        sys.exit(listeners(sys.argv[2]))
    if sys.argv[1] == "confined":
        sys.exit(confined(*sys.argv[2:4]))
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
