"""What a restart restores (``job_checkpoints.recovery_target``, the role-mode ``roles._rollback_target``):
the newest checkpoint the job wrote, else the one it started from, else nothing; never a checkpoint of
the job root that predates the job. Real checkpoints written through in-process servers."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import hdfs_io

from engine import job_checkpoints
from engine.config import load_config
from engine.ps import InProcessTransport, PSClient, PSServer
from engine.roles import _rollback_target
from engine.ps import serve

DEMO = Path(__file__).resolve().parents[2] / "configs" / "logreg_demo.yaml"


def checkpoints(tmp_path: Path, job: str, n: int) -> list[str]:
    """``n`` complete checkpoints (a base, then deltas) of ``job`` under ``tmp_path/ckpt``; their URIs."""
    cfg = cfg_of(tmp_path, job)
    server = PSServer.from_config(cfg, 0)
    client = PSClient(InProcessTransport([server]))
    client.push("weights", np.arange(1, 9, dtype=np.uint64), np.ones((8, 1), np.float32))
    mgr = job_checkpoints.job_manager(cfg)
    uris = []
    for i in range(n):
        m = mgr.save(client, "base" if i == 0 else "delta", when=3600.0 * (len(mgr.list()) + 1), step=i)
        uris.append(mgr.uri_of(m["name"]))
    server.close()
    return uris


def cfg_of(tmp_path: Path, job: str = "logreg"):
    return load_config(DEMO, [f"checkpoint.root={tmp_path / 'ckpt'}", f"checkpoint.job={job}", "cluster.servers=1",
                              "cluster.warm_up=false"])


def test_a_restart_restores_what_the_job_wrote_else_what_it_started_from(tmp_path):
    old, abandoned = checkpoints(tmp_path, "logreg", 2)
    cfg = cfg_of(tmp_path)
    floor = job_checkpoints.newest_name(cfg)             # the job starts: --resume of the older one
    assert floor == abandoned.split("/logreg/", 1)[1]
    # nothing written yet: the checkpoint it started from, not the newer one the operator rolled back from
    assert job_checkpoints.recovery_target(cfg, floor, old)[0] == old
    assert job_checkpoints.recovery_target(cfg, floor, old)[1]["step"] == 0
    # without a floor (the rule before this one) the abandoned checkpoint came back
    assert job_checkpoints.recovery_target(cfg, None, old)[0] == abandoned
    # started afresh beside an earlier run's checkpoints: the beginning, never the earlier run's model
    assert job_checkpoints.recovery_target(cfg, floor, "") is None
    # once the job wrote one, that one
    (written,) = checkpoints(tmp_path, "logreg", 1)
    assert job_checkpoints.recovery_target(cfg, floor, old)[0] == written
    assert job_checkpoints.recovery_target(cfg, floor, "")[0] == written


def test_the_origin_may_lie_under_another_root_and_an_empty_root_has_floor_empty(tmp_path):
    (warm,) = checkpoints(tmp_path, "other", 1)          # a warm start from another job's checkpoint
    cfg = cfg_of(tmp_path)
    assert job_checkpoints.newest_name(cfg) == ""
    assert job_checkpoints.recovery_target(cfg, "", warm)[0] == warm
    assert job_checkpoints.newest_name(load_config(DEMO, [])) is None      # checkpoints off


def test_role_mode_rolls_back_above_the_lowest_floor_else_to_what_the_servers_restored(tmp_path):
    old, abandoned = checkpoints(tmp_path, "logreg", 2)
    cfg = cfg_of(tmp_path)
    floor = job_checkpoints.newest_name(cfg)
    health = [{"restored": None, "fenced_from": old, "checkpoint_floor": floor},
              {"restored": old, "fenced_from": None, "checkpoint_floor": floor}]
    assert _rollback_target(cfg, health) == (old, None)
    # servers of an older version report no floor: every checkpoint of the job counts (the old rule)
    assert _rollback_target(cfg, [{**h, "checkpoint_floor": None} for h in health]) == (abandoned, None)
    # a chain half loaded (rank 0 died inside its roll-back) still names where the job stands
    assert _rollback_target(cfg, [{"restored": None, "restoring": old, "checkpoint_floor": floor}] * 2) == (old, None)
    (written,) = checkpoints(tmp_path, "logreg", 1)
    # a server restarted after the job wrote a checkpoint has a higher floor: the lowest one decides
    later = job_checkpoints.newest_name(cfg)
    assert _rollback_target(cfg, [health[0], {**health[1], "checkpoint_floor": later}]) == (written, floor)
    assert _rollback_target(cfg, [{**h, "checkpoint_floor": later} for h in health]) == (old, None)
    # servers that started on an empty root, fresh, with nothing written: nothing to roll back to
    fresh = tmp_path / "fresh"
    assert _rollback_target(cfg_of(fresh), [{"restored": None, "checkpoint_floor": ""}]) == (None, None)


def test_a_damaged_checkpoint_of_the_job_falls_back_to_its_own_then_to_its_origin_never_before_it(tmp_path):
    """A restart's restore (``job_checkpoints.resume`` with the job's floor and origin) of a damaged
    checkpoint: the fallback keeps to older checkpoints the job wrote, then the one it started from;
    before, it walked back through the whole root and restored the newer checkpoint the operator had
    rolled back from."""
    old, abandoned = checkpoints(tmp_path, "logreg", 2)
    cfg = cfg_of(tmp_path)
    floor = job_checkpoints.newest_name(cfg)
    (written,) = checkpoints(tmp_path, "logreg", 1)
    part = next(p for p in Path(written).rglob("*.arrow"))
    part.write_bytes(part.read_bytes()[:-16] + bytes(16))            # damaged: its CRC-32 no longer matches
    core = PSServer.from_config(cfg, 0)
    server, port = serve(core, "127.0.0.1", 0)
    try:
        ep = [f"127.0.0.1:{port}"]
        got = job_checkpoints.resume(cfg, ep, written, fallback=True, floor=floor, origin=old)
        assert got.checkpoint.restored == old
        got = job_checkpoints.resume(cfg, ep, written, fallback=True)        # the walk without a floor
        assert got.checkpoint.restored == abandoned
    finally:
        server.stop(0)
        core.close()


def test_checkpoints_record_the_servers_resume_pair_and_only_the_newest_checkpoint_counts(tmp_path, caplog):
    """``--resume URI --resume-id ID`` (``engine k8s --resume URI``): each server's part report carries
    the pair, the manifest lists it in ``resumed_with``, and ``resumed_since`` answers the job's newest
    checkpoint when that one records the pair, with the floor below the pair's run (a fallback keeps to
    it); else None (restore URI). A checkpoint of an older render with the same pair, under newer ones
    of another render, does not count (a review found it revived an abandoned branch), nor does the
    same id with another URI."""
    cfg = cfg_of(tmp_path)
    mgr = job_checkpoints.job_manager(cfg)
    servers = [PSServer.from_config(cfg, 0)]
    client = PSClient(InProcessTransport(servers))
    client.push("weights", np.arange(1, 9, dtype=np.uint64), np.ones((8, 1), np.float32))
    u, v = "s3://b/ckpt/other/20240101/0100-base", "s3://b/ckpt/other/20240101/0200-base"
    hour = [0.0]

    def save(kind: str = "delta") -> dict:
        hour[0] += 3600.0
        return mgr.save(client, kind, when=hour[0])
    try:
        before = save("base")                                       # a server started without the pair
        assert before["resumed_with"] == []
        assert job_checkpoints.resumed_since(cfg, "r1", u) is None
        servers[0].resumed_with = {"id": "r1", "uri": u}
        first, second = save(), save()
        assert first["resumed_with"] == second["resumed_with"] == [{"id": "r1", "uri": u}]
        assert job_checkpoints.resumed_since(cfg, "r1", u) == (mgr.uri_of(second["name"]), before["name"])
        assert job_checkpoints.resumed_since(cfg, "r1", v) is None            # the same id, another URI
        assert job_checkpoints.resumed_since(cfg, "r2", u) is None            # another id: a new roll-back
        servers[0].resumed_with = None                              # a later render without --resume URI
        save()
        assert job_checkpoints.resumed_since(cfg, "r1", u) is None            # rendering U again: U itself
        servers[0].resumed_with = {"id": "r1", "uri": u}            # ... whose checkpoints then count
        newest = save()
        plain = mgr.list()[-2].name
        assert job_checkpoints.resumed_since(cfg, "r1", u) == (mgr.uri_of(newest["name"]), plain)
        # a damaged manifest is judged by its neighbours: the restore (with its fallback above the floor)
        # names the damage
        latest = save()
        (tmp_path / "ckpt" / "logreg" / latest["name"] / hdfs_io.MANIFEST_NAME).write_text("{not json")
        with caplog.at_level("WARNING", logger="engine.job_checkpoints"):
            assert job_checkpoints.resumed_since(cfg, "r1", u) == (mgr.uri_of(latest["name"]), plain)
        assert "judged by its neighbours" in caplog.text
    finally:
        servers[0].close()
