"""Numba kernels of the streaming package: xxHash64 over Arrow string buffers and Criteo field parsing.

Every kernel takes only numpy arrays and scalars and writes into caller-owned output arrays; none
allocates in its loop. Arrow variable-length arrays are passed as their raw buffers:

* ``offsets : int32[n + 1]`` or ``int64[n + 1]``, already shifted by the array's ``offset`` so that value
  ``i`` is ``data[offsets[i]:offsets[i + 1]]``;
* ``data : uint8[m]``, the value bytes;
* ``validity : uint8[k]``, the Arrow validity bitmap (LSB first) and ``vbit0``, the bit index of value 0
  (the array's ``offset``); ``has_validity = False`` means "no nulls" and ``validity`` is ignored.

The hash is xxHash64 (Yann Collet, https://github.com/Cyan4973/xxHash, spec ``doc/xxhash_spec.md``) with
seed 0. Its constants and rounds are written out below; ``tests/unit/test_streaming_keys.py`` checks the
kernel against the published test vectors and a plain-Python transcription.

Status codes: parsers write a per-row ``status : int16[n]``; 0 means "ok"; a parser that finds a bad
value in row ``i`` writes its ``field_code`` there only if ``status[i] == 0``, so the first bad field of
a row (in the order the parsers are called) is the one reported.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_P1 = np.uint64(11400714785074694791)
_P2 = np.uint64(14029467366897019727)
_P3 = np.uint64(1609587929392839161)
_P4 = np.uint64(9650029242287828579)
_P5 = np.uint64(2870177450012600261)
_U0 = np.uint64(0)
_U1 = np.uint64(1)
_U8 = np.uint64(8)
_U64 = np.uint64(64)


@njit(cache=True, nogil=True, inline="always")
def _rotl(x, r):
    return (x << r) | (x >> (_U64 - r))


@njit(cache=True, nogil=True, inline="always")
def _read64(data, p):
    v = _U0
    for k in range(8):
        v |= np.uint64(data[p + k]) << np.uint64(8 * k)
    return v


@njit(cache=True, nogil=True, inline="always")
def _read32(data, p):
    v = _U0
    for k in range(4):
        v |= np.uint64(data[p + k]) << np.uint64(8 * k)
    return v


@njit(cache=True, nogil=True, inline="always")
def _round(acc, lane):
    acc = acc + lane * _P2
    acc = _rotl(acc, np.uint64(31))
    return acc * _P1


@njit(cache=True, nogil=True, inline="always")
def _merge(acc, v):
    acc ^= _round(_U0, v)
    return acc * _P1 + _P4


@njit(cache=True, nogil=True)
def xxh64(data, start, end, seed):
    """xxHash64 of ``data[start:end]``.

    Parameters
    ----------
    data : uint8[m]
    start, end : int
        Byte range, ``0 <= start <= end <= m``.
    seed : uint64

    Returns
    -------
    uint64
    """
    seed = np.uint64(seed)
    n = end - start
    p = start
    if n >= 32:
        v1 = seed + _P1 + _P2
        v2 = seed + _P2
        v3 = seed
        v4 = seed - _P1
        limit = end - 32
        while p <= limit:
            v1 = _round(v1, _read64(data, p))
            v2 = _round(v2, _read64(data, p + 8))
            v3 = _round(v3, _read64(data, p + 16))
            v4 = _round(v4, _read64(data, p + 24))
            p += 32
        h = (_rotl(v1, np.uint64(1)) + _rotl(v2, np.uint64(7)) + _rotl(v3, np.uint64(12))
             + _rotl(v4, np.uint64(18)))
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = seed + _P5
    h = h + np.uint64(n)
    while p + 8 <= end:
        h ^= _round(_U0, _read64(data, p))
        h = _rotl(h, np.uint64(27)) * _P1 + _P4
        p += 8
    if p + 4 <= end:
        h ^= _read32(data, p) * _P1
        h = _rotl(h, np.uint64(23)) * _P2 + _P3
        p += 4
    while p < end:
        h ^= np.uint64(data[p]) * _P5
        h = _rotl(h, np.uint64(11)) * _P1
        p += 1
    h ^= h >> np.uint64(33)
    h = h * _P2
    h ^= h >> np.uint64(29)
    h = h * _P3
    h ^= h >> np.uint64(32)
    return h


@njit(cache=True, nogil=True, inline="always")
def _is_valid(validity, vbit0, has_validity, i):
    if not has_validity:
        return True
    b = vbit0 + i
    return (validity[b >> 3] >> (b & 7)) & 1 == 1


@njit(cache=True, nogil=True)
def hash_values(offsets, data, validity, vbit0, has_validity, prefix, hash_mask, missing_key,
                empty_is_missing, check_hex, field_code, out, status):
    """Hash every value of an Arrow string/binary array into slot-prefixed keys.

    Parameters
    ----------
    offsets : int32[n + 1] or int64[n + 1]
    data : uint8[m]
    validity : uint8[k]
    vbit0 : int
    has_validity : bool
    prefix : uint64
        The slot bits, already shifted into place (``slot << HASH_BITS``).
    hash_mask : uint64
        Mask of the hash bits. The all-ones hash value is reserved for "missing"; a hash landing
        there is moved to ``hash_mask - 1``.
    missing_key : uint64
        Key written for nulls (and for empty values when ``empty_is_missing``).
    empty_is_missing : bool
    check_hex : bool
        When true, a value with a byte outside ``[0-9a-fA-F]`` is bad: ``status[i]`` gets ``field_code``
        (if still 0) and ``out[i]`` the missing key.
    field_code : int
    out : uint64[n]
        Output keys (written).
    status : int16[n]
        Row status (read and written), see the module docstring.
    """
    n = out.shape[0]
    for i in range(n):
        if not _is_valid(validity, vbit0, has_validity, i):
            out[i] = missing_key
            continue
        s = offsets[i]
        e = offsets[i + 1]
        if s == e and empty_is_missing:
            out[i] = missing_key
            continue
        if check_hex:
            ok = True
            for p in range(s, e):
                c = data[p]
                if not ((c >= 48 and c <= 57) or (c >= 97 and c <= 102) or (c >= 65 and c <= 70)):
                    ok = False
                    break
            if not ok:
                if status[i] == 0:
                    status[i] = field_code
                out[i] = missing_key
                continue
        h = xxh64(data, s, e, _U0) & hash_mask
        if h == hash_mask:
            h = hash_mask - _U1
        out[i] = prefix | h


@njit(cache=True, nogil=True)
def parse_log1p_ints(offsets, data, field_code, out, status):
    """Parse decimal integers (``-?[0-9]+``, empty = missing) into ``log1p(max(v, 0))``.

    Parameters
    ----------
    offsets : int32[n + 1] or int64[n + 1]
    data : uint8[m]
    field_code : int
    out : float32[n]
        Written: ``log1p(max(v, 0))``; 0 for missing and for bad values.
    status : int16[n]
        A value that is not an integer, or a positive one too large for float64 (309 digits and more),
        sets ``status[i] = field_code`` (if still 0).
    """
    n = out.shape[0]
    for i in range(n):
        s = offsets[i]
        e = offsets[i + 1]
        if s == e:
            out[i] = 0.0
            continue
        neg = False
        p = s
        if data[p] == 45:  # '-'
            neg = True
            p += 1
        if p == e:
            out[i] = 0.0
            if status[i] == 0:
                status[i] = field_code
            continue
        v = 0.0
        ok = True
        while p < e:
            c = data[p]
            if c < 48 or c > 57:
                ok = False
                break
            v = v * 10.0 + (c - 48)
            p += 1
        if not ok:
            out[i] = 0.0
            if status[i] == 0:
                status[i] = field_code
        elif neg:
            out[i] = 0.0
        elif not np.isfinite(v):    # 309+ digits overflow float64: no finite log1p to write
            out[i] = 0.0
            if status[i] == 0:
                status[i] = field_code
        else:
            out[i] = np.log1p(v)


@njit(cache=True, nogil=True)
def parse_labels(offsets, data, field_code, out, status):
    """Parse click labels: exactly ``0`` or ``1``.

    Parameters
    ----------
    offsets : int32[n + 1] or int64[n + 1]
    data : uint8[m]
    field_code : int
    out : float32[n]
        Written: 0.0 or 1.0 (0.0 for bad values).
    status : int16[n]
        Any other value (including empty) sets ``status[i] = field_code`` (if still 0).
    """
    n = out.shape[0]
    for i in range(n):
        s = offsets[i]
        e = offsets[i + 1]
        out[i] = 0.0
        if e - s == 1 and (data[s] == 48 or data[s] == 49):
            out[i] = data[s] - 48
        elif status[i] == 0:
            status[i] = field_code


@njit(cache=True, nogil=True)
def row_byte_lengths(offsets, out):
    """Add each value's byte length to ``out``.

    Parameters
    ----------
    offsets : int32[n + 1] or int64[n + 1]
    out : int64[n]
        Accumulated in place.
    """
    for i in range(out.shape[0]):
        out[i] += offsets[i + 1] - offsets[i]
