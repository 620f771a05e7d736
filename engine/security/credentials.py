"""Credentials of one role, read from the ``security`` section and re-read when their files change.

* ``Secret``: a token from a file (re-read when the file's inode, size or mtime changes, checked at
  most every ``reload_interval_s``) or from an environment variable (fixed for the process's life).
* ``ServerTokens``: what a server accepts: the worker token and the admin token, each with the value it
  replaced for ``token_overlap_s`` after a change, compared in constant time (``hmac.compare_digest``).
* ``ServerSecurity``: a server's TLS credentials (``grpc.dynamic_ssl_server_credentials``, whose fetcher
  gRPC calls before every new handshake: a renewed certificate takes effect without a restart) and its
  tokens.
* ``ClientSecurity``: a client's channel credentials (rebuilt when the files change; ``version`` tells
  the transport to open new channels) and the bearer token it sends: the admin token on admin methods
  when this role holds it (the launcher and the checkpoint coordinator, worker rank 0), else the worker
  token.

A rotation never half-applies: a certificate whose key does not match it (the files caught between two
renames) is ignored until both match, and an empty or missing token file keeps the previous token
(both logged).
"""
from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass

import grpc

from ..errors import ConfigError
from .settings import SecurityConfig

__all__ = ["Secret", "ServerTokens", "ServerSecurity", "ClientSecurity", "server_security", "client_security",
           "holds_admin_token", "withheld_vars", "ADMIN", "WORKER"]

log = logging.getLogger(__name__)

ADMIN, WORKER = "admin", "worker"


def _stamp(path: str):
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


_warned_open: set[str] = set()


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            if (key == "key" or key.endswith("token_file")) and path not in _warned_open \
                    and os.fstat(f.fileno()).st_mode & 0o004:
                _warned_open.add(path)     # once per file: a watcher reads it again at every change
                log.warning("%s: %s is readable by every user of this machine (mode %o): a secret; "
                            "chmod o-r it (engine certs writes 0600)", "security.tls key" if key == "key" else
                            key, path, os.fstat(f.fileno()).st_mode & 0o777)
            return f.read()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path!r}: {e.strerror or e}") from None


class _Watched:
    """Files re-read together when any of them changes (checked at most every ``interval_s`` seconds).
    ``load(contents) -> value`` turns the files' bytes into the value, or raises ValueError to keep the
    previous one (a rotation caught half-way)."""

    def __init__(self, paths: dict[str, str], load, interval_s: float):
        self.paths, self._load, self.interval_s = paths, load, interval_s
        self._lock = threading.Lock()
        self._next = 0.0
        self.version = 0
        self._stamps = self._stamps_now()
        self.value = load({k: _read(p, k) for k, p in paths.items()})

    def _stamps_now(self):
        try:
            return tuple(_stamp(p) for p in self.paths.values())
        except OSError:
            return None

    def refresh(self, force: bool = False) -> bool:
        """Re-read the files if they changed; True when the value changed."""
        now = time.monotonic()
        if not force and now < self._next:
            return False
        with self._lock:
            self._next = now + self.interval_s
            stamps = self._stamps_now()
            if stamps is None or stamps == self._stamps:
                return False
            try:
                value = self._load({k: _read(p, k) for k, p in self.paths.items()})
            except (ConfigError, ValueError) as e:
                log.warning("security: %s changed but cannot be used yet (%s); keeping the previous one",
                            ", ".join(self.paths.values()), e)
                return False
            self._stamps, self.value = stamps, value
            self.version += 1
            log.info("security: re-read %s", ", ".join(self.paths.values()))
            return True


def _token(contents: dict) -> bytes:
    (key, raw), = contents.items()
    token = raw.strip()
    if not token:
        raise ValueError(f"{key}: the file is empty")
    if any(c < 0x21 or c > 0x7e for c in token):
        raise ValueError(f"{key}: a token must be printable ASCII without spaces")
    return token


class Secret:
    """A bearer token from ``path`` (re-read when it changes) or the environment variable ``env``.

    Raises
    ------
    ConfigError
        (at construction) the file cannot be read or is empty, or the variable is unset or empty; the
        message names the config key ``key``.
    """

    def __init__(self, key: str, *, path: str = "", env: str = "", interval_s: float = 5.0):
        self.key = key
        self._file = None
        if path:
            try:
                self._file = _Watched({f"{key}_file": path}, _token, interval_s)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            self._fixed = b""
        else:
            value = os.environ.get(env, "").strip()
            if not value:
                raise ConfigError(f"{key}_env names the environment variable {env!r}, which is not set "
                                  f"(or empty) in this process")
            self._fixed = value.encode()

    def value(self) -> bytes:
        """The token, after re-reading the file if it changed (at most every ``interval_s``)."""
        if self._file is None:
            return self._fixed
        self._file.refresh()
        return self._file.value

    def current(self) -> bytes:
        """The token as last read (no check of the file)."""
        return self._fixed if self._file is None else self._file.value

    def refresh(self, force: bool = False) -> tuple[bytes, bytes] | None:
        """(old, new) when the file changed, else None."""
        if self._file is None:
            return None
        old = self._file.value
        return (old, self._file.value) if self._file.refresh(force) else None


class ServerTokens:
    """The tokens a server accepts. ``role(token)``: ``ADMIN``, ``WORKER`` or None.

    After a token file changes, the value it replaced is still accepted for ``overlap_s`` seconds, so
    clients that have not re-read their copy yet keep working. Without an admin token the worker token
    also grants admin methods (a single-secret cluster on loopback; ``engine.security.listen`` refuses it
    off loopback)."""

    def __init__(self, worker: Secret, admin: Secret | None, overlap_s: float):
        self.secrets = {WORKER: worker, ADMIN: admin}
        self.overlap_s = overlap_s
        self._old: dict[str, tuple[bytes, float]] = {}
        self._forced_at = 0.0

    def _accepted(self, kind: str) -> list[bytes]:
        secret = self.secrets[kind]
        if secret is None:
            return []
        changed = secret.refresh()
        if changed:
            self._old[kind] = (changed[0], time.monotonic() + self.overlap_s)
        out = [secret.current()]
        old = self._old.get(kind)
        if old is not None and time.monotonic() < old[1]:
            out.append(old[0])
        return out

    def role(self, token: bytes | None) -> str | None:
        """``ADMIN``, ``WORKER`` or None (missing or wrong). Every accepted value is compared, each in
        constant time. A token that matches none makes the files be re-read at once (at most once a
        second), so a client that saw a rotation first is not refused."""
        if not token:
            return None
        for attempt in (0, 1):
            admin = any(hmac.compare_digest(token, t) for t in self._accepted(ADMIN))
            worker = any(hmac.compare_digest(token, t) for t in self._accepted(WORKER))
            if admin or (worker and self.secrets[ADMIN] is None):
                return ADMIN
            if worker:
                return WORKER
            now = time.monotonic()
            if attempt or now - self._forced_at < 1.0:
                return None
            self._forced_at = now
            for kind, secret in self.secrets.items():
                if secret is not None and (changed := secret.refresh(force=True)):
                    self._old[kind] = (changed[0], now + self.overlap_s)
        return None


def _key_matches(cert_pem: bytes, key_pem: bytes, what: str) -> None:
    """Raises ValueError when the private key is not the certificate's (a rotation caught half-way)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what}: not a PEM certificate and unencrypted private key: {e}") from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if (cert.public_key().public_bytes(serialization.Encoding.DER, pub)
            != key.public_key().public_bytes(serialization.Encoding.DER, pub)):
        raise ValueError(f"{what}: the key does not belong to the certificate")


def _tls_files(cfg: SecurityConfig, *, server: bool) -> dict[str, str]:
    """The PEM files a role reads: its certificate and key (a client's own pair, else the server's)
    and the CA."""
    t = cfg.tls
    cert, key = (t.client_cert, t.client_key) if not server and t.client_cert else (t.cert, t.key)
    files = {"cert": cert, "key": key} if cert else {}
    if t.ca:
        files["ca"] = t.ca
    return files


@dataclass
class ServerSecurity:
    """A server's credentials: ``tls`` (None: plaintext) and ``tokens`` (None: no token check)."""

    tls: _Watched | None
    tokens: ServerTokens | None

    def credentials(self) -> grpc.ServerCredentials | None:
        """gRPC server credentials that re-read the certificate files before a new handshake when they
        changed; with a CA the client must present a certificate it signed."""
        if self.tls is None:
            return None
        watched = self.tls

        def config(files: dict) -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration([(files["key"], files["cert"])],
                                                             root_certificates=files.get("ca"))
        seen = [watched.version]

        def fetch():
            watched.refresh()
            if watched.version == seen[0]:
                return None
            seen[0] = watched.version
            return config(watched.value)
        return grpc.dynamic_ssl_server_credentials(config(watched.value), fetch,
                                                   require_client_authentication="ca" in watched.paths)


class ClientSecurity:
    """A client's credentials. ``channel_credentials()`` (None: plaintext), ``version`` (changes when
    the certificate files do: open new channels), ``metadata(admin)`` (the bearer token header)."""

    def __init__(self, tls: _Watched | None, token: Secret | None, admin: Secret | None, *, insecure: bool = False):
        self._tls, self._token, self._admin = tls, token, admin
        self.insecure = insecure

    def check_endpoints(self, endpoints) -> None:
        """Refuse to send a bearer token in plaintext off loopback: the rule of ``check_listen`` on the
        client's side. Servers off loopback need TLS unless ``security.insecure``; a client whose config
        has tokens but no TLS sent them in clear to whatever answered at the address.

        Parameters
        ----------
        endpoints : list of str
            ``host:port`` (``[v6]:port``).

        Raises
        ------
        ConfigError
            Tokens, no TLS, ``security.insecure`` false, and an endpoint that is not loopback (named).
        """
        if self._tls is not None or self._token is None or self.insecure:
            return
        from .listen import is_loopback
        for ep in endpoints:
            if not is_loopback(ep.rsplit(":", 1)[0]):      # host:port, [v6]:port
                raise ConfigError(f"refusing to send the bearer token (security.token_file/token_env) in plaintext "
                                  f"to {ep}, which is not loopback: set security.tls (security.tls.ca to verify "
                                  f"the servers by) or, on a network you trust, security.insecure: true")

    @property
    def tls(self) -> bool:
        return self._tls is not None

    @property
    def version(self) -> int:
        if self._tls is None:
            return 0
        self._tls.refresh()
        return self._tls.version

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self._tls is None:
            return None
        f = self._tls.value
        return grpc.ssl_channel_credentials(root_certificates=f.get("ca"), private_key=f.get("key"),
                                            certificate_chain=f.get("cert"))

    def metadata(self, admin: bool = False) -> tuple | None:
        """``(("authorization", "Bearer <token>"),)``: the admin token for admin methods when this role
        holds it, else the worker token; None without tokens."""
        secret = self._admin if admin and self._admin is not None else self._token
        if secret is None:
            return None
        return (("authorization", "Bearer " + secret.value().decode()),)


#: a certificate that expires sooner than this is logged as a warning at every (re)load (seconds)
EXPIRY_WARNING_S = 14 * 86400


def _check_validity(pem: bytes, what: str, *, now=None) -> None:
    """Raise ValueError unless a certificate of ``pem`` (one, or a CA bundle: any of them) is valid at
    ``now`` (UTC; default the clock): an expired or not-yet-valid certificate fails every handshake with
    a bare "certificate has expired" at the peer, or "Socket closed" for a client's. Logs a warning when
    the one that lasts longest ends within ``EXPIRY_WARNING_S``."""
    import datetime as dt

    from cryptography import x509
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError as e:
        raise ValueError(f"{what}: not a PEM certificate: {e}") from None
    now = now or dt.datetime.now(dt.timezone.utc)
    valid = [c for c in certs if c.not_valid_before_utc <= now < c.not_valid_after_utc]
    if not valid:
        c = max(certs, key=lambda c: c.not_valid_after_utc)
        if now >= c.not_valid_after_utc:
            raise ValueError(f"{what}: the certificate ({c.subject.rfc4514_string()}) expired on "
                             f"{c.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: renew it (engine certs OUT --hosts ... "
                             f"--renew)")
        c = min(certs, key=lambda c: c.not_valid_before_utc)
        behind = (c.not_valid_before_utc - now).total_seconds()
        # engine certs starts certificates an hour before it runs: a host further behind than that is
        # almost always a wrong clock here (a VM resumed, no NTP), which renewing does not mend
        raise ValueError(f"{what}: the certificate ({c.subject.rfc4514_string()}) is not valid before "
                         f"{c.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (this host's clock: {now:%Y-%m-%d %H:%M} "
                         f"UTC, {behind / 3600:.1f} h before it): set this host's clock right (NTP); `engine "
                         f"certs` starts certificates 1 h before it runs, so only a host whose clock is more than "
                         f"that behind the one that ran it refuses them")
    end = max(c.not_valid_after_utc for c in valid)
    if (end - now).total_seconds() < EXPIRY_WARNING_S:
        log.warning("%s: the certificate expires on %s UTC, in %.1f days: renew it (engine certs OUT --hosts "
                    "... --renew)",
                    what, f"{end:%Y-%m-%d %H:%M}", (end - now).total_seconds() / 86400)


def _load_tls(contents: dict) -> dict:
    """Check TLS files read together: the key is the certificate's, and the certificate and the CA are
    valid now (a rotation that brings an expired one keeps the previous files: ``_Watched``)."""
    if "cert" in contents:
        _key_matches(contents["cert"], contents["key"], "security.tls")
        _check_validity(contents["cert"], "security.tls certificate")
    if "ca" in contents:
        _check_validity(contents["ca"], "security.tls.ca")
    return contents


def holds_admin_token(role: str, rank: int) -> bool:
    """Whether the process of ``role`` (``server``/``worker``) and ``rank`` needs the admin token: every
    server (it tells admin calls from others) and worker rank 0 (the checkpoint coordinator: saves,
    restores, the roll-back's ``Fence`` with ``clear``, the hybrid mode's dense state). The launcher,
    which starts them, holds it too. A worker of another rank never reads it (``connect(admin=False)``),
    so a launcher gives it no admin token variable (``withheld_vars``)."""
    return role == "server" or (role == "worker" and rank == 0)


def withheld_vars(cfg: SecurityConfig, role: str, rank: int) -> tuple[str, ...]:
    """The environment variables a launcher takes out of the environment of ``role``'s process ``rank``:
    the one ``security.admin_token_env`` names, unless that process holds the admin token
    (``holds_admin_token``); else none. Least privilege: with the token, any worker could stop every
    server or load another checkpoint into them. With ``admin_token_file`` there is nothing to take out
    (the file's mode and owner guard it; ``engine k8s`` mounts it where only Kubernetes decides)."""
    name = cfg.admin_token_env
    return (name,) if name and not holds_admin_token(role, rank) else ()


def _secret(cfg: SecurityConfig, kind: str) -> Secret | None:
    path, env = getattr(cfg, f"{kind}_file"), getattr(cfg, f"{kind}_env")
    if not (path or env):
        return None
    return Secret(f"security.{kind}", path=path, env=env, interval_s=cfg.reload_interval_s)


def _watched_tls(files: dict, interval_s: float, *, tls_on: bool = False) -> _Watched | None:
    if not files:
        return _Watched({}, lambda contents: {}, interval_s) if tls_on else None
    try:
        return _Watched(files, _load_tls, interval_s)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def server_security(cfg: SecurityConfig) -> ServerSecurity:
    """A server's credentials from ``cfg``.

    Raises
    ------
    ConfigError
        A file cannot be read, a key does not match its certificate, a certificate is expired or not yet
        valid, TLS without a server certificate (``security.tls.cert``), a token variable is unset, or
        the admin token is the worker token; the message names the key.
    """
    if cfg.tls.enabled and not cfg.tls.cert:
        raise ConfigError("security.tls: a server needs security.tls.cert and security.tls.key")
    tls = _watched_tls(_tls_files(cfg, server=True), cfg.reload_interval_s)
    token, admin = _secret(cfg, "token"), _secret(cfg, "admin_token")
    if token is not None and admin is not None and hmac.compare_digest(token.value(), admin.value()):
        raise ConfigError("security.admin_token_file/admin_token_env holds the same token as security.token_file/"
                          "token_env: every worker would be an admin (save, load, shrink, stop); give the admin "
                          "a token of its own (engine certs writes both)")
    tokens = ServerTokens(token, admin, cfg.token_overlap_s) if token else None
    return ServerSecurity(tls, tokens)


def client_security(cfg: SecurityConfig, *, admin: bool = False) -> ClientSecurity:
    """A client's credentials; ``admin``: this role holds the admin token (the launcher, worker rank 0).
    Other roles never read the admin token's file or variable, so it need not exist where they run.

    Without ``security.tls.ca`` a client verifies the servers against the system's trusted roots (a
    publicly signed server certificate).

    Raises
    ------
    ConfigError
        As ``server_security``.
    """
    tls = _watched_tls(_tls_files(cfg, server=False), cfg.reload_interval_s, tls_on=cfg.tls.enabled)
    return ClientSecurity(tls, _secret(cfg, "token"), _secret(cfg, "admin_token") if admin else None,
                          insecure=cfg.insecure)
