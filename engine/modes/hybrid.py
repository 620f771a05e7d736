"""hybrid mode: sparse tables on the parameter servers, the dense tower on every worker, all-reduced
over MPI (PERSIA's hybrid training, HugeCTR, TorchRec, Paddle's hybrid mode; Horovod's exchange).

Sparse rows travel exactly as in async mode (``AsyncMode``: pulled at the step, pushed after it, the
servers apply them on arrival; same pipeline, admission, spill and checkpoints). The dense tower never
goes to a server during training: every worker holds all of it, with its own copy of the optimizer
the dense table is configured with (``tables.dense.NAME``: adam or sgd, learning_rate, beta1, beta2,
epsilon; the same ``models.optim`` code and float32 arithmetic as the servers' dense table, so one
worker trains bit for bit the model async mode trains with one worker). Each step, per dense table:

``hybrid.dense_sync_steps`` k = 1 (default, gradient all-reduce)
    ``grad`` (float32[P], the gradient of the batch's mean loss) is summed over the workers with a
    non-blocking ``MPI_Iallreduce``, divided by the number of workers, and every worker applies the
    optimizer step to that mean: the parameters are identical on every worker after every step, as if
    one worker had stepped with the mean of all workers' gradients (sync SGD over the dense tower).
k > 1 (model averaging, the "MA" of Alibaba's XDL middleware)
    every worker steps its optimizer with its own gradient; every k steps (and at every drain: an
    evaluation, a checkpoint, the end) the parameters and the optimizer's moments (Adam's m and v;
    the step count is the same everywhere) are averaged over the workers, so they are identical on
    every worker at each sync point.

Overlap: the pipelined loop (``model.pipeline`` exact or stale; ``dense_on_workers``) sends step t's
sparse gradients with the next batch's pull (one Step request per server, as async) on its
communicator thread and, beside that round trip, runs the dense step on the worker's own thread: it
starts the all-reduce of t's dense gradient, completes it with a test-and-yield loop (``MPI_Test``,
then ``time.sleep``: ``engine.allreduce.backoff``, 0 for the first ``SPIN_S``, then up to
``MAX_NAP_S``) rather than ``MPI_Wait`` (MPICH's wait busy-polls a core, which on a small machine
takes it from the parameter server), and steps the optimizer, all before t+1 computes: the dense
tower is never stale. With ``hybrid.bucket_floats`` > 0 (and k = 1) the all-reduce and the optimizer
step run instead beside the backward pass, layer by layer from the output layer down, on a progress
thread, over the model's own parameters (``engine.allreduce.OverlappedDenseStep``, PyTorch DDP's
gradient buckets); the loop then waits only for the lowest layers. The sequential loop and model
averaging (k > 1) run the whole step after the pass.
``exact``
waits for t's sparse request too (t+1 sees every update of this worker, as the sequential loop);
``stale`` keeps two sparse requests in flight (t+1's rows come from t-1's request: this worker's own
sparse updates arrive one step later, Paddle's async communicator), while the dense step stays exact.
``profile()`` reports the wall and CPU seconds of the loop and where the dense step's time goes.

Every worker must make the same collective calls in the same order: the worker loop runs the same
number of steps on every worker in this mode (like sync), and drains at the same points. A worker
that dies ends the MPI world (``mpiexec`` kills the others): the launcher restarts the whole job from
its newest checkpoint. The servers' dense table is the checkpointed copy: at every drain (before an
evaluation, at each aligned checkpoint meeting, at the end) rank 0 uploads the whole optimizer state,
parameters and Adam's moments m, v and step count t (``PSClient.set_dense_state``, the admin token);
on start and resume every worker pulls that state (``PSClient.pull_dense_state``), so all ranks start
identical and a resumed or restarted job continues exactly where its checkpoint stood (the same Adam
moments and bias correction as the job that wrote it; async mode's checkpoints resume the same way).
A fresh job starts from rank 0's initial parameters with zero moments and t = 0, as before.

MPI traffic is neither authenticated nor encrypted: off loopback the config refuses this mode unless
``security.insecure: true`` (``engine.config``), and so does every worker for the addresses it really
uses: servers named in ``ENGINE_SERVERS``, a world whose ranks are on several hosts
(``engine.allreduce.check_world_confined``).
"""
from __future__ import annotations

import time

import numpy as np

from ..allreduce import (DenseReplica, OverlappedDenseStep, check_world_confined, describe_peers, world,
                          world_hosts)
from ..errors import ConfigError
from .asynchronous import AsyncMode


class HybridMode(AsyncMode):
    """Async sparse tables on the servers; the dense tables on every worker, all-reduced over MPI.

    Parameters
    ----------
    client : PSClient
    rank, num_workers : int
        Must equal the MPI world's rank and size (``mpiexec`` started every worker).
    dense_tables : dict[str, DenseTableConfig]
        ``tables.dense`` of the config (optimizer settings per table).
    sync_steps : int
        ``hybrid.dense_sync_steps``.
    comm : mpi4py.MPI.Comm, optional
        Default ``MPI.COMM_WORLD``.
    overlap_buckets : int or None
        ``hybrid.bucket_floats``: with k = 1, the smallest collective (floats) of the dense step
        overlapped with the backward pass (``OverlappedDenseStep``); None (default): no overlap, the
        whole gradient all-reduced after the pass.
    insecure : bool
        ``security.insecure``: without it a world on several hosts, or servers off loopback, is refused
        (``engine.allreduce.check_world_confined``).

    Raises
    ------
    ConfigError
        The MPI world does not match ``--rank`` / ``cluster.workers`` (the worker was not started by
        the launcher's ``mpiexec``), mpi4py is missing, or the world's traffic leaves the host without
        ``insecure``.
    """

    name = "hybrid"
    dense_on_workers = True
    dense_step_replies_params = False      # the step is local: the model's vector, stepped in place
    lockstep = True

    def __init__(self, client, *, rank: int, num_workers: int, dense_tables: dict, sync_steps: int = 1,
                 comm=None, barrier_timeout_s: float = 600.0, overlap_buckets: int | None = None,
                 insecure: bool = False):
        super().__init__(client, rank=rank, num_workers=num_workers, barrier_timeout_s=barrier_timeout_s)
        self.comm = comm if comm is not None else world()
        if (self.comm.Get_rank(), self.comm.Get_size()) != (rank, num_workers):
            raise ConfigError(
                f"mode hybrid: this worker is MPI rank {self.comm.Get_rank()} of {self.comm.Get_size()}, but "
                f"--rank {rank} of cluster.workers={num_workers}: start the workers with one `mpiexec -n "
                f"{num_workers}` whose rank r runs --rank r (the local launcher does)")
        hosts = world_hosts(self.comm)
        # the addresses really used: ENGINE_SERVERS, and a world on several hosts (the config sees neither)
        check_world_confined(self.comm, insecure=insecure, hosts=hosts,
                             endpoints=getattr(getattr(client, "transport", None), "endpoints", ()))
        self.peers = describe_peers(hosts, rank)    # named when an all-reduce times out
        self.dense_tables = dict(dense_tables)
        self.sync_steps = int(sync_steps)
        self.replicas: dict[str, DenseReplica] = {}
        self.timing = {"allreduce_s": 0.0, "optimizer_s": 0.0}   # seconds: completing the all-reduce, Adam
        self.overlap_buckets = overlap_buckets
        self._overlaps: dict = {}        # table -> OverlappedDenseStep (k = 1, the pipelined loop)
        self._attached: dict = {}        # table -> the replica whose parameters are the model's vector

    def _replica(self, table: str) -> DenseReplica:
        r = self.replicas.get(table)
        if r is None:
            raise ConfigError(f"mode hybrid: dense table {table!r} was not initialized on this worker "
                              f"(init_dense first)")
        return r

    def init_dense(self, table: str, params: np.ndarray) -> np.ndarray:
        """Rank 0 sets the initial parameters on the servers unless they hold some (a resumed
        checkpoint); every worker pulls the servers' whole optimizer state (parameters, Adam's m, v, t),
        so all start identical, and a resumed job where its checkpoint stood."""
        if table not in self.dense_tables:
            raise ConfigError(f"tables.dense.{table}: missing; declared dense tables: {sorted(self.dense_tables)}")
        if self.rank == 0:
            self.client.init_dense(table, params)
        self.barrier(f"init-dense-{table}")
        state = self.client.pull_dense_state(table)
        rep = DenseReplica(state.params, self.dense_tables[table], self.comm, sync_steps=self.sync_steps,
                           timeout_s=self.barrier_timeout_s, peers=self.peers)
        rep.load_state(state)
        self.replicas[table] = rep
        return rep.params.copy()

    def pull_dense(self, table: str) -> np.ndarray:
        """This worker's parameters (a copy, float32[P]); no server is asked."""
        return self._replica(table).params.copy()

    def push_dense_grads(self, table: str, grad: np.ndarray) -> None:
        """One dense step with this worker's ``grad : float32[P]`` (collective: every worker calls it)."""
        self.push_pull_dense(table, grad)

    def push_pull_dense(self, table: str, grad: np.ndarray) -> np.ndarray | None:
        """One dense step with this worker's ``grad : float32[P]``: start the all-reduce (k = 1), complete
        it on this thread with the test-and-yield loop, step the optimizer -> the fresh parameters (a copy),
        or None once ``attach_dense`` made the model's vector the replica's (it is stepped in place).
        The pipelined loop calls it right after sending the step's sparse request, so the all-reduce runs
        beside that round trip (``dense_on_workers``). Collective: every worker calls it."""
        rep = self._replica(table)
        t0 = time.perf_counter()
        handle = rep.start_step(grad)
        t1 = time.perf_counter()
        if handle[1] is not None:
            rep.complete(handle)
        t2 = time.perf_counter()
        rep.finish_step(handle)
        t3 = time.perf_counter()
        self.timing["allreduce_s"] += t2 - t1
        self.timing["optimizer_s"] += (t1 - t0) + (t3 - t2)
        return None if self._attached.get(table) is rep else rep.params.copy()

    def attach_dense(self, table: str, live: np.ndarray) -> None:
        """``live`` (the model's float32[P] vector) becomes the replica's parameters (``DenseReplica.attach``):
        ``push_pull_dense`` then steps the model in place and returns None instead of a copy for the model
        to load, saving two copies of the tower a step (2 x 1.7 MB for CTR-DNN). The pipelined loop
        attaches at its start, as the overlapped step does (``overlap_dense``).

        Raises
        ------
        ValueError
            ``live`` is not float32[P].
        """
        rep = self._replica(table)
        rep.attach(live)
        self._attached[table] = rep

    def overlap_dense(self, table: str, live: np.ndarray) -> bool:
        """k = 1: yes (``OverlappedDenseStep``): ``live`` (the model's float32[P] vector) becomes the
        replica's parameters, all-reduced and stepped range by range beside the backward pass. k > 1
        (model averaging steps locally): no."""
        if self.sync_steps != 1 or self.overlap_buckets is None:
            return False
        ov = self._overlaps.get(table)
        if ov is None:
            ov = self._overlaps[table] = OverlappedDenseStep(self._replica(table),
                                                             bucket_floats=self.overlap_buckets)
        ov.attach(live)
        return True

    def begin_dense_step(self, table: str):
        """Open the step (Adam's t += 1) -> ``on_grad(grad, lo, hi)`` for ``forward_backward``."""
        return self._overlaps[table].begin()

    def finish_dense_step(self, table: str) -> None:
        """Wait for the rest of the step's all-reduce and optimizer ranges (collective: every worker)."""
        ov = self._overlaps[table]
        t0 = time.perf_counter()
        ov.finish()
        self.timing["allreduce_s"] += time.perf_counter() - t0

    def push_pull(self, table, keys, grads, shows, clicks, pull_keys, dense_table, dense_grad):
        """The sparse push of this step and the pull of the next (async's one Step request per server),
        then the dense step on this worker (``push_pull_dense``) -> (rows float32[m, dim], fresh dense
        float32[P] or None). The pipelined loop does not call it with a dense table: it overlaps the two
        itself (``dense_on_workers``)."""
        rows, _ = super().push_pull(table, keys, grads, shows, clicks, pull_keys, None, None)
        fresh = self.push_pull_dense(dense_table, dense_grad) if dense_table is not None else None
        return rows, fresh

    def drain(self) -> None:
        """``sync`` now."""
        self.sync()

    def sync(self) -> None:
        """A drain (evaluation, checkpoint meeting, end): the sparse pushes are flushed, model averaging
        averages, and rank 0 uploads every dense table's whole optimizer state to the servers
        (``set_dense_state``: parameters, Adam's m, v, t) so that evaluation, checkpoints and export read
        the trained parameters and a resume continues with the same moments. Every worker calls it at the
        same point; the caller's barrier follows."""
        self.client.flush()
        for table, rep in self.replicas.items():
            rep.sync()
            if self.rank == 0:
                self.client.set_dense_state(table, rep.state())

    def profile(self) -> dict:
        """Collective statistics for the worker's profile event: all-reduces completed (one per bucket
        when overlapped with the backward pass), dense steps taken, and the wall and CPU seconds spent
        completing them (the test-and-yield loop; overlapped: the wait after the pass, and the progress
        thread's CPU, its optimizer ranges included)."""
        reps = list(self.replicas.values())      # one copy: Prometheus reads this from its own thread
        return {"allreduce": {"calls": sum(r.collectives for r in reps), "dense_steps": sum(r.steps for r in reps),
                              "overlapped": bool(self._overlaps),
                              "wait_s": round(sum(r.wait_s for r in reps), 4),
                              "wait_cpu_s": round(sum(r.wait_cpu_s for r in reps), 4)},
                "exchange": {k: round(v, 4) for k, v in self.timing.items()}}
