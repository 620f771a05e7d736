"""Config loading: key paths in errors, --set overrides, round trip through the resolved YAML."""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from engine.config import (SECRET_ENV, ClusterConfig, ServerConfig, apply_overrides, dump_config, from_dict,
                           load_config, restore_secrets, secret_env)
from engine.config_yaml import load_yaml
from engine.errors import ConfigError
from engine.launch.local import LocalCluster
from engine.program_configs import PROGRAM_CONFIGS, program_config_class
from engine.programs import PROGRAMS, load_program

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "logreg_demo.yaml"


def base() -> dict:
    return {"mode": "async", "cluster": {"servers": 2, "workers": 3},
            "tables": {"sparse": {"emb": {"dim": 4}}, "dense": {"d": {"optimizer": "sgd"}}},
            "model": {"kind": "logreg", "table": "emb", "dense_table": "d"}}


@pytest.mark.parametrize("override, message", [
    ("cluster.servers=0", "cluster.servers must be >= 1, got 0"),
    ("cluster.nope=1", "cluster: unknown key(s) ['nope']"),
    ("mode=fast", "mode must be one of ['sync', 'async', 'geo', 'hybrid'], got 'fast'"),
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
    with pytest.raises(ConfigError, match=r"^config file .*: is a directory, not a YAML file$"):   # was "not found"
        load_config(tmp_path)


def test_a_file_that_is_not_utf8_or_not_readable_is_a_config_error(tmp_path):
    """A Latin-1 byte gave a UnicodeDecodeError traceback (exit 1); now one line naming the file, the
    byte's offset and its line."""
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"mode: async\ncluster:\n  workers: 1\n# caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == (f"config file {bad}: not UTF-8 text: byte 0xe9 at offset 39 (line 4) cannot be "
                            f"decoded (invalid continuation byte); save the file as UTF-8")
    if os.geteuid() != 0:                  # root reads a mode-0 file anyway
        locked = tmp_path / "locked.yaml"
        locked.write_text("mode: async\n")
        locked.chmod(0)
        with pytest.raises(ConfigError, match=f"config file {locked}: cannot read it: Permission denied"):
            load_config(locked)


# ----------------------------------------------------------------------------- field kinds (issue 15)
ONLINE = REPO / "configs" / "ctr_online.yaml"


def _yaml(tmp_path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


ONLINE_BASE = """
cluster: {servers: 2, workers: 3}
tables:
  sparse: {emb: {dim: 4}}
  dense: {d: {optimizer: sgd}}
model:
  kind: ctr_online
  sparse_table: emb
  dense_table: d
"""


@pytest.mark.parametrize("written, expected", [
    ("2024010108", "2024010108"),    # an int to YAML
    ("0100", "0100"),                # an int (100) to YAML 1.2, octal 64 to YAML 1.1
    ("yes", "yes"),                  # a bool to YAML 1.1
    ("true", "true"),
    ("2024-01-01", "2024-01-01"),    # a date to YAML
    ("1e3", "1e3"),
    ("'0100'", "0100"),              # quoted: a string anyway
])
def test_string_fields_get_the_text_as_written_in_files_and_set(tmp_path, written, expected):
    from_file = load_config(_yaml(tmp_path, ONLINE_BASE + f"  until: {written}\n"))
    assert from_file.model.params.until == expected
    from_set = load_config(_yaml(tmp_path, ONLINE_BASE), [f"model.until={written}"])
    assert from_set.model.params.until == expected
    # a sparse table's string fields (sparse_tables.TableConfig) too
    cfg = load_config(_yaml(tmp_path, ONLINE_BASE), [f"tables.sparse.emb.spill_path={written}"])
    assert cfg.sparse_tables["emb"].spill_path == expected


def test_until_and_other_strings_from_the_shipped_config():
    cfg = load_config(ONLINE, ["model.until=2024010108", "model.partitions=0100", "checkpoint.base_every=3600"])
    p = cfg.model.params
    assert (p.until, p.partitions, cfg.checkpoint.base_every) == ("2024010108", "0100", "3600")
    assert load_config(ONLINE, ["model.until=0100"]).model.params.until == "0100"
    assert load_config(ONLINE).model.params.until == ""
    assert load_config(ONLINE).sparse_tables["embedding"].spill_path is None      # spill_path: null


def test_null_and_empty_for_a_string_field(tmp_path):
    assert load_config(_yaml(tmp_path, ONLINE_BASE + "  until:\n")).model.params.until == ""
    assert load_config(_yaml(tmp_path, ONLINE_BASE), ["model.until="]).model.params.until == ""
    with pytest.raises(ConfigError, match="model.until must be a string, got None"):
        load_config(_yaml(tmp_path, ONLINE_BASE + "  until: null\n"))
    with pytest.raises(ConfigError, match=r"model.until must be a string, got \[1, 2\]"):
        load_config(_yaml(tmp_path, ONLINE_BASE), ["model.until=[1, 2]"])


def test_every_field_kind_through_a_file_and_through_set(tmp_path):
    text = """
cluster: {servers: 2, workers: 3, warm_up: false, endpoints: [h:1, h:2], startup_timeout_s: 5}
geo: {learning_rate: 1, delta_scale: sum}
server: {max_concurrent_rpcs: 0, reply_window_bytes: 1024, max_barrier_wait_s: 1.5}
model:
  kind: ctr_dnn
  hidden: [8, 4]
  slots: [C1, 0100]
  data: {source: generated, generated_rows: 100}
"""
    sets = ["cluster.servers=2", "cluster.workers=3", "cluster.warm_up=false", "cluster.endpoints=[h:1, h:2]",
            "cluster.startup_timeout_s=5", "geo.learning_rate=1", "geo.delta_scale=sum",
            "server.max_concurrent_rpcs=0", "server.reply_window_bytes=1024", "server.max_barrier_wait_s=1.5",
            "model.kind=ctr_dnn", "model.hidden=[8, 4]", "model.slots=[C1, 0100]", "model.data.source=generated",
            "model.data.generated_rows=100"]
    for cfg in (load_config(_yaml(tmp_path, text)), load_config(_yaml(tmp_path, "{}"), sets)):
        assert cfg.cluster.workers == 3 and type(cfg.cluster.workers) is int                     # int
        assert cfg.cluster.warm_up is False                                                      # bool
        assert cfg.cluster.endpoints == ("h:1", "h:2")                                           # list -> tuple
        assert cfg.cluster.startup_timeout_s == 5.0 and type(cfg.cluster.startup_timeout_s) is float
        assert cfg.geo.learning_rate == 1.0 and cfg.geo.delta_scale == "sum"                     # float, choice
        assert (cfg.server.max_concurrent_rpcs, cfg.server.reply_window_bytes,
                cfg.server.max_barrier_wait_s) == (0, 1024, 1.5)                                 # new section
        p = cfg.model.params
        assert p.hidden == (8, 4) and p.slots == ("C1", "0100")                                  # tuples
        assert p.data.source == "generated" and p.data.generated_rows == 100                     # nested section
    # a comma-separated string for a list field; each piece read as YAML for non-string items
    cfg = load_config(_yaml(tmp_path, "model: {kind: ctr_dnn}\n"), ["model.slots=C1,0100", "model.hidden=16,8"])
    assert cfg.model.params.slots == ("C1", "0100") and cfg.model.params.hidden == (16, 8)


def test_yaml_1_2_numbers_and_booleans(tmp_path):
    cfg = load_config(_yaml(tmp_path, "cluster: {num_vshards: 0100, warm_up: true}\n"))
    assert cfg.cluster.num_vshards == 100                    # not octal 64 (YAML 1.1)
    with pytest.raises(ConfigError, match="cluster.warm_up must be true or false, got 'yes'"):
        load_config(_yaml(tmp_path, "cluster: {warm_up: yes}\n"))


@pytest.mark.parametrize("override, message", [
    # strict booleans and ints
    ("cluster.warm_up=1", "cluster.warm_up must be true or false, got 1"),
    ("cluster.warm_up=yes", "cluster.warm_up must be true or false, got 'yes'"),
    ("cluster.warm_up='true'", "cluster.warm_up must be true or false, got 'true'"),
    ("cluster.workers=true", "cluster.workers must be an int, got True"),
    ("cluster.workers=3.0", "cluster.workers must be an int, got 3.0"),
    ("cluster.workers='3'", "cluster.workers must be an int, got '3'"),
    ("geo.learning_rate=fast", "geo.learning_rate must be a number, got 'fast'"),
    ("geo.learning_rate=.nan", "geo.learning_rate must be a finite number, got nan"),
    ("cluster.host=[a]", "cluster.host must be a string, got ['a']"),
    ("cluster.endpoints={a: 1}", "cluster.endpoints must be a list, got {'a': 1}"),
    ("model.hidden=[8, x]", "model.hidden[1] must be an int, got 'x'"),
    ("cluster=5", "cluster must be a mapping, got 5"),
    ("model.data=5", "model.data must be a mapping, got 5"),
    # bounds and choices
    ("server.max_barrier_wait_s=0", "server.max_barrier_wait_s must be > 0, got 0.0"),
    ("server.max_concurrent_rpcs=-1", "server.max_concurrent_rpcs must be >= 0, got -1"),
    ("server.reply_window_bytes=-1", "server.reply_window_bytes must be >= 0, got -1"),
    ("tables.dense.d.beta1=1", "tables.dense.d.beta1 must be <= 0.999999, got 1.0"),
    ("model.data.generated_rows=5", "model.data.generated_rows must be >= 10, got 5"),
    ("geo.delta_scale=max", "geo.delta_scale must be one of ['mean', 'sum'], got 'max'"),
    ("model.pipeline=0100", "model.pipeline must be one of ['exact', 'stale', 'sequential'], got '0100'"),
    ("checkpoint.keep_bases=0", "checkpoint.keep_bases must be >= 1, got 0"),
    ("checkpoint.delta_every=soon", "checkpoint.delta_every must be a duration like 30m, 1h, 3600s, a step count "
                                    "like 500steps, 'partition' or 0, got 'soon'"),
    # unknown keys, in nested sections too, with the known keys listed
    ("model.data.colour=red", "model.data: unknown key(s) ['colour']; known keys: ['cache_dir',"),
    ("server.threads=4", "server: unknown key(s) ['threads']; known keys: ['expiry_clock', "
                         "'max_barrier_wait_s', 'max_concurrent_rpcs', 'max_dense_floats', 'max_message_bytes', "
                         "'reply_window_bytes']"),
    ("server.max_dense_floats=0", "server.max_dense_floats must be >= 1, got 0"),
    ("tables.views=1", "tables: unknown key(s) ['views']"),
    ("sparse_tables.emb.dim=4", "config: unknown key(s) ['sparse_tables']"),
])
def test_bad_values_name_key_value_and_what_is_allowed(override, message):
    data = base()
    data["model"] = {"kind": "ctr_dnn", "sparse_table": "emb", "dense_table": "d"}
    with pytest.raises(ConfigError) as ei:
        from_dict(apply_overrides(data, [override]))
    assert message in str(ei.value)


def test_every_error_of_a_section_is_reported_at_once():
    with pytest.raises(ConfigError) as ei:
        from_dict(apply_overrides(base(), ["cluster.servers=0", "cluster.workers=x", "cluster.a=1", "cluster.b=2"]))
    msg = str(ei.value)
    assert "cluster.servers must be >= 1, got 0" in msg and "cluster.workers must be an int, got 'x'" in msg
    assert "cluster: unknown key(s) ['a', 'b']; known keys: [" in msg


def test_sections_built_in_code_are_checked_too():
    with pytest.raises(ConfigError, match="ClusterConfig.servers must be >= 1, got 0"):
        ClusterConfig(servers=0)
    with pytest.raises(ConfigError, match="ServerConfig.max_concurrent_rpcs must be an int, got '8'"):
        dataclasses.replace(ServerConfig(), max_concurrent_rpcs="8")
    with pytest.raises(ConfigError, match="unknown key"):
        ClusterConfig(nope=1)
    s = ServerConfig(max_barrier_wait_s=5)
    assert s.max_barrier_wait_s == 5.0 and [f.name for f in dataclasses.fields(s)] == [
        "max_barrier_wait_s", "max_concurrent_rpcs", "reply_window_bytes", "max_message_bytes", "expiry_clock",
        "max_dense_floats"]


def test_server_section_defaults_and_round_trip(tmp_path):
    assert ServerConfig() == ServerConfig(600.0, 256, 64 << 20, 16 << 20, "wall", 1 << 25)
    cfg = load_config(DEMO)
    assert cfg.server == ServerConfig()             # the demo documents every knob with its default
    assert from_dict(base()).server == ServerConfig()
    cfg = load_config(DEMO, ["server.max_concurrent_rpcs=4"])
    assert cfg.to_dict()["server"] == {"max_barrier_wait_s": 600.0, "max_concurrent_rpcs": 4,
                                       "reply_window_bytes": 64 << 20, "max_message_bytes": 16 << 20,
                                       "expiry_clock": "wall", "max_dense_floats": 1 << 25}
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_yaml_reader_keeps_texts_through_anchors_and_rejects_duplicates(tmp_path):
    text = "common: &c {until: 0100}\n"
    doc = load_yaml(text + "model:\n  <<: *c\n  kind: ctr_online\n", "x.yaml")
    doc.pop("common")
    assert from_dict(doc).model.params.until == "0100"
    with pytest.raises(ConfigError, match=r"duplicate key cluster.workers \(line 2, again at line 4\)$"):
        load_config(_yaml(tmp_path, "cluster:\n  workers: 1\n  servers: 1\n  workers: 2\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_yaml(tmp_path, "cluster: [\n"))
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(_yaml(tmp_path, "- 1\n"))
    with pytest.raises(ConfigError, match="value is not valid YAML"):
        apply_overrides({}, ["cluster.endpoints=[a"])


def test_a_replaced_value_does_not_take_a_stale_text(tmp_path):
    doc = apply_overrides(load_yaml(ONLINE_BASE + "  until: 0100\n", "x.yaml"), [])
    doc["model"]["until"] = 7                       # edited in code after reading: no text for 7
    with pytest.raises(ConfigError, match="model.until must be a string, got 7"):
        from_dict(doc)


def test_the_program_registries_agree():
    assert set(PROGRAM_CONFIGS) == set(PROGRAMS)
    for kind in PROGRAMS:
        assert load_program(kind).Config is program_config_class(kind), kind
    with pytest.raises(ConfigError, match=r"model.kind must be one of \['ctr_dnn'"):
        program_config_class("gpt")


# ----------------------------------------------------------------------------- secrets on disk (issue 15)
def _with_inline_keys():
    data = base()
    data["storage"] = {"endpoint": "h:9000", "scheme": "http", "access_key": "AKIA-INLINE-1",
                       "secret_key": "s3cr3t-INLINE-2"}
    return from_dict(data)


def test_dumped_config_is_private_and_holds_no_inline_secret(tmp_path):
    cfg = _with_inline_keys()
    path = tmp_path / "config.yaml"
    path.write_text("old")
    path.chmod(0o644)                                # an older file is replaced, not reused
    dump_config(cfg, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert "AKIA-INLINE-1" not in text and "s3cr3t-INLINE-2" not in text
    env = secret_env(cfg)
    assert env == {SECRET_ENV["access_key"]: "AKIA-INLINE-1", SECRET_ENV["secret_key"]: "s3cr3t-INLINE-2"}
    # the child: reads the file, then takes the secrets from its environment
    child = load_config(path)
    assert child.storage.access_key == "" and child.storage.secret_key == ""
    restored = restore_secrets(child, env)
    assert restored == cfg
    opts = restored.storage.options()
    assert (opts.access_key, opts.secret_key) == ("AKIA-INLINE-1", "s3cr3t-INLINE-2")
    assert restore_secrets(child, {}) == child
    assert restore_secrets(cfg, {SECRET_ENV["access_key"]: "other"}) == cfg     # a config's own key wins
    assert secret_env(from_dict(base())) == {}


def test_launcher_hands_inline_secrets_to_children_in_their_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_STORAGE_ACCESS_KEY", "from-the-launchers-own-env")
    fake = tmp_path / "fake-python"                  # stands in for the interpreter: records its environment
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open(sys.argv[sys.argv.index('--rank') + 1] + '.env', 'w').write(json.dumps(dict(os.environ)))\n")
    fake.chmod(0o755)
    cfg = _with_inline_keys()
    cluster = LocalCluster(cfg, tmp_path / "run", python=str(fake))
    assert stat.S_IMODE(os.stat(cluster.config_path).st_mode) == 0o600
    assert "s3cr3t-INLINE-2" not in cluster.config_path.read_text()
    monkeypatch.chdir(tmp_path)
    child = cluster._spawn("server", 0, [], {})
    assert child.proc.wait(timeout=60) == 0
    env = json.loads((tmp_path / "0.env").read_text())
    assert env["ENGINE_STORAGE_SECRET_KEY"] == "s3cr3t-INLINE-2"
    assert env["ENGINE_STORAGE_ACCESS_KEY"] == "AKIA-INLINE-1"
    assert restore_secrets(load_config(cluster.config_path), env) == cfg
    # without inline secrets nothing is handed down, not even the launcher's own variables
    plain = LocalCluster(from_dict(base()), tmp_path / "run2", python=str(fake))
    assert plain._spawn("server", 1, [], {}).proc.wait(timeout=60) == 0
    env = json.loads((tmp_path / "1.env").read_text())
    assert "ENGINE_STORAGE_ACCESS_KEY" not in env and "ENGINE_STORAGE_SECRET_KEY" not in env


def test_max_rows_below_the_local_shard_count_is_a_config_error():
    from engine.config import from_dict
    with pytest.raises(ConfigError, match=r"tables.sparse.emb.max_rows must be 0 \(no limit\) or >= "
                                          r"cluster.local_shards \(4\), got 3"):
        from_dict({"cluster": {"local_shards": 4}, "tables": {"sparse": {"emb": {"dim": 2, "max_rows": 3}}}})
    assert from_dict({"tables": {"sparse": {"emb": {"dim": 2, "max_rows": 4}}}}).sparse_tables["emb"].max_rows == 4


@pytest.mark.parametrize("config, override, message", [
    ("ctr.yaml", "tables.sparse.embeding.learning_rate=0.5",
     "tables.sparse.embeding: model.kind ctr_dnn uses no sparse table 'embeding' (it uses sparse table(s) "
     "'embedding' (model.sparse_table); dense table(s) 'dense' (model.dense_table)); a misspelt table name "
     "loses its settings"),
    ("ctr.yaml", "tables.dense.dens.learning_rate=0.5", "tables.dense.dens: model.kind ctr_dnn uses no dense table"),
    ("deepfm.yaml", "tables.sparse.emb.dim=11", "tables.sparse.emb: model.kind deepfm uses no sparse table 'emb'"),
    ("ctr_online.yaml", "tables.dense.dense2.learning_rate=0.5",
     "tables.dense.dense2: model.kind ctr_online uses no dense table 'dense2'"),
    ("logreg_demo.yaml", "tables.sparse.weight.learning_rate=0.5",
     "tables.sparse.weight: model.kind logreg uses no sparse table 'weight' (it uses sparse table(s) 'weights' "
     "(model.table); dense table(s) 'bias' (model.dense_table))"),
])
def test_a_table_the_program_does_not_use_is_refused(config, override, message):
    """A misspelt table name in --set declared a table of its own: the override was lost, exit 0."""
    load_config(REPO / "configs" / config)                          # the shipped config passes
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / config, [override])
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("config", ["ctr.yaml", "deepfm.yaml", "ctr_online.yaml"])
def test_a_config_of_before_2026_11_25_with_its_metrics_table_loads_with_a_warning(config, caplog):
    """Shipped configs until 6999b4d (2026-11-25) declared ``tables.dense.metrics`` (sgd, learning rate 1),
    the dense table ``model.metrics_table`` named for merging evaluation histograms. The servers sum
    metrics themselves since; the unused-table check refused such a config as a misspelt table, so a
    config that worked before the upgrade no longer loaded (found loading 6ca8201's configs/*.yaml)."""
    new = load_config(REPO / "configs" / config)
    with caplog.at_level("WARNING", logger="engine.config"):
        old = load_config(REPO / "configs" / config, ["tables.dense.metrics.optimizer=sgd",
                                                      "tables.dense.metrics.learning_rate=1.0",
                                                      "model.metrics_table=metrics"])
    assert old == new and "metrics" not in old.dense_tables
    assert any("tables.dense.metrics: the dense table model.metrics_table named before 2026-11-25" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigError, match="tables.dense.metricz: model.kind"):   # any other name: refused
        load_config(REPO / "configs" / config, ["tables.dense.metricz.optimizer=sgd"])


def test_tables_renamed_with_the_model_keys_are_used():
    cfg = from_dict(base())                     # model.table: emb, model.dense_table: d
    assert sorted(cfg.sparse_tables) == ["emb"] and sorted(cfg.dense_tables) == ["d"]
    servers_only = {k: v for k, v in base().items() if k != "model"}
    servers_only["tables"] = {"sparse": {"a": {"dim": 2}, "b": {"dim": 2}}}
    assert sorted(from_dict(servers_only).sparse_tables) == ["a", "b"]    # no program: nothing to check


@pytest.mark.parametrize("override, message", [
    ("tables.sparse.emb.seed=[1,2]", "tables.sparse.emb.seed must be an int, got [1, 2]"),
    ("tables.sparse.emb.seed=1.5", "tables.sparse.emb.seed must be an int, got 1.5"),
    ("tables.sparse.emb.dim=true", "tables.sparse.emb.dim must be an int, got True"),
    ("tables.sparse.emb.memory_rows=true", "tables.sparse.emb.memory_rows must be an int, got True"),
    ("tables.sparse.emb.init_range=true", "tables.sparse.emb.init_range must be a number, got True"),
    ("tables.sparse.emb.learning_rate='0.1'", "tables.sparse.emb.learning_rate must be a number, got '0.1'"),
    ("tables.sparse.emb.expire_after={a: 1}", "tables.sparse.emb.expire_after must be a number or None"),
])
def test_sparse_table_values_of_the_wrong_type_are_refused(override, message):
    """They passed the config (``seed: [1, 2]``, ``dim: true``: TableConfig checked ranges, not types) and
    every server then died on them with a traceback (``[1, 2] % 2**64``), restarted max_restarts times."""
    with pytest.raises(ConfigError) as e:
        from_dict(apply_overrides(base(), [override]))
    assert str(e.value) == message or str(e.value).startswith(message), str(e.value)
    spilled = from_dict(apply_overrides(base(), ["tables.sparse.emb.spill_path=5", "tables.sparse.emb.seed=7"]))
    assert spilled.sparse_tables["emb"].spill_path == "5" and spilled.sparse_tables["emb"].seed == 7


@pytest.mark.parametrize("override", ["client.dead_after_s=1e308", "client.timeout_s=1e308",
                                      "cluster.preempt_timeout_s=1e19", "security.reload_interval_s=1e10",
                                      "observability.push_interval_s=2147484"])
def test_durations_past_max_seconds_are_refused(override):
    """``client.dead_after_s: 1e308`` passed and killed every role with a traceback (keepalive's
    ``int(1000 * inf)``); ``client.timeout_s: 1e308`` hung the workers waiting for the servers."""
    from engine.config_base import MAX_SECONDS
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        from_dict(apply_overrides(base(), [override]))
    assert str(e.value).startswith(f"{key} must be <= 2147483, got "), str(e.value)
    assert MAX_SECONDS == 2_147_483.0
    cfg = from_dict(apply_overrides(base(), [f"{key}={MAX_SECONDS}"]))          # the bound itself is taken
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == MAX_SECONDS


def test_deeply_nested_yaml_is_a_config_error_naming_the_line(tmp_path):
    """2000 levels of ``[`` took ruamel 22 s (quadratic scanner) and ended in a RecursionError traceback; so
    did 500 levels, and 700 levels of block mappings."""
    import time

    from engine.config_yaml import MAX_FLOW_DEPTH
    deep = tmp_path / "deep.yaml"
    deep.write_text("mode: async\n# [[[ in a comment\nx: '[[[['\ny: " + "[" * 2000 + "]" * 2000 + "\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"deep.yaml: not valid YAML: \[ and {{ nested more than "
                                          rf"{MAX_FLOW_DEPTH} deep \(line 4\)"):
        load_config(deep)
    assert time.monotonic() - started < 2
    block = tmp_path / "block.yaml"
    block.write_text("".join(" " * i + f"k{i}:\n" for i in range(700)) + " " * 700 + "v: 1\n")
    with pytest.raises(ConfigError, match="block.yaml: not valid YAML: nested too deep"):
        load_config(block)
    with pytest.raises(ConfigError, match=r"--set 'x=\[\[\[.*value is not valid YAML: \[ and { nested more than"):
        apply_overrides({}, ["x=" + "[" * 600 + "]" * 600])
    ok = load_yaml("x: " + "[" * MAX_FLOW_DEPTH + "]" * MAX_FLOW_DEPTH + "\n", "ok.yaml")    # the limit itself
    assert isinstance(ok["x"], list)


def test_num_vshards_past_max_vshards_is_refused():
    """``cluster.num_vshards: 1099511627776`` (2^40) passed, and every server died allocating its 4 TiB
    owner map (a MemoryError traceback, restarted max_restarts times, exit 1)."""
    from engine.config import MAX_VSHARDS
    with pytest.raises(ConfigError, match=r"^cluster.num_vshards must be <= 1048576, got 1099511627776$"):
        from_dict(apply_overrides(base(), ["cluster.num_vshards=1099511627776"]))
    assert from_dict(apply_overrides(base(), [f"cluster.num_vshards={MAX_VSHARDS}"])).cluster.num_vshards == 1 << 20


@pytest.mark.parametrize("override, message", [
    ("model.batch_size=9000", "model.batch_size (9000) must be <= model.examples_per_worker (8000): every worker "
                              "trains whole batches of its examples only, and would train none"),
    ("model.seed=-1", "model.seed must be >= 0, got -1"),
    ("model.num_features=18446744073709551616", "model.num_features must be <= 16777216, got 18446744073709551616"),
])
def test_logreg_settings_that_cannot_train_are_refused(override, message):
    """batch_size over examples_per_worker trained 0 steps and exited 0 with a "final" line; a negative seed
    and 2^64 features killed every worker with a numpy traceback (restarted, exit 1)."""
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    assert str(e.value) == message
    assert load_config(DEMO, ["model.batch_size=8000", "model.seed=0"]).model.params.batch_size == 8000


@pytest.mark.parametrize("override, message", [
    ("model.window=5", "model: unknown key(s) ['window'] for model.kind ctr_dnn (key of model.kind word2vec); "
                       "known keys: ['batch_size', "),
    ("model.partitions=x", "model: unknown key(s) ['partitions'] for model.kind ctr_dnn (key of model.kind "
                           "ctr_online); known keys: "),
    ("model.bogus=1", "model: unknown key(s) ['bogus'] for model.kind ctr_dnn; known keys: "),
])
def test_a_model_key_of_another_program_names_the_program(override, message):
    """``--set model.window=5`` on a CTR config said only "unknown key(s) ['window']", not that it is a
    word2vec knob that the config's model.kind does not have."""
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / "ctr.yaml", [override])
    assert str(e.value).startswith(message), str(e.value)


def test_more_local_shards_than_a_server_has_vshards_is_refused():
    """``cluster.local_shards: 9223372036854775808`` passed and every server died with an OverflowError
    traceback (smaller huge counts: one SparseTable per shard, most of them never holding a row)."""
    with pytest.raises(ConfigError, match=r"^cluster.local_shards must be <= cluster.num_vshards // cluster.servers "
                                          r"\(8: a local shard holds whole vshards, more would stay empty\), got 9$"):
        from_dict(apply_overrides(base(), ["cluster.num_vshards=17", "cluster.servers=2", "cluster.local_shards=9",
                                           "cluster.endpoints=[]"]))
    cfg = from_dict(apply_overrides(base(), ["cluster.num_vshards=17", "cluster.servers=2", "cluster.local_shards=8"]))
    assert cfg.cluster.local_shards == 8


def test_a_sketch_wider_than_max_sketch_width_is_refused():
    """``sketch_width: 18446744073709551616`` passed, and every server died allocating the sketch (numpy's
    "Maximum allowed dimension exceeded" traceback, restarted, exit 1)."""
    from sparse_tables.config import MAX_SKETCH_WIDTH
    with pytest.raises(ConfigError, match=r"^tables.sparse.emb.sketch_width must be an int in \[64, 1073741824\]"):
        from_dict(apply_overrides(base(), ["tables.sparse.emb.sketch_width=18446744073709551616"]))
    cfg = from_dict(apply_overrides(base(), [f"tables.sparse.emb.sketch_width={MAX_SKETCH_WIDTH}"]))
    assert cfg.sparse_tables["emb"].sketch_width == 1 << 30
