"""Key routing: which virtual shard, server and local shard a sparse key belongs to.

The function is pure and fixed, so every client, server and checkpoint agrees on it::

    vshard(key)  = mix64(key) % num_vshards                     (num_vshards default 1024)
    server(v)    = s such that lo(s) <= v < lo(s + 1),  lo(s) = s * num_vshards // num_servers
    local(v)     = (v - lo(s)) * num_local // (lo(s + 1) - lo(s))

``mix64`` is the 64-bit finalizer of SplitMix64 (Stafford's "Mix13"), an invertible bit mixer::

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >> 31)                                            (all mod 2**64)

The sparse table's own index uses a different (salted murmur fmix64) hash, so the keys of one vshard
still spread evenly over a shard's index. Vshards map to servers in contiguous ranges; a checkpoint
written per vshard (group) can therefore be loaded onto any number of servers.

This module sits below ``engine.ps`` and ``engine.checkpoint`` (both route keys); ``engine.ps.routing``
re-exports it.

Example::

    >>> import numpy as np
    >>> keys = np.array([1, 2, 3], dtype=np.uint64)
    >>> route(keys, 1024, 2)                 # server index per key, int32[3]
    >>> vshard_of(keys, 1024)                # what checkpoints group rows by, int32[3]
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..errors import ConfigError, ProtocolError

DEFAULT_NUM_VSHARDS = 1024

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@njit(cache=True, nogil=True)
def _mix64(z):
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True)
def _vshards_kernel(keys, num_vshards, out):
    nv = np.uint64(num_vshards)
    for i in range(keys.shape[0]):
        out[i] = np.int32(_mix64(keys[i]) % nv)


@njit(cache=True, nogil=True)
def _lookup_kernel(keys, num_vshards, owner, out):
    nv = np.uint64(num_vshards)
    for i in range(keys.shape[0]):
        out[i] = owner[np.int64(_mix64(keys[i]) % nv)]


def _check_keys(keys) -> np.ndarray:
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.ndim != 1:
        got = f"{keys.dtype}{list(keys.shape)}" if isinstance(keys, np.ndarray) else type(keys).__name__
        raise ProtocolError(f"keys: expected a uint64[n] array, got {got}")
    return np.ascontiguousarray(keys)


def mix64(keys: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer of keys : uint64[n] -> uint64[n] (see the module docstring)."""
    keys = _check_keys(keys)
    out = np.empty(len(keys), np.uint64)
    _mix_kernel(keys, out)
    return out


@njit(cache=True, nogil=True)
def _mix_kernel(keys, out):
    for i in range(keys.shape[0]):
        out[i] = _mix64(keys[i])


def vshard_of(keys: np.ndarray, num_vshards: int = DEFAULT_NUM_VSHARDS) -> np.ndarray:
    """Virtual shard of each key: keys : uint64[n] -> int32[n] in [0, num_vshards)."""
    keys = _check_keys(keys)
    _check_counts(num_vshards, 1)
    out = np.empty(len(keys), np.int32)
    _vshards_kernel(keys, num_vshards, out)
    return out


def vshard_bounds(num_vshards: int, num_servers: int) -> np.ndarray:
    """int64[num_servers + 1]: server s owns vshards [bounds[s], bounds[s + 1])."""
    _check_counts(num_vshards, num_servers)
    return np.array([s * num_vshards // num_servers for s in range(num_servers + 1)], np.int64)


def vshard_owners(num_vshards: int, num_servers: int) -> np.ndarray:
    """int32[num_vshards]: the server owning each vshard (contiguous ranges, sizes differ by <= 1)."""
    b = vshard_bounds(num_vshards, num_servers)
    return np.repeat(np.arange(num_servers, dtype=np.int32), np.diff(b))


def local_shard_owners(num_vshards: int, num_servers: int, server: int, num_local: int) -> np.ndarray:
    """int32[num_vshards]: the local shard of each vshard on ``server`` (-1 for vshards it does not own).

    Server ``server``'s vshard range is split into ``num_local`` contiguous sub-ranges.
    """
    b = vshard_bounds(num_vshards, num_servers)
    lo, hi = int(b[server]), int(b[server + 1])
    if num_local < 1:
        raise ConfigError(f"num_local must be >= 1, got {num_local}")
    out = np.full(num_vshards, -1, np.int32)
    if hi > lo:
        out[lo:hi] = (np.arange(hi - lo, dtype=np.int64) * num_local // (hi - lo)).astype(np.int32)
    return out


def route(keys: np.ndarray, num_vshards: int, num_servers: int) -> np.ndarray:
    """Server index of each key.

    Parameters
    ----------
    keys : uint64[n]
    num_vshards, num_servers : int

    Returns
    -------
    int32[n] in [0, num_servers)

    Raises
    ------
    ProtocolError
        keys is not uint64[n].
    ConfigError
        num_vshards < num_servers, or either is < 1.
    """
    return lookup(keys, num_vshards, vshard_owners(num_vshards, num_servers))


def lookup(keys: np.ndarray, num_vshards: int, owner: np.ndarray) -> np.ndarray:
    """owner[vshard(key)] for each key : uint64[n] -> int32[n] (owner : int32[num_vshards])."""
    keys = _check_keys(keys)
    out = np.empty(len(keys), np.int32)
    _lookup_kernel(keys, num_vshards, owner, out)
    return out


def _check_counts(num_vshards: int, num_servers: int) -> None:
    if not isinstance(num_vshards, (int, np.integer)) or num_vshards < 1:
        raise ConfigError(f"num_vshards must be an int >= 1, got {num_vshards!r}")
    if not isinstance(num_servers, (int, np.integer)) or not 1 <= num_servers <= num_vshards:
        raise ConfigError(f"num_servers must be an int in [1, num_vshards={num_vshards}], got {num_servers!r}")
