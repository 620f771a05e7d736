"""Role mode (``--role``, as ``engine k8s`` or a manual multi-host run starts a job) checks the CTR inputs
before the first step, as the launcher's ``prepare`` does (``engine.programs.ctr_inputs``): one server and
two workers started by hand on 127.0.0.1, a train split of three files with a bad label deep in the last
one, which only worker 1 reads."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from streaming.criteo import convert_criteo, generate_criteo

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
#: the old code's worker 0 waited this long at its next sync barrier for worker 1, which had exited
BARRIER_TIMEOUT_S = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_with_a_bad_label(d: Path) -> tuple[Path, Path, str]:
    """(train dir of 3 files, test dir, the launcher's message): the bad label is row 451 of the last file,
    which lies in the second half of the rows (worker 1's); ``part-2.repaired.arrow`` beside the directory
    is that file without it."""
    generate_criteo(d / "rows.txt", 2500, 5)
    for split in ("train", "test"):
        convert_criteo([d / "rows.txt"], d / f"{split}-one", split=split, batch_size=100)
    t = pa.concat_tables(pa.ipc.open_stream(str(f)).read_all() for f in sorted((d / "train-one").glob("*.arrow")))
    (d / "train").mkdir()
    third = t.num_rows // 3
    for i in range(3):
        part = t.slice(i * third, third if i < 2 else t.num_rows - 2 * third)
        if i == 2:
            labels = part.column("label").to_numpy().copy()
            labels[450] = 2.0
            part = part.set_column(0, "label", pa.array(labels, pa.float32()))
            _write(d / "part-2.repaired.arrow", t.slice(2 * third))
        _write(d / "train" / f"part-{i}.arrow", part)
    return d / "train", d / "test-one", (f"engine train: bad input data: {d / 'train' / 'part-2.arrow'}: row 451: "
                                         f"field label: expected a label in [0, 1], got 2.0")


def _write(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=100)


def role_cmd(tmp: Path, train: Path, test: Path, role: str, rank: int, *extra: str) -> list[str]:
    sets = ["mode=sync", "model.data.source=arrow", f"model.data.train_path={train}", f"model.data.test_path={test}",
            "model.slots=[C1, C2, C3]", "model.hidden=[16]", "model.batch_size=64", "model.shuffle_buffer=0",
            "model.log_every_s=0.001", "observability.tensorboard=false", f"model.metrics_dir={tmp / 'metrics'}",
            f"checkpoint.root={tmp / 'ckpt'}", "cluster.stop_servers_at_end=true",
            f"client.barrier_timeout_s={BARRIER_TIMEOUT_S}", "model.blas_threads=1"]
    return [sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"),
            *[a for s in sets for a in ("--set", s)], "--role", role, "--rank", str(rank), *extra]


def test_role_mode_workers_refuse_a_bad_label_before_any_step_and_train_once_it_is_repaired(tmp_path):
    """Before, both workers trained 10 steps, then worker 1's reader met the label (exit 2) and worker 0
    waited at the sync barrier of its 11th step until client.barrier_timeout_s (exit 1, a traceback; ~24 s
    for this test, 600 s by default), and the servers held the partial epoch. Now every worker checks its
    share of the rows before the first step and they meet on the verdict: both end within seconds with the
    launcher's line and exit 2 (engine k8s fails the Job on it), and no worker pushed anything. With the
    file repaired, the same workers started again against the same server (still serving, as after any
    failed attempt) train the job to its end: worker 0 empties the servers of the failed attempt first
    (engine.roles), and the check passes."""
    from engine.ps import PSClient
    train, test, line = split_with_a_bad_label(tmp_path)
    port = free_port()
    env = {**os.environ, "ENGINE_SERVERS": f"127.0.0.1:{port}", "ENGINE_NUM_WORKERS": "2"}
    env.pop("ENGINE_PARENT_PID", None)          # a scheduler's role, not a launcher's child
    logs = [tmp_path / f"worker-{w}.log" for w in range(2)]
    procs = []

    def start_workers() -> None:
        for w in range(2):
            with open(logs[w], "wb") as log:
                procs.append(subprocess.Popen(role_cmd(tmp_path, train, test, "worker", w), cwd=REPO, env=env,
                                              stdout=subprocess.DEVNULL, stderr=log, start_new_session=True))
    try:
        with open(tmp_path / "server.log", "wb") as log:
            procs.append(subprocess.Popen(role_cmd(tmp_path, train, test, "server", 0, "--port", str(port)),
                                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log,
                                          start_new_session=True))
        start_workers()
        t0 = time.monotonic()
        codes = [p.wait(timeout=BARRIER_TIMEOUT_S + 60) for p in procs[1:]]
        took = time.monotonic() - t0
        errs = [f.read_text() for f in logs]
        assert codes == [2, 2], (codes, errs[0][-2000:], errs[1][-2000:])
        for err in errs:
            assert err.strip().splitlines()[-1] == line, err[-2000:]
            assert "Traceback" not in err, err[-3000:]
        assert "worker 0: worker 1 found bad input data before training" in errs[0], errs[0][-2000:]
        assert took < BARRIER_TIMEOUT_S, took           # nobody waited out a barrier
        with PSClient([f"127.0.0.1:{port}"], name="probe") as probe:
            requests = probe.stats()[0]["requests"]
        assert not {m: requests.get(m) for m in ("Push", "Step") if requests.get(m)}, requests   # nothing trained
        events = [json.loads(x) for f in (tmp_path / "metrics").glob("*.jsonl") for x in f.read_text().splitlines()]
        assert not [e for e in events if e["event"] == "train"], events[-3:]

        os.replace(tmp_path / "part-2.repaired.arrow", train / "part-2.arrow")
        start_workers()
        codes = [p.wait(timeout=120) for p in procs[3:]]
        errs = [f.read_text() for f in logs]
        assert codes == [0, 0], (codes, errs[0][-2000:], errs[1][-2000:])
        assert "the job has no checkpoint yet: emptied 1 of 1 server(s)" in errs[0], errs[0][-2000:]
        assert "inputs checked by 2 worker(s) before training" in errs[0], errs[0][-2000:]
        assert procs[0].wait(timeout=30) == 0             # stopped by worker 0 at the job's end
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_a_role_mode_job_resumed_onto_a_spoilt_file_is_refused_before_its_first_step(tmp_path):
    """--resume of a checkpoint at an epoch's end (its position maps onto any files) after the train file
    got a bad label: the resumed workers check their shares again and end with the launcher's line and exit
    2 before any step; no checkpoint is written. Before, they resumed and trained epoch 1 up to the bad
    batch, and worker 0 then waited out its sync barrier (exit 1). A resume onto the files the first start
    checked reads none of them again (the job's input records), and trains."""
    from engine.checkpoint import CheckpointManager
    from engine.ps import PSClient
    train, test, line = split_with_a_bad_label(tmp_path)
    os.replace(train / "part-2.arrow", tmp_path / "part-2.spoilt.arrow")
    os.replace(tmp_path / "part-2.repaired.arrow", train / "part-2.arrow")
    env = {**os.environ, "ENGINE_NUM_WORKERS": "2"}
    env.pop("ENGINE_PARENT_PID", None)
    epochs = ("--set", "model.epochs=2", "--set", "checkpoint.delta_every=1steps")    # one at each epoch's end
    procs = []

    def job(tag: str, *server_args: str) -> tuple[list[int], list[str], int]:
        port = free_port()
        e = {**env, "ENGINE_SERVERS": f"127.0.0.1:{port}"}
        with open(tmp_path / f"{tag}-server.log", "wb") as log:
            procs.append(subprocess.Popen(role_cmd(tmp_path, train, test, "server", 0, "--port", str(port), *epochs,
                                                   *server_args), cwd=REPO, env=e, stdout=subprocess.DEVNULL,
                                          stderr=log, start_new_session=True))
        workers = []
        for w in range(2):
            with open(tmp_path / f"{tag}-worker-{w}.log", "wb") as log:
                workers.append(subprocess.Popen(role_cmd(tmp_path, train, test, "worker", w, *epochs), cwd=REPO,
                                                env=e, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True))
        procs.extend(workers)
        codes = [p.wait(timeout=BARRIER_TIMEOUT_S + 60) for p in workers]
        return codes, [(tmp_path / f"{tag}-worker-{w}.log").read_text() for w in range(2)], port

    try:
        codes, errs, _ = job("first")
        assert codes == [0, 0], (codes, errs[0][-2000:], errs[1][-2000:])
        mgr = CheckpointManager(str(tmp_path / "ckpt"), "ctr_dnn")
        written = [r.name for r in mgr.list()]
        (epoch_end,) = [n for n in written if (mgr.manifest(n)["sources"]["train"]["epoch"],
                                               mgr.manifest(n)["sources"]["train"]["batch"]) == (1, 0)]
        # the same files: every share passed at the first start (ctr_records), so no worker reads it again
        codes, errs, _ = job("again", "--resume", mgr.uri_of(epoch_end))
        assert codes == [0, 0], (codes, errs[0][-2000:], errs[1][-2000:])
        for w, err in enumerate(errs):
            assert (f"worker {w}: its share of the inputs was checked at an earlier start of the job, the files "
                    f"unchanged since") in err, err[-2000:]
        written = [r.name for r in mgr.list()]
        os.replace(tmp_path / "part-2.spoilt.arrow", train / "part-2.arrow")    # another version: checked
        codes, errs, port = job("resumed", "--resume", mgr.uri_of(epoch_end))
        assert codes == [2, 2], (codes, errs[0][-2000:], errs[1][-2000:])
        for err in errs:
            assert "resuming at epoch 1, batch 0" in err, err[-2000:]
            assert err.strip().splitlines()[-1] == line, err[-2000:]
        with PSClient([f"127.0.0.1:{port}"], name="probe") as probe:
            requests = probe.stats()[0]["requests"]
        assert not {m: requests.get(m) for m in ("Push", "Step") if requests.get(m)}, requests
        assert [r.name for r in mgr.list()] == written
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
