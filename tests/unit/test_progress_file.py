"""The progress file a supervising launcher and ``engine status`` read (``engine.progress``)."""
from __future__ import annotations

from engine import progress


def test_a_mark_is_in_the_file_when_mark_returns_even_with_the_beat_thread_writing(tmp_path):
    """A checkpoint mark is written at once, because the process may be killed before the next beat;
    the beat thread writes the same file. Both used to serialize and rename without ordering, so a
    beat that serialized before the mark could publish after it and hide the mark (the launcher then
    counted the examples since the previous mark as lost)."""
    path = tmp_path / "worker-0.progress.json"
    p = progress.Progress(str(path), interval_s=0.0005)
    try:
        for i in range(300):
            p.step(10)
            p.mark(f"ckpt-{i}")
            got = progress.read(path)
            assert got is not None and got["last_mark"] == f"ckpt-{i}", i
            assert got["marks"][f"ckpt-{i}"] == 10 * (i + 1)
    finally:
        p.close()
