"""Parameter-server benchmark. Prints one JSON object per measurement, each with a ``bench`` field.

1. ``pull`` / ``push``: 1 server process, 2 client processes, dim 16, batches of 100k unique keys
   (table pre-filled with ``--rows`` keys, adagrad). ``keys_per_s`` is the aggregate of both clients;
   ``ratio_vs_in_process`` compares it with the same operations on the same table in one process
   (one SparseTable with the server's config, 2 threads calling it, no RPC). The machine may be
   shared, so the two are measured alternately ``--repeats`` times (the clients wait at a barrier
   while the in-process run goes) and each side reports its best repeat; ``ratio_median`` is the
   median of the per-repeat ratios.
2. ``pull_latency``: 2 server processes, one client, p50 / p99 milliseconds of a CTR-sized pull
   (26 slots x 512 rows = 13,312 keys drawn from the filled key space).
``cpu_ms_per_batch`` (medians over repeats) splits the CPU one 100k-key batch costs: the server process,
both client processes, and the in-process reference; on 2 cores the ratio cannot beat
in_process / (server + clients). ``ratio_vs_in_process_transport`` is the same measurement against the
PS itself without gRPC (PSClient and PSServer over the in-process transport, 2 threads): what gRPC costs.
3. ``pull_transport_floor``: what gRPC alone allows. A bare gRPC server (no table, no codec) answers
   each 800 KB request (100k keys) with a prebuilt 6.4 MB reply (100k rows of dim 16), to 2 client
   processes that only call it: ``keys_per_s`` is the pull rate of a parameter server whose table and
   client cost nothing, and ``ratio_vs_in_process`` puts it against the same in-process figure as 1.

4. ``pull_tls`` / ``push_tls``: measurement 1 against a server with TLS (mutual, ECDSA P-256 from
   ``engine certs``) and bearer tokens checked by the interceptor, beside the same cluster in plaintext,
   alternating per repeat; ``ratio_vs_plaintext`` is the best TLS rate over the best plaintext rate
   (``ratio_median``: the median of the per-repeat ratios). ``--only tls`` runs just this part.

    python bench/ps_bench.py [--rounds 20] [--rows 1000000] [--repeats 3] [--only tls]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

DIM = 16
BATCH = 100_000
TABLE = {"dim": DIM, "optimizer": "adagrad", "learning_rate": 0.05, "initializer": "uniform"}


def cluster_config(servers: int):
    from engine.config import from_dict
    return from_dict({"cluster": {"servers": servers, "workers": 2}, "tables": {"sparse": {"emb": TABLE}}})


def batches(rows: int, rounds: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.choice(rows, BATCH, replace=False).astype(np.uint64) for _ in range(rounds)]


def fill(push, rows: int) -> None:
    keys = np.arange(rows, dtype=np.uint64)
    for s in range(0, rows, 200_000):
        k = keys[s:s + 200_000]
        push(k, np.full((len(k), DIM), 0.01, np.float32))


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (or of process ``pid``, all its threads)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_main(args) -> None:
    """One client process: per repeat and operation, wait at a barrier (with the other client and the
    bench process), time its batches, and meet again when done."""
    from engine.ps import PSClient
    if args.config:             # the cluster's config: TLS and the worker token (pull_tls, push_tls)
        from engine.config import load_config
        from engine.connect import connect
        c = connect(load_config(args.config), args.endpoints.split(","), name=f"bench{args.rank}", admin=False)
    else:
        c = PSClient(args.endpoints.split(","), name=f"bench{args.rank}")
    data = batches(args.rows, args.rounds, seed=100 + args.rank)
    grads = np.full((BATCH, DIM), 0.001, np.float32)
    c.pull("emb", data[0])                                   # warm-up
    c.push("emb", data[0][:1000], grads[:1000])
    out = []
    for rep in range(args.repeats):
        times = {}
        for op in ("pull", "push"):
            c.barrier(f"bench-{rep}-{op}", 3, timeout=600)
            t0, c0 = time.perf_counter(), cpu_seconds()
            for keys in data:
                c.pull("emb", keys) if op == "pull" else c.push("emb", keys, grads)
            times[op] = (t0, time.perf_counter(), cpu_seconds() - c0)
            c.barrier(f"bench-{rep}-{op}-done", 3, timeout=600)
        out.append(times)
    c.close()
    print(json.dumps(out))


class InProcess:
    """A reference in this process, 2 threads, no RPC. ``via="table"`` (the ratio of issue 3): one
    SparseTable with the server's table config. ``via="transport"``: PSClient over the in-process
    transport (no serialization) to a PSServer with the bench cluster's config, i.e. the same client
    (dedup, routing) and server (local shards) as the gRPC run minus gRPC."""

    def __init__(self, rows: int, rounds: int, via: str = "table"):
        if via == "table":
            from sparse_tables import SparseTable, TableConfig
            self.t = SparseTable(TableConfig(**TABLE))
        else:
            from engine.ps import InProcessTransport, PSClient, PSServer
            self.server = PSServer.from_config(cluster_config(1), 0)
            client = PSClient(InProcessTransport([self.server], serialize=False), name="bench-inproc")
            self.t = _ClientAsTable(client)
        fill(self.t.push, rows)
        self.data = [batches(rows, rounds, seed=100 + r) for r in range(2)]
        self.grads = np.full((BATCH, DIM), 0.001, np.float32)
        self.run("pull")                                     # warm-up (JIT, caches)

    def run(self, op: str) -> tuple[float, float]:
        """(keys/s, CPU ms per 100k keys) of both threads' batches."""
        t, grads = self.t, self.grads

        def work(r):
            for keys in self.data[r]:
                t.pull(keys) if op == "pull" else t.push(keys, grads)
        threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
        t0, c0 = time.perf_counter(), cpu_seconds()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        n = sum(len(d) for d in self.data)
        return n * BATCH / (time.perf_counter() - t0), 1e3 * (cpu_seconds() - c0) / n


class _ClientAsTable:
    def __init__(self, client):
        self.client = client

    def pull(self, keys):
        return self.client.pull("emb", keys)

    def push(self, keys, grads):
        self.client.push("emb", keys, grads)

    def close(self):
        self.client.close()


def throughput(args) -> float:
    """Measurements 1; returns the best in-process table pull rate (keys/s) for the floor."""
    from engine.launch.local import LocalCluster
    from engine.ps import PSClient
    ref = InProcess(args.rows, args.rounds)
    ref_ps = InProcess(args.rows, args.rounds, via="transport")
    with LocalCluster(cluster_config(1), tempfile.mkdtemp(prefix="ps-bench-")) as cl:
        eps = cl.start_servers()
        with PSClient(eps) as c:
            fill(lambda k, g: c.push("emb", k, g), args.rows)
            procs = [subprocess.Popen([sys.executable, __file__, "--client", "--rank", str(r), "--endpoints",
                                       ",".join(eps), "--rows", str(args.rows), "--rounds", str(args.rounds),
                                       "--repeats", str(args.repeats)],
                                      stdout=subprocess.PIPE, text=True) for r in range(2)]
            local = {"pull": [], "push": []}
            local_cpu = {"pull": [], "push": []}
            local_ps = {"pull": [], "push": []}
            local_ps_cpu = {"pull": [], "push": []}
            server_cpu = {"pull": [], "push": []}
            server_pid = cl.pids()[0]
            for rep in range(args.repeats):
                for op in ("pull", "push"):
                    kps, cpu = ref.run(op)
                    local[op].append(kps)
                    local_cpu[op].append(cpu)
                    kps, cpu = ref_ps.run(op)
                    local_ps[op].append(kps)
                    local_ps_cpu[op].append(cpu)
                    c.barrier(f"bench-{rep}-{op}", 3, timeout=600)       # clients run now
                    c0 = cpu_seconds(server_pid)
                    c.barrier(f"bench-{rep}-{op}-done", 3, timeout=600)
                    server_cpu[op].append(cpu_seconds(server_pid) - c0)
            outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        cl.stop_servers()
    ref.t.close()
    ref_ps.t.close()
    for op in ("pull", "push"):
        remote = []
        for rep in range(args.repeats):
            start = min(o[rep][op][0] for o in outs)
            end = max(o[rep][op][1] for o in outs)
            remote.append(2 * args.rounds * BATCH / (end - start))
        kps, ip = max(remote), max(local[op])
        batches_run = 2 * args.rounds
        server_ms = 1e3 * float(np.median(server_cpu[op])) / batches_run
        client_ms = 1e3 * float(np.median([sum(o[rep][op][2] for o in outs) for rep in range(args.repeats)])
                                ) / batches_run
        print(json.dumps({"bench": op, "servers": 1, "clients": 2, "dim": DIM, "batch_keys": BATCH,
                          "cpus_granted": len(os.sched_getaffinity(0)),     # engine plan scales by it
                          "rounds_per_client": args.rounds, "repeats": args.repeats, "keys_per_s": round(kps),
                          "in_process_keys_per_s": round(ip), "ratio_vs_in_process": round(kps / ip, 3),
                          "ratio_median": round(float(np.median(np.array(remote) / np.array(local[op]))), 3),
                          "in_process_transport_keys_per_s": round(max(local_ps[op])),
                          "ratio_vs_in_process_transport": round(kps / max(local_ps[op]), 3),
                          "cpu_ms_per_batch": {"server": round(server_ms, 2), "clients": round(client_ms, 2),
                                               "in_process": round(float(np.median(local_cpu[op])), 2),
                                               "in_process_transport": round(float(np.median(local_ps_cpu[op])),
                                                                             2)}}),
              flush=True)
    return max(local["pull"])


def latency(args) -> None:
    from engine.launch.local import LocalCluster
    from engine.ps import PSClient
    with LocalCluster(cluster_config(2), tempfile.mkdtemp(prefix="ps-bench-")) as cl:
        eps = cl.start_servers()
        with PSClient(eps) as c:
            fill(lambda k, g: c.push("emb", k, g), args.rows)
            rng = np.random.default_rng(7)
            samples = []
            for i in range(args.latency_pulls + 20):
                keys = rng.integers(0, args.rows, 26 * 512).astype(np.uint64)
                t0 = time.perf_counter()
                c.pull("emb", keys, init_missing=True)
                if i >= 20:
                    samples.append((time.perf_counter() - t0) * 1e3)
        cl.stop_servers()
    s = np.array(samples)
    print(json.dumps({"bench": "pull_latency", "servers": 2, "keys": 26 * 512, "dim": DIM,
                      "pulls": len(s), "p50_ms": round(float(np.percentile(s, 50)), 3),
                      "p99_ms": round(float(np.percentile(s, 99)), 3)}), flush=True)


def tls(args) -> None:
    """Measurement 4: the same client processes against a plaintext and a TLS + token server."""
    from engine.config import dump_config, from_dict
    from engine.connect import connect
    from engine.launch.local import LocalCluster
    from engine.security import certs
    tmp = tempfile.mkdtemp(prefix="ps-bench-tls-")
    files = certs.write_cluster_credentials(os.path.join(tmp, "creds"), ["localhost"])
    sec = {"tls": {"cert": files["server.pem"], "key": files["server.key"], "ca": files["ca.pem"],
                   "client_cert": files["client.pem"], "client_key": files["client.key"]},
           "token_file": files["token"], "admin_token_file": files["admin_token"]}
    base = {"cluster": {"servers": 1, "workers": 2}, "tables": {"sparse": {"emb": TABLE}}}
    variants = {"plaintext": from_dict(base), "tls": from_dict({**base, "security": sec})}
    clusters, clients, procs = {}, {}, {}
    try:
        for name, cfg in variants.items():
            cl = clusters[name] = LocalCluster(cfg, os.path.join(tmp, name))
            eps = cl.start_servers()
            dump_config(cfg, os.path.join(tmp, f"{name}.yaml"))
            c = clients[name] = connect(cfg, eps, name=f"bench-{name}", admin=True)
            fill(lambda k, g: c.push("emb", k, g), args.rows)
            procs[name] = [subprocess.Popen(
                [sys.executable, __file__, "--client", "--rank", str(r), "--endpoints", ",".join(eps), "--rows",
                 str(args.rows), "--rounds", str(args.rounds), "--repeats", str(args.repeats), "--config",
                 os.path.join(tmp, f"{name}.yaml")], stdout=subprocess.PIPE, text=True) for r in range(2)]
        for rep in range(args.repeats):
            for op in ("pull", "push"):
                order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
                for name in order:           # one cluster at a time; the other's clients wait
                    clients[name].barrier(f"bench-{rep}-{op}", 3, timeout=600)
                    clients[name].barrier(f"bench-{rep}-{op}-done", 3, timeout=600)
        outs = {n: [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in ps]
                for n, ps in procs.items()}
    finally:
        for name, cl in clusters.items():
            if name in clients:
                clients[name].close()
            cl.stop_servers()
            cl.shutdown()
    for op in ("pull", "push"):
        rate = {n: [2 * args.rounds * BATCH / (max(o[rep][op][1] for o in outs[n]) - min(o[rep][op][0] for o in outs[n]))
                    for rep in range(args.repeats)] for n in variants}
        print(json.dumps({"bench": f"{op}_tls", "servers": 1, "clients": 2, "dim": DIM, "batch_keys": BATCH,
                          "rounds_per_client": args.rounds, "repeats": args.repeats,
                          "tls": "mutual TLS 1.3, ECDSA P-256, bearer token checked per call",
                          "keys_per_s": round(max(rate["tls"])), "plaintext_keys_per_s": round(max(rate["plaintext"])),
                          "ratio_vs_plaintext": round(max(rate["tls"]) / max(rate["plaintext"]), 3),
                          "ratio_median": round(float(np.median(np.array(rate["tls"]) / np.array(rate["plaintext"]))), 3),
                          "cores": os.cpu_count()}), flush=True)


def echo_server_main(args) -> None:
    """The bare gRPC server of ``pull_transport_floor``: prints its port, serves until killed."""
    import grpc
    from concurrent.futures import ThreadPoolExecutor
    from engine.ps import _malloc, codec
    _malloc.tune()
    reply = np.random.default_rng(0).random((BATCH, DIM), np.float32).tobytes()
    opts = [("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES)]
    server = grpc.server(ThreadPoolExecutor(8), options=opts)
    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: reply, request_deserializer=None,
                                                  response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("Echo", {"Pull": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def echo_client_main(args) -> None:
    """One client of ``pull_transport_floor``: from a common start time, ``rounds`` calls."""
    import grpc
    from engine.ps import _malloc, codec
    _malloc.tune()
    ch = grpc.insecure_channel(args.endpoints, options=[("grpc.max_receive_message_length",
                                                         codec.MAX_MESSAGE_BYTES)])
    call = ch.unary_unary("/Echo/Pull")
    request = batches(args.rows, 1, seed=100 + args.rank)[0].tobytes()
    for _ in range(3):
        call(request)
    time.sleep(max(0.0, args.start_at - time.time()))
    t0, c0 = time.perf_counter(), cpu_seconds()
    for _ in range(args.rounds):
        assert len(call(request)) == BATCH * DIM * 4
    print(json.dumps([args.start_at, args.start_at + time.perf_counter() - t0, cpu_seconds() - c0]))


def transport_floor(args, in_process_keys_per_s: float) -> None:
    server = subprocess.Popen([sys.executable, __file__, "--echo-server"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        best, cpus = 0.0, []
        for _ in range(args.repeats):
            start_at = time.time() + 3.0
            s0 = cpu_seconds(server.pid)
            procs = [subprocess.Popen([sys.executable, __file__, "--echo-client", "--rank", str(r),
                                       "--endpoints", f"127.0.0.1:{port}", "--rows", str(args.rows),
                                       "--rounds", str(args.rounds), "--start-at", str(start_at)],
                                      stdout=subprocess.PIPE, text=True) for r in range(2)]
            spans = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
            best = max(best, 2 * args.rounds * BATCH / (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)))
            cpus.append((cpu_seconds(server.pid) - s0, sum(c for _, _, c in spans)))
    finally:
        server.kill()
        server.wait()
    print(json.dumps({"bench": "pull_transport_floor", "servers": 1, "clients": 2, "dim": DIM,
                      "batch_keys": BATCH, "reply_bytes": BATCH * DIM * 4, "keys_per_s": round(best),
                      "in_process_keys_per_s": round(in_process_keys_per_s),
                      "ratio_vs_in_process": round(best / in_process_keys_per_s, 3),
                      "cpu_ms_per_batch": {"server": round(1e3 * float(np.median([c[0] for c in cpus])) /
                                                           (2 * args.rounds), 2),
                                           "clients": round(1e3 * float(np.median([c[1] for c in cpus])) /
                                                            (2 * args.rounds), 2)}}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20, help="100k-key batches per client and operation")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the table")
    ap.add_argument("--latency-pulls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3, help="alternating gRPC / in-process measurements")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", default="", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="", help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=("tls",), default=None, help="run only this part")
    ap.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--echo-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.client or args.echo_client or args.echo_server:
        (client_main if args.client else echo_client_main if args.echo_client else echo_server_main)(args)
        return
    if args.only == "tls":
        tls(args)
        return
    in_process = throughput(args)
    latency(args)
    transport_floor(args, in_process)
    tls(args)


if __name__ == "__main__":
    main()
