"""Feature-key layout: THE one place that defines how raw feature values become ``uint64`` keys.

Layout (``HASH_VERSION = 1``)
-----------------------------
A sparse feature is a ``uint64`` key made of a slot prefix and a hash::

    bit 63 ........ 48 47 ........................................ 0
        [ slot : 16   ][ low 48 bits of xxHash64(raw bytes, seed 0) ]

* ``slot`` is the feature field id, ``0 <= slot <= 65535`` (``MAX_SLOT``). Keys of two different slots
  can never be equal, so per-slot settings (dimension, admission, expiry) are possible.
* The hash is xxHash64 (https://github.com/Cyan4973/xxHash) with seed 0 over the value's raw bytes
  (UTF-8 for strings), truncated to its low 48 bits. Inside one slot two distinct values collide with
  probability about ``n**2 / 2**49`` for ``n`` distinct values (≈0.2 % for a million).
* The all-ones hash ``HASH_MASK = 2**48 - 1`` is reserved: ``missing_key(slot) = slot << 48 | HASH_MASK``
  is the key of a null (missing) value of that slot. A real value whose hash lands there is moved to
  ``HASH_MASK - 1``.
* Integer ids (word ids, item ids already dense) are embedded, not hashed:
  ``make_keys(slot, ids) = slot << 48 | ids`` with ``ids < HASH_MASK``, so ``key_ids(keys)`` recovers them.

Example: the Criteo value ``"05db9164"`` in slot 1 gives
``(1 << 48) | (xxh64(b"05db9164") & HASH_MASK)``; a missing C1 gives ``0x0001_FFFF_FFFF_FFFF``.

Any change to this layout or hash must bump ``HASH_VERSION``; checkpoints and exports record it and
refuse to mix versions.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from . import _kernels

__all__ = [
    "HASH_VERSION", "SLOT_BITS", "HASH_BITS", "HASH_MASK", "MAX_SLOT",
    "slot_prefix", "missing_key", "make_keys", "key_slots", "key_ids", "hash_array", "hash_value",
    "arrow_buffers", "is_raw_strings",
]

HASH_VERSION = 1
SLOT_BITS = 16
HASH_BITS = 64 - SLOT_BITS
HASH_MASK = (1 << HASH_BITS) - 1
MAX_SLOT = (1 << SLOT_BITS) - 1

_HASH_MASK_U64 = np.uint64(HASH_MASK)
_STRING_TYPES = (pa.string(), pa.binary(), pa.large_string(), pa.large_binary())
_VIEW_TYPES = {pa.string_view(): pa.string(), pa.binary_view(): pa.binary()}


def is_raw_strings(t: pa.DataType) -> bool:
    """Whether ``hash_array`` takes an Arrow column of type ``t``: string, binary, their large and view
    forms, and dictionary-encoded columns of those (pandas' categoricals in Parquet), each hashed as the
    plain strings it holds."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return t in _STRING_TYPES or t in _VIEW_TYPES


def _plain(chunk: pa.Array) -> pa.Array:
    """``chunk`` as a string/binary array of ``_STRING_TYPES`` (dictionary decoded, views cast)."""
    if pa.types.is_dictionary(chunk.type):
        chunk = chunk.dictionary_decode()
    if chunk.type in _VIEW_TYPES:
        chunk = chunk.cast(_VIEW_TYPES[chunk.type])
    return chunk


def _check_slot(slot) -> int:
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
        raise TypeError(f"slot must be an int, got {type(slot).__name__}")
    slot = int(slot)
    if not 0 <= slot <= MAX_SLOT:
        raise ValueError(f"slot must be in [0, {MAX_SLOT}] ({SLOT_BITS} bits), got {slot}")
    return slot


def slot_prefix(slot: int) -> np.uint64:
    """The slot's high bits, ``slot << HASH_BITS``.

    Raises
    ------
    ValueError
        If ``slot`` is outside ``[0, MAX_SLOT]``.
    """
    return np.uint64(_check_slot(slot) << HASH_BITS)


def missing_key(slot: int) -> np.uint64:
    """The key of a missing (null) value of ``slot``: ``slot << HASH_BITS | HASH_MASK``.

    Raises
    ------
    ValueError
        If ``slot`` is outside ``[0, MAX_SLOT]``.
    """
    return np.uint64((_check_slot(slot) << HASH_BITS) | HASH_MASK)


def make_keys(slot: int, ids) -> np.ndarray:
    """Keys for integer ids (e.g. Word2Vec word ids): ``slot << HASH_BITS | ids``.

    Parameters
    ----------
    slot : int
        ``0 <= slot <= MAX_SLOT``.
    ids : uint64[n] (or any non-negative integer array)
        Each ``< HASH_MASK`` (the all-ones value is the missing key).

    Returns
    -------
    keys : uint64[n]

    Raises
    ------
    ValueError
        If the slot is out of range, or an id is negative or ``>= HASH_MASK``.
    """
    prefix = slot_prefix(slot)
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"ids must be an integer array, got dtype {ids.dtype}")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= HASH_MASK:
            bad = lo if lo < 0 else hi
            raise ValueError(f"ids must be in [0, {HASH_MASK - 1}], got {bad}")
    return ids.astype(np.uint64) | prefix


def key_slots(keys) -> np.ndarray:
    """Slot ids of keys.

    Parameters
    ----------
    keys : uint64[n]

    Returns
    -------
    slots : uint64[n]
    """
    return np.asarray(keys, dtype=np.uint64) >> np.uint64(HASH_BITS)


def key_ids(keys) -> np.ndarray:
    """Low (hash or id) bits of keys; the inverse of ``make_keys`` for ids.

    Parameters
    ----------
    keys : uint64[n]

    Returns
    -------
    ids : uint64[n]
    """
    return np.asarray(keys, dtype=np.uint64) & _HASH_MASK_U64


def arrow_buffers(arr: pa.Array):
    """Raw buffers of a string/binary Arrow array for the kernels.

    Parameters
    ----------
    arr : pyarrow.Array of type string, binary, large_string or large_binary (any offset/slice)

    Returns
    -------
    offsets : int32[n + 1] or int64[n + 1]
        Absolute byte offsets into ``data`` of values ``0..n``.
    data : uint8[m]
    validity : uint8[k]
        The validity bitmap (empty if none).
    vbit0 : int
        Bit index of value 0 in ``validity`` (the array's offset).
    has_validity : bool

    Raises
    ------
    TypeError
        If ``arr`` is not a string/binary array.
    """
    if arr.type not in _STRING_TYPES:
        raise TypeError(f"expected a string or binary array, got {arr.type}")
    n = len(arr)
    off_dtype = np.int64 if arr.type in (pa.large_string(), pa.large_binary()) else np.int32
    validity_buf, offsets_buf, data_buf = arr.buffers()[:3]
    if offsets_buf is None or n == 0:
        offsets = np.zeros(n + 1, dtype=off_dtype)
    else:
        offsets = np.frombuffer(offsets_buf, dtype=off_dtype, count=arr.offset + n + 1)[arr.offset:]
    data = (np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None and data_buf.size
            else np.zeros(0, dtype=np.uint8))
    has_validity = validity_buf is not None and arr.null_count > 0
    validity = (np.frombuffer(validity_buf, dtype=np.uint8) if has_validity
                else np.zeros(0, dtype=np.uint8))
    return offsets, data, validity, arr.offset, has_validity


def hash_array(slot: int, values, *, empty_is_missing: bool = False) -> np.ndarray:
    """Hash an Arrow string/binary array into slot-prefixed keys (Numba over the Arrow buffers).

    Parameters
    ----------
    slot : int
        ``0 <= slot <= MAX_SLOT``.
    values : pyarrow.Array or ChunkedArray, string/binary/large_string/large_binary, length n
        Slices are handled (the array offset is honoured). Views and dictionary-encoded columns of
        those are decoded first (``is_raw_strings``): the same keys as the plain strings.
    empty_is_missing : bool
        Also map empty values to ``missing_key(slot)`` (nulls always do).

    Returns
    -------
    keys : uint64[n]

    Raises
    ------
    TypeError
        If ``values`` is not a string/binary array.
    ValueError
        If the slot is out of range.
    """
    prefix = slot_prefix(slot)
    mkey = missing_key(slot)
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    out = np.empty(len(values), dtype=np.uint64)
    pos = 0
    with np.errstate(over="ignore"):  # only matters under NUMBA_DISABLE_JIT
        for chunk in chunks:
            offsets, data, validity, vbit0, has_validity = arrow_buffers(_plain(chunk))
            n = len(chunk)
            status = np.zeros(n, dtype=np.int16)
            _kernels.hash_values(offsets, data, validity, vbit0, has_validity, prefix, _HASH_MASK_U64,
                                 mkey, empty_is_missing, False, 0, out[pos:pos + n], status)
            pos += n
    return out


def hash_value(slot: int, value) -> int:
    """Key of one raw value (``str``, ``bytes`` or ``None``): for tests and debugging, not hot paths.

    Returns
    -------
    key : int
    """
    arr = pa.array([value], type=pa.string() if isinstance(value, str) else pa.binary())
    return int(hash_array(slot, arr)[0])
