"""What people watch: Prometheus metrics of every role, TensorBoard curves of every run.

The other modules call this one, never print or count inline:

* roles: ``prometheus.start(cfg, role, rank)`` serves ``/metrics`` (``observability.prometheus_port``)
  and pushes to a Pushgateway; the PS server installs ``RoleMetrics.interceptor(paths)`` and
  ``watch_server(core)``; checkpoint code calls ``prometheus.record_checkpoint``;
* worker programs: ``events(metrics_file, cfg, rank)`` wraps the run's metrics file so each event also
  becomes TensorBoard scalars and Prometheus gauges, and ``watch_trainer(trainer)`` exports the
  trainer's counters (examples, steps, training seconds: this process's, live; seconds per phase) at
  scrape time;
* launcher hooks: ``tensorboard.record_final(cfg, metrics_file, event)`` -> the final line's
  ``tensorboard_dir``.

Config: ``engine.observability.settings.ObservabilityConfig`` (the ``observability:`` section).
"""
from __future__ import annotations

import importlib

__all__ = ["events", "watch_trainer", "record_final", "run_logdir"]


def __getattr__(name: str):
    # submodules load on first use: reading a config (engine.config imports .settings) stays light
    if name in ("prometheus", "tensorboard"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("record_final", "run_logdir", "EventSink"):
        return getattr(importlib.import_module(f"{__name__}.tensorboard"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def events(inner, cfg, rank: int, role: str = "worker"):
    """``inner`` (a metrics file: ``write(event)``) wrapped so its events also go to TensorBoard
    (``observability.tensorboard``) and this process's Prometheus gauges; ``inner`` itself when both
    are off."""
    from . import prometheus
    from .tensorboard import EventSink, run_logdir
    m = prometheus.current()
    path = str(getattr(inner, "path", "") or "")
    logdir = run_logdir(cfg, path)
    if logdir is None and m is None:
        return inner
    return EventSink(inner, logdir, f".{role}{rank}", gauges=m.events if m is not None else None)


def watch_trainer(trainer) -> None:
    """Export ``trainer``'s counters to this process's Prometheus endpoint, read at scrape time:
    ``trainer.live_counters()`` (``examples``, ``steps``, ``train_seconds`` of this process, live; required)
    and ``phases``; nothing when metrics are off."""
    from . import prometheus
    m = prometheus.current()
    if m is not None:
        m.watch_trainer(trainer)
