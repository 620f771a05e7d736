"""Checkpoints of offline CTR jobs with exact data positions: a restart neither skips nor repeats data.

A worker's data position is ``(epoch, batch)``: the number of record batches of its shard of the train
split it has trained in ``epoch``. Its shard is read in a deterministic order (an equal share of the rows
of the files, by rank, shuffled with a seed of ``model.seed``, the rank and the epoch; see ``ctr_data``), so the
position names the next batch exactly; with ``model.shuffle_buffer: 0`` it is the file and record-batch
offset.

Under async training a snapshot taken while pushes are in flight cannot say which batches it holds, so
the workers meet at step-aligned points instead of the launcher saving on its own clock (Paddle's
parameter server likewise saves between passes)::

    every checkpoint.align_steps steps of an epoch (while every worker still has data) and at the end
    of every epoch:
        every worker: finish the in-flight step, flush its pushes (async) / send its deltas (GEO)
        barrier ckpt-{epoch}-{batch}                      all updates of batches < batch are applied
        rank 0: a delta or base if the schedule says one is due (checkpoint.delta_every / base_every:
                wall clock, or steps such as 500steps counted by ``trainer.steps``), with
                sources.train = {epoch, batch, workers, batch_size, ...}
        barrier ckpt-{epoch}-{batch}-done

Every worker is at the same ``batch`` at an aligned point (the points stop at the smallest shard's
batch count), so one position serves all. ``engine train --resume`` restores the model and each worker
skips the first ``batch`` batches of epoch ``epoch`` of its shard. Resuming with another number of
workers, batch size, shuffle buffer, seed or train split cannot map the position: the worker logs a
warning and restarts that epoch from its first batch. A finished job records ``(epochs, 0)``.

The CTR trainer also records the train files it reads (``sources.train.files``:
``ctr_data.files_fingerprint``, names, sizes, a CRC of both ends and one of blocks sampled between
them). A position inside an epoch maps
only onto the same files: a file added, removed or rewritten since would make the skipped batches other
rows (some never trained, others trained twice), so such a resume is refused (``ConfigError``, exit 2,
naming what changed; as Word2Vec refuses a changed corpus). At an epoch's start nothing of the epoch was
read and the files are read as they are now. A checkpoint written before the files were recorded is
accepted with a warning.

A step schedule (``delta_every: 500steps``) is checked only at these points, so a checkpoint falls due at
the first aligned point at or after the period (``align_steps`` should divide it; with ``align_steps: 0``
only epoch ends). Its count runs from the start, or from the restored checkpoint's ``step``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .. import job_checkpoints as ckpt_job
from .. import preempt, progress
from ..checkpoint.schedule import Schedule
from ..errors import ConfigError

log = logging.getLogger(__name__)

SAVE_TIMEOUT_S = 3600.0   # the other workers wait this long for rank 0's save


def describe_file_changes(was: list, now: list, most: int = 5) -> list[str]:
    """What differs between two ``ctr_data.files_fingerprint`` lists (``[[name, size, crc, inner], ...]``,
    read in name order), one phrase per file (at most ``most``, then how many more); [] when they are
    equal. An entry without ``inner`` (recorded before it was) is compared by name, size and ``crc``."""
    old = {str(e[0]): (int(e[1]), str(e[2]), str(e[3]) if len(e) > 3 else None) for e in was}
    new = {str(e[0]): (int(e[1]), str(e[2]), str(e[3]) if len(e) > 3 else None) for e in now}
    out = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a is None:
            out.append(f"{name} added ({b[0]} bytes)")
        elif b is None:
            out.append(f"{name} removed")
        elif a[0] != b[0]:
            out.append(f"{name} was {a[0]} bytes, now {b[0]}")
        elif a[1] != b[1]:
            out.append(f"{name} rewritten (same size, CRC-32 of its ends was {a[1]}, now {b[1]})")
        elif a[2] is not None and b[2] is not None and a[2] != b[2]:
            out.append(f"{name} rewritten inside (same size and ends, CRC-32 of the blocks sampled between "
                       f"them was {a[2]}, now {b[2]})")
    return out[:most] + ([f"and {len(out) - most} more"] if len(out) > most else [])


def _epoch_start_checkpoint(mgr, name: str, most: int = 256) -> tuple[str, int] | None:
    """(URI, epoch) of the newest checkpoint of ``name``'s chain (``name``, its parent delta, ... its base:
    this job's lineage, never another run's checkpoint under the same root; at most ``most`` looked at)
    whose data position is an epoch's start (``sources.train.batch`` 0), or None."""
    try:
        for _ in range(most):
            m = mgr.manifest(name)
            train = (m.get("sources") or {}).get("train") or {}
            if "epoch" in train and int(train.get("batch", -1)) == 0:
                return mgr.uri_of(name), int(train["epoch"])
            if m.get("kind") != "delta" or not m.get("parent"):
                return None
            name = m["parent"]
    except Exception:   # noqa: BLE001 - only a hint for an error about to be raised
        log.debug("could not read the chain of checkpoint %s", name, exc_info=True)
    return None


@dataclass(frozen=True)
class Position:
    """``epoch``, and ``batch``: batches of that epoch already trained (the next one to read)."""

    epoch: int = 0
    batch: int = 0


class AlignedCheckpoints:
    """Rank 0 writes the job's checkpoints at aligned points; every rank takes part in the meetings.

    Parameters
    ----------
    trainer : engine.programs.ctr.CTRTrainer, or any object with the same attributes
        Its ``ctx`` (config), ``rank``, ``num_workers``, ``client``, ``mode``, ``steps`` (global step
        count) and ``_drain()`` (make every update of this worker visible on the servers).
    identity : dict, optional
        What the data position depends on (recorded in ``sources.train``; a resume that finds it changed
        restarts the epoch). Default: the CTR trainer's workers, batch size, shuffle buffer, seed, train
        path and how the rows are split (``shard_by``).
    files : list, optional
        The train files read (``ctr_data.files_fingerprint``), recorded in ``sources.train.files``; a
        resume inside an epoch onto other files is refused (module docstring). None: not recorded.
    """

    def __init__(self, trainer, identity: dict | None = None, files: list | None = None):
        self.t = trainer
        self._given_identity = identity
        self.files = files
        self.ck = trainer.ctx.config.checkpoint
        self.enabled = self.ck.enabled
        self.mgr = ckpt_job.job_manager(trainer.ctx.config) if self.enabled and trainer.rank == 0 else None
        self.schedule = Schedule(self.ck, start_s=time.monotonic(), start_step=0)   # periods: monotonic
        self.last_uri: str | None = None
        if self.mgr is not None:
            self._check_alignment()

    def _check_alignment(self) -> None:
        """Log where a step period cannot be met exactly (it is checked at aligned points only)."""
        a = self.ck.align_steps
        for key, every in (("delta_every", self.schedule.delta), ("base_every", self.schedule.base)):
            if every.unit != "steps" or every.amount <= 0:
                continue
            n = int(every.amount)
            if a <= 0:
                log.warning("checkpoint.%s=%dsteps with checkpoint.align_steps=0: checkpoints are written at "
                            "epoch ends only; set align_steps (a divisor of %d) to checkpoint within an epoch",
                            key, n, n)
            elif n % a:
                log.warning("checkpoint.%s=%dsteps is not a multiple of checkpoint.align_steps=%d: a checkpoint "
                            "is written at the first aligned point at or after every %d steps (every %d steps "
                            "within an epoch)",
                            key, n, a, n, -(-n // a) * a)

    # -------------------------------------------------------------------------------- positions
    def _identity(self) -> dict:
        if self._given_identity is not None:
            return dict(self._given_identity)
        p, t = self.t.cfg, self.t
        # shard_by: how the train rows are split among the workers (ctr_data.make_source); a checkpoint of
        # before the balanced split of the rows records none, and its position inside an epoch, taken on
        # other shards, is not mapped
        return {"workers": t.num_workers, "batch_size": p.batch_size, "shuffle_buffer": p.shuffle_buffer,
                "seed": p.seed, "train_path": p.data.train_path, "shard_by": "rows"}

    def sources(self, pos: Position) -> dict:
        """The manifest's ``sources``."""
        train = {"epoch": pos.epoch, "batch": pos.batch, **self._identity()}
        if self.files is not None:
            train["files"] = self.files
        return {"train": train}

    def restored(self) -> tuple[Position, int]:
        """(position, step) of the checkpoint ``--resume`` restored; ``(Position(), 0)`` without one.

        The schedule's step count restarts from that step.
        """
        pos, step = self._restored()
        self.schedule = Schedule(self.ck, start_s=time.monotonic(), start_step=step)
        progress.current().mark(f"{pos.epoch}:{pos.batch}")     # nothing trained after it yet
        progress.current().base(step)                            # engine status: the job's step
        return pos, step

    def _restored(self) -> tuple[Position, int]:
        uri = self.ck.restored
        if not uri:
            return Position(), 0
        mgr, target = ckpt_job.manager_for(self.t.ctx.config, uri)
        manifest = mgr.manifest(mgr.resolve(target))
        step = int(manifest.get("step", 0))
        train = (manifest.get("sources") or {}).get("train") or {}
        if "epoch" not in train or "batch" not in train:
            log.warning("worker %d: checkpoint %s records no data position; training restarts from the "
                        "first batch of epoch 0", self.t.rank, uri)
            return Position(), step
        pos = Position(int(train["epoch"]), int(train["batch"]))
        changed = {k: (train.get(k), v) for k, v in self._identity().items() if train.get(k) != v}
        if ("train_path" in changed and self.files is not None and isinstance(train.get("files"), list)
                and not describe_file_changes(train["files"], self.files)):
            # the inputs moved (a local directory copied to s3://, a new mount point): the same files by
            # name, size and content hold the same rows in the same order, so the position maps
            if self.t.rank == 0:
                log.info("model.data.train_path is %s, was %s when checkpoint %s was taken: the same files "
                         "(names, sizes, CRCs), so its position holds", *changed.pop("train_path")[::-1], uri)
            else:
                changed.pop("train_path")
        if changed and pos.batch:
            log.warning("worker %d: resumed at epoch %d batch %d of checkpoint %s, but %s changed (was, now); "
                        "the position cannot be mapped: epoch %d restarts from its first batch", self.t.rank,
                        pos.epoch, pos.batch, uri, changed, pos.epoch)
            pos = Position(pos.epoch, 0)
        if self.files is not None:
            self._check_files(train.get("files"), pos, uri, (mgr, manifest.get("name")))
        log.info("worker %d: resuming at epoch %d, batch %d (checkpoint %s)", self.t.rank, pos.epoch,
                 pos.batch, uri)
        return pos, step

    def _check_files(self, recorded, pos: Position, uri: str, chain=None) -> None:
        """The train files now (``self.files``) against those the checkpoint recorded (module docstring).

        ``chain``: ``(manager, name)`` of the restored checkpoint, whose chain is searched for an
        epoch-start checkpoint to name in the error.

        Raises
        ------
        ConfigError
            Inside an epoch (``pos.batch`` > 0), other files: names ``model.data.train_path``, the
            checkpoint, the position, what changed (added, removed, size, CRC of the ends or of the
            blocks between them) and the newest checkpoint of its chain taken at an epoch's start.
        """
        path = self.t.cfg.data.train_path
        if not isinstance(recorded, list):
            if pos.batch and self.t.rank == 0:
                log.warning("checkpoint %s records no fingerprint of the train files (written before they were "
                            "recorded): cannot verify that model.data.train_path %s holds the files its position "
                            "epoch %d batch %d was taken on; resuming on them as they are", uri, path, pos.epoch,
                            pos.batch)
            return
        changes = describe_file_changes(recorded, self.files)
        if not changes:
            return
        if not pos.batch:
            if self.t.rank == 0:
                log.info("the train files changed since checkpoint %s (%s): epoch %d is read from its start on "
                         "them as they are now", uri, "; ".join(changes), pos.epoch)
            return
        start = _epoch_start_checkpoint(*chain) if chain and chain[1] else None
        where = (f"resume from checkpoint {start[0]}, taken at the start of epoch {start[1]} (--resume "
                 f"{start[0]}: the epoch is read from its start on the files as they are now)" if start else
                 "resume from a checkpoint taken at an epoch's start (none in this checkpoint's chain back "
                 "to its base: --resume URI names one)")
        raise ConfigError(
            f"model.data.train_path: {path} holds other files than checkpoint {uri} was trained on "
            f"({'; '.join(changes)}): its position, epoch {pos.epoch} batch {pos.batch}, would skip rows never "
            f"trained and train others twice. Resume with the files it was trained on, {where}, or train "
            f"afresh without --resume (a file repaired after the job stopped on a bad value counts as other "
            f"files: its rows before the position were trained as they were)")

    def check_shards(self, sizes: list[int], batch_size: int, path: str) -> None:
        """Warn when the smallest of the workers' shards (``sizes``: rows per worker) holds fewer batches
        than ``align_steps``: ``points`` then has none, and checkpoints come at epoch ends only."""
        a = self.ck.align_steps if self.enabled else 0
        rows = min(sizes)
        if 0 < a and rows // batch_size < a:
            log.warning("no checkpoint inside an epoch: worker %d's shard of %s has %d rows, %d batch(es) of "
                        "%d, fewer than checkpoint.align_steps %d (the workers meet for a checkpoint only at "
                        "steps every worker reaches); checkpoints come at epoch ends only: lower "
                        "checkpoint.align_steps or model.batch_size, or run fewer workers",
                        sizes.index(rows), path, rows, rows // batch_size, batch_size, a)

    # -------------------------------------------------------------------------------- meetings
    def points(self, start: int, min_batches: int) -> list[int]:
        """Aligned batch offsets after ``start`` at which every worker is still inside its shard."""
        a = self.ck.align_steps
        if not self.enabled or a <= 0:
            return []
        return list(range((start // a + 1) * a, min_batches + 1, a))

    def meet(self, pos: Position, *, force: bool = False) -> None:
        """Drain, meet, and (rank 0) write a checkpoint when due or ``force``d (the final one)."""
        if not self.enabled:
            return
        t = self.t
        t._drain()
        name = f"ckpt-{pos.epoch}-{pos.batch}"
        preempt.announce(t.client)           # before the barrier: rank 0 sees it inside the meeting
        t.mode.barrier(name)
        report = progress.current()
        # every batch before pos is applied: a restart from a checkpoint of pos replays what follows
        report.mark(f"{pos.epoch}:{pos.batch}")
        with report.phase(f"checkpoint at {pos.epoch}:{pos.batch}", SAVE_TIMEOUT_S):
            if t.rank == 0:
                # the schedule's periods on the monotonic clock (a step of the wall clock neither holds
                # checkpoints back nor brings them forward); the wall clock only names the checkpoint
                mono = time.monotonic()
                stop = preempt.decide(t.client)
                kind = self.schedule.due(mono, step=t.steps) or ("delta" if force or stop else None)
                if kind is not None:
                    if not self.mgr.head:
                        kind = "base"
                    m = self.mgr.save(t.client, kind, when=time.time(), step=t.steps, sources=self.sources(pos),
                                      config=t.ctx.config.to_dict())
                    self.schedule.done(m["kind"], mono, step=t.steps)
                    self.last_uri = self.mgr.uri_of(m["name"])
                    log.info("checkpoint %s at epoch %d batch %d", self.last_uri, pos.epoch, pos.batch)
                if stop:
                    preempt.publish(t.client, name)
            # past the servers' cap on one barrier (max_barrier_wait_s, 600 s): a save may take longer
            t.mode.barrier_until(f"{name}-done", SAVE_TIMEOUT_S)
        if not force and preempt.decided(t.client, name):    # at the final meeting the job is done anyway
            raise preempt.Preempted(f"preempted at epoch {pos.epoch} batch {pos.batch} (step {t.steps}) after "
                                    f"checkpoint {self.last_uri or 'written by rank 0'}")
