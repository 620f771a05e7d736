"""TensorBoard event files of a run (``tensorboardX.SummaryWriter``).

Every process of a run writes into ``observability.tensorboard_dir/RUN_ID/`` (RUN_ID: the stem of the
run's metrics file, ``model.metrics_file``, which the launcher picks once for all processes), each into
its own event file (suffix ``.worker0``, ``.final``, ...), so TensorBoard shows one run::

    tensorboard --logdir runs/tensorboard

``EventSink`` wraps a worker's metrics file (anything with ``write(event: dict)``): every event still
goes to the file, and its numbers also become scalars:

=============  =========================================  =========================================
event          tags                                       step
=============  =========================================  =========================================
train          ``train/rank{R}/{auc,logloss,...}``        the event's ``step`` (the job's step)
               (CTR: examples/s; word2vec: loss, words/s)
eval           ``test/{auc,logloss,copc,accuracy,...}``   the event's ``step`` (its ``epoch`` when it
               (rank 0 writes the global summary)         has none)
partition      ``online/{progressive_auc,...}``           hours since 1970 of the partition
profile        ``profile/rank{R}/phase_seconds/{phase}``  the event's ``step`` (else its ``steps``)
final          ``final/{...}`` (the launcher, ``record_final``)  0
=============  =========================================  =========================================

The job's step (``CTRTrainer.global_step``) is one axis across the attempts of a run: a resumed or
restarted process starts at its checkpoint's step, not at 0, and writes a second event file into the
same directory. Steps an attempt trained past its last checkpoint are trained again by the next one
under the same numbers (the same batches): TensorBoard's default reader (its data server) keeps the
later attempt's points, a point whose step comes again dropping the tag's points at or past it, so the
curves never run back (``--load_fast=false``'s Python reader shows both attempts' points there).

Each event is flushed as it is written, so a process that crashes leaves readable files (at most the
record being written is lost; readers skip a torn last record). ``close`` (also at exit) closes the file.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import math
import os
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["EventSink", "run_logdir", "record_final", "scalars_of"]

#: fields that are positions, counts or times, not curves
_SKIP = frozenset({"event", "rank", "epoch", "step", "time", "examples_total", "words_total",
                   "effective_words_total", "train_started_at", "dense_steps", "steps"})


def _summary_writer_class(logdir: str):
    """``tensorboardX.SummaryWriter``, imported without boto3 unless ``logdir`` is on S3.

    tensorboardX's ``record_writer`` imports boto3 whenever it is installed, for ``s3://`` log directories
    only; that import cost each worker and launcher 0.34-0.46 s of CPU (``-X importtime``, 2026-11-28), a
    sixth of its start-up. For any other directory boto3 is hidden while tensorboardX loads (a ``None``
    entry in ``sys.modules`` makes ``import boto3`` raise ImportError: the import system's documented
    way to block one module) and put back after. A later ``s3://`` directory in the same process reloads
    ``record_writer`` so it finds boto3.
    """
    s3 = logdir.startswith("s3://")
    if s3 or "boto3" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter, record_writer
        if s3 and not record_writer.S3_ENABLED:
            importlib.reload(record_writer)
        return SummaryWriter
    sys.modules["boto3"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("boto3", 0) is None:        # the block, not a boto3 loaded meanwhile
            del sys.modules["boto3"]
    return SummaryWriter


def run_logdir(cfg, metrics_file: str) -> str | None:
    """``tensorboard_dir/RUN_ID`` (absolute) of the run whose metrics file is ``metrics_file``, or None
    when ``observability.tensorboard`` is off."""
    obs = cfg.observability
    if not obs.tensorboard or not metrics_file:
        return None
    return os.path.join(os.path.abspath(obs.tensorboard_dir), Path(metrics_file).stem)


def scalars_of(event: dict) -> tuple[list[tuple[str, float]], int] | None:
    """(tag, value) pairs and the global step of one metrics-file event; None for events that carry no
    curve (``start``). Non-finite values (an AUC of one class) are skipped."""
    kind = event.get("event")
    if kind == "train":
        prefix, step = f"train/rank{event.get('rank', 0)}", event.get("step", 0)
    elif kind == "eval":
        prefix, step = event.get("split", "test"), event.get("step", event.get("epoch", 0))
    elif kind == "partition":
        prefix, step = "online", _partition_hours(event.get("partition", ""))
    elif kind == "profile":
        phases = event.get("phase_seconds") or {}
        return ([(f"profile/rank{event.get('rank', 0)}/phase_seconds/{k}", float(v)) for k, v in phases.items()],
                int(event.get("step", event.get("steps", 0)) or 0))
    elif kind == "final":
        prefix, step = "final", 0
    else:
        return None
    out = [(f"{prefix}/{k}", float(v)) for k, v in event.items()
           if k not in _SKIP and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return out, int(step or 0)


def _partition_hours(name: str) -> int:
    try:
        from streaming.hourly import partition_time
        return int(partition_time(name).timestamp() // 3600)
    except (ValueError, ImportError):
        return 0


class EventSink:
    """A metrics file that also writes TensorBoard scalars and updates the Prometheus event gauges.

    Parameters
    ----------
    inner : object with ``write(event: dict)``
        The metrics file (``engine.programs.ctr_report.MetricsFile``).
    logdir : str or None
        The run's TensorBoard directory (None: no event files).
    suffix : str
        Event file name suffix (``.worker0``): one file per process.
    gauges : engine.observability.prometheus.EventGauges, optional
    """

    def __init__(self, inner, logdir: str | None, suffix: str, gauges=None):
        self.inner, self.logdir, self.gauges = inner, logdir, gauges
        self.path = getattr(inner, "path", None)
        self._writer = None
        self._lock = threading.Lock()
        if logdir:
            SummaryWriter = _summary_writer_class(logdir)
            try:
                # made here first: tensorboardX checks and then creates it, and two workers starting at
                # once lost that race (FileExistsError killed one of them)
                if "://" not in logdir:
                    os.makedirs(logdir, exist_ok=True)
                self._writer = SummaryWriter(logdir, flush_secs=30, filename_suffix=suffix)
            except Exception as e:  # noqa: BLE001 - event files are a view: they never stop training
                log.warning("tensorboard: cannot write event files under %s: %s; training goes on without "
                            "them", logdir, e)
                self._writer = None
            else:
                atexit.register(self.close)

    def write(self, event: dict) -> None:
        self.inner.write(event)
        if self.gauges is not None:
            self.gauges.note(event)
        if self._writer is None:
            return
        got = scalars_of(event)
        if not got:
            return
        pairs, step = got
        wall = event.get("time")
        try:
            with self._lock:
                for tag, v in pairs:
                    self._writer.add_scalar(tag, v, step, walltime=wall)
                self._writer.flush()
        except Exception as e:  # noqa: BLE001 - a full disk under the event files must not stop training
            log.warning("tensorboard: cannot write to %s: %s", self.logdir, e)

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def record_final(cfg, metrics_file: str, event: dict) -> str | None:
    """Write the run's ``final`` event (launcher side) as ``final/*`` scalars; returns the run's
    TensorBoard directory (the final JSON line's ``tensorboard_dir``), None when TensorBoard is off."""
    logdir = run_logdir(cfg, metrics_file)
    if logdir is None:
        return None
    sink = EventSink(_Nowhere(), logdir, ".final")
    sink.write(event)
    sink.close()
    return logdir


class _Nowhere:
    def write(self, event: dict) -> None:
        pass
