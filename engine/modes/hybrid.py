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
then ``time.sleep``: ``dense_progress.backoff``, 0 for the first ``SPIN_S``, then up to
``MAX_NAP_S``) rather than ``MPI_Wait`` (MPICH's wait busy-polls a core, which on a small machine
takes it from the parameter server), and steps the optimizer, all before t+1 computes: the dense
tower is never stale. With ``hybrid.bucket_floats`` > 0 (and k = 1) the all-reduce and the optimizer
step run instead beside the backward pass, layer by layer from the output layer down, on a progress
thread, over the model's own parameters (``dense_progress.OverlappedDenseStep``, PyTorch DDP's
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
``security.insecure: true`` (``engine.config``).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import time

import numpy as np

from models.optim import SGD, Adam

from ..errors import ConfigError, EngineError
from .asynchronous import AsyncMode
from .dense_progress import CollectiveTimeoutError, OverlappedDenseStep, backoff

log = logging.getLogger(__name__)



#: MPICH's switch for CMA, its single-copy transfer between ranks on one host (``process_vm_readv``)
CMA_CVAR = "MPIR_CVAR_CH4_CMA_ENABLE"


def cma_refused() -> str | None:
    """Whether this process may not call ``process_vm_readv`` -> the errno's name (``"EPERM"``: a seccomp
    profile refuses the call, as a container runtime's may), or None when it may (or the C library has no
    such function).

    MPICH moves every intranode message of 8 KiB or more with CMA: the receiving rank reads the sender's
    memory with ``process_vm_readv``. It turns CMA off by itself when Yama's ``ptrace_scope`` forbids it,
    but not when a seccomp filter refuses the call: every all-reduce of the dense tower then fails
    (``copy_iovs: process_vm_readv failed (errno 1)``) or hangs, on every restart. The probe reads 8 bytes of
    this process's own memory, which the kernel allows any process unless a filter refuses the call.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    src, dst = ctypes.c_uint64(0x5EC0), ctypes.c_uint64(0)

    class IOVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [ctypes.c_int, ctypes.POINTER(IOVec), ctypes.c_ulong, ctypes.POINTER(IOVec),
                      ctypes.c_ulong, ctypes.c_ulong]
    local = IOVec(ctypes.cast(ctypes.byref(dst), ctypes.c_void_p), 8)
    remote = IOVec(ctypes.cast(ctypes.byref(src), ctypes.c_void_p), 8)
    if readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 8 and dst.value == src.value:
        return None
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))


def world():
    """``mpi4py.MPI.COMM_WORLD`` (imports mpi4py, which initializes MPI: a singleton world of one
    process when not started by ``mpiexec``).

    Before MPI starts, ``cma_refused`` probes ``process_vm_readv``: where it is refused and the user has
    not set ``MPIR_CVAR_CH4_CMA_ENABLE`` (which is then obeyed), CMA is switched off for this process
    with a warning, and MPICH copies messages through shared memory instead. Every rank of one host
    runs under the same profile, so all of them decide alike. The cost, measured at 2 ranks: an
    all-reduce of CTR-DNN's tower took 4.2-4.4 ms of CPU without CMA against 0.6-1.3 ms with it.

    Raises
    ------
    ConfigError
        mpi4py or its MPI library is missing.
    """
    if CMA_CVAR not in os.environ and "mpi4py.MPI" not in sys.modules:
        why = cma_refused()
        if why is not None:
            os.environ[CMA_CVAR] = "0"
            log.warning("mode hybrid: process_vm_readv is refused in this process (%s: a seccomp profile?), so "
                        "MPICH's single-copy transfers between ranks on one host (CMA) cannot work: %s=0 is "
                        "set, and all-reduces copy through shared memory (slower). Allow process_vm_readv "
                        "(e.g. CAP_SYS_PTRACE in the container) to get CMA back, or set %s yourself",
                        why, CMA_CVAR, CMA_CVAR)
    try:
        from mpi4py import MPI
    except ImportError as e:         # pragma: no cover - an install without the hybrid extra
        raise ConfigError(f"mode hybrid needs mpi4py and an MPI library (pip install mpi4py mpich; "
                          f"`make install` installs both): {e}") from None
    return MPI.COMM_WORLD


def make_optimizer(size: int, cfg):
    """The optimizer the servers' dense table runs for ``cfg`` (a ``DenseTableConfig``), over ``size``
    floats: the same construction as ``engine.ps.hosts._Block``."""
    if cfg.optimizer == "adam":
        return Adam(size, cfg.learning_rate, cfg.beta1, cfg.beta2, cfg.epsilon)
    return SGD(size, cfg.learning_rate)


class DenseReplica:
    """One dense table held by every worker, kept identical by all-reduce (see the module docstring).

    Parameters
    ----------
    params : float32[P]
        Initial parameters (copied); identical on every rank.
    cfg : engine.config.DenseTableConfig
        Its optimizer settings.
    comm : mpi4py.MPI.Comm
        The workers' communicator (rank r = worker r).
    sync_steps : int
        1: all-reduce the gradients every step; k > 1: average parameters and moments every k steps.
    timeout_s : float, seconds
        Longest wait for one collective.

    Attributes
    ----------
    params : float32[P]
        The live parameters: the model's own vector once ``attach``ed (the pipelined loop), else a
        vector the model loads copies of.
    steps : int
        Optimizer steps taken.
    wait_s, wait_cpu_s : float, seconds
        Wall and CPU time (of the waiting thread) spent in the test-and-yield loop (all collectives so far).
    """

    def __init__(self, params: np.ndarray, cfg, comm, *, sync_steps: int = 1, timeout_s: float = 600.0):
        if sync_steps < 1:
            raise ConfigError(f"hybrid.dense_sync_steps must be >= 1, got {sync_steps}")
        self.params = np.array(params, np.float32).ravel()
        self.cfg, self.comm = cfg, comm
        self.size = comm.Get_size()
        self.sync_steps = int(sync_steps)
        self.timeout_s = float(timeout_s)
        self.opt = make_optimizer(len(self.params), cfg)
        self.steps = 0
        self.unsynced = 0            # model averaging: local steps since the last average
        self.collectives = 0
        self.wait_s = 0.0
        self.wait_cpu_s = 0.0

    def attach(self, live: np.ndarray) -> None:
        """Make ``live : float32[P]`` (the model's parameter vector) this replica's parameters, after
        copying the replica's values into it: from now on steps, averages and loads update the model in
        place, and nobody needs a copy of the parameters to load.

        Raises
        ------
        ValueError
            ``live`` is not float32[P].
        """
        if not isinstance(live, np.ndarray) or live.dtype != np.float32 or live.shape != self.params.shape:
            raise ValueError(f"attach: expected float32[{len(self.params)}], got "
                             f"{getattr(live, 'dtype', type(live).__name__)}{getattr(live, 'shape', '')}")
        if live is not self.params:
            live[...] = self.params
            self.params = live

    # -------------------------------------------------------------------------------- collectives
    def start_sum(self, values: np.ndarray):
        """Start summing ``values : float32[n]`` over the workers -> a handle for ``finish_sum``. Returns
        at once; ``values`` must not change until the sum is finished."""
        from mpi4py import MPI
        send = np.ascontiguousarray(values, np.float32)
        recv = np.empty_like(send)
        if self.size == 1:
            recv[...] = send
            return [None, recv]
        return [self.comm.Iallreduce(send, recv, op=MPI.SUM), recv]

    def finish_sum(self, handle) -> np.ndarray:
        """Complete ``start_sum``: test, then yield or nap, until done -> the sum float32[n] (identical
        on every worker). Idempotent: a finished handle returns its sum at once.

        Raises
        ------
        CollectiveTimeoutError
            Not complete within ``timeout_s``.
        """
        req, recv = handle
        if req is None:
            return recv
        handle[0] = None
        t0, c0 = time.perf_counter(), time.thread_time()
        nap = 0.0
        while not req.Test():
            waited = time.perf_counter() - t0
            if waited > self.timeout_s:
                # no MPI_Cancel: MPI forbids cancelling a collective (MPICH fails "unknown type of
                # request"); the worker exits non-zero and end_world aborts the world
                raise CollectiveTimeoutError(f"MPI all-reduce of {len(recv)} floats did not complete within "
                                             f"{self.timeout_s:g} s (client.barrier_timeout_s): a worker hangs")
            nap = backoff(nap, waited)
            time.sleep(nap)
        self.wait_s += time.perf_counter() - t0
        self.wait_cpu_s += time.thread_time() - c0
        self.collectives += 1
        return recv

    # -------------------------------------------------------------------------------- steps
    def start_step(self, grad: np.ndarray):
        """First half of one step with this worker's ``grad : float32[P]``: k = 1 starts the gradients'
        all-reduce; k > 1 steps locally and, at a sync point, starts the average. -> a handle for
        ``finish_step``."""
        if len(grad) != len(self.params):
            raise ConfigError(f"dense gradient has {len(grad)} values, the dense table {len(self.params)}")
        if self.sync_steps == 1:
            return "grad", self.start_sum(grad)
        self.opt.step(self.params, np.ascontiguousarray(grad, np.float32))
        self.steps += 1
        self.unsynced += 1
        if self.unsynced >= self.sync_steps:
            return "avg", self.start_average()
        return "none", None

    def finish_step(self, handle) -> None:
        """Second half of ``start_step``: k = 1 applies the optimizer to the mean gradient; k > 1
        installs the average (at a sync point)."""
        what, h = handle
        if what == "grad":
            g = self.finish_sum(h)
            if self.size > 1:
                g /= np.float32(self.size)
            self.opt.step(self.params, g)
            self.steps += 1
        elif what == "avg":
            self.finish_average(h)

    def complete(self, handle) -> None:
        """Complete the collective of a ``start_step`` handle without applying it (``finish_step`` then
        applies at once), so the wait and the optimizer step can be timed apart."""
        if handle[1] is not None:
            self.finish_sum(handle[1])

    def step(self, grad: np.ndarray) -> None:
        """``start_step`` then ``finish_step``."""
        self.finish_step(self.start_step(grad))

    def load_state(self, state) -> None:
        """Start from a dense table's whole optimizer state (``engine.ps.dense_client.DenseOptimizerState``,
        as ``PSClient.pull_dense_state`` returns it): parameters, and Adam's m, v and step count t.

        Raises
        ------
        ConfigError
            The state's optimizer or length differs from this replica's (``tables.dense``), or its blocks
            were stepped unequally (one t per block, an optimizer over the whole vector has one).
        """
        if state.optimizer != self.cfg.optimizer or len(state.params) != len(self.params):
            raise ConfigError(f"the servers' dense table holds a {state.optimizer} state of {len(state.params)} "
                              f"floats, this worker's tables.dense config a {self.cfg.optimizer} table of "
                              f"{len(self.params)}")
        try:
            t = state.step
        except ValueError as e:
            raise ConfigError(f"dense table: {e}") from None
        self.params[...] = state.params
        if isinstance(self.opt, Adam):
            self.opt.load_state_dict({"m": np.asarray(state.m, np.float32), "v": np.asarray(state.v, np.float32),
                                      "t": t})

    def state(self):
        """This replica's whole optimizer state -> ``DenseOptimizerState`` (arrays are live views: upload
        or copy them before the next step)."""
        from ..ps.dense_client import DenseOptimizerState
        if isinstance(self.opt, Adam):
            return DenseOptimizerState(self.params, self.opt.m, self.opt.v, np.int64(self.opt.t), "adam")
        return DenseOptimizerState(self.params, None, None, np.int64(0), "sgd")

    def _state(self) -> list[np.ndarray]:
        st = [self.params]
        if isinstance(self.opt, Adam):
            st += [self.opt.m, self.opt.v]
        return st

    def start_average(self):
        """Start averaging the parameters and the optimizer's moments over the workers."""
        self.unsynced = 0
        return self.start_sum(np.concatenate(self._state()))

    def finish_average(self, handle) -> None:
        total = self.finish_sum(handle)
        if self.size > 1:
            total /= np.float32(self.size)
        at = 0
        for a in self._state():
            a[...] = total[at:at + len(a)]
            at += len(a)

    def sync(self) -> None:
        """Model averaging: average now if a local step is not yet averaged (every worker calls it at
        the same point); k = 1: nothing to do (always identical)."""
        if self.sync_steps > 1 and self.unsynced:
            self.finish_average(self.start_average())


def end_world(code: int, error: BaseException | None = None) -> None:
    """Called by the worker's CLI with its exit ``code`` just before it exits: on failure (not 0, not a
    preemption, which every rank takes at the same meeting) abort the MPI world, so mpiexec ends every
    rank now with this code instead of the others waiting for this one in ``MPI_Finalize`` or a
    collective until the launcher declares them hung. No-op without an initialized MPI world of more
    than one process.

    ``error`` is the exception the worker is failing with, if any: its traceback goes into the log line
    here, because the abort ends the process before Python would print it (the worker's log then held
    the abort and no reason)."""
    from ..preempt import EXIT_PREEMPTED
    mpi = sys.modules.get("mpi4py.MPI")
    if code in (0, EXIT_PREEMPTED) or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    if mpi.COMM_WORLD.Get_size() > 1:
        reason = ""
        if error is not None:
            try:
                reason = f" ({type(error).__name__}: {error})"
            except Exception:           # noqa: BLE001 - an exception whose str fails must not stop the abort
                reason = f" ({type(error).__name__})"
        log.error("worker %d: exiting with code %d%s: aborting the MPI world (mpiexec ends every worker; the "
                  "launcher restarts the job)", mpi.COMM_WORLD.Get_rank(), code, reason,
                  exc_info=(type(error), error, error.__traceback__) if error is not None else None)
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(code)


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

    Raises
    ------
    ConfigError
        The MPI world does not match ``--rank`` / ``cluster.workers`` (the worker was not started by
        the launcher's ``mpiexec``), or mpi4py is missing.
    """

    name = "hybrid"
    dense_on_workers = True
    dense_step_replies_params = False      # the step is local: the model's vector, stepped in place
    lockstep = True

    def __init__(self, client, *, rank: int, num_workers: int, dense_tables: dict, sync_steps: int = 1,
                 comm=None, barrier_timeout_s: float = 600.0, overlap_buckets: int | None = None):
        super().__init__(client, rank=rank, num_workers=num_workers, barrier_timeout_s=barrier_timeout_s)
        self.comm = comm if comm is not None else world()
        if (self.comm.Get_rank(), self.comm.Get_size()) != (rank, num_workers):
            raise ConfigError(
                f"mode hybrid: this worker is MPI rank {self.comm.Get_rank()} of {self.comm.Get_size()}, but "
                f"--rank {rank} of cluster.workers={num_workers}: start the workers with one `mpiexec -n "
                f"{num_workers}` whose rank r runs --rank r (the local launcher does)")
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
                           timeout_s=self.barrier_timeout_s)
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

    def steps_per_epoch(self, shard_rows: int, batch_size: int) -> int:
        """Every batch of the smallest shard, its last one partial (a worker with more rows stops there)."""
        return -(-shard_rows // batch_size)

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
