"""A spilling table's dumps copy their RAM rows into a spool file in the spill directory, not RAM
(``sparse_tables._snapshot``): the dump is the same, still the table at one instant, the file lives only
while the dump does, and a disk that refuses the file costs RAM, not the dump."""
from __future__ import annotations

import logging
import os
import resource
import signal
from pathlib import Path

import numpy as np
import pytest

from sparse_tables import _snapshot
from tests.unit.test_spill_dump import DIM, _rows, _spilling_table


def _spool_files(spill_dir: Path) -> list[str]:
    """This process's open files inside ``spill_dir`` that have no name (unlinked spool files)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(spill_dir)) and target.endswith("(deleted)"):
            out.append(target)
    return out


@pytest.fixture
def spool_always(monkeypatch):
    monkeypatch.setattr(_snapshot, "SPOOL_MIN_BYTES", 0)


def test_a_base_dump_reads_its_ram_rows_back_from_a_spool_file_as_they_were_at_its_instant(tmp_path, spool_always):
    t, old = _spilling_table(tmp_path, 6_000)
    spill_dir = tmp_path / "spill"
    want = _rows(t.rows())                              # a whole dump, nothing pushed meanwhile
    assert _spool_files(spill_dir) == []                # an exhausted dump closed its file
    it = t.rows(chunk_rows=256)
    first = [next(it)]
    assert len(_spool_files(spill_dir)) == 1            # the RAM rows are in one unnamed file
    t.push(old, np.full((len(old), DIM), 5.0, np.float32))      # every row changes, rows evict and load
    got = _rows(first + list(it))
    assert got == want
    assert _spool_files(spill_dir) == []
    t.close()


def test_a_delta_dump_is_read_twice_from_its_spool_file_and_close_drops_it(tmp_path, spool_always):
    t, old = _spilling_table(tmp_path, 6_000)
    t.clear_dirty()
    t.push(old[::3], np.ones((len(old[::3]), DIM), np.float32))
    d = t.dirty_dump(clear=True)
    assert len(_spool_files(tmp_path / "spill")) == 1
    first = _rows(list(d))
    assert set(first) == {int(k) for k in old[::3]}
    assert _rows(list(d)) == first                      # a retried delta file reads the same rows
    d.close()
    assert _spool_files(tmp_path / "spill") == []
    with pytest.raises(RuntimeError, match="after close"):
        list(d)
    t.close()


def test_a_spool_file_the_disk_refuses_leaves_the_copy_in_ram_and_the_dump_whole(tmp_path, spool_always, caplog):
    """RLIMIT_FSIZE makes the kernel refuse the spool file's writes past 64 KiB (EFBIG), as a full disk
    would: the dump logs it, copies the rows in memory and is the same dump."""
    t, old = _spilling_table(tmp_path, 6_000)
    want = _rows(t.rows())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        with caplog.at_level(logging.WARNING, logger="sparse_tables.table"):
            it = t.rows(chunk_rows=256)
            first = [next(it)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert "could not be spooled" in caplog.text and "copied in memory" in caplog.text
    assert _spool_files(tmp_path / "spill") == []       # the refused file was closed at once
    assert _rows(first + list(it)) == want
    t.close()
