"""``ctr_dnn`` and ``deepfm``: CTR models trained from Arrow batches through the parameter servers.

One worker step, as named methods (TorchRec's ``input_dist → compute → output_dist`` spirit)::

    read             record batch → labels float32[B], dense float32[B, 13], keys uint64[B, S]
    dedup            keys → uniq uint64[u], rows int32[B*S] (index into uniq), segments int32[B*S]
                     (cell = example * S + slot), shows float32[u] (occurrences), clicks float32[u]
                     (label sum over the occurrences)
    pull             emb = mode.pull_sparse(uniq) float32[u, width] (training pulls create nothing but
                     read the value a push would create); dense parameters from mode.pull_dense
    forward_backward model.forward_backward(...) → loss, probs, grad_emb, grad_dense (mean-loss grads)
    push             mode.push_sparse_grads(uniq, B * grad_emb, shows, clicks); mode.push_dense_grads

Async mode (``model.pipeline``): the dense gradient travels as DENSE_STEP (the servers apply Adam and
reply with the fresh parameters: one round trip instead of a push and a pull), and the network works
next to the matrix products. ``exact`` (default): while batch t computes, a communicator thread reads
and dedups batch t+1; then it sends t's sparse gradients, t's dense gradient and t+1's keys in one Step
request per server (``Mode.push_pull``: push, dense step, then pull, applied in that order), which
replies with t+1's rows and the fresh dense parameters. Step t+1 starts when that is done, so it trains
on values that include all of this worker's updates, as the sequential loop does; every push is applied
on arrival. One request instead of three saves ~1 ms of gRPC CPU per call on each side.

Merged dense steps (``model.dense_merge_steps`` k, async only; 1 in configs/ctr.yaml, 4 in the others): the dense
gradients of k steps are averaged and sent once (``merge_dense``), and the worker keeps its dense
parameters between those steps (gradient accumulation for the MLP, as Paddle's async communicator merges
queued dense gradients; sparse rows are still pushed and pulled every step). The dense exchange (1.7 MB
each way for CTR-DNN) is most of a step's non-matrix CPU, so k = 4 trained 1.4x faster on a 2-core
machine (``bench/ctr_bench.py``: 36.6k vs 26.3k examples/s). On the shared Criteo rows (mean of 3
seeds, both workers starting together after the JIT warm-up) k = 4 cost CTR-DNN 0.009 test AUC (0.7465
vs 0.7557; logloss 0.468 vs 0.459): with 16k rows at batch 128, a quarter of the dense steps is too few;
on 800k generated rows at batch 512 the held-out AUC did not move (seeds 0-1: 0.8053/0.8056 vs
0.8053/0.8057), so merge on data of a million rows and more.
(Before the warm-up existed one worker, loading a kernel in its first step, started ~0.3 s after the other,
and k = 4 then held 0.7550 warm but not cold: how the workers' merged steps interleave matters at this
size.) Hence 1 in ``configs/ctr.yaml``; DeepFM lost nothing at k = 4 (0.7593 vs 0.7590 on the shared
rows), so ``configs/deepfm.yaml`` merges 4. Every segment end (epoch,
aligned checkpoint point, evaluation) sends what was summed, so no gradient is lost or carried over.
``stale`` (``configs/ctr_bigdata.yaml``, ``configs/deepfm_bigdata.yaml``): the same Step requests, two in
flight instead of one, so a step trains on what the request before its predecessor's returned and sees
this worker's own updates one step later (Paddle's async communicator does not wait for a step's own
push either). With 4 merged dense steps it is the fastest async setting (ctr_bench: ~1.8x the
examples/s of the shipped CTR-DNN config, the same held-out AUC on 1M generated rows), but on the 16k
shared Criteo rows it costs CTR-DNN AUC (mean of seeds 0-2: 0.7478 at k = 1, 0.7360 at k = 4, against
0.7560 exact at k = 1) and DeepFM a little (0.7576 against 0.7593, k = 4).
``sequential``: one step after the other. Sync always runs so (a pull must see the step's pushes). GEO
with ``exact`` or ``stale`` reads batch t+1 and fetches its rows missing from the local copy while t
computes (``_prefetched_steps``): with one worker it trains the sequential loop's model; with several, a
row entering the local copy may carry the servers' value of one step earlier.

Gradient scaling (batch-size independence). ``grad_emb`` is the gradient of the MEAN batch loss, i.e.
``(1/B) Σ_occurrences g``. The worker pushes the gradient of the SUMMED loss, ``B * grad_emb``, with
``shows`` = the key's occurrence count in the batch; the sparse table divides a pushed gradient by its
show count before the optimizer rule (Paddle's CtrCommonAccessor), so each key is updated with the mean
per-occurrence gradient whatever the batch size. In sync mode the servers sum the held pushes of all
workers (gradients and shows alike), so the division gives the mean over every occurrence in the global
batch. GEO's local table applies the same rule with plain SGD. Dense gradients are the mean-loss ones
(Adam on the servers; GEO: local SGD, deltas every ``geo.k_steps``).

Data (``model.data``, see ``ctr_data``) is resolved once in the launcher by ``prepare``: the shared
Criteo rows are converted to Arrow (canonical split) when their Arrow form is missing or stale, or a
planted-model file is generated when they are absent; every input's schema, every train value the workers
check (labels, dense values, keys) and every test value evaluation reads are checked then. A worker started
without a launcher (``--role worker`` under ``engine k8s``, Slurm, by hand) checks its own share of them
before its first step instead, and the workers agree on one verdict (``ctr_inputs``). Each worker
reads its shard of the train split (an equal share of the rows, ``ctr_data.make_source``; shuffled within
``shuffle_buffer`` rows, a new order every epoch), evaluates its shard of the test split after each epoch,
and the histograms are merged on the servers into the global AUC (``ctr_report``). Metrics go to one
JSON-lines file per run (``model.metrics_file``).

Checkpoints (``checkpoint.root`` set) are written by rank 0 at step-aligned meetings of the workers, with
every worker's data position, so ``--resume`` continues at the next unread batch (``ctr_positions``); the
final one (``checkpoint.final``) before the final evaluation, so a failing evaluation loses no training.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time

import numpy as np
import pyarrow as pa

from models import ModelConfigError, build_model
from streaming.source import list_files

from .. import failpoints, observability, progress
from ..errors import ConfigError, TrainingDivergedError
from ..metrics import BinaryMetrics
from ..program_configs import CTRConfig as Config
from ..ps.warmup import read_only
from . import ctr_eval
from .ctr_data import (CTRBatch, check_unchanged, dedup_batch, expected_schema, file_rows,
                       files_fingerprint, local_versions, make_source, prepare_data, shard_sizes, to_batch,
                       untrained_rows)
from .ctr_inputs import agree_on_files, check_before_training, check_splits
from .ctr_records import Listing, Records
from .ctr_positions import AlignedCheckpoints, Position
from .ctr_report import EVAL_BUCKETS, Follower, MetricsFile, now_stamp, reset_metrics
from .ctr_steps import StepPipelines

log = logging.getLogger(__name__)

WRITES_CHECKPOINTS = True    # rank 0 writes them at aligned points with exact data positions (ctr_positions)
PHASES = ("read", "dedup", "pull_sparse", "pull_dense", "compute", "push_sparse", "push_dense", "push_pull",
          "end_step", "wait", "prefetch")   # seconds per step phase (profile); push_pull: the fused async
                                            # call; prefetch: GEO's fetch of the next batch's missing rows


# ---------------------------------------------------------------------------------- launcher side
def _check_tables(cfg, p: Config) -> None:
    kind = cfg.model.kind
    try:
        model = build_model(kind, num_slots=max(1, len(p.slots)), dim=p.dim, dense_dim=p.dense_dim,
                            hidden=p.hidden, seed=p.seed)
    except ModelConfigError as e:
        raise ConfigError(f"model: {e}") from None
    if not p.slots:
        raise ConfigError("model.slots must list at least one sparse column, got []")
    t = cfg.sparse_tables.get(p.sparse_table)
    if t is None:
        raise ConfigError(f"tables.sparse.{p.sparse_table}: missing (model.sparse_table names it); "
                          f"declared sparse tables: {sorted(cfg.sparse_tables)}")
    if t.dim != model.sparse_width:
        extra = " (deepfm rows hold the first-order weight + the embedding: dim + 1)" if kind == "deepfm" else ""
        raise ConfigError(f"tables.sparse.{p.sparse_table}.dim must be {model.sparse_width} for {kind} with "
                          f"model.dim={p.dim}{extra}, got {t.dim}")
    if t.initializer == "zeros" and p.dense_dim == 0:    # every tower input 0: ReLU'(0) = 0 passes nothing back
        learns = ("only the output bias learns" if kind == "ctr_dnn" else
                  "only the first-order weights learn: a logistic regression")
        raise ConfigError(f"tables.sparse.{p.sparse_table}.initializer: zeros with model.dense_dim=0 cannot train "
                          f"{kind}: every embedding starts at 0 and no dense feature feeds the tower, so no gradient "
                          f"reaches the embeddings or hidden layers ({learns}); use initializer uniform or normal "
                          f"(init_range e.g. 0.01), or dense features")
    if p.dense_table not in cfg.dense_tables:
        raise ConfigError(f"tables.dense.{p.dense_table}: missing (model.dense_table names it); declared "
                          f"dense tables: {sorted(cfg.dense_tables)}")


BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _limit_blas_threads(threads: int, processes: int) -> None:
    """Set the BLAS thread count the launched processes inherit (unless the environment sets it).

    ``threads`` 0 = auto: the machine's cores shared by the local processes (at least 1). An
    oversubscribed OpenBLAS (every worker starting one thread per core) is 8x slower on a busy 2-core
    machine than one thread per worker.
    """
    n = threads or max(1, (os.cpu_count() or 1) // max(1, processes))
    for var in BLAS_ENV:
        if var not in os.environ:
            os.environ[var] = str(n)
            log.debug("%s=%d for the launched processes", var, n)


def prepare(cfg):
    """Launcher hook, before any process starts: check the tables against the model, resolve the data
    (convert / generate, schema check), pick this run's metrics file and write its start event.

    Raises
    ------
    ConfigError
        A missing table or a width mismatch, a bad model knob, a missing data path (key named).
    streaming.errors.DataFormatError, streaming.errors.SchemaError
        Bad input data: a train file's schema or any value a worker checks (``ctr_data.check_train_split``),
        a test file's schema or any value evaluation reads (label, dense, keys, group ids), named with the
        file, the row and the column.
    """
    p: Config = cfg.model.params
    _check_tables(cfg, p)
    _limit_blas_threads(p.blas_threads, cfg.cluster.workers + cfg.cluster.servers)
    schema = expected_schema(p.slots, p.dense_dim)
    opts = cfg.storage.options()          # URI inputs (s3://, hdfs://) are read with the checkpoints' settings
    data = prepare_data(p.data, schema, opts)
    metrics_file = p.metrics_file or str(
        (os.path.abspath(p.metrics_dir)) + f"/{cfg.model.kind}-{cfg.mode}-{now_stamp()}-{os.getpid()}.jsonl")
    p = dataclasses.replace(p, data=data, metrics_file=metrics_file)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, params=p))
    # every train value a worker checks and every test value evaluation reads, checked now (before training,
    # not after it), or by an earlier start of the job on the same files (ctr_records)
    rows, test_rows = check_splits(cfg, data, schema, opts)
    log.info("train split %s: %d rows; test split %s: %s (values checked)", data.train_path, rows,
             data.test_path, "as at an earlier start" if test_rows is None else f"{test_rows} rows")
    MetricsFile(metrics_file).write({
        "event": "start", "model": cfg.model.kind, "mode": cfg.mode, "workers": cfg.cluster.workers,
        "servers": cfg.cluster.servers, "train_path": data.train_path, "test_path": data.test_path,
        "train_rows": rows, "epochs": p.epochs, "batch_size": p.batch_size, "seed": p.seed,
        "time": time.time()})
    log.info("metrics file: %s", metrics_file)
    return cfg


def follow(cfg) -> Follower:
    """Launcher hook: a context manager showing the metrics file live while the job runs."""
    p: Config = cfg.model.params
    files = list_files(p.data.train_path, storage_options=cfg.storage.options())
    counts = Listing(Records.of(cfg), "train", files).rows      # counted by prepare's check, recorded
    rows = sum(counts if counts is not None else file_rows(files))
    return Follower(p.metrics_file, rows * p.epochs)


def final(cfg, results: list[dict]) -> dict:
    """Launcher hook: the final event (written to the metrics file and printed as the last stdout line).

    ``examples_per_s`` = training examples of all workers / the longest worker's training time
    (evaluation excluded, data reading included); ``rows_left_out_per_epoch``: train rows no worker
    reads in an epoch (a lockstep mode's shards of unequal step counts, ``ctr_data.untrained_rows``; 0
    in async and GEO).
    """
    p: Config = cfg.model.params
    test = next((r.get("test") for r in results if r.get("rank") == 0), None) or {}
    examples = sum(r.get("examples", 0) for r in results)
    seconds = max([r.get("train_seconds", 0.0) for r in results] + [1e-9])
    event = {"event": "final", "model": cfg.model.kind, "mode": cfg.mode,
             "test_auc": test.get("auc"), "test_logloss": test.get("logloss"),
             "test_copc": test.get("copc"), **ctr_eval.final_fields(test), "examples_per_s": examples / seconds,
             "metrics_file": p.metrics_file, "checkpoint": None,
             "rows_left_out_per_epoch": max([r.get("rows_left_out_per_epoch", 0) for r in results] + [0])}
    started = [r["train_started_at"] for r in results if r.get("train_started_at")]
    event["train_started_at"] = min(started) if started else None   # wall clock of the first step
    MetricsFile(p.metrics_file).write({**event, "examples": examples, "train_seconds": seconds})
    event["tensorboard_dir"] = observability.record_final(cfg, p.metrics_file, event)
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in event.items()}


# ---------------------------------------------------------------------------------- worker side
class CTRTrainer(StepPipelines):
    """The worker loop of one rank (see the module docstring for the step).

    Parameters
    ----------
    ctx : engine.roles.WorkerContext
    """

    def __init__(self, ctx):
        self.ctx = ctx
        self.cfg: Config = ctx.config.model.params
        self.kind = ctx.config.model.kind
        self.mode, self.client = ctx.mode, ctx.client
        self.rank, self.num_workers = ctx.rank, ctx.num_workers
        self.storage_options = ctx.config.storage.options()    # reach URI inputs (s3://, hdfs://)
        p = self.cfg
        self.model = build_model(self.kind, num_slots=len(p.slots), dim=p.dim, dense_dim=p.dense_dim,
                                 hidden=p.hidden, seed=p.seed)
        width = self.client.sparse_dim(p.sparse_table)
        if width != self.model.sparse_width:
            raise ConfigError(f"tables.sparse.{p.sparse_table}.dim is {width} on the servers, but {self.kind} "
                              f"needs {self.model.sparse_width}")
        self.schema = expected_schema(p.slots, p.dense_dim)
        self.metrics = observability.events(MetricsFile(p.metrics_file or os.path.join(
            p.metrics_dir, f"{self.kind}-{ctx.config.mode}.jsonl")), ctx.config, self.rank)   # + TensorBoard
        self.num_slots = len(p.slots)
        self.steps = 0                # the job's steps at the last commit point (see the property)
        self.examples = 0             # training examples of this process
        self.examples_before = 0      # this rank's examples before the restored position (train events)
        self.file_rows: list[int] | None = None   # rows of each train file (ctr_data.file_rows), in run()
        self.train_versions: list = []            # (size, mtime_ns, inode) of its local files as listed
        self.train_fingerprint: list = []         # ctr_data.files_fingerprint of them as listed
        self.train_files: list | None = None      # the train inputs as listed once, in run(): every epoch reads
        self.untrained = 0            # train rows a lockstep mode leaves out of every epoch (all workers)
        self.train_seconds = 0.0      # wall seconds of this process's finished training epochs
        self._clock_lock = threading.Lock()
        self._train_clock: tuple[float, float | None] = (0.0, None)   # (seconds, perf_counter of the running
                                                                      # epoch's start or None): live_counters
        self.train_started_at: float | None = None    # wall clock (seconds) of this worker's first step
        self.loss_sum = 0.0
        self.phases = dict.fromkeys(PHASES, 0.0)
        self._fresh_dense: np.ndarray | None = None    # async: parameters the last DENSE_STEP returned
        self._dense_stale = True      # the model's dense parameters must be pulled before the next step
        self._dense_sum: np.ndarray | None = None      # async: dense gradients summed, not sent yet
        self._dense_n = 0
        self.dense_steps = 0          # dense gradients sent (async)
        self._dense_lock = threading.Lock()
        # hybrid: async's sparse pipeline, the dense step beside it on this thread (Mode.dense_on_workers)
        self.pipelined = p.pipeline != "sequential" and self.mode.pipelines_requests
        self.prefetching = p.pipeline != "sequential" and self.mode.prefetches_rows
        observability.watch_trainer(self)     # Prometheus reads examples, steps, phases at scrape time
        self.evaluation = ctr_eval.Evaluation(self)    # rows, group metrics and their merge (ctr_eval)

    def warm_up(self) -> float:
        """Compile this worker's kernels (read, dedup, forward/backward, predict, metrics) on one
        synthetic batch of ``batch_size`` rows, so that no step of the job compiles (``engine.ps.warmup``
        does the same for the PS kernels). Only gradients are computed (the parameters stay as they are)
        and nothing reaches the servers. Returns seconds."""
        t0 = time.perf_counter()
        p, rng = self.cfg, np.random.default_rng(0)
        n = p.batch_size
        cols = {"label": pa.array((rng.random(n) < 0.25).astype(np.float32))}
        if p.dense_dim:
            cols["dense"] = pa.FixedSizeListArray.from_arrays(
                pa.array(rng.random(n * p.dense_dim, np.float32)), p.dense_dim)
        for s in p.slots:
            cols[s] = pa.array(rng.integers(1, 1000, n, dtype=np.uint64))
        rb = pa.RecordBatch.from_arrays([cols[f.name] for f in self.schema], schema=self.schema)
        batch = self.read(rb)
        uniq, rows, segments, _, _ = self.dedup(batch)
        emb = rng.uniform(-0.01, 0.01, (len(uniq), self.model.sparse_width)).astype(np.float32)
        for rows_in in (emb, read_only(emb)):      # rows a multi-server assembly or a pull reply gives
            res = self.model.forward_backward(rows_in, rows, segments, batch.dense, batch.labels)
            self.model.predict(rows_in, rows, segments, batch.dense)
        BinaryMetrics(EVAL_BUCKETS).update(res.probs, batch.labels)
        return time.perf_counter() - t0

    # -- step counts ------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """The job's steps up to the last commit point (an aligned checkpoint point or an epoch end; the
        online job's partition end), counted from the restored checkpoint's ``step`` (0 in a fresh job):
        what a checkpoint records. Assigning it also marks ``Mode.step`` (see ``global_step``)."""
        return self._committed_steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._committed_steps, self._steps_mark = int(value), self.mode.step

    @property
    def global_step(self) -> int:
        """The job's step now: ``steps`` plus the steps this process ended since ``steps`` was last set
        (``Mode.step`` counts them live). The one step axis of every event (``train``, ``eval``,
        ``profile``: TensorBoard's x axis, the launcher's log): monotonic across restarts and resumes,
        since a resumed process starts at its checkpoint's step. Works for subclasses that move
        ``steps`` at their own commit points (``ctr_online``: the restored step, then each partition's)."""
        return self._committed_steps + self.mode.step - self._steps_mark

    @contextlib.contextmanager
    def training_clock(self):
        """Count the time inside the block into ``train_seconds`` (at its end) and, while it runs, into
        ``live_counters``. Not reentrant."""
        with self._clock_lock:
            start = time.perf_counter()
            self._train_clock = (self.train_seconds, start)
        try:
            yield
        finally:
            with self._clock_lock:
                self.train_seconds += time.perf_counter() - start
                self._train_clock = (self.train_seconds, None)

    def live_counters(self) -> dict[str, float]:
        """This process's work since it started, read at scrape time (Prometheus, another thread):
        ``examples`` trained, ``steps`` ended (``Mode.examples`` and ``Mode.step``, both moved by
        ``Mode.end_step`` after every batch) and ``train_seconds``, wall seconds inside training epochs
        (reading the data and the epoch's checkpoint meetings in, evaluations out), the running epoch
        included. A restarted or resumed process starts again from 0, whatever step it resumed at."""
        with self._clock_lock:
            done, since = self._train_clock
            seconds = done + (time.perf_counter() - since if since is not None else 0.0)
        return {"examples": self.mode.examples, "steps": self.mode.step, "train_seconds": seconds}

    # -- the step ---------------------------------------------------------------------------------
    def read(self, rb) -> CTRBatch:
        """Arrays of one record batch."""
        return to_batch(rb, self.cfg.slots, self.cfg.dense_dim)

    def dedup(self, batch: CTRBatch):
        """Unique keys of the batch and the sparse index into them.

        Returns
        -------
        uniq : uint64[u]
            First-occurrence order (``ctr_data.dedup_batch``, O(B*S)).
        rows : int32[B*S]
            ``uniq[rows[i]]`` is occurrence ``i`` (row-major over (example, slot)).
        segments : int32[B*S]
            Cell of each occurrence: ``example * S + slot``.
        shows : float32[u]
            Occurrences of each unique key.
        clicks : float32[u]
            Sum of the labels of the examples each key occurs in.
        """
        return dedup_batch(batch)

    def pull(self, uniq: np.ndarray, prefetched=None) -> np.ndarray:
        """Training values of the batch's keys -> float32[u, width]; refreshes the dense parameters
        (async: the parameters the previous step's DENSE_STEP returned, when there is one).
        ``prefetched``: what ``Mode.prefetch_sparse`` fetched ahead for these keys (GEO)."""
        t0 = time.perf_counter()
        table = self.cfg.sparse_table
        emb = (self.mode.pull_sparse(table, uniq) if prefetched is None
               else self.mode.pull_sparse(table, uniq, prefetched=prefetched))
        t1 = time.perf_counter()
        self.refresh_dense()
        self.phases["pull_sparse"] += t1 - t0
        self.phases["pull_dense"] += time.perf_counter() - t1
        return emb

    def refresh_dense(self) -> None:
        """Load the dense parameters into the model: the ones a dense step returned (async), once; else
        pulled now, except in async mode between two merged dense steps (nothing changed them)."""
        with self._dense_lock:
            fresh, self._fresh_dense = self._fresh_dense, None
        if fresh is not None:
            self.model.set_dense(fresh)
        elif self._dense_stale or not self.mode.dense_step_replies_params:
            self.model.set_dense(self.mode.pull_dense(self.cfg.dense_table))
        self._dense_stale = False

    def _send_dense(self, grad: np.ndarray | None) -> None:
        """Async: one dense step with ``grad`` (None: nothing to send); the next step loads the
        parameters it returned."""
        if grad is not None:
            fresh = self.mode.push_pull_dense(self.cfg.dense_table, grad)
            with self._dense_lock:
                self._fresh_dense = fresh

    def _flush_dense(self) -> None:
        """Async: send the dense gradients merged so far (a segment ends)."""
        if self.mode.dense_step_replies_params:
            self._send_dense(self.merge_dense(None, flush=True))

    def merge_dense(self, grad: np.ndarray | None, flush: bool = False) -> np.ndarray | None:
        """Async mode: the dense gradient to send after this step, or None to send nothing yet.

        With ``dense_merge_steps`` k > 1 the gradients ``grad : float32[P]`` of k steps are summed and
        their mean is sent once, so the servers take one Adam step per k worker steps and the worker
        keeps its dense parameters between them (gradient accumulation; Paddle's async communicator
        likewise merges queued dense gradients before sending). ``flush`` (a segment or epoch end, a
        drain) sends the mean of what was summed; ``grad`` None adds nothing. k = 1 returns ``grad``.
        """
        k = self.cfg.dense_merge_steps
        if k <= 1 and self._dense_n == 0:
            if grad is not None:
                self.dense_steps += 1
            return grad
        if grad is not None:
            if self._dense_sum is None:
                self._dense_sum = np.array(grad, np.float32)
            else:
                self._dense_sum += grad
            self._dense_n += 1
        if self._dense_n == 0 or (self._dense_n < k and not flush):
            return None
        out, n = self._dense_sum, self._dense_n
        self._dense_sum, self._dense_n = None, 0
        out *= np.float32(1.0 / n)
        self.dense_steps += 1
        return out

    def forward_backward(self, emb, rows, segments, batch: CTRBatch, on_grad=None):
        """``models.StepResult`` of the batch (gradients of the mean loss); ``on_grad`` as the model's.

        Raises
        ------
        TrainingDivergedError
            The loss or a sparse gradient is NaN or Inf (checked here, before anything is pushed)."""
        res = self.model.forward_backward(emb, rows, segments, batch.dense, batch.labels, on_grad)
        if not (np.isfinite(res.loss) and np.isfinite(res.grad_emb).all()):
            self._diverged(res)
        return res

    def _diverged(self, res) -> None:
        c = self.ctx.config
        rates = [f"tables.sparse.{n}.learning_rate={t.learning_rate:g}" for n, t in c.sparse_tables.items()]
        rates += [f"tables.dense.{n}.learning_rate={t.learning_rate:g}" for n, t in c.dense_tables.items()]
        if self.mode.name == "geo":
            rates.insert(0, f"geo.learning_rate={c.geo.learning_rate:g}")
        what = (f"the loss is {float(res.loss)}" if not np.isfinite(res.loss) else
                f"{int((~np.isfinite(res.grad_emb)).any(axis=-1).sum())} sparse gradient row(s) are NaN or Inf")
        raise TrainingDivergedError(
            f"training diverged: worker {self.rank}, step {self.global_step}: {what}; nothing of this step "
            f"was pushed to the servers, and the last checkpoint holds the last finite state. Lower the learning rates "
            f"({', '.join(rates)}) and resume")

    def push(self, uniq, res, shows, clicks, batch_size: int) -> None:
        """Sum-loss sparse gradients with show/click counts (the server divides by shows), then the
        mean-loss dense gradient. Async mode sends the dense gradient with DENSE_STEP (one round trip:
        the servers apply Adam and reply with the fresh parameters, which the next step uses instead
        of pulling)."""
        grads = res.grad_emb
        grads *= np.float32(batch_size)
        t0 = time.perf_counter()
        self.mode.push_sparse_grads(self.cfg.sparse_table, uniq, grads, shows=shows, clicks=clicks)
        t1 = time.perf_counter()
        if self.mode.dense_step_replies_params:
            self._send_dense(self.merge_dense(res.grad_dense))
        else:
            self.mode.push_dense_grads(self.cfg.dense_table, res.grad_dense)
        self.phases["push_sparse"] += t1 - t0
        self.phases["push_dense"] += time.perf_counter() - t1

    def train_step(self, batch: CTRBatch, deduped=None, prefetched=None):
        """One sequential step: dedup (unless ``deduped``, ``dedup``'s result, is given), pull (with
        ``prefetched``, see ``pull``), forward/backward, push, end of step -> StepResult."""
        clock, ph = time.perf_counter, self.phases
        t0 = clock()
        uniq, rows, segments, shows, clicks = deduped if deduped is not None else self.dedup(batch)
        t1 = clock()
        emb = self.pull(uniq, prefetched)
        t2 = clock()
        res = self.forward_backward(emb, rows, segments, batch)
        t3 = clock()
        self.push(uniq, res, shows, clicks, batch.size)
        t4 = clock()
        self.mode.end_step(batch.size)
        ph["dedup"] += t1 - t0
        ph["compute"] += t3 - t2
        ph["end_step"] += clock() - t4
        return res

    # -- loops ------------------------------------------------------------------------------------
    def train_epoch(self, epoch: int, max_steps: int | None, *, skip: int = 0, min_batches: int = 0) -> None:
        """One pass over this worker's shard of the train split.

        ``skip``: batches of the epoch already trained (a resumed position). ``min_batches``: batches
        every worker's shard holds; the aligned checkpoint points (``ctr_positions``) lie below it.
        """
        p = self.cfg
        # a local file written again since it was listed is refused, as a store's is at its open
        self.train_versions = check_unchanged(self.train_files, self.train_versions, self.train_fingerprint)
        src = make_source(self.train_files, batch_size=p.batch_size, schema=self.schema, rank=self.rank,
                          num_workers=self.num_workers, shuffle_buffer=p.shuffle_buffer, seed=p.seed,
                          prefetch=p.prefetch, file_rows=self.file_rows, storage_options=self.storage_options,
                          versions=self.train_versions)    # and not as a version written after this check
        if self.train_started_at is None:
            self.train_started_at = time.time()
        progress.current().where(epoch=epoch)           # engine status shows it
        t_epoch = time.perf_counter()
        with self.training_clock():
            steps = self._train_epoch(epoch, src.batches(epoch), max_steps, skip, min_batches)
        log.info("worker %d: epoch %d: %d steps, %d examples in %.1f s", self.rank, epoch, steps,
                 self.examples, time.perf_counter() - t_epoch)

    def _train_epoch(self, epoch: int, it, max_steps: int | None, skip: int, min_batches: int) -> int:
        """``train_epoch``'s loop over the batches ``it`` of the epoch -> steps trained."""
        p = self.cfg
        window = BinaryMetrics(1 << 12)
        w_steps, w_loss, w_examples = 0, 0.0, 0
        t_win = time.perf_counter()
        steps = 0
        for i in range(skip):                      # trained before the checkpoint this job resumed
            if next(it, None) is None:
                break
            if i % 256 == 255:                     # a long skip is progress, not a hang (engine.liveness)
                progress.current().moved()
        stepper = (self._pipelined_steps if self.pipelined
                   else self._prefetched_steps if self.prefetching else self._steps)
        done = skip
        # segments end at the aligned checkpoint points; each drains its pipeline before returning
        ends = self.checkpoints.points(skip, min_batches if max_steps is None else min(min_batches, max_steps))
        try:
            for end in ends + [None]:
                limit = None if end is None else end - done
                if max_steps is not None:
                    limit = max_steps - done if limit is None else min(limit, max_steps - done)
                for batch, res in stepper(it, limit):
                    steps += 1
                    done += 1
                    w_steps += 1
                    w_loss += res.loss
                    w_examples += batch.size
                    self.examples += batch.size
                    self.loss_sum += res.loss
                    window.update(res.probs, batch.labels)
                    now = time.perf_counter()
                    if now - t_win >= p.log_every_s:
                        self._train_event(epoch, window, w_loss / w_steps, w_examples / (now - t_win))
                        window = BinaryMetrics(1 << 12)
                        w_steps, w_loss, w_examples, t_win = 0, 0.0, 0, now
                if end is not None:
                    self.steps += steps
                    steps = 0
                    self.checkpoints.meet(Position(epoch, end))
        finally:
            it.close()
        now = time.perf_counter()
        if w_steps:
            self._train_event(epoch, window, w_loss / w_steps, w_examples / max(now - t_win, 1e-9))
        self.steps += steps
        return done - skip

    def _train_event(self, epoch, window: BinaryMetrics, loss: float, eps: float) -> None:
        s = window.summary()
        self.metrics.write({"event": "train", "rank": self.rank, "epoch": epoch, "step": self.global_step,
                            "examples_total": self.examples, "examples_job": self.examples_before + self.examples,
                            "logloss": loss, "auc": s["auc"],
                            "pred_ctr": s["pred_ctr"], "actual_ctr": s["actual_ctr"],
                            "examples_per_s": eps, "time": time.time()})

    def _drain(self) -> None:
        """Make every update of this worker visible on the servers (merged dense gradients, async
        queue, GEO deltas); the next step pulls the dense parameters afresh."""
        self._flush_dense()
        self._fresh_dense = None
        self._dense_stale = True
        self.mode.drain()                            # hybrid: rank 0 uploads the dense tower

    def evaluate(self, tag: str, epoch: int) -> dict | None:
        """Global metrics of the test split (every worker scores its shard; merged on the servers).
        Returns the summary on rank 0, None elsewhere (an announced long phase: engine.progress)."""
        with progress.current().phase(f"evaluation {tag}", self.mode.barrier_timeout_s):
            return self._evaluate(tag, epoch)

    def _evaluate(self, tag: str, epoch: int) -> dict | None:
        p = self.cfg
        self._drain()
        self.mode.barrier(f"eval-start-{tag}")
        self.model.set_dense(self.client.pull_dense(p.dense_table))
        summary = self.evaluation.score(tag)
        if summary is not None:
            self.metrics.write({"event": "eval", "epoch": epoch, "step": self.global_step, "split": "test",
                                **summary, "time": time.time()})
            log.info("epoch %d test: AUC %.4f logloss %.4f COPC %.3f (%d rows)%s", epoch, summary["auc"],
                     summary["logloss"], summary["copc"], summary["count"], ctr_eval.describe(summary))
        return summary

    def run(self) -> dict:
        p = self.cfg
        if p.data.source != "arrow" or not p.data.train_path or not p.data.test_path:
            raise ConfigError(f"model.data.source is {p.data.source!r}: a worker started with --role needs "
                              f"source: arrow with train_path and test_path (convert first with `engine "
                              f"convert criteo`), or launch the whole job with `engine train CONFIG`")
        if self.ctx.config.cluster.warm_up:      # every worker starts its first step compiled
            log.info("worker %d: kernels ready in %.1f s", self.rank, self.warm_up())
        self.mode.init_dense(p.dense_table, self.model.get_dense())
        self.evaluation.reset()
        reset_metrics(self.client, self.mode, p.metrics_table)
        # listed once: every epoch reads these files, the versions counted and fingerprinted here (a store's
        # object written again meanwhile is refused at its open, streaming.inputs, not read with these counts)
        failpoints.hit(f"ctr.before_listing.rank{self.rank}")
        self.train_files = list_files(p.data.train_path, storage_options=self.storage_options)
        log.info("worker %d: %d train file(s) listed under %s", self.rank, len(self.train_files), p.data.train_path)
        self.train_versions = local_versions(self.train_files)      # checked before every epoch
        # the rows and fingerprint of these files at these versions, as recorded by the launcher or an earlier
        # start (ctr_records), else read now (and recorded by worker 0)
        self.train_listing = Listing(Records.of(self.ctx.config), "train", self.train_files)
        self.train_fingerprint = self.train_listing.fingerprint or files_fingerprint(self.train_files)
        agree_on_files(self)            # every worker splits the rows by the same listing (before a restore
        #                                 can refuse one worker's listing and leave the others at a barrier)
        self.checkpoints = AlignedCheckpoints(self, files=self.train_fingerprint)
        start, self.steps = self.checkpoints.restored()
        max_steps = None
        lockstep = self.mode.lockstep      # every worker must run the same number of steps
        resumed = start.epoch > 0 or start.batch > 0
        self.file_rows = self.train_listing.rows or file_rows(self.train_files)   # every epoch's split of the rows
        if self.rank == 0 and (self.train_listing.rows is None or self.train_listing.fingerprint is None):
            self.train_listing.record(rows=self.file_rows, fingerprint=self.train_fingerprint)
        check_before_training(self)     # role mode: every worker checks its share; one verdict before any step
        sizes = shard_sizes(self.file_rows, self.num_workers)
        rows = min(sizes)
        min_batches = rows // p.batch_size
        if self.rank == 0:
            self.checkpoints.check_shards(sizes, p.batch_size, p.data.train_path)
        if lockstep:
            max_steps = self.mode.steps_per_epoch(rows, p.batch_size)
            self.untrained = untrained_rows(sizes, max_steps, p.batch_size)
            log.info("%s mode: %d steps per epoch on every worker", self.mode.name, max_steps)
            if self.untrained and self.rank == 0:
                log.warning("%s mode: %d of the %d train rows are left out of every epoch: the workers step "
                            "together, %d steps of %d rows each, and the shards of %s hold %s rows (the "
                            "longest shards' last rows); run a number of workers that divides the row count, "
                            "or async or GEO mode, to train every row", self.mode.name, self.untrained,
                            sum(sizes), max_steps, p.batch_size, p.data.train_path, sizes)
        if resumed:     # the launcher's bar counts the job's examples, not this process's (ctr_report.Follower)
            per_epoch = min(max_steps * p.batch_size, sizes[self.rank]) if max_steps else sizes[self.rank]
            self.examples_before = start.epoch * per_epoch + min(start.batch * p.batch_size, per_epoch)
        for epoch in range(start.epoch, p.epochs):
            self.train_epoch(epoch, max_steps, skip=start.batch if epoch == start.epoch else 0,
                             min_batches=min_batches)
            if p.eval_every_epoch and epoch < p.epochs - 1:
                self.evaluate(f"epoch{epoch}", epoch)
            if epoch < p.epochs - 1:
                self.checkpoints.meet(Position(epoch + 1, 0))
        self.mode.finish()
        if self.checkpoints.ck.final:   # before the final evaluation: one that fails never loses the model
            self.checkpoints.meet(Position(p.epochs, 0), force=True)
        summary = self.evaluate("final", p.epochs - 1)
        self.metrics.write({"event": "profile", "rank": self.rank, "step": self.global_step, "steps": self.steps,
                            "dense_steps": self.dense_steps, **getattr(self.mode, "profile", dict)(),
                            "train_seconds": self.train_seconds,
                            "phase_seconds": {k: round(v, 3) for k, v in self.phases.items()}})
        log.info("worker %d: seconds per phase over %d steps: %s", self.rank, self.mode.step,
                 ", ".join(f"{k} {v:.2f}" for k, v in self.phases.items()))
        out = {"rank": self.rank, "steps": self.steps, "examples": self.examples,
               "rows_left_out_per_epoch": self.untrained,
               "checkpoint": self.checkpoints.last_uri,
               "train_seconds": self.train_seconds, "train_started_at": self.train_started_at,
               "train_logloss": self.loss_sum / max(1, self.mode.step)}   # this process's steps
        if summary is not None:
            out["test"] = summary
        return out


def run(ctx) -> dict:
    """Worker entry point (``engine.programs`` contract)."""
    return CTRTrainer(ctx).run()
