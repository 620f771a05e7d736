"""The dense tower's all-reduce over MPI, for hybrid mode (``engine.modes.hybrid``, Horovod's exchange):
the MPI world of the workers, the dense replica each worker holds and steps, and how collectives are
completed without MPICH's busy wait.

- ``world``: ``MPI.COMM_WORLD`` after the CMA probe (``cma_refused``: MPICH's single-copy transfers need
  ``process_vm_readv``, which a container's seccomp profile may refuse).
- ``DenseReplica``: one dense table's parameters and optimizer state on a worker; per step the gradient
  is summed over the workers with ``MPI_Iallreduce`` and every worker applies the same optimizer step to
  the mean (k = 1), or every worker steps alone and the state is averaged every k steps (model
  averaging).
- ``backoff``: the pauses of the test-and-yield loop (``MPI_Test``, then a yield, then naps) that
  completes a request rather than ``MPI_Wait``, which busy-polls a core a small machine's server needs.
- ``OverlappedDenseStep``: the all-reduce and the optimizer step range by range beside the backward
  pass, on a progress thread (PyTorch DDP's gradient buckets).
- ``end_world``: a failing worker aborts the world, so mpiexec ends every rank at once (a rank that
  cannot reach mpiexec ends itself after ``ABORT_GRACE_S``).
- ``world_hosts``, ``check_world_confined``, ``confine_one_host_world``: where the ranks are, and the
  rule that MPI traffic leaves the host only with ``security.insecure`` (judged by the addresses really
  used); a world all on one host listens on loopback only.

Faults: a collective that does not complete within its timeout (a peer hangs) raises
``CollectiveTimeoutError`` naming the ranks it waited for and their hosts; a peer that dies ends the MPI
world (``mpiexec``).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import sys
import threading
import time
from collections import deque

import numpy as np

from models.optim import SGD, Adam

from .errors import ConfigError, EngineError

log = logging.getLogger(__name__)

SPIN_S = 2e-3        # test with sleep(0) (a yield) this long before napping
MAX_NAP_S = 2e-4     # longest nap between two tests


def backoff(nap: float, waited: float) -> float:
    """The next pause (seconds) of a test-and-yield loop that has waited ``waited`` seconds and last
    napped ``nap``: 0 (a yield) for the first ``SPIN_S``, then doubling from 20 us up to ``MAX_NAP_S``."""
    return 0.0 if waited < SPIN_S else min(MAX_NAP_S, max(2 * nap, 20e-6))


class CollectiveTimeoutError(EngineError, TimeoutError):
    """An MPI collective did not complete in time (a peer hangs or died without ending the world)."""


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


def confine_one_host_world(env=os.environ) -> bool:
    """Before MPI starts in a rank of a world that hydra says is all on this host (``MPI_LOCALNRANKS``
    equal to ``PMI_SIZE``, both set by hydra's proxy): confine the ranks' listeners to loopback
    (``engine.launch.mpi.LOOPBACK_ONLY``) unless the user set one of those variables -> whether it did.

    The local launcher sets them for its world (``loopback_env``); a world started by the user's own
    ``mpiexec -n W`` on one host (role mode) did not get them, and each rank's UCX listened on the
    machine's network address too (2026-11-30: ``ss -ltnp`` under ``mpiexec -n 2``), open to anyone who
    reaches the host, for traffic that is neither authenticated nor encrypted, while the config's
    addresses were all loopback. A world on several hosts is left alone (it needs the network)."""
    from .launch.mpi import LOOPBACK_ONLY
    local, size = env.get("MPI_LOCALNRANKS"), env.get("PMI_SIZE")
    if not local or local != size or any(k in env for k in LOOPBACK_ONLY):
        return False
    env.update(LOOPBACK_ONLY)
    return True


def world():
    """``mpi4py.MPI.COMM_WORLD`` (imports mpi4py, which initializes MPI: a singleton world of one
    process when not started by ``mpiexec``).

    A world all on this host talks on loopback only (``confine_one_host_world``), as the local
    launcher's does.

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
    if "mpi4py.MPI" not in sys.modules:
        confine_one_host_world()
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


def world_hosts(comm) -> list[tuple[int, str]]:
    """Per rank of ``comm``: (its host's id, the host's name). The id is the lowest world rank on that
    host (MPI's shared-memory split, which follows the process manager's host map: ``mpiexec -hosts
    a,b``), the name ``MPI_Get_processor_name``. Collective: every rank calls it at the same point."""
    from mpi4py import MPI
    if comm.Get_size() < 2:
        return [(0, MPI.Get_processor_name())]
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = node.bcast(comm.Get_rank(), root=0)
    finally:
        node.Free()
    return comm.allgather((leader, MPI.Get_processor_name()))


def describe_peers(hosts: list[tuple[int, str]], rank: int, most: int = 8) -> str:
    """The ranks a collective of ``rank`` waits for, with their hosts (``world_hosts``): ``"rank 1 on w1"``,
    ``"ranks 1 on w1, 2 on w2"`` (the first ``most``, then how many more)."""
    others = [f"{r} on {name}" + (" (this host)" if lead == hosts[rank][0] else "")
              for r, (lead, name) in enumerate(hosts) if r != rank]
    more = f" and {len(others) - most} more" if len(others) > most else ""
    return ("rank " if len(others) == 1 else "ranks ") + ", ".join(others[:most]) + more


def check_world_confined(comm, *, insecure: bool, endpoints=(), hosts=None) -> None:
    """Refuse an MPI world whose traffic leaves this host unless ``security.insecure`` is true: MPI is
    neither authenticated nor encrypted. Collective: every rank of ``comm`` calls it at the same point.

    The config's rule (``engine.config``) sees ``cluster.host`` and ``cluster.endpoints`` only; the
    addresses really used are checked here, where the world exists: the servers' endpoints the client
    dialled (``ENGINE_SERVERS`` in role mode, which the config never saw) and the ranks' hosts. A world
    whose ranks are on more than one host sends the dense tower's all-reduce over the network whatever
    address the config names.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The workers' world.
    insecure : bool
        ``security.insecure``.
    endpoints : sequence of str
        ``host:port`` of the servers this worker uses (``PSTransport.endpoints``; ``inproc:N`` is local).
    hosts : list of (int, str), optional
        ``world_hosts(comm)``, if already gathered (else gathered here).

    Raises
    ------
    ConfigError
        Not ``insecure`` and an endpoint is not loopback or the ranks span hosts (named; every rank
        raises it, so the world ends with exit code 2 on every rank).
    """
    from .security.listen import is_loopback
    if insecure:
        return
    remote = [e for e in endpoints if not e.startswith("inproc:") and not is_loopback(e.rsplit(":", 1)[0])]
    if remote:
        raise ConfigError(f"mode hybrid off loopback (server endpoint {remote[0]!r}, from ENGINE_SERVERS or "
                          f"cluster.endpoints) needs security.insecure: true: the workers' MPI traffic is neither "
                          f"authenticated nor encrypted")
    if hosts is None:
        hosts = world_hosts(comm)
    groups: dict = {}
    for rank, (lead, name) in enumerate(hosts):
        groups.setdefault((lead, name), []).append(rank)
    if len(groups) > 1:
        where = "; ".join(f"ranks {ranks} on {name}" for (_, name), ranks in sorted(groups.items()))
        raise ConfigError(f"mode hybrid: the workers' MPI world spans {len(groups)} hosts ({where}), so the dense "
                          f"tower's all-reduce crosses the network, neither authenticated nor encrypted: set "
                          f"security.insecure: true in the workers' config on a network you trust")


def make_optimizer(size: int, cfg):
    """The optimizer the servers' dense table runs for ``cfg`` (a ``DenseTableConfig``), over ``size``
    floats: the same construction as ``engine.ps.dense_host._Block``."""
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
    peers : str
        Who a collective waits for, for the timeout's message (``describe_peers``: "rank 1 on w1").

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

    def __init__(self, params: np.ndarray, cfg, comm, *, sync_steps: int = 1, timeout_s: float = 600.0,
                 peers: str = ""):
        if sync_steps < 1:
            raise ConfigError(f"hybrid.dense_sync_steps must be >= 1, got {sync_steps}")
        self.params = np.array(params, np.float32).ravel()
        self.cfg, self.comm = cfg, comm
        self.size = comm.Get_size()
        self.sync_steps = int(sync_steps)
        self.timeout_s = float(timeout_s)
        self.peers = peers
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
                raise self.timed_out(len(recv))
            nap = backoff(nap, waited)
            time.sleep(nap)
        self.wait_s += time.perf_counter() - t0
        self.wait_cpu_s += time.thread_time() - c0
        self.collectives += 1
        return recv

    def timed_out(self, floats: int) -> CollectiveTimeoutError:
        """The error of a collective of ``floats`` floats not complete within ``timeout_s``: it names the
        ranks it waited for and their hosts (``peers``). MPI does not say which of them is missing; a
        rank on another host may be alive and cut off by the network (a partition between the hosts)."""
        who = f"waiting for {self.peers}" if self.peers else "waiting for the other workers"
        return CollectiveTimeoutError(
            f"MPI all-reduce of {floats} floats did not complete within {self.timeout_s:g} s "
            f"(client.barrier_timeout_s), {who}: a worker hangs, died without ending the world, or is cut off "
            f"from this host by the network")

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
        from .ps.dense_client import DenseOptimizerState
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


#: seconds a rank waits in ``MPI_Abort`` before it ends itself (``end_world``): the abort completes in
#: milliseconds when mpiexec is reachable
ABORT_GRACE_S = 5


def end_world(code: int, error: BaseException | None = None) -> None:
    """Called by the worker's CLI with its exit ``code`` just before it exits: on failure (not 0, not a
    preemption, which every rank takes at the same meeting) abort the MPI world, so mpiexec ends every
    rank now with this code instead of the others waiting for this one in ``MPI_Finalize`` or a
    collective until the launcher declares them hung. No-op without an initialized MPI world of more
    than one process.

    ``error`` is the exception the worker is failing with, if any: its traceback goes into the log line
    here, because the abort ends the process before Python would print it (the worker's log then held
    the abort and no reason).

    The abort waits for the process manager; where it cannot reach ``mpiexec`` (a partition between the
    hosts) the process ends itself after ``ABORT_GRACE_S`` (SIGALRM), instead of waiting as long as the
    partition lasts."""
    from .preempt import EXIT_PREEMPTED
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
        # the local launcher, or in role mode whoever ran mpiexec (a scheduler, an MPI operator), reads the code
        then = ("a config or input error: the job ends, not restarted" if code == 2 else
                "the local launcher, or the scheduler that ran mpiexec, restarts the job")
        log.error("worker %d: exiting with code %d%s: aborting the MPI world (mpiexec ends every worker; %s)",
                  mpi.COMM_WORLD.Get_rank(), code, reason, then,
                  exc_info=(type(error), error, error.__traceback__) if error is not None else None)
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        # MPI_Abort asks the process manager to end the world and waits for it to end this process: a rank
        # whose host lost the network to mpiexec's waited there for as long as the partition lasted (its
        # world long gone, the process alive), 2026-11-30. SIGALRM's default action ends the process
        # after ABORT_GRACE_S whatever MPI does (nothing in the engine handles SIGALRM)
        import signal
        signal.alarm(ABORT_GRACE_S)
        mpi.COMM_WORLD.Abort(code)


# ---------------------------------------------------------------------- overlap with the backward pass
BUCKET_FLOATS = 1 << 16   # smallest collective (floats): a layer's bias alone would cost a round of MPI
PASS_NAP_S = 2e-4        # nap between tests while the pass runs (longer naps measured slower)
_END = object()           # the backward pass is over: complete what is in flight, then signal
_STOP = object()          # the thread exits


class OverlappedDenseStep:
    """Runs ``replica``'s gradient all-reduce and optimizer step range by range beside the backward pass
    (PyTorch DDP's gradient buckets, Horovod's tensor fusion), on the same MPI ``Iallreduce`` as
    ``DenseReplica``.

    The backward pass finishes the dense gradient layer by layer from the output down
    (``CTRModelBase.forward_backward``'s ``on_grad``). As soon as a range of it is final, and the pass no
    longer reads those parameters, the range goes to this worker's *dense progress thread*, which starts its
    ``MPI_Iallreduce`` (ranges are first gathered into buckets of at least ``BUCKET_FLOATS`` floats: one
    collective per layer of ~100k floats, not one per bias). The thread completes the collectives in the
    order they started with the test-and-yield loop (``MPI_Test``, then a yield or a nap: never MPICH's
    busy ``MPI_Wait``) and, for each one that completes, divides the sum by the number of workers and
    applies the optimizer step to that range of the parameters in place (``Adam.step_range`` with the
    step's coefficients: the same bits as one whole-vector step, the update being elementwise). So the
    upper layers are exchanged and stepped while the lower layers' matrix products run, and what is left
    after the pass is the lowest layer's exchange and update.

    The parameters updated are the model's own (``attach``): the next step computes with them, no copy in
    and out. Every worker starts the same collectives in the same order (the same backward pass over the
    same layout), so the parameters stay bit-identical on every worker, as with ``DenseReplica.step``.

    Faults: a collective that does not complete within ``timeout_s`` (a peer hangs) raises
    ``CollectiveTimeoutError`` on the worker's thread at ``finish``; a peer that dies ends the MPI world
    (``mpiexec``), as with ``DenseReplica``. Only the progress thread calls MPI while a step is open.

    Parameters
    ----------
    replica : DenseReplica
        With ``sync_steps`` 1; its ``params`` become the model's live vector (``attach``).
    bucket_floats : int
        Smallest collective, in floats (ranges are gathered up to it).

    The replica's ``wait_s`` gains the wall time the worker's thread waits in ``finish`` (what the
    overlap did not hide), its ``wait_cpu_s`` the progress thread's CPU time (starting collectives,
    testing them, dividing, the optimizer), its ``collectives`` one per bucket.
    """

    def __init__(self, replica, *, bucket_floats: int = BUCKET_FLOATS):
        if replica.sync_steps != 1:
            raise ValueError("the overlapped dense step all-reduces gradients: hybrid.dense_sync_steps must be 1")
        self.rep = replica
        self.bucket_floats = int(bucket_floats)
        self.recv = np.empty_like(replica.params)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._pending: tuple[np.ndarray, int, int] | None = None
        self._coeffs = None
        self._open = False
        self._thread: threading.Thread | None = None

    def attach(self, live: np.ndarray) -> None:
        """Make ``live : float32[P]`` (the model's parameter vector) the replica's parameters
        (``DenseReplica.attach``); from now on steps update it in place.

        Raises
        ------
        ValueError
            ``live`` is not float32[P].
        """
        self.rep.attach(live)

    # ------------------------------------------------------------------------ the worker's thread
    def begin(self):
        """Open one step -> the ``on_grad(grad, lo, hi)`` callback for ``forward_backward``.

        Raises
        ------
        CollectiveTimeoutError
            A previous step's collective failed (the job must end).
        """
        if self._error is not None:
            raise self._error
        if self._open:
            raise RuntimeError("OverlappedDenseStep.begin: the previous step was not finished")
        self._coeffs = self.rep.opt.begin_step()
        self._open = True
        self._done.clear()
        if self.rep.size > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hybrid-dense-progress", daemon=True)
            self._thread.start()
        return self._ready

    def _ready(self, grad: np.ndarray, lo: int, hi: int) -> None:
        """``grad[lo:hi]`` is final (called inside the backward pass)."""
        if self.rep.size == 1:                     # nothing to exchange: step the range now
            self.rep.opt.step_range(self.rep.params, grad, lo, hi, self._coeffs)
            return
        p = self._pending
        if p is not None and p[0] is grad and (hi == p[1] or lo == p[2]):   # adjacent: one bucket
            p = (grad, min(lo, p[1]), max(hi, p[2]))
        else:
            self._flush()
            p = (grad, lo, hi)
        self._pending = p
        if p[2] - p[1] >= self.bucket_floats:
            self._flush()

    def _flush(self) -> None:
        if self._pending is not None:
            self._q.put(self._pending)
            self._pending = None

    def finish(self) -> None:
        """Close the step: wait until every range is all-reduced and stepped (the parameters are then
        this step's, identical on every worker).

        Raises
        ------
        CollectiveTimeoutError
            A collective did not complete within the replica's ``timeout_s``.
        """
        if not self._open:
            raise RuntimeError("OverlappedDenseStep.finish: no step is open")
        self._open = False
        self.rep.steps += 1
        if self.rep.size == 1:
            return
        t0 = time.perf_counter()
        self._flush()
        self._q.put(_END)
        # the progress thread enforces timeout_s per collective; this bound only catches a dead thread
        if not self._done.wait(self.rep.timeout_s + 60.0) and self._error is None:
            self._error = CollectiveTimeoutError("hybrid dense progress thread stopped answering")
        self.rep.wait_s += time.perf_counter() - t0
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the progress thread (idempotent)."""
        if self._thread is not None:
            self._q.put(_STOP)
            self._thread.join(timeout=5.0)
            self._thread = None

    # ------------------------------------------------------------------------ the progress thread
    def _run(self) -> None:
        """The progress thread: ``_progress``, whose error (an MPI error, a failed optimizer step) is
        handed to the training thread, which raises it in ``finish`` or ``begin`` (before, the thread died
        with it, ``finish`` waited ``timeout_s + 60`` s and the job saw a hang, not the error)."""
        try:
            self._progress()
        except BaseException as e:  # noqa: BLE001 - raised again on the training thread
            self._error = e
            self._done.set()

    def _progress(self) -> None:
        from mpi4py import MPI

        rep, comm = self.rep, self.rep.comm
        inflight: deque = deque()           # (request, lo, hi, started at)
        ended = False
        ended_at = nap = 0.0
        c0 = time.thread_time()
        while True:
            if not inflight and not ended:
                self._account(c0)
                msg = self._q.get()         # idle: block, no CPU
                c0 = time.thread_time()
            else:
                try:
                    msg = self._q.get_nowait()
                except queue.Empty:
                    msg = None
            if msg is _STOP:
                return
            if msg is _END:
                ended, ended_at = True, time.perf_counter()
            elif msg is not None:
                grad, lo, hi = msg
                inflight.append((comm.Iallreduce(grad[lo:hi], self.recv[lo:hi], op=MPI.SUM), lo, hi,
                                 time.perf_counter()))
                continue
            if inflight:
                req, lo, hi, started = inflight[0]
                if req.Test():
                    inflight.popleft()
                    r = self.recv[lo:hi]
                    r /= np.float32(rep.size)
                    rep.opt.step_range(rep.params, self.recv, lo, hi, self._coeffs)
                    rep.collectives += 1
                    nap = 0.0
                    continue
                waited = time.perf_counter() - started
                if waited > rep.timeout_s:      # no MPI_Cancel of a collective (see finish_sum)
                    self._error = rep.timed_out(hi - lo)
                    self._account(c0)
                    self._done.set()
                    return
                # while the pass still runs, nap (the worker's matrix products want the core); once the
                # worker waits in finish, yield first (the tail is on its critical path), then back off
                nap = backoff(nap, time.perf_counter() - ended_at) if ended else PASS_NAP_S
                time.sleep(nap)
            elif ended:
                ended = False
                self._account(c0)
                c0 = time.thread_time()
                self._done.set()

    def _account(self, c0: float) -> None:
        self.rep.wait_cpu_s += time.thread_time() - c0
