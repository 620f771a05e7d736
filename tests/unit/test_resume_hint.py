"""The command ``engine train`` prints after a preemption (exit 75) or a storage failure continues the same
job: the config's ``--set`` overrides, ``--launcher`` and ``--until`` come along. It used to print only
``engine train CONFIG --resume``, which drops a ``--set checkpoint.root=...``/``checkpoint.job=...`` and
so resumes another job's checkpoints (or none), and any other override the job ran with."""
from __future__ import annotations

import shlex

from engine.cli import _build_parser
from engine.cli.train import resume_command


def test_the_resume_command_keeps_the_overrides_launcher_and_until():
    args = _build_parser().parse_args(
        ["train", "configs/ctr.yaml", "--set", "checkpoint.job=my job", "--set", "model.epochs=3",
         "--launcher", "local", "--until", "2024010108", "--run-dir", "runs/x", "--resume", "s3://b/old"])
    cmd = resume_command(args)
    assert shlex.split(cmd) == ["engine", "train", "configs/ctr.yaml", "--set", "checkpoint.job=my job",
                                "--set", "model.epochs=3", "--launcher", "local", "--until", "2024010108",
                                "--resume"]
    # re-parsed, it is the same job with a plain --resume (the newest complete checkpoint of its root)
    again = _build_parser().parse_args(shlex.split(cmd)[1:])
    assert again.overrides == args.overrides and again.resume == "" and again.config == args.config


def test_without_options_it_is_the_plain_resume():
    args = _build_parser().parse_args(["train", "configs/ctr.yaml"])
    assert resume_command(args) == "engine train configs/ctr.yaml --resume"


def test_inline_storage_secrets_are_not_repeated():
    """The line goes to the terminal and the logs: a --set storage.secret_key=... was printed back in full."""
    args = _build_parser().parse_args(["train", "configs/ctr.yaml", "--set", "storage.access_key=AKIAEXAMPLE",
                                       "--set", "storage.secret_key=s3cr3t/value", "--set", "storage.region=eu"])
    cmd = resume_command(args)
    assert "AKIAEXAMPLE" not in cmd and "s3cr3t" not in cmd
    assert shlex.split(cmd)[3:9] == ["--set", "storage.access_key=<as before>", "--set",
                                     "storage.secret_key=<as before>", "--set", "storage.region=eu"]


def test_the_same_command_again_for_a_job_that_never_trained():
    """A job that ended before its workers started (its checkpoints could not be listed) is told to run
    the same command again: with its own --resume (none, or the URI it named), not a plain --resume that
    would restore the root's newest checkpoint, perhaps an earlier run's."""
    fresh = _build_parser().parse_args(["train", "configs/ctr.yaml", "--set", "model.epochs=3"])
    assert resume_command(fresh, resume=fresh.resume) == "engine train configs/ctr.yaml --set model.epochs=3"
    named = _build_parser().parse_args(["train", "configs/ctr.yaml", "--resume", "s3://b/ck/job/20240101/0100-base"])
    assert resume_command(named, resume=named.resume).endswith("--resume s3://b/ck/job/20240101/0100-base")
