"""The coordinator of checkpoints: names, publishes, restores and prunes them.

One process coordinates (worker 0 or the launcher); the servers write and read their own part files.
``cluster`` is anything with the PS client's shape::

    cluster.num_servers : int
    cluster.save(uri, parent) -> int   every server writes its part files + part report into uri
                                 (parallel); a delta names its parent's URI, which a server refuses
                                 (DeltaParentError) unless its changes are counted from it
    cluster.load(uri) -> int     every server loads its rows of the checkpoint at uri (base: reset first)

Save protocol::

    1. pick the name {day}/{HHMM}-{kind}[.seq]; clean leftovers of a crashed attempt of that name
    2. cluster.save(uri, parent)                 servers write in parallel; any failure stops here
    3. read _parts/s{i}.json of every server     a missing report (server died) stops here
    4. manifest.json, then _SUCCESS              only now does the checkpoint exist

A failure anywhere before 4 leaves a directory that restore ignores. Because the servers that did
write have already cleared their dirty state, the next checkpoint after a failed one is a base.

The servers keep the same rule for every coordinator (``engine.ps.delta_lineage``): a delta whose
parent is not the checkpoint a server last saved or loaded is refused, and ``save`` writes a base
instead. So a second coordinator on the same servers (a zombie rank 0 whose save ran while a new one
took over) makes the other's next checkpoint a base, never a delta without the rows the first took.

Restore: the newest base and its deltas in order (``chain_of``), each file's size checked before the
first row is loaded, each file's CRC-32 checked as it is read; with ``fallback`` a damaged checkpoint
makes restore try the previous complete one.

Example::

    >>> mgr = CheckpointManager("s3://bucket/ckpt", "ctr")           # doctest: +SKIP
    >>> mgr.save(client, "base", step=100, sources={"train": {...}})  # -> manifest dict
    >>> mgr.restore(client)                                          # newest complete checkpoint
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import time
from typing import Any, Callable, Protocol

import hdfs_io
from hdfs_io import CheckpointCorruptError, NotPublishedError, Publisher, Storage, StorageOptions
from streaming.keys import HASH_VERSION

from .. import failpoints
from ..errors import DeltaParentError
from .manifest import (DEFAULT_GROUPS, FORMAT_VERSION, CheckpointRef, chain_of, checkpoint_name,
                       list_checkpoints, parse_name, read_checkpoint_manifest)
from .writer import part_report_name

__all__ = ["Cluster", "CheckpointManager", "CheckpointNotFoundError"]

log = logging.getLogger(__name__)

#: retention leaves an incomplete checkpoint directory alone while its newest file is younger than this
#: (seconds): it may be a save still in flight (a slow server), not the leftovers of a crashed one. The age
#: is the store's times compared with each other (the file's modification time against a probe's the
#: store stamps now, ``hdfs_io.Storage.clock_now``), never with the pruning host's clock, which may be
#: minutes from the store's (S3, an HDFS NameNode, an NFS server stamp the times). On a file system whose
#: clients stamp the times (a local disk; CephFS, Lustre), the writer's and the pruner's clocks must agree
#: within this.
INCOMPLETE_GRACE_S = 600.0


class Cluster(Protocol):
    num_servers: int

    def save(self, uri: str) -> int: ...

    def load(self, uri: str, chain_end: str = "") -> int: ...


class CheckpointNotFoundError(NotPublishedError):
    """No complete checkpoint exists where one was asked for."""


def _json_safe(obj):
    """The config snapshot as strict JSON: non-finite floats become their YAML spelling (".inf",
    "-.inf", ".nan"), which ``yaml.safe_load`` reads back as floats."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return ".nan" if obj != obj else (".inf" if obj > 0 else "-.inf")
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _redacted(config: dict) -> dict:
    """The config snapshot without inline storage secrets (``storage.access_key`` / ``secret_key`` become
    empty: a reader falls back to its own environment)."""
    storage = config.get("storage") if isinstance(config, dict) else None
    if not isinstance(storage, dict) or not any(storage.get(k) for k in ("access_key", "secret_key")):
        return config
    return {**config, "storage": {**storage, "access_key": "", "secret_key": ""}}


def written_lately(storage: Storage, name: str, grace_s: float, store_now: list, what: str) -> bool:
    """True when the newest modification under ``name`` is less than ``grace_s`` seconds before the
    store's clock now, or when that cannot be told (a listing error, a failed clock probe: keep it).

    ``store_now`` caches the store's clock for one retention pass: [] until read, then [seconds] (or
    [None] when the probe failed: everything is kept this time). The store's times are compared with each
    other only: the pruning host's clock may be minutes from the store's (``INCOMPLETE_GRACE_S``)."""
    try:
        newest = storage.newest_mtime(name)
    except OSError as exc:
        log.warning("%s: cannot list %s (%s); keeping it", what, storage.uri_of(name), exc)
        return True
    if newest is None:
        return False
    if not store_now:
        try:
            store_now.append(storage.clock_now())
        except OSError as exc:
            log.warning("%s: cannot read the store's clock under %s (%s); keeping every incomplete directory "
                        "this time", what, storage.uri, exc)
            store_now.append(None)
    return store_now[0] is None or store_now[0] - newest < grace_s


def _is_damage(exc: BaseException) -> bool:
    """A restore error that means "this checkpoint is unusable" (as opposed to a dead cluster)."""
    if isinstance(exc, (CheckpointCorruptError, NotPublishedError)):
        return True
    return getattr(exc, "code", None) in ("DATA_LOSS", "NOT_FOUND")


class CheckpointManager:
    """Checkpoints of one job under ``{root}/{job}``.

    Parameters
    ----------
    root : str
        URI of the checkpoint root (local path, ``file://``, ``s3://``, ``hdfs://``).
    job : str
        Job (model) name, one directory below ``root``.
    storage_options : hdfs_io.StorageOptions, optional
        S3 endpoint / credentials (default: the standard AWS environment variables).
    keep_bases : int
        Retention: keep this many newest bases, their deltas, and every checkpoint the chains of
        those reach (see ``prune``).
    groups : int
        Vshard groups per table the servers are expected to cut (the manifest records what their part
        reports say they cut).
    clock : callable -> float, seconds since the epoch
        Names checkpoints when ``save`` is given no ``when``.
    """

    def __init__(self, root: str, job: str, *, storage_options: StorageOptions | None = None,
                 keep_bases: int = 2, groups: int = DEFAULT_GROUPS, retry: hdfs_io.RetryPolicy | None = None,
                 clock: Callable[[], float] = time.time):
        if not job or "/" in job:
            raise ValueError(f"job must be a non-empty name without '/', got {job!r}")
        if keep_bases < 1:
            raise ValueError(f"keep_bases must be >= 1, got {keep_bases}")
        base = Storage.from_uri(root, storage_options=storage_options, retry=retry)
        self.storage = base.sub(job)
        self.job = job
        self.keep_bases = keep_bases
        self.groups = groups
        self.clock = clock
        self.head: str | None = None          # last checkpoint this process saved or restored
        self._force_base = False
        self._parents: dict[str, str | None] = {}   # complete checkpoint -> parent (retention's chains)

    @property
    def uri(self) -> str:
        return self.storage.uri

    def uri_of(self, name: str) -> str:
        return self.storage.uri_of(name)

    # ------------------------------------------------------------------ listing
    def list(self) -> list[CheckpointRef]:
        """Complete checkpoints, oldest first."""
        return list_checkpoints(self.storage)

    def latest(self) -> CheckpointRef | None:
        refs = self.list()
        return refs[-1] if refs else None

    def manifest(self, name: str) -> dict[str, Any]:
        return read_checkpoint_manifest(self.storage, name)

    def _seqs_at(self, day: str, hhmm: str) -> list[int]:
        """Sequence numbers of every directory named ``{day}/{hhmm}-*`` (incomplete ones included: a
        save in flight owns its name until it publishes or fails)."""
        try:
            names = self.storage.listdir(day)
        except FileNotFoundError:
            names = []
        return [r.seq for r in (parse_name(f"{day}/{n}") for n in names) if r is not None and r.hhmm == hhmm]

    def _next_ref(self, when: _dt.datetime, kind: str) -> CheckpointRef:
        ref = checkpoint_name(when, kind)
        seqs = self._seqs_at(ref.day, ref.hhmm)
        ref = CheckpointRef(ref.day, ref.hhmm, max(seqs) + 1 if seqs else 0, kind)
        newest = self.latest()
        if newest is not None and ref <= newest:     # a clock behind the newest name: keep names ordered
            # the minute of the newest complete name, after every name there (a save still in flight at
            # that minute, e.g. a zombie coordinator's, holds a higher seq than the newest complete one)
            seq = max(self._seqs_at(newest.day, newest.hhmm) + [newest.seq]) + 1
            ref = CheckpointRef(newest.day, newest.hhmm, seq, kind)
        return ref

    # ------------------------------------------------------------------ save
    def save(self, cluster: Cluster, kind: str = "delta", *, when: _dt.datetime | float | None = None,
             step: int = 0, sources: dict | None = None, config: dict | None = None,
             extra: dict | None = None) -> dict[str, Any]:
        """Write one checkpoint of every server's tables and publish it.

        Parameters
        ----------
        cluster : Cluster
            Usually the ``PSClient`` (its Save RPC makes every server write its parts).
        kind : {"base", "delta"}
            A delta with no previous checkpoint in this process (or after a failed save), or one the
            servers refuse because their changes are not counted from this process's last checkpoint
            (``engine.errors.DeltaParentError``), is written as a base instead (logged).
        when : datetime or float seconds since the epoch, optional
            Training time that names the checkpoint (default: the clock), UTC.
        step : int
            Training step recorded in the manifest.
        sources : dict, optional
            Input source name -> position (JSON-able), so a restart neither skips nor repeats data.
        config : dict, optional
            Config snapshot (``EngineConfig.to_dict()``; infinities stored as YAML's ``.inf``).
        extra : dict, optional
            More JSON-able metadata (e.g. ``{"consumed": [...partitions...]}``).

        Returns
        -------
        dict
            The published manifest (``manifest["name"]`` is the checkpoint's name).

        Raises
        ------
        CheckpointCorruptError
            A server's part report is missing or malformed (named); nothing is published.
        hdfs_io.StorageError
            The checkpoint's storage failed (down or silent through ``hdfs_io``'s retries, a full or
            read-only disk, access refused): the coordinator's own writes raise
            ``StorageUnavailableError`` naming the file, a server's ``engine.errors.CheckpointStorageError``
            (both are ``StorageError``). Nothing is published and the next save is a base.
        engine.errors.RemoteError
            Server failures; nothing is published.
        """
        try:
            try:
                return self._save(cluster, kind, when, step, sources, config, extra)
            except DeltaParentError as e:
                # another coordinator saved or loaded on these servers since this one's last checkpoint: a
                # delta from here would lack the rows that went into theirs
                log.warning("writing a base instead of a delta: %s", e)
                return self._save(cluster, "base", when, step, sources, config, extra)
        except OSError as e:
            if isinstance(e, (hdfs_io.StorageError, FileExistsError)):   # typed already / another writer's
                raise
            # the coordinator's own writes (manifest.json, _SUCCESS) on a full or read-only disk, access
            # refused: pyarrow's and the OS's errors are plain OSErrors; typed, a role ends on it with one line
            raise hdfs_io.StorageUnavailableError(
                f"checkpoint save under {self.uri} failed, nothing published: {type(e).__name__}: "
                f"{hdfs_io.described(e)}", uri=self.uri) from e

    def _save(self, cluster: Cluster, kind: str, when, step: int, sources: dict | None, config: dict | None,
              extra: dict | None) -> dict[str, Any]:
        if kind not in ("base", "delta"):
            raise ValueError(f"kind must be 'base' or 'delta', got {kind!r}")
        parent = self.head
        if kind == "delta" and (parent is None or self._force_base):
            log.info("writing a base instead of a delta: %s", "no parent checkpoint in this run"
                     if parent is None else "the previous save failed")
            kind = "base"
        if when is None:
            when = self.clock()
        if not isinstance(when, _dt.datetime):
            when = _dt.datetime.fromtimestamp(float(when), tz=_dt.timezone.utc)
        ref = self._next_ref(when, kind)
        uri = self.storage.uri_of(ref.name)
        chain_index, base = 0, ref.name
        if kind == "delta":
            pm = self.manifest(parent)
            chain_index, base = pm["chain_index"] + 1, pm["base"]
        meta = {"checkpoint_format": FORMAT_VERSION, "kind": kind, "name": ref.name, "job": self.job,
                "parent": parent if kind == "delta" else None, "base": base, "chain_index": chain_index,
                "hash_version": HASH_VERSION, "groups": self.groups, "num_servers": cluster.num_servers,
                "step": int(step), "train_time": when.isoformat(), "sources": sources or {},
                "config": _json_safe(_redacted(config or {})), "extra": _json_safe(extra or {})}
        t0 = time.perf_counter()
        self._force_base = True             # until this save is published
        with Publisher(self.storage, ref.name, manifest=meta) as pub:
            cluster.save(uri, self.uri_of(parent) if kind == "delta" else "")
            reports = [self._part_report(ref.name, s) for s in range(cluster.num_servers)]
            tables: dict[str, dict] = {"sparse": {}, "dense": {}}
            for rep in reports:
                pub.entries.update({k: hdfs_io.FileEntry.from_json(v) for k, v in rep["files"].items()})
                for name, n in rep["rows"].items():
                    t = tables["sparse"].setdefault(name, {"rows": 0, "tombstones": 0, **rep["tables"].get(name, {})})
                    t["rows"] += n
                    t["tombstones"] += rep["tombstones"].get(name, 0)
                for name, d in rep["dense"].items():
                    tables["dense"].setdefault(name, d)
            nv = {rep["num_vshards"] for rep in reports}
            if len(nv) != 1:
                raise CheckpointCorruptError(f"{uri}: servers disagree on num_vshards: {sorted(nv)}", uri=uri)
            # readers find a row's file by the manifest's groups: record the cut the servers made
            cut = {rep.get("groups", self.groups) for rep in reports}
            if len(cut) != 1 or not all(isinstance(g, int) and g >= 1 for g in cut):
                raise CheckpointCorruptError(f"{uri}: servers cut their part files into different numbers of "
                                             f"vshard groups: {sorted(cut)}", uri=uri)
            # the servers' --resume URI --resume-id ID: a server replaced later with the same arguments
            # restores the newest checkpoint when it records them, not URI again (engine.roles.run_server)
            marks = {(str(w["id"]), str(w["uri"])) for w in (r.get("resumed_with") for r in reports)
                     if isinstance(w, dict) and w.get("id") and w.get("uri")}
            pub.manifest.update(tables=tables, num_vshards=nv.pop(), groups=cut.pop(),
                                resumed_with=[{"id": i, "uri": u} for i, u in sorted(marks)])
            failpoints.hit("checkpoint.before_publish")
        manifest = pub.written_manifest
        self._parents[ref.name] = parent if kind == "delta" else None    # retention's chains: no re-read
        self.head = ref.name
        self._force_base = False
        seconds = time.perf_counter() - t0
        rows = sum(t["rows"] for t in tables["sparse"].values())
        from ..observability.prometheus import record_checkpoint     # no-op unless metrics are on here
        record_checkpoint("save", kind, seconds,
                          sum(int(f.get("size", 0)) for f in manifest["files"].values()))
        log.info("checkpoint %s published: %s, %d row(s), %d file(s), %.2f s", uri, kind, rows,
                 len(manifest["files"]), seconds)
        if kind == "base":
            try:
                self.prune()
            except OSError as e:    # the checkpoint is published: a failed retention must not fail its save
                log.warning("retention under %s failed after %s was published (the next base's retention tries "
                            "again): %s: %s", self.uri, uri, type(e).__name__, e)
        return manifest

    def _part_report(self, name: str, server: int) -> dict:
        path = hdfs_io.join(name, part_report_name(server))
        uri = self.storage.uri_of(path)
        try:
            rep = json.loads(self.storage.read_bytes(path))
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{uri} is missing: server {server} did not finish its part",
                                         uri=uri) from exc
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"{uri} is not valid JSON: {exc}", uri=uri) from exc
        for key in ("files", "rows", "tombstones", "tables", "dense", "num_vshards"):
            if key not in rep:
                raise CheckpointCorruptError(f"{uri}: missing field {key!r}", uri=uri)
        return rep

    # ------------------------------------------------------------------ restore
    def resolve(self, target: str | None = None) -> str:
        """Checkpoint name of ``target`` (a name, a URI below this job, or None for the newest).

        Raises
        ------
        CheckpointNotFoundError
            No complete checkpoint, or ``target`` is not one.
        """
        if target is None:
            ref = self.latest()
            if ref is None:
                raise CheckpointNotFoundError(f"no complete checkpoint under {self.uri}", uri=self.uri)
            return ref.name
        name = target
        prefix = self.storage.uri.rstrip("/") + "/"
        if target.startswith(prefix):
            name = target[len(prefix):]
        ref = parse_name(name)
        if ref is None:
            raise CheckpointNotFoundError(f"{target!r} is not a checkpoint of {self.uri} (expected "
                                          f"YYYYMMDD/HHMM-base|delta[.N] or a URI below it)", uri=target)
        return ref.name

    def restore(self, cluster: Cluster, target: str | None = None, *, fallback: bool = False,
                floor: str | None = None) -> dict[str, Any]:
        """Load a checkpoint's chain (base, then its deltas in order) onto every server.

        Parameters
        ----------
        cluster : Cluster
        target : str, optional
            Checkpoint name or URI (default: the newest complete one).
        fallback : bool
            On a damaged checkpoint, try the previous complete checkpoint (then the one before, ...).
        floor : str, optional
            A checkpoint name: fall back only to checkpoints named above it (a job's recovery never
            restores one from before the job: ``engine.job_checkpoints.recovery_target``).

        Returns
        -------
        dict
            The manifest of the checkpoint restored (its ``sources``, ``step``, ``extra``).

        Raises
        ------
        CheckpointNotFoundError
            Nothing to restore.
        CheckpointCorruptError
            The checkpoint (or, with fallback, every candidate) is damaged; the message names the file.
        """
        name = self.resolve(target)
        candidates = [name]
        if fallback:
            target_ref, floor_ref = parse_name(name), parse_name(floor) if floor else None
            candidates += [r.name for r in reversed(self.list())
                           if r < target_ref and (floor_ref is None or r > floor_ref)]
        first_error: BaseException | None = None
        for cand in candidates:
            try:
                return self._restore_one(cluster, cand)
            except Exception as exc:  # noqa: BLE001 - only damage falls back, the rest is re-raised
                if not _is_damage(exc):
                    raise
                first_error = first_error or exc
                if not fallback:
                    break
                log.warning("checkpoint %s is damaged (%s); falling back to the previous complete one",
                            self.uri_of(cand), exc)
        if isinstance(first_error, CheckpointCorruptError):
            raise first_error
        msg = str(getattr(first_error, "message", first_error))
        uri = getattr(first_error, "uri", None) or self.uri_of(name)
        raise CheckpointCorruptError(f"restore of {self.uri_of(name)} failed: {msg}", uri=uri) from first_error

    def _restore_one(self, cluster: Cluster, name: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        chain = chain_of(self.storage, name)
        for m in chain:
            if m.get("hash_version") != HASH_VERSION:
                uri = self.uri_of(m["name"])
                raise CheckpointCorruptError(f"{uri}: hash_version {m.get('hash_version')} differs from this "
                                             f"build's {HASH_VERSION}; its keys cannot be used", uri=uri)
            hdfs_io.verify(self.storage, m["name"], checksums=False)     # presence + sizes, before any load
        rows = 0
        end = self.uri_of(chain[-1]["name"]) if len(chain) > 1 else ""
        for m in chain:
            rows += cluster.load(self.uri_of(m["name"]), chain_end=end)
        self.head = name
        self._force_base = False
        log.info("restored %s (base %s + %d delta(s)): %d row(s) loaded in %.2f s", self.uri_of(name),
                 chain[0]["name"], len(chain) - 1, rows, time.perf_counter() - t0)
        from ..observability.prometheus import record_checkpoint
        record_checkpoint("restore", "chain", time.perf_counter() - t0)
        return chain[-1]

    # ------------------------------------------------------------------ retention
    def prune(self) -> list[str]:
        """Delete old checkpoints and the leftovers of crashed saves. Returns the names deleted.

        Complete checkpoints named before the oldest of the ``keep_bases`` newest bases are deleted,
        except those the chain of a kept checkpoint (or of this process's ``head``) reaches: after a
        roll-back (a job resumed from an older delta), a kept delta's parents can be older than every
        kept base, and deleting them would leave it listed complete but unrestorable. The chains are
        read from the kept deltas' manifests, cached by name (a complete checkpoint never changes), so
        repeated prunes read only the new ones.

        Incomplete directories named before the newest complete checkpoint are deleted too, unless their
        newest file is younger than ``INCOMPLETE_GRACE_S`` (the storage's modification times): that may
        be a save still in flight (a slow server, a coordinator held before publish) rather than a crashed
        one's leftovers; a later prune deletes it once it is old. ``_SUCCESS`` goes first, so a reader
        never sees half of a deleted checkpoint.
        """
        complete = self.list()
        bases = [r for r in complete if r.kind == "base"]
        deleted = []
        if len(bases) > self.keep_bases:
            oldest_kept = bases[-self.keep_bases]
            roots = [r.name for r in complete if r >= oldest_kept and r.kind == "delta"]
            if self.head is not None:
                roots.append(self.head)
            reached = self._reached(roots)
            for r in complete:
                if r < oldest_kept and reached is not None and r.name not in reached:
                    self.storage.delete(hdfs_io.join(r.name, hdfs_io.SUCCESS_NAME), missing_ok=True)
                    self.storage.delete(r.name, missing_ok=True)
                    self._parents.pop(r.name, None)
                    deleted.append(r.name)
        if complete:
            newest = complete[-1]
            done = {r.name for r in complete}
            store_now: list[float | None] = []      # the store's clock, read once and only when needed
            for r in list_checkpoints(self.storage, complete_only=False):
                if r < newest and r.name not in done:
                    if self._written_lately(r.name, store_now):
                        log.info("retention: keeping incomplete %s, written to less than %.0f s ago (a save in "
                                 "flight?)", self.uri_of(r.name), INCOMPLETE_GRACE_S)
                        continue
                    self.storage.delete(r.name, missing_ok=True)
                    deleted.append(r.name)
        for day in self._days():
            try:
                if not self.storage.listdir(day):
                    self.storage.delete(day, missing_ok=True)
            except FileNotFoundError:
                pass
        if deleted:
            log.info("retention (keep %d bases): deleted %s", self.keep_bases, ", ".join(deleted))
        return deleted

    def _parent_of(self, name: str) -> str | None:
        """The parent of complete checkpoint ``name`` (None for a base), from its manifest, cached."""
        ref = parse_name(name)
        if ref is not None and ref.kind == "base":
            return None
        if name not in self._parents:
            m = self.manifest(name)
            self._parents[name] = m["parent"] if m["kind"] == "delta" else None
        return self._parents[name]

    def _reached(self, roots: list[str]) -> set[str] | None:
        """Names on the chains of ``roots`` (roots included). A damaged or missing link ends its chain
        (nothing beyond is restorable through it); None when a manifest could not be read for another
        reason (a storage error: retention then deletes no complete checkpoint this time)."""
        out: set[str] = set()
        for name in roots:
            cur: str | None = name
            while cur is not None and cur not in out:
                out.add(cur)
                try:
                    cur = self._parent_of(cur)
                except Exception as exc:  # noqa: BLE001 - damage ends a chain, anything else stops retention
                    if not _is_damage(exc):
                        log.warning("retention: cannot read the chain of %s (%s); deleting no complete "
                                    "checkpoint this time", self.uri_of(name), exc)
                        return None
                    cur = None
        return out

    def _written_lately(self, name: str, store_now: list) -> bool:
        """True when the newest file (or the directory itself) under ``name`` was modified less than
        ``INCOMPLETE_GRACE_S`` before the store's clock now (``store_now``: [] until read, then [seconds]
        or [None] when the probe failed), or when that cannot be told (a listing or probe error)."""
        return written_lately(self.storage, name, INCOMPLETE_GRACE_S, store_now, "retention")

    def _days(self) -> list[str]:
        try:
            return [d for d in self.storage.listdir("") if d.isdigit() and len(d) == 8]
        except FileNotFoundError:
            return []
