"""``--format word2vec``: a Word2Vec input-vector table in the word2vec text/binary format.

Keys of the table are word ids embedded in the key (``streaming.keys.make_keys(slot, ids)``); the
vocabulary (``vocab.arrow`` of ``streaming.text``) maps id -> word. The file is written by
``models.word2vec_io.save_word2vec_format`` in vocabulary order (descending count), so gensim's
``KeyedVectors.load_word2vec_format`` reads it.

A Word2Vec checkpoint records the fingerprint of the vocabulary it was trained with (``sources.train.vocab``,
the description's ``vocab_fingerprint``): a ``vocab.arrow`` of other bytes (the corpus re-converted
since) is refused, as it would put every vector under another word (``check_vocab``).
"""
from __future__ import annotations

import logging
import os
import tempfile
from contextlib import contextmanager

import numpy as np

from .errors import ExportError

__all__ = ["export_word2vec", "word_vectors", "check_vocab", "local_vocab"]

log = logging.getLogger(__name__)


@contextmanager
def local_vocab(vocab: str, storage_options=None):
    """``vocab`` (``vocab.arrow`` or the converted-corpus directory holding it) as a local path: itself, or,
    for a URI (``s3://``, ``hdfs://``; reached with ``storage_options``, the config's ``storage`` section),
    its copy in a temporary directory removed on exit (``streaming.inputs.fetch``; a directory's
    ``vocab.arrow``).

    Raises
    ------
    FileNotFoundError
        Nothing at the URI, or a directory without ``vocab.arrow`` (names the URI).
    streaming.inputs.InputUnavailableError
        The store did not answer (after the retries), or refused the credentials (``refused`` set).
    """
    from streaming.inputs import fetch, is_uri
    from streaming.text import VOCAB_FILE
    if not is_uri(vocab):
        yield vocab
        return
    with tempfile.TemporaryDirectory(prefix="engine-vocab-") as tmp:
        try:
            path = fetch(vocab, tmp, storage_options, in_directory=VOCAB_FILE)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"vocabulary {vocab}: {exc}") from None
        yield path


def check_vocab(source, vocab: str, *, name: str | None = None) -> None:
    """``vocab`` is the vocabulary ``source`` was trained with: its size and CRC-32 equal the
    fingerprint the source's description records (``vocab_fingerprint``). A source recording none (a
    checkpoint written before they were recorded) is a WARNING: it cannot be verified.

    Parameters
    ----------
    source : ExportSource
    vocab : str
        ``vocab.arrow`` or the converted-corpus directory holding it (local).
    name : str, optional
        What the messages call ``vocab`` (the URI it was copied from); default ``vocab``.

    Raises
    ------
    ExportError
        The fingerprints differ (both named, with the file and the source).
    FileNotFoundError
        ``vocab`` does not exist.
    """
    from streaming.text import vocab_fingerprint
    name = name or vocab
    recorded = source.model_description().get("vocab_fingerprint")
    if not isinstance(recorded, dict):
        log.warning("%s records no fingerprint of the vocabulary it was trained with (written before they "
                    "were recorded): cannot verify that %s is that vocabulary", source.source_uri, name)
        return
    now = vocab_fingerprint(vocab)
    if any(recorded.get(k) != v for k, v in now.items()):
        words = f", {recorded['vocab_words']} words" if "vocab_words" in recorded else ""
        raise ExportError(f"{name}: not the vocabulary {source.source_uri} was trained with ({_show(now)}; the "
                          f"checkpoint's sources.train.vocab records {_show(recorded)}{words}): the corpus was "
                          f"re-converted since? Its word ids would name other words; pass the vocab.arrow it "
                          f"was trained with (engine export: --vocab)")


def _show(fp) -> str:
    return f"{fp.get('vocab_bytes')} bytes, crc32 {fp.get('vocab_crc32')}"


def word_vectors(source, vocab: str, storage_options=None):
    """The input vectors of ``source`` in vocabulary order.

    Parameters
    ----------
    source : ExportSource
        Rows keyed by ``make_keys(slot, word_id)``; ``values`` = the input vectors ``float32[dim]``.
    vocab : str
        ``vocab.arrow`` or the converted-corpus directory holding it: local, or a URI reached with
        ``storage_options`` (``local_vocab``).
    storage_options : hdfs_io.StorageOptions, optional
        For a URI ``vocab`` (None: the environment's).

    Returns
    -------
    words : list of str, length V
    vectors : float32[V, dim]
        Words without a row are zero vectors.
    missing : int
        Words without a row.

    Raises
    ------
    ExportError
        ``vocab`` is not the vocabulary the source was trained with (``check_vocab``), no rows, a row
        whose word id is outside the vocabulary, or rows of mixed width.
    FileNotFoundError
        ``vocab`` does not exist.
    streaming.inputs.InputUnavailableError
        A URI ``vocab``'s store did not answer, or refused the credentials (``local_vocab``).
    """
    from streaming.keys import key_ids
    from streaming.text import read_vocab
    with local_vocab(vocab, storage_options) as path:
        check_vocab(source, path, name=vocab)
        words, _ = read_vocab(path)
    vecs = None
    have = np.zeros(len(words), bool)
    for rb in source.embedding_batches():
        keys = np.ascontiguousarray(rb.column("key").to_numpy(), np.uint64)
        col = rb.column("values")
        dim = col.type.list_size
        vals = col.flatten().to_numpy(zero_copy_only=False).reshape(len(keys), dim)
        if vecs is None:
            vecs = np.zeros((len(words), dim), np.float32)
        elif vecs.shape[1] != dim:
            raise ExportError(f"{source.source_uri}: rows of width {dim} after rows of width {vecs.shape[1]}")
        ids = key_ids(keys).astype(np.int64)
        bad = ids >= len(words)
        if bad.any():
            raise ExportError(f"{source.source_uri}: key {int(keys[bad][0])} has word id {int(ids[bad][0])}, "
                              f"outside the vocabulary of {len(words)} words ({vocab})")
        vecs[ids] = vals
        have[ids] = True
    if vecs is None:
        raise ExportError(f"{source.source_uri}: no rows to export")
    missing = int((~have).sum())
    if missing:
        log.warning("%d of %d vocabulary words have no row in %s; written as zero vectors", missing,
                    len(words), source.source_uri)
    return words, vecs, missing


def export_word2vec(source, out_uri: str, *, vocab: str, binary: bool = False, storage_options=None,
                    overwrite: bool = False) -> dict:
    """Write ``source``'s rows as word2vec vectors.

    The file appears whole or not at all: on an object store (S3) it is one PUT (an object appears
    whole at close); elsewhere it is written under a temporary name beside ``out_uri``
    (``hdfs_io.temp_names``) and renamed over it once complete, so a failed or killed export leaves an
    earlier file there untouched (and its temporary, removed by the next export to ``out_uri`` on this
    host once the process is gone).

    Parameters
    ----------
    source : ExportSource
        Rows keyed by ``make_keys(slot, word_id)``; ``values`` = the input vectors ``float32[dim]``.
    out_uri : str
        Output file on any :mod:`hdfs_io` backend.
    vocab : str
        ``vocab.arrow`` or the converted-corpus directory holding it: local, or a URI on the store
        ``storage_options`` reach (``local_vocab``).
    binary : bool
        word2vec binary format instead of text.
    overwrite : bool
        Replace an existing file at ``out_uri`` (a directory is never replaced).

    Returns
    -------
    dict
        ``{"words": V, "dim": dim, "missing": words without a row (written as zeros)}``.

    Raises
    ------
    ExportError
        ``vocab`` is not the vocabulary the source was trained with, a row whose word id is outside the
        vocabulary, or rows of mixed width; ``out_uri`` is a directory, or is, contains or is inside the
        source checkpoint's job root.
    FileExistsError
        A file is at ``out_uri`` and ``overwrite`` is false.
    models.errors.ModelInputError
        A word the word2vec format cannot hold (ASCII whitespace: ``models.word2vec_io``).
    FileNotFoundError, streaming.inputs.InputUnavailableError
        A URI ``vocab`` that is not there, or whose store does not answer or refuses the credentials.
    """
    from hdfs_io import temp_names
    from models.word2vec_io import save_word2vec_format
    from . import target as T
    storage, name = _parent(out_uri, storage_options)
    T.check_not_source(out_uri, getattr(source, "source_uri", None))
    T.check_file_target(storage, name, overwrite=overwrite)
    words, vecs, missing = word_vectors(source, vocab, storage_options)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vectors")
        save_word2vec_format(path, words, vecs, binary=binary)
        with open(path, "rb") as f:
            data = f.read()
    T.check_file_target(storage, name, overwrite=overwrite)     # appeared meanwhile?
    if storage.is_object_store:
        storage.write_bytes(name, data)                         # the object appears whole at close
    else:
        T.remove_stale_stages(storage, name, "tmp", "a partial word2vec file written")
        tmp_name = temp_names.temp_name(name, "tmp")
        try:
            storage.write_bytes(tmp_name, data)
            storage.sync(tmp_name)
            storage.move(tmp_name, name)
            storage.sync("")
        except BaseException:
            try:
                storage.delete(tmp_name, missing_ok=True)
            except Exception as exc:  # noqa: BLE001 - the error that brought us here matters more
                log.warning("could not remove %s: %s", storage.uri_of(tmp_name), exc)
            raise
    return {"words": len(words), "dim": int(vecs.shape[1]), "missing": missing}


def _parent(uri, storage_options):
    from .bundle import split_uri
    return split_uri(uri, storage_options)
