"""Evaluation of the CTR programs: global metrics merged on the servers, and per-group metrics when the
test split has a grouping column (``model.data.group_column``: a user or query id).

Without a grouping column each worker scores its shard of the test split (``ctr_data.make_source``) into
a ``BinaryMetrics`` histogram; the histograms are summed on the servers (``ctr_report.merge_global``)
into the global AUC, logloss, COPC and accuracy at 0.5.

With one, GAUC, UAUC and the positive/negative order ratio (``engine.group_metrics``) need every group
whole on one worker. Each worker reads the whole test split and keeps only the rows whose group it owns
(``owned_mask(groups, rank, num_workers)``, a fixed hash of the group id): the groups partition the
rows, so every test row is still scored exactly once over all workers and the global histogram is the
same sum as without grouping (only which worker scores a row changes). A worker scores its rows once and
feeds the same predictions to both accumulators::

    worker w:  for each record batch of the whole test split (``eval_batch_size`` rows):
                   keep rows with owner_of(group) == w  ->  dedup -> pull -> predict -> probs float32[b]
                   histogram.update(probs, labels);  groups.update(probs, labels, group ids)
               add_metric(metrics_table + ".groups", counts int64[7], sums float64[2])   # exact sums
               merge_global(histogram)        # adds it, barrier, rank 0 reads and resets, barrier
    rank 0:    read and reset metrics_table + ".groups"  ->  GroupMetrics.from_parts(...).summary()

Every worker added its group parts before the first barrier of ``merge_global``, so rank 0's read after
it sees all of them; the next add comes after the next evaluation's start barrier, which rank 0 reaches
only after its reset. Reading costs each worker the whole test split (decode only: scoring, the
expensive part, is split). Group ids are integers of any width, or strings hashed to uint64 keys as a
sparse slot's values are (``streaming.keys.hash_array``, slot 0; the empty string is one group).

Reported (rank 0's eval summary, the metrics file's ``eval`` event, the final JSON line as ``test_*``):
``gauc`` (impression-weighted mean of per-group AUCs, single-class groups skipped: XDL), ``uauc`` (their
plain mean), ``pn_ratio`` (Paddle's positive/negative order ratio: pairs within a group ranked right /
ranked wrong, ties in neither; ``inf`` -> null when nothing is wrong), ``gauc_groups``,
``gauc_impressions``, ``groups``, ``pairs_right``, ``pairs_wrong``, ``pairs_tied``.
"""
from __future__ import annotations

import logging

import pyarrow as pa

from streaming import keys
from streaming.source import ArrowSource, list_files
from streaming.values import first

from ..group_metrics import GroupMetrics, owned_mask
from ..metrics import BinaryMetrics
from .ctr_data import check_values, group_column_type, make_source, string_slots
from .ctr_report import EVAL_BUCKETS, merge_global

log = logging.getLogger(__name__)

#: the servers' accumulator of the group parts: ``model.metrics_table`` + this suffix
GROUP_SUFFIX = ".groups"
#: the slot whose hash turns string group ids into uint64 ids
GROUP_HASH_SLOT = 0


def eval_schema(schema: pa.Schema, column: str, path: str, storage_options=None) -> pa.Schema:
    """The columns evaluation reads: ``schema`` (the model's) plus the grouping ``column`` of the test
    split ``path``, with the type it has there (integer ids as they are; string ids are hashed by
    ``group_ids`` after ``eval_check`` has looked for nulls).

    Raises
    ------
    ConfigError
        As ``ctr_data.group_column_type`` (missing column, bad type; names the key and the file).
    """
    t = group_column_type(path, column, storage_options)
    if column in schema.names:            # a sparse slot used as the group (hashed to uint64 keys on read)
        return schema
    return schema.append(pa.field(column, t))


def eval_check(column: str):
    """The ``ArrowSource`` check of the test split: ``ctr_data.check_values`` (label, dense, keys), and
    first a null group id in ``column`` when grouping (``""``: none) -> ``check(rb) -> (column, row,
    reason) or None``; ``ArrowSource`` raises ``DataFormatError`` naming the file, its row and the column."""
    def check(rb: pa.RecordBatch):
        if column:
            col = rb.column(column)
            if col.null_count:
                return (column, first(col.is_null()), "expected a group id (model.data.group_column), got null: "
                                                      "every test row needs a group")
        return check_values(rb)
    return check


def group_ids(col: pa.Array):
    """uint64/int64[b] group ids of a (null-free) grouping column: integers as they are, strings hashed
    to uint64 keys as a sparse slot's values are (``GROUP_HASH_SLOT``; the empty string is one group)."""
    if pa.types.is_integer(col.type):
        return col.to_numpy()
    return keys.hash_array(GROUP_HASH_SLOT, col, empty_is_missing=True)


def eval_source(path: str, schema: pa.Schema, column: str, *, batch_size: int, prefetch: int,
                storage_options=None) -> ArrowSource:
    """The whole test split ``path`` with the columns ``schema`` names (``eval_schema`` when grouping by
    ``column``), raw string slots hashed and every value checked (``eval_check``); ``storage_options``
    reach a URI ``path``'s store."""
    return ArrowSource(list_files(path, storage_options=storage_options), batch_size=batch_size, schema=schema,
                       string_slots=string_slots(schema), prefetch=prefetch, check=eval_check(column))


def check_test_split(data, schema: pa.Schema, storage_options=None, files=None) -> int:
    """Launcher side, before any process starts: read the whole test split once and check every value
    evaluation will read (label, dense, keys, group ids), so bad test data fails the job before training
    rather than after it -> rows of the test split. ``files``: the split as ``list_files`` listed it (None:
    list ``data.test_path``).

    Raises
    ------
    streaming.errors.DataFormatError
        A value evaluation cannot use (names the file, its row and the column), or an unreadable input.
    streaming.errors.SchemaError, ConfigError
        A missing or mistyped column (the group column: ``eval_schema``).
    """
    column = data.group_column
    if column:
        schema = eval_schema(schema, column, data.test_path, storage_options)
    src = eval_source(data.test_path if files is None else files, schema, column, batch_size=1 << 16,
                      prefetch=0, storage_options=storage_options)
    return sum(rb.num_rows for rb in src.batches(0))


class Evaluation:
    """One worker's evaluation of the test split (module docstring).

    Parameters
    ----------
    trainer : engine.programs.ctr.CTRTrainer
        Supplies ``cfg``, ``client``, ``mode``, ``model``, ``schema``, ``rank``, ``num_workers``,
        ``read`` and ``dedup``.

    Raises
    ------
    ConfigError
        ``model.data.group_column`` names a column the test split lacks (or holds with a bad type).
    """

    def __init__(self, trainer):
        self.t = trainer
        p = trainer.cfg
        self.column = p.data.group_column
        self.group_table = p.metrics_table + GROUP_SUFFIX
        self.schema = trainer.schema
        if self.column and p.data.test_path:     # no path: the worker's run() names what is missing
            self.schema = eval_schema(trainer.schema, self.column, p.data.test_path, trainer.storage_options)

    def reset(self) -> None:
        """Rank 0 removes what an earlier run left in the group accumulator (call before the barrier of
        ``ctr_report.reset_metrics``, which orders it before any worker's first add)."""
        if self.column and self.t.rank == 0:
            self.t.client.reset_metric(self.group_table)

    def batches(self):
        """This worker's evaluation rows -> iterator of (CTRBatch, group ids uint64/int64[b] or None).

        Raises
        ------
        streaming.errors.DataFormatError
            A value evaluation cannot use (a null group id among them): names the file, row and column.
        """
        t, p = self.t, self.t.cfg
        if not self.column:
            src = make_source(p.data.test_path, batch_size=p.eval_batch_size, schema=t.schema, rank=t.rank,
                              num_workers=t.num_workers, prefetch=p.prefetch, storage_options=t.storage_options)
            for rb in src.batches(0):
                yield t.read(rb), None
            return
        src = eval_source(p.data.test_path, self.schema, self.column, batch_size=p.eval_batch_size,
                          prefetch=p.prefetch, storage_options=t.storage_options)
        for rb in src.batches(0):
            groups = group_ids(rb.column(self.column))
            mask = owned_mask(groups, t.rank, t.num_workers)
            if not mask.any():
                continue
            if not mask.all():
                rb = rb.filter(pa.array(mask))
                groups = groups[mask]
            yield t.read(rb), groups

    def score(self, tag: str) -> dict | None:
        """Score this worker's rows and merge every worker's parts on the servers (all workers call it
        with the same ``tag``, after the evaluation's start barrier and with the dense parameters
        loaded). Returns the global summary on rank 0 (``BinaryMetrics.summary()`` plus the group
        metrics when grouping), None elsewhere."""
        t, p = self.t, self.t.cfg
        local = BinaryMetrics(EVAL_BUCKETS)
        per_group = GroupMetrics(t.rank, t.num_workers) if self.column else None
        for batch, groups in self.batches():
            uniq, rows, segments, _, _ = t.dedup(batch)
            emb = t.client.pull(p.sparse_table, uniq)     # unknown keys read zeros, nothing created
            probs = t.model.predict(emb, rows, segments, batch.dense)
            local.update(probs, batch.labels)
            if per_group is not None:
                per_group.update(probs, batch.labels, groups)
        if per_group is not None:            # before merge_global's first barrier (module docstring)
            t.client.add_metric(self.group_table, *per_group.to_parts())
        summary = merge_global(t.client, t.mode, p.metrics_table, local, tag)
        if summary is not None and per_group is not None:
            merged = GroupMetrics.from_parts(*t.client.read_metric(self.group_table))
            t.client.reset_metric(self.group_table)
            summary.update(group_summary(merged, summary["count"]))
        return summary


def group_summary(merged: GroupMetrics, count: int) -> dict:
    """The reported group fields of the merged parts (module docstring). ``count``: the global
    histogram's rows, which the groups must cover exactly; when they do not (a worker's parts lost or
    added twice: an accumulator fault, never a data problem) an error is logged and ``group_rows``
    says how many rows the group metrics cover."""
    s = merged.summary()
    out = {"gauc": s["gauc"], "uauc": s["uauc"], "pn_ratio": s["pos_neg_order_ratio"],
           "gauc_groups": s["gauc_groups"], "gauc_impressions": s["gauc_impressions"], "groups": s["groups"],
           "pairs_right": s["pairs_right"], "pairs_wrong": s["pairs_wrong"], "pairs_tied": s["pairs_tied"]}
    if s["rows"] != count:
        log.error("group metrics cover %d rows but the global histogram %d: the group accumulator lost or "
                  "double-counted a worker's parts", s["rows"], count)
        out["group_rows"] = s["rows"]
    return out


def describe(summary: dict) -> str:
    """The group part of the evaluation log line ("" without grouping)."""
    if "gauc" not in summary:
        return ""
    return (f", GAUC {summary['gauc']:.4f} UAUC {summary['uauc']:.4f} pos/neg order ratio "
            f"{summary['pn_ratio']:.4f} ({summary['gauc_groups']} of {summary['groups']} groups)")


def final_fields(test: dict) -> dict:
    """``test_gauc``, ``test_uauc``, ``test_pn_ratio`` of rank 0's final summary for the final JSON line
    (empty without grouping)."""
    if "gauc" not in test:
        return {}
    return {"test_gauc": test["gauc"], "test_uauc": test["uauc"], "test_pn_ratio": test["pn_ratio"]}

