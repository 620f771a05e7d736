"""The ``checkpoint`` config section and the schedule it implies.

::

    checkpoint:
      root: ""                # URI of the checkpoint root ("" = no checkpoints); job dir below it
      job: ""                 # directory under root (default: model.kind)
      delta_every: 1h         # a delta every this much TRAINING time ("30m", "3600s", "1h"), or every
                              # this many steps ("500steps"; offline CTR programs only, see below), or
                              # "partition" (after every input partition); "0" = no periodic deltas
      base_every: 24h         # a base every this much training time (the online job shrinks first), or
                              # every this many steps ("5000steps")
      keep_bases: 2           # retention: newest bases kept with their deltas; older ones deleted
      fallback: false         # restore: a damaged checkpoint falls back to the previous complete one
      final: true             # write a checkpoint when a finite job ends
      threads: 2              # local shards written / files read concurrently per server
      align_steps: 256        # offline jobs: every this many steps of an epoch the workers meet (drained)
                              # and rank 0 writes a checkpoint if one is due, recording each worker's
                              # exact data position; 0 = only at epoch ends

Training time is the data's time where the data has one (an hourly partition's hour), else the time
spent training, measured on the monotonic clock (``time.monotonic()`` of the process that keeps the
schedule: the launcher's ``Periodic`` thread, the offline programs' rank 0), so a step of the wall clock
(NTP, a VM resumed, an operator's ``date -s``) neither holds checkpoints back nor brings them forward. The
wall clock (UTC) only names the checkpoints (``engine.checkpoint.manifest.checkpoint_name``).

Step counts. ``delta_every`` and ``base_every`` each take either a time or a step count (they may differ:
``delta_every: 500steps`` with the default ``base_every: 24h``). A step is one batch of every worker (the
manifest's ``step``): with 2 workers of 128 rows, ``500steps`` is 128,000 examples. A step period counts
only where the program reports its step at its checkpoint points. The offline programs (``ctr_dnn``,
``deepfm``, ``logreg``, ``word2vec``: ``engine.programs.ctr_positions.AlignedCheckpoints``) check the
schedule at aligned points only: every ``align_steps`` steps of an epoch and at epoch ends. A step
period that is not a multiple of ``align_steps`` therefore falls due at the first aligned point at or
after it (``delta_every: 300steps`` with ``align_steps: 256``: steps 512, 1024, ...), and with
``align_steps: 0`` only at epoch ends. The online CTR job checks at the end of each partition, with its
steps (``engine.programs.ctr_online.online_schedule``), and writes a checkpoint there whatever is due
(a delta unless a base is). A program that does not write its own checkpoints is checkpointed by the
launcher's wall-clock thread (``engine.job_checkpoints.Periodic``; none of the shipped ones): it sees
no steps, so a step period never falls due there (a warning says so when the schedule is built); the
time periods work as before. ``delta_every: partition`` falls due only in the online job (a warning
says so elsewhere).

Precedence, as for times: a base is due when its period has passed since the last base; otherwise a
delta when its period has passed since the last checkpoint of either kind (a base restarts the delta
count).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from ..config_base import section
from ..errors import ConfigError

__all__ = ["CheckpointConfig", "Every", "Schedule", "parse_duration", "parse_every"]

log = logging.getLogger(__name__)

_DUR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_STEPS_RE = re.compile(r"^\s*(\d+)\s*steps?\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text, key: str) -> float:
    """``"1h"`` -> 3600.0 seconds (units s, m, h, d; a bare number is seconds).

    Raises
    ------
    ConfigError
        Not a duration; the message names ``key``.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = _DUR_RE.match(str(text))
    if not m:
        raise ConfigError(f"{key} must be a duration like 30m, 1h, 3600s, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class Every:
    """A parsed ``delta_every`` / ``base_every``.

    Attributes
    ----------
    amount : float, seconds (unit ``"s"``) or steps (unit ``"steps"``)
        0 = never (``delta_every: 0``); unused for ``"partition"``.
    unit : {"s", "steps", "partition"}
    """

    amount: float
    unit: Literal["s", "steps", "partition"]


def parse_every(text, key: str, *, partition: bool = False) -> Every:
    """``"1h"`` -> ``Every(3600.0, "s")``, ``"500steps"`` -> ``Every(500, "steps")``.

    Parameters
    ----------
    text : str or number
        A duration (``30m``, ``1h``, ``3600s``, ``2d``, a bare number of seconds), a step count
        (``500steps``, ``1step``; an integer), or with ``partition`` the word ``partition``.
    key : str
        Key path named in errors (``checkpoint.delta_every``).
    partition : bool
        Accept ``"partition"`` (``delta_every`` only).

    Raises
    ------
    ConfigError
        None of these forms; the message names ``key`` and the forms allowed.
    """
    if partition and text == "partition":
        return Every(0.0, "partition")
    m = _STEPS_RE.match(str(text)) if isinstance(text, str) else None
    if m:
        return Every(float(int(m.group(1))), "steps")
    try:
        return Every(parse_duration(text, key), "s")
    except ConfigError:
        allowed = ("a duration like 30m, 1h, 3600s, a step count like 500steps, 'partition' or 0" if partition
                   else "a duration like 24h, 3600s or a step count like 5000steps")
        raise ConfigError(f"{key} must be {allowed}, got {text!r}") from None


@section
class CheckpointConfig:
    """The ``checkpoint`` section (see the module docstring)."""

    root: str = ""
    job: str = ""
    delta_every: str = "1h"
    base_every: str = "24h"
    keep_bases: Annotated[int, Field(ge=1)] = 2
    fallback: bool = False
    final: bool = True
    threads: Annotated[int, Field(ge=1)] = 2
    align_steps: Annotated[int, Field(ge=0)] = 256
    shared: bool = False        # a local root that every node mounts (the Ray launcher on several nodes)
    restored: str = ""          # set by the launcher after --resume: the checkpoint the servers hold

    def __post_init__(self) -> None:
        parse_every(self.delta_every, "checkpoint.delta_every", partition=True)
        if parse_every(self.base_every, "checkpoint.base_every").amount <= 0:
            raise ConfigError(f"checkpoint.base_every must be > 0, got {self.base_every!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.root)


class Schedule:
    """Decides when a delta or a base is due.

    Parameters
    ----------
    config : CheckpointConfig
    start_s : float, seconds
        Training time of the last base (or of the start); the clocks run from here. One clock for
        ``start_s`` and every ``now_s``: the data's time, or ``time.monotonic()`` (never ``time.time()``:
        a backward step of the wall clock would hold every time period back by that much).
    start_step : int, optional
        Step of the last base (or of the start: 0, or the restored checkpoint's step); the step counts
        run from here. None: the caller reports no steps, so a step period never falls due (logged).
    partitions : bool
        The caller reports the ends of input partitions (the online job): ``delta_every: partition``
        falls due there. False (the offline programs): it never falls due (logged).

    Examples
    --------
    >>> s = Schedule(CheckpointConfig(delta_every="500steps"), start_s=0.0, start_step=0)
    >>> s.due(10.0, step=499), s.due(10.0, step=512)
    (None, 'delta')
    """

    def __init__(self, config: CheckpointConfig, start_s: float = 0.0, start_step: int | None = None,
                 partitions: bool = False):
        self.delta = parse_every(config.delta_every, "checkpoint.delta_every", partition=True)
        self.base = parse_every(config.base_every, "checkpoint.base_every")
        self.per_partition = self.delta.unit == "partition"
        self.counts_steps = start_step is not None
        self.last_base_s = self.last_ckpt_s = start_s
        self.last_base_step = self.last_ckpt_step = int(start_step or 0)
        if not self.counts_steps:
            for key, every, text in (("delta_every", self.delta, config.delta_every),
                                     ("base_every", self.base, config.base_every)):
                if every.unit == "steps" and every.amount > 0:
                    log.warning("checkpoint.%s=%s counts steps, which this program does not report at its "
                                "checkpoints: it never falls due here (step counts apply to the offline CTR "
                                "programs, which checkpoint at aligned points); use a time like 30m",
                                key, text)
        if self.per_partition and not partitions:
            log.warning("checkpoint.delta_every=partition writes a delta after each input partition of the "
                        "online job; this program reads no partitions, so no periodic delta is written "
                        "(only base_every's bases and the final checkpoint): use a step count like 500steps "
                        "or a time like 30m")

    def _passed(self, every: Every, since_s: float, since_step: int, now_s: float, step: int | None) -> bool:
        if every.amount <= 0:
            return False
        if every.unit == "s":
            return now_s - since_s >= every.amount
        if every.unit == "steps":
            return step is not None and step - since_step >= every.amount
        return False

    def due(self, now_s: float, *, step: int | None = None, partition_done: bool = False) -> str | None:
        """``"base"``, ``"delta"`` or None.

        Parameters
        ----------
        now_s : float, seconds
            Training time now.
        step : int, optional
            Step now (steps of each worker, as the manifest's ``step``); None: step periods are not due.
        partition_done : bool
            An input partition just ended (``delta_every: partition``).
        """
        if self._passed(self.base, self.last_base_s, self.last_base_step, now_s, step):
            return "base"
        if self.per_partition and partition_done:
            return "delta"
        if self._passed(self.delta, self.last_ckpt_s, self.last_ckpt_step, now_s, step):
            return "delta"
        return None

    def done(self, kind: str, now_s: float, *, step: int | None = None) -> None:
        """Record that a checkpoint of ``kind`` was written at training time ``now_s`` (and ``step``)."""
        self.last_ckpt_s = now_s
        if step is not None:
            self.last_ckpt_step = int(step)
        if kind == "base":
            self.last_base_s = now_s
            if step is not None:
                self.last_base_step = int(step)
