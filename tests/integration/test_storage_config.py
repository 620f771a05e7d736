"""S3 settings from the config alone (issue 6): with no AWS_* variable in the environment, ``storage:``
(endpoint, region, scheme, and the names of the variables that hold the keys) reaches every process of
an ``engine train`` job — the servers writing checkpoint parts, rank 0 writing manifests, the
``--resume`` restore — and inline keys never land in a checkpoint manifest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint import CheckpointManager
from engine.config import StorageConfig
from engine.errors import ConfigError
from tests.contract.storage_fixtures import moto_s3, s3_bucket, s3_storage_options  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


def _train(tmp: Path, tag: str, root: str, storage: list[str], env: dict, *more: str) -> dict:
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), "--run-dir", str(tmp / tag),
           "--set", "model.data.source=generated", "--set", "model.data.generated_rows=2000",
           "--set", f"model.data.cache_dir={tmp / 'cache'}", "--set", f"model.metrics_dir={tmp / 'metrics'}",
           "--set", f"observability.tensorboard_dir={tmp / 'tb'}",
           "--set", f"checkpoint.root={root}", "--set", "model.hidden=[8]",
           *[a for s in storage for a in ("--set", f"storage.{s}")], *more]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((tmp / tag).glob("*.log")))
    assert res.returncode == 0, res.stderr[-3000:] + logs
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.long   # make test-long (~45 s): S3 train and resume run in test_online_resume; the options are test_storage_config_options'
@pytest.mark.slow
def test_train_and_resume_on_s3_with_settings_from_the_config_only(moto_s3, s3_bucket, s3_storage_options,  # noqa: F811
                                                                   tmp_path):
    root = f"s3://{s3_bucket}/cfg-only-{os.getpid()}-{time.monotonic_ns()}"
    env = _clean_env(MY_S3_KEY=moto_s3.access_key, MY_S3_SECRET=moto_s3.secret_key)
    storage = [f"endpoint={moto_s3.endpoint}", "scheme=http", f"region={moto_s3.region}",
               "access_key_env=MY_S3_KEY", "secret_key_env=MY_S3_SECRET"]
    final = _train(tmp_path, "run1", root, storage, env)
    assert final["checkpoint"].startswith(root + "/ctr_dnn/")
    mgr = CheckpointManager(root, "ctr_dnn", storage_options=s3_storage_options)
    manifest = mgr.manifest(mgr.latest().name)
    assert manifest["config"]["storage"]["access_key_env"] == "MY_S3_KEY"
    resumed = _train(tmp_path, "run2", root, storage, env, "--resume")
    assert resumed["checkpoint"] != final["checkpoint"] and resumed["checkpoint"].startswith(root)

    # inline keys work too, and the manifests do not keep them
    inline = [f"endpoint={moto_s3.endpoint}", "scheme=http", f"region={moto_s3.region}",
              f"access_key={moto_s3.access_key}", f"secret_key={moto_s3.secret_key}"]
    root2 = root + "-inline"
    _train(tmp_path, "run3", root2, inline, _clean_env())
    mgr2 = CheckpointManager(root2, "ctr_dnn", storage_options=s3_storage_options)
    snap = mgr2.manifest(mgr2.latest().name)["config"]["storage"]
    assert snap["access_key"] == "" and snap["secret_key"] == "" and snap["endpoint"] == moto_s3.endpoint


def test_storage_config_options(monkeypatch):
    assert StorageConfig().options() is None
    monkeypatch.setenv("K1", "ak")
    monkeypatch.setenv("K2", "sk")
    o = StorageConfig(endpoint="h:9000", scheme="http", access_key_env="K1", secret_key_env="K2").options()
    assert (o.endpoint_override, o.scheme, o.access_key, o.secret_key) == ("h:9000", "http", "ak", "sk")
    monkeypatch.delenv("K2")
    with pytest.raises(ConfigError, match="storage.secret_key_env names the environment variable 'K2'"):
        StorageConfig(access_key_env="K1", secret_key_env="K2").options()
    with pytest.raises(ConfigError, match="must be given together"):
        StorageConfig(access_key="a").options()


def test_storage_section_rejects_unknown_keys():
    from engine.config import from_dict
    with pytest.raises(ConfigError, match="storage"):
        from_dict({"storage": {"endpoint": "x", "secret": "y"}})
    with pytest.raises(ConfigError, match="storage.scheme"):
        from_dict({"storage": {"scheme": "ftp"}})


@pytest.mark.long   # make test-long (pyproject.toml): ~60 s of hdfs_io's retries; the CLI's other one-line
# errors are tested in make test
def test_checkpoint_storage_that_never_answers_ends_the_job_with_one_line_not_a_traceback(tmp_path):
    """An S3 endpoint where nothing listens: every look-up of the job's checkpoints fails after hdfs_io's
    retries (``StorageUnavailableError``). The launcher exits 1 with one ``engine train:`` line that says
    how to continue once the storage answers; before, a traceback."""
    cmd = [sys.executable, "-m", "engine", "train", str(REPO / "configs/logreg_demo.yaml"), "--run-dir",
           str(tmp_path / "run"), "--resume", "--set", "checkpoint.root=s3://bucket/ckpt",
           "--set", "cluster.warm_up=false", *[a for s in ("endpoint=http://127.0.0.1:9", "connect_timeout_s=1",
                                                           "request_timeout_s=1", "access_key=x", "secret_key=y")
                                                 for a in ("--set", f"storage.{s}")]]
    res = subprocess.run(cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("engine train: checkpoint storage failed: ") and "127.0.0.1:9" in last, last
    # the job's command with its --set overrides (a0f3fe2), its inline secrets not repeated
    assert "continue with: engine train " + str(REPO / "configs/logreg_demo.yaml") + " --set checkpoint.root=" in last
    assert last.endswith("--set 'storage.access_key=<as before>' --set 'storage.secret_key=<as before>' --resume"), last
