"""Config loading: key paths in errors, --set overrides, round trip through the resolved YAML."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import apply_overrides, dump_config, from_dict, load_config
from engine.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "logreg_demo.yaml"


def base() -> dict:
    return {"mode": "async", "cluster": {"servers": 2, "workers": 3},
            "tables": {"sparse": {"emb": {"dim": 4}}, "dense": {"d": {"optimizer": "sgd"}}},
            "model": {"kind": "logreg", "table": "emb", "dense_table": "d"}}


@pytest.mark.parametrize("override, message", [
    ("cluster.servers=0", "cluster.servers must be >= 1, got 0"),
    ("cluster.nope=1", "cluster: unknown key(s) ['nope']"),
    ("mode=fast", "mode must be one of ['sync', 'async', 'geo'], got 'fast'"),
    ("tables.sparse.emb.dim=0", "tables.sparse.emb.dim must be a positive int, got 0"),
    ("tables.sparse.emb.colour=red", "tables.sparse.emb: unknown key(s) ['colour']"),
    ("tables.dense.d.optimizer=rmsprop", "tables.dense.d.optimizer must be one of ['adam', 'sgd']"),
    ("model.kind=gpt", "model.kind must be one of"),
    ("model.batch_size=0", "model.batch_size must be >= 1, got 0"),
    ("model.epochs=two", "model.epochs must be an int, got 'two'"),
    ("client.timeout_s=-1", "client.timeout_s must be > 0, got -1.0"),
    ("geo.k_steps=0", "geo.k_steps must be >= 1, got 0"),
    ("cluster.endpoints=[a:1]", "cluster.endpoints lists 1 servers but cluster.servers is 2"),
    ("extra=1", "unknown key(s) ['extra']"),
])
def test_errors_name_the_key_path(override, message):
    with pytest.raises(ConfigError) as ei:
        from_dict(apply_overrides(base(), [override]))
    assert message in str(ei.value)


def test_set_overrides_parse_yaml_values_and_create_paths():
    d = apply_overrides(base(), ["cluster.workers=5", "mode=geo", "geo.learning_rate=0.5",
                                 "cluster.endpoints=[h:1, h:2]", "tables.sparse.emb.spill_path=null"])
    cfg = from_dict(d)
    assert cfg.cluster.workers == 5 and cfg.mode == "geo" and cfg.geo.learning_rate == 0.5
    assert cfg.cluster.endpoints == ("h:1", "h:2")
    assert cfg.sparse_tables["emb"].spill_path is None
    assert base()["cluster"]["workers"] == 3   # the input mapping is not modified
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        apply_overrides({}, ["mode"])
    with pytest.raises(ConfigError, match="not a mapping"):
        apply_overrides({"mode": "sync"}, ["mode.x=1"])


def test_config_is_frozen_and_round_trips(tmp_path):
    cfg = load_config(DEMO, ["mode=sync"])
    with pytest.raises(Exception):
        cfg.mode = "geo"
    dump_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
