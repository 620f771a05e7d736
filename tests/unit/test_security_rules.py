"""The pure rules of ``engine.security``: path confinement, loopback detection, the listener rule and
the security config section."""
from __future__ import annotations

import pytest

from engine.errors import ConfigError
from engine.security.confine import OutsideRootError, confine
from engine.security.listen import check_listen, is_loopback
from engine.security.settings import SecurityConfig, TlsConfig

OK = [("s3://b/ckpt", "s3://b/ckpt/job/20240101/0100-base"), ("hdfs://nn:8020/ckpt", "hdfs://nn:8020/ckpt/j/x"),
      ("/data/ckpt", "/data/ckpt/j/20240101/0100-delta.2"), ("/data/ckpt", "file:///data/ckpt/j/x"),
      ("s3://b/ckpt/", "S3://b/ckpt/j")]
BAD = [("s3://b/ckpt", "s3://other/ckpt/j/x", "another scheme, bucket or namenode"),
       ("s3://b/ckpt", "s3://b/ckpt/../x/j", "'..'"), ("s3://b/ckpt", "s3://b/ckptx/j", "not below"),
       ("s3://b/ckpt", "s3://b/ckpt", "not below"), ("s3://b/ckpt", "hdfs://b/ckpt/j", "another scheme"),
       ("s3://b/ckpt", "s3://b/ckpt/j?endpoint_override=evil:9000", "query"),
       ("hdfs://nn:8020/ckpt", "hdfs://evil:8020/ckpt/j", "namenode"),
       ("/data/ckpt", "/data/other/j", "not below"), ("/data/ckpt", "/data/ckpt/./j", "'..'"),
       ("/data/ckpt", "s3://b/data/ckpt/j", "another scheme"), ("/data/ckpt", "/data/ckpt/j\x00", "not a location")]


@pytest.mark.parametrize("root,uri", OK)
def test_locations_below_the_root_pass(root, uri):
    assert confine(uri, root) == uri


@pytest.mark.parametrize("root,uri,why", BAD)
def test_locations_outside_the_root_are_refused_naming_it(root, uri, why):
    with pytest.raises(OutsideRootError) as ei:
        confine(uri, root)
    assert why in str(ei.value) and f"checkpoint.root {root!r}" in str(ei.value)


def test_an_empty_root_allows_nothing_and_none_everything(tmp_path):
    with pytest.raises(OutsideRootError, match="checkpoint.root is empty"):
        confine(str(tmp_path / "x"), "")
    assert confine("s3://any/where", None) == "s3://any/where"


def test_a_symlink_out_of_a_local_root_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(OutsideRootError):
        confine(str(tmp_path / "root" / "link" / "j"), str(tmp_path / "root"))
    assert confine(str(tmp_path / "root" / "j" / "x"), str(tmp_path / "root"))


@pytest.mark.parametrize("host,expected", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
                                           ("localhost", True), ("0.0.0.0", False), ("10.1.2.3", False),
                                           ("::", False), ("no-such-host.invalid", False)])
def test_loopback(host, expected):
    assert is_loopback(host) is expected


def test_the_listener_rule_names_what_is_missing(caplog):
    check_listen("127.0.0.1", SecurityConfig())                # loopback: nothing needed
    with pytest.raises(ConfigError) as ei:
        check_listen("10.0.0.1", SecurityConfig(token_file="t"))
    msg = str(ei.value)
    assert "security.tls.cert and security.tls.key" in msg and "security.admin_token_file" in msg
    assert "security.token_file" not in msg.split("without")[1].split(":")[0]
    secured = SecurityConfig(tls=TlsConfig(cert="c", key="k", ca="a"), token_file="t", admin_token_file="a")
    check_listen("10.0.0.1", secured)
    check_listen("0.0.0.0", SecurityConfig(insecure=True))
    assert "WITHOUT" in caplog.text and "security.insecure: true" in caplog.text


def test_the_section_checks_its_pairs():
    with pytest.raises(ConfigError, match="cert and key must be given together"):
        TlsConfig(cert="c")
    with pytest.raises(ConfigError, match="token_env or token_file, not both"):
        SecurityConfig(token_env="A", token_file="b")
    with pytest.raises(ConfigError, match="an admin token needs a worker token"):
        SecurityConfig(admin_token_file="a")


def test_a_client_never_sends_its_token_in_plaintext_off_loopback(tmp_path):
    """The listener rule on the client's side (``ClientSecurity.check_endpoints``, run by every
    ``GrpcTransport``): a config with tokens but no TLS sent them in clear to whatever answered at an
    address off loopback. Channels connect lazily, so nothing here reaches the network."""
    from engine.ps.transport import GrpcTransport
    from engine.security import certs
    from engine.security.credentials import client_security
    (tmp_path / "t").write_text("s3cret\n")
    tokens = SecurityConfig(token_file=str(tmp_path / "t"))
    for eps in (["127.0.0.1:5000", "[::1]:5001", "localhost:5002"], ["10.1.2.3:5000"]):
        GrpcTransport(eps, security=client_security(SecurityConfig(insecure=False))).close()   # no token
    GrpcTransport(["127.0.0.1:5000", "[::1]:5001"], security=client_security(tokens)).close()
    for ep in ("10.1.2.3:5000", "[2001:db8::1]:5000", "no-such-host.invalid:5000"):
        with pytest.raises(ConfigError) as ei:
            GrpcTransport(["127.0.0.1:5000", ep], security=client_security(tokens))
        assert f"refusing to send the bearer token (security.token_file/token_env) in plaintext to {ep}" \
            in str(ei.value) and "security.tls" in str(ei.value)
    insecure = SecurityConfig(token_file=str(tmp_path / "t"), insecure=True)
    GrpcTransport(["10.1.2.3:5000"], security=client_security(insecure)).close()
    certs.write_cluster_credentials(tmp_path / "c", ["localhost"])
    tls = SecurityConfig(tls=TlsConfig(ca=str(tmp_path / "c" / "ca.pem")), token_file=str(tmp_path / "t"))
    GrpcTransport(["10.1.2.3:5000"], security=client_security(tls)).close()


def test_an_admin_token_equal_to_the_worker_token_is_refused(tmp_path):
    """It was accepted silently, which made every worker an admin (save, load, shrink, stop)."""
    from engine.security.credentials import server_security
    (tmp_path / "t").write_text("same-token\n")
    (tmp_path / "a").write_text("same-token")
    with pytest.raises(ConfigError, match="holds the same token as security.token_file/token_env: every worker "
                                          "would be an admin"):
        server_security(SecurityConfig(token_file=str(tmp_path / "t"), admin_token_file=str(tmp_path / "a")))
    (tmp_path / "a").write_text("another-token")
    assert server_security(SecurityConfig(token_file=str(tmp_path / "t"),
                                          admin_token_file=str(tmp_path / "a"))).tokens is not None


def test_a_world_readable_token_or_key_is_a_warning(tmp_path, caplog):
    from engine.security import certs
    from engine.security.credentials import server_security
    certs.write_cluster_credentials(tmp_path / "c", ["localhost"])
    c = tmp_path / "c"
    cfg = SecurityConfig(tls=TlsConfig(cert=str(c / "server.pem"), key=str(c / "server.key")),
                         token_file=str(c / "token"), admin_token_file=str(c / "admin_token"))
    server_security(cfg)                              # engine certs' modes: 0600, nothing to say
    assert "readable by every user" not in caplog.text
    (c / "token").chmod(0o644)
    (c / "server.key").chmod(0o604)
    server_security(cfg)
    assert f"security.token_file: {c / 'token'} is readable by every user of this machine (mode 644)" in caplog.text
    assert f"security.tls key: {c / 'server.key'} is readable by every user" in caplog.text


def test_the_launcher_gives_the_admin_token_only_to_the_roles_that_hold_it(tmp_path, monkeypatch):
    """Least privilege: with ``security.admin_token_env`` the launcher passed its whole environment, the
    admin token included, to every worker, though only the servers (they check it) and worker rank 0
    (the checkpoint coordinator) use it; any worker could stop every server. Real child processes: the
    local launcher's, hybrid mode's MPI rank shims (run as hydra runs them, with ``PMI_RANK``) and Ray's
    role actors (their ``start``, outside Ray)."""
    import json
    import os
    import subprocess
    import sys

    from engine.config import from_dict
    from engine.launch.local import LocalCluster
    from engine.launch.mpi import rank_records
    from engine.security.credentials import holds_admin_token

    monkeypatch.setenv("ENGINE_TEST_TOKEN", "worker-token")
    monkeypatch.setenv("ENGINE_TEST_ADMIN_TOKEN", "admin-token")
    monkeypatch.chdir(tmp_path)
    fake = tmp_path / "fake-python"           # stands in for the interpreter: records its environment
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "a = sys.argv\nname = a[a.index('--role') + 1] + a[a.index('--rank') + 1]\n"
                    "open(name + '.env', 'w').write(json.dumps(dict(os.environ)))\n")
    fake.chmod(0o755)
    cfg = from_dict({"mode": "async", "cluster": {"servers": 1, "workers": 2},
                     "tables": {"sparse": {"emb": {"dim": 4}}, "dense": {"d": {"optimizer": "sgd"}}},
                     "model": {"kind": "logreg", "table": "emb", "dense_table": "d"},
                     "security": {"token_env": "ENGINE_TEST_TOKEN", "admin_token_env": "ENGINE_TEST_ADMIN_TOKEN"}})
    cluster = LocalCluster(cfg, tmp_path / "run", python=str(fake))

    def env_of(name: str) -> dict:
        return json.loads((tmp_path / f"{name}.env").read_text())

    for role, rank in (("server", 0), ("worker", 0), ("worker", 1)):
        assert cluster._spawn(role, rank, [], {}).proc.wait(timeout=60) == 0
        env = env_of(f"{role}{rank}")
        assert env["ENGINE_TEST_TOKEN"] == "worker-token", (role, rank)
        assert env.get("ENGINE_TEST_ADMIN_TOKEN") == ("admin-token" if holds_admin_token(role, rank) else None), \
            (role, rank)
    # hybrid: hydra passes mpiexec's environment (the admin token in it, for rank 0) to every rank's shim
    world = tmp_path / "world.json"
    world.write_text(json.dumps({"ranks": rank_records(cluster)}))
    mpiexec_env = cluster.child_env({})
    for rank in range(2):
        (tmp_path / f"worker{rank}.env").unlink()
        shim = subprocess.run([sys.executable, "-m", "engine.launch.mpi", str(world)], timeout=60,
                              env={**mpiexec_env, "PMI_RANK": str(rank)})
        assert shim.returncode == 0
        env = env_of(f"worker{rank}")
        assert env.get("ENGINE_TEST_ADMIN_TOKEN") == ("admin-token" if rank == 0 else None), rank
        assert env["ENGINE_TEST_TOKEN"] == "worker-token"
    # Ray: a role actor's process inherits the actor's environment (a local Ray's actors have the
    # driver's), less what the launcher withholds
    import shutil

    from engine.launch.ray import RoleActor
    monkeypatch.setattr(sys, "executable", str(fake))
    for rank in range(2):
        (tmp_path / f"worker{rank}.env").unlink()
        actor = RoleActor(f"worker{rank}")
        try:
            actor.start("{}", ["--role", "worker", "--rank", str(rank)], {}, [],
                        cluster.withheld_env("worker", rank))
            assert actor.proc.wait(timeout=60) == 0
        finally:
            shutil.rmtree(actor.dir, ignore_errors=True)
        assert env_of(f"worker{rank}").get("ENGINE_TEST_ADMIN_TOKEN") == ("admin-token" if rank == 0 else None)
    # the launcher itself keeps it (restores, the final checkpoint, Stop)
    assert os.environ["ENGINE_TEST_ADMIN_TOKEN"] == "admin-token"
