"""The warm-up's throwaway directory (``engine.ps.warmup.ScratchDir``): a process SIGKILLed while it held
one leaves it behind, and the next warm-up removes it, never one whose process still runs."""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from engine.ps.warmup import ScratchDir, sweep_scratch_dirs

REPO = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from engine.ps.warmup import ScratchDir
d = ScratchDir(sys.argv[1])
(d.path / "embedding").mkdir()
(d.path / "embedding" / "000001.sst").write_bytes(b"x" * 4096)
print(d.path, flush=True)
time.sleep(120)
"""


def _holder(root: Path) -> tuple[subprocess.Popen, Path]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    guard = threading.Timer(60, p.kill)          # a holder that never says its path must not hang the test
    guard.start()
    try:
        line = p.stdout.readline().strip()
    finally:
        guard.cancel()
    assert line, f"the holder printed no path (exit {p.poll()})"
    return p, Path(line)


def test_a_killed_process_directory_is_removed_by_the_next_one_and_a_live_ones_is_kept(tmp_path):
    dead, dead_dir = _holder(tmp_path)
    live, live_dir = _holder(tmp_path)
    legacy = tmp_path / (ScratchDir.PREFIX + "old")          # an earlier version's: no lock file
    legacy.mkdir()
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert dead_dir.is_dir() and live_dir.is_dir()      # a SIGKILL skips every cleanup
        mine = ScratchDir(tmp_path)
        assert mine.swept == [dead_dir]
        assert not dead_dir.exists()
        assert (live_dir / "embedding" / "000001.sst").is_file() and legacy.is_dir()
        assert sweep_scratch_dirs(tmp_path) == []           # its own is held as well
        mine.close()
        mine.close()                                        # idempotent
        assert not mine.path.exists()
    finally:
        live.kill()
        live.wait(10)
    deadline = time.monotonic() + 10
    while live_dir.exists() and time.monotonic() < deadline:   # its lock died with it
        sweep_scratch_dirs(tmp_path)
        time.sleep(0.05)
    assert not live_dir.exists() and legacy.is_dir()


def test_a_warm_up_whose_servers_cannot_be_built_removes_its_directory(tmp_path, monkeypatch):
    from engine.errors import ConfigError
    from engine.ps.warmup import warm_up
    from sparse_tables import TableConfig
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))      # where ScratchDir makes its directory
    with pytest.raises(ConfigError, match="num_local must be >= 1"):
        warm_up({"emb": TableConfig(dim=4, spill_path=str(tmp_path / "spill"))}, {}, local_shards=0)
    assert not list(tmp_path.glob(ScratchDir.PREFIX + "*"))
