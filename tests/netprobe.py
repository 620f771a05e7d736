"""Probes of a secured parameter server, run from a test host of its own (``test_multihost.py``)::

    python -m tests.netprobe ENDPOINTS CREDS_DIR CHECKPOINT_ROOT [--target I] [--stop]

Prints one JSON object: for each probe the gRPC status code and message it got (every probe must be
refused), and the rows of a fixed key set pulled from the whole cluster (ENDPOINTS, comma-separated)
with valid credentials before and after the probes (the test checks they are equal). The probes go to
server ``--target``. ``--stop`` instead only stops that server with the admin token.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np

from engine.errors import RemoteError
from engine.ps import PSClient, codec
from engine.ps import ps_pb2 as pb
from engine.ps.transport import GrpcTransport
from engine.security import certs
from engine.security.credentials import client_security
from engine.security.settings import SecurityConfig, TlsConfig

KEYS = np.arange(1, 4097, dtype=np.uint64) * np.uint64(2654435761)


def config(d: Path, **kw) -> SecurityConfig:
    tls = TlsConfig(ca=str(d / "ca.pem"), client_cert=str(d / "client.pem"), client_key=str(d / "client.key"))
    return SecurityConfig(**{"tls": tls, "token_file": str(d / "token"), "admin_token_file": str(d / "admin_token"),
                             **kw})


def outcome(fn) -> dict:
    try:
        fn()
    except RemoteError as e:
        return {"code": e.code, "message": e.message}
    return {"code": "OK", "message": ""}


def digest(eps: list[str], sec: SecurityConfig, table: str) -> str:
    with PSClient(eps, security=client_security(sec), timeout_s=20, retries=2) as c:
        rows = c.pull(table, KEYS, init_missing=False)
    return hashlib.sha256(rows.tobytes()).hexdigest()


def raw_call(ep: str, sec: SecurityConfig, method: str, request, admin: bool = False,
             max_message_bytes: int = codec.MAX_MESSAGE_BYTES):
    t = GrpcTransport([ep], retries=0, security=client_security(sec, admin=admin),
                      max_message_bytes=max_message_bytes)
    try:
        return t.call(0, method, request, 10.0)
    finally:
        t.close()


def send_garbage(host: str, port: int, payloads) -> None:
    """Each payload on a connection of its own, then read whatever comes back (at most 1 s)."""
    for data in payloads:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(data)
            s.settimeout(1.0)
            try:
                s.recv(4096)
            except OSError:
                pass


def garbage(ep: str) -> dict:
    host, port = ep.rsplit(":", 1)
    rng = np.random.default_rng(1)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    send_garbage(host, int(port), (rng.bytes(8192), preface + b"\x7f\xff\xff\x00\x00\x00\x00\x00\x01" + rng.bytes(512),
                                   b"\x16\x03\x01\xff\xff" + rng.bytes(100), b"\x16\x03"))
    return {"code": "SENT", "message": "random bytes, a truncated TLS record, an HTTP/2 frame of length 2^24-1"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoints")
    ap.add_argument("creds", type=Path)
    ap.add_argument("root")
    ap.add_argument("--table", default="embedding")
    ap.add_argument("--target", type=int, default=0)
    ap.add_argument("--stop", action="store_true", help="only stop server --target with the admin token")
    a = ap.parse_args()
    eps = a.endpoints.split(",")
    ep, d = eps[a.target], a.creds
    sec = config(d)
    if a.stop:
        print(json.dumps({"stop": outcome(lambda: raw_call(ep, sec, "Stop", pb.Empty(request_id="probe-admin-stop"),
                                                           admin=True))}))
        return 0
    other = d.parent / "other-ca"
    if not other.exists():
        certs.write_cluster_credentials(other, ["localhost"])
    os.environ["NETPROBE_WRONG"] = "wrong-token-" + "x" * 20
    ckpt = "20240101/0100-base"
    health = pb.Empty(request_id="probe-health")
    probes = {
        "no_token": lambda: raw_call(ep, SecurityConfig(tls=sec.tls), "Health", health),
        "wrong_token": lambda: raw_call(ep, SecurityConfig(tls=sec.tls, token_env="NETPROBE_WRONG"), "Health", health),
        "worker_token_stop": lambda: raw_call(ep, sec, "Stop", pb.Empty(request_id="probe-stop")),
        "plaintext": lambda: GrpcTransport([ep], retries=0).call(0, "Health", health, 10.0),
        "foreign_client_cert": lambda: raw_call(ep, SecurityConfig(
            tls=TlsConfig(ca=str(d / "ca.pem"), client_cert=str(other / "client.pem"),
                          client_key=str(other / "client.key")), token_file=str(d / "token")), "Health", health),
        "save_dotdot": lambda: raw_call(ep, sec, "Save", pb.PathRequest(
            request_id="p1", path=f"{a.root}/../escape/{ckpt}"), admin=True),
        "save_absolute": lambda: raw_call(ep, sec, "Save", pb.PathRequest(
            request_id="p2", path=f"{a.root}-elsewhere/job/{ckpt}"), admin=True),
        "save_s3": lambda: raw_call(ep, sec, "Save", pb.PathRequest(
            request_id="p3", path=f"s3://attacker-bucket/job/{ckpt}"), admin=True),
        "load_dotdot": lambda: raw_call(ep, sec, "Load", pb.PathRequest(
            request_id="p4", path=f"{a.root}/../escape/{ckpt}"), admin=True),
        "load_absolute": lambda: raw_call(ep, sec, "Load", pb.PathRequest(
            request_id="p5", path=f"{a.root}-elsewhere/job/{ckpt}"), admin=True),
        "load_s3": lambda: raw_call(ep, sec, "Load", pb.PathRequest(
            request_id="p6", path=f"s3://attacker-bucket/job/{ckpt}"), admin=True),
        "over_size_limit": lambda: raw_call(ep, sec, "Pull", codec.Wire(
            pb.PullRequest(table=a.table, request_id="p7"), keys=np.arange(2_200_000, dtype=np.uint64)),
            max_message_bytes=64 << 20),          # 17.6 MB: over the server's 16 MiB, not the client's
        "garbage": lambda: garbage(ep),
    }
    before = digest(eps, sec, a.table)
    results = {}
    for name, probe in probes.items():
        results[name] = probe() if name == "garbage" else outcome(probe)
    after = digest(eps, sec, a.table)
    out = {"probes": results, "before": before, "after": after,
           "elsewhere_exists": os.path.exists(a.root + "-elsewhere")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
