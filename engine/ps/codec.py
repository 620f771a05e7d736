"""numpy arrays <-> ``Tensor`` messages, the zero-copy wire codec, and the size limits of the wire.

A ``Tensor`` carries ``dtype`` (numpy's ``dtype.str``, always little-endian: ``"<u8"``, ``"<f4"``),
``shape`` and ``data``, the C-order bytes. Decoding is zero-copy (``np.frombuffer`` over the message's
bytes) and checks everything a malformed or truncated payload could get wrong.

Worked example: the keys ``[7, 9]`` (uint64) travel as::

    Tensor(dtype="<u8", shape=[2],
           data=b"\\x07\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x09\\x00\\x00\\x00\\x00\\x00\\x00\\x00")

and a pull reply of dim 2 for them as ``Tensor(dtype="<f4", shape=[2, 2], data=<16 bytes>)``.
An absent optional array (``shows`` of a push without counts) is the empty message (``dtype == ""``).

Fast path (what the client and server use; the bytes are plain protobuf, see ``ps.proto``):

- ``Wire(msg, keys=arr, ...)`` is an outgoing message: the protobuf ``msg`` without its Tensor fields
  plus numpy arrays for them. ``serialize`` writes ``msg``'s encoding, then each array as a Tensor
  field whose ``data`` is the array memory, appended last (one copy, into the bytes handed to gRPC;
  the protobuf runtime would copy 3 times: ``tobytes``, field assignment, serialization). An ``align``
  field pads ``data`` to a multiple of 8 bytes from the message start.
- ``Wire.allocate(msg, name, dtype, shape)`` is a reply built in place: its final bytes are allocated
  first and the server's kernels write the array (pull rows, dense parameters) straight into them, so
  ``serialize`` has nothing to copy. ``ENGINE_PS_INPLACE_REPLY=0`` (or a Python other than CPython)
  uses a bytearray and one copy instead.
- ``parse(buf, cls)`` walks the wire format of a ``cls`` message: everything except the ``data`` of
  Tensor fields goes to the protobuf runtime (a few dozen bytes), ``data`` stays a memoryview of
  ``buf``. It returns a ``Received``: attribute access as on the message, Tensor fields are
  ``RawTensor(dtype, shape, data)`` that ``decode`` turns into arrays without copying. A message that
  does not parse (truncated, bad varint or wire type) gives a ``Received`` whose ``error`` is set (the
  server turns it into INVALID_ARGUMENT naming the table and request id it could read).

Example: ``parse(serialize(Wire(pb.PullRequest(table="emb", request_id="r1"), keys=np.array([7, 9],
np.uint64))), pb.PullRequest)`` gives ``r.table == "emb"`` and ``decode(r.keys, "keys", U64, 1)``
``== [7, 9]``, viewing the received bytes.

Chunking: a client splits a sparse request so that neither it nor its reply exceeds ``CHUNK_BYTES``
(see ``chunk_keys``); dense tables travel in blocks of ``DENSE_BLOCK`` floats. gRPC's message limits
are set to ``MAX_MESSAGE_BYTES``, comfortably above one chunk plus the message overhead.

Why 8 MiB: every gRPC call costs about 1 ms of CPU in Python (client and server together) before any
payload, so a 100k-key pull of dim 16 (6.4 MB reply) in one chunk instead of two gave 12% more pull
throughput in ``bench/ps_bench.py`` (0.327 -> 0.368 of the in-process table); 2 MiB chunks gave 0.281.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from ..errors import ProtocolError
from . import ps_pb2 as pb

CHUNK_BYTES = 8 << 20          # payload bytes per sparse request or reply chunk (see below)
DENSE_BLOCK = 1 << 19          # floats per dense block (2 MiB)
MAX_MESSAGE_BYTES = 16 << 20   # gRPC max send/receive message length

U64 = np.dtype("<u8")
F32 = np.dtype("<f4")
I64 = np.dtype("<i8")
F64 = np.dtype("<f8")
REPLY_OVERHEAD_BYTES = 4096    # a reply's bytes beyond its arrays (ids, shapes, tags), generously


def encode(arr: np.ndarray | None) -> pb.Tensor:
    """numpy array (any dtype, any shape) -> Tensor; None -> the empty Tensor. Copies once."""
    if arr is None:
        return pb.Tensor()
    arr = np.asarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return pb.Tensor(dtype=arr.dtype.str, shape=arr.shape, data=arr.tobytes())


def is_absent(t) -> bool:
    """True for the empty Tensor (an optional array left out)."""
    return not t.dtype and not t.shape and not t.data


def decode(t, name: str, dtype: np.dtype, ndim: int, *, shape: tuple | None = None
           ) -> np.ndarray:
    """Tensor -> read-only numpy array viewing the message bytes (no copy unless misaligned).

    Parameters
    ----------
    t : Tensor or RawTensor
    name : str
        Field name used in error messages (``keys``, ``grads``, ...).
    dtype : numpy dtype
        The only dtype accepted for this field.
    ndim : int
        Required number of dimensions.
    shape : tuple of int or None, optional
        Required shape; ``None`` entries are free.

    Raises
    ------
    ProtocolError
        Wrong dtype, ndim or shape, negative dimensions, or ``len(data)`` different from
        ``prod(shape) * itemsize`` (a truncated or padded payload).
    """
    if t.dtype != dtype.str:
        raise ProtocolError(f"{name}: expected dtype {dtype.str} ({dtype.name}), got {t.dtype!r}")
    dims = tuple(int(d) for d in t.shape)
    if len(dims) != ndim or any(d < 0 for d in dims):
        raise ProtocolError(f"{name}: expected a {ndim}-d shape, got {list(dims)}")
    if shape is not None:
        for want, got in zip(shape, dims):
            if want is not None and want != got:
                raise ProtocolError(f"{name}: expected shape {_fmt(shape)}, got {list(dims)}")
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    data = t.data
    if len(data) != expected:
        raise ProtocolError(f"{name}: payload is {len(data)} bytes, expected {expected} for "
                            f"{dtype.name}{list(dims)} (truncated or corrupt message)")
    arr = np.frombuffer(data, dtype=dtype).reshape(dims)
    return arr if arr.flags.aligned else arr.copy()


def chunk_bytes(max_message_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """Payload bytes per sparse chunk for servers that accept ``max_message_bytes``: ``CHUNK_BYTES``,
    or half the limit when that is smaller (room for the message overhead and a dense part)."""
    return min(CHUNK_BYTES, max(1 << 16, int(max_message_bytes) // 2))


def chunk_keys(dim: int, max_message_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """Keys per sparse chunk for rows of ``dim`` float32: request (8-byte key + dim floats + show and
    click) and reply (dim floats) both stay within ``chunk_bytes(max_message_bytes)``."""
    return max(1, chunk_bytes(max_message_bytes) // (8 + 4 * dim + 8))


def _fmt(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


# ---------------------------------------------------------------------------- zero-copy wire codec
REQUEST = {"Pull": pb.PullRequest, "Push": pb.PushRequest, "Dense": pb.DenseRequest, "Step": pb.StepRequest,
           "Barrier": pb.BarrierRequest, "Save": pb.PathRequest, "Load": pb.PathRequest,
           "Shrink": pb.ShrinkRequest, "Stats": pb.Empty, "Health": pb.Empty, "Stop": pb.Empty,
           "Metric": pb.MetricRequest, "Fence": pb.FenceRequest, "Clock": pb.ClockRequest}
REPLY = {"Pull": pb.PullResponse, "Push": pb.PushResponse, "Dense": pb.DenseResponse, "Step": pb.StepResponse,
         "Barrier": pb.BarrierResponse, "Save": pb.CountResponse, "Load": pb.CountResponse,
         "Shrink": pb.CountResponse, "Stats": pb.JsonResponse, "Health": pb.JsonResponse,
         "Stop": pb.Empty, "Metric": pb.MetricResponse, "Fence": pb.JsonResponse, "Clock": pb.JsonResponse}
_DATA_TAG = b"\x1a"       # Tensor.data: field 3, length-delimited
_ALIGN_TAG = b"\x22"      # Tensor.align: field 4, length-delimited
ALIGN = 8
MAX_WALKED_FIELDS = 256   # top-level fields parse() walks before handing the message to protobuf


def _tensor_fields(cls) -> dict[str, int]:
    return {f.name: f.number for f in cls.DESCRIPTOR.fields
            if f.message_type is not None and f.message_type.full_name == pb.Tensor.DESCRIPTOR.full_name}


_TENSORS = {cls: _tensor_fields(cls) for cls in set(REQUEST.values()) | set(REPLY.values())}
_BY_NUMBER = {cls: {n: name for name, n in f.items()} for cls, f in _TENSORS.items()}


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _writable_bytes(n: int):
    """(bytes object of n bytes, writable uint8[n] numpy view of its contents).

    gRPC's Python API sends ``bytes`` only, so a reply that is to be filled in place must be a bytes
    object created uninitialized with ``PyBytes_FromStringAndSize(NULL, n)`` and written before anyone
    else sees it, the C-API's documented way to build a bytes object (the filled object is never
    hashed or shared before it is complete). Off CPython the view is a bytearray and ``bytes`` is made
    by copying it when the message is serialized."""
    if _PYBYTES_NEW is not None:
        b = _PYBYTES_NEW(None, n)
        return b, np.asarray(_BytesView(b))     # the view's base holds the bytes object alive
    buf = bytearray(n)
    return buf, np.frombuffer(buf, np.uint8)


class _BytesView:
    """Exposes the contents of a fresh bytes object as a writable uint8 array and keeps it alive (a
    numpy array made from this object has it as its base)."""

    def __init__(self, b: bytes):
        self.owner = b
        self.__array_interface__ = {"shape": (len(b),), "typestr": "|u1", "version": 3,
                                    "data": (id(b) + _BYTES_DATA_OFFSET, False)}


def _bytes_constructor():
    if sys.implementation.name != "cpython" or os.environ.get("ENGINE_PS_INPLACE_REPLY", "1") == "0":
        return None
    fn = ctypes.pythonapi.PyBytes_FromStringAndSize
    fn.restype = ctypes.py_object
    fn.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    return fn


_PYBYTES_NEW = _bytes_constructor()
_BYTES_DATA_OFFSET = bytes.__basicsize__ - 1     # offsetof(PyBytesObject, ob_sval)


class RawTensor:
    """A received Tensor: ``dtype`` (str), ``shape`` (tuple), ``data`` (memoryview of the message bytes,
    or ``b""``). Duck-types ``pb.Tensor`` for ``decode`` and ``is_absent``."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape: tuple, data):
        self.dtype, self.shape, self.data = dtype, shape, data

    @classmethod
    def of(cls, arr: np.ndarray | None) -> "RawTensor":
        """View a numpy array as a RawTensor (no copy; the in-process transport without serialization)."""
        if arr is None:
            return cls("", (), b"")
        arr = _le_contiguous(arr)
        return cls(arr.dtype.str, tuple(arr.shape), memoryview(arr.reshape(-1).view(np.uint8)))


class Wire:
    """An outgoing message: protobuf ``msg`` (Tensor fields left unset) plus arrays for Tensor fields
    (None: absent). Reads like the message: ``w.request_id``, ``w.values`` (a RawTensor view)."""

    __slots__ = ("msg", "arrays", "encoded")

    def __init__(self, msg, **arrays):
        fields = _TENSORS.get(type(msg))
        if fields is None:
            raise TypeError(f"{type(msg).__name__} is not a message of the PS protocol")
        for name in arrays:
            if name not in fields:
                raise TypeError(f"{type(msg).__name__} has no Tensor field {name!r}")
        self.msg = msg
        self.arrays = {k: v for k, v in arrays.items() if v is not None}
        self.encoded = None

    @classmethod
    def allocate(cls, msg, name: str, dtype: np.dtype, shape: tuple) -> "Wire":
        """A message whose one Tensor field ``name`` is filled in place: the final encoding is
        allocated once and ``w.arrays[name]`` is a writable ``dtype[shape]`` view of its data bytes.
        A pull reply is written by the table kernels straight into the bytes handed to gRPC, with no
        serialization copy (6.4 MB per 100k-key pull of dim 16). Write the array before ``serialize``.

        Raises
        ------
        TypeError
            ``name`` is not a Tensor field of ``msg``.
        """
        return cls.allocate_fields(msg, {name: (dtype, shape)})

    @classmethod
    def allocate_fields(cls, msg, specs: dict) -> "Wire":
        """``allocate`` for several Tensor fields: ``specs`` maps field name -> (dtype, shape); each
        ``w.arrays[name]`` is a writable view of its data bytes in the one final encoding (a Step
        reply carries the pulled rows and the fresh dense parameters this way).

        Raises
        ------
        TypeError
            A name is not a Tensor field of ``msg``.
        """
        fields = _TENSORS.get(type(msg))
        for name in specs:
            if fields is None or name not in fields:
                raise TypeError(f"{type(msg).__name__} has no Tensor field {name!r}")
        head = msg.SerializeToString()
        pos = len(head)
        chunks, layout = [(0, head)], []
        for name, (dtype, shape) in specs.items():
            dtype = np.dtype(dtype).newbyteorder("<")
            shape = tuple(int(d) for d in shape)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            prefix = _tensor_prefix(fields[name], dtype, shape, nbytes, pos)
            chunks.append((pos, prefix))
            layout.append((name, dtype, shape, pos + len(prefix), nbytes))
            pos += len(prefix) + nbytes
        encoded, view = _writable_bytes(pos)
        for at, part in chunks:
            view[at:at + len(part)] = np.frombuffer(part, np.uint8)
        w = cls(msg)
        for name, dtype, shape, start, nbytes in layout:
            w.arrays[name] = view[start:start + nbytes].view(dtype).reshape(shape)
        w.encoded = encoded
        return w

    def __getattr__(self, name):
        if name in _TENSORS[type(self.msg)]:
            return RawTensor.of(self.arrays.get(name))
        return getattr(self.msg, name)

    def SerializeToString(self) -> bytes:   # noqa: N802 - same name as protobuf messages
        return serialize(self)


class Received:
    """A parsed message: attributes of the protobuf message, Tensor fields as RawTensor views.
    ``error`` is a ProtocolError when the bytes did not parse (then only ``table`` and ``request_id``
    are meaningful, possibly empty)."""

    __slots__ = ("msg", "tensors", "error")

    def __init__(self, msg, tensors: dict, error: ProtocolError | None = None):
        self.msg, self.tensors, self.error = msg, tensors, error

    def __getattr__(self, name):
        t = self.tensors.get(name)
        if t is not None:
            return t
        return getattr(self.msg, name)


def _le_contiguous(arr) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def _tensor_prefix(field: int, dtype: np.dtype, shape: tuple, nbytes: int, pos: int) -> bytes:
    """Encoding of Tensor field ``field`` up to its ``data`` bytes, padded (``align``) so that the data
    starts at a multiple of ALIGN from the message start when the prefix is written at ``pos``."""
    meta = pb.Tensor(dtype=dtype.str, shape=shape).SerializeToString()
    tag = _varint(field << 3 | 2)
    dlen = _DATA_TAG + _varint(nbytes)
    for pad in (0,) + tuple(range(2, 2 * ALIGN + 2)):   # no align field, or one of 2.. bytes
        fill = _ALIGN_TAG + _varint(pad - 2) + bytes(pad - 2) if pad else b""
        body = meta + fill + dlen
        prefix = tag + _varint(len(body) + nbytes) + body
        if (pos + len(prefix)) % ALIGN == 0:
            return prefix
    return prefix   # not reached in practice; a misaligned payload is still valid (decode copies it)


def serialize(obj) -> bytes:
    """``Wire`` or protobuf message -> its protobuf encoding (a ``Wire``'s arrays copied once; a
    ``Wire.allocate`` reply is already its encoding and is returned as it is)."""
    if not isinstance(obj, Wire):
        return obj.SerializeToString()
    if obj.encoded is not None:
        return obj.encoded if isinstance(obj.encoded, bytes) else bytes(obj.encoded)
    head = obj.msg.SerializeToString()
    parts = [head]
    pos = len(head)
    fields = _TENSORS[type(obj.msg)]
    for name, arr in obj.arrays.items():
        arr = _le_contiguous(arr)
        prefix = _tensor_prefix(fields[name], arr.dtype, arr.shape, arr.nbytes, pos)
        parts.append(prefix)
        parts.append(memoryview(arr.reshape(-1).view(np.uint8)))
        pos += len(prefix) + arr.nbytes
    return b"".join(parts)


def _read_varint(buf, i: int, end: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= end or shift > 63:
            raise ProtocolError("truncated or corrupt message (bad varint)")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7


def _fields(buf, i: int, end: int):
    """Yield (field number, wire type, tag start, value start, value end) of a message span."""
    while i < end:
        f0 = i
        tag, i = _read_varint(buf, i, end)
        fn, wt = tag >> 3, tag & 7
        if fn == 0:
            raise ProtocolError("corrupt message (field number 0)")
        if wt == 0:
            _, v1 = _read_varint(buf, i, end)
        elif wt == 1:
            v1 = i + 8
        elif wt == 5:
            v1 = i + 4
        elif wt == 2:
            ln, i = _read_varint(buf, i, end)
            v1 = i + ln
        else:
            raise ProtocolError(f"corrupt message (unsupported wire type {wt} of field {fn})")
        if v1 > end:
            raise ProtocolError(f"truncated message: field {fn} runs {v1 - end} bytes past the end")
        yield fn, wt, f0, i, v1
        i = v1


def parse(buf, cls):
    """Bytes of a ``cls`` message -> ``Received`` (Tensor data viewed in place). Never raises: a
    malformed message gives a Received with ``error`` set. Messages without Tensor fields are parsed by
    the protobuf runtime and returned as they are."""
    by_number = _BY_NUMBER[cls]
    if not by_number:
        try:
            return cls.FromString(buf)
        except Exception as e:  # noqa: BLE001 - reported by the handler with the request context
            return Received(cls(), {}, ProtocolError(f"malformed {cls.__name__}: {e}"))
    mv = memoryview(buf)
    head, data = [], {}
    try:
        for count, (fn, wt, f0, v0, v1) in enumerate(_fields(mv, 0, len(mv))):
            if count >= MAX_WALKED_FIELDS:
                return _parse_slow(buf, cls)
            name = by_number.get(fn)
            if name is None or wt != 2:
                head.append(mv[f0:v1])
                continue
            meta = []
            for sfn, swt, s0, sv0, sv1 in _fields(mv, v0, v1):
                if sfn == 3 and swt == 2:
                    data[name] = mv[sv0:sv1]          # the last occurrence wins, as in protobuf
                elif sfn != 4:
                    meta.append(mv[s0:sv1])
            body = b"".join(meta)
            head.append(_varint(fn << 3 | 2) + _varint(len(body)) + body)
        msg = cls.FromString(b"".join(head))
    except Exception as e:  # noqa: BLE001 - reported by the handler with the request context
        return Received(_salvage(mv, cls), {}, e if isinstance(e, ProtocolError) else
                        ProtocolError(f"malformed {cls.__name__}: {e}"))
    tensors = {}
    for name in by_number.values():
        t = getattr(msg, name)
        tensors[name] = RawTensor(t.dtype, tuple(t.shape), data.get(name, b""))
    return Received(msg, tensors)


def _parse_slow(buf, cls):
    """The protobuf runtime's parse (copies the arrays): for odd encodings with many fields, which the
    Python wire walker would take long over."""
    try:
        msg = cls.FromString(bytes(buf))
    except Exception as e:  # noqa: BLE001 - reported by the handler with the request context
        return Received(_salvage(memoryview(buf), cls), {}, ProtocolError(f"malformed {cls.__name__}: {e}"))
    return Received(msg, {name: RawTensor(getattr(msg, name).dtype, tuple(getattr(msg, name).shape),
                                          getattr(msg, name).data) for name in _BY_NUMBER[cls].values()})


def _salvage(mv, cls):
    """The string fields ``table`` and ``request_id`` read up to the first malformed byte."""
    want = {f.number: f.name for f in cls.DESCRIPTOR.fields if f.name in ("table", "request_id")}
    msg = cls()
    try:
        for count, (fn, wt, _, v0, v1) in enumerate(_fields(mv, 0, len(mv))):
            if count >= MAX_WALKED_FIELDS:
                break
            if fn in want and wt == 2:
                setattr(msg, want[fn], bytes(mv[v0:v1]).decode("utf-8", "replace"))
    except ProtocolError:
        pass
    return msg


def parser(cls):
    """``parse`` bound to one message class (a gRPC deserializer)."""
    return lambda buf: parse(buf, cls)


def keys_or_empty(t, name: str) -> np.ndarray:
    """uint64[n] keys of field ``t`` (``name``), or none when the field is absent (``decode``)."""
    return np.empty(0, np.uint64) if is_absent(t) else decode(t, name, U64, 1)


def push_arrays(req, dim: int, what: str, *, may_be_empty: bool = False):
    """(keys uint64[n], grads float32[n, dim], shows float32[n] or None, clicks float32[n] or None) of
    the push part of a Push or Step request; ``may_be_empty`` (Step): absent keys and grads are an
    empty push. Raises ProtocolError naming the field on a wrong dtype, shape or size."""
    keys = keys_or_empty(req.keys, "keys") if may_be_empty else decode(req.keys, "keys", U64, 1)
    n = len(keys)
    if may_be_empty and n == 0 and is_absent(req.grads):
        grads = np.empty((0, dim), np.float32)
    else:
        grads = decode(req.grads, what, F32, 2, shape=(n, dim))
    shows, clicks = (None if is_absent(t) else decode(t, name, F32, 1, shape=(n,))
                     for name, t in (("shows", req.shows), ("clicks", req.clicks)))
    return keys, grads, shows, clicks
