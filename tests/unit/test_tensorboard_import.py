"""EventSink's tensorboardX import: boto3 stays unloaded for a local directory (tensorboardX imports it
only for s3:// event files, ~0.4 s of every worker's start-up), and an s3:// directory in the same
process still gets tensorboardX's S3 support."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_a_local_event_dir_loads_no_boto3_and_events_are_written(tmp_path):
    out = _run(f"""
        import sys
        from engine.observability.tensorboard import EventSink
        class Inner:
            def write(self, event): pass
        sink = EventSink(Inner(), {str(tmp_path / 'tb')!r}, ".worker0")
        sink.write({{"event": "train", "rank": 0, "step": 3, "auc": 0.75}})
        sink.close()
        import tensorboardX.record_writer as rw
        print("boto3" in sys.modules, sys.modules.get("boto3", "absent") is None, rw.S3_ENABLED)
        import boto3                                        # not blocked after the import
        print(boto3.__name__)
    """)
    assert out.splitlines() == ["False False False", "boto3"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/rank0/auc")] == [pytest.approx(0.75)]


def test_an_s3_event_dir_after_a_local_one_gets_s3_support(tmp_path):
    out = _run(f"""
        from engine.observability.tensorboard import _summary_writer_class
        _summary_writer_class({str(tmp_path)!r})
        import tensorboardX.record_writer as rw
        before = rw.S3_ENABLED
        _summary_writer_class("s3://bucket/tb")
        print(before, rw.S3_ENABLED)
    """)
    assert out == "False True"
