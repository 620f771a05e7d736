"""The word2vec vector formats (word2vec.c ``-binary 0/1``), as gensim's
``KeyedVectors.load_word2vec_format`` / ``save_word2vec_format`` read and write them.

Text format (UTF-8)::

    3 4                                   ← "count dim"
    the 0.0123 -0.5 0.25 1
    of -0.1 0.2 0.3 0.4                   ← word, then dim floats, space-separated
    and 0 0 0 0

Binary format: the same header line, then per word ``word`` + ``b" "`` + ``dim`` little-endian float32
(``4 * dim`` bytes) + ``b"\\n"`` (word2vec.c writes the newline; gensim's reader strips it from the next
word, so files from either tool load in both).

Words must be non-empty and free of ASCII whitespace (``FORMAT_BREAKERS``: space, ``\\t \\n \\r \\v
\\f``), which the readers split on (gensim: ``bytes.rstrip()`` and ``split(" ")`` per line, or up to the
space in binary). Any other character is kept as it is, non-ASCII spaces such as U+00A0 included: the
corpus tokenizer (``streaming.text``) splits only on ASCII whitespace, so its words may hold them, and
gensim reads them back unchanged.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from .errors import ModelInputError

__all__ = ["save_word2vec_format", "load_word2vec_format", "FORMAT_BREAKERS"]

log = logging.getLogger(__name__)

#: characters a word of the word2vec formats cannot hold (the readers split on them)
FORMAT_BREAKERS = frozenset(" \t\n\r\v\f")


def _check(words, vectors) -> np.ndarray:
    vectors = np.asarray(vectors)
    if vectors.ndim != 2 or vectors.shape[0] != len(words):
        raise ModelInputError(f"vectors: expected float[{len(words)}, dim], got shape {vectors.shape}")
    for i, w in enumerate(words):
        if not w or not FORMAT_BREAKERS.isdisjoint(w):
            raise ModelInputError(f"words: the word2vec format cannot hold word {i} {w!r} (empty or containing "
                                  "ASCII whitespace: space, \\t, \\n, \\r, \\v or \\f)")
    return np.ascontiguousarray(vectors, dtype=np.float32)


def save_word2vec_format(path, words, vectors, *, binary: bool = False) -> None:
    """Write vectors in the word2vec text or binary format.

    Parameters
    ----------
    path : str or PathLike
        Written atomically (a temporary file renamed into place).
    words : sequence of str, length V
        In the order to write (conventionally by descending frequency: gensim's ``restrict_vocab`` and
        ``limit`` take the first rows).
    vectors : float[V, dim]
        Written as float32; text uses ``%.9g``, which reads back to the identical float32.
    binary : bool

    Raises
    ------
    ModelInputError
        On a shape mismatch or a word the format cannot hold (empty, or containing a character of
        ``FORMAT_BREAKERS``); the word and its index are named.
    """
    vectors = _check(words, vectors)
    n, dim = vectors.shape
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(f"{n} {dim}\n".encode())
        if binary:
            le = vectors.astype("<f4", copy=False)
            for w, row in zip(words, le):
                f.write(w.encode("utf-8") + b" " + row.tobytes() + b"\n")
        else:
            fmt = " ".join(["%.9g"] * dim)
            lines = []
            for i, w in enumerate(words):
                lines.append(w + " " + fmt % tuple(vectors[i].tolist()))
                if len(lines) == 4096:
                    f.write(("\n".join(lines) + "\n").encode("utf-8"))
                    lines = []
            if lines:
                f.write(("\n".join(lines) + "\n").encode("utf-8"))
    os.replace(tmp, path)
    log.info("wrote %d vectors of dim %d to %s (%s)", n, dim, path, "binary" if binary else "text")


def load_word2vec_format(path, *, binary: bool | None = None):
    """Read a word2vec text or binary file.

    Parameters
    ----------
    path : str or PathLike
    binary : bool, optional
        Detected when omitted: text when the first row, up to its newline, is UTF-8 of a word and ``dim``
        space-separated numbers.

    Returns
    -------
    words : list of str, length V
    vectors : float32[V, dim]

    Raises
    ------
    ModelInputError
        On a malformed header, a short file or a row of the wrong length (the message names the row).
    """
    with open(path, "rb") as f:
        data = f.read()
    nl = data.find(b"\n")
    try:
        n, dim = (int(x) for x in data[:nl].split())
    except ValueError:
        raise ModelInputError(f"{path}: expected a 'count dim' header line, got {data[:nl][:80]!r}") from None
    body = memoryview(data)[nl + 1:]
    if binary is None:
        binary = _looks_binary(body, dim)
    words: list[str] = []
    vectors = np.empty((n, dim), np.float32)
    if binary:
        pos = 0
        raw = bytes(body)
        for i in range(n):
            sp = raw.find(b" ", pos)
            end = sp + 1 + 4 * dim
            if sp < 0 or end > len(raw):
                raise ModelInputError(f"{path}: row {i}: unexpected end of file (header says {n} words)")
            words.append(raw[pos:sp].decode("utf-8").lstrip("\n"))
            vectors[i] = np.frombuffer(raw, "<f4", dim, sp + 1)
            pos = end
    else:
        lines = bytes(body).decode("utf-8").split("\n")
        if len(lines) < n or (len(lines) > n and any(ln.strip() for ln in lines[n:])):
            raise ModelInputError(f"{path}: expected {n} rows after the header, got {len(lines)}")
        for i in range(n):
            parts = lines[i].rstrip().split(" ")
            if len(parts) != dim + 1:
                raise ModelInputError(f"{path}: row {i}: expected a word and {dim} floats, got "
                                      f"{len(parts) - 1} values")
            words.append(parts[0])
            vectors[i] = np.array(parts[1:], dtype=np.float32)
    return words, vectors


def _looks_binary(body, dim: int) -> bool:
    """False when the first row of ``body`` (bytes after the header) reads as a text row: UTF-8, a word
    and ``dim`` numbers separated by single spaces, up to the first newline. (Reading only the ``4 * dim``
    bytes after the first word, as before, took a text file of short numbers for binary: with small
    ``dim`` those bytes reach into the next row's word.)"""
    raw = bytes(body[:64 * (dim + 1) + 4096])     # a text row of %.9g floats is at most ~17 bytes per value
    nl = raw.find(b"\n")
    try:
        parts = (raw[:nl] if nl >= 0 else raw).decode("utf-8").rstrip().split(" ")   # word2vec.c ends rows in " "
    except UnicodeDecodeError:
        return True
    if len(parts) != dim + 1:
        return True
    try:
        for x in parts[1:]:
            float(x)
    except ValueError:
        return True
    return False
