"""The parameter-server process: ``PSServer``, transport-free request handling (gRPC: ``grpc_service.serve``).

``PSServer`` hosts the sparse tables (each split into local SparseTable shards) and the dense-table
blocks of one server rank. Its RPC methods (``Pull``, ``Push``, ``Dense``, ``Step``, ``Barrier``, ``Save``,
``Load``, ``Shrink``, ``Stats``, ``Health``, ``Stop``, ``Metric``) take and return the protobuf messages of
``ps.proto``; ``handle(method, request)`` wraps them so every failure becomes a ``ServerError`` with a
gRPC status code and a message naming the server, table, shard and request id, e.g.::

    INVALID_ARGUMENT: [server 1/2, table 'emb', shard all, request w0:17.0] grads: expected
    float32[3, 8] (one row of dim 8 per key), got float32[3, 4]

The same object serves gRPC (``grpc_service.serve``) and the in-process transport, so a whole cluster can live in
one pytest process. A rejected request changes nothing: everything is validated before any shard is
touched.

Exactly once: every mutating request (``MUTATING``) runs through a ``dedup.ReplyWindow``, so a retry
with the same request id whose first attempt was applied gets the remembered reply and changes nothing.
Barriers (``barrier.Barriers``) cost no RPC thread while they wait. Replies never exceed the message
limit: a pull part that would is cut to the rows that fit (the reply says how many) and the client asks
for the rest; nothing is allocated before its size is checked.
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hdfs_io import described
from sparse_tables import SpillFailedError, waits
from sparse_tables.rwlock import RWLock

from .. import awake, failpoints
from ..checkpoint.manifest import kind_of_uri
from ..config import EngineConfig
from ..errors import ProtocolError
from ..security.confine import OutsideRootError
from . import _malloc, codec, dense_handler, governor
from . import ps_pb2 as pb
from .barrier import BarrierError, Barriers
from .checkpoint_handlers import CheckpointHandlers
from .data_clock import DataClock, clock_request
from .dedup import Expired, InProgress, ReplyWindow
from .delta_lineage import DeltaLineage
from .dense_host import MAX_DENSE_FLOATS, DenseHost
from .hosts import HostError, SparseHost, failed_shard, invalid, shrink_each, spill_failures
from .metric_sums import MetricSums
from . import names
from .names import RecentNames
from .protocol import PROTOCOL_VERSION
from .request_rules import MAX_REQUEST_ID_CHARS, admin_reason, clip
from .routing import DEFAULT_NUM_VSHARDS
from .watchdog import PHASES, RequestWatchdog

log = logging.getLogger(__name__)

METHODS = ("Pull", "Push", "Dense", "Step", "Barrier", "Save", "Load", "Shrink", "Stats", "Health", "Stop",
           "Metric", "Fence", "Clock")
#: methods that change server state; answered at most once per request id (see dedup.ReplyWindow).
#: Dense pulls and metric reads do not change anything and are not remembered (``_mutating``).
MUTATING = frozenset({"Push", "Dense", "Step", "Save", "Load", "Shrink", "Metric"})
#: data requests that carry the generation their sender expects (see ps.proto: Generations)
GENERATION_CHECKED = frozenset({"Pull", "Push", "Dense", "Step", "Barrier", "Metric", "Save", "Shrink", "Fence",
                                "Clock"})
#: requests that make their sender a client of this generation (``clients`` in Health); an expiry pass
#: (an operator's or the online job's rank 0) is not training, nor is moving the data clock
_JOINS = GENERATION_CHECKED - {"Fence", "Shrink", "Clock"}
#: the errors of a request refused before it changed anything
_REFUSALS = (HostError, BarrierError, ProtocolError, ValueError, InProgress, Expired, OutsideRootError)
#: requests that change a table (a server that applied one is no longer ``fresh``)
_WRITES = frozenset({"Push", "Dense", "Step"})
#: the failpoints of data requests (``engine.failpoints``)
_DATA_POINTS = {"Pull": "server.pull", "Push": "server.push", "Step": "server.step"}
#: methods that read or change the tables (they never overlap a Load)
_ON_TABLES = frozenset({"Pull", "Push", "Dense", "Step", "Save", "Shrink", "Clock"})
#: methods that need the admin token when tokens are configured (``engine.security.interceptor``);
#: a forced dense re-initialisation and setting a dense table's optimizer state need it too (``admin_reason``)
ADMIN_METHODS = frozenset({"Save", "Load", "Shrink", "Stop"})
#: upper bounds (seconds) of the per-method latency histogram in ``Stats`` (``latency``): fixed, so two
#: reads subtract to the histogram of the interval between them (``engine status``); +inf bucket last
LATENCY_BOUNDS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0)


class ServerError(Exception):
    """A failed request: ``code`` is a gRPC status code name; the message is complete for the user."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class PSServer(CheckpointHandlers):
    """One parameter-server rank.

    Parameters
    ----------
    sparse : dict of str -> sparse_tables.TableConfig
    dense : dict of str -> DenseTableConfig
    index, num_servers : int
        This server's rank and the cluster size (vshard ranges follow from them).
    num_vshards : int
    local_shards : int
        SparseTable shards per sparse table on this server (requests to different shards run in
        parallel; each shard serializes its own updates).
    storage_options : hdfs_io.StorageOptions, optional
        Where checkpoints live on S3 (default: the standard AWS environment variables).
    checkpoint_groups, checkpoint_threads : int
        Vshard groups per table in checkpoint part files; shards written / files read concurrently.
    max_barrier_wait_s : float, seconds
        Cap of any client-given barrier timeout (``server.max_barrier_wait_s``).
    reply_window_bytes : int, bytes
        Replies of recent mutating requests kept to answer retries (``server.reply_window_bytes``;
        0 turns deduplication off).
    max_message_bytes : int, bytes
        The largest request this server accepts and the largest reply it sends (gRPC's message limits);
        larger pull parts are cut. Clients read it from ``Health``.
    checkpoint_root : str or None
        ``Save`` and ``Load`` accept only locations strictly below it (``engine.security.confine``;
        others are PERMISSION_DENIED naming the root). None: unconfined (a server built in-process by a
        library user); "": no Save or Load at all.
    load_roots : sequence of str
        Further roots ``Load`` (never ``Save``) accepts, named by this server's operator (``--allow-load``,
        the launcher's ``--resume URI``); a trusted load (``handle(trusted=True)``) adds its job's root.
    clock : callable returning float seconds, optional
        The sparse tables' clock for ``last_seen`` and expiry (default ``time.time``); ``Shrink``
        expires at this clock, never at a time a client names.
    expiry_clock : {"wall", "data"}
        ``data``: the tables read a ``DataClock`` (over ``clock``) that the job moves forward with
        ``Clock`` requests (``engine.ps.data_clock``; ``server.expiry_clock``).
    request_bound_s : float, seconds
        A request in flight longer than this (not counting waits behind a checkpoint, a restore or an
        expiry pass) makes the server stuck (``engine.ps.watchdog``; ``client.timeout_s``): ``Health``
        says so in ``stuck``.
    max_dense_floats : int, floats
        The largest dense table a client may initialize (``server.max_dense_floats``).
    max_client_names : int, optional
        Names kept in ``writers`` and ``clients`` each (default ``names.MAX_NAMES``; ``from_config``:
        at least 4 per worker, so a job's own workers are never the ones dropped).
    """

    def __init__(self, sparse: dict, dense: dict | None = None, *, index: int = 0, num_servers: int = 1,
                 num_vshards: int = DEFAULT_NUM_VSHARDS, local_shards: int = 4,
                 storage_options=None, checkpoint_groups: int = 16, checkpoint_threads: int = 2,
                 max_barrier_wait_s: float = 600.0, reply_window_bytes: int = 64 << 20,
                 max_message_bytes: int = codec.MAX_MESSAGE_BYTES, checkpoint_root: str | None = None,
                 load_roots=(), clock=None, request_bound_s: float = 60.0, expiry_clock: str = "wall",
                 max_dense_floats: int = MAX_DENSE_FLOATS, max_client_names: int | None = None):
        if not 0 <= index < num_servers:
            raise ValueError(f"server index must be in [0, {num_servers}), got {index}")
        if not (isinstance(checkpoint_groups, int) and checkpoint_groups >= 1):
            raise ValueError(f"checkpoint_groups must be an int >= 1, got {checkpoint_groups!r}")
        self.index, self.num_servers, self.num_vshards = index, num_servers, num_vshards
        self.storage_options = storage_options            # checkpoint storage (None: AWS env vars)
        self.checkpoint_root = checkpoint_root
        self.load_roots = [r for r in load_roots if r]
        self.auth = None                                  # the gRPC AuthInterceptor (serve), for Stats
        self.call_guard = None                            # calls stalled on the wire (serve), for Stats
        self.governor = None                              # engine.ps.governor (a budgeted role server)
        self.checkpoint_groups, self.checkpoint_threads = checkpoint_groups, checkpoint_threads
        self._pool = ThreadPoolExecutor(max(2, local_shards), thread_name_prefix=f"ps{index}-shard")
        self._inflight = 0                       # Pull/Push requests being handled
        self._inflight_lock = threading.Lock()
        if expiry_clock not in ("wall", "data"):
            raise ValueError(f"expiry_clock must be 'wall' or 'data', got {expiry_clock!r}")
        self.data_clock = DataClock(clock or time.time) if expiry_clock == "data" else None
        clock = self.data_clock or clock
        self.sparse = {name: SparseHost(name, cfg, server=index, num_servers=num_servers,
                                        num_vshards=num_vshards, num_local=local_shards, pool=self._pool,
                                        busy=self._busy, clock=clock)
                       for name, cfg in sparse.items()}
        self.dense = {name: DenseHost(name, (dense or {})[name], ordinal=i, server=index,
                                      num_servers=num_servers, max_floats=max_dense_floats)
                      for i, name in enumerate(sorted(dense or {}))}
        self.stopped = threading.Event()
        self.preempting = False                  # SIGTERM: serving until the job checkpointed (Health)
        self.restored: str | None = None         # URI of the last checkpoint loaded (Health)
        self.resumed_with: dict | None = None    # {"id", "uri"} of --resume URI --resume-id ID: in part reports
        self.restoring: str | None = None        # the end of the chain a restore is loading (Health)
        # changes at every start, Load and Fence: data requests that expect another one are refused
        self.generation = time.time_ns()
        self.fresh = True                        # nothing written or loaded since this server started
        # roll-backs of the job this server lived through (Health, engine_restarts_total): Loads and
        # Fences that ended an attempt which had written to it (``_rolled_back``)
        self.rollbacks = 0
        self._written_since_rollback = False
        self.on_rollback = None                  # called after each one counted (the metrics' counter)
        # clients that wrote since this server started or last loaded (their request ids' names: a
        # worker's is ``worker{rank}``): a worker that finds its own name here is a restarted one (Health)
        self.writers = RecentNames(max_client_names)
        # clients whose data requests this generation accepted (names, as ``writers``): a starting worker
        # that finds its own name here was restarted within the attempt, which cannot take it back (the
        # others may be past the start's barriers, or counted its dead self's arrival at one) (Health)
        self.clients = RecentNames(max_client_names)     # both bounded: the most recently seen (engine.ps.names)
        self._clients_lock = threading.Lock()
        self.fenced: str | None = None           # why the last Fence ended the attempt (Health)
        self.fenced_from: str | None = None      # what ``restored`` said when it came (Health)
        # the job root's newest checkpoint when this server started ("" none; None unknown), set by
        # ``roles.run_server``: the ones named above it were written since, by this job (Health)
        self.checkpoint_floor: str | None = None
        self.lineage = DeltaLineage(index)       # the checkpoint a delta saved now continues (Save, Load)
        self.barriers = Barriers(max_wait_s=max_barrier_wait_s, generation=self.generation)
        self.window = ReplyWindow(reply_window_bytes)
        self.max_message_bytes = int(max_message_bytes)
        self.metric_sums = MetricSums()
        self._apply_lock = threading.Lock()
        # requests that read or change the tables share it; Load holds it alone while it swaps them
        self._tables_lock = RWLock()
        self._started = time.monotonic()     # uptime: a step of the wall clock is no restart (engine status)
        self._requests = dict.fromkeys(METHODS, 0)
        self._latency = {m: [0] * (len(LATENCY_BOUNDS_S) + 1) for m in METHODS}   # counts per bucket
        self._latency_sum = dict.fromkeys(METHODS, 0.0)                            # seconds
        self._errors = 0
        self._count_lock = threading.Lock()
        self.checkpoint_parts: dict[str, tuple[int, float, int]] = {}   # op -> (count, seconds, bytes written)
        # requests in flight: is this server stuck? (Health) Judged on its awake time: a request in flight
        # while the process was stopped or frozen did not hang (engine.awake)
        self.watchdog = RequestWatchdog(request_bound_s, clock=awake.clock().now)
        waits.watch(self.watchdog)                        # a table waiting out a write stall is no hang

    def _note_part(self, op: str, seconds: float, nbytes: int = 0) -> None:
        """One Save / Load of this server's checkpoint parts (``engine.observability`` reads them)."""
        n, s, b = self.checkpoint_parts.get(op, (0, 0.0, 0))
        self.checkpoint_parts[op] = (n + 1, s + seconds, b + nbytes)

    def _busy(self) -> int:
        return self._inflight

    @classmethod
    def from_config(cls, cfg: EngineConfig, index: int, num_servers: int | None = None) -> "PSServer":
        return cls(cfg.sparse_tables, cfg.dense_tables, index=index,
                   num_servers=num_servers or cfg.cluster.servers, num_vshards=cfg.cluster.num_vshards,
                   local_shards=cfg.cluster.local_shards, checkpoint_threads=cfg.checkpoint.threads,
                   storage_options=cfg.storage.options(),
                   max_barrier_wait_s=cfg.server.max_barrier_wait_s,
                   reply_window_bytes=cfg.server.reply_window_bytes,
                   max_message_bytes=cfg.server.max_message_bytes, checkpoint_root=cfg.checkpoint.root,
                   request_bound_s=cfg.client.timeout_s, expiry_clock=cfg.server.expiry_clock,
                   max_dense_floats=cfg.server.max_dense_floats,
                   max_client_names=max(names.MAX_NAMES, 4 * cfg.cluster.workers))

    # ------------------------------------------------------------------ dispatch
    def handle(self, method: str, request, *, trusted: bool = False):
        """Run one RPC. Raises ServerError (code + full message) on any failure. ``trusted``: the call
        comes from this process's own operator (``--resume`` at start-up), not from a client, so a
        ``Load`` may name a checkpoint outside ``checkpoint_root``."""
        table = clip(getattr(request, "table", "") or "-")      # echoed in errors: client strings, clipped
        full_rid = getattr(request, "request_id", "") or "-"
        rid = clip(full_rid)
        with self._count_lock:
            self._requests[method] = self._requests.get(method, 0) + 1
        t0 = time.perf_counter()
        token = self.watchdog.enter(method, rid)
        try:
            if method not in METHODS:
                raise HostError("UNIMPLEMENTED", f"unknown method {method!r}")
            if getattr(request, "error", None) is not None:     # codec.Received that did not parse
                raise request.error
            if len(full_rid) > MAX_REQUEST_ID_CHARS:
                raise ProtocolError(f"request_id: {len(full_rid)} characters, more than the {MAX_REQUEST_ID_CHARS} "
                                    f"a server accepts (a PSClient's name, before '@', makes most of it)")
            generation = self.generation
            self._check_generation(method, request)    # again under the tables lock (_run)
            # its sender takes part once it was answered, or failed in a way that may have changed something
            # (a refusal changed nothing: a worker whose first request was refused took no part)
            joins = full_rid.split("@", 1)[0] if method in _JOINS and "@" in full_rid else None
            try:
                if _mutating(method, request):
                    reply = self.window.run(request.request_id, lambda: self._run(method, request, trusted, token),
                                            replay=lambda: self._reread(method, request))
                else:
                    reply = self._run(method, request, token=token)
            except _REFUSALS:
                raise
            except Exception:
                if joins:
                    self._joined(joins, generation)
                raise
            if joins:
                self._joined(joins, generation)
            return _stamped(reply, self.generation)
        except Exception as e:  # noqa: BLE001 - every failure must reach the caller with context
            if isinstance(e, HostError):
                code, shard = e.code, ("all" if e.shard is None else e.shard)
            elif isinstance(e, BarrierError):
                code, shard = e.code, "all"
            elif isinstance(e, InProgress):
                code, shard = "UNAVAILABLE", "all"     # the client retries with the same id later
            elif isinstance(e, Expired):
                code, shard = "ABORTED", "all"         # applied once; never applied again
            elif isinstance(e, OutsideRootError):
                code, shard = "PERMISSION_DENIED", "all"
            elif isinstance(e, SpillFailedError):   # said once, as the store failed (and in Health)
                code, shard = "UNAVAILABLE", failed_shard(self.sparse.values(), e)
            elif isinstance(e, (ProtocolError, ValueError)):
                code, shard = "INVALID_ARGUMENT", "all"
            else:
                code, shard = "INTERNAL", "?"
                log.exception("server %d: %s request %s on table %s failed", self.index, method, rid, table)
            with self._count_lock:
                self._errors += 1
            msg = (f"[server {self.index}/{self.num_servers}, table {table!r}, shard {shard}, "
                   f"request {rid}] {described(e)}")
            raise ServerError(code, msg) from None
        finally:
            self.watchdog.exit(token)
            if method in self._latency:     # handling time, answered or failed (engine status: p99)
                dt = time.perf_counter() - t0
                with self._count_lock:
                    self._latency[method][bisect.bisect_left(LATENCY_BOUNDS_S, dt)] += 1
                    self._latency_sum[method] += dt

    def _joined(self, name: str, generation: int) -> None:
        """Client ``name`` had a data request of ``generation`` answered: list it in ``clients`` (Health),
        unless a generation began since (every request refreshes its name: the names kept are the most
        recently seen, ``engine.ps.names``)."""
        with self._clients_lock:
            if self.generation == generation:
                self.clients.add(name)

    def _check_generation(self, method: str, request) -> None:
        """ABORTED unless the request expects this server's generation (or any: 0)."""
        expected = getattr(request, "generation", 0) if method in GENERATION_CHECKED else 0
        if expected and expected != self.generation:
            raise HostError("ABORTED", f"generation mismatch: the request expects generation {expected}, "
                            f"this server is at {self.generation} (it restarted, loaded a checkpoint or was "
                            f"fenced since; restored: {self.restored}, fenced: {self.fenced}); nothing was applied")

    def _run(self, method: str, request, trusted: bool = False, token: int = -1):
        if method == "Load":    # alone: no request may run on shards that Load swaps out
            with self._tables_lock.exclusive():
                self.watchdog.running(token)
                if request.chain_end and kind_of_uri(request.path) == "delta" and self.restoring != request.chain_end:
                    # a delta of a chain whose base this process did not load (it restarted half-way)
                    raise HostError("FAILED_PRECONDITION", f"{request.path} is a link of the chain ending at "
                                    f"{request.chain_end}, whose base this server did not load (it restarted "
                                    f"during the restore?): restore the chain again")
                t0 = time.perf_counter()
                try:
                    reply = self.Load(request, trusted=trusted)
                except BaseException:
                    self.lineage.loaded(None)
                    raise
                self.lineage.loaded(request.path)
                self._note_part("load", time.perf_counter() - t0)
                self.window.clear()     # remembered replies were computed from the tables just replaced
                # half-way up a chain (base, deltas) is no state to start from: restored once at its end
                end = request.chain_end or request.path
                if end == request.path:
                    self.restored, self.restoring, self.fenced_from = request.path, None, None
                else:       # fenced_from stays until the chain's end: a roll-back may still need it
                    self.restored, self.restoring = None, end
                self.fresh = False
                self.writers.clear()
                self._rolled_back()
                self._new_generation()
                if self.data_clock is not None:     # the job sets it again from the restored position
                    self.data_clock.reset()
            return reply
        if method == "Fence":   # alone too: no write of the attempt it ends straddles it
            if not request.generation:      # PSClient.fence always names one (read from Health)
                raise ProtocolError("generation: a Fence must name the generation it ends (Health's "
                                    "generation); 0 (any) is refused, nothing was fenced")
            with self._tables_lock.exclusive():
                self.watchdog.running(token)
                self._check_generation(method, request)     # a Load or a fence since: refused
                self.fenced = clip(request.reason or request.request_id, 1000)
                log.warning("server %d: fenced by %s: generation %d ends%s", self.index, self.fenced,
                            self.generation, "; every table emptied" if request.clear else "")
                # the tables hold the restored checkpoint plus the ended attempt's writes: no longer it,
                # but still what the job's state descends from (a second fence keeps the first's)
                self.fenced_from, self.restored = self.restored or self.fenced_from, None
                try:
                    if request.clear:       # back to the job's beginning: a fresh server's state
                        self.fresh = False
                        for h in self.sparse.values():
                            h.clear()
                        for h in self.dense.values():
                            h.clear()
                        self.window.clear()
                        self.fenced_from, self.restoring, self.fresh = None, None, True
                        self.lineage.loaded(None)
                        self.writers.clear()
                        if self.data_clock is not None:
                            self.data_clock.reset()
                finally:        # a clear that failed half-way ends the attempt all the same
                    self._rolled_back()
                    self._new_generation()
            return self.Health(request)
        if method == "Barrier":
            return self.Barrier(request, token)
        if method not in _ON_TABLES:
            return getattr(self, method)(request)
        with self._tables_lock.shared():
            # a Load or a Fence (exclusive) changes the generation: checked here, it cannot change until
            # this request is done, so nothing lands on tables it did not expect
            self._check_generation(method, request)
            if method in PHASES:        # Save, Shrink: others may wait behind them (engine.ps.watchdog)
                self.watchdog.running(token)
            if method not in ("Pull", "Push", "Step"):
                return self._wrote(method, request, getattr(self, method)(request))
            failpoints.hit(_DATA_POINTS[method])
            with self._inflight_lock:
                self._inflight += 1
            try:
                return self._wrote(method, request, getattr(self, method)(request))
            finally:
                with self._inflight_lock:
                    self._inflight -= 1

    def _wrote(self, method: str, request, reply):
        """Note a write (under the tables lock: a Load that follows clears the note): the server is no
        longer fresh, and the writer's name (its request id's, before ``@``) is listed in Health."""
        if method in _WRITES and _mutating(method, request):
            self.fresh = False
            self._written_since_rollback = True
            self.writers.add(request.request_id.split("@", 1)[0])
        return reply

    def _rolled_back(self) -> None:
        """A Load or a Fence (under the exclusive tables lock): when the attempt it ends had written to
        this server, the job rolled back (role mode: a worker or server restarted, and rank 0 restores
        the newest checkpoint or empties the servers). Counted once per attempt: the fence of a
        replaced worker and rank 0's load after it are one roll-back, a chain's links one, and a
        restore onto a server nothing wrote to (a launcher's restart, with new servers) none."""
        if self._written_since_rollback:
            self._written_since_rollback = False
            self.rollbacks += 1
            if self.on_rollback is not None:
                self.on_rollback()

    def _new_generation(self) -> None:
        """Move to a new generation (after a Load or a Fence) and drop what was held for the old one."""
        with self._clients_lock:
            generation = max(time.time_ns(), self.generation + 1)
            # the barriers first: nobody knows the new generation before it is published below, and
            # from now on an arrival naming the old one is refused (barrier.Barriers: generations)
            self.barriers.reset(generation)
            self.generation = generation
            self.clients.clear()
        self._drop_transient()

    def _drop_transient(self) -> None:
        """After a Load: what was held for the state the load replaced goes too (sync pushes and dense
        gradients waiting for their barrier, metric sums of an evaluation in progress; the barrier
        arrivals went in ``_new_generation``); applied later, it would land on the restored tables."""
        dropped = sum(h.drop_pending() for h in self.sparse.values())
        for h in self.dense.values():
            h.drop_pending()
        self.metric_sums.clear()
        if dropped:
            log.warning("server %d: dropped %d sync push(es) held for the state the load replaced",
                        self.index, dropped)

    def _msg(self, cls, req, **fields):
        """A reply message of ``cls`` for ``req`` stamped with this server's generation (replies built
        in place, ``codec.Wire.allocate``, must carry it before their bytes are laid out)."""
        return cls(request_id=req.request_id, generation=self.generation, **fields)

    def _fits(self, n: int, row_bytes: int, other_bytes: int = 0) -> int:
        """How many of ``n`` rows of ``row_bytes`` fit in one reply beside ``other_bytes`` of other
        arrays. Without other arrays at least 1 (a pull reply always makes progress); beside them
        possibly 0 (the client pulls the rows separately).

        Raises
        ------
        HostError
            INVALID_ARGUMENT (checked before anything changes): ``other_bytes`` alone exceed the limit.
        """
        budget = self.max_message_bytes - codec.REPLY_OVERHEAD_BYTES - other_bytes
        if other_bytes and budget < 0:
            raise invalid(f"the dense part of this reply ({other_bytes} bytes) exceeds the message limit "
                          f"max_message_bytes={self.max_message_bytes}: step fewer blocks per request")
        fit = min(n, budget // max(1, row_bytes))
        return fit if other_bytes else max(fit, min(n, 1))

    def _reread(self, method: str, req):
        """Answer a repeat of an applied write whose reply left the reply window: the rows and
        parameters it returned, read again now; nothing changes.

        Raises
        ------
        Expired
            The method's reply carries nothing that can be read again (a count, a flag).
        """
        with self._tables_lock.shared():
            if method == "Step":
                host = self._sparse(req.table)
                pull_keys = codec.keys_or_empty(req.pull_keys, "pull_keys")
                blocks, spans, total = list(req.blocks), [], 0
                dense = self._dense(req.dense_table) if blocks else None
                for b in blocks:
                    spans.append((b, total, total + dense.block_length(b)))
                    total += dense.block_length(b)
                pull_keys = pull_keys[:self._fits(len(pull_keys), 4 * host.dim, 4 * total)]
                specs = {"values": (codec.F32, (len(pull_keys), host.dim))}
                if spans:
                    specs["dense"] = (codec.F32, (total,))
                reply = codec.Wire.allocate_fields(self._msg(pb.StepResponse, req), specs)
                for b, a, z in spans:
                    dense.pull(b, out=reply.arrays["dense"][a:z])
                if len(pull_keys):
                    host.pull(pull_keys, True, out=reply.arrays["values"])
                return reply
            if method == "Push" and req.return_values:
                host = self._sparse(req.table)
                keys = codec.decode(req.keys, "keys", codec.U64, 1)
                m = self._fits(len(keys), 4 * host.dim)
                reply = codec.Wire.allocate(self._msg(pb.PushResponse, req, keys=len(keys)),
                                            "values", codec.F32, (m, host.dim))
                host.pull(keys[:m], True, out=reply.arrays["values"])
                return reply
            if method == "Dense" and (reply := dense_handler.reread(self, req)) is not None:
                return reply
        raise Expired(f"{method} request {req.request_id} was applied earlier; its reply left the reply "
                      f"window (server.reply_window_bytes) and cannot be read again; it was not applied twice")

    def _sparse(self, name: str) -> SparseHost:
        host = self.sparse.get(name)
        if host is None:
            raise HostError("NOT_FOUND", f"unknown sparse table {clip(name)!r}; this server hosts "
                            f"sparse tables {sorted(self.sparse)}")
        return host

    def _dense(self, name: str) -> DenseHost:
        host = self.dense.get(name)
        if host is None:
            raise HostError("NOT_FOUND", f"unknown dense table {clip(name)!r}; this server hosts "
                            f"dense tables {sorted(self.dense)}")
        return host

    # ------------------------------------------------------------------ RPCs
    def Pull(self, req: pb.PullRequest) -> codec.Wire:
        """Rows of ``keys : uint64[n]`` -> ``values : float32[m, dim]`` for keys[0:m], m < n only when
        n rows would exceed the message limit (checked before anything is allocated)."""
        host = self._sparse(req.table)
        keys = codec.decode(req.keys, "keys", codec.U64, 1)
        keys = keys[:self._fits(len(keys), 4 * host.dim)]
        reply = codec.Wire.allocate(self._msg(pb.PullResponse, req), "values", codec.F32,
                                    (len(keys), host.dim))
        host.pull(keys, req.init_missing, out=reply.arrays["values"])
        return reply

    def Push(self, req: pb.PushRequest) -> pb.PushResponse:
        host = self._sparse(req.table)
        if req.kind not in (pb.GRAD, pb.DELTA):     # proto3 keeps unknown enum values: never a gradient
            raise ProtocolError(f"kind: {req.kind} is no PushKind (GRAD = {pb.GRAD}, DELTA = {pb.DELTA}); "
                                f"nothing applied")
        delta = req.kind == pb.DELTA
        keys, grads, shows, clicks = codec.push_arrays(req, host.dim, "deltas" if delta else "grads")
        n = len(keys)
        if delta and req.accumulate:
            raise ProtocolError("a DELTA push cannot accumulate")
        if req.accumulate and req.return_values:
            raise ProtocolError("an accumulated push is applied at the barrier: it cannot return values")
        if req.accumulate:
            host.accumulate(keys, grads, shows, clicks)
        else:
            host.push(keys, grads, shows, clicks, delta=delta)
        if req.return_values:   # the rows after this update (and any other that landed since)
            m = self._fits(n, 4 * host.dim)
            reply = codec.Wire.allocate(self._msg(pb.PushResponse, req, keys=n), "values",
                                        codec.F32, (m, host.dim))
            host.pull(keys[:m], True, out=reply.arrays["values"])
            return reply
        return pb.PushResponse(request_id=req.request_id, keys=n)

    def Dense(self, req: pb.DenseRequest) -> codec.Wire:
        """One block of one dense table (``dense_handler.dense``)."""
        return dense_handler.dense(self, req)

    def Step(self, req: pb.StepRequest) -> codec.Wire:
        """Sparse push, dense step, then sparse pull in one request (see ps.proto); everything is
        validated before the first change, so a rejected request leaves every table as it was."""
        host = self._sparse(req.table)
        keys, grads, shows, clicks = codec.push_arrays(req, host.dim, "grads", may_be_empty=True)
        n = len(keys)
        pull_keys = codec.keys_or_empty(req.pull_keys, "pull_keys")
        push_parts = host.check_push(keys, grads, shows, clicks, delta=False) if n else None
        blocks = list(req.blocks)
        dense = spans = None
        total = 0
        if blocks or not codec.is_absent(req.dense_grads):
            dense = self._dense(req.dense_table)
            if len(set(blocks)) != len(blocks):
                raise ProtocolError(f"blocks {blocks}: a block may be stepped once per request")
            spans = []
            for b in blocks:
                dense.check_block(b)
                spans.append((b, total, total + dense.block_length(b)))
                total += dense.block_length(b)
            dgrads = codec.decode(req.dense_grads, "dense_grads", codec.F32, 1, shape=(total,))
            for b, a, z in spans:
                dense.check_grad(b, dgrads[a:z])
        pull_keys = pull_keys[:self._fits(len(pull_keys), 4 * host.dim, 4 * total)]
        pull_parts = host.check_keys(pull_keys) if len(pull_keys) else None
        specs = {"values": (codec.F32, (len(pull_keys), host.dim))}
        if spans is not None:
            specs["dense"] = (codec.F32, (total,))
        reply = codec.Wire.allocate_fields(self._msg(pb.StepResponse, req), specs)
        if n:
            host.push(keys, grads, shows, clicks, delta=False, parts=push_parts)
        for b, a, z in spans or ():
            dense.step(b, dgrads[a:z], out=reply.arrays["dense"][a:z], checked=True)
        if len(pull_keys):
            host.pull(pull_keys, True, out=reply.arrays["values"], parts=pull_parts)
        return reply

    def Barrier(self, req: pb.BarrierRequest, token: int = -1) -> pb.BarrierResponse:
        """Arrive at (or poll) barrier ``name`` with the request id as token; answers at once or after
        a short linger (``barrier.Barriers``). The last arrival applies held sync updates if asked: a
        phase for the watchdog (``token``: this request's), as long as every worker's push together."""
        world = req.world

        def apply() -> None:
            self.watchdog.running(token)
            self._apply_pending(world, req)
        on_open = apply if req.apply_pending else None
        # the generation again under the barriers' lock: a Load or a Fence (which takes no lock a
        # Barrier holds) may have reset them since handle() checked it
        r = self.barriers.arrive(req.name, req.request_id, world, req.timeout_s, on_open, generation=req.generation)
        return pb.BarrierResponse(request_id=req.request_id, round=r.generation, released=r.released,
                                  arrived=r.arrived, waited=r.waited)

    def _apply_pending(self, world: int, req) -> None:
        with self._tables_lock.shared(), self._apply_lock:
            # an opener of an ended generation that waited behind a Load applies nothing of the new one
            self._check_generation("Barrier", req)
            for host in self.sparse.values():
                host.apply_pending(world)
            for host in self.dense.values():
                host.apply_pending(world)

    def Shrink(self, req: pb.ShrinkRequest) -> pb.CountResponse:
        """Expiry pass (one table or all) at the server's own clock; returns rows deleted. A request
        naming a time is refused (a client-chosen ``now`` could expire every row)."""
        if req.has_now:
            raise ProtocolError("now: Shrink expires at the server's own clock; a request may not name a time")
        if self.data_clock is not None and self.data_clock.value is None:
            raise HostError("FAILED_PRECONDITION", f"server {self.index}: Shrink: the data clock (server.expiry_clock: "
                            f"data) is not set since this server started, loaded a checkpoint or was fenced with "
                            f"clear; the online job's rank 0 sets it before each hour (a job whose config says "
                            f"server.expiry_clock: wall never does: make the workers' and servers' configs agree)")
        hosts = [self._sparse(req.table)] if req.table else list(self.sparse.values())
        failpoints.hit("server.shrink")
        count = shrink_each(hosts, f"server {self.index}", "table")    # every table's pass runs
        if self.checkpoint_root == "":
            # this server saves no checkpoint, so nothing reads what changed since the last one: without
            # a clear the set of spilled dirty keys held every key ever evicted dirty, the expired ones
            # too (a churning table: +3.1 MB a day for 880k keys on disk, 42 bytes a key by day 11)
            for host in hosts:
                for shard in list(host.shards):
                    shard.clear_dirty()
        return pb.CountResponse(request_id=req.request_id, count=count)

    def Clock(self, req: pb.ClockRequest) -> pb.JsonResponse:
        """Read the data clock, or move it forward (``engine.ps.data_clock``; ps.proto ``ClockRequest``)."""
        return pb.JsonResponse(request_id=req.request_id, json=json.dumps(clock_request(self.data_clock, req)))

    def Metric(self, req: pb.MetricRequest) -> pb.MetricResponse | codec.Wire:
        """Exact metric sums (``engine.ps.metric_sums``)."""
        return self.metric_sums.handle(req)

    def Stats(self, req: pb.Empty) -> pb.JsonResponse:
        with self._count_lock:
            reqs, errors = dict(self._requests), self._errors
            latency = {m: list(c) for m, c in self._latency.items() if reqs.get(m)}
            latency_sum = {m: self._latency_sum[m] for m in latency}
        out = {"server": self.index, "num_servers": self.num_servers, "requests": reqs, "errors": errors,
               "latency_bounds_s": list(LATENCY_BOUNDS_S), "latency": latency, "latency_sum_s": latency_sum,
               "rss_bytes": governor.rss_bytes(), "malloc": self.heap_stats(), "pid": os.getpid(),
               "memory_governor": self.governor.stats() if self.governor is not None else None,
               "uptime_s": time.monotonic() - self._started, "reply_window": self.window.stats(),
               "barriers": self.barriers.stats(), **self.watchdog.state(), "spill_failed": self.spill_failed(),
               "auth_denied": dict(self.auth.denied) if self.auth is not None else {},
               "calls_cancelled": dict(self.call_guard.cancelled) if self.call_guard is not None else {},
               "sparse": {n: h.stats() for n, h in self.sparse.items()},
               "dense": {n: h.stats() for n, h in self.dense.items()}}
        return pb.JsonResponse(request_id=req.request_id, json=json.dumps(out))

    @staticmethod
    def heap_stats() -> dict | None:
        """glibc's malloc heap of this process (``_malloc.heap_stats``), for ``Stats`` and metrics."""
        return _malloc.heap_stats()

    def spill_failed(self) -> str | None:
        """The local shards whose spill store stopped writing for good (``SparseHost.failed``), each
        with its store and RocksDB's error, or None: such a server is neither ready nor live (Health)."""
        return "; ".join(spill_failures(self.sparse.values())) or None

    def Health(self, req: pb.Empty) -> pb.JsonResponse:
        failed, stuck = self.spill_failed(), self.watchdog.stuck()
        out = {"ready": not self.stopped.is_set() and failed is None, "live": stuck is None and failed is None,
               "failed": failed, "preempting": self.preempting, "stuck": stuck,
               "restored": self.restored,
               "restoring": self.restoring,
               "generation": self.generation, "fresh": self.fresh, "writers": self.writers.sorted(),
               "clients": self.clients.sorted(), "writers_dropped": self.writers.dropped,
               "clients_dropped": self.clients.dropped,
               "fenced": self.fenced, "fenced_from": self.fenced_from, "checkpoint_floor": self.checkpoint_floor,
               "rollbacks": self.rollbacks,
               "expiry_clock": "wall" if self.data_clock is None else "data",
               "data_time": None if self.data_clock is None else self.data_clock.value,
               "server": self.index, "num_servers": self.num_servers, "protocol": PROTOCOL_VERSION,
               "num_vshards": self.num_vshards, "max_message_bytes": self.max_message_bytes,
               "sparse": {n: {"dim": h.dim} for n, h in self.sparse.items()},
               "dense": {n: {"ordinal": h.ordinal, "size": h.size, "block_size": codec.DENSE_BLOCK}
                         for n, h in self.dense.items()}}
        return pb.JsonResponse(request_id=req.request_id, json=json.dumps(out))

    def Stop(self, req: pb.Empty) -> pb.Empty:
        log.info("server %d: stop requested (request %s)", self.index, req.request_id)
        self.stopped.set()
        self.barriers.stop()
        return pb.Empty(request_id=req.request_id)

    def close(self) -> None:
        waits.unwatch(self.watchdog)
        self.stopped.set()
        self.barriers.stop()
        if self.governor is not None:
            self.governor.stop()
        for h in self.sparse.values():
            h.close()
        self._pool.shutdown(wait=False)


def _stamped(reply, generation: int):
    """``reply`` with this server's generation set (replies built in place carry it already)."""
    msg = reply.msg if isinstance(reply, codec.Wire) else reply
    if "generation" in msg.DESCRIPTOR.fields_by_name and not (isinstance(reply, codec.Wire) and reply.encoded):
        msg.generation = generation
    return reply


def _mutating(method: str, request) -> bool:
    """Whether ``request`` may change server state (and so must be applied at most once)."""
    if method == "Dense":
        return dense_handler.mutating(request)
    if method == "Metric":
        return request.op != pb.METRIC_READ
    return method in MUTATING
