"""The ``checkpoint`` config section and the schedule it implies.

::

    checkpoint:
      root: ""                # URI of the checkpoint root ("" = no checkpoints); job dir below it
      job: ""                 # directory under root (default: model.kind)
      delta_every: 1h         # a delta every this much TRAINING time ("30m", "3600s", "1h"), or
                              # "partition" (after every input partition); "0" = no periodic deltas
      base_every: 24h         # a base every this much training time (the online job shrinks first)
      keep_bases: 2           # retention: newest bases kept with their deltas; older ones deleted
      fallback: false         # restore: a damaged checkpoint falls back to the previous complete one
      final: true             # write a checkpoint when a finite job ends
      threads: 2              # local shards written / files read concurrently per server
      align_steps: 256        # offline jobs: every this many steps of an epoch the workers meet (drained)
                              # and rank 0 writes a checkpoint if one is due, recording each worker's
                              # exact data position; 0 = only at epoch ends

Training time is the data's time where the data has one (an hourly partition's hour), else the wall
clock time spent training.
"""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

from ..config_base import section
from ..errors import ConfigError

__all__ = ["CheckpointConfig", "Schedule", "parse_duration"]

_DUR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
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
    restored: str = ""          # set by the launcher after --resume: the checkpoint the servers hold

    def __post_init__(self) -> None:
        if self.delta_every != "partition":
            parse_duration(self.delta_every, "checkpoint.delta_every")
        if parse_duration(self.base_every, "checkpoint.base_every") <= 0:
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
        Training time of the last base (or of the start); the clocks run from here.
    """

    def __init__(self, config: CheckpointConfig, start_s: float = 0.0):
        self.per_partition = config.delta_every == "partition"
        self.delta_s = 0.0 if self.per_partition else parse_duration(config.delta_every, "checkpoint.delta_every")
        self.base_s = parse_duration(config.base_every, "checkpoint.base_every")
        self.last_base_s = start_s
        self.last_ckpt_s = start_s

    def due(self, now_s: float, *, partition_done: bool = False) -> str | None:
        """``"base"``, ``"delta"`` or None at training time ``now_s`` (seconds)."""
        if now_s - self.last_base_s >= self.base_s:
            return "base"
        if (self.per_partition and partition_done) or (self.delta_s > 0 and now_s - self.last_ckpt_s >= self.delta_s):
            return "delta"
        return None

    def done(self, kind: str, now_s: float) -> None:
        """Record that a checkpoint of ``kind`` was written at training time ``now_s``."""
        self.last_ckpt_s = now_s
        if kind == "base":
            self.last_base_s = now_s
