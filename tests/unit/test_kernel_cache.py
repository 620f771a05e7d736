"""Kernels cached on disk (``cache=True``) recompile when a helper they compile in changes in another
module (``sparse_tables._jit``): Numba keys a cache on the kernel's own file only, so a change to
``_kernels.fmix64`` alone left ``keysets``' Bloom filter kernels, cached before, running the old hash
(and a change to an optimizer rule in ``_optimizers`` left ``push_rows`` running the old rule)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core import config

import sparse_tables

pytestmark = pytest.mark.skipif(config.DISABLE_JIT, reason="compiled-kernel caches")

PROBE = """
import numpy as np, sparse_tables
from sparse_tables.keysets import ScalableBloom
assert sparse_tables.__file__.startswith({root!r}), sparse_tables.__file__
b = ScalableBloom(initial_capacity=64, bits_per_key=2, nhash=1)   # a small filter: many false positives
b.add(np.arange(64, dtype=np.uint64))
print(np.flatnonzero(b.may_contain(np.arange(1000, 1400, dtype=np.uint64))).tolist())
"""


def test_a_changed_helper_recompiles_the_kernels_of_other_modules_that_inline_it(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(Path(sparse_tables.__file__).parent, root / "sparse_tables",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "probe.py").write_text(PROBE.format(root=str(root)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}

    def probe(**extra) -> str:
        out = subprocess.run([sys.executable, "probe.py"], cwd=root, env={**env, **extra}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    before = probe()                              # compiled, and cached in sparse_tables/__pycache__
    kernels = root / "sparse_tables" / "_kernels.py"
    text = kernels.read_text()
    assert "x *= U64(0xFF51AFD7ED558CCD)" in text
    kernels.write_text(text.replace("x *= U64(0xFF51AFD7ED558CCD)", "x *= U64(0xFF51AFD7ED558CCF)"))
    fresh = probe(NUMBA_CACHE_DIR=str(tmp_path / "fresh"))     # the new fmix64, compiled from nothing
    assert fresh != before
    assert probe() == fresh                       # the cached keysets kernels were recompiled
