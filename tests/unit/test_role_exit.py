"""A role process (``engine train --role``) ends without the interpreter's final garbage collection
(``engine.cli.train._end_role_process``): that collection was the gap, of seconds on a loaded machine, in
which a finished worker's closed health port made a liveness probe restart it. Whatever way the role
ends, its objects are frozen; the launcher's process, which callers may run in-process, is left alone."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROGRAM = """
import gc, sys
from engine.cli import main
rc = main(sys.argv[1:])
print("result", rc, gc.get_freeze_count())
"""


@pytest.mark.parametrize("role, env_role, frozen", [(["--role", "worker"], None, True),
                                                    (["--role", "server"], None, True),
                                                    ([], "worker", True),
                                                    ([], None, False),
                                                    ([], "", False)])       # ENGINE_ROLE set empty: the launcher
def test_a_role_process_ends_with_its_objects_out_of_the_final_collection(role, env_role, frozen):
    # a bad key ends each the same way (exit 2, one line) before anything starts
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_ROLE"}
    if env_role is not None:
        env["ENGINE_ROLE"] = env_role
    p = subprocess.run([sys.executable, "-c", PROGRAM, "train", str(REPO / "configs" / "logreg_demo.yaml"),
                        *role, "--set", "mode=nonsense"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "engine train: config error:" in p.stderr and "mode" in p.stderr, p.stderr[-2000:]
    _, rc, count = p.stdout.split()
    assert int(rc) == 2
    assert (int(count) > 0) == frozen, (role, count)


def test_a_server_whose_restore_fails_still_closes_its_spill_stores(tmp_path):
    """A server that cannot restore the checkpoint it was told to (``--resume URI`` of nothing) exits 1
    with one line, and its spill stores, opened before the restore, are closed and their directories
    removed: the role's end no longer runs the collection that might have finalized them."""
    spill, ckpt = tmp_path / "spill", tmp_path / "ckpt"
    cfg = tmp_path / "server.yaml"
    cfg.write_text(f"""
cluster: {{servers: 1, workers: 1}}
checkpoint: {{root: {ckpt}}}
tables:
  sparse:
    emb: {{dim: 4, optimizer: sgd, learning_rate: 1.0, memory_rows: 100, spill_path: {spill}, num_threads: 1}}
""")
    p = subprocess.run([sys.executable, "-m", "engine", "train", str(cfg), "--role", "server", "--port", "0",
                        "--resume", str(tmp_path / "nothing")], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert f"engine train: cannot resume: no complete checkpoint under {tmp_path / 'nothing'}" in p.stderr
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert spill.is_dir() and not list(spill.iterdir()), sorted(spill.iterdir())   # the shards' stores: gone


@pytest.mark.parametrize("argv, message", [
    (["--role", "worker", "--rank", "0", "--resume-id", "x"], "--resume-id: only for --role server"),
    (["--resume-id", "x"], "--resume-id: only for --role server"),
    (["--role", "server", "--port", "0", "--resume-id", "x"], "--resume-id: only with --resume URI"),
    (["--role", "server", "--port", "0", "--resume", "s3://b/c/j/20240101/0100-base", "--resume-id", "a b"],
     "--resume-id: 1-64 letters"),
])
def test_a_resume_id_where_it_means_nothing_is_a_usage_error(tmp_path, argv, message):
    """``--resume-id`` belongs to a server started with ``--resume URI`` (``engine k8s`` renders both): on a
    worker, the launcher, a server without a URI, or malformed, it is refused with exit 2 and one line,
    never silently ignored."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster: {servers: 1, workers: 1, warm_up: false}\n"
                   "tables: {sparse: {emb: {dim: 4, optimizer: sgd, learning_rate: 1.0}}}\n")
    p = subprocess.run([sys.executable, "-m", "engine", "train", str(cfg), *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
