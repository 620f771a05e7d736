"""One rank of an MPI world exercising hybrid mode's dense replica (``engine.modes.hybrid.DenseReplica``):
run as ``mpiexec -n W python tests/hybrid_ranks.py OUT.npz SYNC_STEPS STEPS SIZE`` by
``tests/unit/test_hybrid_mode.py``. Every rank starts from ``initial(size)`` and steps with its own
gradients ``grad(step, rank, size)`` through the real all-reduce and optimizer; rank 0 gathers every
rank's parameters (and Adam moments) after every step and saves them as ``params[step, rank, :]``,
``m[...]``, ``v[...]``, with the CPU and wall seconds the test-and-yield loop spent, for the test to check
against a single-process reference built from the same functions."""
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


def main(out: str, sync_steps: int, steps: int, size: int) -> None:
    from mpi4py import MPI

    from engine.modes.hybrid import DenseReplica
    comm = MPI.COMM_WORLD
    rep = DenseReplica(initial(size), table_config(), comm, sync_steps=sync_steps, timeout_s=60)
    keep = {"params": [], "m": [], "v": []}
    for t in range(steps):
        rep.step(grad(t, comm.rank, size))
        for k, a in (("params", rep.params), ("m", rep.opt.m), ("v", rep.opt.v)):
            got = comm.gather(a.copy(), root=0)
            if comm.rank == 0:
                keep[k].append(np.stack(got))
    if comm.rank == 0:
        np.savez(out, **{k: np.stack(v) for k, v in keep.items()}, wait_s=rep.wait_s,
                 wait_cpu_s=rep.wait_cpu_s, collectives=rep.collectives, world=comm.size)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
