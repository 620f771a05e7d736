"""What one server process holds: ``SparseHost`` (one sparse table split into local shards) and
``dense_host.DenseHost`` (the blocks of one dense table that this server owns).

Both validate a whole request before touching any shard, so a rejected request leaves every table
unchanged. Errors are ``HostError`` carrying a gRPC status code name and the shard concerned; the
server adds the server, table and request id to the message.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sparse_tables import SparseTable, TableConfig, TableConfigError, TableInputError
from sparse_tables.errors import SpillDirError, SpillError, SpillFailedError
from sparse_tables.budget import MemoryBudget
from sparse_tables.config import RowLayout
from sparse_tables.spill import sweep_dead

from . import _arrays, _kernels, routing

log = logging.getLogger(__name__)

PARALLEL_SHARDS_MIN = 8192   # keys in a request above which local shards are worked in parallel


def copy_out(params: np.ndarray, out: np.ndarray | None) -> np.ndarray:
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
        if config.spill_path:
            # this server's directories of this table that a dead run left under names not opened again
            # now (the other slot, a shard number beyond num_local): they held their RocksDB files for good
            mine = re.compile(rf"{re.escape(self.name)}-server{self.server}-shard\d+(\.\d+)?")
            sweep_dead(config.spill_path, mine)
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
