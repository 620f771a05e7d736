"""``ENGINE_SERVERS`` against ``cluster.servers`` in role mode (README, "A cluster on several hosts").

A server routes vshards by ``cluster.servers`` of its config, a worker by the endpoints it is given. A
count that differs made the worker fail at its first call with a ``ProtocolError`` traceback ("server 0
of 2, expected server 0 of 1"), exit 1, which a scheduler retries; it is a config error (exit 2, one line
naming both) before the worker connects to anything."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import load_config
from engine.errors import ConfigError
from engine.roles import server_endpoints

REPO = Path(__file__).resolve().parents[2]


def test_engine_servers_must_list_cluster_servers_endpoints(monkeypatch):
    cfg = load_config(REPO / "configs" / "logreg_demo.yaml", ["cluster.servers=2"])
    monkeypatch.setenv("ENGINE_SERVERS", "127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"ENGINE_SERVERS lists 1 servers but cluster.servers is 2"):
        server_endpoints(cfg)
    monkeypatch.setenv("ENGINE_SERVERS", "127.0.0.1:1,127.0.0.1:2")
    assert server_endpoints(cfg) == ["127.0.0.1:1", "127.0.0.1:2"]


def test_a_worker_given_fewer_endpoints_than_cluster_servers_exits_2_with_one_line():
    env = {**os.environ, "ENGINE_SERVERS": "127.0.0.1:1", "ENGINE_NUM_WORKERS": "1"}
    env.pop("ENGINE_ROLE", None)
    p = subprocess.run([sys.executable, "-m", "engine.cli", "train", "configs/logreg_demo.yaml", "--role", "worker",
                        "--set", "cluster.servers=2", "--set", "cluster.startup_timeout_s=3",
                        "--set", "cluster.warm_up=false"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "ENGINE_SERVERS lists 1 servers but cluster.servers is 2" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("endpoint, why", [("h", "no ':port'"), ("h:x", "the port must be in [1, 65535], got 'x'"),
                                           (":7100", "no host"), ("h:0", "the port must be in [1, 65535], got '0'"),
                                           ("h:70000", "the port must be in [1, 65535], got '70000'")])
def test_an_endpoint_that_is_not_host_port_is_a_config_error(monkeypatch, endpoint, why):
    """A server given ``cluster.endpoints: [h]`` (or ``h:x``) died on it with an IndexError (ValueError)
    traceback, a worker waited cluster.startup_timeout_s for it; ``engine status :1`` exited 1 "unreachable"."""
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / "logreg_demo.yaml",
                    ["cluster.servers=2", f"cluster.endpoints=[h:1, '{endpoint}']"])
    assert str(e.value) == f"cluster.endpoints[1] must be host:port ({why}), got '{endpoint}'"
    cfg = load_config(REPO / "configs" / "logreg_demo.yaml", ["cluster.servers=2"])
    monkeypatch.setenv("ENGINE_SERVERS", f"h:1,{endpoint}")
    with pytest.raises(ConfigError) as e:
        server_endpoints(cfg)
    assert str(e.value) == f"ENGINE_SERVERS must be host:port ({why}), got '{endpoint}'"
    from engine.observability import status
    with pytest.raises(ConfigError) as e:
        status.resolve(f"h:1,{endpoint}", root="/nonexistent")
    assert str(e.value).endswith(f"is neither a directory nor host:port endpoints (bad: {endpoint})")
    good = load_config(REPO / "configs" / "logreg_demo.yaml",
                       ["cluster.servers=2", "cluster.endpoints=['[::1]:1', h:65535]"])
    assert good.cluster.endpoints == ("[::1]:1", "h:65535")
