"""How kernel helpers that take arrays are compiled, and when the compiled kernels cached on disk are stale.

Numba inlines ``@njit(inline="always")`` helpers into the caller's IR, and every inlined call then takes
and drops a reference on each array argument (``NRT_incref``/``NRT_decref``: a ``lock`` instruction
each) that Numba's refcount pruning cannot remove inside loops with early exits. In a table push those
atomics were 70% of the time with the rows in cache (perf, 20k-row table). ``borrowed`` compiles a
helper as its own function without the runtime's reference counting (``_nrt=False``): the caller
passes its arrays as borrowed references and LLVM is free to inline the body. Measured on 10M rows of
dim 16 (push, adagrad): 4.4M -> 5.3-6.0M keys/s; a cache-resident lookup (``find_rows``) 30 -> 12 ns per
key.

A ``borrowed`` helper must not allocate arrays (no NRT); scalar-only helpers stay
``@njit(inline="always")``. With ``NUMBA_DISABLE_JIT=1`` it returns the Python function.

Stale caches. Numba keys a kernel's on-disk cache (``cache=True``: ``__pycache__/*.nbi``, ``*.nbc``) on
a sha256 of the kernel's own source file, and nothing else. Kernels here compile helpers of other
modules into themselves: ``_kernels.push_rows`` the optimizer rules of ``_optimizers``; ``keysets``,
``_evict``, ``_compact`` and ``_load_kernels`` the hashes of ``_kernels``; ``models._w2v_kernels`` the
``sparse_tables.kernels`` mixers. A change to such a helper alone (a fix of an optimizer rule, pulled
into a checkout, or an upgrade whose ``__pycache__`` outlived it) left those kernels running the old
code from their caches, silently; touching their files did not help (the key is the text, not the
time). ``install_cache_stamp`` (run on import, before any kernel is defined) adds a sha256 of every
kernel source of this package (its ``.py`` files that use Numba) to the cache key of each kernel
defined in this package or in a module that imports ``sparse_tables.kernels``: a change to any of them
recompiles them all once. It uses Numba's cache locators (``numba.core.caching``, the classes ``NUMBA_CACHE_LOCATOR_CLASSES`` names):
where they are not as expected it does nothing, and the caches behave as Numba's own.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba import njit

borrowed = njit(_nrt=False, cache=True, nogil=True)

_PACKAGE = Path(__file__).resolve().parent
_IMPORTS_PUBLIC_KERNELS = (b"from sparse_tables.kernels import", b"import sparse_tables.kernels")


@functools.lru_cache(maxsize=None)
def package_stamp() -> bytes:
    """sha256 of this package's kernel sources (each ``.py`` file that mentions numba: name and text)."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.glob("*.py")):
        text = path.read_bytes()
        if b"numba" in text:
            h.update(path.name.encode() + b"\0" + text + b"\0")
    return h.digest()


@functools.lru_cache(maxsize=None)
def _stamped(py_file: str) -> bool:
    """Whether kernels of ``py_file`` inline this package's helpers: files of this package, and modules
    that import ``sparse_tables.kernels`` (at their top, so this module ran before their kernels)."""
    path = Path(py_file).resolve()
    if path.parent == _PACKAGE:
        return True
    try:
        text = path.read_bytes()
    except OSError:
        return False
    return any(s in text for s in _IMPORTS_PUBLIC_KERNELS)


def install_cache_stamp() -> bool:
    """Register the cache locators described in the module docstring ahead of Numba's own (once per
    process). Returns whether they are in place."""
    try:
        from numba.core import caching
    except ImportError:
        return False

    def named(name):            # Numba 0.68 names them without the underscore of earlier versions
        return getattr(caching, name, None) or getattr(caching, "_" + name, None)

    impl = named("CacheImpl")
    bases = [named(n) for n in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")]
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list) or not all(isinstance(b, type) for b in bases):
        return False            # another Numba: its own caching, unchanged
    if any(getattr(c, "_sparse_tables_stamp", False) for c in classes):
        return True
    stamped = []
    for base in bases:
        def get_source_stamp(self, _base=base):
            return (_base.get_source_stamp(self), package_stamp())

        def from_function(cls, py_func, py_file, _base=base):
            if not _stamped(py_file):
                return None
            return _base.from_function.__func__(cls, py_func, py_file)

        stamped.append(type(f"SparseTables{base.__name__.lstrip('_')}", (base,), {
            "_sparse_tables_stamp": True, "get_source_stamp": get_source_stamp,
            "from_function": classmethod(from_function)}))
    classes[:0] = stamped
    return True


install_cache_stamp()
