"""How long a supervised job takes to recover from a dead server and to notice a frozen one.

    python bench/recovery_bench.py [--quick] [--only machine,recovery,hang] [--rows 5000000]

Both measurements run ``engine train configs/ctr.yaml`` (CTR-DNN, 2 servers + 2 workers, async, the
shipped network) on generated rows, with the embedding table at dim 16 (row-wise Adagrad, the config's
optimizer), under the real launcher and supervisor (``engine.launch``), as separate process trees.

* ``machine``   os.cpu_count, the CPUs this process may run on (sched_getaffinity), the load average.
* ``recovery``  a job whose checkpoint holds ``--rows`` rows is killed (``kill -9`` of server 0)
                mid-training, between two aligned checkpoints:

                - ``recovery_s``: from the kill to the first training step of the restarted attempt (the
                  ``time`` of the first ``train`` event in the job's metrics file written after the
                  ``restart-1`` directory appeared; ``model.log_every_s`` is 0.001 so every step writes
                  one). The restarted attempt's worker progress report (``step`` past 0) confirms it.
                - ``restore_s``: the restore of that same checkpoint (the chain the restart restored: the
                  base and its deltas) alone, in the same run once the job is stopped: fresh servers of
                  the job's resolved config (``LocalCluster.start_servers``), then
                  ``engine.job_checkpoints.resume`` timed, the call the supervisor makes.
                - ``overhead_s = recovery_s - restore_s`` (target <= 10: detection, process start,
                  warm-up, the workers' start), with the timeline of the launcher's log (``detect_s``:
                  kill to ``restart-1``, ``servers_ready_s``, ``restored_s``; the restart's own restore
                  time ``restore_in_recovery_s``, from the checkpoint coordinator's log line).

                How the table gets its rows: generated CTR data of a few thousand rows touches far fewer
                than 5M keys, and the logreg program only takes dim-1 tables, so the bench writes the
                job's first checkpoint itself: in-process servers built from the job's config
                (``PSServer.from_config``) receive ``--rows`` random keys through ``PSClient.push``
                (one Adagrad step each, shows 1, so every row carries value, accumulator and counters),
                the dense MLP its initial parameters (``PSClient.init_dense``), and
                ``CheckpointManager.save`` publishes a base at data position epoch 0, batch 0 under the
                job's root. ``engine train --resume`` starts from it; the job then writes deltas
                every ``checkpoint.delta_every`` steps on top of it, so the checkpoint the restart
                restores is that base plus its deltas and the restore moves every row over the wire
                format and storage path a real one does.
* ``hang``      ``kill -STOP`` of server 0 of a running job (no checkpoints: detection does not depend
                on the table) with the default ``client.dead_after_s`` (30 s; ``--quick``: 5 s):
                ``detect_s`` from the SIGSTOP to the ``restart-1`` directory (the supervisor's next
                attempt begins; target <= dead_after_s + 2), ``declared_s`` to the moment the launcher
                signalled the frozen server (a SIGTERM pending on it: the death is declared and the
                attempt is being stopped) and ``stop_s`` between the two (stopping the attempt), with
                the role the launcher blamed.

``--quick``: 500k rows and dead_after_s 5, to check the bench works. Every wait is bounded; every
process a run starts is killed at its end, failed or not. One JSON object per line on stdout, each with a
``bench`` field. Heavy (the full run holds 5M rows in three processes at once); never run by tests.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import job_checkpoints as ckpt_job
from engine import progress
from engine.config import load_config
from engine.launch.local import LocalCluster
from engine.launch.procs import processes_of, role_pid
from engine.ps import InProcessTransport, PSClient, PSServer

CONFIG = REPO / "configs" / "ctr.yaml"
TABLE = "embedding"
DIM = 16
CHUNK = 1 << 18            # keys per push while filling
OVERHEAD_TARGET_S = 10.0
HANG_SLACK_S = 2.0


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def machine() -> dict:
    return {"bench": "machine", "os_cpu_count": os.cpu_count(),
            "sched_getaffinity_cpus": len(os.sched_getaffinity(0)),
            "loadavg_1min": round(os.getloadavg()[0], 2)}


# ----------------------------------------------------------------------------- the job and its processes
def job_sets(tmp: Path, *extra: str) -> list[str]:
    """``--set`` overrides of configs/ctr.yaml shared by both measurements."""
    return ["model.data.source=generated", "model.data.generated_rows=20000",
            f"model.data.cache_dir={tmp / 'cache'}", f"model.metrics_file={tmp / 'metrics.jsonl'}",
            f"model.dim={DIM}", f"tables.sparse.{TABLE}.dim={DIM}", "cluster.servers=2", "cluster.workers=2",
            "model.epochs=200", "model.eval_every_epoch=false", *extra]


def start_job(run_dir: Path, sets: list[str], resume: str | None, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine", "train", str(CONFIG), "--run-dir", str(run_dir)]
    for kv in sets:
        cmd += ["--set", kv]
    if resume is not None:
        cmd += ["--resume", resume]
    with open(log_path, "wb") as err:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def stop_job(proc: subprocess.Popen | None, tmp: Path) -> None:
    """Ctrl-C to the launcher (it stops its children), then SIGKILL to whatever is left under ``tmp``."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while (left := processes_of(tmp)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    if left:
        raise RuntimeError(f"processes left under {tmp}: {left}")


def wait_until(what: str, ok, timeout_s: float, proc: subprocess.Popen | None = None, poll_s: float = 0.02):
    """Poll ``ok()`` until it returns something truthy (returned); raise after ``timeout_s`` or when the
    launcher ``proc`` has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ok()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the job exited ({proc.returncode}) before {what}")
        time.sleep(poll_s)
    raise RuntimeError(f"{what}: not within {timeout_s:g}s")


_LOG = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) launcher \w+ [\w.]+: (.*)$")


def launcher_events(log_path: Path) -> list[tuple[float, str]]:
    """(wall seconds, message) of the launcher's log lines (asctime is local time, millisecond resolution)."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        m = _LOG.match(line)
        if m:
            t = _dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((t, m.group(2)))
    return out


def first_after(events, t0: float, pattern: str):
    """(time, match) of the first launcher event at or after ``t0`` (less its 1 ms resolution) matching."""
    rx = re.compile(pattern)
    for t, msg in events:
        m = rx.search(msg)
        if t >= t0 - 0.001 and m:
            return t, m
    return None, None


# ----------------------------------------------------------------------------- recovery
def write_base(cfg, rows: int, seed: int = 0) -> tuple[str, float]:
    """Publish the job's first checkpoint: ``rows`` rows pushed into in-process servers of ``cfg``, the
    dense MLP at its initial parameters. Returns (URI, seconds)."""
    from models import build_model

    t0 = time.perf_counter()
    p = cfg.model.params
    servers = [PSServer.from_config(cfg, i) for i in range(cfg.cluster.servers)]
    try:
        client = PSClient(InProcessTransport(servers, serialize=False), timeout_s=3600)
        rng = np.random.default_rng(seed)
        keys = np.unique(rng.integers(1, 1 << 62, int(rows * 1.01), dtype=np.uint64))[:rows]
        for a in range(0, rows, CHUNK):
            k = keys[a:a + CHUNK]
            client.push(TABLE, k, rng.normal(0, 0.01, (len(k), DIM)).astype(np.float32),
                        shows=np.ones(len(k), np.float32), clicks=(rng.random(len(k)) < 0.1).astype(np.float32))
        model = build_model(cfg.model.kind, num_slots=len(p.slots), dim=p.dim, dense_dim=p.dense_dim,
                            hidden=p.hidden, seed=p.seed)
        client.init_dense(p.dense_table, model.get_dense())
        mgr = ckpt_job.job_manager(cfg)
        m = mgr.save(client, "base", when=time.time(), step=0, sources={"train": {"epoch": 0, "batch": 0}},
                     config=cfg.to_dict())
        got = m["tables"]["sparse"][TABLE]["rows"]
        if got != rows:
            raise RuntimeError(f"base holds {got} rows of {TABLE}, expected {rows}")
        return mgr.uri_of(m["name"]), time.perf_counter() - t0
    finally:
        for s in servers:
            s.close()


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def time_restore(config_path: Path, uri: str, run_dir: Path) -> tuple[float, int]:
    """Fresh servers of the resolved config at ``config_path``; (seconds, rows) of restoring ``uri``
    with ``engine.job_checkpoints.resume`` (the supervisor's call)."""
    cfg = load_config(config_path)
    cap = _Capture()
    coord = logging.getLogger("engine.checkpoint.coordinator")
    saved = coord.level, coord.propagate
    coord.addHandler(cap)
    coord.setLevel(logging.INFO)
    coord.propagate = False
    try:
        with LocalCluster(cfg, run_dir) as cluster:
            cluster.start_servers()
            t0 = time.perf_counter()
            ckpt_job.resume(cfg, cluster.endpoints, uri)
            seconds = time.perf_counter() - t0
            cluster.stop_servers()
    finally:
        coord.removeHandler(cap)
        coord.setLevel(saved[0])
        coord.propagate = saved[1]
    rows = next((int(m.group(1)) for m in map(re.compile(r"(\d+) row\(s\) loaded").search, cap.messages) if m), -1)
    return seconds, rows


def manifests(job_root: Path) -> list[dict]:
    out = []
    for f in job_root.glob("*/*/manifest.json"):
        if (f.parent / "_SUCCESS").exists():
            try:
                out.append(json.loads(f.read_text()))
            except ValueError:
                pass
    return sorted(out, key=lambda m: m["name"])


def first_train_event(metrics: Path, after: float) -> dict | None:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "train" and ev.get("time", 0) > after and (best is None or ev["time"] < best["time"]):
            best = ev
    return best


def bench_recovery(tmp: Path, rows: int, timeout_s: float) -> dict:
    ck_root = tmp / "ckpt"
    sets = job_sets(tmp, f"checkpoint.root={ck_root}", "checkpoint.job=recovery", "checkpoint.align_steps=16",
                    "checkpoint.delta_every=32steps", "model.log_every_s=0.001")
    cfg = load_config(CONFIG, sets)
    base_uri, base_s = write_base(cfg, rows)
    run_dir = tmp / "run-recovery"
    launcher_log = tmp / "launcher-recovery.log"
    proc = start_job(run_dir, sets, base_uri, launcher_log)
    try:
        # mid-training: a delta on top of the base is published, and worker 0 trains past it, between meetings
        wait_until("a delta checkpoint on top of the base", lambda: len(manifests(ck_root / "recovery")) >= 2,
                   timeout_s, proc)
        delta_step = manifests(ck_root / "recovery")[-1]["step"]

        def training():
            r = progress.read(run_dir / "worker-0.progress.json")
            return r and r.get("phase") is None and r.get("step", 0) >= delta_step + 8

        wait_until("worker 0 training after the delta", training, timeout_s, proc, poll_s=0.005)
        pid = role_pid(run_dir, "server", 0, 30)
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        restarted = run_dir / "restart-1"
        wait_until("restart-1", restarted.exists, timeout_s, proc, poll_s=0.005)
        t_restart = time.time()
        first = wait_until("the restarted attempt's first training step",
                           lambda: first_train_event(tmp / "metrics.jsonl", t_restart), timeout_s, proc)
        report = wait_until("the restarted worker's progress report past step 0",
                            lambda: (r := progress.read(restarted / f"worker-{first['rank']}.progress.json"))
                            and r.get("step", 0) > 0 and r, 30, proc)
    finally:
        stop_job(proc, tmp)
    t_first = float(first["time"])
    if float(report["step_time"]) < t_first - 0.01:
        raise RuntimeError(f"progress report's step_time {report['step_time']} precedes the metrics event {t_first}")
    events = launcher_events(launcher_log)
    _, why = first_after(events, t_kill, r"^(\S+ \d+) failed \((.*?)\); restart 1/")
    t_ready, _ = first_after(events, t_restart, r"^servers ready")
    t_resumed, resumed = first_after(events, t_restart, r"^resumed from (\S+) \(step (\d+)\)")
    _, restored = first_after(events, t_restart,
                              r"\((base \S+) \+ (\d+) delta\(s\)\): (\d+) row\(s\) loaded in ([\d.]+) s")
    if resumed is None or restored is None:
        raise RuntimeError(f"no restore in the restarted attempt's launcher log {launcher_log}")
    uri = resumed.group(1)
    restore_s, restore_rows = time_restore(restarted / "config.yaml", uri, tmp / "run-restore")
    recovery_s = t_first - t_kill
    overhead_s = recovery_s - restore_s
    return {"bench": "recovery", "rows_in_base": rows, "dim": DIM, "optimizer": cfg.sparse_tables[TABLE].optimizer,
            "servers": cfg.cluster.servers, "workers": cfg.cluster.workers, "base_write_s": round(base_s, 2),
            "killed": "server 0", "blamed": why.group(1) if why else None,
            "checkpoint": uri.rsplit("/", 2)[-2] + "/" + uri.rsplit("/", 1)[-1],
            "checkpoint_step": int(resumed.group(2)), "chain_deltas": int(restored.group(2)),
            "rows_restored": int(restored.group(3)),
            "recovery_s": round(recovery_s, 3), "restore_s": round(restore_s, 3), "restore_rows": restore_rows,
            "overhead_s": round(overhead_s, 3), "overhead_target_s": OVERHEAD_TARGET_S,
            "overhead_ok": overhead_s <= OVERHEAD_TARGET_S,
            "detect_s": round(t_restart - t_kill, 3),
            "servers_ready_s": round(t_ready - t_kill, 3) if t_ready else None,
            "restored_s": round(t_resumed - t_kill, 3),
            "restore_in_recovery_s": float(restored.group(4)),
            "first_step_s": round(t_first - t_kill, 3),
            "first_step_progress_step": int(report["step"])}


# ----------------------------------------------------------------------------- hang
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits on the (stopped) process ``pid``; True once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    pend = {k: int(v, 16) for k, v in re.findall(r"^(ShdPnd|SigPnd):\s*([0-9a-f]+)$", text, re.MULTILINE)}
    return bool((pend.get("ShdPnd", 0) | pend.get("SigPnd", 0)) & SIGTERM_BIT) or "State:\tZ" in text


def bench_hang(tmp: Path, dead_after_s: float | None, timeout_s: float) -> dict:
    sets = job_sets(tmp, 'checkpoint.root=""')
    if dead_after_s is not None:
        sets.append(f"client.dead_after_s={dead_after_s:g}")
    dead_after = load_config(CONFIG, sets).client.dead_after_s
    run_dir = tmp / "run-hang"
    launcher_log = tmp / "launcher-hang.log"
    proc = start_job(run_dir, sets, None, launcher_log)
    try:
        wait_until("worker 0 training", lambda: (r := progress.read(run_dir / "worker-0.progress.json"))
                   and r.get("step", 0) >= 20, timeout_s, proc)
        pid = role_pid(run_dir, "server", 0, 30)
        t_stop = time.time()
        os.kill(pid, signal.SIGSTOP)
        bound = dead_after + 60
        wait_until("the launcher's SIGTERM to the frozen server", lambda: sigterm_pending(pid), bound, proc, 0.005)
        t_declared = time.time()
        wait_until("restart-1", (run_dir / "restart-1").exists, bound, proc, 0.005)
        t_restart = time.time()
    finally:
        stop_job(proc, tmp)
    t_log, why = first_after(launcher_events(launcher_log), t_stop, r"^(\S+ \d+) failed \((.*?)\); restart 1/")
    detect_s = t_restart - t_stop
    return {"bench": "hang", "frozen": "server 0", "dead_after_s": dead_after,
            "blamed": why.group(1) if why else None, "reason": why.group(2) if why else None,
            "detect_s": round(detect_s, 3), "target_s": dead_after + HANG_SLACK_S,
            "detect_ok": detect_s <= dead_after + HANG_SLACK_S,
            "declared_s": round(t_declared - t_stop, 3), "stop_s": round(t_restart - t_declared, 3),
            "restart_logged_s": round(t_log - t_stop, 3) if t_log else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="500k rows, client.dead_after_s 5")
    p.add_argument("--rows", type=int, default=None, help="rows of the checkpoint (default 5M; --quick 500k)")
    p.add_argument("--only", default="machine,recovery,hang")
    p.add_argument("--timeout", type=float, default=600.0, help="longest wait for any one event, seconds")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rows = args.rows or (500_000 if args.quick else 5_000_000)
    only = set(args.only.split(","))
    if "machine" in only:
        emit(machine())
    for name in ("recovery", "hang"):
        if name not in only:
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f"recovery-bench-{name}-"))
        try:
            if name == "recovery":
                emit(bench_recovery(tmp, rows, args.timeout))
            else:
                emit(bench_hang(tmp, 5.0 if args.quick else None, args.timeout))
        finally:
            stop_job(None, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
