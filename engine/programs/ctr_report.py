"""Metrics of a CTR run: the JSON-lines file, global AUC merged through the parameter servers, and the
launcher's live view of the file (progress bar on a terminal, plain log lines otherwise).

The metrics file (one per run, ``model.metrics_file``) holds one JSON object per line::

    {"event": "start", "model": "ctr_dnn", "mode": "async", "workers": 2, "train_rows": 16488, ...}
    {"event": "train", "rank": 1, "epoch": 0, "step": 40, "examples_total": 10240, "examples_job": 10240,
     "logloss": 0.49, "auc": 0.71, "examples_per_s": 8123.0, "time": ...}   # per worker, per interval
    {"event": "eval", "epoch": 0, "step": 80, "split": "test", "auc": 0.752, "logloss": 0.47,
     "pred_ctr": 0.22, "actual_ctr": 0.23, "copc": 1.04, "count": 4121}   # global, after each epoch
    {"event": "profile", "rank": 0, "step": 120, "steps": 120, "phase_seconds": {...}, ...}   # per worker
    {"event": "final", "model": ..., "mode": ..., "test_auc": ..., "test_logloss": ...,
     "test_copc": ..., "examples_per_s": ..., "metrics_file": ..., "checkpoint": null}

``step`` is the job's step (``CTRTrainer.global_step``): a resumed or restarted attempt continues from
its checkpoint's step, so the events of all attempts share one increasing axis; ``examples_total``
counts this process's examples (0 again in a new attempt), ``examples_job`` the rank's examples since the
job began (the restored position's plus this process's: what the launcher's bar counts).

Global evaluation: every worker scores its shard of the test split into a ``BinaryMetrics`` histogram,
adds it into the servers' metric accumulator ``model.metrics_table`` (``PSClient.add_metric``: int64
counts and float64 sums, exact),
waits at a barrier; rank 0 pulls the sum and computes AUC/logloss/COPC from the merged counts (never an
average of per-worker AUCs), resets the table and releases everyone at a second barrier.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path


from ..metrics import BinaryMetrics

log = logging.getLogger(__name__)

#: histogram resolution of the merged evaluation (2 * 2^16 + 4 floats travel per worker and evaluation)
EVAL_BUCKETS = 1 << 16


def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    return obj


class MetricsFile:
    """Append-only JSON-lines writer; each event is one ``write`` of one line (several processes may
    append to the same local file)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: dict) -> None:
        line = json.dumps(_clean(event), separators=(", ", ": ")) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def merge_global(client, mode, name: str, local: BinaryMetrics, tag: str) -> dict | None:
    """Sum every worker's histogram on the servers; rank 0 gets the global summary, others None.

    Every worker must call this with the same ``tag`` (it names the barriers). The sums are exact:
    int64 counts and float64 sums (``PSClient.add_metric``), whatever the number of examples.

    Parameters
    ----------
    client : engine.ps.PSClient
    mode : engine.modes.Mode
        Supplies rank, number of workers and the barrier.
    name : str
        The servers' metric accumulator (``model.metrics_table``); empty before the call (``reset_metrics``).
    local : BinaryMetrics
        This worker's counts (``EVAL_BUCKETS`` buckets).
    tag : str

    Returns
    -------
    dict or None
        ``BinaryMetrics.summary()`` of the merged counts on rank 0.
    """
    client.add_metric(name, *local.to_parts())
    mode.barrier(f"metrics-pushed-{tag}")
    summary = None
    if mode.rank == 0:
        summary = BinaryMetrics.from_parts(*client.read_metric(name)).summary()
        client.reset_metric(name)
    mode.barrier(f"metrics-reset-{tag}")
    return summary


def reset_metrics(client, mode, name: str) -> None:
    """Start with an empty accumulator ``name`` (rank 0 clears what an earlier run left; everybody
    meets at a barrier afterwards)."""
    if mode.rank == 0:
        client.reset_metric(name)
    mode.barrier("metrics-init")


class Follower:
    """Launcher side: tail the metrics file while the job runs and show it on stderr.

    On a terminal a tqdm bar counts the job's training examples (``total_examples``; each rank's
    ``examples_job``: a resumed or restarted process's count starts at its checkpoint's position, so the
    bar fills after a resume and steps back by what a restart replays) with the latest train loss
    and test AUC as postfix; otherwise each event is logged as one plain line. It shows what is written
    after it starts (before the job's processes): the lines of an earlier run in the same file (a pinned
    ``model.metrics_file`` resumed) are not shown again.
    """

    def __init__(self, path: str | os.PathLike, total_examples: int, *, tty: bool | None = None,
                 poll_s: float = 0.5):
        self.path = Path(path)
        self.total = total_examples
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-follower", daemon=True)
        self._examples: dict[int, int] = {}
        self._bar = None
        self._start = 0

    def __enter__(self) -> "Follower":
        try:
            self._start = self.path.stat().st_size
        except OSError:
            self._start = 0
        if self.tty:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=self.total, unit="ex", unit_scale=True, desc="train", file=sys.stderr)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        if self._bar is not None:
            self._bar.close()

    def _run(self) -> None:
        pos = self._start
        while True:
            stopping = self._stop.is_set()
            try:
                with open(self.path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except OSError:
                chunk = b""
            end = chunk.rfind(b"\n") + 1
            for line in chunk[:end].splitlines():
                try:
                    self._show(json.loads(line))
                except ValueError:
                    continue
            pos += end
            if stopping:
                return
            self._stop.wait(self.poll_s)

    def _show(self, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "train":
            # the job's examples of that rank (a resumed process's count starts at its checkpoint's position)
            self._examples[ev.get("rank", 0)] = ev.get("examples_job", ev.get("examples_total", 0))
            if self._bar is not None:
                self._bar.update(sum(self._examples.values()) - self._bar.n)
                self._bar.set_postfix(loss=f"{ev.get('logloss') or 0:.4f}", refresh=False)
                return
            log.info("train  rank %s epoch %s step %s: logloss %.4f auc %s, %.0f examples/s",
                     ev.get("rank"), ev.get("epoch"), ev.get("step"), ev.get("logloss") or float("nan"),
                     _fmt(ev.get("auc")), ev.get("examples_per_s") or 0.0)
        elif kind == "eval":
            msg = (f"eval   epoch {ev.get('epoch')} ({ev.get('split')}, {ev.get('count')} rows): "
                   f"AUC {_fmt(ev.get('auc'))} logloss {_fmt(ev.get('logloss'))} pred/actual CTR "
                   f"{_fmt(ev.get('pred_ctr'))}/{_fmt(ev.get('actual_ctr'))} COPC {_fmt(ev.get('copc'))}")
            if self._bar is not None:
                self._bar.set_postfix(test_auc=_fmt(ev.get("auc")), refresh=False)
                self._bar.write(msg, file=sys.stderr)
            else:
                log.info("%s", msg)


def _fmt(v) -> str:
    return "nan" if v is None else f"{v:.4f}"


def now_stamp() -> str:
    """``YYYYmmdd-HHMMSS`` of now in UTC (metrics file names, run ids): names of runs started under
    other ``TZ`` settings, or across a DST change, sort in the order the runs started."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())
