"""The x axis of the TensorBoard curves (``engine.observability.tensorboard.scalars_of``): every event
with a ``step`` (the job's step, ``CTRTrainer.global_step``) is drawn at it (train, eval, profile), so
the curves of a run share one axis across its attempts; events without one keep their old axis."""
from __future__ import annotations

from engine.observability.tensorboard import EventSink, scalars_of


def test_train_eval_and_profile_events_are_drawn_at_their_step():
    train = scalars_of({"event": "train", "rank": 1, "epoch": 1, "step": 795, "auc": 0.75, "examples_total": 9})
    assert train == ([("train/rank1/auc", 0.75)], 795)
    ev = scalars_of({"event": "eval", "epoch": 1, "step": 861, "split": "test", "auc": 0.76, "count": 10})
    assert ev == ([("test/auc", 0.76), ("test/count", 10.0)], 861)
    prof = scalars_of({"event": "profile", "rank": 0, "step": 861, "steps": 861, "phase_seconds": {"read": 1.5}})
    assert prof == ([("profile/rank0/phase_seconds/read", 1.5)], 861)


def test_events_without_a_step_keep_their_axis():
    assert scalars_of({"event": "eval", "epoch": 2, "split": "test", "auc": 0.7})[1] == 2
    assert scalars_of({"event": "profile", "rank": 0, "steps": 40, "phase_seconds": {}})[1] == 40
    assert scalars_of({"event": "final", "test_auc": 0.7}) == ([("final/test_auc", 0.7)], 0)


def test_an_eval_event_file_is_read_back_at_the_events_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Inner:
        def write(self, event):
            pass

    sink = EventSink(Inner(), str(tmp_path), ".worker0")
    sink.write({"event": "eval", "epoch": 0, "step": 37, "split": "test", "auc": 0.71})
    sink.write({"event": "eval", "epoch": 1, "step": 74, "split": "test", "auc": 0.73})
    sink.close()
    ea = EventAccumulator(str(tmp_path))
    ea.Reload()
    assert [(e.step, round(e.value, 6)) for e in ea.Scalars("test/auc")] == [(37, 0.71), (74, 0.73)]
