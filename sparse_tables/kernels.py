"""Numba building blocks of the sparse tables that other packages' kernels may call.

The table's own kernels stay private (``sparse_tables._kernels``); this module is the public, stable
part of them: scalar 64-bit mixers and a software prefetch hint, all usable inside ``@njit`` code of
any package (``models``' word2vec kernels, ``engine.export``'s lookup kernels) and from Python.

    >>> import numpy as np
    >>> from sparse_tables.kernels import splitmix64
    >>> int(splitmix64(np.uint64(0)))
    16294208416658607535

Contents
--------
splitmix64(x : uint64) -> uint64
    SplitMix64 (Steele, Lea & Flood 2014), one step of the generator seeded with ``x``. The one SplitMix64
    of the code base: row initialization is a pure function of ``(seed, key)`` built from it, here and in
    ``models._w2v_kernels.init_input_rows``.
fmix64(x : uint64) -> uint64
    MurmurHash3's 64-bit finalizer (Appleby): a bijection on uint64 with full avalanche. The table index
    hashes ``fmix64(key ^ salt)``.
prefetch(arr, i), prefetch_last(arr, i)
    Ask the CPU for the cache line of ``arr[i]`` (1-D) or the first / last line of row ``i`` (2-D),
    without blocking. No-ops under ``NUMBA_DISABLE_JIT=1``.

The mixers are ``@njit(inline="always")``: they compile into the caller, so a caller's
``@njit(cache=True)`` cache holds their code. Numba keys a cache on the text of the caller's own source
file only (touching it does nothing); a module that imports this one at its top has its cached kernels
keyed on this package's kernel sources too (``sparse_tables._jit.install_cache_stamp``), so they
recompile after a change here.

These names are the same objects as the private ones (re-exported, not copied), so a kernel that
calls them compiles to the same code as the table's own kernels.
"""
from __future__ import annotations

from ._kernels import fmix64, splitmix64
from ._prefetch import prefetch, prefetch_last

__all__ = ["splitmix64", "fmix64", "prefetch", "prefetch_last"]
