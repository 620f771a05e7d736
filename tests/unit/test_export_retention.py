"""Retention of the online job's serving bundles (``engine.export.retention``): the ``keep_full`` newest
full bundles and everything after the oldest of them stay, so every kept delta still applies onto its
chain; older bundles and incomplete leftovers go, ``_SUCCESS`` first. Before, bundles were never
deleted: 24 a day, each with the dense tower."""
from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pytest

import hdfs_io
from engine.export import RowBatchSource, describe_model, export_bundle, load_bundle
from engine.export.retention import prune_bundles
from models import build_model

SLOTS = ["C1", "C2", "C3"]
MODEL = build_model("ctr_dnn", num_slots=3, dim=4, dense_dim=2, hidden=(8,), seed=1)


def export(root, name: str, step: int, since: str | None) -> str:
    keys = np.arange(1, 51, dtype=np.uint64)
    vals = np.full((50, 4), float(step), np.float32)
    vals[: step % 50] += 1.0
    rows = pa.RecordBatch.from_arrays(
        [pa.array(keys), pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1)), 4)], names=["key", "values"])
    out = f"{root}/{name}"
    export_bundle(RowBatchSource(describe_model(MODEL, SLOTS), MODEL.get_dense(), [rows], "memory://t"), out,
                  groups=2, since=None if since is None else f"{root}/{since}")
    return out


def aged(path) -> None:
    """A killed export's leftover: nothing written to it for an hour (older than INCOMPLETE_GRACE_S)."""
    old = time.time() - 3600
    for p in [path, *path.rglob("*")]:
        os.utime(p, (old, old))


def names(root) -> list[str]:
    return sorted(f"{d.parent.name}/{d.name}" for d in root.glob("*/*") if d.is_dir())


def test_the_newest_full_bundles_and_their_chains_stay(tmp_path):
    root = tmp_path / "exports"
    plan = [("20240101/0100-base", None), ("20240101/0200-delta", "20240101/0100-base"),
            ("20240101/0300-base", None), ("20240101/0400-delta", "20240101/0300-base"),
            # an export that failed at 05: 06's delta is against 04, the last published
            ("20240101/0600-delta", "20240101/0400-delta"),
            ("20240102/0000-delta", None),            # a full bundle after a delta checkpoint (no export before)
            ("20240102/0100-delta", "20240102/0000-delta")]
    for step, (name, since) in enumerate(plan):
        export(root, name, step, since)
    (root / "20240101" / "0500-delta").mkdir()         # the failed export's leftover: no _SUCCESS
    (root / "20240101" / "0500-delta" / "model.json").write_text("{}")
    aged(root / "20240101" / "0500-delta")
    assert prune_bundles(str(root), 2) == ["20240101/0100-base", "20240101/0200-delta", "20240101/0500-delta"]
    assert names(root) == ["20240101/0300-base", "20240101/0400-delta", "20240101/0600-delta",
                           "20240102/0000-delta", "20240102/0100-delta"]
    served = load_bundle(str(root / "20240101" / "0300-base"))     # the older kept chain still applies
    for name in ("0400-delta", "0600-delta"):
        served.apply_delta(str(root / "20240101" / name))
    assert prune_bundles(str(root), 2) == []                      # nothing more to delete
    assert prune_bundles(str(root), 1) == ["20240101/0300-base", "20240101/0400-delta", "20240101/0600-delta"]
    assert names(root) == ["20240102/0000-delta", "20240102/0100-delta"]
    assert not (root / "20240101").exists()                        # the emptied day goes too


def test_fewer_full_bundles_than_kept_deletes_only_leftovers(tmp_path):
    root = tmp_path / "exports"
    export(root, "20240101/0100-base", 0, None)
    export(root, "20240101/0300-delta", 1, "20240101/0100-base")
    (root / "20240101" / "0200-delta").mkdir()
    aged(root / "20240101" / "0200-delta")
    assert prune_bundles(str(root), 2) == ["20240101/0200-delta"]
    assert prune_bundles(str(tmp_path / "nothing"), 2) == []
    with pytest.raises(ValueError, match="keep_full"):
        prune_bundles(str(root), 0)


def test_an_unreadable_bundle_is_left_alone_with_a_warning(tmp_path, caplog):
    root = tmp_path / "exports"
    export(root, "20240101/0100-base", 0, None)
    export(root, "20240101/0200-base", 1, None)
    export(root, "20240101/0300-base", 2, None)
    (root / "20240101" / "0200-base" / "model.json").write_bytes(b"garbage")     # its CRC-32 no longer holds
    assert prune_bundles(str(root), 2) == []          # 0200 does not count as full: 0100 and 0300 are kept
    assert any("not a readable bundle" in r.getMessage() and "0200-base" in r.getMessage() for r in caplog.records)
    assert hdfs_io.is_complete(hdfs_io.Storage.from_uri(str(root)), "20240101/0100-base")


def test_after_a_roll_back_the_bundle_just_published_and_its_chain_stay(tmp_path):
    """Run A exported bases at 00 and 03; the job is resumed from hour 01's checkpoint (a roll-back) and
    exports 0200 as a delta against 0100 (the chain of the restored checkpoint). The newer bundles of
    the abandoned run must neither count nor take 0200's chain with them."""
    root = tmp_path / "exports"
    for step, (name, since) in enumerate([("20240101/0000-base", None), ("20240101/0100-delta", "20240101/0000-base"),
                                          ("20240101/0300-base", None), ("20240101/0400-delta", "20240101/0300-base")]):
        export(root, name, step, since)
    export(root, "20240101/0200-delta", 9, "20240101/0100-delta")     # the resumed run
    assert prune_bundles(str(root), 1, current="20240101/0200-delta") == []
    served = load_bundle(str(root / "20240101" / "0000-base"))
    for name in ("0100-delta", "0200-delta"):
        served.apply_delta(str(root / "20240101" / name))
    assert names(root) == ["20240101/0000-base", "20240101/0100-delta", "20240101/0200-delta",
                           "20240101/0300-base", "20240101/0400-delta"]                  # nothing newer touched
    # without `current` the abandoned run's base would have counted, and 0200's chain gone with 0000
    assert prune_bundles(str(root), 1) == ["20240101/0000-base", "20240101/0100-delta", "20240101/0200-delta"]
