"""The table's hot kernels take no array references inside their loops (see sparse_tables/_jit.py).

A structural guard, not a timing: Numba's reference counting (``NRT_incref``, a ``lock`` instruction)
inside a per-key loop made a cache-resident push 3x slower. Each kernel is compiled afresh from its
Python source for the signature the table used, with its own options (``push_rows`` runs without
reference counting, so the optimizer rule it inlines adds none), and its LLVM IR may hold no more ``NRT_incref`` calls
than its array arguments (the function's own prologue).
"""
from __future__ import annotations

import numba
import numpy as np
import pytest
from numba.core import config, types

from sparse_tables import SparseTable, TableConfig
from sparse_tables import _kernels as K

pytestmark = pytest.mark.skipif(config.DISABLE_JIT, reason="inspects compiled code")


@pytest.fixture(scope="module")
def used_kernels():
    t = SparseTable(TableConfig(dim=8, optimizer="adagrad", num_threads=1))
    keys = np.arange(2000, dtype=np.uint64)
    t.push(keys, np.ones((2000, 8), np.float32))
    t.pull(keys)
    t.pull(keys, out=np.empty((2000, 8), np.float32), rows=np.arange(0, 2000, 3))
    t.contains(keys)
    t.close()


@pytest.mark.parametrize("name", ["push_rows", "pull_rows", "pull_rows_at", "dedup_index", "find_rows"])
def test_hot_kernels_take_no_references_inside_their_loops(name, used_kernels):
    disp = getattr(K, name)
    assert disp.signatures, f"{name} was not compiled by the table calls above"
    sig = disp.signatures[0]
    options = {k: v for k, v in disp.targetoptions.items() if k != "cache"}   # e.g. push_rows' _nrt=False
    fresh = numba.njit(**options)(disp.py_func)
    fresh.compile(sig)
    body = fresh.inspect_llvm(sig).split("define ptr @_ZN7cpython")[0]   # the kernel, not its wrapper
    arrays = sum(isinstance(a, types.Array) for a in sig)
    increfs = body.count("call void @NRT_incref")
    assert increfs <= arrays, (f"{name}: {increfs} NRT_incref calls for {arrays} array arguments; an "
                               f"array-taking helper is inlined into a loop (use sparse_tables._jit.borrowed)")
