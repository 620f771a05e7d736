"""Worker programs: what a worker process runs, selected by ``model.kind`` in the config.

A program is a module with

- ``Config``: a frozen dataclass of its own knobs (the ``model`` section minus ``kind``; unknown keys
  are rejected by ``engine.config.build``), declared in ``engine.program_configs`` (which the config
  loader reads without importing any program) and re-exported by the program module, and
- ``run(ctx: engine.worker.WorkerContext) -> dict``: the training loop. It talks to the servers only
  through ``ctx.mode`` (``engine.modes``) and ``ctx.client``, and returns a JSON-able summary; the
  launcher collects the summaries of every rank.

Optional launcher-side hooks (run by ``engine train`` in the launching process only):

- ``prepare(cfg) -> cfg``: before any process starts (resolve and convert data, pick output files);
  raise ``ConfigError`` / ``streaming.errors.DataFormatError`` / ``SchemaError`` for bad input (exit 2);
- ``follow(cfg)``: a context manager active while the job runs (live progress);
- ``final(cfg, results) -> dict``: the ``{"event": "final", ...}`` object printed as the last stdout
  line (default: model, mode and the workers' summaries).

Register a program by adding its module path to ``PROGRAMS`` and its Config class to
``engine.program_configs.PROGRAM_CONFIGS``.
"""
from __future__ import annotations

import importlib

from ..errors import ConfigError

PROGRAMS = {
    "logreg": "engine.programs.logreg",
    "ctr_dnn": "engine.programs.ctr",
    "deepfm": "engine.programs.ctr",
    "ctr_online": "engine.programs.ctr_online",
    "word2vec": "engine.programs.word2vec",
}


def load_program(kind: str):
    """The program module for ``model.kind``.

    Raises
    ------
    ConfigError
        Unknown kind (the known kinds are listed).
    """
    if kind not in PROGRAMS:
        raise ConfigError(f"model.kind must be one of {sorted(PROGRAMS)}, got {kind!r}")
    return importlib.import_module(PROGRAMS[kind])

