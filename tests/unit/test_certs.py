"""``engine certs`` / ``engine.security.certs``: the files and their modes, a chain that verifies, the
SANs, refusing to overwrite, renewal with the same CA, and a real mutual-TLS gRPC call."""
from __future__ import annotations

import ipaddress
import stat
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification as xv
from cryptography.x509.oid import ExtendedKeyUsageOID

from engine.cli import main
from engine.cli.certs import security_yaml
from engine.errors import ConfigError
from engine.security import certs

SECRET = ("ca.key", "server.key", "client.key", "token", "admin_token")


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    return cert.issuer == ca.subject


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    out = tmp_path_factory.mktemp("c") / "creds"
    written = certs.write_cluster_credentials(out, "ps-0.example.com, 10.1.2.3,,*.ps.default.svc,::1")
    return out, written


def test_files_and_modes(creds):
    out, written = creds
    assert list(written) == list(certs.FILES)
    assert written == {n: str(out / n) for n in certs.FILES}
    assert _mode(out) == 0o700
    for name in certs.FILES:
        assert _mode(out / name) == (0o600 if name in SECRET else 0o644), name
    for name in ("token", "admin_token"):
        text = (out / name).read_text()
        assert text.endswith("\n") and len(text.strip()) >= 43 and "\n" not in text.strip()
    assert (out / "token").read_text() != (out / "admin_token").read_text()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert b"BEGIN PRIVATE KEY" in (out / "server.key").read_bytes()         # PKCS8, unencrypted


def test_chain_sans_and_usages(creds):
    out, _ = creds
    ca, server, client = (_cert(out / n) for n in ("ca.pem", "server.pem", "client.pem"))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    assert _signed_by(ca, ca) and _signed_by(server, ca) and _signed_by(client, ca)
    assert isinstance(server.public_key().curve, ec.SECP256R1)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["ps-0.example.com", "*.ps.default.svc", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(a)
                                                       for a in ("10.1.2.3", "::1", "127.0.0.1")]
    eku = lambda c: list(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert eku(server) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert eku(client) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert client.subject.rfc4514_string() == "CN=engine-client"
    assert server.not_valid_before_utc < ca.not_valid_after_utc
    assert 364 < (server.not_valid_after_utc - server.not_valid_before_utc).days <= 366
    assert server.serial_number != client.serial_number
    # an RFC 5280 path validator accepts both leaves for their purpose
    policy = xv.PolicyBuilder().store(xv.Store([ca]))
    policy.build_server_verifier(xv.DNSName("ps-0.example.com")).verify(server, [])
    policy.build_server_verifier(xv.IPAddress(ipaddress.ip_address("10.1.2.3"))).verify(server, [])
    policy.build_client_verifier().verify(client, [])


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["certs", str(out), "--hosts", "ps-0"]) == 0
    stdout = capsys.readouterr().out
    assert f"token_file: {out / 'token'}" in stdout and f"ca: {out / 'ca.pem'}" in stdout
    assert "kubectl create secret generic engine-security" in stdout
    before = (out / "ca.pem").read_bytes()
    assert main(["certs", str(out), "--hosts", "ps-0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine certs: ") and "ca.key" in err and "--force" in err
    assert (out / "ca.pem").read_bytes() == before
    assert main(["certs", str(out), "--hosts", "ps-0", "--force"]) == 0
    assert (out / "ca.pem").read_bytes() != before


@pytest.mark.parametrize("host", ["bad_name", "-x.example", "10.0.0.256", "a..b", "x" * 64 + ".com", "*"])
def test_invalid_host(tmp_path, capsys, host):
    assert main(["certs", str(tmp_path / "c"), "--hosts", f"ok.example,{host}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine certs: ") and repr(host) in err
    assert not (tmp_path / "c").exists()


def test_bad_days_and_flags(tmp_path, capsys):
    assert main(["certs", str(tmp_path / "c"), "--hosts", "h", "--days", "0"]) == 2
    assert "--days" in capsys.readouterr().err
    assert main(["certs", str(tmp_path / "c"), "--hosts", "h", "--tokens"]) == 2
    assert "--renew" in capsys.readouterr().err


def test_renew_keeps_ca(tmp_path, capsys):
    out = tmp_path / "c"
    with pytest.raises(ConfigError, match="ca.pem not found"):
        certs.renew(out, "h")
    first = certs.write_cluster_credentials(out, "ps-0")
    ca, server = (out / "ca.pem").read_bytes(), _cert(out / "server.pem")
    token = (out / "token").read_text()
    assert main(["certs", str(out), "--hosts", "ps-0,ps-1", "--renew", "--days", "30"]) == 0
    assert "renewed:" in capsys.readouterr().out
    assert (out / "ca.pem").read_bytes() == ca and (out / "token").read_text() == token
    new = _cert(out / "server.pem")
    assert new.serial_number != server.serial_number and _signed_by(new, _cert(out / "ca.pem"))
    assert "ps-1" in new.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
        .get_values_for_type(x509.DNSName)
    assert (new.not_valid_after_utc - new.not_valid_before_utc).days <= 31
    written = certs.renew(out, ["ps-0"], tokens=True)
    assert set(written) == set(certs.FILES) - {"ca.pem", "ca.key"} and set(first) >= set(written)
    assert (out / "token").read_text() != token and _mode(out / "token") == 0o600
    assert (out / "ca.pem").read_bytes() == ca


@pytest.mark.parametrize("name", ["plain", "a dir: {x, y}", 'q"uo\\te'])
def test_security_yaml_parses(tmp_path, name):
    out = tmp_path / name
    sec = yaml.safe_load(security_yaml(out))["security"]
    assert sec == {"tls": {"cert": str(out / "server.pem"), "key": str(out / "server.key"),
                           "ca": str(out / "ca.pem"), "client_cert": str(out / "client.pem"),
                           "client_key": str(out / "client.key")},
                   "token_file": str(out / "token"), "admin_token_file": str(out / "admin_token")}


def test_write_secret_file(tmp_path):
    p = tmp_path / "s"
    p.write_bytes(b"old")
    p.chmod(0o644)
    certs.write_secret_file(p, b"new")
    assert p.read_bytes() == b"new" and _mode(p) == 0o600
    assert [f.name for f in tmp_path.iterdir()] == ["s"]


def test_mutual_tls_grpc(creds):
    out, _ = creds
    read = lambda n: (out / n).read_bytes()
    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})])
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(read("server.key"), read("server.pem"))], root_certificates=read("ca.pem"),
        require_client_auth=True))
    assert port
    server.start()
    try:
        good = grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))
        with grpc.secure_channel(f"127.0.0.1:{port}", good) as ch:
            assert ch.unary_unary("/t.T/Echo")(b"ping", timeout=5) == b"ping"
        # a DNS SAN of the certificate is accepted as the server's name too
        with grpc.secure_channel(f"127.0.0.1:{port}", good,
                                 options=[("grpc.ssl_target_name_override", "ps-0.example.com")]) as ch:
            assert ch.unary_unary("/t.T/Echo")(b"dns", timeout=5) == b"dns"
        no_cert = grpc.ssl_channel_credentials(read("ca.pem"))
        with grpc.secure_channel(f"127.0.0.1:{port}", no_cert) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/t.T/Echo")(b"ping", timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def _reissue(out, *, start_days_ago: float, lasts_days: float) -> None:
    """Re-issue ``out``'s server and client certificates with the given validity (same CA)."""
    import datetime as dt
    ca_cert, ca_key = certs._load_ca(out)
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=start_days_ago)
    certs._issue_leaves(out, ca_cert, ca_key, certs.parse_hosts(["localhost"]), start,
                        start + dt.timedelta(days=lasts_days))


def test_an_expired_or_not_yet_valid_certificate_is_refused_at_load_naming_it(tmp_path, caplog):
    """A role that loads an expired certificate refuses to start naming it, where before it started and
    every handshake failed with "certificate has expired" at the peer ("Socket closed" for a client's
    certificate), retried until the client gave up. A rotation that brings one keeps the previous
    files; one that ends within two weeks is a warning."""
    import os
    from engine.security.credentials import client_security, server_security
    from engine.security.settings import SecurityConfig, TlsConfig
    out = tmp_path / "c"
    certs.write_cluster_credentials(out, ["localhost"])
    tls = TlsConfig(cert=str(out / "server.pem"), key=str(out / "server.key"), ca=str(out / "ca.pem"),
                    client_cert=str(out / "client.pem"), client_key=str(out / "client.key"))
    cfg = SecurityConfig(tls=tls, reload_interval_s=0.01)
    server = server_security(cfg)                      # valid: loads
    _reissue(out, start_days_ago=10, lasts_days=2)     # expired 8 days ago
    for load in (server_security, client_security):
        with pytest.raises(ConfigError, match=r"security.tls certificate: the certificate \(CN=.*\) expired on "
                                              r"\d{4}-\d\d-\d\d \d\d:\d\d UTC: renew it"):
            load(cfg)
    before = server.tls.value["cert"]
    os.utime(out / "server.pem", ns=(1, 1))            # a change the watcher sees at once
    assert server.tls.refresh(force=True) is False and server.tls.value["cert"] == before
    assert "cannot be used yet" in caplog.text and "expired on" in caplog.text
    _reissue(out, start_days_ago=-2, lasts_days=30)    # valid from the day after tomorrow
    with pytest.raises(ConfigError, match=r"is not valid before .* \(this host's clock: .* UTC, 4[78]\.\d h "
                                          r"before it\): set this host's clock right \(NTP\)"):
        server_security(cfg)
    caplog.clear()
    _reissue(out, start_days_ago=1, lasts_days=4)      # valid, ends in 3 days
    server_security(cfg)
    assert "expires on" in caplog.text and "in 3.0 days" in caplog.text
