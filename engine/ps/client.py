"""``PSClient``: the worker's view of the parameter servers.

A small typed API in the ps-lite spirit. Sparse calls take ``keys : uint64[n]`` in any order with
duplicates; the client deduplicates (``pull``: each key fetched once; ``push``: gradients, shows and
clicks of duplicate keys summed), routes keys with ``routing`` (a pure function), sends one request
per server and chunk concurrently on a thread pool, and reassembles replies in the caller's order::

    >>> client = PSClient(["127.0.0.1:50051", "127.0.0.1:50052"])
    >>> v = client.pull("emb", np.array([7, 9, 7], np.uint64), init_missing=True)   # float32[3, dim]
    >>> client.push("emb", np.array([7, 9, 7], np.uint64), grads)   # key 7's two rows are summed
    >>> client.flush()                                               # wait for queued async pushes

Every call blocks until all servers answered or ``timeout_s`` passed. UNAVAILABLE is retried with
exponential backoff (``retries`` times; over gRPC by gRPC's own retry policy, see ``transport``);
DEADLINE_EXCEEDED is retried for reads only (pulls, stats, health). Every retry resends the same
request id, and the servers answer a repeated id of a write from their reply window without applying
it again, so a write whose reply was lost is applied exactly once. Request ids are
``{name}@{incarnation}:{seq}``: ``incarnation`` is unique to this process and client object, so a
restarted worker never reuses its former self's ids. RESOURCE_EXHAUSTED from an overloaded server
(``server.max_concurrent_rpcs``) is backed off and retried for up to ``timeout_s``; a message over a
size limit is never retried (``MessageTooLargeError`` names the limit and the size). Errors are typed:
``RequestRejectedError`` (the server refused the request; nothing changed), ``ShardUnavailableError``,
``PSTimeoutError``, ``ProtocolError`` (bad arguments, raised before anything is sent).

Barriers cost the servers no thread while callers wait: ``barrier`` arrives, then polls with the same
request id until released (see ``engine.ps.barrier``).

Async pushes (``push_async``, enabled with ``async_queue > 0``): a background sender takes queued
pushes from a bounded queue, merges everything queued for a table (duplicates summed, as Paddle's
client does) and sends one push; ``push_async`` blocks when the queue is full; ``flush()`` waits for
the queue to drain and re-raises the first failed send.

A whole async training step (``push_pull``): this step's sparse gradients and dense gradient and the
next step's keys in one ``Step`` request per server, which applies the push, then the dense optimizer
step, then replies with the next step's rows and the fresh dense parameters::

    >>> rows, fresh = client.push_pull("emb", keys, grads, next_keys, shows=shows, clicks=clicks,
    ...                                dense_table="mlp", dense_grad=g)   # float32[m, dim], float32[P]
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import random
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeoutError

import numpy as np

from ..errors import (
    BarrierTimeoutError,
    GenerationChangedError,
    ProtocolError,
    PSTimeoutError,
    RemoteError,
    RequestRejectedError,
    ShardUnavailableError,
)
from . import _arrays, _kernels, codec, protocol, routing
from . import ps_pb2 as pb
from ._status import too_large as _too_large
from ._status import too_large_error as _too_large_error
from ._status import typed as _typed
from .async_push import AsyncPusher
from .inflight import InFlight
from .dense_client import DenseClient, DenseOptimizerState  # noqa: F401  (re-exported)
from .server import GENERATION_CHECKED
from .transport import GrpcTransport, Transport

log = logging.getLogger(__name__)

_ids = itertools.count()
#: this process's incarnation: start time and random bits, so request ids of a restarted process (even
#: with the same pid and worker rank) never repeat an earlier process's ids within a server's window
_INCARNATION = f"{int(time.time() * 1000):x}{os.urandom(3).hex()}"
#: longest pause between two polls of a barrier (seconds)
BARRIER_POLL_MAX_S = 0.02


class PSClient(DenseClient):
    """Client of one PS cluster (its dense-table calls: ``dense_client.DenseClient``).

    Parameters
    ----------
    endpoints : list of str or Transport
        ``["host:port", ...]`` in server-rank order (a GrpcTransport is built), or a Transport
        (e.g. ``InProcessTransport``).
    timeout_s : float, seconds
        Deadline of every call (and of waiting for its fan-out).
    retries : int
        Retries on UNAVAILABLE (and DEADLINE_EXCEEDED for reads).
    backoff_s, max_backoff_s : float, seconds
        First retry delay, doubling up to max_backoff_s.
    threads : int
        Fan-out threads (gRPC calls release the GIL).
    async_queue : int
        Capacity of the async push queue (0: ``push_async`` sends synchronously).
    name : str, optional
        Prefix of request ids (default ``host/pid/n``), so server errors can be traced to a worker.
    security : engine.security.credentials.ClientSecurity, optional
        TLS and bearer tokens (``engine.security.credentials.client_security``); None: plaintext.
    max_message_bytes : int, bytes
        This client's gRPC message limit (``server.max_message_bytes``). Requests are chunked to the
        smaller of it and the limit each server reports in ``Health``.
    dead_after_s : float, seconds
        ``client.dead_after_s``: a connection to a server that stopped answering keepalive pings (a
        host powered off, a network cut) is closed after about that long, and its calls fail UNAVAILABLE and are
        retried on a new connection (``engine.ps.keepalive``) rather than waiting for ``timeout_s``.
    """

    def __init__(self, endpoints, *, timeout_s: float = 60.0, retries: int = 5, backoff_s: float = 0.05,
                 max_backoff_s: float = 2.0, threads: int = 8, async_queue: int = 0,
                 name: str | None = None, security=None, max_message_bytes: int = codec.MAX_MESSAGE_BYTES,
                 dead_after_s: float = 30.0):
        self.transport: Transport = endpoints if isinstance(endpoints, Transport) else GrpcTransport(
            list(endpoints), retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
            security=security, max_message_bytes=max_message_bytes, dead_after_s=dead_after_s)
        self.max_message_bytes = int(max_message_bytes)
        self.num_servers = self.transport.num_servers
        self.timeout_s, self.retries = float(timeout_s), int(retries)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.name = name or f"{socket.gethostname()}/{os.getpid()}"
        self.client_id = f"{self.name}@{_INCARNATION}.{next(_ids)}"
        self._seq = itertools.count()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="ps-client")
        self._info: dict | None = None
        self._info_lock = threading.Lock()
        self._async_cap = int(async_queue)
        self._pusher: AsyncPusher | None = None
        self._closed = False
        #: the calls in flight, for a worker's liveness check (``engine.liveness``)
        self.in_flight = InFlight()

    # ------------------------------------------------------------------ plumbing
    def _rid(self) -> str:
        return f"{self.client_id}:{next(self._seq)}"

    def _call(self, server: int, method: str, request, *, idempotent: bool, timeout: float | None = None):
        """One request to one server, retried with the same request id (see the module docstring).

        Raises
        ------
        MessageTooLargeError
            The request or its reply is over a gRPC message limit (never retried).
        RequestRejectedError, ShardUnavailableError, PSTimeoutError, RemoteError
        """
        timeout = self.timeout_s if timeout is None else timeout
        if method in GENERATION_CHECKED:        # expect the generation the servers had when we met them
            msg = request.msg if isinstance(request, codec.Wire) else request
            if not msg.generation:
                msg.generation = self.generations()[server]
        # its bound: every attempt's deadline and the back-off between them (at most 1.5 x max_backoff_s)
        token = self.in_flight.enter(server, method, timeout * (self.retries + 1)
                                     + self.retries * 1.5 * self.max_backoff_s + 5.0)
        try:
            return self._attempts(server, method, request, idempotent, timeout)
        finally:
            self.in_flight.exit(token)

    def _attempts(self, server: int, method: str, request, idempotent: bool, timeout: float):
        """``_call``'s attempts: the first, and its retries."""
        delay = self.backoff_s
        attempts = 0
        started = time.monotonic()
        while True:
            try:
                return self.transport.call(server, method, request, timeout)
            except RemoteError as e:
                if e.code == "RESOURCE_EXHAUSTED":
                    if _too_large(e.message):
                        raise _too_large_error(e, method, server) from None
                    attempts += 1          # overloaded: not applied; back off for up to timeout_s
                    retry = time.monotonic() - started < self.timeout_s
                else:
                    attempts += self.transport.attempts_per_call if e.code == "UNAVAILABLE" else 1
                    retry = (e.code == "UNAVAILABLE" or (idempotent and e.code == "DEADLINE_EXCEEDED")) \
                        and attempts <= self.retries
                if not retry:
                    raise _typed(e, attempts - 1) from None
                log.debug("%s to server %d: %s; retry %d in %.2fs", method, server, e.code, attempts, delay)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, self.max_backoff_s)

    def _fan_out(self, calls: list[tuple], *, idempotent: bool, timeout: float | None = None) -> list:
        """Run [(server, method, request)] concurrently; results in order. Raises the first error."""
        wait_s = (self.timeout_s if timeout is None else timeout) * (self.retries + 1) + 5.0
        return self._parallel([functools.partial(self._call, s, m, r, idempotent=idempotent, timeout=timeout)
                               for s, m, r in calls], wait_s)

    def _parallel(self, fns: list, wait_s: float) -> list:
        """Run the callables concurrently (the first on this thread, one thread hand-off less); results
        in order. Raises the first error, or PSTimeoutError after ``wait_s`` seconds."""
        if len(fns) == 1:
            return [fns[0]()]
        futures = [self._pool.submit(fn) for fn in fns[1:]]
        deadline = time.monotonic() + wait_s
        try:
            out = [fns[0]()]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        for f in futures:
            try:
                out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except FuturesTimeoutError as e:    # the builtin TimeoutError from Python 3.11 on
                if isinstance(e, PSTimeoutError):   # the call's own (a TimeoutError too): as it is, naming its server
                    raise
                raise PSTimeoutError("DEADLINE_EXCEEDED", f"fan-out did not finish in {wait_s:.1f}s") from None
        return out

    def info(self) -> dict:
        """Cluster description from every server's Health (tables, dims, vshards), cached.

        Raises
        ------
        RemoteError
            A server cannot be reached; ProtocolError when the servers disagree with the endpoints.
        """
        with self._info_lock:
            if self._info is None:
                replies = self._fan_out([(s, "Health", pb.Empty(request_id=self._rid()))
                                         for s in range(self.num_servers)], idempotent=True)
                infos = [json.loads(r.json) for r in replies]
                protocol.check_servers(infos, self.transport.endpoints)     # before any data request
                for i, h in enumerate(infos):
                    if h["server"] != i or h["num_servers"] != self.num_servers:
                        raise ProtocolError(
                            f"endpoint {self.transport.endpoints[i]} is server {h['server']} of "
                            f"{h['num_servers']}, expected server {i} of {self.num_servers}: list the "
                            f"endpoints in server-rank order")
                info = infos[0]
                info["owner"] = routing.vshard_owners(info["num_vshards"], self.num_servers)
                info["generations"] = [int(h.get("generation", 0)) for h in infos]
                info["max_message_bytes"] = min([self.max_message_bytes] + [int(h.get(
                    "max_message_bytes", codec.MAX_MESSAGE_BYTES)) for h in infos])
                self._info = info
            return self._info

    def generations(self) -> list[int]:
        """Each server's generation when this client first met it (``info``); data requests carry it
        and a server at another generation refuses them (``GenerationChangedError``)."""
        return self.info()["generations"]

    def pin_generations(self, health: list[dict]) -> None:
        """Expect the generations of ``health`` (one ``Health`` answer per server, as ``health()`` gives
        them) from now on: those of the state a starting worker agreed to train from, so a load or a
        fence between that answer and its first data request is noticed, not trained on."""
        self.info()
        with self._info_lock:
            self._info["generations"] = [int(h.get("generation", 0)) for h in health]

    def _sparse(self, table: str) -> dict:
        info = self.info()
        if table not in info["sparse"]:
            raise RequestRejectedError("NOT_FOUND", f"unknown sparse table {table!r}; the servers host "
                                       f"{sorted(info['sparse'])}")
        return info["sparse"][table]

    def sparse_dim(self, table: str) -> int:
        """Embedding width of a sparse table (RequestRejectedError NOT_FOUND for an unknown table)."""
        return int(self._sparse(table)["dim"])

    def _plan(self, keys: np.ndarray, dim: int) -> list[tuple[int, slice | np.ndarray]]:
        """[(server, positions into keys)] with at most chunk_keys(dim) keys per entry; positions are
        a slice when they are contiguous (one server), else int64 indices."""
        step = codec.chunk_keys(dim, self.info()["max_message_bytes"])
        if self.num_servers == 1:
            return [(0, slice(i, min(i + step, len(keys)))) for i in range(0, len(keys), step)]
        return [(s, pos[i:i + step]) for s, pos in self._route(keys).items() for i in range(0, len(pos), step)]

    def _route(self, keys: np.ndarray) -> dict:
        """{server: positions into keys} for the servers with keys (a slice with one server, else
        int64 indices)."""
        if len(keys) == 0:
            return {}
        if self.num_servers == 1:
            return {0: slice(0, len(keys))}
        info = self.info()
        srv = routing.lookup(keys, info["num_vshards"], info["owner"])
        order = np.empty(len(keys), np.int64)
        bounds = np.empty(self.num_servers + 1, np.int64)
        _kernels.group(srv, self.num_servers, order, bounds)
        return {s: order[bounds[s]:bounds[s + 1]] for s in range(self.num_servers) if bounds[s + 1] > bounds[s]}

    # ------------------------------------------------------------------ sparse
    def pull(self, table: str, keys: np.ndarray, *, init_missing: bool = False) -> np.ndarray:
        """Values of ``keys : uint64[n]`` (duplicates allowed) -> ``float32[n, dim]``.

        ``init_missing``: keys without a row read the value a push would create (training pulls); else
        zeros. Nothing is created on the server.

        Raises
        ------
        ProtocolError
            keys is not uint64[n].
        RequestRejectedError, ShardUnavailableError, PSTimeoutError
        """
        keys = _arrays.check_keys(keys)
        dim = self._sparse(table)["dim"]
        if len(keys) == 0:
            return np.empty((0, dim), np.float32)
        uniq, inverse = _arrays.unique(keys)
        plan = self._plan(uniq, dim)
        rid = self._rid()
        calls = [(s, "Pull", codec.Wire(pb.PullRequest(table=table, request_id=f"{rid}.{i}",
                                                       init_missing=init_missing), keys=_arrays.take(uniq, pos)))
                 for i, (s, pos) in enumerate(plan)]
        replies = self._fan_out(calls, idempotent=True)
        return self._assemble(plan, replies, uniq, inverse, len(keys), dim, table, init_missing)

    def _assemble(self, plan, replies, uniq, inverse, n_keys: int, dim: int, table: str,
                  init_missing: bool = True, beside: bool = False) -> np.ndarray:
        """float32[n_keys, dim] in the caller's key order from the per-chunk ``values`` of replies. A
        server cuts a reply that would exceed its message limit to the first rows that fit; the rest
        are pulled again (``init_missing`` as the original request). ``beside``: the rows came beside
        other arrays (a Step's dense part), so a reply may hold none of them."""
        def rows(r, pos) -> np.ndarray:
            n = _arrays.count(pos)
            v = codec.decode(r.values, "values", codec.F32, 2, shape=(None, dim))
            if len(v) > n or (len(v) == 0 < n and not beside):
                raise ProtocolError(f"values: expected up to {n} rows (at least one), got {len(v)}")
            if len(v) == n:
                return v
            rest = _arrays.take(uniq, pos)[len(v):]
            log.debug("pull of %d rows of %s was cut to %d by the server's message limit", n, table, len(v))
            return np.concatenate([v, self.pull(table, rest, init_missing=init_missing)])
        if len(plan) == 1:
            out = rows(replies[0], plan[0][1])
        else:
            out = np.empty((len(uniq), dim), np.float32)
            for (s, pos), r in zip(plan, replies):
                v = rows(r, pos)
                if isinstance(pos, slice):
                    out[pos] = v
                else:
                    _kernels.put_rows(v, pos, out)
        if inverse is None:
            return out
        full = np.empty((n_keys, dim), np.float32)
        _kernels.take_rows(out, inverse, full)
        return full

    def push(self, table: str, keys: np.ndarray, grads: np.ndarray, *, shows: np.ndarray | None = None,
             clicks: np.ndarray | None = None, accumulate: bool = False) -> None:
        """Push gradients ``grads : float32[n, dim]`` of ``keys : uint64[n]``; the table's optimizer
        applies them on the servers. ``shows, clicks : float32[n]`` optional counts. Duplicate keys are
        summed first. ``accumulate`` (sync mode) holds the push until the next applying barrier.

        Raises
        ------
        ProtocolError
            Wrong dtype/shape, NaN/Inf (checked here before anything is sent).
        RequestRejectedError, ShardUnavailableError, PSTimeoutError
        """
        self._push(table, keys, grads, shows, clicks, pb.GRAD, accumulate)

    def push_delta(self, table: str, keys: np.ndarray, deltas: np.ndarray, *, shows: np.ndarray | None = None,
                   clicks: np.ndarray | None = None, return_values: bool = False) -> np.ndarray | None:
        """GEO: ``value += delta`` on the servers for ``keys : uint64[n]``, ``deltas : float32[n, dim]``
        (duplicates summed; no optimizer). ``shows``, ``clicks`` : float32[n], optional: the counts
        behind the deltas, added to the rows' (for expiry, admission and export filters) as a push's
        are. Raises as ``push``.

        ``return_values``: the same round trip brings back the rows' values after the update (as
        ``pull(table, keys, init_missing=True)`` right after it would): ``float32[n, dim]`` in the order
        of ``keys``; a GEO sync needs one round trip instead of two."""
        return self._push(table, keys, deltas, shows, clicks, pb.DELTA, False, return_values)

    def _merged_push(self, table, keys, grads, shows, clicks, what: str):
        """Check a push's arrays and sum duplicate keys -> (dim, keys, inverse or None, grads, shows,
        clicks) with unique keys; clicks default to zeros when shows are given."""
        keys = _arrays.check_keys(keys)
        dim = self._sparse(table)["dim"]
        grads = _arrays.check_array(grads, (len(keys), dim), what)
        if clicks is not None and shows is None:
            raise ProtocolError("clicks given without shows: pass shows too")
        if shows is not None:
            shows = _arrays.check_array(shows, (len(keys),), "shows")
            clicks = (np.zeros(len(keys), np.float32) if clicks is None
                      else _arrays.check_array(clicks, (len(keys),), "clicks"))
        uniq, inverse = _arrays.unique(keys)
        if inverse is not None:   # sum duplicates
            grads = _arrays.segment_sum(grads, inverse, len(uniq))
            if shows is not None:
                shows = _arrays.segment_sum(shows, inverse, len(uniq))
                clicks = _arrays.segment_sum(clicks, inverse, len(uniq))
        return dim, uniq, inverse, grads, shows, clicks

    def _push(self, table, keys, grads, shows, clicks, kind, accumulate, return_values=False):
        dim, uniq, inverse, grads, shows, clicks = self._merged_push(
            table, keys, grads, shows, clicks, "deltas" if kind == pb.DELTA else "grads")
        if len(uniq) == 0:
            return np.empty((0, dim), np.float32) if return_values else None
        plan = self._plan(uniq, dim)
        rid = self._rid()
        calls = []
        for i, (s, pos) in enumerate(plan):
            req = pb.PushRequest(table=table, request_id=f"{rid}.{i}", kind=kind, accumulate=accumulate,
                                 return_values=return_values)
            calls.append((s, "Push", codec.Wire(req, keys=_arrays.take(uniq, pos), grads=_arrays.take(grads, pos),
                                                shows=_arrays.take(shows, pos), clicks=_arrays.take(clicks, pos))))
        replies = self._fan_out(calls, idempotent=False)
        if return_values:
            n_keys = len(uniq) if inverse is None else len(inverse)
            return self._assemble(plan, replies, uniq, inverse, n_keys, dim, table)
        return None

    # ------------------------------------------------------------------ async pushes
    @property
    def queues_pushes(self) -> bool:
        """True when ``push_async`` queues pushes for the background sender (``async_queue > 0``)."""
        return self._async_cap > 0

    def push_async(self, table: str, keys: np.ndarray, grads: np.ndarray, *, shows=None, clicks=None) -> None:
        """Queue a push for the background sender (merged with other queued pushes of the table; see
        ``async_push.AsyncPusher``). Without an async queue (``async_queue=0``) this is ``push``. The
        arrays are copied.

        Raises
        ------
        ProtocolError
            Bad arguments; also any error of an earlier background send (re-raised once).
        PSTimeoutError
            The queue stayed full for ``timeout_s``.
        """
        if self._async_cap <= 0:
            return self.push(table, keys, grads, shows=shows, clicks=clicks)
        if self._pusher is not None:
            self._pusher.raise_error()
        keys = _arrays.check_keys(keys)
        dim = self._sparse(table)["dim"]
        grads = _arrays.check_array(grads, (len(keys), dim), "grads")
        if shows is not None:
            shows = _arrays.check_array(shows, (len(keys),), "shows")
            clicks = np.zeros(len(keys), np.float32) if clicks is None else _arrays.check_array(
                clicks, (len(keys),), "clicks")
        if self._pusher is None:
            self._pusher = AsyncPusher(self.push, self._async_cap, self.timeout_s)
        self._pusher.put(table, keys, grads, shows, clicks)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued async push was sent; re-raise a failed send.

        Raises
        ------
        PSTimeoutError
            The queue did not drain within ``timeout`` seconds (default ``timeout_s`` x (retries + 1)).
        """
        if self._pusher is not None:
            self._pusher.flush(timeout if timeout is not None else self.timeout_s * (self.retries + 1))

    # ------------------------------------------------------------------ fused async step
    def push_pull(self, table: str, keys: np.ndarray, grads: np.ndarray, pull_keys: np.ndarray, *,
                  shows: np.ndarray | None = None, clicks: np.ndarray | None = None,
                  dense_table: str | None = None, dense_grad: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
        """One async training step in one round trip per server (the Step RPC): ``push`` of
        ``grads : float32[n, dim]`` for ``keys : uint64[n]`` (with optional ``shows, clicks :
        float32[n]``), then, with ``dense_table``, ``push_pull_dense`` of ``dense_grad : float32[P]``,
        then ``pull(table, pull_keys, init_missing=True)`` of ``pull_keys : uint64[m]`` after both.

        Returns ``(rows float32[m, dim] in the order of pull_keys, fresh dense float32[P] or None)``:
        what those three calls give one after the other, with one RPC per server instead of three (each
        gRPC call costs ~1 ms of CPU before its payload). Duplicate keys are summed (push) or
        repeated (pull) as in the separate calls. When a server's part would exceed a chunk (``codec.chunk_bytes``),
        the three calls are made separately, in that order.

        Raises
        ------
        ProtocolError
            Wrong dtype/shape, NaN/Inf (checked here before anything is sent).
        RequestRejectedError, ShardUnavailableError, PSTimeoutError
        """
        pull_keys = _arrays.check_keys(pull_keys)
        dim, uniq, _, grads, shows, clicks = self._merged_push(table, keys, grads, shows, clicks, "grads")
        blocks = []
        if dense_table is not None:
            size = self._dense_size(dense_table)
            dense_grad = _arrays.check_array(dense_grad, (size,), "dense_grad")
            blocks = self._blocks(dense_table, size)
        puniq, pinverse = _arrays.unique(pull_keys)
        push_at, pull_at = self._route(uniq), self._route(puniq)
        servers = sorted(set(push_at) | set(pull_at) | {s for _, s, _, _ in blocks})
        n = _arrays.count
        too_big = any(n(push_at.get(s)) * (8 + 4 * dim + 8) + n(pull_at.get(s)) * max(8, 4 * dim)
                      + 4 * sum(z - a for _, o, a, z in blocks if o == s)
                      > codec.chunk_bytes(self.info()["max_message_bytes"]) for s in servers)
        if too_big:
            return self._push_pull_separately(table, uniq, grads, shows, clicks, pull_keys, dense_table,
                                              dense_grad)
        if not servers:
            return np.empty((0, dim), np.float32), None
        rid = self._rid()
        calls = []
        for i, s in enumerate(servers):
            mine = [(b, a, z) for b, o, a, z in blocks if o == s]
            req = pb.StepRequest(table=table, request_id=f"{rid}.{i}", blocks=[b for b, _, _ in mine])
            dg = None
            if mine:
                req.dense_table = dense_table
                dg = (dense_grad[mine[0][1]:mine[0][2]] if len(mine) == 1
                      else np.concatenate([dense_grad[a:z] for _, a, z in mine]))
            pos = push_at.get(s)
            calls.append((s, "Step", codec.Wire(
                req, keys=_arrays.take(uniq, pos), grads=_arrays.take(grads, pos), shows=_arrays.take(shows, pos),
                clicks=_arrays.take(clicks, pos), pull_keys=_arrays.take(puniq, pull_at.get(s)), dense_grads=dg)))
        replies = dict(zip(servers, self._fan_out(calls, idempotent=False)))
        plan = [(s, pull_at[s]) for s in servers if s in pull_at]
        if plan:
            rows = self._assemble(plan, [replies[s] for s, _ in plan], puniq, pinverse, len(pull_keys), dim,
                                  table, beside=bool(blocks))
        else:
            rows = np.empty((len(pull_keys), dim), np.float32)
        fresh = None
        if blocks:
            size = len(dense_grad)
            if len(blocks) == 1:
                fresh = codec.decode(replies[blocks[0][1]].dense, "dense", codec.F32, 1, shape=(size,))
            else:
                fresh = np.empty(size, np.float32)
                got = {s: codec.decode(replies[s].dense, "dense", codec.F32, 1,
                                       shape=(sum(z - a for _, o, a, z in blocks if o == s),))
                       for s in {o for _, o, _, _ in blocks}}
                offset = dict.fromkeys(got, 0)
                for b, s, a, z in blocks:
                    fresh[a:z] = got[s][offset[s]:offset[s] + z - a]
                    offset[s] += z - a
        return rows, fresh

    def _push_pull_separately(self, table, uniq, grads, shows, clicks, pull_keys, dense_table, dense_grad):
        """``push_pull`` as three calls (a part too large for one request)."""
        self._push(table, uniq, grads, shows, clicks, pb.GRAD, False)
        fresh = self.push_pull_dense(dense_table, dense_grad) if dense_table is not None else None
        return self.pull(table, pull_keys, init_missing=True), fresh

    # ------------------------------------------------------------------ control
    def barrier(self, name: str, world: int, *, apply_pending: bool = False, all_servers: bool = False,
                timeout: float | None = None) -> None:
        """Block until ``world`` callers reached barrier ``name`` (on server 0, or on every server with
        ``all_servers``). ``apply_pending`` (sync mode, implies all_servers): the last arrival on each
        server applies the held updates, averaged over ``world``, before anyone is released.

        Waiting holds no server thread: the first call arrives, the same request (same id) is sent
        again until the server says released; a server may hold a poll for a short linger, else the
        client pauses up to ``BARRIER_POLL_MAX_S`` between polls.

        Raises
        ------
        PSTimeoutError
            Not everybody arrived within ``timeout`` seconds (default 600; the server caps it by its
            ``server.max_barrier_wait_s``).
        """
        timeout = 600.0 if timeout is None else float(timeout)
        servers = range(self.num_servers) if (all_servers or apply_pending) else [0]
        rid = self._rid()

        def wait(s: int):
            req = pb.BarrierRequest(request_id=f"{rid}.{s}", name=name, world=world,
                                    apply_pending=apply_pending, timeout_s=timeout)
            deadline = time.monotonic() + timeout + 5.0
            pause = 0.0005
            while True:
                # not idempotent for DEADLINE_EXCEEDED: the server's deadline answer is final; a poll
                # that itself timed out on the way (a busy server) is sent again until our deadline
                try:
                    r = self._call(s, "Barrier", req, idempotent=False, timeout=min(self.timeout_s, 30.0))
                except PSTimeoutError as e:
                    if f"barrier {name!r}" in e.message:    # the server's answer: not everybody came
                        raise BarrierTimeoutError(e.code, e.message, e.endpoint) from None
                    if time.monotonic() > deadline:
                        raise
                    continue
                if r.released:
                    return r
                if time.monotonic() > deadline:
                    raise BarrierTimeoutError("DEADLINE_EXCEEDED", f"barrier {name!r}: {r.arrived} of {world} "
                                              f"callers arrived on server {s} within {timeout:g}s")
                if not r.waited:
                    time.sleep(pause * (0.5 + random.random()))
                    pause = min(2 * pause, BARRIER_POLL_MAX_S)
        self._parallel([functools.partial(wait, s) for s in servers], timeout + 10.0)

    def arrive(self, name: str, world: int, *, timeout: float = 600.0) -> int:
        """Arrive at barrier ``name`` on server 0 once, without waiting for it (another caller waits with
        ``barrier``); returns how many have arrived. An arrival nobody polls is withdrawn after 30 s."""
        req = pb.BarrierRequest(request_id=self._rid(), name=name, world=world, timeout_s=timeout)
        return self._call(0, "Barrier", req, idempotent=False, timeout=min(self.timeout_s, 30.0)).arrived

    def save(self, path: str, parent: str = "", *, timeout: float = 3600.0) -> int:
        """Every server writes its part files of the checkpoint directory ``path`` (a URI ending in
        ``HHMM-base`` / ``HHMM-delta[.N]``), in parallel; returns sparse rows written. The part files do
        not form a checkpoint until ``engine.checkpoint.CheckpointManager`` publishes the manifest and
        ``_SUCCESS``; use ``CheckpointManager.save(client, ...)`` rather than this call.

        A delta names its ``parent`` checkpoint's URI; a server whose changes are not counted from it
        refuses (``DeltaParentError``, ``engine.ps.delta_lineage``)."""
        rid = self._rid()
        return sum(r.count for r in self._fan_out(
            [(s, "Save", pb.PathRequest(request_id=f"{rid}.{s}", path=str(path), parent=str(parent)))
             for s in range(self.num_servers)], idempotent=False, timeout=max(timeout, self.timeout_s)))

    def load(self, path: str, chain_end: str = "", *, timeout: float = 3600.0) -> int:
        """Every server loads the rows it owns of the published checkpoint at ``path`` (written by any
        number of servers; a base replaces the tables, a delta is applied on top). Returns rows loaded.
        ``CheckpointManager.restore(client)`` loads a whole base + deltas chain, each load naming the
        chain's last checkpoint (``chain_end``; ``ps.proto``: PathRequest)."""
        rid = self._rid()
        try:
            return sum(r.count for r in self._fan_out(
                [(s, "Load", pb.PathRequest(request_id=f"{rid}.{s}", path=str(path), chain_end=chain_end))
                 for s in range(self.num_servers)], idempotent=False, timeout=max(timeout, self.timeout_s)))
        finally:
            with self._info_lock:       # every Load changes the servers' generations: meet them again
                self._info = None

    def shrink(self, table: str = "", *, timeout: float = 3600.0) -> int:
        """Expiry pass on every server (one table or all) at each server's own clock; returns rows
        deleted. An admin method (the admin token when the cluster has tokens).

        A pass reads every row, RocksDB's included: 47-89 s at 10^8 keys on one server here
        (``bench/scale_bench.py``), so like ``save`` and ``load`` it waits up to ``timeout`` seconds
        (default 3600; at least ``timeout_s``), not the client's per-call ``timeout_s``.

        Raises
        ------
        PSTimeoutError
            A server did not answer within ``timeout`` seconds.
        """
        rid = self._rid()
        return sum(r.count for r in self._fan_out(
            [(s, "Shrink", pb.ShrinkRequest(table=table, request_id=f"{rid}.{s}"))
             for s in range(self.num_servers)], idempotent=False, timeout=max(timeout, self.timeout_s)))

    def advance_clock(self, data_time: float) -> list[float | None]:
        """Move every server's data clock (``server.expiry_clock: data``, ``engine.ps.data_clock``)
        forward to ``data_time`` (seconds since the epoch; 0 only reads); returns each server's data
        time after it (None: unset). Forward only, so a retry changes nothing. Moving it is an admin
        request (the admin token when the cluster has tokens).

        Raises
        ------
        RequestRejectedError
            FAILED_PRECONDITION: a server runs on the wall clock; INVALID_ARGUMENT: a bad time.
        AccessDeniedError
            Moving it with the worker token.
        """
        rid = self._rid()
        replies = self._fan_out([(s, "Clock", pb.ClockRequest(request_id=f"{rid}.{s}", advance_to=float(data_time)))
                                 for s in range(self.num_servers)], idempotent=True)
        return [json.loads(r.json)["data_time"] for r in replies]

    # ------------------------------------------------------------------ exact metric sums
    def _metric_server(self, name: str) -> int:
        return zlib.crc32(name.encode()) % self.num_servers

    def add_metric(self, name: str, counts: np.ndarray, sums: np.ndarray) -> None:
        """Add ``counts : int64[c]`` and ``sums : float64[s]`` into the accumulator ``name`` on its
        server (created by the first add; every add must use the same c and s). Exact: integer counts
        never round, whatever their total (a float32 sum stops counting at 2^24).

        Raises
        ------
        ProtocolError
            Wrong dtypes or non-finite sums (nothing sent).
        RequestRejectedError
            The shapes differ from the accumulator's.
        """
        if not isinstance(counts, np.ndarray) or counts.dtype != np.int64 or counts.ndim != 1:
            raise ProtocolError(f"counts: expected int64[c], got {getattr(counts, 'dtype', type(counts))}")
        if not isinstance(sums, np.ndarray) or sums.dtype != np.float64 or sums.ndim != 1:
            raise ProtocolError(f"sums: expected float64[s], got {getattr(sums, 'dtype', type(sums))}")
        if not np.isfinite(sums).all():
            raise ProtocolError("sums: contains NaN or Inf; nothing was sent")
        req = pb.MetricRequest(table=name, request_id=self._rid(), op=pb.METRIC_ADD)
        self._call(self._metric_server(name), "Metric", codec.Wire(req, counts=counts, sums=sums),
                   idempotent=False)

    def read_metric(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The accumulator ``name`` -> ``(counts int64[c], sums float64[s])`` (empty when absent)."""
        r = self._call(self._metric_server(name), "Metric",
                       pb.MetricRequest(table=name, request_id=self._rid(), op=pb.METRIC_READ), idempotent=True)
        return (codec.decode(r.counts, "counts", codec.I64, 1).copy(),
                codec.decode(r.sums, "sums", codec.F64, 1).copy())

    def reset_metric(self, name: str) -> None:
        """Remove the accumulator ``name`` (the next ``add_metric`` starts from zero)."""
        self._call(self._metric_server(name), "Metric",
                   pb.MetricRequest(table=name, request_id=self._rid(), op=pb.METRIC_RESET), idempotent=False)

    def stats(self) -> list[dict]:
        """Per-server counters and table statistics."""
        rid = self._rid()
        return [json.loads(r.json) for r in self._fan_out(
            [(s, "Stats", pb.Empty(request_id=f"{rid}.{s}")) for s in range(self.num_servers)],
            idempotent=True)]

    def health(self) -> list[dict]:
        """Every server's ``Health`` answer; ProtocolError when one speaks another protocol version."""
        rid = self._rid()
        out = [json.loads(r.json) for r in self._fan_out(
            [(s, "Health", pb.Empty(request_id=f"{rid}.{s}")) for s in range(self.num_servers)],
            idempotent=True)]
        protocol.check_servers(out, self.transport.endpoints)
        return out

    def fence(self, generations: list[int], reason: str, *, clear: bool = False,
              servers: list[int] | None = None) -> list[bool]:
        """End the attempt the servers serve, without changing their tables: each server whose generation
        is still ``generations[s]`` (as read from ``health``) moves to a new one, so the running workers'
        requests are refused (``GenerationChangedError``) and they exit to be restarted, and drops what it
        held for that attempt (``ps.proto``: FenceRequest). ``reason`` is shown in each server's log and
        ``Health`` (``fenced``). ``clear`` (admin token): every table is emptied too and the servers are
        fresh again, the roll-back of a job with no checkpoint to its beginning. ``servers``: fence
        only these (default all). Returns, per server, whether this call fenced it (False: not asked,
        or it had moved on already: a load or another fence).

        Raises
        ------
        ShardUnavailableError, PSTimeoutError
            A server could not be reached.
        RemoteError
            FAILED_PRECONDITION: ``clear`` to a server too old to empty its tables.
        """
        rid = self._rid()
        out = []
        for s, g in enumerate(generations):
            if servers is not None and s not in servers:
                out.append(False)
                continue
            try:
                # it waits for the tables to itself, as a Load does: behind a Save of a big table
                reply = self._call(s, "Fence", pb.FenceRequest(request_id=f"{rid}.{s}", generation=int(g),
                                                               reason=reason, clear=clear),
                                   idempotent=False, timeout=max(3600.0, self.timeout_s))
            except GenerationChangedError:
                out.append(False)
                continue
            if clear and not json.loads(reply.json).get("fresh"):
                # an older server drops the unknown field and only fences
                raise RemoteError("FAILED_PRECONDITION", f"server {s} fenced but did not empty its tables: "
                                  f"it predates Fence with clear; upgrade the servers first")
            out.append(True)
        return out

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Poll Health until every server answers ready (a server that answers is ready unless stopping).

        Raises
        ------
        ShardUnavailableError
            Some server was not ready within ``timeout`` seconds; ``endpoint`` names the one of the last
            error or the first still stopping, and the message ends with that error or those servers.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                health = self.health()
            except RemoteError as e:
                why, endpoint = f"last error: {e.code}: {e.message}", e.endpoint
            else:
                stopping = [s for s, h in enumerate(health) if not h["ready"]]
                if not stopping:
                    return
                why = "stopping: " + ", ".join(f"server {s} ({self.transport.endpoints[s]})" for s in stopping)
                endpoint = self.transport.endpoints[stopping[0]]
            if time.monotonic() > deadline:
                raise ShardUnavailableError("UNAVAILABLE", f"servers not ready within {timeout:g}s: {why}",
                                            endpoint)
            time.sleep(0.1)

    def stop(self, servers=None) -> None:
        """Ask every server (or those of ``servers``, an iterable of server indexes) to stop; servers
        already gone are ignored."""
        for s in (range(self.num_servers) if servers is None else servers):
            try:
                self.transport.call(s, "Stop", pb.Empty(request_id=self._rid()), 5.0)
            except RemoteError as e:
                log.info("stop server %d: %s", s, e)

    def close(self) -> None:
        """Flush queued pushes, stop the sender and release the transport."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pusher is not None:
                self.flush()
                self._pusher.close()
        finally:
            self._pool.shutdown(wait=False)
            self.transport.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
