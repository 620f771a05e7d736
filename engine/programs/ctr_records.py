"""What a job has learned about its input files, kept so that a restart does not read them again.

Before its first step a CTR job reads its inputs more than once: the launcher reads every value of both
splits (``ctr_data.check_train_split``, ``ctr_eval.check_test_split``), counts the rows of each train file
(``ctr_data.file_rows``, for the progress bar and every worker's row split) and every worker
fingerprints the train files (``ctr_data.files_fingerprint``, 66 ranged reads a file); in role mode
every worker reads its whole share again (``ctr_inputs.check_before_training``). All of it was done again
at every ``engine train --resume`` and every restart of a role-mode worker: on 1000 files on S3, ~150 s of
fingerprints per worker start, and one read of the whole data set (hours for a terabyte) per resume.

A record keeps those facts for one listing of files at given versions::

    {checkpoint.root}/{job}/_inputs/{kind}-{digest}.json
        kind    train | test
        digest  SHA-256 of the files' URIs (absolute paths) and versions, in reading order
        {"format": 1, "files": [URI...], "versions": [TOKEN...], "rows": [int...] | null,
         "fingerprint": [[name, size, crc, inner]...] | null, "checked": [CHECK_KEY...], "sha256": ...}

and a later start whose listing has the same URIs at the same versions reads it instead of the files.
The version (``version_tokens``) changes whenever the content can have: on S3 the object's ETag (with its
size and modification time), on HDFS and other stores the size and modification time, on a local disk
the inode, size, modification time and status-change time (``st_ctime``, which no user tool can set
back: a file written again, ``touch``-ed or copied over with ``cp -p`` gets a new one). So a record never
stands for other bytes; a file copied elsewhere or restored from a backup just misses it and is read.

``checked`` holds the keys (``check_key``) of the value checks the files passed whole: the train split's
(``check_train_split``; role mode's, once every worker's share passed and every worker saw the same
versions) and the test split's (with the grouping column). A key changes with the schema, the grouping
column, ``CHECKS`` and the checks' source code, so a new version of the checks reads the data again.

Records are a cache, never a source of truth for the data: a record that is missing, unreadable,
garbage or for other versions is a miss (logged), and the facts are read from the files as before; a
record that cannot be written is a warning. Without checkpoints (``checkpoint.root`` empty or checkpoints
off) nothing is recorded. Deleting ``_inputs`` makes the next start read everything again; a job keeps its
``MAX_RECORDS`` newest records. Only one
process writes at a time: the launcher (before any worker starts), then worker 0 (the train rows and
fingerprint of its listing when no record had them, under a launcher too; in role mode the verdict); a local
record is written under a temporary name and renamed into place, an object store's in one PUT, and a
record cut short does not parse (a miss).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from hdfs_io import Storage, join
from streaming.inputs import RemoteInput

log = logging.getLogger(__name__)

#: the records' directory under the job's checkpoint directory (``_``: never a checkpoint's day)
RECORD_DIR = "_inputs"
#: the record layout; a record of another format is a miss
FORMAT = 1
#: the version of the value checks (``ctr_data.check_values``, ``ctr_eval.eval_check``): raise it when a
#: check is added or tightened, so that data checked by older code is read again
CHECKS = 1
#: HEAD requests (or stats) in flight at once when taking a store's versions
VERSION_REQUESTS = 16
#: records kept in a job's ``_inputs``: writing one more deletes the oldest beyond this many (a directory
#: that keeps gaining files gives each start a new listing, and so a new record)
MAX_RECORDS = 64


def version_tokens(files) -> list[str]:
    """The version of each input of ``files`` (``list_files`` entries: local paths or
    ``streaming.inputs.RemoteInput``) -> ``str[F]``: ``"ino:size:mtime_ns:ctime_ns"`` for a local file,
    ``"size:mtime_ns:etag"`` for a store's object (one HEAD on S3, ``VERSION_REQUESTS`` in flight; the
    ETag is pinned: every later read of that ``RemoteInput`` must see it, ``RemoteInput.version``).

    Raises
    ------
    FileNotFoundError
        A local file vanished since the listing.
    streaming.inputs.InputChangedError, streaming.inputs.InputUnavailableError
        A store's object written again or deleted since the listing; the store did not answer.
    """
    def one(f) -> str:
        if isinstance(f, RemoteInput):
            size, mtime_ns, etag = f.version()
            return f"{size}:{mtime_ns}:{etag.decode('ascii', 'replace') if etag is not None else ''}"
        st = os.stat(f)
        return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    if any(isinstance(f, RemoteInput) for f in files) and len(files) > 1:
        with ThreadPoolExecutor(min(VERSION_REQUESTS, len(files))) as pool:
            return list(pool.map(one, files))
    return [one(f) for f in files]


def file_uris(files) -> list[str]:
    """Each input's URI (a store's) or absolute path (a local file's): what a record names."""
    return [str(f) if isinstance(f, RemoteInput) else os.path.abspath(str(f)) for f in files]


def check_key(split: str, schema, group_column: str | None = None) -> str:
    """The key under which a split that passed its value checks is recorded: ``split`` (``train`` or
    ``test``), the expected ``schema`` (``pyarrow.Schema``), the grouping column (the test split's),
    ``CHECKS`` and the source code of the checks (``checks_digest``). 16 hex digits."""
    text = json.dumps([split, CHECKS, checks_digest(),
                       schema.to_string(show_field_metadata=False, show_schema_metadata=False), group_column or ""])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def checks_digest() -> str:
    """SHA-256 of the source of the value checks (``streaming.values``, ``ctr_data.check_values``,
    ``ctr_eval.eval_check``): an engine whose checks changed in any way, ``CHECKS`` raised or not, reads
    and checks the data again rather than trust a record an older check wrote."""
    import inspect

    from streaming import values

    from .ctr_data import check_values
    from .ctr_eval import eval_check
    text = "".join(inspect.getsource(o) for o in (values, check_values, eval_check))
    return hashlib.sha256(text.encode()).hexdigest()


class Records:
    """The records of one job (module docstring), in its checkpoint directory.

    Parameters
    ----------
    storage : hdfs_io.Storage or None
        Rooted at ``{checkpoint.root}/{job}/_inputs``; None: nothing is read or written (no checkpoints).
    """

    def __init__(self, storage: Storage | None):
        self.storage = storage

    @classmethod
    def of(cls, cfg) -> "Records":
        """The records of the job ``cfg`` (the whole engine config) configures: under its checkpoint
        directory (``checkpoint.root``, ``checkpoint.job``) with its ``storage`` options; none without
        checkpoints. A root that cannot be opened is a warning and no records."""
        ck = cfg.checkpoint
        if not (ck.enabled and ck.root):
            return cls(None)
        from ..job_checkpoints import job_name
        try:
            return cls(Storage.from_uri(ck.root, storage_options=cfg.storage.options()).sub(
                join(job_name(cfg), RECORD_DIR)))
        except Exception as e:  # noqa: BLE001 - a cache: its store failing never stops the job
            log.warning("input records under %s: %s: %s; the inputs are read without them", ck.root,
                        type(e).__name__, e)
            return cls(None)

    @property
    def enabled(self) -> bool:
        return self.storage is not None

    def name(self, kind: str, uris: list[str], versions: list[str]) -> str:
        """The record's file name for ``kind`` and a listing (``file_uris``, ``version_tokens``)."""
        digest = hashlib.sha256(json.dumps([FORMAT, uris, versions]).encode()).hexdigest()[:40]
        return f"{kind}-{digest}.json"

    def read(self, kind: str, uris: list[str], versions: list[str]) -> dict:
        """The record of ``kind`` for this listing -> its facts (``rows``, ``fingerprint``, ``checked``),
        ``{}`` when there is none, or it is unreadable, damaged or for another listing (a warning names
        it). Never raises for the store: a store that does not answer is a miss too (logged)."""
        if self.storage is None:
            return {}
        name = self.name(kind, uris, versions)
        try:
            raw = self.storage.read_bytes(name)
        except FileNotFoundError:
            return {}
        except Exception as e:  # noqa: BLE001 - a cache: read the inputs instead
            log.warning("input record %s could not be read (%s: %s); reading the inputs instead",
                        self.storage.uri_of(name), type(e).__name__, e)
            return {}
        try:
            rec = json.loads(raw)
            body = {k: rec[k] for k in ("format", "files", "versions", "rows", "fingerprint", "checked")}
            ok = (rec.get("sha256") == _digest(body) and body["format"] == FORMAT and body["files"] == uris
                  and body["versions"] == versions)
        except (ValueError, TypeError, KeyError, AttributeError):
            ok = False
        if not ok:
            log.warning("input record %s is damaged or names other files (ignored; the inputs are read and "
                        "the record written again)", self.storage.uri_of(name))
            return {}
        return {"rows": body["rows"], "fingerprint": body["fingerprint"], "checked": list(body["checked"] or [])}

    def write(self, kind: str, uris: list[str], versions: list[str], *, rows=None, fingerprint=None,
              checked=()) -> bool:
        """Write the record of a listing with these facts (``Listing.record`` merges them with those it
        read: one writer at a time, module docstring) -> whether it was written. A store that fails is a
        warning."""
        if self.storage is None:
            return False
        body = {"format": FORMAT, "files": uris, "versions": versions,
                "rows": [int(r) for r in rows] if rows is not None else None,
                "fingerprint": fingerprint, "checked": sorted(set(checked))}
        data = json.dumps({**body, "sha256": _digest(body)}).encode()
        name = self.name(kind, uris, versions)
        try:
            if self.storage.is_local:     # a rename: a reader never sees half of it
                tmp = f".{name}.{os.getpid()}.tmp"
                self.storage.write_bytes(tmp, data)
                self.storage.move(tmp, name)
            else:                         # one PUT on S3; on HDFS a record cut short does not parse
                self.storage.write_bytes(name, data)
        except Exception as e:  # noqa: BLE001 - a cache: the job goes on without it
            log.warning("input record %s could not be written (%s: %s); the next start reads the inputs again",
                        self.storage.uri_of(name), type(e).__name__, e)
            return False
        self._prune(keep=name)
        return True

    def _prune(self, keep: str) -> None:
        """Delete the oldest records (by modification time) beyond ``MAX_RECORDS``, never ``keep``; a
        failure is a warning (one LIST per record written)."""
        try:
            infos = [i for i in self.storage.children("") if i.base_name.endswith(".json")
                     and not i.base_name.startswith(".")]
            if len(infos) <= MAX_RECORDS:
                return
            infos.sort(key=lambda i: i.mtime_ns or 0)
            for info in infos[:len(infos) - MAX_RECORDS]:
                if info.base_name != keep:
                    self.storage.delete(info.base_name, missing_ok=True)
        except Exception as e:  # noqa: BLE001 - a cache: the job goes on without it
            log.warning("input records under %s could not be pruned (%s: %s)", self.storage.uri_of(""),
                        type(e).__name__, e)


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Listing:
    """One split's files as listed now, with their versions and their record's facts.

    Parameters
    ----------
    records : Records
    kind : str
        ``train`` or ``test``.
    files : list
        ``list_files`` entries, in reading order.
    """

    def __init__(self, records: Records, kind: str, files: list):
        self.records, self.kind, self.files = records, kind, files
        self.uris = file_uris(files)
        self.versions = version_tokens(files) if records.enabled else []
        self.facts = records.read(kind, self.uris, self.versions) if records.enabled else {}

    def checked(self, key: str) -> bool:
        """Whether these files at these versions passed the checks of ``key`` (``check_key``)."""
        return key in self.facts.get("checked", [])

    @property
    def rows(self) -> list[int] | None:
        """``int[F]`` recorded rows of each file, or None."""
        rows = self.facts.get("rows")
        return [int(r) for r in rows] if rows is not None and len(rows) == len(self.files) else None

    @property
    def fingerprint(self) -> list | None:
        """The recorded ``ctr_data.files_fingerprint`` of the files, or None."""
        fp = self.facts.get("fingerprint")
        return fp if fp is not None and len(fp) == len(self.files) else None

    def unchanged(self) -> bool:
        """Whether every file still has the version taken at the listing (re-taken now: a stat, or a HEAD
        on S3). A fact learned while a file changed under it must not be recorded. A store that does not
        answer counts as changed (nothing recorded)."""
        if not self.records.enabled:
            return False
        try:
            return version_tokens(self.files) == self.versions
        except Exception:  # noqa: BLE001 - deleted, rewritten, or unreachable: not the versions read
            return False

    def record(self, **facts) -> bool:
        """Record ``facts`` (``Records.write``) for this listing, if every file is still the version listed;
        the facts are kept in ``self.facts`` either way."""
        merged = dict(self.facts)
        for k in ("rows", "fingerprint"):
            if facts.get(k) is not None:
                merged[k] = facts[k]
        merged["checked"] = sorted(set(merged.get("checked", [])) | set(facts.get("checked", ())))
        self.facts = merged
        if not self.unchanged():
            return False
        return self.records.write(self.kind, self.uris, self.versions, rows=merged.get("rows"),
                                  fingerprint=merged.get("fingerprint"), checked=merged["checked"])
