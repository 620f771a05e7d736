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
    for extra in (b"\0" * 8, b"\0" * 3):     # padded: one element too many, or a part of one
        padded = pb.Tensor(dtype=t.dtype, shape=t.shape, data=t.data + extra)
        with pytest.raises(ProtocolError, match=f"keys: payload is {32 + len(extra)} bytes, expected 32"):
            codec.decode(padded, "keys", codec.U64, 1)
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


# ---------------------------------------------------------------------------- zero-copy wire codec
WIRE_DTYPES = [np.uint64, np.float32, np.int64, np.int32, np.float64, np.uint8, np.float16]


@pytest.mark.parametrize("dtype", WIRE_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (5,), (7, 3), (0, 16), (2, 3, 4)])
def test_wire_round_trip_every_dtype_aligned_and_protobuf_compatible(dtype, shape):
    arr = (np.arange(int(np.prod(shape))) * 3 + 1).astype(dtype).reshape(shape)
    buf = codec.serialize(codec.Wire(pb.PullResponse(request_id="r-7"), values=arr))
    r = codec.parse(buf, pb.PullResponse)
    assert r.error is None and r.request_id == "r-7"
    back = codec.decode(r.values, "values", np.dtype(dtype).newbyteorder("<"), len(shape))
    assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)
    if arr.size:
        assert back.flags.aligned and not back.flags.owndata      # a view of the received bytes
        assert (back.ctypes.data - np.frombuffer(buf, np.uint8).ctypes.data) % codec.ALIGN == 0
    # the same bytes are a valid protobuf message for the generated code, and the other way round
    msg = pb.PullResponse.FromString(buf)
    assert msg.values.dtype == arr.dtype.str and list(msg.values.shape) == list(shape)
    assert msg.values.data == arr.tobytes()
    r2 = codec.parse(pb.PullResponse(request_id="r-8", values=codec.encode(arr)).SerializeToString(),
                     pb.PullResponse)
    assert np.array_equal(codec.decode(r2.values, "values", arr.dtype, len(shape)), arr)



@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("rid", ["", "r", "x" * 120, "y" * 300])
@pytest.mark.parametrize("shape", [(0, 4), (3, 4), (1000, 16), (40_000, 10)])
def test_wire_allocate_gives_the_bytes_serialize_would_write(rid, shape, inplace, monkeypatch):
    """A reply filled in place is byte-identical to serializing the same array, stays aligned, and is
    an ordinary immutable bytes object once serialized (hashable, equal to a copy); also through the
    bytearray fallback used off CPython (or with ENGINE_PS_INPLACE_REPLY=0)."""
    if not inplace:
        monkeypatch.setattr(codec, "_PYBYTES_NEW", None)
    arr = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 0.5
    msg = pb.PushResponse(request_id=rid, keys=shape[0])
    w = codec.Wire.allocate(msg, "values", codec.F32, shape)
    view = w.arrays["values"]
    assert view.shape == shape and view.dtype == codec.F32 and view.flags.writeable
    view[...] = arr
    np.testing.assert_array_equal(codec.decode(w.values, "values", codec.F32, 2), arr)  # reads as a Wire
    buf = codec.serialize(w)
    assert type(buf) is bytes and buf == codec.serialize(codec.Wire(msg, values=arr))
    assert hash(buf) == hash(bytes(bytearray(buf)))
    r = codec.parse(buf, pb.PushResponse)
    assert r.request_id == rid and r.keys == shape[0]
    back = codec.decode(r.values, "values", codec.F32, 2, shape=shape)
    np.testing.assert_array_equal(back, arr)
    assert back.flags.aligned and not back.flags.owndata
    with pytest.raises(TypeError, match="no Tensor field 'keys'"):
        codec.Wire.allocate(pb.PullResponse(), "keys", codec.U64, (1,))


def test_wire_allocate_view_keeps_its_bytes_alive():
    """The in-process transport hands the reply's array itself to the client: it must own a reference
    to the bytes it views, or the values would dangle once the reply is dropped."""
    w = codec.Wire.allocate(pb.PullResponse(request_id="r"), "values", codec.F32, (1000, 16))
    view = w.arrays["values"]
    view[...] = 2.5
    encoded = w.encoded
    chain, base = [], view
    while base is not None:
        chain.append(base)
        base = getattr(base, "base", None)
    assert any(b is encoded or getattr(b, "owner", getattr(b, "obj", None)) is encoded for b in chain)
    del w, encoded
    assert float(view.sum()) == 2.5 * 16_000


def test_wire_push_request_with_every_array_and_absent_ones():
    keys = np.array([7, 9, 1 << 63], np.uint64)
    grads = np.random.default_rng(2).random((3, 4)).astype(np.float32)
    shows = np.array([1, 2, 3], np.float32)
    req = pb.PushRequest(table="emb", request_id="w0:1.0", kind=pb.DELTA, accumulate=True)
    r = codec.parse(codec.serialize(codec.Wire(req, keys=keys, grads=grads, shows=shows, clicks=None)),
                    pb.PushRequest)
    assert (r.table, r.request_id, r.kind, r.accumulate) == ("emb", "w0:1.0", pb.DELTA, True)
    assert np.array_equal(codec.decode(r.keys, "keys", codec.U64, 1), keys)
    assert np.array_equal(codec.decode(r.grads, "grads", codec.F32, 2, shape=(3, 4)), grads)
    assert np.array_equal(codec.decode(r.shows, "shows", codec.F32, 1), shows)
    assert codec.is_absent(r.clicks)


def test_wire_big_endian_and_non_contiguous_arrays_are_sent_as_little_endian_c_order():
    a = np.arange(12, dtype=">u8").reshape(3, 4)[:, ::2]
    r = codec.parse(codec.serialize(codec.Wire(pb.PullRequest(table="t"), keys=a)), pb.PullRequest)
    assert r.keys.dtype == "<u8"
    assert np.array_equal(codec.decode(r.keys, "keys", codec.U64, 2), a)


def test_wire_worked_example_of_the_proto_comment():
    buf = codec.serialize(codec.Wire(pb.PullRequest(table="emb", request_id="r1"),
                                     keys=np.array([7, 9], np.uint64)))
    assert buf.hex(" ") == ("0a 03 65 6d 62 12 02 72 31 1a 1d 0a 03 3c 75 38 12 01 02 22 01 00 1a 10 "
                            "07 00 00 00 00 00 00 00 09 00 00 00 00 00 00 00")


def test_wire_truncated_frames_are_rejected_at_every_cut():
    keys = np.arange(5, dtype=np.uint64)
    grads = np.ones((5, 2), np.float32)
    buf = codec.serialize(codec.Wire(pb.PushRequest(table="emb", request_id="rq-5"), keys=keys, grads=grads))
    for cut in range(len(buf)):
        r = codec.parse(buf[:cut], pb.PushRequest)
        if r.error is not None:
            assert isinstance(r.error, ProtocolError)
            assert r.table in ("", "emb") and r.request_id in ("", "rq-5")   # salvaged when readable
            continue
        with pytest.raises(ProtocolError):   # a cut at a field boundary: an array is short or absent
            codec.decode(r.keys, "keys", codec.U64, 1, shape=(5,))
            codec.decode(r.grads, "grads", codec.F32, 2, shape=(5, 2))
    # cut inside grads' data: the header parses, the length check names the field
    r = codec.parse(buf[:-3], pb.PushRequest)
    assert r.error is not None and "truncated" in str(r.error) and r.table == "emb" and r.request_id == "rq-5"


@pytest.mark.parametrize("junk", [b"\xff" * 12, b"\x1a\x05ab", b"\x0b\x00", b"\x00\x01", b"\x1a\x80"])
def test_wire_garbage_is_an_error_not_an_exception(junk):
    r = codec.parse(junk, pb.PullRequest)
    assert isinstance(r.error, ProtocolError)
    assert isinstance(codec.parse(junk, pb.Empty), (pb.Empty, codec.Received))


def test_wire_mistyped_payload_is_rejected_by_decode():
    buf = codec.serialize(codec.Wire(pb.PullRequest(table="emb"), keys=np.arange(4, dtype=np.int64)))
    with pytest.raises(ProtocolError, match="expected dtype <u8"):
        codec.decode(codec.parse(buf, pb.PullRequest).keys, "keys", codec.U64, 1)


def test_wire_rejects_unknown_tensor_fields():
    with pytest.raises(TypeError, match="no Tensor field"):
        codec.Wire(pb.PullRequest(), values=np.zeros(1))


def test_wire_many_fields_fall_back_to_the_protobuf_runtime():
    """A legal but odd encoding (the request id repeated 1000 times: last one wins) parses the same."""
    keys = np.arange(3, dtype=np.uint64)
    buf = b"".join(pb.PullRequest(request_id=f"r{i}").SerializeToString() for i in range(1000))
    buf += codec.serialize(codec.Wire(pb.PullRequest(table="emb", request_id="last"), keys=keys))
    r = codec.parse(buf, pb.PullRequest)
    assert r.error is None and r.request_id == "last" and r.table == "emb"
    assert np.array_equal(codec.decode(r.keys, "keys", codec.U64, 1), keys)
    bad = codec.parse(buf[:-1], pb.PullRequest)
    assert bad.error is not None
