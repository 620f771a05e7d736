"""sync mode: every step, all workers' gradients are merged at a barrier and applied once.

Each worker pushes with ``accumulate=True``: the servers validate and hold the gradients. ``end_step``
is a barrier on every server; the last arrival on a server applies, for each table, one optimizer
update with the mean of the held gradients over the workers (sparse rows pushed by several workers
are merged; with show counts the accessor's show normalization makes the sum a mean), then releases
everyone. Pulls of the next step therefore see exactly one merged update per step.

Every worker must run the same number of steps (a worker that stops early leaves the others waiting
at the barrier until ``barrier_timeout_s``).
"""
from __future__ import annotations

import numpy as np

from .. import progress
from .base import Mode


class SyncMode(Mode):
    name = "sync"
    lockstep = True

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        return self.client.pull(table, keys, init_missing=True)

    def push_sparse_grads(self, table, keys, grads, shows=None, clicks=None) -> None:
        self.client.push(table, keys, grads, shows=shows, clicks=clicks, accumulate=True)

    def pull_dense(self, table: str) -> np.ndarray:
        return self.client.pull_dense(table)

    def push_dense_grads(self, table: str, grad: np.ndarray) -> None:
        self.client.push_dense(table, grad, accumulate=True)

    def end_step(self, examples: int = 0) -> None:
        with progress.current().phase("sync step barrier", self.barrier_timeout_s):
            self.client.barrier("sync:step", self.num_workers, apply_pending=True,
                                timeout=self.barrier_timeout_s)
        super().end_step(examples)
