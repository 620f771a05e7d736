"""Retention of the online job's serving bundles: ``{export_root}/{YYYYMMDD}/{HHMM}-{base|delta}``.

``ctr_online`` exports a bundle after every hourly checkpoint, named as that checkpoint: a full bundle
after a base (or when no earlier export was published), else a delta against the last published bundle.
Left alone that is 24 bundles a day, each with the whole dense tower. ``prune_bundles`` keeps the
``keep_full`` newest FULL bundles and everything published after the oldest of them, and deletes the
rest: every kept delta's chain starts at a kept full bundle, because a delta is only ever made against
the newest published bundle, never against one before the newest full bundle. So a serving system
reading any of the ``keep_full`` newest chains still finds every link of it; one still reading an older
chain has had ``keep_full - 1`` full bundles (a base period each) to move on. Incomplete bundle
directories (an export that failed or was killed) older than the newest published bundle go too.

A job resumed from an older checkpoint (``--resume URI``, a roll-back) continues the chain of a bundle
of that checkpoint's chain while the bundles of the run it abandoned are still there, newer: given the
bundle just published (``current``), only bundles up to it count and may go, and every link of its own
chain stays.

Deletion removes ``_SUCCESS`` first, so a reader never loads half of a deleted bundle (it sees
``NotPublishedError``), as the checkpoint retention does (``CheckpointManager.prune``).
"""
from __future__ import annotations

import logging

import hdfs_io
from hdfs_io import Storage, StorageOptions

from ..checkpoint.coordinator import written_lately
from ..checkpoint.manifest import list_checkpoints
from .bundle import open_bundle
from .errors import BundleError

log = logging.getLogger(__name__)

__all__ = ["prune_bundles"]


def prune_bundles(root: str, keep_full: int, *, current: str | None = None,
                  storage_options: StorageOptions | None = None,
                  incomplete_grace_s: float | None = None) -> list[str]:
    """Delete the bundles under ``root`` that no chain of the ``keep_full`` newest full bundles needs.

    Parameters
    ----------
    root : str
        URI of the export root (local path, ``s3://``, ``hdfs://``).
    keep_full : int, >= 1
        Full bundles kept, with every bundle published after the oldest of them.
    current : str, optional
        The bundle just published (``YYYYMMDD/HHMM-kind``). Only bundles up to it count and may go:
        newer ones are a run the job rolled back from (``--resume`` of an older checkpoint), left as
        they are, and every link of ``current``'s own chain is kept whatever its age.
    incomplete_grace_s : float, optional
        An incomplete bundle directory whose newest file (or the directory) was modified less than this
        many seconds before the store's clock now (``hdfs_io.Storage.clock_now``; never this host's
        clock, which may be minutes from the store's) is kept (an export in flight); default
        ``INCOMPLETE_GRACE_S`` of ``engine.checkpoint.coordinator`` (600).

    Returns
    -------
    list of str
        Names deleted (``YYYYMMDD/HHMM-kind``), oldest first.

    Raises
    ------
    ValueError
        ``keep_full`` < 1.
    OSError
        A storage error (``hdfs_io.StorageError``); what was deleted before it stays deleted.
    """
    if keep_full < 1:
        raise ValueError(f"keep_full must be >= 1, got {keep_full}")
    if incomplete_grace_s is None:
        from ..checkpoint.coordinator import INCOMPLETE_GRACE_S as incomplete_grace_s
    storage = Storage.from_uri(root, storage_options=storage_options)
    published = [r for r in list_checkpoints(storage) if current is None or r.name <= current]
    full, keep = [], set()
    for ref in published:
        try:
            info = open_bundle(storage.uri_of(ref.name), storage_options=storage_options)
        except (hdfs_io.CheckpointCorruptError, hdfs_io.NotPublishedError, BundleError) as e:
            log.warning("bundle retention: %s is not a readable bundle (%s); left as it is",
                        storage.uri_of(ref.name), e)
            continue
        if not info.is_delta:
            full.append(ref)
        if ref.name == current:     # its chain's links, by their last two path parts (day/name)
            keep |= {"/".join(link["uri"].rstrip("/").split("/")[-2:]) for link in info.meta.get("chain", [])}
    cutoff = full[-keep_full] if len(full) >= keep_full else None
    done = {r.name for r in published}
    newest = published[-1] if published else None
    deleted, store_now = [], []         # the store's clock: read once, only when an incomplete one is seen
    for ref in list_checkpoints(storage, complete_only=False):
        if ref.name in keep or (current is not None and ref.name > current):
            continue
        old = cutoff is not None and ref < cutoff
        leftover = ref.name not in done and newest is not None and ref < newest
        if (old or leftover) and ref.name not in done and written_lately(storage, ref.name, incomplete_grace_s,
                                                                         store_now, "bundle retention"):
            log.info("bundle retention: keeping incomplete %s, written to less than %.0f s ago (an export in "
                     "flight?)", storage.uri_of(ref.name), incomplete_grace_s)
            continue
        if old or leftover:
            storage.delete(hdfs_io.join(ref.name, hdfs_io.SUCCESS_NAME), missing_ok=True)
            storage.delete(ref.name, missing_ok=True)
            deleted.append(ref.name)
    for day in {n.split("/")[0] for n in deleted}:
        try:
            if not storage.listdir(day):
                storage.delete(day, missing_ok=True)
        except FileNotFoundError:
            pass
    if deleted:
        log.info("bundle retention (keep %d full bundles) under %s: deleted %s", keep_full, storage.uri,
                 ", ".join(deleted))
    return deleted

