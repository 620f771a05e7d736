"""``ctr_dnn_async_hosts`` of ``bench/ctr_bench.py``: the ``ctr_dnn_async`` job across test hosts.

1 server host and 2 worker hosts (network namespaces joined by a bridge, ``tests/netns.py``; needs root),
each role started with ``--role/--rank`` as a scheduler would, with mutual TLS and tokens from
``engine certs`` and the server named by DNS name. ``examples_per_s`` is computed as the launcher does
(``engine.programs.ctr.final``: examples of both workers / the longest worker's training time), and
``ratio_vs_loopback`` divides it by the same job on loopback (local launcher, plaintext), measured
right before it in the same run.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PORT = 7000


def available() -> tuple[bool, str]:
    """Whether test hosts can be made here (root, iproute2, a real namespace created and deleted)."""
    sys.path.insert(0, str(REPO))
    from tests.netns import netns_available
    return netns_available()


def run_hosts(config: str, sets: list[str], work: Path) -> tuple[dict, float]:
    """Run the job with ``sets`` across test hosts; returns (final line as the launcher would print it,
    wall seconds from the first process started to the last worker's exit)."""
    sys.path.insert(0, str(REPO))
    from engine.config import dump_config, load_config
    from engine.programs import ctr, load_program
    from engine.security import certs
    from tests.netns import TestHosts

    work.mkdir(parents=True, exist_ok=True)
    creds = work / "hosts-creds"
    certs.write_cluster_credentials(creds, ["server0"], force=True)
    sec = [f"security.tls.cert={creds / 'server.pem'}", f"security.tls.key={creds / 'server.key'}",
           f"security.tls.ca={creds / 'ca.pem'}", f"security.tls.client_cert={creds / 'client.pem'}",
           f"security.tls.client_key={creds / 'client.key'}", f"security.token_file={creds / 'token'}",
           f"security.admin_token_file={creds / 'admin_token'}"]
    cfg = load_config(REPO / config, [*sets, *sec])
    cfg = load_program(cfg.model.kind).prepare(cfg)
    path = work / "hosts.yaml"
    dump_config(cfg, path)
    engine = [sys.executable, "-m", "engine", "train", str(path)]
    with TestHosts(["server0", "worker0", "worker1"]) as hosts:
        hosts.env_overrides.update({"ENGINE_SERVERS": f"server0:{PORT}", "ENGINE_NUM_WORKERS": "2"})
        t0 = time.perf_counter()
        server = hosts.popen("server0", [*engine, "--role", "server", "--rank", "0", "--host", hosts.ip("server0"),
                                         "--port", str(PORT)], stdout=subprocess.DEVNULL,
                             stderr=open(work / "hosts-server0.log", "w"), cwd=REPO)
        workers = [hosts.popen(f"worker{w}", [*engine, "--role", "worker", "--rank", str(w), "--result-file",
                                              str(work / f"hosts-worker{w}.json")], stdout=subprocess.DEVNULL,
                               stderr=open(work / f"hosts-worker{w}.log", "w"), cwd=REPO) for w in range(2)]
        for w, p in enumerate(workers):
            if p.wait(timeout=3600) != 0:
                raise SystemExit(f"ctr_dnn_async_hosts: worker {w} failed:\n"
                                 + (work / f"hosts-worker{w}.log").read_text()[-3000:])
        wall = time.perf_counter() - t0
        stop = hosts.run("worker0", [sys.executable, "-m", "tests.netprobe", f"server0:{PORT}", str(creds),
                                     cfg.checkpoint.root or "/nonexistent", "--stop"], timeout=120)
        if stop.returncode != 0:
            print(f"# stopping the server failed: {stop.stderr[-500:]}", file=sys.stderr)
        server.wait(timeout=60)
    results = [json.loads((work / f"hosts-worker{w}.json").read_text()) for w in range(2)]
    return ctr.final(cfg, results), wall
