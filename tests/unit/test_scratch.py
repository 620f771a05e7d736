"""Throwaway directories held by an flock (``engine.scratch.ScratchDir``): a process SIGKILLed while it
held one leaves it behind, and the next one of its kind removes it, never one whose process still runs.
The warm-up's spill stores use them, and so does the MPI world, whose directory records hydra's topology
file for the next world to remove (``engine.launch.mpi.sweep_worlds``)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from engine.launch.mpi import TOPOLOGY_PREFIX, TOPOLOGY_RECORD, WORLD_PREFIX, sweep_worlds
from engine.ps.warmup import WARM_UP_PREFIX
from engine.scratch import ScratchDir, sweep_scratch_dirs

REPO = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from engine.scratch import ScratchDir
d = ScratchDir(sys.argv[2], sys.argv[1])
(d.path / "embedding").mkdir()
(d.path / "embedding" / "000001.sst").write_bytes(b"x" * 4096)
if len(sys.argv) > 3:
    (d.path / "topology.json").write_text(sys.argv[3])
print(d.path, flush=True)
time.sleep(120)
"""


def _holder(root: Path, prefix: str = WARM_UP_PREFIX, record: str | None = None) -> tuple[subprocess.Popen, Path]:
    argv = [sys.executable, "-c", HOLD, str(root), prefix, *([record] if record is not None else [])]
    p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
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
    legacy = tmp_path / (WARM_UP_PREFIX + "old")          # an earlier version's: no lock file
    legacy.mkdir()
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert dead_dir.is_dir() and live_dir.is_dir()      # a SIGKILL skips every cleanup
        mine = ScratchDir(WARM_UP_PREFIX, tmp_path)
        assert mine.swept == [dead_dir]
        assert not dead_dir.exists()
        assert (live_dir / "embedding" / "000001.sst").is_file() and legacy.is_dir()
        assert sweep_scratch_dirs(tmp_path, WARM_UP_PREFIX) == []           # its own is held as well
        mine.close()
        mine.close()                                        # idempotent
        assert not mine.path.exists()
    finally:
        live.kill()
        live.wait(10)
    deadline = time.monotonic() + 10
    while live_dir.exists() and time.monotonic() < deadline:   # its lock died with it
        sweep_scratch_dirs(tmp_path, WARM_UP_PREFIX)
        time.sleep(0.05)
    assert not live_dir.exists() and legacy.is_dir()


def test_a_warm_up_whose_servers_cannot_be_built_removes_its_directory(tmp_path, monkeypatch):
    from engine.errors import ConfigError
    from engine.ps.warmup import warm_up
    from sparse_tables import TableConfig
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))      # where ScratchDir makes its directory
    with pytest.raises(ConfigError, match="num_local must be >= 1"):
        warm_up({"emb": TableConfig(dim=4, spill_path=str(tmp_path / "spill"))}, {}, local_shards=0)
    assert not list(tmp_path.glob(WARM_UP_PREFIX + "*"))


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(10)


def test_only_directories_of_the_same_kind_are_swept_and_on_sweep_sees_each_before_it_goes(tmp_path):
    warm, warm_dir = _holder(tmp_path)
    other, other_dir = _holder(tmp_path, "engine-other-")
    _kill(warm)
    _kill(other)
    seen = []

    def undo(d: Path) -> None:
        seen.append((d, (d / "embedding" / "000001.sst").is_file()))
        raise OSError("cannot undo")          # logged; the directory goes all the same

    assert sweep_scratch_dirs(tmp_path, WARM_UP_PREFIX, on_sweep=undo) == [warm_dir]
    assert seen == [(warm_dir, True)] and not warm_dir.exists()
    assert other_dir.is_dir()                  # another kind: left to its own sweeper
    assert sweep_scratch_dirs(tmp_path, "engine-other-") == [other_dir]


def test_a_dead_launchers_world_directory_takes_hydras_topology_file_with_it(tmp_path):
    """What ``World`` records (``TOPOLOGY_RECORD``) is removed by the next sweep when it is still that
    very file; a file replaced since (another inode), a record naming a file that is not hydra's and a
    live launcher's record are left alone."""
    def topo(name: str) -> tuple[Path, str]:
        f = tmp_path / (TOPOLOGY_PREFIX + name)
        f.write_text("<topology/>")
        st = f.stat()
        return f, json.dumps({"path": str(f), "dev": st.st_dev, "ino": st.st_ino})

    gone, rec_gone = topo("a")
    replaced, rec_replaced = topo("b")
    live_file, rec_live = topo("c")
    other = tmp_path / "precious.txt"
    other.write_text("x")
    st = other.stat()
    rec_other = json.dumps({"path": str(other), "dev": st.st_dev, "ino": st.st_ino})
    procs = [_holder(tmp_path, WORLD_PREFIX, r) for r in (rec_gone, rec_replaced, rec_other)]
    live, live_dir = _holder(tmp_path, WORLD_PREFIX, rec_live)
    try:
        fresh = tmp_path / "fresh"
        fresh.write_text("<a new file of the same name/>")           # made before the old one's inode is
        os.replace(fresh, replaced)                                 # freed, so never the same inode
        for p, _ in procs:
            _kill(p)
        swept = sweep_worlds(tmp_path)
        assert sorted(swept) == sorted(d for _, d in procs)
        assert not gone.exists() and replaced.exists() and other.exists() and live_file.exists()
        assert (live_dir / TOPOLOGY_RECORD).is_file()
    finally:
        _kill(live)
    assert sweep_worlds(tmp_path) == [live_dir] and not live_file.exists()


def test_garbage_records_and_links_never_stop_a_sweep_or_the_next_world(tmp_path, caplog):
    """A record that is not JSON, lacks a field or has one of the wrong type is logged and its
    directory removed (else every later hybrid start would fail on it); a symbolic link named like a
    world directory is left alone, and so is the directory it points to."""
    bad = ["{not json", json.dumps({"path": "/tmp/" + TOPOLOGY_PREFIX + "zz"}),
           json.dumps({"path": "/tmp/" + TOPOLOGY_PREFIX + "zz", "dev": None, "ino": 1}), json.dumps([1, 2])]
    procs = [_holder(tmp_path, WORLD_PREFIX, r) for r in bad]
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ".lock").write_text("")
    link = tmp_path / (WORLD_PREFIX + "link")
    link.symlink_to(target)
    for p, _ in procs:
        _kill(p)
    with caplog.at_level("WARNING", logger="engine.scratch"):
        swept = sweep_worlds(tmp_path)          # what World does as it starts
    assert sorted(swept) == sorted(d for _, d in procs)
    assert len([r for r in caplog.records if "could not undo" in r.getMessage()]) == len(bad)
    assert link.is_symlink() and (target / ".lock").exists()
