"""Role mode's check of the CTR inputs before the first step: what the launcher's ``prepare`` hook does
for ``engine train CONFIG`` (``ctr_data.check_train_split``, ``ctr_eval.check_test_split``), done by the
workers themselves when a scheduler starts them (``--role worker`` without a launcher: ``engine k8s``,
Slurm, a manual multi-host run).

Without it a bad value deep in a file (a label outside [0, 1], a NaN dense value, a null key) was found
by the one worker that read it, in the middle of an epoch: that worker exited 2, its peers trained on
and then waited at their next barrier until ``client.barrier_timeout_s`` (a lockstep mode's next step,
async mode's finish) and exited 1 with a traceback, and the servers held the partial epoch. A repaired
file could not resume the job's checkpoints either (positions taken on the file as it was).

Who checks what (``check_before_training``, called by every worker after the start's barriers and
before its first step)::

    worker w:  read its own rows of the train split (ctr_data.make_source with file_rows: the rows it
               trains, every value a worker checks) and its share of the test split (files, or record
               batches, w::W; the values evaluation reads, group ids included)
               a bad value (DataFormatError / SchemaError): its description goes to the accumulator
               {metrics_table}.input-check.{w} on the servers, and a 1 to index w of
               {metrics_table}.input-check (int64[W]); a clean shard adds 0 there (and its row counts);
               a check failing for another reason (the store, a missing group column) a 2, and that
               worker raises its error after the barrier, its peers a LaunchError naming it
               barrier input-check                       nobody steps before every worker has checked
               read {metrics_table}.input-check: any 1 -> read those workers' descriptions and raise the
               first bad value in reading order (train before test, then file, then row), the one the
               launcher's check names, on EVERY worker

So the check is parallel (each row is read once, by the worker that trains it), nothing is trained
before the verdict, and every worker ends with the same one line (``engine train: bad input data:
FILE: row N: field F: ...``) and exit code 2, which ``engine k8s``'s podFailurePolicy fails the Job on
(no restart: a restart reads the same file). A worker that dies during its check never arrives, as
any peer that dies (its peers time out at the barrier, or its restarted self fences them).

The accumulators are written once per generation of the servers: every later attempt of the workers
against the same servers goes through a roll-back (``engine.roles``), which changes the generation and
drops them (``engine.ps.metric_sums``), so no verdict is read twice or counted from an earlier attempt.

A resumed or restarted worker checks again, unless the job's input records (``ctr_records``, in its
checkpoint directory) say that these files, at these versions, passed the same checks at an earlier
start: worker 0 records that once every share passed and every worker saw the same versions (a flag 3
at the verdict: clean by the record). A file written again since has another version, so it is read and
checked again; without checkpoints every start checks. The launcher's own check (``check_splits``, for
``engine train CONFIG``, ``--resume`` included) uses the same records. A child of a launcher
(``ENGINE_PARENT_PID`` set: local, Ray, MPI) skips the check here: its launcher checked everything
before any process started.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np
import pyarrow as pa

from streaming.errors import DataFormatError, SchemaError
from streaming.inputs import InputChangedError
from streaming.source import ArrowSource, list_files

from .. import progress
from ..errors import LaunchError
from . import ctr_eval
from .ctr_data import check_train_files, files_fingerprint, make_source, string_slots
from .ctr_records import Listing, Records, check_key

log = logging.getLogger(__name__)

#: the accumulators' name after ``model.metrics_table``: the flags, and ``.{rank}`` each finder's description
SUFFIX = ".input-check"
#: rows per record batch read by the check (as the launcher's)
CHECK_BATCH_ROWS = 1 << 16
#: the longest description (bytes of JSON) a worker publishes; a longer reason is cut
MAX_DESCRIPTION_BYTES = 8192
#: the accumulator of the workers' digests of their train listings: ``model.metrics_table`` + this
FILES_SUFFIX = ".input-files"
#: the accumulator of the versions each worker checked: ``model.metrics_table`` + ``SUFFIX`` + this
VERSIONS_SUFFIX = ".versions"
#: the splits, in the order the launcher checks them
SPLITS = ("train", "test")


def launched() -> bool:
    """This process is a child of a launcher (``ENGINE_PARENT_PID``, as ``engine.roles`` tells them
    apart), whose ``prepare`` hook checked every input before any process started."""
    return bool(os.environ.get("ENGINE_PARENT_PID"))


def check_splits(cfg, data, schema: pa.Schema, storage_options=None) -> tuple[int, int | None]:
    """The launcher's check of both splits (``ctr.prepare``): every train value a worker checks
    (``ctr_data.check_train_files``) and every test value evaluation reads (``ctr_eval.check_test_split``),
    unless the job's input records (``ctr_records``) say these files at these versions passed the same
    checks -> (train rows, test rows or None when not counted now). Records what it learned: the checks
    passed, the train files' rows and fingerprint (the workers then read neither again at their start).

    ``cfg``: the whole engine config (its checkpoint directory holds the records); ``data``: the resolved
    ``model.data`` (``ctr_data.prepare_data``).

    Raises
    ------
    streaming.errors.DataFormatError, streaming.errors.SchemaError, engine.errors.ConfigError
        As ``check_train_split`` and ``check_test_split``.
    """
    records = Records.of(cfg)
    train = Listing(records, "train", list_files(data.train_path, storage_options=storage_options))
    key, facts = check_key("train", schema), {}
    if train.checked(key) and train.rows is not None:
        rows = sum(train.rows)
        log.info("train split %s: values checked by an earlier start, the files unchanged since (%d files, %d "
                 "rows; %s)", data.train_path, len(train.files), rows, records.storage.uri_of(""))
    else:
        per_file = check_train_files(train.files, schema)
        rows, facts = sum(per_file), {"rows": per_file, "checked": [key]}
    if records.enabled and train.fingerprint is None:      # every worker's start needs it
        facts["fingerprint"] = files_fingerprint(train.files)
    if facts:
        train.record(**facts)
    test = Listing(records, "test", list_files(data.test_path, storage_options=storage_options))
    key = check_key("test", schema, data.group_column)
    if test.checked(key):
        log.info("test split %s: values checked by an earlier start, the files unchanged since (%d files)",
                 data.test_path, len(test.files))
        return rows, None
    test_rows = ctr_eval.check_test_split(data, schema, storage_options, files=test.files)
    test.record(checked=[key])
    return rows, test_rows


def check_shard(data, schema: pa.Schema, rank: int, num_workers: int, train_file_rows,
                storage_options=None, train_files=None, test_files=None) -> tuple[int, int]:
    """Read worker ``rank``'s share of the inputs and check every value, as the launcher's checks do for
    all of them -> (train rows, test rows) read.

    Train: the rows ``rank`` trains (``ctr_data.make_source`` with ``train_file_rows``, ``int[F]``: the
    rows of each train input), every value a worker checks (``ctr_data.check_values``). Test: files (or,
    with fewer files than workers, record batches) ``rank::num_workers``, every value evaluation reads
    (``ctr_eval.eval_check``: with ``data.group_column``, null group ids too). Rows named in an error
    are rows of the file (1-based), whatever the share. ``storage_options`` reach URI inputs' store
    (``streaming.inputs``). ``train_files``: the train inputs as the trainer listed them (``list_files``:
    the listing its row counts, fingerprint and pinned versions come from); None lists ``data.train_path``;
    ``test_files`` alike for ``data.test_path``.

    Raises
    ------
    streaming.errors.DataFormatError, streaming.errors.SchemaError
        The first bad value or input of the share, named with the file, the row and the column.
    engine.errors.ConfigError
        The grouping column is missing from the test split or of a bad type (``ctr_eval.eval_schema``).
    """
    train = make_source(data.train_path if train_files is None else train_files, batch_size=CHECK_BATCH_ROWS,
                        schema=schema, rank=rank,
                        num_workers=num_workers, prefetch=0, file_rows=train_file_rows,
                        storage_options=storage_options)
    train_rows = 0
    for rb in train.batches(0):
        train_rows += rb.num_rows
        progress.current().moved()      # a long read is progress, not a hang (engine.liveness)
    column = data.group_column
    test_schema = ctr_eval.eval_schema(schema, column, data.test_path, storage_options) if column else schema
    files = list_files(data.test_path, storage_options=storage_options) if test_files is None else test_files
    test = ArrowSource(files, batch_size=CHECK_BATCH_ROWS, schema=test_schema,
                       string_slots=string_slots(test_schema), prefetch=0, shard=(rank, num_workers),
                       shard_by="files" if len(files) >= num_workers else "batches",
                       check=ctr_eval.eval_check(column))
    test_rows = 0
    for rb in test.batches(0):
        test_rows += rb.num_rows
        progress.current().moved()
    return train_rows, test_rows


def check_before_training(trainer) -> None:
    """Role mode: every worker checks its share of the inputs (``check_shard``), and the workers agree
    on the verdict before any of them steps (module docstring). Call it on every worker, after the
    barriers of the start (``Mode.init_dense``, ``ctr_report.reset_metrics``) and before the first
    step. Does nothing in a child of a launcher (``launched``).

    ``trainer``: an ``engine.programs.ctr.CTRTrainer`` (``cfg``, ``schema``, ``rank``, ``num_workers``,
    ``client``, ``mode`` and ``file_rows`` set).

    Raises
    ------
    streaming.errors.DataFormatError, streaming.errors.SchemaError
        On every worker, when any worker found a bad value: the first in reading order (train split
        before test split, then file, then row), with the launcher's message (file, row, column).
    Exception
        The worker's own check failing for another reason (a store that does not answer,
        ``streaming.inputs.InputUnavailableError``; a missing group column, ``ConfigError``): raised
        after the barrier, so its peers do not wait for it.
    engine.errors.LaunchError
        On the peers of such a worker (none found bad data): names it (exit 1, a restart).
    engine.errors.BarrierTimeoutError
        A worker did not reach the verdict within ``client.barrier_timeout_s`` (it died while checking).
    """
    if launched():
        return
    p, rank, workers = trainer.cfg, trainer.rank, trainer.num_workers
    client, name = trainer.client, p.metrics_table + SUFFIX
    found, failed, rows, recorded = None, None, (0, 0), False
    train_files = getattr(trainer, "train_files", None)
    train = getattr(trainer, "train_listing", None)     # ctr_records.Listing of train_files
    test = None
    keys = (check_key("train", trainer.schema), check_key("test", trainer.schema, p.data.group_column))
    try:
        test = Listing(train.records if train is not None else Records(None), "test",
                       list_files(p.data.test_path, storage_options=trainer.storage_options))
        recorded = train is not None and train.checked(keys[0]) and test.checked(keys[1])
        if recorded:        # these files at these versions passed every check at an earlier start
            log.info("worker %d: its share of the inputs was checked at an earlier start of the job, the files "
                     "unchanged since (input records: %s); not read again", rank, train.records.storage.uri_of(""))
        else:
            rows = check_shard(p.data, trainer.schema, rank, workers, trainer.file_rows, trainer.storage_options,
                               train_files=train_files, test_files=test.files)
    except (DataFormatError, SchemaError) as e:
        found = e
        log.error("worker %d: bad input data in its share of the inputs: %s; every worker ends with it once "
                  "every worker has checked (nothing is trained)", rank, e)
        try:
            files = data_files(p.data, trainer.storage_options, train_files, test.files if test else None)
        except Exception:  # noqa: BLE001 - the test split's listing failed: the error still goes out, ordered last
            files = ([], [])
        client.add_metric(f"{name}.{rank}", encode(e, files), np.zeros(0, np.float64))
    except Exception as e:  # noqa: BLE001 - not bad data: raised after the barrier, its peers told of it
        failed = e
        log.error("worker %d: the check of its share of the inputs failed (not bad data): %s: %s", rank,
                  type(e).__name__, e)
    flags = np.zeros(workers, np.int64)
    flags[rank] = 1 if found is not None else 2 if failed is not None else 3 if recorded else 0
    client.add_metric(name, flags, np.array(rows, np.float64))
    versions = test is not None and train is not None and train.records.enabled
    if versions:        # which versions this worker's verdict is about: worker 0 records the verdict only if
        #                 every worker saw the same ones (not per-host copies of the files that differ)
        client.add_metric(name + VERSIONS_SUFFIX, _digest_at([train.versions, test.versions], rank, workers),
                          np.zeros(0, np.float64))
    trainer.mode.barrier("input-check")         # every worker's verdict is in
    flags, sums = client.read_metric(name)
    finders = [int(w) for w in np.flatnonzero(flags == 1)]
    broken = [int(w) for w in np.flatnonzero(flags == 2)]
    if failed is not None and not finders:
        raise failed
    if broken and not finders:
        raise LaunchError(f"worker{'s' * (len(broken) > 1)} {', '.join(map(str, broken))}: the check of "
                          f"{'their' if len(broken) > 1 else 'its'} share of the inputs failed before training "
                          f"(not bad data: {'their logs name' if len(broken) > 1 else 'its log names'} why); "
                          f"this worker stops too, nothing was trained", role="worker", rank=broken[0],
                          exit_code=1)
    if not finders:
        if rank == 0 and (flags != 3).any():
            log.info("inputs checked by %d worker(s) before training: train split %s: %d rows; test split %s: "
                     "%d rows", workers, p.data.train_path, int(sums[0]), p.data.test_path, int(sums[1]))
            seen = client.read_metric(name + VERSIONS_SUFFIX)[0] if versions else None
            if seen is not None and (seen == seen[0]).all() and seen[0] != 0:    # every share passed, same files
                train.record(checked=[keys[0]])
                test.record(checked=[keys[1]])
        return
    errors = {w: decode(client.read_metric(f"{name}.{w}")[0]) for w in finders}
    by = min(finders, key=lambda w: (errors[w][0], w))
    first = errors[by][1]
    if by != rank:
        log.error("worker %d: worker %d found bad input data before training (%d worker(s) found some): %s; "
                  "nothing was trained", rank, by, len(finders), first)
    raise first


def agree_on_files(trainer) -> None:
    """Every worker lists the train files itself when it starts (``CTRTrainer.run``), and splits the rows
    by the counts of its own listing: a file added, removed or written between two workers' listings (a
    pipeline still writing the directory) gave them other splits, rows to two workers or to none,
    silently. Each worker puts a digest of its listing (``ctr_data.files_fingerprint``: names, sizes,
    CRCs) at its index of ``{metrics_table}.input-files`` (``int64[W]``), and after the barrier
    ``input-files`` every worker compares them. Accumulators go with the servers' generation, as
    ``check_before_training``'s do. One worker: nothing to agree on.

    ``trainer``: an ``engine.programs.ctr.CTRTrainer`` (``cfg``, ``rank``, ``num_workers``, ``client``,
    ``mode``, ``train_fingerprint`` set).

    Raises
    ------
    streaming.inputs.InputChangedError
        On every worker, when the listings differ: names ``model.data.train_path`` and the workers whose
        listing differs from worker 0's; nothing was trained (exit 2, not restarted into a directory
        still being written).
    engine.errors.BarrierTimeoutError
        A worker did not arrive within ``client.barrier_timeout_s``.
    """
    workers, rank = trainer.num_workers, trainer.rank
    if workers == 1:
        return
    name = trainer.cfg.metrics_table + FILES_SUFFIX
    trainer.client.add_metric(name, _digest_at(trainer.train_fingerprint, rank, workers), np.zeros(0, np.float64))
    trainer.mode.barrier("input-files")
    seen = trainer.client.read_metric(name)[0]
    other = [w for w in range(workers) if seen[w] != seen[0]]
    if not other:
        return
    path = trainer.cfg.data.train_path
    raise InputChangedError(path, f"expected every worker to list the same train files, got {len(other)} of "
                                  f"{workers} workers (worker{'s' * (len(other) > 1)} "
                                  f"{', '.join(map(str, other))}) listing other files than worker 0 "
                                  f"({len(trainer.train_fingerprint)} files here, on worker {rank}): files were "
                                  f"added, removed or written while the job started, and each worker would split "
                                  f"the rows by its own counts (rows to two workers or to none); nothing was "
                                  f"trained. Start the job again once {path} holds its final files (new data is "
                                  f"best written under new names, in a new directory)", field="<listing>")


def _digest_at(value, rank: int, workers: int) -> np.ndarray:
    """``int64[workers]``, zero but at ``rank``: 56 bits of the SHA-256 of ``value``'s JSON, plus 1 (never
    0, an index nobody wrote): a worker's share of an accumulator the workers compare after a barrier."""
    raw = hashlib.sha256(json.dumps(value).encode()).digest()
    out = np.zeros(workers, np.int64)
    out[rank] = int.from_bytes(raw[:7], "little") + 1
    return out


def data_files(data, storage_options=None, train_files=None, test_files=None) -> tuple[list, list]:
    """The train and test inputs of ``data`` (``model.data``) in reading order (``list_files``), as the
    names errors give them (a path, or a URI); ``train_files``: the trainer's listing of the train split
    (None: listed now)."""
    train = list_files(data.train_path, storage_options=storage_options) if train_files is None else train_files
    test = list_files(data.test_path, storage_options=storage_options) if test_files is None else test_files
    return [str(f) for f in train], [str(f) for f in test]


def encode(e: Exception, files: tuple[list, list]) -> np.ndarray:
    """A bad-input error as ``int64[4 + n]``: ``[split, file index, row, bytes]`` (where it lies in
    reading order: ``SPLITS`` index, index into ``files[split]``, 1-based row, 0 for a schema error)
    then its JSON description, ``bytes`` long, packed 8 bytes to a count. The split is the one whose
    files name ``e.path`` (train first)."""
    split, index = next(((s, f.index(e.path)) for s, f in enumerate(files) if e.path in f), (len(SPLITS), 0))
    if isinstance(e, DataFormatError):
        desc = {"kind": "data", "path": e.path, "line": e.line, "field": e.field, "reason": e.reason,
                "unit": e.unit}
        row = e.line
    else:
        desc = {"kind": "schema", "path": e.path, "column": e.column, "expected": e.expected,
                "actual": e.actual, "message": str(e)}
        row = 0
    text = "reason" if "reason" in desc else "message"
    raw = json.dumps(desc).encode()
    for _ in range(32):                 # a very long reason is cut (the finder's own log has it whole)
        if len(raw) <= MAX_DESCRIPTION_BYTES or len(desc[text]) < 8:
            break
        desc[text] = desc[text][:len(desc[text]) // 2] + "..."
        raw = json.dumps(desc).encode()
    padded = raw + b"\0" * (-len(raw) % 8)
    return np.concatenate([np.array([split, index, row, len(raw)], np.int64), np.frombuffer(padded, "<i8")])


def decode(counts: np.ndarray) -> tuple[tuple[int, int, int], Exception]:
    """``encode``'s counts -> ((split, file index, row): the error's place in reading order, the error
    as the finder raised it: a ``DataFormatError`` or ``SchemaError`` with the same message)."""
    split, index, row, n = (int(v) for v in counts[:4])
    desc = json.loads(np.ascontiguousarray(counts[4:], "<i8").tobytes()[:n])
    if desc["kind"] == "data":
        err: Exception = DataFormatError(desc["path"], desc["line"], desc["field"], desc["reason"], unit=desc["unit"])
    else:
        err = SchemaError(desc["path"], desc["column"], desc["expected"], desc["actual"])
        err.args = (desc["message"],)           # its message as the finder's (the columns present included)
    return (split, index, row), err
