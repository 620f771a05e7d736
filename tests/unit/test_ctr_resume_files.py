"""A CTR checkpoint records the train files its data position was taken on (``sources.train.files``:
``ctr_data.files_fingerprint``), and a resume inside an epoch onto other files is refused.

Before, the position's identity was only workers, batch size, shuffle buffer, seed and train path: a
file added to the train directory after a preemption (one that sorts first) moved every batch, and the
resumed job skipped rows it never trained and trained others twice, exit 0 and no warning. Real Arrow
files and real checkpoints (an in-process parameter server, saved as rank 0 saves them)."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from engine.checkpoint import CheckpointManager
from engine.config import load_config
from engine.errors import ConfigError
from engine.programs.ctr_data import FINGERPRINT_BYTES, SAMPLE_BLOCKS, SAMPLE_BYTES, files_fingerprint
from engine.programs.ctr_positions import AlignedCheckpoints, Position, describe_file_changes
from engine.ps import InProcessTransport, PSClient, PSServer

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, n: int, seed: int, *, other_rows: slice | None = None) -> None:
    """``n`` rows of ``seed``; ``other_rows``: those rows' values changed (the file keeps its size)."""
    rng = np.random.default_rng(seed)
    label, c1 = rng.integers(0, 2, n), rng.integers(1, 1 << 60, n, dtype=np.uint64)
    if other_rows is not None:
        label[other_rows], c1[other_rows] = 1 - label[other_rows], c1[other_rows] + 1
    t = pa.table({"label": pa.array(label, pa.float32()), "C1": pa.array(c1)})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t, max_chunksize=1000)


@pytest.fixture
def train(tmp_path):
    d = tmp_path / "train"
    d.mkdir()
    _write(d / "part-00001.arrow", 20000, 1)      # > 2 x FINGERPRINT_BYTES: head and tail are read
    _write(d / "part-00002.arrow", 300, 2)
    return d


def test_the_fingerprint_names_sizes_and_both_ends_of_every_file(train):
    fp = files_fingerprint(str(train))
    big = (train / "part-00001.arrow").read_bytes()
    assert len(big) > 2 * FINGERPRINT_BYTES
    crc = zlib.crc32(big[-FINGERPRINT_BYTES:], zlib.crc32(big[:FINGERPRINT_BYTES]))
    middle = big[FINGERPRINT_BYTES:-FINGERPRINT_BYTES]
    assert len(middle) <= SAMPLE_BLOCKS * SAMPLE_BYTES                       # read whole
    assert fp[0] == ["part-00001.arrow", len(big), f"{crc:08x}", f"{zlib.crc32(middle):08x}"]
    small = (train / "part-00002.arrow").read_bytes()
    assert fp[1] == ["part-00002.arrow", len(small), f"{zlib.crc32(small):08x}", "00000000"]
    assert files_fingerprint(str(train / "part-00002.arrow")) == [fp[1]]   # a single file: its name
    shutil.copy2(train / "part-00001.arrow", train / "copy.tmp")            # a copy (new mtime) is the same file
    (train / "part-00001.arrow").unlink()
    (train / "copy.tmp").rename(train / "part-00001.arrow")
    assert files_fingerprint(str(train)) == fp


def test_each_kind_of_change_is_named(train):
    was = files_fingerprint(str(train))
    assert describe_file_changes(was, was) == []
    _write(train / "part-00000.arrow", 50, 3)                               # sorts first
    (train / "part-00002.arrow").unlink()
    _write(train / "part-00001.arrow", 20000, 9)                            # other rows, the same size
    now = files_fingerprint(str(train))
    assert now[1][1] == was[0][1]
    size = (train / "part-00000.arrow").stat().st_size
    assert describe_file_changes(was, now) == [
        f"part-00000.arrow added ({size} bytes)",
        f"part-00001.arrow rewritten (same size, CRC-32 of its ends was {was[0][2]}, now {now[1][2]})",
        "part-00002.arrow removed"]
    _write(train / "part-00001.arrow", 20001, 1)
    assert describe_file_changes(was[:1], files_fingerprint(str(train))[1:2]) == [
        f"part-00001.arrow was {was[0][1]} bytes, now {(train / 'part-00001.arrow').stat().st_size}"]
    many = [[f"f{i}", 1, "0"] for i in range(8)]
    assert describe_file_changes([], many, most=5)[-1] == "and 3 more"


def _trainer(tmp_path, train: Path, restored: str = ""):
    """What ``AlignedCheckpoints`` needs of the CTR trainer: its config, data config, rank and workers."""
    cfg = load_config(REPO / "configs" / "ctr.yaml", [
        "cluster.workers=1", "model.slots=[C1]", "model.data.source=arrow", f"model.data.train_path={train}",
        f"model.data.test_path={train}", f"checkpoint.root={tmp_path / 'ckpt'}"])
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, restored=restored))
    return SimpleNamespace(ctx=SimpleNamespace(config=cfg), cfg=cfg.model.params, rank=0, num_workers=1)


def _checkpoint(tmp_path, train: Path, pos: Position, *, record: bool = True) -> str:
    """A checkpoint of ``pos`` with the ``sources`` rank 0 writes (``record=False``: an older engine's)."""
    t = _trainer(tmp_path, train)
    ck = AlignedCheckpoints(t, files=files_fingerprint(str(train)) if record else None)
    server = PSServer.from_config(t.ctx.config, 0)
    client = PSClient(InProcessTransport([server]))
    try:
        client.init_dense("dense", np.zeros(4, np.float32))
        mgr = CheckpointManager(str(tmp_path / "ckpt"), "ctr_dnn")
        m = mgr.save(client, "base" if not mgr.list() else "delta", sources=ck.sources(pos),
                     config=t.ctx.config.to_dict())
        return mgr.uri_of(m["name"])
    finally:
        client.close()
        server.close()


def _resume(tmp_path, train: Path, uri: str) -> Position:
    ck = AlignedCheckpoints(_trainer(tmp_path, train, uri), files=files_fingerprint(str(train)))
    return ck.restored()[0]


def test_a_resume_inside_an_epoch_onto_other_files_is_refused(tmp_path, train, caplog):
    uri = _checkpoint(tmp_path, train, Position(0, 7))
    manifest = json.loads(Path(uri, "manifest.json").read_text())
    assert manifest["sources"]["train"]["files"] == files_fingerprint(str(train))
    assert _resume(tmp_path, train, uri) == Position(0, 7)                  # the same files: exact position
    _write(train / "part-00000.arrow", 50, 3)                               # sorts first: every batch moves
    size = (train / "part-00000.arrow").stat().st_size
    with pytest.raises(ConfigError) as e:
        _resume(tmp_path, train, uri)
    assert str(e.value) == (
        f"model.data.train_path: {train} holds other files than checkpoint {uri} was trained on "
        f"(part-00000.arrow added ({size} bytes)): its position, epoch 0 batch 7, would skip rows never "
        f"trained and train others twice. Resume with the files it was trained on, resume from a checkpoint "
        f"taken at an epoch's start (none in this checkpoint's chain back to its base: --resume URI names one), "
        f"or train afresh without --resume (a file repaired after the job stopped on a bad value counts as other files: "
        f"its rows before the position were trained as they were)")
    (train / "part-00000.arrow").unlink()
    assert _resume(tmp_path, train, uri) == Position(0, 7)                  # put back: accepted again
    # at an epoch's start nothing of the epoch was read: the files are read as they are now
    start = _checkpoint(tmp_path, train, Position(1, 0))
    _write(train / "part-00000.arrow", 50, 3)
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr_positions"):
        assert _resume(tmp_path, train, start) == Position(1, 0)
    assert any("the train files changed since checkpoint" in r.getMessage() for r in caplog.records)
    # the refusal names the epoch-start checkpoint of its chain to resume from instead (before, it said only
    # "a checkpoint taken at an epoch's start", and a user whose repaired file was refused had to find one)
    (train / "part-00000.arrow").unlink()
    start, later = _chain(tmp_path, train, Position(1, 0), Position(1, 3))   # a base, a delta on it
    _write(train / "part-00000.arrow", 50, 3)
    with pytest.raises(ConfigError, match=f"resume from checkpoint {start}, taken at the start of epoch 1 "
                                          f"\\(--resume {start}: the epoch is read from its start"):
        _resume(tmp_path, train, later)


def _chain(tmp_path, train: Path, *positions: Position) -> list[str]:
    """A base of the first position and a delta for each other one on it, as rank 0 writes them."""
    t = _trainer(tmp_path, train)
    ck = AlignedCheckpoints(t, files=files_fingerprint(str(train)))
    server = PSServer.from_config(t.ctx.config, 0)
    client = PSClient(InProcessTransport([server]))
    try:
        client.init_dense("dense", np.zeros(4, np.float32))
        mgr = CheckpointManager(str(tmp_path / "ckpt"), "ctr_dnn")
        return [mgr.uri_of(mgr.save(client, "delta" if i else "base", sources=ck.sources(pos),
                                    config=t.ctx.config.to_dict())["name"]) for i, pos in enumerate(positions)]
    finally:
        client.close()
        server.close()


def test_a_checkpoint_that_recorded_no_files_is_accepted_with_a_warning(tmp_path, train, caplog):
    uri = _checkpoint(tmp_path, train, Position(0, 5), record=False)
    _write(train / "part-00000.arrow", 50, 3)
    with caplog.at_level(logging.WARNING, logger="engine.programs.ctr_positions"):
        assert _resume(tmp_path, train, uri) == Position(0, 5)
    assert any("records no fingerprint of the train files" in r.getMessage() for r in caplog.records)


def test_a_same_size_change_inside_a_large_file_is_refused(tmp_path, train):
    """Other rows in the middle of a file, same size, same first and last 64 KiB: the ends' CRC alone
    passed it, and the resume skipped rows of other data (found by an audit: rows 9,000-11,000 of a
    20,000-row file rewritten kept the fingerprint). The blocks sampled between the ends see it, in a
    file far larger than they read (64 blocks of 4 KiB), at a cost bounded whatever its size."""
    big = train / "part-00001.arrow"
    _write(big, 400_000, 1)                                  # ~4.8 MB: the samples cover ~5% of it
    uri = _checkpoint(tmp_path, train, Position(0, 7))
    was = files_fingerprint(str(train))
    _write(big, 400_000, 1, other_rows=slice(150_000, 250_000))
    with pytest.raises(ConfigError) as e:
        _resume(tmp_path, train, uri)
    now = files_fingerprint(str(train))
    assert now[0][:3] == was[0][:3] and now[0][3] != was[0][3]       # size and ends equal: only inside
    assert (f"part-00001.arrow rewritten inside (same size and ends, CRC-32 of the blocks sampled between them "
            f"was {was[0][3]}, now {now[0][3]})") in str(e.value)
    # a fingerprint recorded before the inner blocks were (3 fields) is compared as it was
    assert describe_file_changes([e[:3] for e in was], now) == []


def test_a_position_taken_on_the_former_split_of_the_rows_restarts_its_epoch(tmp_path, train, caplog):
    """A checkpoint of an engine that split the train files whole among the workers records no
    ``shard_by``: its batch offset counts batches of other shards than today's balanced split of the
    rows, so the epoch restarts from its first batch (with a warning) rather than skip other rows."""
    t = _trainer(tmp_path, train)
    sources = AlignedCheckpoints(t, files=files_fingerprint(str(train))).sources(Position(0, 7))
    assert sources["train"].pop("shard_by") == "rows"
    server = PSServer.from_config(t.ctx.config, 0)
    client = PSClient(InProcessTransport([server]))
    try:
        client.init_dense("dense", np.zeros(4, np.float32))
        mgr = CheckpointManager(str(tmp_path / "ckpt"), "ctr_dnn")
        uri = mgr.uri_of(mgr.save(client, "base", sources=sources, config=t.ctx.config.to_dict())["name"])
    finally:
        client.close()
        server.close()
    with caplog.at_level(logging.WARNING, logger="engine.programs.ctr_positions"):
        assert _resume(tmp_path, train, uri) == Position(0, 0)
    assert any("'shard_by': (None, 'rows')" in r.getMessage() for r in caplog.records)


def test_the_same_files_under_another_path_keep_the_position(tmp_path, train, caplog):
    """Inputs moved (copied to another directory, a new mount point, or an s3:// prefix: the fingerprint
    of tests/contract/test_remote_inputs.py is the same there): the train path in the position's identity
    differed, and the epoch restarted from its first batch, training its first batches twice. The same
    files (names, sizes, CRCs) hold the same rows in the same order: the position holds. Other files under
    another path restart the epoch from its first batch, as before."""
    uri = _checkpoint(tmp_path, train, Position(0, 7))
    moved = tmp_path / "moved" / "train"
    shutil.copytree(train, moved)
    with caplog.at_level(logging.INFO, logger="engine.programs.ctr_positions"):
        assert _resume(tmp_path, moved, uri) == Position(0, 7)
    assert any(f"model.data.train_path is {moved}, was {train} when checkpoint {uri} was taken: the same files"
               in r.getMessage() for r in caplog.records)
    _write(moved / "part-00000.arrow", 50, 3)
    assert _resume(tmp_path, moved, uri) == Position(0, 0)


def test_a_local_file_written_again_or_deleted_after_it_was_listed_is_refused(train):
    """Checked before every epoch (ctr.CTRTrainer.train_epoch): the row split holds for the files listed."""
    from engine.programs.ctr_data import check_unchanged, local_versions
    from streaming.inputs import InputChangedError
    from streaming.source import list_files
    files = list_files(str(train))
    versions, fp = local_versions(files), files_fingerprint(str(train))
    assert check_unchanged(files, versions, fp) == versions
    shutil.copy(train / "part-00002.arrow", train / "copy.tmp")
    (train / "copy.tmp").replace(train / "part-00002.arrow")          # the same bytes again: a new inode, taken
    again = check_unchanged(files, versions, fp)
    assert again[1] != versions[1] and again[0] == versions[0]
    _write(train / "part-00002.arrow", 300, 3)                         # other rows, the same size
    with pytest.raises(InputChangedError, match=rf"^{train / 'part-00002.arrow'}: row 1: field <object version>: "
                                                rf"expected the file as the job listed it"):
        check_unchanged(files, again, fp)
    (train / "part-00002.arrow").unlink()
    with pytest.raises(InputChangedError, match="got none: deleted"):
        check_unchanged(files, again, fp)
