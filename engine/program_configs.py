"""The ``model`` sections of the worker programs, and which section ``model.kind`` selects.

Each worker program (``engine.programs``) has its own knobs: the ``model`` section of a config minus
``kind``. Their sections live here, below both ``engine.config`` (which builds the ``model`` section from
``PROGRAM_CONFIGS``) and the programs (each re-exports its section as ``Config``), so reading a config
imports no program and no program module closes an import cycle with ``engine.config``. Every knob is
commented in the ``configs/*.yaml`` of its program.

A new program adds its section here and its module to ``engine.programs.PROGRAMS``, under the same kinds
(``tests/unit/test_config.py`` checks that both registries agree).
"""
from __future__ import annotations

from dataclasses import field
from typing import Annotated, Literal

from pydantic import Field

from .config_base import MAX_SECONDS, IntTuple, Nested, StrTuple, section
from .errors import ConfigError

__all__ = ["CTRConfig", "CTROnlineConfig", "DataConfig", "LogregConfig", "PROGRAM_CONFIGS", "Word2VecConfig",
           "program_config_class"]

#: the 26 categorical slots of Criteo
CRITEO_SLOTS = tuple(f"C{j}" for j in range(1, 27))


@section
class LogregConfig:
    """The ``model`` section of ``logreg`` (``engine.programs.logreg``; ``configs/logreg_demo.yaml``)."""

    table: str = "weights"
    dense_table: str = "bias"
    # the worker draws float32[num_features] planted weights and pulls all of them at the end
    num_features: Annotated[int, Field(ge=1, le=1 << 24)] = 100
    keys_per_example: Annotated[int, Field(ge=1)] = 8
    examples_per_worker: Annotated[int, Field(ge=1)] = 8000
    batch_size: Annotated[int, Field(ge=1)] = 64
    epochs: Annotated[int, Field(ge=1)] = 3
    seed: Annotated[int, Field(ge=0)] = 7        # numpy's generators take no negative seed
    weight_scale: Annotated[float, Field(gt=0)] = 1.0
    planted_bias: float = -0.5

    def __post_init__(self) -> None:
        if self.batch_size > self.examples_per_worker:      # the worker drops the last partial batch
            raise ConfigError(f"model.batch_size ({self.batch_size}) must be <= model.examples_per_worker "
                              f"({self.examples_per_worker}): every worker trains whole batches of its "
                              f"examples only, and would train none")

    def used_tables(self) -> dict[str, dict[str, str]]:
        """The tables this program trains: ``{"sparse": {name: key naming it}, "dense": {...}}``
        (``engine.config.from_dict`` refuses any other declared table)."""
        return {"sparse": {self.table: "model.table"}, "dense": {self.dense_table: "model.dense_table"}}


@section
class DataConfig:
    """The ``model.data`` section of the CTR programs (see ``engine.programs.ctr_data``)."""

    source: Literal["shared_criteo", "criteo", "generated", "arrow"] = "shared_criteo"
    criteo_path: str = "../shared/data/criteo/train.txt"
    fallback: Literal["generated", "none"] = "generated"
    train_path: str = ""
    test_path: str = ""
    cache_dir: str = "runs/cache"
    generated_rows: Annotated[int, Field(ge=10)] = 20000
    generated_seed: Annotated[int, Field(ge=0)] = 20240
    convert_batch_size: Annotated[int, Field(ge=1, le=1 << 22)] = 512     # streaming.criteo.MAX_BATCH_SIZE
    max_bad_rows: Annotated[int, Field(ge=0)] = 0
    group_column: str = ""       # test-split column of a user/query id: GAUC, pos/neg order ratio ("" = none)


@section
class CTRConfig:
    """The ``model`` section of ``ctr_dnn`` / ``deepfm`` (``engine.programs.ctr``; every knob is commented
    in ``configs/ctr.yaml``)."""

    sparse_table: str = "embedding"
    dense_table: str = "dense"
    metrics_table: str = "metrics"
    slots: StrTuple = CRITEO_SLOTS
    dense_dim: Annotated[int, Field(ge=0)] = 13
    dim: Annotated[int, Field(ge=1)] = 10
    hidden: IntTuple = (400, 400, 400)
    batch_size: Annotated[int, Field(ge=1)] = 256
    epochs: Annotated[int, Field(ge=1)] = 1
    seed: Annotated[int, Field(ge=0)] = 0
    shuffle_buffer: Annotated[int, Field(ge=0)] = 65536
    eval_every_epoch: bool = True
    eval_batch_size: Annotated[int, Field(ge=1)] = 4096
    log_every_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 2.0
    prefetch: Annotated[int, Field(ge=0)] = 4
    pipeline: Literal["exact", "stale", "sequential"] = "exact"
    dense_merge_steps: Annotated[int, Field(ge=1)] = 1
    blas_threads: Annotated[int, Field(ge=0)] = 0
    metrics_dir: str = "runs/metrics"
    metrics_file: str = ""
    data: Annotated[DataConfig, Nested] = field(default_factory=DataConfig)

    def used_tables(self) -> dict[str, dict[str, str]]:
        """The tables this program trains: ``{"sparse": {name: key naming it}, "dense": {...}}``
        (``engine.config.from_dict`` refuses any other declared table; ``metrics_table`` is a servers'
        accumulator, not a declared table)."""
        return {"sparse": {self.sparse_table: "model.sparse_table"}, "dense": {self.dense_table: "model.dense_table"}}


@section
class CTROnlineConfig(CTRConfig):
    """The ``model`` section of ``ctr_online`` (``engine.programs.ctr_online``; ``configs/ctr_online.yaml``):
    every ``ctr_dnn``/``deepfm`` knob (``data`` is unused) plus the stream."""

    network: Literal["ctr_dnn", "deepfm"] = "ctr_dnn"
    partitions: str = ""
    poll_interval_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 10.0
    # a missing hour before a complete later one
    wait_for_missing_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = 0.0
    until: str = ""              # YYYYMMDDHH, a string as written ("" = run forever)
    max_partitions: Annotated[int, Field(ge=0)] = 0
    export_root: str = ""        # serving bundles after every checkpoint ("" = none): full after a base
    export_dtype: Literal["float32", "float16"] = "float32"
    export_min_show: Annotated[float, Field(ge=0)] = 0.0
    export_keep_full: Annotated[int, Field(ge=0)] = 2   # full bundles kept with their deltas (0 = keep all)
    run_id: str = ""             # set by the launcher (ctr_online.prepare) per engine train run, not a knob:
    #                              its restarted attempts continue the run's max_partitions count


@section
class Word2VecConfig:
    """The ``model`` section of ``word2vec`` (``engine.programs.word2vec``; every knob is commented in
    ``configs/word2vec.yaml``)."""

    corpus: str = "../shared/data/text/corpus.txt.gz"
    arrow_dir: str = "runs/cache/text-corpus"
    min_count: Annotated[int, Field(ge=1)] = 5
    max_vocab: Annotated[int, Field(ge=0)] = 0
    dim: Annotated[int, Field(ge=1)] = 100
    window: Annotated[int, Field(ge=1)] = 5
    negative: Annotated[int, Field(ge=1)] = 5
    sample: Annotated[float, Field(ge=0)] = 1e-3
    alpha: Annotated[float, Field(gt=0)] = 0.025
    min_alpha: Annotated[float, Field(ge=0)] = 1e-4
    ns_exponent: float = 0.75
    epochs: Annotated[int, Field(ge=1)] = 5
    seed: Annotated[int, Field(ge=0)] = 1
    batch_words: Annotated[int, Field(ge=1)] = 50_000
    input_table: str = "syn0"
    output_table: str = "syn1neg"
    progress_table: str = "progress"
    input_slot: Annotated[int, Field(ge=0, le=65535)] = 1
    output_slot: Annotated[int, Field(ge=0, le=65535)] = 2
    log_every_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 5.0
    eval_after_train: bool = True
    eval_data_dir: str = "../shared/data/text"
    metrics_dir: str = "runs/metrics"
    metrics_file: str = ""

    def used_tables(self) -> dict[str, dict[str, str]]:
        """The tables this program trains: ``{"sparse": {name: key naming it}, "dense": {...}}``
        (``engine.config.from_dict`` refuses any other declared table; the two sparse keys may name one table)."""
        sparse = {self.input_table: "model.input_table", self.output_table: "model.output_table"}
        return {"sparse": sparse, "dense": {self.progress_table: "model.progress_table"}}


#: ``model.kind`` -> the section of its program (the kinds of ``engine.programs.PROGRAMS``)
PROGRAM_CONFIGS = {
    "logreg": LogregConfig,
    "ctr_dnn": CTRConfig,
    "deepfm": CTRConfig,
    "ctr_online": CTROnlineConfig,
    "word2vec": Word2VecConfig,
}


def program_config_class(kind: str):
    """The ``model`` section class of worker program ``kind``.

    Raises
    ------
    ConfigError
        Unknown kind (the known kinds are listed).
    """
    if kind not in PROGRAM_CONFIGS:
        raise ConfigError(f"model.kind must be one of {sorted(PROGRAM_CONFIGS)}, got {kind!r}")
    return PROGRAM_CONFIGS[kind]
