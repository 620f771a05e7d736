"""The workload ``engine plan`` measures from a config's own training data: unique keys per worker batch
(``measure_unique_keys``), read, shuffled and deduplicated as a CTR worker does, so the plan's network
and throughput figures rest on the traffic the job will see rather than on a guess. The formulas that use
it: ``engine.plan``; the bench figures: ``engine.plan_inputs``.
"""
from __future__ import annotations

import gzip
import math
import tempfile
from pathlib import Path

from .plan_inputs import Figure, PlanInputError

__all__ = ["MEASURE_BATCHES", "measure_unique_keys"]

#: full batches of the train data ``measure_unique_keys`` reads by default
MEASURE_BATCHES = 20


def measure_unique_keys(cfg, batches: int = MEASURE_BATCHES) -> Figure:
    """Mean unique keys per worker batch over the first ``batches`` full batches of the config's train
    data, read and deduplicated as a CTR worker does (``ctr_data.make_source`` with the config's shuffle
    buffer and seed, ``to_batch``, ``dedup_batch``).

    A Criteo text file (``model.data.source`` ``shared_criteo`` / ``criteo``) has its first ``(shuffle_buffer
    + batches * batch_size) * 5 / 4`` lines converted into a temporary directory (the train split keeps 4
    lines of 5), so nothing is written beside the data or in ``cache_dir``.

    Raises
    ------
    PlanInputError
        The model is not a CTR model with ``model.data``, the source is generated data, the data is
        missing or malformed, or it holds no full batch; the message says to pass
        ``--unique-keys-per-batch``.
    """
    kind = cfg.model.kind if cfg.model else None

    def fail(why: str) -> PlanInputError:
        return PlanInputError(f"cannot measure unique keys per batch: {why}; pass --unique-keys-per-batch N")

    if kind not in ("ctr_dnn", "deepfm"):
        raise fail(f"model.kind {kind!r} (measuring reads model.data of ctr_dnn and deepfm)")
    from streaming.criteo import convert_criteo
    from streaming.errors import DataFormatError, SchemaError
    from streaming.inputs import is_uri

    from .programs.ctr_data import dedup_batch, expected_schema, make_source, to_batch
    p, d = cfg.model.params, cfg.model.params.data
    with tempfile.TemporaryDirectory(prefix="engine-plan-") as tmp:
        if d.source == "generated" or (d.source == "shared_criteo" and not Path(d.criteo_path).is_file()
                                       and d.fallback == "generated"):
            why = "source 'generated'" if d.source == "generated" else f"criteo_path {d.criteo_path!r} missing"
            raise fail(f"model.data would be generated planted-model rows ({why}), not real traffic")
        try:
            if d.source == "arrow":
                path, what = d.train_path, f"model.data.train_path {d.train_path}"
                if not path or not (is_uri(path) or Path(path).exists()):
                    raise fail(f"model.data.train_path {path!r} not found")
            else:
                raw = Path(d.criteo_path)
                if is_uri(d.criteo_path):     # training copies it whole first (ctr_data); a plan reads a few lines
                    raise fail(f"model.data.criteo_path {d.criteo_path} is on a store: measure on a local copy of "
                               f"its first lines (--set model.data.criteo_path=PATH)")
                if not raw.is_file():
                    raise fail(f"model.data.criteo_path {d.criteo_path} not found (from {Path.cwd()})")
                lines = math.ceil((p.shuffle_buffer + batches * p.batch_size) * 5 / 4) + 5
                head = Path(tmp) / "head.txt"
                copied = _copy_head(raw, head, lines)
                path = str(Path(tmp) / "train")
                convert_criteo([head], path, split="train", batch_size=d.convert_batch_size,
                               max_bad_rows=d.max_bad_rows, progress=False)
                what = (f"model.data.criteo_path {d.criteo_path} (its first {copied} lines, train split)")
            src = make_source(path, batch_size=p.batch_size, schema=expected_schema(p.slots, p.dense_dim),
                              rank=0, num_workers=1, shuffle_buffer=p.shuffle_buffer, seed=p.seed, prefetch=0,
                              storage_options=cfg.storage.options())
            counts = []
            it = src.batches(0)
            try:
                for rb in it:
                    if rb.num_rows < p.batch_size or len(counts) >= batches:
                        break
                    counts.append(len(dedup_batch(to_batch(rb, p.slots, p.dense_dim))[0]))
            finally:
                it.close()
        except (DataFormatError, SchemaError, OSError) as e:
            raise fail(f"{type(e).__name__}: {e}") from None
    if not counts:
        raise fail(f"{what} holds no full batch of {p.batch_size} rows")
    mean = sum(counts) / len(counts)
    return Figure("unique_keys_per_batch", mean, "keys", "measured",
                  f"{what}: mean of {len(counts)} batches of {p.batch_size} rows (min {min(counts)}, max "
                  f"{max(counts)}), shuffled as training (shuffle_buffer {p.shuffle_buffer}, seed {p.seed})")


def _copy_head(src: Path, dst: Path, lines: int) -> int:
    """Copy the first ``lines`` lines of ``src`` (plain or gzip) to ``dst``; returns the lines copied."""
    with open(src, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    n = 0
    with (gzip.open(src, "rb") if gz else open(src, "rb")) as f, open(dst, "wb") as out:
        for line in f:
            if n >= lines:
                break
            out.write(line)
            n += 1
    return n
