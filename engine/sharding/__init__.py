"""Where a sparse key lives: the pure routing function (key -> vshard -> server -> local shard) and the
grouping kernel that cuts arrays by it.

Both the parameter server (``engine.ps``) and the checkpoint reader and writer (``engine.checkpoint``)
route keys; this package sits below both and imports neither, so neither imports the other to route.

* ``routing``   ``vshard_of``, ``route``, ``lookup``, ``local_shard_owners``, ... (see its docstring)
* ``_kernels``  ``group``: a stable counting sort of positions by label
"""
from .routing import (DEFAULT_NUM_VSHARDS, local_shard_owners, lookup, mix64, route,
                      vshard_bounds, vshard_of, vshard_owners)

__all__ = ["DEFAULT_NUM_VSHARDS", "local_shard_owners", "lookup", "mix64", "route", "vshard_bounds",
           "vshard_of", "vshard_owners"]
