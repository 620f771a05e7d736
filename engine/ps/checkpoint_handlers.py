"""``PSServer``'s checkpoint requests, ``Save`` and ``Load`` (a mixin of ``engine.ps.server.PSServer``, whose
``handle`` runs them: admin token, confinement to the checkpoint root, exactly-once replies, the tables'
exclusive lock for a Load). The part files' format is ``engine.checkpoint.writer`` / ``reader``'s; a delta's
parent rule is ``engine.ps.delta_lineage``'s."""
from __future__ import annotations

import logging
import time

from hdfs_io import CheckpointCorruptError, NotPublishedError, Storage, described, permanent_mark
from sparse_tables import SpillError, TableConfigError

from .. import failpoints
from ..checkpoint.manifest import kind_of_uri, read_checkpoint_manifest
from ..checkpoint.reader import CheckpointMismatchError, load_server_parts
from ..checkpoint.writer import save_server_parts
from ..errors import CheckpointStorageError, RestoreMismatchError
from ..security.confine import OutsideRootError, confine
from ..sharding import routing
from . import ps_pb2 as pb
from .hosts import HostError

log = logging.getLogger(__name__)


class CheckpointHandlers:
    """``Save`` and ``Load`` over the attributes ``PSServer`` sets (``sparse``, ``dense``, ``index``,
    ``num_servers``, ``num_vshards``, ``checkpoint_root``, ``load_roots``, ``lineage``, ...)."""

    def Save(self, req: pb.PathRequest) -> pb.CountResponse:
        """Write this server's part files of the checkpoint directory ``req.path`` (a URI ending in
        ``HHMM-base`` or ``HHMM-delta[.N]``; see ``engine.checkpoint.writer``). Returns the rows written.

        A delta must name the checkpoint this server's changes are counted from as ``req.parent``
        (``engine.ps.delta_lineage``), else FAILED_PRECONDITION "delta parent mismatch", nothing written.
        A storage failure (down or silent through ``hdfs_io``'s retries, a full or read-only disk) is
        FAILED_PRECONDITION "checkpoint storage error" naming the call and the file (``_storage_failed``);
        the parts it wrote are not published, and only a base is accepted after it."""
        kind = kind_of_uri(confine(req.path, self.checkpoint_root))
        with self.lineage.saving(kind, req.path, req.parent):   # a delta must continue this server's state
            try:
                return self._save(req, kind)
            except OSError as e:    # the storage's (hdfs_io names the call and the file): no server fault
                raise _storage_failed(self.index, "save", req.path, e) from None

    def _save(self, req: pb.PathRequest, kind: str) -> pb.CountResponse:
        for h in self.sparse.values():      # no checkpoint of a state a failed request may have changed
            h.check_alive()
        dense = {n: st for n, h in self.dense.items() if (st := h.snapshot()) is not None}
        t0 = time.perf_counter()
        report = save_server_parts(self._checkpoint_storage(req.path), kind=kind, server=self.index,
                                   num_servers=self.num_servers, num_vshards=self.num_vshards,
                                   sparse={n: h.shards for n, h in self.sparse.items()}, dense=dense,
                                   groups=self.checkpoint_groups, threads=self.checkpoint_threads,
                                   resumed_with=self.resumed_with)
        self._note_part("save", time.perf_counter() - t0,
                        sum(f.get("size", 0) for f in report["files"].values()))
        return pb.CountResponse(request_id=req.request_id, count=sum(report["rows"].values()))

    def Load(self, req: pb.PathRequest, *, trusted: bool = False) -> pb.CountResponse:
        """Load this server's rows of the published checkpoint at ``req.path``: all or nothing.

        A base is read into fresh shards (``SparseHost.fresh_shards``, under the other spill directory
        name) while the live shards keep their rows; only when every file has been verified (size and
        CRC-32, columns, row counts, ``max_rows``) and the dense blocks checked are the fresh shards
        swapped in and the old ones closed, and the dense blocks set. A delta is verified completely
        (every file read and checked, ``max_rows`` counted) before any live row changes, then applied
        on top (``engine.checkpoint.reader``). On any failure the sparse and dense tables are as they
        were and the fresh shards, with their spill directories, are gone.

        Peak memory of a base load: a RAM-only table holds its old rows and the new ones until the
        swap, up to twice its size (each side at most ``max_rows`` when set). A spilled table first
        moves its RAM rows to RocksDB and keeps none until the swap (``SparseTable.release_ram``), so
        RAM holds about one RAM tier, the new shards' (``memory_rows`` each), plus the old shards' Bloom
        filters (under ``memory_bytes`` both sides share one budget, which counts them); disk holds both
        databases until the swap. Reading costs one part file per ``checkpoint_threads`` thread on top.
        A delta costs no second copy of the table, only those files and the delta's tombstone keys.

        Raises
        ------
        HostError
            DATA_LOSS naming the file (missing, damaged, misfit, or the row counts disagree with the
            manifest); NOT_FOUND (not published); FAILED_PRECONDITION (a table that does not fit, a
            table that would pass ``max_rows``: the table, the limit and the row count are named, the
            message starting with ``RestoreMismatchError.MARKER``; or a spill directory that cannot be
            claimed); UNAVAILABLE: a spill store failed (a full disk),
            the new shards' or, for a delta, a live one's (refused before anything is applied). A base
            load replaces live shards whose store had failed: the server is live again.
            FAILED_PRECONDITION "checkpoint storage error" (``_storage_failed``): the checkpoint's storage
            failed (down or silent through ``hdfs_io``'s retries, access refused); nothing changed.
        """
        ckpt = self._checkpoint_storage(req.path if trusted else self._confine_load(req.path))
        failpoints.hit("server.load")
        fresh: dict = {}
        try:
            manifest = read_checkpoint_manifest(ckpt, "")
            for h in self.sparse.values() if manifest["kind"] != "base" else ():
                h.check_alive()                 # a delta writes into the live shards: none may have failed
            if manifest["kind"] == "base":
                counts = manifest["tables"].get("sparse", {})
                for name, h in self.sparse.items():
                    fresh[name] = h.fresh_shards(counts.get(name, {}).get("rows", 0) // self.num_servers)
            target = fresh if fresh else {n: h.shards for n, h in self.sparse.items()}
            hosts = list(self.sparse.values())
            owner = (routing.local_shard_owners(self.num_vshards, self.num_servers, self.index,
                                                hosts[0].num_local) if hosts else None)
            _check_dense_names(manifest, list(self.dense), ckpt.uri)

            def check_dense(dense: dict) -> None:      # before any live row changes
                for name, (size, blocks) in dense.items():
                    if name in self.dense:
                        self.dense[name].check_restore(size, blocks)
            rows, _, dense = load_server_parts(
                ckpt, num_vshards=self.num_vshards, local_owner=owner, sparse=target,
                dense_owns=lambda name, b: name in self.dense and self.dense[name].owner(b) == self.index,
                manifest=manifest, threads=self.checkpoint_threads, check_dense=check_dense)
            dense = {n: v for n, v in dense.items() if n in self.dense}
        except BaseException as e:
            for name, shards in fresh.items():
                self.sparse[name].discard(shards)
            if isinstance(e, NotPublishedError):
                raise HostError("NOT_FOUND", str(e)) from None
            if isinstance(e, CheckpointCorruptError):
                raise HostError("DATA_LOSS", str(e)) from None
            if isinstance(e, CheckpointMismatchError):      # the client's RestoreMismatchError
                raise HostError("FAILED_PRECONDITION", f"{RestoreMismatchError.MARKER}: {e}") from None
            if isinstance(e, TableConfigError):
                raise HostError("FAILED_PRECONDITION", str(e)) from None
            if isinstance(e, SpillError):   # a full disk: the base's new shards are gone (discard)
                raise HostError("UNAVAILABLE", f"{e}{'; the load was undone' if fresh else ''}") from None
            if isinstance(e, OSError):      # the checkpoint's storage failed: no table changed
                raise _storage_failed(self.index, "load", req.path, e) from None
            raise
        if trusted:     # rolling back to this chain later (a client's Load) stays possible
            self.load_roots.append(req.path.rstrip("/").rsplit("/", 2)[0])
        for name, shards in fresh.items():
            self.sparse[name].adopt(shards)
        for name, (size, blocks) in dense.items():
            self.dense[name].restore(size, blocks)
        return pb.CountResponse(request_id=req.request_id, count=sum(rows.values()))

    def _confine_load(self, uri: str) -> str:
        """``uri`` when below ``checkpoint_root`` or one of ``load_roots``; else OutsideRootError."""
        for root in self.load_roots:
            try:
                return confine(uri, root)
            except OutsideRootError:
                pass
        return confine(uri, self.checkpoint_root)

    def _checkpoint_storage(self, uri: str) -> Storage:
        return Storage.from_uri(uri, storage_options=self.storage_options)


def _check_dense_names(manifest: dict, hosted: list[str], uri: str) -> None:
    """Refuse a checkpoint whose dense tables this server's do not match (before anything is read).

    A hosted dense table the checkpoint neither holds nor declares (its config snapshot's
    ``tables.dense``: a table that was not initialized yet when it was saved is declared there) would
    keep its initial values while the rest of the model restores: a renamed ``model.dense_table``
    resumed with a fresh MLP and no word (test AUC 0.652 -> 0.629). A dense table of the checkpoint
    that this server does not host is not loaded, and logged (the ``tables.dense.metrics`` of
    checkpoints of before 2026-11-25 is one: nothing reads it any more).

    Raises
    ------
    CheckpointMismatchError
        Naming the hosted table, the checkpoint and the dense tables it holds.
    """
    held = manifest["tables"].get("dense", {})
    declared = ((manifest.get("config") or {}).get("tables") or {}).get("dense") or {}
    missing = [n for n in hosted if n not in held and n not in declared]
    if held and missing:
        raise CheckpointMismatchError(
            f"dense table {missing[0]!r}: checkpoint {uri} holds no such table (its dense tables: "
            f"{sorted(held)}); restoring it would leave {missing[0]!r} at its initial values while the rest of "
            f"the model restores: name the checkpoint's table (model.dense_table, tables.dense)")
    for name in sorted(set(held) - set(hosted)):
        log.warning("dense table %r of checkpoint %s is not hosted here; it is not loaded", name, uri)


def _storage_failed(server: int, op: str, uri: str, e: OSError) -> HostError:
    """FAILED_PRECONDITION "checkpoint storage error" (the client's ``CheckpointStorageError``) for a Save
    or Load of server ``server`` whose storage failed, logged as one WARNING: ``op`` and the checkpoint
    ``uri``, then the storage call and the file the error names (``hdfs_io`` adds them as notes: pyarrow's
    own message names neither). Not INTERNAL: not this server's fault, no traceback in its log, and the
    client does not retry a call that the storage layer already retried. A storage that refuses it for
    good (read-only, access refused, full: ``hdfs_io.permanent_failure``) is marked so in the message
    (``[permanent storage failure: EROFS]``), so worker 0 ends the job at once instead of restarting it."""
    detail = f"{type(e).__name__}: {described(e)}{permanent_mark(e)}"
    log.warning("server %d: %s of %s failed in its storage: %s", server, op, uri, detail)
    return HostError("FAILED_PRECONDITION", f"{CheckpointStorageError.MARKER}: {op} of {uri} failed: {detail}")
