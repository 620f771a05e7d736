"""Key routing of the parameter server: a re-export of ``engine.sharding.routing`` (the pure function
key -> vshard -> server -> local shard, documented there), which lives below both ``engine.ps`` and
``engine.checkpoint`` so the checkpoint reader and writer route keys without importing ``engine.ps``.

    >>> import numpy as np
    >>> from engine.ps import routing
    >>> routing.route(np.array([1, 2, 3], dtype=np.uint64), 1024, 2)   # server index per key, int32[3]
"""
from ..sharding.routing import (DEFAULT_NUM_VSHARDS, local_shard_owners, lookup, mix64, route,
                                vshard_bounds, vshard_of, vshard_owners)

__all__ = ["DEFAULT_NUM_VSHARDS", "local_shard_owners", "lookup", "mix64", "route", "vshard_bounds",
           "vshard_of", "vshard_owners"]
