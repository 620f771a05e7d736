"""Checkpoint names, listing and manifests.

Layout under a job root (``{root}/{job}``)::

    20240101/0000-base/                       a base: every row of every sparse table
        sparse/emb/g03-s0001-j02.arrow        rows of vshard group 3 written by server 1, local shard 2
        dense/dense/s0001.arrow               the dense blocks server 1 held (params + Adam state)
        _parts/s0001.json                     what server 1 wrote (merged into the manifest)
        manifest.json                         files + sizes + CRC-32, row counts, parent, config, ...
        _SUCCESS                              written last; without it the checkpoint does not exist
    20240101/0100-delta/                      rows changed since the parent + tombstones
        sparse/emb/g03-s0001-j02.arrow
        tombstones/emb/s0001.arrow            keys with a row at the parent and none now (one uint64 column "key")
    20240101/0100-delta.2/                    a second checkpoint in the same minute (tests, fast jobs)

Names sort by ``(day, HHMM, sequence)``: ``0100-base`` < ``0100-delta.1`` < ``0100-delta.2`` <
``0101-delta``. The chain of a checkpoint is explicit: every delta's manifest names its ``parent`` and
its ``base``, so restore never guesses from names.

Manifest fields added to the ones ``hdfs_io`` writes (``files``, ``checksum``, ...)::

    checkpoint_format  1
    kind               "base" | "delta"
    name               "20240101/0100-delta"
    parent, base       names (null for a base's parent)
    chain_index        0 for a base, parent's + 1 for a delta
    hash_version       streaming.keys.HASH_VERSION
    num_vshards, groups, num_servers     how the part files were cut
    tables             {"sparse": {name: {"rows", "tombstones", "dim", "optimizer", "state_width"}},
                        "dense": {name: {"size"}}}
    step               training step (int)
    sources            {source name: position dict (partition, file_index, batch_index, row)}
    config             the engine config snapshot (YAML mapping)
    extra              caller metadata (e.g. "consumed": partitions consumed since the parent)
"""
from __future__ import annotations

import datetime as _dt
import logging
import re
from dataclasses import dataclass
from typing import Any

import hdfs_io
from hdfs_io import CheckpointCorruptError, NotPublishedError, Storage

__all__ = ["FORMAT_VERSION", "DEFAULT_GROUPS", "CheckpointRef", "checkpoint_name", "parse_name",
           "list_checkpoints", "read_checkpoint_manifest", "chain_of", "kind_of_uri"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
#: vshard groups per sparse table: part files are cut by group, so N writers load onto M readers
DEFAULT_GROUPS = 16
KINDS = ("base", "delta")

_DAY_RE = re.compile(r"^\d{8}$")
_NAME_RE = re.compile(r"^(\d{4})-(base|delta)(?:\.(\d+))?$")


@dataclass(frozen=True, order=True)
class CheckpointRef:
    """One checkpoint directory, ordered by time then sequence.

    Attributes
    ----------
    day : str
        ``YYYYMMDD``.
    hhmm : str
        ``HHMM``.
    seq : int
        0 for the first checkpoint of that minute, then 1, 2, ...
    kind : str
        ``base`` or ``delta``.
    """

    day: str
    hhmm: str
    seq: int
    kind: str

    @property
    def name(self) -> str:
        """Path below the job root: ``20240101/0100-delta`` or ``20240101/0100-delta.2``."""
        suffix = f".{self.seq}" if self.seq else ""
        return f"{self.day}/{self.hhmm}-{self.kind}{suffix}"

    def __str__(self) -> str:
        return self.name


def checkpoint_name(when: _dt.datetime, kind: str, seq: int = 0) -> CheckpointRef:
    """The reference of a checkpoint taken at ``when``, named in UTC: a naive ``when`` is UTC, one that
    carries another time zone is converted (before, it was named in that zone's local time: an hour of a
    DST change named twice, names out of order with other writers').

    Raises
    ------
    ValueError
        ``kind`` is not ``base``/``delta``.
    """
    if kind not in KINDS:
        raise ValueError(f"checkpoint kind must be one of {KINDS}, got {kind!r}")
    if when.tzinfo is not None:
        when = when.astimezone(_dt.timezone.utc)
    return CheckpointRef(when.strftime("%Y%m%d"), when.strftime("%H%M"), int(seq), kind)


def parse_name(name: str) -> CheckpointRef | None:
    """``"20240101/0100-delta.2"`` -> CheckpointRef; None when the name is not a checkpoint's."""
    parts = name.strip("/").split("/")
    if len(parts) != 2 or not _DAY_RE.match(parts[0]):
        return None
    m = _NAME_RE.match(parts[1])
    if not m:
        return None
    return CheckpointRef(parts[0], m.group(1), int(m.group(3) or 0), m.group(2))


def ref_of_uri(uri: str) -> CheckpointRef | None:
    """The reference of a checkpoint directory URI from its last two components
    (``.../ctr/20240101/0100-delta.2`` -> ``20240101/0100-delta.2``); None when they are not a
    checkpoint's name (a job root, say)."""
    return parse_name("/".join(uri.rstrip("/").split("/")[-2:]))


def kind_of_uri(uri: str) -> str:
    """``base`` or ``delta`` from the last path component of a checkpoint directory URI.

    Raises
    ------
    ValueError
        The URI does not end in a checkpoint directory name.
    """
    last = uri.rstrip("/").rsplit("/", 1)[-1]
    m = _NAME_RE.match(last)
    if not m:
        raise ValueError(f"expected a checkpoint directory URI ending in HHMM-base or HHMM-delta[.N], got {uri!r}")
    return m.group(2)


def list_checkpoints(storage: Storage, *, complete_only: bool = True) -> list[CheckpointRef]:
    """Checkpoints under a job root, oldest first.

    Parameters
    ----------
    storage : Storage
        Rooted at ``{root}/{job}``.
    complete_only : bool
        Skip directories without ``_SUCCESS`` (they do not exist for readers).
    """
    try:
        days = [d for d in storage.listdir("") if _DAY_RE.match(d)]
    except FileNotFoundError:
        return []
    out = []
    for day in days:
        names = hdfs_io.list_complete(storage, day) if complete_only else _listdir(storage, day)
        for n in names:
            ref = parse_name(f"{day}/{n}")
            if ref is not None:
                out.append(ref)
    return sorted(out)


def _listdir(storage: Storage, path: str) -> list[str]:
    try:
        return storage.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_checkpoint_manifest(storage: Storage, name: str) -> dict[str, Any]:
    """The manifest of a published checkpoint, with the checkpoint fields checked.

    Raises
    ------
    NotPublishedError
        No ``_SUCCESS``.
    CheckpointCorruptError
        The manifest is missing, invalid, or is not a checkpoint manifest of this format (names it).
    """
    manifest = hdfs_io.read_manifest(storage, name)
    uri = storage.uri_of(hdfs_io.join(name, hdfs_io.MANIFEST_NAME))
    if manifest.get("checkpoint_format") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{uri}: expected checkpoint_format {FORMAT_VERSION}, got {manifest.get('checkpoint_format')!r}",
            uri=uri)
    for key, typ in (("kind", str), ("name", str), ("num_vshards", int), ("groups", int),
                     ("tables", dict), ("chain_index", int)):
        if not isinstance(manifest.get(key), typ):
            raise CheckpointCorruptError(f"{uri}: field {key!r} missing or not a {typ.__name__}", uri=uri)
    if manifest["kind"] not in KINDS or (manifest["kind"] == "delta" and not manifest.get("parent")):
        raise CheckpointCorruptError(f"{uri}: bad kind/parent ({manifest['kind']!r}, {manifest.get('parent')!r})",
                                     uri=uri)
    return manifest


def chain_of(storage: Storage, name: str) -> list[dict[str, Any]]:
    """Manifests from the base to ``name`` (base first), following ``parent`` links.

    Raises
    ------
    NotPublishedError
        A checkpoint of the chain has no ``_SUCCESS`` (e.g. deleted by retention).
    CheckpointCorruptError
        A manifest is damaged, or the links form no chain ending at a base.
    """
    chain = []
    cur: str | None = name
    while cur is not None:
        try:
            m = read_checkpoint_manifest(storage, cur)
        except NotPublishedError as e:
            if not chain:
                raise
            child = chain[-1]["name"]
            what = "is missing" if not storage.exists(cur) else "has no _SUCCESS marker"
            raise NotPublishedError(f"{storage.uri_of(cur)}, the parent of {storage.uri_of(child)} (the chain "
                                    f"of {storage.uri_of(name)}), {what}: the chain cannot be restored (deleted "
                                    f"by retention or by hand?); use a checkpoint whose chain is complete, "
                                    f"e.g. a newer base", uri=storage.uri_of(cur)) from e
        chain.append(m)
        if m["kind"] == "base":
            break
        parent = m["parent"]
        if len(chain) > 100_000 or parent == cur:
            raise CheckpointCorruptError(f"{storage.uri_of(cur)}: parent links do not end at a base",
                                         uri=storage.uri_of(cur))
        cur = parent
    chain.reverse()
    for i, m in enumerate(chain):
        if m["chain_index"] != i:
            uri = storage.uri_of(m["name"])
            raise CheckpointCorruptError(f"{uri}: chain_index {m['chain_index']} but it is delta #{i} "
                                         f"after base {chain[0]['name']}", uri=uri)
    return chain


def is_published(storage: Storage, name: str) -> bool:
    """True when checkpoint ``name`` has its ``_SUCCESS`` marker."""
    try:
        return hdfs_io.is_complete(storage, name)
    except NotPublishedError:
        return False
