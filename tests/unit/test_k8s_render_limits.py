"""``engine k8s``: every integer the manifests compute from the config fits its Kubernetes field, or the
render is refused naming the key and the largest value allowed (``engine.launch.k8s.check_limits``).
Before, ``cluster.startup_timeout_s=1e12`` rendered a startup probe ``failureThreshold`` of 200000000000
(over int32: kubectl refuses the whole Job), which the schema validator itself lets through (it does
not check integer formats), so these tests check the numbers directly."""
from __future__ import annotations

import math

import kubernetes_validate
import pytest

from engine.config_base import MAX_SECONDS
from engine.errors import ConfigError
from engine.launch import k8s
from tests.unit.test_k8s_manifests import VERSIONS, by_kind, cli, container, creds, error_line, render, sets  # noqa: F401

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _integers(obj, path=""):
    """(path, value) of every integer in a manifest (booleans left out)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _integers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _integers(v, f"{path}[{i}]")
    elif isinstance(obj, int) and not isinstance(obj, bool):
        yield path, obj


INT64_FIELDS = ("terminationGracePeriodSeconds",)      # the rest of ours are int32 in the Kubernetes API


def _assert_fits(m: k8s.Manifests) -> None:
    for name, obj in m.files.items():
        for path, value in _integers(obj):
            top = INT64_MAX if path.rsplit(".", 1)[-1] in INT64_FIELDS else INT32_MAX
            assert 0 <= value <= top, (name, path, value)


@pytest.mark.parametrize("key, value, limit, also", [
    # durations stop at MAX_SECONDS in every config (engine.config_base), well inside their fields
    ("cluster.startup_timeout_s", "1e12", "2147483", ()),
    ("cluster.preempt_timeout_s", "1e19", "2147483", ()),
    ("kubernetes.backoff_limit", str(INT32_MAX + 1), str(INT32_MAX), ()),
    ("cluster.workers", "100001", "100000", ()),
    ("cluster.servers", "100001", "100000", ("cluster.num_vshards=200000", "cluster.local_shards=1")),   # vshards >= servers
])
def test_a_value_over_its_kubernetes_field_is_refused_naming_the_key_and_the_limit(tmp_path, creds, capsys, key,
                                                                                  value, limit, also):
    with pytest.raises(ConfigError) as e:
        render(creds, f"{key}={value}", *also)
    assert key in str(e.value) and limit in str(e.value), e.value
    # the CLI: one line, exit 2, nothing written
    assert cli(tmp_path / "out", sets(creds, f"{key}={value}", *also)) == 2
    line = error_line(capsys)
    assert key in line and limit in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [
    (f"cluster.startup_timeout_s={MAX_SECONDS}",),              # the largest startup time a config takes
    (f"kubernetes.backoff_limit={INT32_MAX}",),
    (f"cluster.preempt_timeout_s={MAX_SECONDS}",),
])
def test_the_largest_values_render_within_their_fields_and_validate(creds, extra):
    m = render(creds, *extra)
    _assert_fits(m)
    for obj in m.files.values():
        kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)
    if extra[0].startswith("cluster.startup_timeout_s"):
        probe = container(by_kind(m)["server"])["startupProbe"]
        assert probe["failureThreshold"] == math.ceil(MAX_SECONDS / k8s.STARTUP_PERIOD_S)
        assert probe["periodSeconds"] == k8s.STARTUP_PERIOD_S


def test_the_default_manifests_fit_their_fields(creds):
    _assert_fits(render(creds))


def test_table_budgets_past_the_server_pods_memory_limit_are_refused_naming_both_keys(tmp_path, creds, capsys):
    """A server pod's memory limit below its tables' ``memory_bytes`` rendered fine, and the server was
    OOM-killed once its RAM tier filled (the server's own check reads its cgroup only when it starts)."""
    budget = ("tables.sparse.embedding.spill_path=/spill", "tables.sparse.embedding.memory_bytes=9000000000")
    with pytest.raises(ConfigError) as e:
        render(creds, *budget)                               # kubernetes.server_memory: 8Gi by default
    assert str(e.value).startswith("kubernetes.server_memory=8Gi (8589934592 bytes) is less than the table "
                                   "budgets of one server (tables.sparse.embedding.memory_bytes=9000000000)"), e.value
    assert cli(tmp_path / "out", sets(creds, *budget)) == 2
    assert "kubernetes.server_memory=8Gi" in error_line(capsys) and not (tmp_path / "out").exists()
    for limit in ("10Gi", "9.5G", "1e10"):
        _assert_fits(render(creds, *budget, f"kubernetes.server_memory={limit}"))
