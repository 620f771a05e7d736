"""The dense tower's MPI progress in hybrid mode (``engine.modes.hybrid``): how a worker completes its
non-blocking collectives without MPICH's busy ``MPI_Wait`` (``backoff``: the test-and-yield loop's
pauses), the error a collective that never completes raises, and ``OverlappedDenseStep``, which
all-reduces and steps the dense gradient range by range beside the backward pass on a progress thread.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque

import numpy as np

from ..errors import EngineError

SPIN_S = 2e-3        # test with sleep(0) (a yield) this long before napping
MAX_NAP_S = 2e-4     # longest nap between two tests


def backoff(nap: float, waited: float) -> float:
    """The next pause (seconds) of a test-and-yield loop that has waited ``waited`` seconds and last
    napped ``nap``: 0 (a yield) for the first ``SPIN_S``, then doubling from 20 us up to ``MAX_NAP_S``."""
    return 0.0 if waited < SPIN_S else min(MAX_NAP_S, max(2 * nap, 20e-6))


class CollectiveTimeoutError(EngineError, TimeoutError):
    """An MPI collective did not complete in time (a peer hangs or died without ending the world)."""


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
                    self._error = CollectiveTimeoutError(
                        f"MPI all-reduce of {hi - lo} floats did not complete within {rep.timeout_s:g} s "
                        f"(client.barrier_timeout_s): a worker hangs")
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
