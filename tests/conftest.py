"""Shared pytest fixtures. Real data lives in ../shared/data beside the repo; tests that need it skip
with a clear message when it is absent."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _restore_environ():
    """Give every test the environment it started with. In-process launcher runs set variables for the
    processes they start (``OPENBLAS_NUM_THREADS`` among them); left in pytest's own environment, they
    reach the subprocesses of whichever test the same xdist worker runs next, so a test's numbers would
    depend on the file order."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(name="tmpfs")
def _tmpfs_factory(tmp_path):
    """Factory for small tmpfs mounts (see tests/tmpfs.py): ``disk = tmpfs("spill", 4 << 20)`` mounts one
    of that many bytes at ``tmp_path / "spill"`` (``read_only=True``: read-only), unmounted after the
    test even when it fails. Skips the test when mounting is not possible (not root)."""
    from contextlib import ExitStack

    from tests.tmpfs import mounted

    with ExitStack() as stack:
        def make(name: str, size_bytes: int, read_only: bool = False) -> Path:
            return stack.enter_context(mounted(tmp_path / name, size_bytes, read_only))
        yield make


@pytest.fixture(name="test_hosts")
def _test_hosts_factory():
    """Factory for network-namespace test hosts (see tests/netns.py): ``hosts = test_hosts(["server0",
    "worker0"])`` returns an entered ``TestHosts``, torn down after the test. Skips the test when
    namespaces are unavailable, or fails it when ENGINE_REQUIRE_NETNS=1."""
    from contextlib import ExitStack

    from tests.netns import TestHosts, require_netns

    with ExitStack() as stack:
        def make(names, **kwargs) -> TestHosts:
            require_netns()
            return stack.enter_context(TestHosts(names, **kwargs))
        yield make


@pytest.fixture(scope="session")
def loopback_reference(tmp_path_factory, worker_id) -> tuple[dict, Path]:
    """``tests.integration.test_multihost.loopback_run`` once per session: (worker 0's result, the
    resolved config) of CTR-DNN sync, 2 servers, 2 workers under the local launcher on 127.0.0.1, its
    data converted to Arrow beside it. Several integration tests compare against this one deterministic
    run; they only read it (their own checkpoints go under their own tmp_path). Under xdist the workers
    share one run: the first to need it makes it in the session's common directory, under a file lock."""
    import json
    import shutil

    from filelock import FileLock

    from tests.integration.test_multihost import loopback_run

    if worker_id == "master":
        return loopback_run(tmp_path_factory.mktemp("loopback-reference"))
    root = tmp_path_factory.getbasetemp().parent / "loopback-reference"     # this session's, every worker's
    with FileLock(f"{root}.lock"):
        result = root / "run-lo" / "worker-0.result.json"
        if result.is_file():
            return json.loads(result.read_text()), root / "run-lo" / "config.yaml"
        shutil.rmtree(root, ignore_errors=True)         # what a failed attempt of another worker left
        root.mkdir()
        return loopback_run(root)


# --- Nothing a test runs may write into the repository -----------------------------------------------
# The shipped configs put every output under the repository's runs/ (checkpoints, metrics, TensorBoard
# runs, the data cache, run directories, input records): right for `make train`, wrong for a test, which
# must point each of them at its own tmp_path (checkpoint.root, model.metrics_dir,
# observability.tensorboard_dir, model.data.cache_dir, cluster.run_root). The session (xdist's controller,
# or pytest alone) lists runs/ before and after; anything new fails the run, naming the paths.
_OUTPUTS = REPO / "runs"


def _outputs() -> set[str]:
    if not _OUTPUTS.is_dir():
        return set()
    found = set()
    for root, dirs, files in os.walk(_OUTPUTS):
        rel = os.path.relpath(root, _OUTPUTS)
        found.update(os.path.normpath(os.path.join(rel, n)) for n in dirs + files)
    return found


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):      # the controller, or pytest without xdist
        session.config._outputs_before = _outputs()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_outputs_before", None)
    if before is None:
        return
    new = sorted(_outputs() - before)
    tops = sorted({p for p in new if not any(p.startswith(q + os.sep) for q in new if q != p)})
    if tops:
        shown = "\n  ".join(f"runs/{p}" for p in tops[:20]) + ("\n  ..." if len(tops) > 20 else "")
        session.config.get_terminal_writer().line(
            f"\nERROR: tests wrote into the repository ({len(tops)} new paths under runs/; point "
            "checkpoint.root, model.metrics_dir, observability.tensorboard_dir, model.data.cache_dir and "
            f"cluster.run_root at tmp_path):\n  {shown}", red=True)
        if session.exitstatus == 0:
            session.exitstatus = 1
