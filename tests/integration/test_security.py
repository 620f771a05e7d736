"""Security of the PS service on loopback, against real gRPC servers with real TLS: tokens, the admin
token, mutual TLS, path confinement, Shrink's clock, message limits, garbage on the port, rotation
under traffic and the listener rule. The same probes across network namespaces are in
``test_multihost.py``."""
from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509

from engine.config import DenseTableConfig
from engine.errors import AccessDeniedError, MessageTooLargeError, RemoteError
from engine.ps import PSClient, PSServer, codec, serve
from engine.ps import ps_pb2 as pb
from engine.ps.transport import GrpcTransport
from engine.security import certs
from engine.security.credentials import client_security, server_security
from engine.security.settings import SecurityConfig, TlsConfig
from sparse_tables import TableConfig
from tests.netprobe import send_garbage
from tests.waiting import until

REPO = Path(__file__).resolve().parents[2]
DIM = 4
KEYS = np.arange(1, 201, dtype=np.uint64)


def security(d: Path, **kw) -> SecurityConfig:
    tls = TlsConfig(cert=str(d / "server.pem"), key=str(d / "server.key"), ca=str(d / "ca.pem"),
                    client_cert=str(d / "client.pem"), client_key=str(d / "client.key"))
    base = dict(tls=tls, token_file=str(d / "token"), admin_token_file=str(d / "admin_token"),
                reload_interval_s=0.1, token_overlap_s=3.0)
    return SecurityConfig(**{**base, **kw})


@pytest.fixture
def secured(tmp_path):
    """A TLS + token server on 127.0.0.1 (checkpoint root tmp/ckpt, 4 MiB message limit) with 200
    trained rows; yields (dir of credentials, SecurityConfig, endpoint, core)."""
    d = tmp_path / "creds"
    certs.write_cluster_credentials(d, ["localhost"])
    sec = security(d)
    core = PSServer({"emb": TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, expire_after=10.0)},
                    {"d": DenseTableConfig(optimizer="sgd")}, local_shards=2,
                    checkpoint_root=str(tmp_path / "ckpt"), max_message_bytes=4 << 20)
    server, port = serve(core, "127.0.0.1", 0, threads=4, security=server_security(sec))
    ep = f"127.0.0.1:{port}"
    with PSClient([ep], security=client_security(sec, admin=True), max_message_bytes=4 << 20) as c:
        c.push("emb", KEYS, np.ones((len(KEYS), DIM), np.float32))
        c.init_dense("d", np.zeros(10, np.float32))
    try:
        yield d, sec, ep, core
    finally:
        server.stop(0).wait()
        core.close()


def client(ep, sec, admin=False, **kw) -> PSClient:
    return PSClient([ep], security=client_security(sec, admin=admin), timeout_s=10, retries=0, **kw)


def raw(ep, sec, admin=False) -> GrpcTransport:
    return GrpcTransport([ep], retries=0, security=client_security(sec, admin=admin))


def code_of(fn) -> str:
    with pytest.raises(RemoteError) as ei:
        fn()
    return ei.value.code


def rows(ep, sec) -> np.ndarray:
    with client(ep, sec) as c:
        return c.pull("emb", KEYS)


def test_tokens_and_the_admin_token(secured, monkeypatch):
    d, sec, ep, core = secured
    before = rows(ep, sec)
    monkeypatch.setenv("WRONG_TOKEN", "not-the-token")
    no_token = SecurityConfig(tls=sec.tls)
    wrong = SecurityConfig(tls=sec.tls, token_env="WRONG_TOKEN")
    for cfg, why in ((no_token, "no bearer token"), (wrong, "a wrong bearer token")):
        with client(ep, cfg) as c, pytest.raises(AccessDeniedError) as ei:
            c.pull("emb", KEYS)
        assert ei.value.code == "UNAUTHENTICATED" and why in ei.value.message and "security.token_file" in ei.value.message
    t = raw(ep, sec, admin=False)
    for method, req in (("Stop", pb.Empty(request_id="p1")),
                        ("Save", pb.PathRequest(request_id="p2", path=str(Path(core.checkpoint_root) / "j/20240101/0100-base"))),
                        ("Load", pb.PathRequest(request_id="p3", path=str(Path(core.checkpoint_root) / "j/20240101/0100-base"))),
                        ("Shrink", pb.ShrinkRequest(request_id="p4")),
                        ("Clock", pb.ClockRequest(request_id="p5", advance_to=1.7e9))):
        with pytest.raises(RemoteError) as ei:
            t.call(0, method, req, 5.0)
        assert ei.value.code == "PERMISSION_DENIED" and f"{method}" in ei.value.message
        assert "needs the admin token" in ei.value.message
    assert json.loads(t.call(0, "Clock", pb.ClockRequest(request_id="p6"), 5.0).json) == {   # reading: allowed
        "expiry_clock": "wall", "data_time": None}
    with client(ep, sec) as c:
        with pytest.raises(AccessDeniedError, match="forced re-initialisation of table 'd' needs the admin token"):
            c.init_dense("d", np.ones(10, np.float32), force=True)
        assert c.init_dense("d", np.ones(10, np.float32)) is False     # already set; not forced: allowed
        np.testing.assert_array_equal(c.pull_dense("d"), np.zeros(10, np.float32))
        generation = c.health()[0]["generation"]
        with pytest.raises(AccessDeniedError, match="emptying every table .clear. needs the admin token"):
            c.fence([generation], "a worker may not empty the tables", clear=True)
        assert c.health()[0]["generation"] == generation                 # refused before the handler
    with client(ep, sec, admin=True) as c:                           # the coordinator may
        assert c.init_dense("d", np.ones(10, np.float32), force=True)
    t.close()
    assert not core.stopped.is_set()
    np.testing.assert_array_equal(rows(ep, sec), before)
    assert core.auth.denied["UNAUTHENTICATED"] >= 2 and core.auth.denied["PERMISSION_DENIED"] >= 6


def test_tls_refuses_plaintext_and_other_cas(secured, tmp_path):
    d, sec, ep, core = secured
    plain = GrpcTransport([ep], retries=0)
    with pytest.raises(RemoteError) as ei:        # gRPC says only "Socket closed": the client says why
        plain.call(0, "Health", pb.Empty(request_id="h"), 3.0)
    assert ei.value.code == "UNAVAILABLE" and "may require TLS, and this client has none" in ei.value.message
    plain.close()
    other = tmp_path / "other"
    certs.write_cluster_credentials(other, ["localhost"])
    # a client certificate from another CA (the server's CA still trusted by the client)
    foreign = SecurityConfig(tls=TlsConfig(ca=str(d / "ca.pem"), client_cert=str(other / "client.pem"),
                                           client_key=str(other / "client.key")), token_file=str(d / "token"))
    t = raw(ep, foreign)
    with pytest.raises(RemoteError) as ei:
        t.call(0, "Health", pb.Empty(request_id="h"), 3.0)
    assert ei.value.code == "UNAVAILABLE" and "refuses this client's certificate" in ei.value.message
    t.close()
    # a server that the client's CA did not sign
    imposter = SecurityConfig(tls=TlsConfig(ca=str(other / "ca.pem"), client_cert=str(d / "client.pem"),
                                            client_key=str(d / "client.key")), token_file=str(d / "token"))
    t = raw(ep, imposter)
    assert code_of(lambda: t.call(0, "Health", pb.Empty(request_id="h"), 3.0)) == "UNAVAILABLE"
    t.close()
    assert rows(ep, sec).shape == (len(KEYS), DIM)


@pytest.mark.parametrize("path", ["{root}/../escape/20240101/0100-base", "{root}-elsewhere/j/20240101/0100-base",
                                  "s3://other-bucket/ckpt/j/20240101/0100-base", "{root}/./j/20240101/0100-base",
                                  "file://{root}/j/20240101/0100-base?x=1"])
def test_save_and_load_are_confined_to_the_checkpoint_root(secured, path):
    d, sec, ep, core = secured
    before = rows(ep, sec)
    uri = path.format(root=core.checkpoint_root)
    with client(ep, sec, admin=True) as c:
        for op in (c.save, c.load):
            with pytest.raises(AccessDeniedError) as ei:
                op(uri)
            assert ei.value.code == "PERMISSION_DENIED" and core.checkpoint_root in ei.value.message
    assert not os.path.exists(core.checkpoint_root + "-elsewhere")
    assert not (Path(core.checkpoint_root).parent / "escape").exists()
    np.testing.assert_array_equal(rows(ep, sec), before)


def test_shrink_takes_the_servers_clock_only(secured):
    d, sec, ep, core = secured
    t = raw(ep, sec, admin=True)
    with pytest.raises(RemoteError) as ei:
        t.call(0, "Shrink", pb.ShrinkRequest(request_id="s", has_now=True, now=1e12), 5.0)
    assert ei.value.code == "INVALID_ARGUMENT" and "server's own clock" in ei.value.message
    t.close()
    with client(ep, sec, admin=True) as c:
        assert c.shrink() == 0                 # rows seen just now do not expire at the server's clock
    assert rows(ep, sec).shape == (len(KEYS), DIM)


def test_message_limit_is_enforced_and_followed(secured):
    d, sec, ep, core = secured
    before = rows(ep, sec)
    t = raw(ep, sec)
    big = codec.Wire(pb.PullRequest(table="emb", request_id="big"), keys=np.arange(700_000, dtype=np.uint64))
    with pytest.raises(RemoteError) as ei:                            # 5.6 MB > the server's 4 MiB
        t.call(0, "Pull", big, 10.0)
    assert ei.value.code == "RESOURCE_EXHAUSTED"
    t.close()
    with client(ep, sec) as c:   # the client learned 4 MiB from Health and sends chunks that fit
        assert c.info()["max_message_bytes"] == 4 << 20
        many = np.arange(1, 400_001, dtype=np.uint64)
        assert c.pull("emb", many, init_missing=False).shape == (len(many), DIM)
    with PSClient([ep], security=client_security(sec), max_message_bytes=4 << 20, retries=0) as c:
        with pytest.raises(MessageTooLargeError, match="server.max_message_bytes"):   # named, not retried
            c._call(0, "Pull", big, idempotent=True)
    np.testing.assert_array_equal(rows(ep, sec), before)


def test_a_request_without_a_token_is_refused_before_it_is_received(secured):
    """The token check answers at the call's start and reads no message: a request larger than the
    server's limit, sent without a token, gets UNAUTHENTICATED. Before, the refusal's handler took the
    whole request first (gRPC read it to the limit, and RESOURCE_EXHAUSTED was the answer here), so
    anyone past TLS could make a server buffer up to max_message_bytes per concurrent call."""
    d, sec, ep, core = secured
    before = rows(ep, sec)
    t = GrpcTransport([ep], retries=0, security=client_security(SecurityConfig(tls=sec.tls)),
                      max_message_bytes=64 << 20)
    big = codec.Wire(pb.PushRequest(table="emb", request_id="big"), keys=np.arange(1_000_000, dtype=np.uint64))
    for _ in range(3):
        with pytest.raises(RemoteError) as ei:                        # 8 MB > the server's 4 MiB
            t.call(0, "Push", big, 10.0)
        assert ei.value.code == "UNAUTHENTICATED" and "no bearer token" in ei.value.message, ei.value
    t.close()
    assert core.auth.denied["UNAUTHENTICATED"] == 3
    np.testing.assert_array_equal(rows(ep, sec), before)


def test_garbage_on_the_port_leaves_the_server_serving(secured):
    d, sec, ep, core = secured
    before = rows(ep, sec)
    port = int(ep.rsplit(":", 1)[1])
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    rng = np.random.default_rng(0)
    payloads = [rng.bytes(4096), preface + b"\x00\x00", preface + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01" + b"x" * 100,
                b"\x16\x03\x01\xff\xff" + rng.bytes(64)]
    send_garbage("127.0.0.1", port, payloads)
    # and a plaintext server (HTTP/2 frames reach gRPC's parser directly)
    plain = PSServer({"emb": TableConfig(dim=DIM)}, local_shards=1)
    server, pport = serve(plain, "127.0.0.1", 0, threads=2)
    try:
        send_garbage("127.0.0.1", pport, payloads + [preface + b"\x7f\xff\xff\x00\x01\x00\x00\x00\x01" + rng.bytes(1000)])
        with PSClient([f"127.0.0.1:{pport}"], timeout_s=5, retries=0) as c:
            assert c.pull("emb", KEYS, init_missing=True).shape == (len(KEYS), DIM)
    finally:
        server.stop(0).wait()
        plain.close()
    np.testing.assert_array_equal(rows(ep, sec), before)


def _served_serial(port: int, d: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
    ctx.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, \
            ctx.wrap_socket(s, server_hostname="localhost") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def test_rotation_of_tokens_and_certificates_under_traffic(secured):
    d, sec, ep, core = secured
    port = int(ep.rsplit(":", 1)[1])
    old_token = (d / "token").read_text().strip()
    errors: list[BaseException] = []
    calls = [0]
    stop = threading.Event()

    def traffic() -> None:
        with client(ep, sec) as c:
            while not stop.is_set():
                try:
                    c.push("emb", KEYS[:10], np.zeros((10, DIM), np.float32))
                    c.pull("emb", KEYS)
                    calls[0] += 1
                except BaseException as e:  # noqa: BLE001 - the test reports every failure
                    errors.append(e)
                    return
    workers = [threading.Thread(target=traffic) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        time.sleep(0.5)
        first_serial = _served_serial(port, d)
        certs.renew(d, ["localhost"], tokens=True)        # new server/client certificates and tokens
        assert (d / "token").read_text().strip() != old_token
        deadline = time.monotonic() + 10
        while _served_serial(port, d) == first_serial and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _served_serial(port, d) == x509.load_pem_x509_certificate((d / "server.pem").read_bytes()).serial_number
        # past the old token's overlap, traffic goes on only if the clients re-read their token files
        time.sleep(sec.token_overlap_s + 0.5)
        n = calls[0]
        until(lambda: calls[0] > n or errors, "traffic after the rotation", timeout_s=20, every_s=0.05)
        assert calls[0] > n                                # traffic went on across the rotation
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert not errors, errors
    os.environ["ENGINE_TEST_OLD_TOKEN"] = old_token
    try:
        old = SecurityConfig(tls=sec.tls, token_env="ENGINE_TEST_OLD_TOKEN")
        time.sleep(sec.token_overlap_s + 0.5)              # the overlap has passed: the old token is refused
        with client(ep, old) as c, pytest.raises(AccessDeniedError, match="UNAUTHENTICATED"):
            c.pull("emb", KEYS)
    finally:
        del os.environ["ENGINE_TEST_OLD_TOKEN"]
    with client(ep, sec) as c:                              # a new client with the new files
        assert c.pull("emb", KEYS).shape == (len(KEYS), DIM)


def test_the_old_token_is_accepted_during_the_overlap(secured, monkeypatch):
    d, sec, ep, core = secured
    monkeypatch.setenv("OLD_TOKEN", (d / "token").read_text().strip())
    old = SecurityConfig(tls=sec.tls, token_env="OLD_TOKEN")
    with client(ep, old) as c:
        c.pull("emb", KEYS)
        certs.write_secret_file(d / "token", b"rotated-token-0123456789\n")
        time.sleep(0.3)                                    # past reload_interval_s, within the 3 s overlap
        with client(ep, sec) as new:
            new.pull("emb", KEYS)                          # the server re-read the file: new token works
        c.pull("emb", KEYS)                                # and the old one still does
        time.sleep(sec.token_overlap_s + 0.5)
        with pytest.raises(AccessDeniedError):
            c.pull("emb", KEYS)


def _train(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "train", str(REPO / "configs/ctr.yaml"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_a_server_refuses_to_listen_off_loopback_without_tls_and_tokens():
    for args in (["--role", "server", "--rank", "0", "--host", "0.0.0.0"], ["--set", "cluster.host=0.0.0.0"]):
        p = _train(*args)
        assert p.returncode == 2, p.stderr[-2000:]
        assert "refusing to listen on the non-loopback address '0.0.0.0'" in p.stderr
        assert "security.tls.cert and security.tls.key" in p.stderr and "security.insecure: true" in p.stderr
