"""What may be at an export's output path, and replacing a published bundle without losing it first.

``hdfs_io.Publisher`` takes any directory without ``_SUCCESS`` for the leftovers of its own crashed
publish and deletes it, and with ``overwrite`` deletes a published one before writing. An export must not
hand it anything else, so before anything at ``OUT`` is touched:

* :func:`check_bundle_target`: ``OUT`` absent is fine; a directory whose every entry has a bundle-layout
  name (:func:`is_layout_name`: ``model.json``, ``dense.npz``, ``deleted.arrow``, ``model.onnx``,
  ``manifest.json``, ``_SUCCESS``, ``embeddings/group-NNNNN-of-NNNNN.arrow``) is an export's own:
  incomplete, the leftovers of a crashed export (replaced); complete, a bundle (replaced only with
  ``overwrite``). Anything else (a file, a directory holding other names, a checkpoint, a dataset) is
  never replaced, ``overwrite`` or not: :class:`~engine.export.errors.ExportError` names ``OUT`` and
  a few of the foreign names.
* :func:`check_not_source`: ``OUT`` is not, does not contain and is not inside the source checkpoint's
  job root (which holds the checkpoint directory itself).

:func:`swap_in` (local disk only) moves a bundle published under a temporary name beside ``OUT`` over
``OUT`` in one ``renameat2(RENAME_EXCHANGE)`` (two renames where the kernel or filesystem lacks it), then
deletes the old one: a failed or killed ``--overwrite`` export leaves the old bundle in place.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import posixpath
import re

import pyarrow.fs as pafs

import hdfs_io
from hdfs_io import Storage

from .errors import ExportError

__all__ = ["is_layout_name", "check_bundle_target", "check_file_target", "check_not_source", "same_place",
           "inside", "swap_in", "remove_stale_stages", "STAGE_TAG"]

log = logging.getLogger(__name__)

_TOP = frozenset({"model.json", "dense.npz", "deleted.arrow", "model.onnx", hdfs_io.MANIFEST_NAME,
                  hdfs_io.SUCCESS_NAME})
_GROUP_RE = re.compile(r"^group-\d{5}-of-\d{5}\.arrow$")
_SHOWN = 3                  # foreign names quoted in a refusal
STAGE_TAG = "export"        # temp_names tag of a bundle staged beside OUT


def is_layout_name(rel: str) -> bool:
    """True when ``rel`` (a path relative to a bundle directory) is a name a bundle export writes."""
    if rel in _TOP or rel == "embeddings":
        return True
    head, _, tail = rel.partition("/")
    return head == "embeddings" and bool(_GROUP_RE.match(tail))


def _foreign(storage: Storage, name: str, entries: list[str]) -> list[str]:
    """Of ``entries`` (``name``'s listing), those, and the names below them, that no bundle export writes
    (at most ``_SHOWN + 1``, relative to ``name``)."""
    out = []
    for rel in entries:
        if not is_layout_name(rel):
            out.append(rel)
        elif rel == "embeddings":
            path = hdfs_io.join(name, rel)
            if storage.is_dir(path):
                out += [f"{rel}/{g}" for g in storage.listdir(path) if not is_layout_name(f"{rel}/{g}")]
            elif storage.is_file(path):
                out.append(rel)
        elif rel in _TOP and storage.is_dir(hdfs_io.join(name, rel)):
            out.append(rel + "/")
        if len(out) > _SHOWN:
            break
    return out


def _refusal(uri: str, foreign: list[str]) -> ExportError:
    shown = ", ".join(foreign[:_SHOWN]) + (", ..." if len(foreign) > _SHOWN else "")
    return ExportError(f"{uri}: exists and is not a bundle (it holds {shown}); refusing to replace it, "
                       f"--overwrite or not: export to a new or empty directory")


def check_bundle_target(storage: Storage, name: str, *, overwrite: bool) -> str:
    """What is at the bundle directory ``name`` (relative to ``storage``), refusing what must stay.

    Returns
    -------
    {"absent", "leftovers", "bundle"}
        Nothing there (or an empty directory); an incomplete directory holding bundle-layout names only
        (a crashed export's leftovers, which the publish deletes); a complete bundle (``overwrite`` set).

    Raises
    ------
    ExportError
        ``name`` is a file, or a directory holding a name no bundle has (``OUT`` and up to three such
        names quoted), whatever ``overwrite``.
    FileExistsError
        ``name`` is a published bundle and ``overwrite`` is false.
    """
    uri = storage.uri_of(name)
    info = storage.info(name)
    if info.type == pafs.FileType.NotFound:
        return "absent"
    if info.type == pafs.FileType.File:
        raise ExportError(f"{uri}: exists and is a file, not a bundle directory; refusing to replace it, "
                          f"--overwrite or not")
    entries = storage.listdir(name)
    foreign = _foreign(storage, name, entries)
    if foreign:
        raise _refusal(uri, foreign)
    if not hdfs_io.is_complete(storage, name):
        return "leftovers" if entries else "absent"
    if not overwrite:
        raise FileExistsError(errno.EEXIST, "already published", uri)
    return "bundle"


def check_file_target(storage: Storage, name: str, *, overwrite: bool) -> bool:
    """For a single-file output (``--format word2vec``): True when a file is there to replace.

    Raises
    ------
    ExportError
        ``name`` is a directory (never replaced).
    FileExistsError
        ``name`` is a file and ``overwrite`` is false.
    """
    info = storage.info(name)
    if info.type == pafs.FileType.NotFound:
        return False
    uri = storage.uri_of(name)
    if info.type != pafs.FileType.File:
        raise ExportError(f"{uri}: exists and is a directory, not a file; refusing to replace it, "
                          f"--overwrite or not")
    if not overwrite:
        raise FileExistsError(errno.EEXIST, "already exists", uri)
    return True


def _norm(uri: str) -> str:
    if "://" in uri:
        scheme, _, rest = uri.partition("://")
        return f"{scheme}://{rest.strip('/')}"
    return os.path.realpath(os.path.abspath(uri))


def same_place(a: str, b: str) -> bool:
    """True when the URIs ``a`` and ``b`` name the same path (local paths resolved, symlinks too)."""
    return _norm(a) == _norm(b)


def inside(a: str, b: str) -> bool:
    """True when ``a`` is strictly below ``b``."""
    na, nb = _norm(a), _norm(b)
    return na.startswith(nb.rstrip("/") + "/")


def job_root_of(checkpoint: str) -> str:
    """The job root of checkpoint ``{root}/{job}/{YYYYMMDD}/{HHMM-kind}`` (its chain's base and deltas lie
    below it); ``checkpoint`` itself when it is not a checkpoint's name (a job root: its newest)."""
    from ..checkpoint.manifest import ref_of_uri
    uri = checkpoint.rstrip("/")
    return posixpath.dirname(posixpath.dirname(uri)) if ref_of_uri(uri) is not None else uri


def check_not_source(out_uri: str, source_uri: str | None) -> None:
    """Refuse an ``OUT`` that is, contains or is inside the job root of the source checkpoint.

    ``source_uri`` is the source's checkpoint directory (``{root}/{job}/YYYYMMDD/HHMM-kind``); a source
    that is not a checkpoint (any other URI) is not checked.

    Raises
    ------
    ExportError
        ``OUT`` overlaps the checkpoints (both named).
    """
    from ..checkpoint.manifest import ref_of_uri
    if not source_uri or ref_of_uri(source_uri) is None:
        return
    job_root = job_root_of(source_uri)     # holds the checkpoint directory itself
    if same_place(out_uri, job_root) or inside(job_root, out_uri) or inside(out_uri, job_root):
        rel = "is" if same_place(out_uri, job_root) else "contains" if inside(job_root, out_uri) else "is inside"
        raise ExportError(f"{out_uri}: the output {rel} the source checkpoint's job root {job_root}; refusing "
                          f"to write there (the publish would replace the checkpoints): export outside {job_root}")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap the local paths ``a`` and ``b`` (Linux ``renameat2``); False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def swap_in(storage: Storage, staged: str, name: str) -> None:
    """Local disk: move the published directory ``staged`` over the published ``name`` (siblings below
    ``storage``'s root), then delete the old one. Readers see the old bundle or the new one; a process
    killed before the swap leaves the old one in place and ``staged`` behind (removed by the next export
    to ``name``: :func:`hdfs_io.temp_names.stale`)."""
    from hdfs_io import temp_names
    a, b = storage.full_path(staged), storage.full_path(name)
    if _exchange(a, b):
        old = staged                       # the swap put the old bundle at the staging name
    else:                                  # no atomic exchange: a short window with no bundle at name
        old = temp_names.temp_name(name, "old")
        os.rename(b, storage.full_path(old))
        os.rename(a, b)
    storage.sync("")
    storage.delete(hdfs_io.join(old, hdfs_io.SUCCESS_NAME), missing_ok=True)
    storage.delete(old, missing_ok=True)


def remove_stale_stages(storage: Storage, name: str, tag: str = STAGE_TAG, what: str = "a bundle staged") -> None:
    """Delete the temporaries beside ``name`` (``hdfs_io.temp_names`` with ``tag``: a bundle staged for
    ``--overwrite``, a word2vec file being written) left by export processes of this host that no
    longer run; ``what`` names them in the log."""
    from hdfs_io import temp_names
    try:
        left = temp_names.stale(storage.listdir(""), name, tag)
    except (FileNotFoundError, NotADirectoryError):
        return
    for d in left:
        log.warning("removing %s: %s by an export that was killed", storage.uri_of(d), what)
        try:
            storage.delete(d, missing_ok=True)
        except OSError as exc:      # another user's leftover: not ours to remove
            log.warning("could not remove %s: %s", storage.uri_of(d), exc)
