"""A role process (``engine train --role``) ends without the interpreter's final garbage collection
(``engine.cli.train._end_role_process``): that collection was the gap, of seconds on a loaded machine, in
which a finished worker's closed health port made a liveness probe restart it. Whatever way the role
ends, its objects are frozen; the launcher's process, which callers may run in-process, is left alone."""
from __future__ import annotations

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


@pytest.mark.parametrize("role, frozen", [(["--role", "worker"], True), (["--role", "server"], True),
                                          ([], False)])
def test_a_role_process_ends_with_its_objects_out_of_the_final_collection(role, frozen):
    # a bad key ends each the same way (exit 2, one line) before anything starts
    p = subprocess.run([sys.executable, "-c", PROGRAM, "train", str(REPO / "configs" / "logreg_demo.yaml"),
                        *role, "--set", "mode=nonsense"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "engine train: config error:" in p.stderr and "mode" in p.stderr, p.stderr[-2000:]
    _, rc, count = p.stdout.split()
    assert int(rc) == 2
    assert (int(count) > 0) == frozen, (role, count)
