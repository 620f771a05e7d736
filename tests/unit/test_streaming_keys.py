"""Feature hashing: the Numba xxHash64 kernel against a plain-Python reference, and the key layout."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streaming import keys
from streaming._kernels import xxh64

M64 = (1 << 64) - 1
P1, P2, P3, P4, P5 = (11400714785074694791, 14029467366897019727, 1609587929392839161,
                      9650029242287828579, 2870177450012600261)


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


def _round(acc, lane):
    return (_rotl((acc + lane * P2) & M64, 31) * P1) & M64


def naive_xxh64(b: bytes, seed: int = 0) -> int:
    """xxHash64 transcribed from the spec with Python ints: slow, obviously correct."""
    n, p = len(b), 0
    if n >= 32:
        v = [(seed + P1 + P2) & M64, (seed + P2) & M64, seed, (seed - P1) & M64]
        while p + 32 <= n:
            for j in range(4):
                v[j] = _round(v[j], int.from_bytes(b[p + 8 * j:p + 8 * j + 8], "little"))
            p += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & M64
        for j in range(4):
            h = (((h ^ _round(0, v[j])) * P1) + P4) & M64
    else:
        h = (seed + P5) & M64
    h = (h + n) & M64
    while p + 8 <= n:
        h ^= _round(0, int.from_bytes(b[p:p + 8], "little"))
        h = (_rotl(h, 27) * P1 + P4) & M64
        p += 8
    if p + 4 <= n:
        h ^= (int.from_bytes(b[p:p + 4], "little") * P1) & M64
        h = (_rotl(h, 23) * P2 + P3) & M64
        p += 4
    while p < n:
        h ^= (b[p] * P5) & M64
        h = (_rotl(h, 11) * P1) & M64
        p += 1
    h ^= h >> 33
    h = (h * P2) & M64
    h ^= h >> 29
    h = (h * P3) & M64
    h ^= h >> 32
    return h


def naive_key(slot: int, value) -> int:
    if value is None:
        return (slot << 48) | keys.HASH_MASK
    if isinstance(value, str):
        value = value.encode()
    h = naive_xxh64(value) & keys.HASH_MASK
    if h == keys.HASH_MASK:
        h -= 1
    return (slot << 48) | h


def _kernel_hash(b: bytes) -> int:
    data = np.frombuffer(b, dtype=np.uint8) if b else np.zeros(0, dtype=np.uint8)
    with np.errstate(over="ignore"):
        return int(xxh64(data, 0, len(b), np.uint64(0)))


@pytest.mark.nojit
@pytest.mark.parametrize("value, expected", [
    (b"", 0xEF46DB3751D8E999),
    (b"a", 0xD24EC4F1A98C6E5B),
    (b"abc", 0x44BC2CF5AD770999),
    (b"Nobody inspects the spammish repetition", 0xFBCEA83C8A378BF1),
])
def test_xxh64_published_vectors(value, expected):
    assert _kernel_hash(value) == expected
    assert naive_xxh64(value) == expected


@pytest.mark.nojit
def test_xxh64_matches_reference_all_tail_lengths():
    rng = np.random.default_rng(0)
    for n in range(0, 70):
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _kernel_hash(b) == naive_xxh64(b), n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=40)), max_size=30), st.integers(0, keys.MAX_SLOT))
def test_hash_array_matches_reference(values, slot):
    got = keys.hash_array(slot, pa.array(values, type=pa.string()))
    assert got.dtype == np.uint64
    assert [int(k) for k in got] == [naive_key(slot, v) for v in values]


@pytest.mark.nojit
@pytest.mark.parametrize("typ", [pa.string(), pa.binary(), pa.large_string(), pa.large_binary()])
def test_nulls_map_to_missing_key_and_types(typ):
    vals = ["05db9164", None, "", "68fd1e64", None]
    arr = pa.array(vals if typ in (pa.string(), pa.large_string())
                   else [None if v is None else v.encode() for v in vals], type=typ)
    got = keys.hash_array(7, arr)
    assert got[1] == got[4] == keys.missing_key(7)
    assert int(got[0]) == naive_key(7, "05db9164")
    assert int(got[2]) == naive_key(7, "")  # empty is a value unless asked otherwise
    got2 = keys.hash_array(7, arr, empty_is_missing=True)
    assert got2[2] == keys.missing_key(7)


@pytest.mark.nojit
def test_sliced_and_chunked_arrays():
    vals = [None if i % 7 == 3 else f"v{i}" for i in range(50)]
    arr = pa.array(vals, type=pa.string())
    full = keys.hash_array(3, arr)
    for start, length in [(1, 10), (9, 30), (13, 0), (49, 1)]:
        np.testing.assert_array_equal(keys.hash_array(3, arr.slice(start, length)),
                                      full[start:start + length])
    chunked = pa.chunked_array([arr.slice(0, 17), arr.slice(17, 20), arr.slice(37)])
    np.testing.assert_array_equal(keys.hash_array(3, chunked), full)


@pytest.mark.nojit
def test_slot_prefix_never_collides_across_slots():
    vals = pa.array([None, "", "a", "05db9164", "x" * 100])
    all_keys = np.concatenate([keys.hash_array(s, vals) for s in (0, 1, 2, 26, keys.MAX_SLOT)])
    assert len(np.unique(all_keys)) == len(all_keys)
    np.testing.assert_array_equal(keys.key_slots(keys.hash_array(26, vals)), np.full(5, 26, np.uint64))


def test_make_keys_roundtrip_and_range_errors():
    ids = np.array([0, 1, 12345, keys.HASH_MASK - 1], dtype=np.uint64)
    k = keys.make_keys(5, ids)
    assert k.dtype == np.uint64
    np.testing.assert_array_equal(keys.key_ids(k), ids)
    np.testing.assert_array_equal(keys.key_slots(k), np.full(4, 5, np.uint64))
    assert keys.missing_key(5) not in set(k.tolist())
    with pytest.raises(ValueError, match="ids must be in"):
        keys.make_keys(5, np.array([keys.HASH_MASK], dtype=np.uint64))
    with pytest.raises(ValueError, match="ids must be in"):
        keys.make_keys(5, np.array([-1]))
    with pytest.raises(ValueError, match="slot must be in"):
        keys.make_keys(keys.MAX_SLOT + 1, ids)
    with pytest.raises(TypeError, match="string or binary"):
        keys.hash_array(1, pa.array([1, 2]))


def test_hash_version_is_recorded_constant():
    assert keys.HASH_VERSION == 1
    assert keys.SLOT_BITS + keys.HASH_BITS == 64
