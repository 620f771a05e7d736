"""What one server process holds: ``SparseHost`` (one sparse table split into local shards) and
``DenseHost`` (the blocks of one dense table that this server owns).

Both validate a whole request before touching any shard, so a rejected request leaves every table
unchanged. Errors are ``HostError`` carrying a gRPC status code name and the shard concerned; the
server adds the server, table and request id to the message.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from models.optim import SGD, Adam
from sparse_tables import SparseTable, TableConfig, TableConfigError, TableInputError
from sparse_tables.errors import SpillDirError, SpillError, SpillFailedError
from sparse_tables.budget import MemoryBudget
from sparse_tables.config import RowLayout

from ..checkpoint.writer import DenseBlockState, DenseState
from ..config import DenseTableConfig
from . import _arrays, _kernels, routing
from .codec import DENSE_BLOCK

log = logging.getLogger(__name__)

PARALLEL_SHARDS_MIN = 8192   # keys in a request above which local shards are worked in parallel


def _copy_out(params: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """A copy of ``params``: into ``out`` (a reply buffer) when given, else a new array."""
    if out is None:
        return params.copy()
    out[:] = params
    return out


class HostError(Exception):
    """A request failed; ``code`` is a gRPC status code name, ``shard`` the local shard or None (all)."""

    def __init__(self, code: str, message: str, shard: int | None = None):
        super().__init__(message)
        self.code = code
        self.shard = shard


#: the most bytes of sync pushes (``accumulate``) a server holds per table until the applying barrier
#: (every worker's pushes of one step: 2 GiB is 64 workers' 32 MiB each)
MAX_PENDING_BYTES = 2 << 30
#: default of ``server.max_dense_floats``: the largest dense table a client may initialize (2^25 floats,
#: 128 MiB of parameters; the shipped models have under 500 000)
MAX_DENSE_FLOATS = 1 << 25


def invalid(msg: str, shard: int | None = None) -> HostError:
    return HostError("INVALID_ARGUMENT", msg, shard)


def shrink_each(units, where: str, kind: str) -> int:
    """Run ``unit.shrink()`` over every unit (shards of a table, tables of a server) even when one fails;
    returns the rows deleted.

    Raises
    ------
    SpillError
        Some unit's pass failed (RocksDB refused a write or a read): after all ran, one error naming
        ``where``, the failed units (by index) and the rows deleted in all (``deleted``, int, also an
        attribute, counting a failed pass's own ``deleted``); chained to the first failure. A
        ``SpillFailedError`` (with its ``path``) when a spill store failed for good in a pass.
    """
    total, failed = 0, []
    for j, unit in enumerate(units):
        try:
            total += unit.shrink()
        except SpillError as exc:
            total += int(getattr(exc, "deleted", 0) or 0)
            failed.append((j, exc))
    if failed:
        msg = (f"{where}: the expiry pass failed on {kind}(s) {[j for j, _ in failed]} of {len(units)} (the "
               f"others ran; {total} row(s) deleted in all): " + "; ".join(str(e) for _, e in failed))
        dead = [e for _, e in failed if isinstance(e, SpillFailedError)]
        err = SpillFailedError(msg, dead[0].path, dead[0].cause) if dead else SpillError(msg)
        err.deleted = total
        raise err from failed[0][1]
    return total


class SparseHost:
    """One sparse table on one server: ``num_local`` SparseTable shards over this server's vshards.

    Parameters
    ----------
    name : str
    config : TableConfig
        Every local shard gets this config, with ``spill_path`` made unique per shard
        (``{spill_path}/{name}-server{S}-shard{J}``, or ``...-shard{J}.1`` for the shards a base load
        fills while the old ones still serve) and ``max_rows`` (per server) divided among the shards.
    server, num_servers, num_vshards, num_local : int
    pool : ThreadPoolExecutor
        Shared by the server; large requests work their local shards in parallel on it.
    busy : callable, optional
        Number of sparse requests the server is running (this one included); shards are worked in
        parallel only when it is 1.

    Raises
    ------
    TableConfigError
        ``max_rows`` is below ``num_local`` (every shard needs a share of at least one row), or a
        spill directory cannot be claimed (``SpillDirError``: foreign files there, or in use by
        another table or process, e.g. another job with the same ``spill_path`` and table names).
    """

    def __init__(self, name: str, config: TableConfig, *, server: int, num_servers: int,
                 num_vshards: int, num_local: int, pool: ThreadPoolExecutor, busy=None, clock=None):
        self.name = name
        self.clock = clock          # the tables' clock (seconds; None: time.time), for last_seen and expiry
        self.config = config
        self.dim = config.dim
        self.server, self.num_servers, self.num_vshards = server, num_servers, num_vshards
        self.local_owner = routing.local_shard_owners(num_vshards, num_servers, server, num_local)
        self.server_owner = routing.vshard_owners(num_vshards, num_servers)
        if 0 < config.max_rows < num_local:
            raise TableConfigError(f"table {name!r}: max_rows={config.max_rows} is below the {num_local} local "
                                   f"shards of a server; max_rows counts the rows of one server and is "
                                   f"divided among its local shards, each needing at least one")
        self.max_rows = config.max_rows
        self.num_local = num_local
        self._slot = 0                  # which of the two spill directory names the live shards use
        self.shards = self._new_shards(self._slot)
        self._pool = pool
        self.busy = busy or (lambda: 0)
        self._pending: list[tuple] = []
        self._pending_bytes = 0         # of the pushes held for the next barrier
        self._pending_lock = threading.Lock()

    # ------------------------------------------------------------------ routing inside the server
    def _split(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """[(local shard, positions of keys)] for the shards with keys; rejects keys of other servers."""
        local = routing.lookup(keys, self.num_vshards, self.local_owner)
        bad = np.flatnonzero(local < 0)
        if len(bad):
            k = keys[bad[0]]
            owner = int(self.server_owner[routing.vshard_of(keys[bad[:1]], self.num_vshards)[0]])
            raise invalid(f"{len(bad)} of {len(keys)} keys are not routed to this server: key {int(k)} "
                          f"belongs to server {owner} (num_vshards={self.num_vshards}, "
                          f"num_servers={self.num_servers}); check the client's server list")
        if len(self.shards) == 1:
            return [(0, np.arange(len(keys)))]
        order = np.empty(len(keys), np.int64)
        bounds = np.empty(len(self.shards) + 1, np.int64)
        _kernels.group(local, len(self.shards), order, bounds)
        return [(j, order[bounds[j]:bounds[j + 1]]) for j in range(len(self.shards))
                if bounds[j + 1] > bounds[j]]

    def _each(self, parts, fn, n: int) -> None:
        """Run fn(shard, positions) for every part: on the shared pool for large requests when this
        server is otherwise idle; inline when other requests are in flight (they already keep the cores
        busy, and thread hand-offs would only add CPU: ~0.7 ms per 100k-key pull)."""
        if len(parts) > 1 and n >= PARALLEL_SHARDS_MIN and self.busy() <= 1:
            futures = [self._pool.submit(fn, j, pos) for j, pos in parts]
            for f in futures:
                f.result()
        else:
            for j, pos in parts:
                fn(j, pos)

    # ------------------------------------------------------------------ operations
    def check_keys(self, keys: np.ndarray) -> list:
        """Raise HostError unless every key of ``keys : uint64[n]`` is routed to this server; returns
        the local shard split that ``pull`` and ``push`` take as ``parts``."""
        return self._split(keys)

    def pull(self, keys: np.ndarray, init_missing: bool, out: np.ndarray | None = None,
             parts: list | None = None) -> np.ndarray:
        """keys : uint64[n] -> float32[n, dim], written into ``out`` when given (the reply buffer).
        Each local shard reads its keys in place and writes its rows straight to their positions.
        ``parts``: the split ``check_keys`` returned for these keys (computed when None)."""
        if parts is None:
            parts = self._split(keys)
        self.check_alive(j for j, _ in parts)
        if out is None:
            out = np.empty((len(keys), self.dim), np.float32)
        if len(parts) == 1 and len(parts[0][1]) == len(keys):
            return self._shard_call(parts[0][0], "pull", keys, init_missing=init_missing, out=out)

        def one(j, pos):
            self._shard_call(j, "pull", keys, init_missing=init_missing, out=out, rows=pos)
        self._each(parts, one, len(keys))
        return out

    def check_push(self, keys, grads, shows, clicks, delta: bool) -> list:
        """Validate a push completely (before any shard is touched); returns the shard split."""
        what = "deltas" if delta else "grads"
        if grads.shape != (len(keys), self.dim):
            raise invalid(f"{what}: expected float32[{len(keys)}, {self.dim}] (one row of dim {self.dim} "
                          f"per key), got float32{list(grads.shape)}")
        if not _kernels.all_finite(grads):
            i = int(np.flatnonzero(~np.isfinite(grads).all(axis=1))[0])
            raise invalid(f"{what}[{i}] (key {int(keys[i])}) is not finite (NaN or Inf); "
                          f"the request was rejected and no row changed")
        if clicks is not None and shows is None:
            raise invalid("clicks given without shows: send shows too")
        for nm, arr in (("shows", shows), ("clicks", clicks)):
            if arr is not None:
                if arr.shape != (len(keys),):
                    raise invalid(f"{nm}: expected float32[{len(keys)}], got float32{list(arr.shape)}")
                if not (np.isfinite(arr).all() and (arr >= 0).all()):
                    raise invalid(f"{nm}: expected finite counts >= 0, got a NaN, Inf or negative value")
        return self._split(keys)

    def push(self, keys, grads, shows, clicks, *, delta: bool, parts=None) -> None:
        """Apply a push (``delta``: GEO deltas) to the local shards, after ``check_push`` (``parts``: its
        split, computed when None) and a check that none of those shards has failed.

        Raises
        ------
        HostError
            INVALID_ARGUMENT (nothing applied); UNAVAILABLE when a shard the keys go to has a failed
            spill store (``check_alive``: nothing applied) or fails during this push. In the latter case
            the update is applied in RAM, in all of that shard or in part (the write-back of rows that
            follows it is what failed), and on the other shards; it is not applied again: the failed
            shard refuses every later request, its server reports not live (``Health``), and its restart
            rolls the cluster back to the newest checkpoint, which drops this update with the rest.
        """
        if parts is None:
            parts = self.check_push(keys, grads, shows, clicks, delta)
        self.check_alive(j for j, _ in parts)

        def one(j, pos):
            whole = len(pos) == len(keys)
            k = keys if whole else _arrays.take(keys, pos)
            g = np.ascontiguousarray(grads) if whole else _arrays.take(grads, pos)
            s = None if shows is None else (shows if whole else _arrays.take(shows, pos))
            c = None if clicks is None else (clicks if whole else _arrays.take(clicks, pos))
            self._shard_call(j, "push_delta" if delta else "push", k, g, shows=s, clicks=c)
        self._each(parts, one, len(keys))

    def accumulate(self, keys, grads, shows, clicks) -> None:
        """Sync mode: hold a validated push until ``apply_pending``. The arrays are copied.

        Raises
        ------
        HostError
            INVALID_ARGUMENT (as ``check_push``); FAILED_PRECONDITION when the pushes held would pass
            ``MAX_PENDING_BYTES`` (pushes with accumulate and no applying barrier); nothing held.
        """
        self.check_push(keys, grads, shows, clicks, delta=False)
        size = sum(a.nbytes for a in (keys, grads, shows, clicks) if a is not None)
        item = (keys.copy(), grads.copy(), None if shows is None else shows.copy(),
                None if clicks is None else clicks.copy())
        with self._pending_lock:
            if self._pending_bytes + size > MAX_PENDING_BYTES:
                raise HostError("FAILED_PRECONDITION", f"table {self.name!r}: {self._pending_bytes} bytes of sync "
                                f"pushes are held for the next applying barrier; this one ({size} bytes) would "
                                f"pass the {MAX_PENDING_BYTES} a server holds per table (engine.ps.hosts."
                                f"MAX_PENDING_BYTES): accumulated pushes need a barrier with apply_pending between "
                                f"steps; nothing held")
            self._pending_bytes += size
            self._pending.append(item)

    def drop_pending(self) -> int:
        """Forget the sync pushes held for the next barrier (a restore rolled the tables back past
        them); returns how many were dropped."""
        with self._pending_lock:
            n, self._pending, self._pending_bytes = len(self._pending), [], 0
        return n

    def apply_pending(self, world: int) -> int:
        """Apply the held pushes as one update. Without show counts the gradients are averaged over
        ``world`` workers; with shows they are summed (the accessor divides by the summed shows, which
        already makes the update a mean). Returns the number of keys applied."""
        with self._pending_lock:
            items, self._pending, self._pending_bytes = self._pending, [], 0
        if not items:
            return 0
        with_shows = [it[2] is not None for it in items]
        if any(with_shows) and not all(with_shows):
            log.warning("table %s: sync step mixes pushes with and without shows; shows of the others "
                        "count as 1", self.name)
        keys, grads, shows, clicks = _arrays.concat_pushes(items)
        if shows is None:
            grads = grads * np.float32(1.0 / world)
        self.push(keys, grads, shows, clicks, delta=False)
        return len(keys)

    def _shard_call(self, j: int, method: str, *args, **kw):
        try:
            return getattr(self.shards[j], method)(*args, **kw)
        except TableInputError as e:
            raise invalid(str(e), shard=j) from None
        except SpillFailedError:
            raise self._unavailable(j, met=True) from None

    def failed(self) -> list[tuple[int, str]]:
        """[(local shard, why)] for the live shards whose spill store stopped writing for good
        (``SparseTable.spill_failed``)."""
        return [(j, why) for j, sh in enumerate(list(self.shards)) if (why := sh.spill_failed) is not None]

    def check_alive(self, shards=None) -> None:
        """Raise HostError UNAVAILABLE, naming the shard and its store, when one of ``shards`` (local
        shard indexes; None: all) has a failed spill store: a request touching it is refused before
        anything is applied."""
        for j in range(len(self.shards)) if shards is None else shards:
            if self.shards[j].spill_failed is not None:
                raise self._unavailable(j)

    def _unavailable(self, j: int, met: bool = False) -> HostError:
        """UNAVAILABLE for shard ``j`` whose store failed; ``met``: during this request, which may have
        applied its update in part (``push``), else before it (nothing applied)."""
        done = ("this request met the failure: what it applied is dropped by that restart" if met else
                "the request was refused, nothing applied")
        return HostError("UNAVAILABLE", f"shard {j} of table {self.name!r} is out of service: "
                         f"{self.shards[j].spill_failed}; this server reports not live (Health: failed) and is "
                         f"to be restarted from the newest checkpoint; {done}", shard=j)

    def shrink(self) -> int:
        """Expiry pass over the local shards at the tables' own clock; returns rows deleted.

        Every shard's pass runs even when one fails (RocksDB refused a write or a read), so one bad
        shard does not leave the others unexpired.

        Raises
        ------
        HostError
            UNAVAILABLE: a shard has a failed spill store (``check_alive``); no pass ran.
        SpillError
            A shard's pass failed: the message names the shard(s), the first error and the rows the
            passes deleted (``deleted``, int, also an attribute); chained to the first error.
        """
        self.check_alive()
        return shrink_each(self.shards, f"table {self.name!r} on server {self.server}", "shard")

    @property
    def budget(self) -> MemoryBudget | None:
        """The live shards' memory budget (``memory_bytes``), or None."""
        return self.shards[0].budget if self.shards else None

    def stats(self) -> dict:
        """Sums over the local shards (``rows``, ``rows_refused_full``, ...; ``max_rows`` is the
        server's limit, 0: none), plus ``rows_per_shard``, ``stale_shards`` (shards whose sizes are
        their last read because a writer held them, ``SparseTable.stats``) and ``stats_age_s`` (the
        oldest of those reads, seconds; 0.0 when all are current). Never waits behind a shard's writer."""
        per = [s.stats() for s in list(self.shards)]
        total = {k: sum(p[k] for p in per) for k in per[0]
                 if isinstance(per[0][k], (int, float)) and k not in ("stale", "stats_age_s")}
        total.update(dim=self.dim, local_shards=len(per), optimizer=self.config.optimizer,
                     rows_per_shard=[p["rows"] for p in per], max_rows=self.max_rows,
                     stale_shards=sum(bool(p["stale"]) for p in per),
                     stats_age_s=max(p["stats_age_s"] for p in per))
        memory = {k: sum(p["memory"][k] for p in per) for k in per[0]["memory"]}
        if "rocksdb_block_cache" in memory and self.budget is not None:
            memory["rocksdb_block_cache"] = per[0]["memory"]["rocksdb_block_cache"]   # one shared cache
        total["memory"] = memory
        if "rocksdb" in per[0]:
            total["rocksdb"] = {k: sum(p["rocksdb"][k] for p in per) for k in per[0]["rocksdb"]}
        if self.budget is not None:
            total["memory_budget"] = self.budget.parts()
            total["rows_cap_per_shard"] = self.budget.rows_cap()
        return total

    # ------------------------------------------------------------------ shards and checkpoints
    def _new_shards(self, slot: int, expected_rows: int = 0,
                    budget: MemoryBudget | None = None) -> list[SparseTable]:
        """Empty local shards whose spill directories use name ``slot`` (0 or 1), sized for
        ``expected_rows`` rows of the table on this server, sharing ``budget`` (a new one from
        ``memory_bytes`` when None). On failure the shards made so far are closed (their directories
        removed) and the error raised."""
        config, n = self.config, self.num_local
        per_shard = max(1024, int(expected_rows * 1.05) // n)
        shards: list[SparseTable] = []
        if config.memory_bytes and budget is None:   # one budget for this server's shards of the table
            try:
                budget = MemoryBudget(config.memory_bytes, n, RowLayout.of(config).row_bytes,
                                      config.sketch_depth * config.sketch_width * 4 if config.uses_admission else 0)
                budget.check_host()
            except ValueError as exc:    # its message starts memory_bytes=
                raise TableConfigError(f"tables.sparse.{self.name}.{exc}") from None
        try:
            for j in range(n):
                cfg = config
                if config.spill_path:
                    suffix = "" if slot == 0 else f".{slot}"
                    cfg = dataclasses.replace(config, spill_path=os.path.join(
                        config.spill_path, f"{self.name}-server{self.server}-shard{j}{suffix}"))
                if config.max_rows:     # shard j's share of the server's limit (sizes differ by <= 1)
                    cfg = dataclasses.replace(cfg, max_rows=(j + 1) * config.max_rows // n
                                              - j * config.max_rows // n)
                rows = min(per_shard, cfg.memory_rows)
                if cfg.max_rows:
                    rows = min(rows, cfg.max_rows)
                clock = {} if self.clock is None else {"clock": self.clock}
                try:
                    shards.append(SparseTable(cfg, initial_rows=rows, **clock, budget=budget,
                                              name=f"sparse table {self.name!r} on server {self.server}"))
                except SpillDirError as exc:    # the config key that chose the directory, for the user
                    raise SpillDirError(f"tables.sparse.{self.name}.spill_path={config.spill_path!r}: {exc}",
                                        exc.path) from None
        except BaseException:
            _close_each(shards, f"table {self.name!r}: a new shard, after an error making the next")
            raise
        return shards

    def fresh_shards(self, expected_rows: int = 0) -> list[SparseTable]:
        """Empty shards to load a base checkpoint into while the live ones keep their rows: same
        configs, spill directories under the other slot name. Hand them to ``adopt`` once every file
        verified, or to ``discard`` on failure. For spilled tables the live shards first move their
        RAM rows to RocksDB and keep none until the load ends (``SparseTable.release_ram``: reads of
        them meanwhile go to disk without promoting), so during the load RAM holds at most the new
        shards' ``memory_rows`` each. Under ``memory_bytes`` the new shards share the live shards'
        budget (one block cache, one set of accounts), so the table never holds two budgets' worth. A
        live shard whose spill store failed (``failed``) takes no write: it keeps its RAM rows, and a
        load that ``adopt`` completes replaces it (the server is live again).

        Parameters
        ----------
        expected_rows : int
            Rows of this table expected on this server (arenas are sized for it: no rehash while
            loading; RAM-only pages are only touched when written).

        Raises
        ------
        TableConfigError
            A spill directory cannot be claimed (``SpillDirError``, naming it).
        SpillError
            A live shard's store failed writing its RAM rows out (``SparseTable.release_ram``); every
            live shard is restored, no new shard is made.
        """
        try:
            for sh in self.shards:
                if sh.spill_failed is None:
                    sh.release_ram()
            return self._new_shards(1 - self._slot, expected_rows, self.budget)
        except BaseException:
            self._restore_ram()
            raise

    def adopt(self, shards: list[SparseTable]) -> None:
        """Swap ``shards`` (from ``fresh_shards``) in and close the old ones (their spill directories
        are removed). The new shards first take over the old ones' cumulative counters
        (``SparseTable.carry_counters``: pulls, pushes, rows created, call times; not rows or bytes), so
        a load or a clear is no counter reset to Prometheus (the caller holds the tables exclusively:
        no call adds to the old shards meanwhile)."""
        for j, sh in enumerate(self.shards if shards else ()):
            shards[j % len(shards)].carry_counters(sh)
        old, self.shards = self.shards, shards
        self._slot = 1 - self._slot
        _close_each(old, f"table {self.name!r}: an old shard replaced by a load or a clear")

    def clear(self) -> None:
        """Drop every row: empty shards (same configs, budget and spill directory slots) replace the
        live ones, which are closed (their spill directories removed). For a roll-back to a job's
        beginning (``PSServer`` Fence with ``clear``); the caller holds the tables exclusively.

        Raises
        ------
        TableConfigError
            A spill directory cannot be claimed (``SpillDirError``, naming it); the live rows stay.
        """
        self.adopt(self._new_shards(1 - self._slot, 0, self.budget))

    def discard(self, shards: list[SparseTable]) -> None:
        """Close shards from ``fresh_shards`` that will not be used (their spill directories go); the
        live shards keep rows in RAM again (``SparseTable.restore_ram``). Raises nothing: it runs on a
        failed load's way out, whose error is the one to report (a shard that cannot be closed or
        restored is logged)."""
        try:
            _close_each(shards, f"table {self.name!r}: a new shard of a failed load")
        finally:
            self._restore_ram()

    def _restore_ram(self) -> None:
        """``restore_ram`` on every live shard, each whatever the others do (a failure is logged)."""
        for j, sh in enumerate(self.shards):
            try:
                sh.restore_ram()
            except Exception:  # noqa: BLE001 - the other shards must get their RAM back all the same
                log.exception("table %r: shard %d could not take rows into RAM again", self.name, j)

    def close(self) -> None:
        """Close every local shard (each whatever the others do; a failure is logged)."""
        _close_each(self.shards, f"table {self.name!r}: closing a shard")


def spill_failures(hosts) -> list[str]:
    """'table T shard J: why' for every local shard of ``hosts`` (SparseHost) whose spill store failed."""
    return [f"table {h.name!r} shard {j}: {why}" for h in hosts for j, why in h.failed()]


def failed_shard(hosts, exc: SpillFailedError) -> int | str:
    """The local shard whose spill store raised ``exc`` (by its directory), or "?" (a shard no longer live)."""
    for h in hosts:
        for j, sh in enumerate(list(h.shards)):
            if sh.config.spill_path and os.path.abspath(sh.config.spill_path) == os.path.abspath(exc.path):
                return j
    return "?"


def _close_each(shards, what: str) -> None:
    """Close every shard of ``shards``, each in its own try, so one that fails (logged with ``what``)
    leaves no other's spill directory and lock behind."""
    for j, sh in enumerate(shards):
        try:
            sh.close()
        except Exception:  # noqa: BLE001 - the next shards must still be closed
            log.exception("%s (%d): close failed", what, j)


class _Block:
    def __init__(self, length: int, cfg: DenseTableConfig):
        self.params = np.zeros(length, np.float32)
        self.initialized = False
        if cfg.optimizer == "adam":
            self.opt = Adam(length, cfg.learning_rate, cfg.beta1, cfg.beta2, cfg.epsilon)
        else:
            self.opt = SGD(length, cfg.learning_rate)
        self.pending = np.zeros(length, np.float32)
        self.pending_n = 0
        self.lock = threading.Lock()


class DenseHost:
    """The blocks of one dense table owned by this server.

    A dense table of ``size`` floats is cut into blocks of ``DENSE_BLOCK`` floats; block ``b`` lives on
    server ``(ordinal + b) % num_servers`` (``ordinal``: the table's position among the dense tables in
    name order), so big tables spread over the servers. Each block has its own optimizer; Adam and SGD
    are element-wise, so this equals one optimizer over the whole vector.
    """

    def __init__(self, name: str, config: DenseTableConfig, *, ordinal: int, server: int,
                 num_servers: int, max_floats: int = MAX_DENSE_FLOATS):
        self.name, self.config = name, config
        self.ordinal, self.server, self.num_servers = ordinal, server, num_servers
        self.max_floats = int(max_floats)        # the largest size a client may initialize it with
        self.size: int | None = None
        self.blocks: dict[int, _Block] = {}
        self._lock = threading.Lock()

    def owner(self, block: int) -> int:
        return (self.ordinal + block) % self.num_servers

    @property
    def num_blocks(self) -> int:
        return 0 if self.size is None else max(1, -(-self.size // DENSE_BLOCK))

    def block_length(self, block: int) -> int:
        return min(DENSE_BLOCK, self.size - block * DENSE_BLOCK) if self.size else 0

    def _block(self, block: int) -> _Block:
        if self.size is None:
            raise HostError("FAILED_PRECONDITION", f"dense table {self.name!r} is not initialized: "
                            f"call PSClient.init_dense(table, params) first")
        if not 0 <= block < self.num_blocks:
            raise invalid(f"block {block} out of range: the table has {self.num_blocks} blocks")
        if self.owner(block) != self.server:
            raise invalid(f"block {block} lives on server {self.owner(block)}, not on this one")
        return self.blocks[block]

    def check_block(self, block: int) -> None:
        """Raise HostError unless the table is initialized and ``block`` exists and lives here."""
        self._block(block)

    def _check(self, block: int, values: np.ndarray, what: str) -> _Block:
        b = self._block(block)
        if values.shape != b.params.shape:
            raise invalid(f"{what}: expected float32[{len(b.params)}] for block {block}, "
                          f"got float32{list(values.shape)}")
        if not _kernels.all_finite(values):
            raise invalid(f"{what} of block {block} is not finite (NaN or Inf); nothing changed")
        return b

    def check_grad(self, block: int, grad: np.ndarray) -> None:
        """Raise HostError unless ``grad`` fits ``block`` (which lives here) and is finite."""
        self._check(block, grad, "grad")

    def check_size(self, size: int) -> None:
        """Raise HostError INVALID_ARGUMENT naming ``size`` unless a client may initialize the table with
        ``size`` floats: 1 <= size <= ``max_floats`` (``server.max_dense_floats``), and the table's own
        size once it has one."""
        if size < 1:
            raise invalid(f"size: a dense table has >= 1 floats, got {size}")
        if size > self.max_floats:
            raise invalid(f"size: {size} floats is more than server.max_dense_floats = {self.max_floats} "
                          f"(raise it in the servers' config for a larger model); nothing allocated")
        if self.size is not None and size != self.size:
            raise invalid(f"size: init with size {size}, but the table was initialized with size {self.size}")

    def _sized(self, size: int) -> None:
        """Allocate the blocks this server owns of a table of ``size`` floats (first call), or raise
        HostError INVALID_ARGUMENT (``check_size``). The blocks are built before the table takes the
        size: an allocation that fails (MemoryError) leaves it uninitialized."""
        with self._lock:
            self.check_size(size)
            if self.size is None:
                n_blocks = max(1, -(-size // DENSE_BLOCK))
                blocks = {bl: _Block(min(DENSE_BLOCK, size - bl * DENSE_BLOCK), self.config)
                          for bl in range(n_blocks) if self.owner(bl) == self.server}
                self.blocks, self.size = blocks, size

    def clear(self) -> None:
        """Forget the table: not initialized again until the next ``init`` (a roll-back to a job's
        beginning)."""
        with self._lock:
            self.size = None
            self.blocks = {}

    def init(self, block: int, size: int, values: np.ndarray, force: bool) -> bool:
        self._sized(size)
        b = self._check(block, values, "values")
        with b.lock:
            if b.initialized and not force:
                return False
            b.params[:] = values
            b.initialized = True
            return True

    def state(self, block: int, out: tuple | None = None) -> DenseBlockState:
        """A consistent copy of the block's whole optimizer state, read under the block lock:
        ``params : float32[L]``, for Adam ``m, v : float32[L]`` and ``t`` (int), else None. ``out``:
        ``(params, m, v)`` buffers to copy into (e.g. the reply's bytes; m, v ignored for SGD).

        Raises
        ------
        HostError
            FAILED_PRECONDITION (table not initialized), INVALID_ARGUMENT (block not here).
        """
        b = self._block(block)
        out = out or (None, None, None)
        with b.lock:
            params = _copy_out(b.params, out[0])
            if not isinstance(b.opt, Adam):
                return DenseBlockState(params)
            return DenseBlockState(params, _copy_out(b.opt.m, out[1]), _copy_out(b.opt.v, out[2]), int(b.opt.t))

    def set_state(self, block: int, size: int, params: np.ndarray, m: np.ndarray | None,
                  v: np.ndarray | None, t: int) -> None:
        """Set the block's whole optimizer state at once (under the block lock), allocating the table
        with ``size`` floats first if this server has not seen it. Everything is checked before anything
        changes; setting the same state twice leaves the same state (a retry is harmless).

        Parameters
        ----------
        block, size : int
        params : float32[L]
        m, v : float32[L] or None
            Adam's moments (v >= 0), required for an Adam table, refused for SGD.
        t : int
            Adam's step count (>= 0); 0 for SGD.

        Raises
        ------
        HostError
            INVALID_ARGUMENT naming the block and the field (wrong length, NaN/Inf, v < 0, t < 0,
            moments that do not fit the table's optimizer, another size than the table's or one over
            ``max_floats``, a block that lives elsewhere); nothing changed.
        """
        if size < 1 or (self.size is not None and size != self.size):
            raise invalid(f"block {block}: size {size} given, the table has "
                          f"{self.size if self.size is not None else 'no size yet (size must be >= 1)'}")
        if size > self.max_floats:
            raise invalid(f"block {block}: size {size} floats is more than server.max_dense_floats = "
                          f"{self.max_floats}; nothing changed")
        n_blocks = max(1, -(-size // DENSE_BLOCK))
        if not 0 <= block < n_blocks:
            raise invalid(f"block {block} out of range: a table of {size} floats has {n_blocks} blocks")
        if self.owner(block) != self.server:
            raise invalid(f"block {block} lives on server {self.owner(block)}, not on this one")
        length = min(DENSE_BLOCK, size - block * DENSE_BLOCK)
        adam = self.config.optimizer == "adam"
        if adam and (m is None or v is None):
            raise invalid(f"block {block}: the table's optimizer is adam: its state needs m and v "
                          f"(float32[{length}] each); nothing changed")
        if not adam and (m is not None or v is not None or t):
            raise invalid(f"block {block}: the table's optimizer is {self.config.optimizer}: it has no "
                          f"moments or step count (m, v absent, t 0); nothing changed")
        for what, arr in (("values (params)", params), ("m", m), ("v", v)):
            if arr is None:
                continue
            if arr.shape != (length,):
                raise invalid(f"block {block} {what}: expected float32[{length}], got float32{list(arr.shape)}; "
                              f"nothing changed")
            if not _kernels.all_finite(arr):
                raise invalid(f"block {block} {what}: not finite (NaN or Inf); nothing changed")
        if v is not None and not (v >= 0).all():
            raise invalid(f"block {block} v: Adam's second moment must be >= 0, got {float(v.min())}; "
                          f"nothing changed")
        if t < 0:
            raise invalid(f"block {block} t: Adam's step count must be >= 0, got {t}; nothing changed")
        self._sized(size)
        b = self.blocks[block]
        with b.lock:
            b.params[:] = params
            if adam:
                b.opt.load_state_dict({"m": m, "v": v, "t": int(t)})
            b.initialized = True

    def pull(self, block: int, out: np.ndarray | None = None) -> np.ndarray:
        """A copy of the block's parameters (into ``out``, e.g. the reply buffer, when given)."""
        b = self._block(block)
        with b.lock:
            return _copy_out(b.params, out)

    def grad(self, block: int, grad: np.ndarray, accumulate: bool) -> None:
        b = self._check(block, grad, "grad")
        with b.lock:
            if accumulate:
                b.pending += grad
                b.pending_n += 1
            else:
                b.opt.step(b.params, np.ascontiguousarray(grad, dtype=np.float32))

    def step(self, block: int, grad: np.ndarray, out: np.ndarray | None = None, *,
             checked: bool = False) -> np.ndarray:
        """Optimizer step with ``grad`` (async mode), then a copy of the block's fresh parameters (into
        ``out`` when given). ``checked``: ``check_grad`` already passed for this gradient."""
        b = self._block(block) if checked else self._check(block, grad, "grad")
        with b.lock:
            b.opt.step(b.params, np.ascontiguousarray(grad, dtype=np.float32))
            return _copy_out(b.params, out)

    def delta(self, block: int, delta: np.ndarray) -> None:
        b = self._check(block, delta, "delta")
        with b.lock:
            b.params += delta

    def drop_pending(self) -> None:
        """Forget the sync gradients held for the next barrier (see ``SparseHost.drop_pending``)."""
        for b in self.blocks.values():
            with b.lock:
                b.pending[:] = 0
                b.pending_n = 0

    def apply_pending(self, world: int) -> None:
        for b in self.blocks.values():
            with b.lock:
                if b.pending_n:
                    b.opt.step(b.params, b.pending * np.float32(1.0 / world))
                    b.pending[:] = 0
                    b.pending_n = 0

    @property
    def nbytes(self) -> int:
        """Bytes of this server's blocks, estimated as four arrays of each block's parameters (the
        parameters, a merged gradient and up to two optimizer moments)."""
        return sum(4 * b.params.nbytes for b in list(self.blocks.values()))

    def stats(self) -> dict:
        return {"size": self.size, "num_blocks": self.num_blocks, "blocks_here": sorted(self.blocks),
                "optimizer": self.config.optimizer}

    def snapshot(self) -> DenseState | None:
        """Copies of this server's blocks with their optimizer state (None before init)."""
        if self.size is None:
            return None
        state = DenseState(self.size)
        for bl, b in self.blocks.items():
            with b.lock:
                if isinstance(b.opt, Adam):
                    st = b.opt.state_dict()
                    state.blocks[bl] = DenseBlockState(b.params.copy(), np.array(st["m"], np.float32),
                                                       np.array(st["v"], np.float32), int(st["t"]))
                else:
                    state.blocks[bl] = DenseBlockState(b.params.copy())
        return state

    def check_restore(self, size: int, blocks: dict) -> None:
        """Raise unless ``restore(size, blocks)`` would succeed; changes nothing.

        Raises
        ------
        HostError
            DATA_LOSS when a block this server owns is missing or has the wrong length (params, or
            Adam's m / v); FAILED_PRECONDITION when the table was initialized with another size.
        """
        if size < 1:
            raise HostError("DATA_LOSS", f"dense table {self.name!r}: the checkpoint gives size {size}")
        if self.size is not None and size != self.size:
            raise HostError("FAILED_PRECONDITION", f"dense table {self.name!r}: the checkpoint's table has "
                            f"{size} values, this server's has {self.size}; nothing was restored")
        adam = self.config.optimizer == "adam"
        for bl in range(max(1, -(-size // DENSE_BLOCK))):
            if self.owner(bl) != self.server:
                continue
            st = blocks.get(bl)
            if st is None:
                raise HostError("DATA_LOSS", f"dense table {self.name!r}: block {bl} is missing from the "
                                f"checkpoint")
            length = min(DENSE_BLOCK, size - bl * DENSE_BLOCK)
            parts = [("params", st.params)] + ([("m", st.m), ("v", st.v)] if adam and st.m is not None else [])
            for what, arr in parts:
                if arr is None or np.shape(arr) != (length,):
                    got = None if arr is None else list(np.shape(arr))
                    raise HostError("DATA_LOSS", f"dense table {self.name!r}: block {bl} {what}: expected "
                                    f"float32[{length}], the checkpoint has {got}")
                if not np.isfinite(arr).all():
                    raise HostError("DATA_LOSS", f"dense table {self.name!r}: block {bl} {what}: the "
                                    f"checkpoint holds NaN or Inf")
            if adam and st.m is not None and st.t is None:
                raise HostError("DATA_LOSS", f"dense table {self.name!r}: block {bl}: Adam moments without "
                                f"their step count t")

    def restore(self, size: int, blocks: dict) -> int:
        """Set the blocks this server owns from a checkpoint (``DenseBlockState`` by block index).
        Everything is checked first (``check_restore``), so a failure changes nothing.

        Raises
        ------
        HostError
            As ``check_restore``.
        """
        self.check_restore(size, blocks)
        n = 0
        for bl in range(max(1, -(-size // DENSE_BLOCK))):
            if self.owner(bl) != self.server:
                continue
            st = blocks[bl]
            self.init(bl, size, st.params, force=True)
            b = self.blocks[bl]
            if isinstance(b.opt, Adam) and st.m is not None:
                b.opt.load_state_dict({"m": st.m, "v": st.v, "t": int(st.t)})
            n += 1
        return n
