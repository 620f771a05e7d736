"""Routing is a pure, balanced function; the codec round-trips arrays and rejects malformed payloads."""
from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ConfigError, ProtocolError
from engine.ps import codec, routing
from engine.ps import ps_pb2 as pb

M64 = (1 << 64) - 1


def naive_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_mix64_matches_the_documented_formula():
    keys = np.array([0, 1, 2, 12345, M64, 1 << 63, 0xDEADBEEF], dtype=np.uint64)
    assert [int(v) for v in routing.mix64(keys)] == [naive_mix64(int(k)) for k in keys]


def test_route_is_pure_and_consistent_with_vshards():
    keys = np.random.default_rng(0).integers(0, 2**63, 10_000, dtype=np.uint64)
    a = routing.route(keys, 1024, 3)
    assert np.array_equal(a, routing.route(keys.copy(), 1024, 3))
    v = routing.vshard_of(keys, 1024)
    assert np.array_equal(v, [naive_mix64(int(k)) % 1024 for k in keys])
    bounds = routing.vshard_bounds(1024, 3)
    assert np.array_equal(a, np.searchsorted(bounds, v, side="right") - 1)


@pytest.mark.parametrize("servers", [1, 2, 3, 7])
def test_route_is_balanced_even_for_sequential_keys(servers):
    keys = np.arange(300_000, dtype=np.uint64)
    counts = np.bincount(routing.route(keys, 1024, servers), minlength=servers)
    sizes = np.diff(routing.vshard_bounds(1024, servers))
    expected = len(keys) * sizes / 1024
    assert np.all(np.abs(counts - expected) < 0.02 * expected)
    vs = np.bincount(routing.vshard_of(keys, 1024), minlength=1024)
    assert vs.min() > 0.8 * vs.mean() and vs.max() < 1.2 * vs.mean()


def test_vshards_map_to_servers_and_local_shards_in_contiguous_ranges():
    owners = routing.vshard_owners(10, 3)
    assert owners.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    local = routing.local_shard_owners(10, 3, 2, 2)
    assert local.tolist() == [-1] * 6 + [0, 0, 1, 1]


def test_routing_rejects_bad_arguments():
    with pytest.raises(ProtocolError, match="uint64"):
        routing.route(np.arange(3), 1024, 2)
    with pytest.raises(ConfigError, match="num_servers"):
        routing.route(np.arange(3, dtype=np.uint64), 4, 5)


@pytest.mark.parametrize("arr", [np.arange(5, dtype=np.uint64), np.zeros((0, 4), np.float32),
                                 np.random.default_rng(1).random((7, 3)).astype(np.float32)])
def test_codec_round_trip(arr):
    t = pb.Tensor.FromString(codec.encode(arr).SerializeToString())
    back = codec.decode(t, "x", arr.dtype, arr.ndim)
    assert back.dtype == arr.dtype and np.array_equal(back, arr)


def test_codec_sends_little_endian():
    arr = np.array([1, 2], dtype=">u8")
    t = codec.encode(arr)
    assert t.dtype == "<u8" and t.data[:8] == (1).to_bytes(8, "little")


def test_codec_rejects_truncated_wrong_dtype_and_wrong_shape():
    t = codec.encode(np.arange(4, dtype=np.uint64))
    cut = pb.Tensor(dtype=t.dtype, shape=t.shape, data=t.data[:-3])
    with pytest.raises(ProtocolError, match="truncated"):
        codec.decode(cut, "keys", codec.U64, 1)
    with pytest.raises(ProtocolError, match="expected dtype <f4"):
        codec.decode(t, "grads", codec.F32, 1)
    g = codec.encode(np.zeros((4, 2), np.float32))
    with pytest.raises(ProtocolError, match=r"grads: expected shape \[4, 3\]"):
        codec.decode(g, "grads", codec.F32, 2, shape=(4, 3))
    with pytest.raises(ProtocolError, match="2-d"):
        codec.decode(t, "keys", codec.U64, 2)
    assert codec.is_absent(codec.encode(None))


def test_chunks_fit_the_limit():
    for dim in (1, 16, 512):
        n = codec.chunk_keys(dim)
        assert n * (8 + 4 * dim + 8) <= codec.CHUNK_BYTES
