"""``ctr_online``: streaming online learning of a CTR model (``network: ctr_dnn | deepfm``) on hourly
partitions, with a checkpoint after every partition.

For each new complete partition ``{partitions}/{YYYYMMDD}/{HH}/`` (``streaming.hourly``), in time order,
waiting ``poll_interval_s`` between listings when none is ready, chosen by rank 0 alone and trained by
every worker (``engine.programs.online_next``: workers listing on their own could disagree on an hour
published between their listings)::

    1. progressive validation   every worker scores its share of the hour with the CURRENT model (pull
                                without creating rows); the merged AUC / logloss is the model's quality
                                on data it has not seen yet
    2. train                    each worker trains on its share (record batches w::W of the hour)
    3. checkpoint (rank 0)      after every worker's updates reached the servers: a delta recording the
                                partition as consumed (manifest ``sources.train.partition`` and
                                ``extra.consumed``); once per ``checkpoint.base_every`` of data time
                                the expiry pass (shrink) runs first and a base is written instead
    4. metrics event (rank 0)   the hour's ``partition`` event, written once its checkpoint is published
    5. export (rank 0)          with ``model.export_root``: the serving bundle of that checkpoint; then
                                the ``export_keep_full`` newest full bundles are kept with the bundles
                                after them, older ones deleted (``engine.export.retention``)

Workers wait at a barrier until the checkpoint is published, so no update of the next hour leaks into
it. A preemption request (SIGTERM) while the job waits for the next hour stops every worker at once
with exit 75 (``EXIT_PREEMPTED``) at the last partition's checkpoint. Killed at any moment and restarted with ``engine train CONFIG --resume``, the job restores the newest
complete checkpoint and continues with the first partition it does not record as consumed: a partition
half-trained when the job died is trained again from the checkpoint taken before it, so every partition
is consumed exactly once in the checkpointed model. With ``server.expiry_clock: data`` rank 0 moves the
servers' data clock to the end of each hour before any worker trains it (``engine.ps.data_clock``), so
rows' ``last_seen`` and the expiry pass count hours of data, not time since the push. The job runs forever, or until ``model.until``
(``--until YYYYMMDDHH``) or ``model.max_partitions`` partitions consumed by this ``engine train`` run:
counted over all its attempts (a restarted cluster continues the count and the list of the checkpoint
it restored, ``extra.run``: ranges of hours, ``engine.programs.online_runs``), while a new ``engine train --resume`` starts a new count. Under ``engine
k8s`` the run is the worker Job (``ENGINE_RUN_ID``, its uid); ``--role worker`` processes started any
other way count each attempt on its own. Rank 0 applies the count (``online_next``).

Faults of the serving export do not stop training: an export that fails (storage error,
``ExportError``, ``BundleError``) is logged as a WARNING naming the partition and the error, written as
an ``export_failed`` event, counted (``exports_failed`` in the final line), and the next partition's
export tries again, as a delta against the last bundle that WAS published (or a full bundle when none
was), so no published delta refers to a bundle that does not exist.

Metrics file events: ``{"event": "partition", "partition": "20240101/05", "rows", "progressive_auc",
"progressive_logloss", "train_logloss", "checkpoint"}`` (one per consumed hour; the metrics are
``null`` for an hour without rows, or ``train_logloss`` for one where rank 0's share was empty, with a
WARNING naming the hour) and ``{"event": "export_failed", "partition", "bundle", "error",
"exports_failed"}``.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import time
import uuid

import hdfs_io
from streaming.hourly import HourlySource, partition_time

from .. import failpoints, observability, preempt, progress
from ..checkpoint import CheckpointManager, Schedule, chain_of
from ..export import BundleError, CheckpointSource, export_bundle, open_bundle
from ..export.errors import ExportError
from ..export.retention import prune_bundles
from ..job_checkpoints import job_name
from ..config import ModelConfig
from ..errors import ConfigError
from ..metrics import BinaryMetrics
from ..program_configs import CTROnlineConfig as Config
from . import ctr, online_runs
from .ctr_data import check_values, expected_schema
from .ctr_report import EVAL_BUCKETS, MetricsFile, merge_global, now_stamp, reset_metrics
from .online_next import NextPartition

log = logging.getLogger(__name__)

#: the launcher does not add a final checkpoint: every partition already ends with one
WRITES_CHECKPOINTS = True


#: an online job may wait for its next hourly partition as long as it takes (its heartbeat still shows
#: that the process is alive; engine.progress)
WAIT_FOR_PARTITION_S = 10 * 365 * 86400.0
#: longest checkpoint (with its serving export) of one partition by rank 0
CHECKPOINT_DEADLINE_S = 3600.0


def _until(p: Config) -> _dt.datetime | None:
    if not p.until:
        return None
    for fmt in ("%Y%m%d%H", "%Y%m%d/%H", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H"):
        try:
            return _dt.datetime.strptime(p.until, fmt).replace(tzinfo=_dt.timezone.utc)
        except ValueError:
            continue
    raise ConfigError(f"model.until must be an hour like 2024010105 (YYYYMMDDHH), got {p.until!r}")


def _as_network(cfg):
    """The config with ``model.kind`` = the network, as the CTR trainer expects."""
    return dataclasses.replace(cfg, model=ModelConfig(cfg.model.params.network, cfg.model.params))


def prepare(cfg):
    """Launcher hook: check tables, stream root, mode and checkpoint root; pick the metrics file.

    Raises
    ------
    ConfigError
        Missing ``model.partitions`` or ``checkpoint.root``, sync mode, bad ``model.until``, or a table
        that does not fit the network.
    """
    p: Config = cfg.model.params
    ctr._check_tables(_as_network(cfg), p)
    expected_schema(p.slots, p.dense_dim)
    _until(p)
    if not p.partitions:
        raise ConfigError("model.partitions must name the hourly partition root (local path or s3://...)")
    if not cfg.checkpoint.enabled:
        raise ConfigError("checkpoint.root must be set for ctr_online: each partition ends with a checkpoint")
    if cfg.mode == "sync":
        raise ConfigError("mode must be async or geo for ctr_online (workers' shares of an hour differ in size)")
    metrics_file = p.metrics_file or str(
        os.path.abspath(p.metrics_dir) + f"/ctr_online-{cfg.mode}-{now_stamp()}-{os.getpid()}.jsonl")
    # names this ``engine train`` run: its restarted attempts continue its partition count (max_partitions)
    p = dataclasses.replace(p, metrics_file=metrics_file, run_id=f"{now_stamp()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    MetricsFile(metrics_file).write({"event": "start", "model": "ctr_online", "network": p.network,
                                     "mode": cfg.mode, "partitions": p.partitions, "time": time.time()})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, params=p))


def final(cfg, results: list[dict]) -> dict:
    """Launcher hook: the last stdout line. ``partitions``: the run's partitions as ranges of consecutive
    hours (``online_runs.compact``: ``"20240101/00..20241230/23"``), ``partitions_count`` how many they
    stand for; listed one name each, a run of a year made a 130 KB line."""
    r0 = next((r for r in results if r.get("rank") == 0), {})
    names = r0.get("partitions", [])
    event = {"event": "final", "model": "ctr_online", "network": cfg.model.params.network, "mode": cfg.mode,
             "partitions": online_runs.compact(names), "partitions_count": len(names),
             "last_partition": r0.get("last_partition"),
             "progressive_auc": r0.get("progressive_auc"), "metrics_file": cfg.model.params.metrics_file,
             "checkpoint": r0.get("checkpoint")}
    if cfg.model.params.export_root:
        event["exports_failed"] = r0.get("exports_failed", 0)
    # the per-hour curves come from the workers' partition events (online/*); this adds final/*
    event["tensorboard_dir"] = observability.record_final(cfg, cfg.model.params.metrics_file, event)
    return event


def online_schedule(ck, start_s: float, start_step: int) -> Schedule:
    """The online job's checkpoint ``Schedule``: checked at the end of each partition, with the job's
    steps (batches of each worker since the job began, the manifest's ``step``) and the partition's
    end, so ``base_every: 5000steps`` falls due at the first partition end at or after 5000 steps
    past the base. ``start_s`` (seconds) and ``start_step``: those of the chain's base (or the start)."""
    return Schedule(ck, start_s=start_s, start_step=start_step, partitions=True)


class OnlineTrainer(ctr.CTRTrainer):
    """The online loop of one worker rank (see the module docstring)."""

    def __init__(self, ctx):
        self.full_config = ctx.config
        super().__init__(dataclasses.replace(ctx, config=_as_network(ctx.config)))
        self.p: Config = ctx.config.model.params
        if not self.p.run_id and os.environ.get("ENGINE_RUN_ID"):     # a Kubernetes worker Job's uid (engine k8s)
            self.p = dataclasses.replace(self.p, run_id=os.environ["ENGINE_RUN_ID"])
        self.ck = ctx.config.checkpoint
        self.mgr: CheckpointManager | None = None
        self.last: str | None = None
        self.consumed: list[str] = []          # partitions trained since the last checkpoint
        self.last_export: str | None = None    # the last serving bundle published (delta base)
        self.done: list[str] = []              # partitions this run consumed (every attempt: extra.run)
        self.exports_failed = 0                # exports of this run that failed (carried by extra.run)
        self._written: tuple[str, str, str] | None = None    # rank 0: (uri, name, kind) of the last checkpoint
        resumed = None
        if self.ck.restored:
            mgr = CheckpointManager(self.ck.root, job_name(ctx.config), keep_bases=self.ck.keep_bases,
                                    storage_options=ctx.config.storage.options())
            name = mgr.resolve(self.ck.restored)
            resumed = mgr.manifest(name)
            self.last = (resumed.get("sources", {}).get("train") or {}).get("partition")
            self.steps = int(resumed.get("step", 0))
            progress.current().base(self.steps)               # engine status: the job's step
            run = (resumed.get("extra") or {}).get("run") or {}
            if self.p.run_id and run.get("id") == self.p.run_id:     # a restarted attempt of this run
                try:        # ranges of hours (online_runs), or one name each (checkpoints written before)
                    self.done = online_runs.expand(run.get("partitions", []), run.get("partitions_count"))
                except ValueError as e:
                    uri = f"{mgr.uri_of(name)}/manifest.json"
                    raise hdfs_io.CheckpointCorruptError(f"{uri}: extra.run.partitions: {e}", uri=uri) from None
                self.exports_failed = int(run.get("exports_failed", 0))
        if self.rank == 0:
            self.mgr = CheckpointManager(self.ck.root, job_name(ctx.config), keep_bases=self.ck.keep_bases,
                                    storage_options=ctx.config.storage.options())
            if resumed is not None:
                self.mgr.head = resumed["name"]
                if self.p.export_root:
                    self.last_export = self._previous_export(resumed["name"])
        start, base_step = 0.0, 0
        if resumed is not None:
            base = resumed["base"]
            base_manifest = resumed if base == name else mgr.manifest(base)
            start = self._base_time(base, base_manifest)
            base_step = int(base_manifest.get("step", 0))
        # the clocks of base_every / delta_every run from the chain's base: its time and its step
        self.schedule = online_schedule(self.ck, start, base_step)
        self.started = resumed is not None

    def _previous_export(self, resumed: str) -> str | None:
        """The newest serving bundle published for a checkpoint of the resumed chain, so a restarted job
        continues the export chain with a delta against it instead of a new full bundle. A delta that
        spans a bundle a killed export never published is still exact: ``export_bundle`` compares the
        checkpoint's rows with the chain of the bundle it is given."""
        opts = self.full_config.storage.options()
        for m in reversed(chain_of(self.mgr.storage, resumed)):
            out = f"{self.p.export_root.rstrip('/')}/{m['name']}"
            try:
                open_bundle(out, storage_options=opts)
            except (OSError, BundleError):       # NotPublishedError, CheckpointCorruptError, storage errors
                continue
            return out
        return None

    @staticmethod
    def _base_time(name: str, manifest: dict | None = None) -> float:
        """Data time (seconds since the epoch, UTC) of base ``name``: its manifest's ``train_time``, else
        the time its name says. The name can be later than the data: a job resumed from an older
        checkpoint beside newer ones names its checkpoints after the newest (names only grow), so the
        base written at 2024-01-01 10:00 of data may be named ``20240103/0900-base.1``, and a restart
        measured ``base_every`` from 2024-01-03 (no base for two more days of data)."""
        when = (manifest or {}).get("train_time")
        if isinstance(when, str):
            try:
                t = _dt.datetime.fromisoformat(when)
                return (t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)).timestamp()
            except ValueError:
                pass
        day, rest = name.split("/")
        return _dt.datetime.strptime(day + rest[:4], "%Y%m%d%H%M").replace(tzinfo=_dt.timezone.utc).timestamp()

    def progressive(self, part) -> dict | None:
        """Global AUC / logloss of the current model on this hour (before training on it)."""
        local = BinaryMetrics(EVAL_BUCKETS)
        self.model.set_dense(self.client.pull_dense(self.p.dense_table))
        for _, _, rb in part.record_batches(shard=(self.rank, self.num_workers), schema=self.schema,
                                              check=check_values):
            batch = self.read(rb)
            uniq, rows, segments, _, _ = self.dedup(batch)
            emb = self.client.pull(self.p.sparse_table, uniq)
            local.update(self.model.predict(emb, rows, segments, batch.dense), batch.labels)
        return merge_global(self.client, self.mode, self.p.metrics_table, local, f"pv-{part.name}")

    def train_partition(self, part) -> tuple[int, float | None]:
        """Train on this worker's share of ``part``; (rows, mean batch logloss or None without a batch)."""
        rows, loss, steps = 0, 0.0, 0
        progress.current().where(partition=part.name)     # engine status: the hour being trained
        with self.training_clock():     # engine_worker_train_seconds_total moves while it trains
            for _, _, rb in part.record_batches(shard=(self.rank, self.num_workers), schema=self.schema,
                                                  check=check_values):
                batch = self.read(rb)
                res = self.train_step(batch)
                rows += batch.size
                loss += res.loss
                steps += 1
        self.steps += steps
        self.examples += rows
        return rows, (loss / steps if steps else None)

    def checkpoint(self, part) -> str | None:
        """Rank 0: shrink + base when one is due, else a delta recording the partition as consumed (and
        this run's partitions so far, ``extra.run``); returns its URI (None on other ranks). The serving
        export is not part of it (``export``)."""
        if self.mgr is None:
            return None
        now = part.end.timestamp()
        if not self.started:                      # the first checkpoint of a fresh job is its base
            self.schedule = online_schedule(self.ck, now, self.steps)
            kind = "base"
        else:
            kind = self.schedule.due(now, partition_done=True, step=self.steps) or "delta"
        if kind == "base" and self.started:
            deleted = self.client.shrink()
            log.info("expiry pass before the base of %s: %d row(s) deleted", part.name, deleted)
        pos = {"partition": part.name, "file_index": len(part.files), "batch_index": 0, "row": 0}
        names = self.done + [part.name]         # as ranges of hours: a manifest's size stays flat (online_runs)
        run = {"id": self.p.run_id, "partitions": online_runs.compact(names), "partitions_count": len(names),
               "exports_failed": self.exports_failed}
        m = self.mgr.save(self.client, kind, when=part.end, step=self.steps, sources={"train": pos},
                          config=self.full_config.to_dict(), extra={"consumed": list(self.consumed), "run": run})
        self.schedule.done(m["kind"], now, step=self.steps)
        self.started = True
        uri = self.mgr.uri_of(m["name"])
        progress.current().mark(f"partition:{part.name}")    # committed: a restart resumes after it
        self._written = (uri, m["name"], m["kind"])
        return uri

    def export(self, part, ckpt_uri: str, name: str, kind: str) -> bool:
        """Rank 0: a serving bundle of the checkpoint just written, under ``model.export_root`` with the
        checkpoint's name: a full bundle after a base (or when no export was published yet), else a delta
        against the last PUBLISHED export, so serving applies hourly patches (``Bundle.apply_delta``).

        Returns False when the export failed (a storage error, ``ExportError`` or ``BundleError``): the
        failure is logged as a WARNING naming ``part`` and the error, written as an ``export_failed``
        metrics event and counted in ``exports_failed``; training goes on and the next checkpoint's
        export tries again. Other exceptions (bugs) propagate."""
        p, opts = self.p, self.full_config.storage.options()
        out = f"{p.export_root.rstrip('/')}/{name}"
        since = self.last_export if kind != "base" else None
        try:
            failpoints.hit("export.before_publish")
            meta = export_bundle(CheckpointSource(ckpt_uri, storage_options=opts), out, dtype=p.export_dtype,
                                 min_show=p.export_min_show if since is None else None, since=since,
                                 storage_options=opts, overwrite=True)
        except (OSError, ExportError, BundleError) as e:     # OSError: hdfs_io.StorageError and the like
            self.exports_failed += 1
            log.warning("partition %s: serving export %s failed, training continues (the next partition's "
                        "export retries against %s; %d export(s) failed in this run): %s: %s", part.name, out,
                        self.last_export or "nothing: a full bundle", self.exports_failed, type(e).__name__, e)
            self.metrics.write({"event": "export_failed", "partition": part.name, "bundle": out,
                                "error": f"{type(e).__name__}: {e}", "exports_failed": self.exports_failed,
                                "time": time.time()})
            return False
        self.last_export = out
        log.info("exported %s bundle %s: %d row(s), %d deleted", meta["bundle"], out, meta["embedding"]["rows"],
                 meta["embedding"]["deleted"])
        if p.export_keep_full:
            try:
                prune_bundles(p.export_root, p.export_keep_full, current=name, storage_options=opts)
            except OSError as e:        # the next export's retention tries again
                log.warning("bundle retention under %s failed (the next export retries): %s: %s", p.export_root,
                            type(e).__name__, e)
        return True

    def partition_event(self, part, pv: dict, train_loss: float | None, ckpt: str | None) -> float | None:
        """Rank 0: the hour's ``partition`` metrics event; returns its progressive AUC. An hour without
        rows has no metrics: ``null`` (not 0.0) and a WARNING naming it."""
        n = int(pv["count"])
        auc, logloss = (pv["auc"], pv["logloss"]) if n else (None, None)
        if not n:
            train_loss = None
            log.warning("partition %s has no rows: no progressive validation or training metrics (null)",
                        part.name)
        self.metrics.write({"event": "partition", "partition": part.name, "rows": n, "progressive_auc": auc,
                            "progressive_logloss": logloss, "train_logloss": train_loss, "step": self.steps,
                            "checkpoint": ckpt, "time": time.time()})
        if n:
            log.info("partition %s: progressive AUC %.4f logloss %.4f (%d rows); checkpoint %s",
                     part.name, auc, logloss, n, ckpt)
        return auc

    def run(self) -> dict:
        p = self.p
        if self.ctx.config.cluster.warm_up:      # the first hour's steps start compiled
            log.info("worker %d: kernels ready in %.1f s", self.rank, self.warm_up())
        self.mode.init_dense(p.dense_table, self.model.get_dense())
        reset_metrics(self.client, self.mode, p.metrics_table)
        src = HourlySource(p.partitions, poll_interval_s=p.poll_interval_s,
                           storage_options=self.full_config.storage.options(),
                           wait_for_missing_s=p.wait_for_missing_s)
        done, last_uri, auc = self.done, None, None
        log.info("worker %d: online from after %s", self.rank, self.last or "the first partition")
        report = progress.current()
        report.mark(f"partition:{self.last}")        # examples trained after the resumed partition: 0
        # rank 0 chooses each partition (and applies max_partitions, counted over this run's attempts);
        # every other worker trains the one it chose
        # with the data clock, rank 0 moves it to the hour's end before any worker learns the hour
        advance = ((lambda part: self.client.advance_clock(part.end.timestamp()))
                   if self.full_config.server.expiry_clock == "data" else None)
        parts = NextPartition(self.client, src, rank=self.rank, num_workers=self.num_workers, until=_until(p),
                              max_partitions=p.max_partitions, on_chosen=advance)
        after = self.last
        while True:
            with report.phase("waiting for the next partition", WAIT_FOR_PARTITION_S):
                part = parts.next(after, done)
            if parts.preempted:
                raise preempt.Preempted(f"preempted while waiting for the partition after {after or 'the first'} "
                                        f"(checkpoint {last_uri or self.ck.restored or 'none: nothing trained'})")
            if part is None:
                break
            after = part.name
            with report.phase(f"progressive validation of {part.name}", self.mode.barrier_timeout_s):
                pv = self.progressive(part)
            rows, train_loss = self.train_partition(part)
            self._drain()
            preempt.announce(self.client)
            self.mode.barrier(f"trained-{part.name}")
            self.consumed.append(part.name)
            with report.phase(f"checkpoint of {part.name}", CHECKPOINT_DEADLINE_S):
                last_uri = self.checkpoint(part)
                if self.rank == 0:
                    # the event once the hour is committed (a restart does not train it again) and
                    # before the export, whose failure must not lose it
                    auc = self.partition_event(part, pv, train_loss, last_uri)
                    if p.export_root:
                        self.export(part, *self._written)
                    if preempt.decide(self.client):
                        preempt.publish(self.client, part.name)
            report.mark(f"partition:{part.name}")
            self.consumed = []
            # the others wait for rank 0's checkpoint and export as long as its phase may last, past the
            # servers' cap on one barrier (barrier_timeout_s would end them first, and the attempt, while
            # a slow save still writes)
            with report.phase(f"barrier checkpointed-{part.name}", CHECKPOINT_DEADLINE_S):
                self.mode.barrier_until(f"checkpointed-{part.name}", CHECKPOINT_DEADLINE_S)
            if self.rank == 0:
                parts.retire()      # every worker read the decision of this hour before the barrier
            done.append(part.name)
            if preempt.decided(self.client, part.name):
                raise preempt.Preempted(f"preempted after partition {part.name} (checkpoint {last_uri or 'by rank 0'})")
        self.mode.finish()
        out = {"rank": self.rank, "partitions": done, "last_partition": done[-1] if done else self.last,
               "steps": self.steps, "examples": self.examples}
        if self.rank == 0:
            out.update(checkpoint=last_uri, progressive_auc=auc, exports_failed=self.exports_failed)
        return out


def run(ctx) -> dict:
    """Worker entry point (``engine.programs`` contract)."""
    return OnlineTrainer(ctx).run()


__all__ = ["Config", "prepare", "final", "run", "OnlineTrainer", "partition_time"]
