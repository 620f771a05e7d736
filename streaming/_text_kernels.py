"""Numba kernels of the text-corpus converter (``streaming.text``).

Two passes over a block of raw bytes that always ends at a line boundary:

* ``tokenize`` packs the whitespace-separated tokens of the block contiguously (so Arrow can view them as
  one binary array without a per-token Python object) and counts the tokens of every line;
* ``build_rows`` turns the per-token vocabulary ids (``-1`` = out of vocabulary) into output rows: each line
  is cut into chunks of at most ``max_len`` *raw* tokens (as gensim's ``LineSentence`` with
  ``max_sentence_length`` does), and out-of-vocabulary tokens are then dropped inside each chunk.

Whitespace is the ASCII set Python's ``str.split()`` uses (space, ``\\t \\n \\v \\f \\r`` and
``\\x1c``-``\\x1f``); non-ASCII Unicode spaces (e.g. U+00A0) are not separators here.
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["tokenize", "build_rows"]


#: 1 for the bytes ``str.split()`` treats as whitespace (ASCII range)
SPACE = np.zeros(256, np.uint8)
SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = 1


def tokenize(data):
    """Pack the tokens of ``data`` contiguously and count tokens per line.

    Parameters
    ----------
    data : uint8[n]
        Raw bytes; lines end with ``\\n`` (the last line may lack it).

    Returns
    -------
    packed : uint8[m]
        The token bytes back to back, ``m <= n``.
    offsets : int64[t + 1]
        Token ``k`` is ``packed[offsets[k]:offsets[k + 1]]``.
    line_ntok : int64[L]
        Tokens on each line (``L`` = newlines, plus one if the data does not end with ``\\n``).
    """
    n = data.shape[0]
    n_lines = int(np.count_nonzero(data == 10))
    if n > 0 and data[n - 1] != 10:
        n_lines += 1
    packed = np.empty(n, np.uint8)
    offsets = np.empty(n // 2 + 2, np.int64)
    line_ntok = np.zeros(n_lines, np.int64)
    n_tok, pos = _tokenize(data, SPACE, packed, offsets, line_ntok)
    return packed[:pos], offsets[:n_tok + 1], line_ntok


@njit(cache=True, nogil=True)
def _tokenize(data, space, packed, offsets, line_ntok):
    pos = 0
    k = 0
    line = 0
    in_tok = False
    offsets[0] = 0
    for i in range(data.shape[0]):
        c = data[i]
        if space[c]:
            if in_tok:
                k += 1
                offsets[k] = pos
                in_tok = False
            if c == 10:
                line += 1
        else:
            if not in_tok:
                in_tok = True
                line_ntok[line] += 1
            packed[pos] = c
            pos += 1
    if in_tok:
        k += 1
        offsets[k] = pos
    return k, pos


@njit(cache=True, nogil=True)
def build_rows(ids, line_ntok, max_len):
    """Cut lines into chunks of at most ``max_len`` raw tokens and drop out-of-vocabulary tokens.

    Lines without tokens give no row; a chunk whose tokens are all out of vocabulary gives an empty row.

    Parameters
    ----------
    ids : int32[t]
        Vocabulary id of every token of the block, ``-1`` when out of vocabulary.
    line_ntok : int64[L]
        Tokens per line, ``sum(line_ntok) == t``.
    max_len : int
        Maximum raw tokens per row (10,000 as gensim's ``MAX_WORDS_IN_BATCH``).

    Returns
    -------
    row_offsets : int32[r + 1]
        Row ``q`` holds ``values[row_offsets[q]:row_offsets[q + 1]]``.
    values : uint32[kept]
        In-vocabulary ids, in order.
    raw_len : uint32[r]
        Raw tokens (out-of-vocabulary ones included) of each row.
    n_oov : int
        Tokens dropped.
    """
    n_rows = 0
    for li in range(line_ntok.shape[0]):
        n_rows += (line_ntok[li] + max_len - 1) // max_len
    row_offsets = np.empty(n_rows + 1, np.int32)
    raw_len = np.empty(n_rows, np.uint32)
    values = np.empty(ids.shape[0], np.uint32)
    row_offsets[0] = 0
    t = 0
    kept = 0
    r = 0
    for li in range(line_ntok.shape[0]):
        left = line_ntok[li]
        while left > 0:
            take = min(left, max_len)
            for _ in range(take):
                v = ids[t]
                t += 1
                if v >= 0:
                    values[kept] = v
                    kept += 1
            raw_len[r] = take
            r += 1
            row_offsets[r] = kept
            left -= take
    return row_offsets, values[:kept], raw_len, ids.shape[0] - kept
