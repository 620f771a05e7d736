"""The training-mode interface: what a worker loop calls per batch.

A worker step is ``pull_sparse`` / ``pull_dense`` → forward/backward → ``push_sparse_grads`` /
``push_dense_grads`` → ``end_step``; after the last step, ``finish``. The mode decides when values
travel and when updates are applied:

=========  ==================================================================================
sync       pushes are held on the servers; ``end_step`` is a barrier at which each server applies
           the mean of all workers' gradients once; the next pulls see the merged update.
async      pushes are applied on arrival (optionally queued and merged in the background).
geo        the worker trains a bounded local copy with plain SGD; every ``k_steps`` steps it
           pushes ``(local - last_synced) / num_workers`` and pulls fresh values.
=========  ==================================================================================

Models that update the rows they pulled in place (Word2Vec's kernel runs SGD itself) do not push
gradients: they push the change they made, ``push_sparse_delta(table, keys, after - before)`` (GEO:
added to the local copy; async: added on the servers at once, no optimizer; sync: refused). In GEO mode
such a model may instead train on ``sparse_replica(table, keys)``: the local copy of a fixed key set (a
vocabulary) as one dense array it updates in place, with no per-step pull or push at all; the mode finds
the changed rows at each sync. Other modes return None there, and the model pulls and pushes deltas.

Arrays: ``keys : uint64[n]``, ``values/grads/deltas : float32[n, dim]``, ``shows, clicks : float32[n]``,
dense ``params/grad : float32[P]``.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

import numpy as np

from .. import failpoints, progress
from ..errors import BarrierTimeoutError, ConfigError
from ..ps.client import PSClient

log = logging.getLogger(__name__)


class Mode(ABC):
    """One training mode bound to a PSClient.

    Parameters
    ----------
    client : PSClient
    rank, num_workers : int
    barrier_timeout_s : float, seconds
        Longest wait at a barrier (a dead worker makes the others fail after this).
    """

    name = "base"
    #: True when the dense step runs on the worker (hybrid: an all-reduce among the workers): the pipelined
    #: loop then sends only sparse rows in its round trips and calls ``push_pull_dense`` itself at the step
    #: boundary, beside the sparse request in flight, so the dense tower is never stale
    dense_on_workers = False
    #: True when ``push_pull`` sends a step's pushes and the next step's pull together (async, hybrid): a
    #: worker program may keep such requests in flight beside its matrix products (``model.pipeline``)
    pipelines_requests = False
    #: True when ``prefetch_sparse`` fetches ahead what a later pull needs (GEO's missing rows)
    prefetches_rows = False
    #: True when the dense step (``push_pull_dense``) replies with the fresh parameters (async's
    #: DENSE_STEP): the worker loads them instead of pulling, keeps its parameters between two of its own
    #: dense steps, and may merge k steps' gradients into one (``model.dense_merge_steps``)
    dense_step_replies_params = False
    #: True when every worker must run the same number of steps per epoch (a collective every step:
    #: sync's barrier, hybrid's all-reduce); ``steps_per_epoch`` gives the count
    lockstep = False

    def __init__(self, client: PSClient, *, rank: int, num_workers: int, barrier_timeout_s: float = 600.0):
        self.client = client
        self.rank, self.num_workers = rank, num_workers
        self.barrier_timeout_s = barrier_timeout_s
        self.step = 0          # steps this process ended (``end_step``)
        self.examples = 0      # the ``examples`` of those steps (what the program counts: CTR rows, ...)

    @abstractmethod
    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Training values of ``keys : uint64[n]`` -> float32[n, dim] (unknown keys: initial values)."""

    def prefetch_sparse(self, table: str, keys: np.ndarray):
        """Fetch ahead what a later ``pull_sparse(table, keys)`` will need, or None when a mode's pull
        must see the pushes made in between (async and sync pull at the step; GEO overrides it)."""
        return None

    @abstractmethod
    def push_sparse_grads(self, table: str, keys: np.ndarray, grads: np.ndarray,
                          shows: np.ndarray | None = None, clicks: np.ndarray | None = None) -> None:
        """Gradients of this step for ``keys`` (duplicates summed)."""

    def push_sparse_delta(self, table: str, keys: np.ndarray, deltas: np.ndarray) -> None:
        """The change ``deltas : float32[n, dim]`` a model made in place to the values it pulled for
        ``keys : uint64[n]`` (unique) this step; the rows become ``value + delta``, no optimizer.

        Raises
        ------
        ConfigError
            The mode cannot apply in-place updates (sync: its barrier merges gradients only).
        """
        raise ConfigError(f"mode {self.name} cannot apply rows a model updated in place (push_sparse_delta); "
                          f"use mode geo or async")

    def sparse_replica(self, table: str, keys: np.ndarray) -> np.ndarray | None:
        """A local copy ``float32[n, dim]`` of the rows of ``keys : uint64[n]`` (unique, a fixed set such
        as a vocabulary) for the model to train in place between syncs, or None when the mode keeps no
        local copy (then: ``pull_sparse`` + ``push_sparse_delta`` every step). Row ``i`` is
        ``keys[i]``; unknown keys start at the value the servers will create for them."""
        return None

    @abstractmethod
    def pull_dense(self, table: str) -> np.ndarray:
        """Current dense parameters -> float32[P]."""

    @abstractmethod
    def push_dense_grads(self, table: str, grad: np.ndarray) -> None:
        """Dense gradient ``grad : float32[P]`` of this step."""

    def overlap_dense(self, table: str, live: np.ndarray) -> bool:
        """Whether this mode steps ``table`` beside the backward pass, updating ``live : float32[P]`` (the
        model's parameter vector) in place. A mode that says yes (hybrid) has ``begin_dense_step(table)``
        (-> the ``on_grad`` callback of ``forward_backward``) and ``finish_dense_step(table)``, which the
        loop calls before and after the pass instead of ``push_pull_dense``. Default: no."""
        return False

    def push_pull_dense(self, table: str, grad: np.ndarray) -> np.ndarray:
        """``push_dense_grads`` then ``pull_dense`` (async overrides it with one round trip)."""
        self.push_dense_grads(table, grad)
        return self.pull_dense(table)

    def push_pull(self, table: str, keys: np.ndarray, grads: np.ndarray, shows: np.ndarray | None,
                  clicks: np.ndarray | None, pull_keys: np.ndarray, dense_table: str | None,
                  dense_grad: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """One step's pushes and the next step's pull: ``push_sparse_grads``, ``push_pull_dense`` (when
        ``dense_table`` is given), then ``pull_sparse(table, pull_keys)`` -> (rows float32[m, dim], fresh
        dense float32[P] or None). Async overrides it with one Step request per server."""
        self.push_sparse_grads(table, keys, grads, shows, clicks)
        fresh = self.push_pull_dense(dense_table, dense_grad) if dense_table is not None else None
        return self.pull_sparse(table, pull_keys), fresh

    def init_dense(self, table: str, params: np.ndarray) -> np.ndarray:
        """Rank 0 sets the initial dense parameters; everyone waits for it and gets the server's copy."""
        if self.rank == 0:
            self.client.init_dense(table, params)
        self.barrier(f"init-dense-{table}")
        return self.pull_dense(table)

    def drain(self) -> None:
        """Make every update this worker holds visible on the servers (before an evaluation, a checkpoint
        meeting, the end): queued pushes, GEO's deltas, hybrid's dense tower. Default: nothing is held
        (sync applies every step at its barrier)."""

    def steps_per_epoch(self, shard_rows: int, batch_size: int) -> int:
        """With ``lockstep``: the steps every worker runs per epoch when the smallest shard holds
        ``shard_rows`` rows, in batches of ``batch_size``: every batch of that shard, its last one partial
        (the shards are balanced, ``ctr_data.make_source``: a longer one holds one row more, left out only
        when the smallest ends on a full batch)."""
        return -(-shard_rows // batch_size)

    def warm_up(self, dims) -> None:
        """Compile the kernels of the mode's own local state (GEO's local copy) for the sparse row widths
        ``dims`` (iterable of int), on throwaway data; nothing is sent. Modes without local state: no-op."""

    def end_step(self, examples: int = 0) -> None:
        """Called once after every batch's pushes, with the batch's ``examples``; reports the step to
        the supervisor (``engine.progress``: a worker whose steps stop moving is hung)."""
        self.examples += examples
        self.step += 1
        progress.current().step(examples)
        failpoints.hit("worker.after_step")

    def finish(self) -> None:
        """Send everything still held locally, then wait for every worker to finish."""
        self.barrier("finish")

    def barrier(self, name: str) -> None:
        """Meet every worker at ``name`` (an announced long wait, up to ``barrier_timeout_s``)."""
        with progress.current().phase(f"barrier {name}", self.barrier_timeout_s):
            self.client.barrier(f"{self.name}:{name}", self.num_workers, timeout=self.barrier_timeout_s)

    def barrier_until(self, name: str, timeout_s: float) -> None:
        """Meet every worker at ``name``, waiting up to ``timeout_s`` seconds even past the servers' cap
        on one barrier (``server.max_barrier_wait_s``, 600 s by default): the other workers wait this way
        for rank 0's checkpoint, whose deadline is an hour. Each time a server's cap runs out, the
        worker's arrival was withdrawn and it arrives again. Not announced: the caller's phase covers it.

        Raises
        ------
        BarrierTimeoutError
            Not every worker arrived within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + float(timeout_s)
        while True:
            left = deadline - time.monotonic()
            try:
                self.client.barrier(f"{self.name}:{name}", self.num_workers, timeout=max(left, 1.0))
                return
            except BarrierTimeoutError as e:
                if deadline - time.monotonic() <= 1.0:
                    raise
                log.info("worker %d: still waiting at %r past the servers' cap on one barrier (%s); arriving "
                         "again, %.0f s left", self.rank, name, e.message, deadline - time.monotonic())
