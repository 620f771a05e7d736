"""Two jobs with the same ``spill_path`` and table names on one machine: the second job's server is
refused with an error naming the spill directory it would have shared, and the first job's server keeps
serving with its rows intact (nothing of its spill directory was wiped). Real server processes."""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.config import from_dict
from engine.errors import LaunchError
from engine.launch.local import LocalCluster
from engine.ps import PSClient

pytestmark = pytest.mark.slow

DIM = 4


def test_second_server_on_a_used_spill_path_is_refused_and_the_first_keeps_serving(tmp_path):
    spill = tmp_path / "spill"
    cfg = from_dict({"cluster": {"servers": 1, "workers": 1, "local_shards": 2, "startup_timeout_s": 120},
                     "tables": {"sparse": {"emb": {"dim": DIM, "optimizer": "sgd", "learning_rate": 1.0,
                                                   "initializer": "zeros", "memory_rows": 100,
                                                   "spill_path": str(spill), "num_threads": 1}}}})
    first = LocalCluster(cfg, tmp_path / "run-a")
    second = LocalCluster(cfg, tmp_path / "run-b")
    try:
        endpoints = first.start_servers()
        keys = np.arange(1, 2001, dtype=np.uint64)
        with PSClient(endpoints, timeout_s=60) as client:
            client.wait_ready(60)
            client.push("emb", keys, np.ones((len(keys), DIM), np.float32))
            before = client.pull("emb", keys)
            assert client.stats()[0]["sparse"]["emb"]["rows_spilled"] > 0
            owned = sorted(os.listdir(spill))
            assert owned == ["emb-server0-shard0", "emb-server0-shard1"]
            with pytest.raises(LaunchError) as ei:
                second.start_servers()
            msg = str(ei.value)
            assert str(spill / "emb-server0-shard0") in msg and "in use by another table or process" in msg
            assert first.servers[0].proc.poll() is None          # the first server is still up ...
            np.testing.assert_array_equal(client.pull("emb", keys), before)   # ... with every row
            client.push("emb", keys[:10], np.ones((10, DIM), np.float32))
            np.testing.assert_array_equal(client.pull("emb", keys[:10]), before[:10] - 1)
            assert sorted(os.listdir(spill)) == owned
            for d in owned:
                assert (spill / d / ".sparse-engine-spill").is_file()
        first.stop_servers()
    finally:
        second.shutdown()
        first.shutdown()
