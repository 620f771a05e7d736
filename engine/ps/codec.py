"""numpy arrays <-> ``Tensor`` messages, and the size limits of the wire.

A ``Tensor`` carries ``dtype`` (numpy's ``dtype.str``, always little-endian: ``"<u8"``, ``"<f4"``),
``shape`` and ``data``, the C-order bytes. Decoding is zero-copy (``np.frombuffer`` over the message's
bytes) and checks everything a malformed or truncated payload could get wrong.

Worked example: the keys ``[7, 9]`` (uint64) travel as::

    Tensor(dtype="<u8", shape=[2],
           data=b"\\x07\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x09\\x00\\x00\\x00\\x00\\x00\\x00\\x00")

and a pull reply of dim 2 for them as ``Tensor(dtype="<f4", shape=[2, 2], data=<16 bytes>)``.
An absent optional array (``shows`` of a push without counts) is the empty message (``dtype == ""``).

Chunking: a client splits a sparse request so that neither it nor its reply exceeds ``CHUNK_BYTES``
(see ``chunk_keys``); dense tables travel in blocks of ``DENSE_BLOCK`` floats. gRPC's message limits
are set to ``MAX_MESSAGE_BYTES``, comfortably above one chunk plus the message overhead.
"""
from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from . import ps_pb2 as pb

CHUNK_BYTES = 4 << 20          # payload bytes per sparse request or reply chunk
DENSE_BLOCK = 1 << 19          # floats per dense block (2 MiB)
MAX_MESSAGE_BYTES = 16 << 20   # gRPC max send/receive message length

U64 = np.dtype("<u8")
F32 = np.dtype("<f4")


def encode(arr: np.ndarray | None) -> pb.Tensor:
    """numpy array (any dtype, any shape) -> Tensor; None -> the empty Tensor. Copies once."""
    if arr is None:
        return pb.Tensor()
    arr = np.asarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return pb.Tensor(dtype=arr.dtype.str, shape=arr.shape, data=arr.tobytes())


def is_absent(t: pb.Tensor) -> bool:
    """True for the empty Tensor (an optional array left out)."""
    return not t.dtype and not t.shape and not t.data


def decode(t: pb.Tensor, name: str, dtype: np.dtype, ndim: int, *, shape: tuple | None = None
           ) -> np.ndarray:
    """Tensor -> read-only numpy array viewing the message bytes (no copy).

    Parameters
    ----------
    t : Tensor
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
    if len(t.data) != expected:
        raise ProtocolError(f"{name}: payload is {len(t.data)} bytes, expected {expected} for "
                            f"{dtype.name}{list(dims)} (truncated or corrupt message)")
    return np.frombuffer(t.data, dtype=dtype).reshape(dims)


def chunk_keys(dim: int) -> int:
    """Keys per sparse chunk for rows of ``dim`` float32: request (8-byte key + dim floats + show and
    click) and reply (dim floats) both stay within CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (8 + 4 * dim + 8))


def _fmt(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
