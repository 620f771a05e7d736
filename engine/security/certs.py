"""Everything a secured cluster needs in one directory: a private CA, server and client certificates,
and the worker and admin bearer tokens (``engine certs``).

Files written into ``out_dir`` (:data:`FILES`)::

    ca.pem, ca.key          self-signed CA (kept so that more certificates can be issued later)
    server.pem, server.key  SANs: the given hosts, localhost, 127.0.0.1; serverAuth + clientAuth
    client.pem, client.key  client certificate, CN engine-client, extendedKeyUsage clientAuth
    token, admin_token      ``secrets.token_urlsafe(32)`` + newline each

Keys are EC P-256 (grpcio's BoringSSL supports it), PEM PKCS8, unencrypted. Keys and tokens are mode
0600, certificates 0644, a directory this module creates 0700. Every file is written atomically (temp
file in the same directory, fsync, ``os.replace``): a process re-reading them during rotation
(:func:`renew`) sees the old or the new file, never a torn one. A key is replaced before its
certificate, so a reader may briefly see a new key with the old certificate; it should keep its current
credentials when a pair does not match and retry.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import re
import secrets
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..errors import ConfigError

CA_CERT, CA_KEY = "ca.pem", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
CLIENT_CERT, CLIENT_KEY = "client.pem", "client.key"
TOKEN, ADMIN_TOKEN = "token", "admin_token"
#: every file :func:`write_cluster_credentials` writes, in writing order
FILES = (CA_KEY, CA_CERT, SERVER_KEY, SERVER_CERT, CLIENT_KEY, CLIENT_CERT, TOKEN, ADMIN_TOKEN)
#: hosts every server certificate is valid for, whatever the user gives
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
CLIENT_CN = "engine-client"
MAX_DAYS = 36500
_SKEW = dt.timedelta(hours=1)            # not-before this far in the past: tolerates clock skew
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def write_secret_file(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, readable by the owner only (mode 0600).

    Parameters
    ----------
    path : str or os.PathLike
        Destination; its directory must exist. An existing file is replaced.
    data : bytes

    Raises
    ------
    OSError
        The directory is missing or not writable, or the disk is full; ``path`` is then unchanged.
    """
    _write_atomic(path, data, 0o600)


def _write_atomic(path, data: bytes, mode: int) -> str:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)                       # before any byte is written
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):            # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return str(path)


def parse_hosts(hosts) -> list[x509.GeneralName]:
    """The SubjectAlternativeName entries for ``hosts`` plus :data:`DEFAULT_HOSTS`, without duplicates.

    Parameters
    ----------
    hosts : str or iterable of str
        Host names or IP addresses; a string is split on commas. Entries are stripped and empty
        entries ignored; an IPv6 address may be written in brackets (``[::1]``); a DNS name may start
        with one wildcard label (``*.ps.default.svc``).

    Returns
    -------
    list of x509.DNSName or x509.IPAddress
        In the order given, the defaults last.

    Raises
    ------
    ConfigError
        An entry is neither an IP address nor a valid DNS name (the message names it).
    """
    hosts = hosts.split(",") if isinstance(hosts, str) else hosts
    out: list[x509.GeneralName] = []
    for entry in filter(None, (h.strip() for h in [*hosts, *DEFAULT_HOSTS])):
        if (name := _general_name(entry)) not in out:
            out.append(name)
    return out


def _general_name(entry: str) -> x509.GeneralName:
    unbracketed = entry[1:-1] if entry.startswith("[") and entry.endswith("]") else entry
    with contextlib.suppress(ValueError):
        return x509.IPAddress(ipaddress.ip_address(unbracketed))
    name = entry.removesuffix(".")
    labels = name.split(".")
    if labels[0] == "*" and len(labels) > 2:
        labels = labels[1:]
    if (not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels)
            or labels[-1].isdigit()):           # an all-digit last label: a mistyped IP (10.0.0.256)
        raise ConfigError(f"--hosts: {entry!r} is neither an IP address nor a valid DNS name")
    return x509.DNSName(name.lower())


def write_cluster_credentials(out_dir, hosts, *, days: int = 365, force: bool = False) -> dict[str, str]:
    """Create a CA, a server and a client certificate and the two tokens in ``out_dir``.

    Parameters
    ----------
    out_dir : str or os.PathLike
        Created (mode 0700, with its parents) when missing.
    hosts : str or iterable of str
        Names and addresses the servers are reached by (see :func:`parse_hosts`).
    days : int, days
        Validity of every certificate, from one hour ago (clock skew); 1 to :data:`MAX_DAYS`.
    force : bool
        Replace files that exist; without it an existing file is an error and nothing is written.

    Returns
    -------
    dict of str -> str
        File name (:data:`FILES`) -> absolute path, in writing order.

    Raises
    ------
    ConfigError
        A file exists (without ``force``), ``out_dir`` is a file, a host or ``days`` is invalid.
    OSError
        A file could not be written.
    """
    sans = parse_hosts(hosts)
    now, not_after = _validity(days)
    out = _prepare_dir(out_dir)
    if not force:
        for name in FILES:
            if (out / name).exists():
                raise ConfigError(f"{out / name} exists (use --force to overwrite it)")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "engine-ca")])
    ca_cert = _sign(ca_name, ca_name, ca_key.public_key(), ca_key, now, not_after,
                    (x509.BasicConstraints(ca=True, path_length=0), True), (_key_usage(cert_sign=True), True))
    written = {CA_KEY: _write_key(out / CA_KEY, ca_key), CA_CERT: _write_cert(out / CA_CERT, ca_cert)}
    return written | _issue_leaves(out, ca_cert, ca_key, sans, now, not_after) | _write_tokens(out)


def renew(out_dir, hosts, *, days: int = 365, tokens: bool = False) -> dict[str, str]:
    """Re-issue the server and client certificates (new keys) with the CA already in ``out_dir``.

    Certificate rotation: each file is replaced atomically, for servers and clients that re-read the
    files when they change. The CA stays, so peers holding the old certificates trust the new ones.

    Parameters
    ----------
    out_dir : str or os.PathLike
        A directory written by :func:`write_cluster_credentials` (at least ``ca.pem`` and ``ca.key``).
    hosts : str or iterable of str
        Names and addresses of the new server certificate (see :func:`parse_hosts`).
    days : int, days
        Validity of the new certificates; cut to the CA's own end of validity.
    tokens : bool
        Also write new ``token`` and ``admin_token`` files.

    Returns
    -------
    dict of str -> str
        File name -> absolute path of each file replaced.

    Raises
    ------
    ConfigError
        ``ca.pem``/``ca.key`` missing, unreadable, not a CA pair or expired; a host or ``days`` invalid.
    """
    sans = parse_hosts(hosts)
    now, not_after = _validity(days)
    out = Path(out_dir).absolute()
    ca_cert, ca_key = _load_ca(out)
    if ca_cert.not_valid_after_utc <= now + _SKEW:
        raise ConfigError(f"{out / CA_CERT} expired on {ca_cert.not_valid_after_utc:%Y-%m-%d}; create a "
                          f"new CA with `engine certs {out} --hosts ... --force`")
    not_after = min(not_after, ca_cert.not_valid_after_utc)
    written = _issue_leaves(out, ca_cert, ca_key, sans, now, not_after)
    return written | _write_tokens(out) if tokens else written


# ------------------------------------------------------------------------------------ helpers
def _validity(days) -> tuple[dt.datetime, dt.datetime]:
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_DAYS:
        raise ConfigError(f"--days must be an integer in [1, {MAX_DAYS}], got {days!r}")
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    return now, now + dt.timedelta(days=days)


def _prepare_dir(out_dir) -> Path:
    out = Path(out_dir).absolute()
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"{out} exists and is not a directory")
    else:
        out.mkdir(mode=0o700, parents=True)
        out.chmod(0o700)                          # mkdir's mode is subject to the umask
    return out


def _load_ca(out: Path):
    if missing := [n for n in (CA_CERT, CA_KEY) if not (out / n).is_file()]:
        raise ConfigError(f"{out / missing[0]} not found: --renew needs the CA of an earlier `engine certs`")
    try:
        ca_cert = x509.load_pem_x509_certificate((out / CA_CERT).read_bytes())
        ca_key = serialization.load_pem_private_key((out / CA_KEY).read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"cannot read the CA in {out}: {e}") from None
    if not any(isinstance(e.value, x509.BasicConstraints) and e.value.ca for e in ca_cert.extensions):
        raise ConfigError(f"{out / CA_CERT} is not a CA certificate (basicConstraints CA:false)")
    if ca_key.public_key() != ca_cert.public_key():
        raise ConfigError(f"{out / CA_KEY} is not the key of {out / CA_CERT}")
    return ca_cert, ca_key


def _sign(subject: x509.Name, issuer: x509.Name, public_key, signing_key, now, not_after, *extensions):
    """A certificate with a random serial, valid from ``now`` - 1 h, with a subject key identifier and
    ``extensions`` ((extension, critical) pairs)."""
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
         .serial_number(x509.random_serial_number()).not_valid_before(now - _SKEW).not_valid_after(not_after)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))
    for ext, critical in extensions:
        b = b.add_extension(ext, critical=critical)
    return b.sign(signing_key, hashes.SHA256())


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    """CA: keyCertSign + cRLSign; leaf: digitalSignature (ECDSA in the TLS handshake)."""
    off = dict.fromkeys(("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
                         "encipher_only", "decipher_only"), False)
    return x509.KeyUsage(digital_signature=not cert_sign, key_cert_sign=cert_sign, crl_sign=cert_sign, **off)


def _leaf(ca_cert, ca_key, cn: str, usages: list, sans: list, now, not_after):
    """A new key and its certificate signed by the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _sign(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]), ca_cert.subject, key.public_key(),
                 ca_key, now, not_after,
                 (x509.BasicConstraints(ca=False, path_length=None), True), (_key_usage(cert_sign=False), True),
                 (x509.ExtendedKeyUsage(usages), False), (x509.SubjectAlternativeName(sans), False),
                 (x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), False))
    return key, cert


def _issue_leaves(out: Path, ca_cert, ca_key, sans, now, not_after) -> dict[str, str]:
    server_key, server_cert = _leaf(ca_cert, ca_key, "engine-server",
                                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                                    sans, now, not_after)
    client_key, client_cert = _leaf(ca_cert, ca_key, CLIENT_CN, [ExtendedKeyUsageOID.CLIENT_AUTH],
                                    [x509.DNSName(CLIENT_CN)], now, not_after)
    return {SERVER_KEY: _write_key(out / SERVER_KEY, server_key),
            SERVER_CERT: _write_cert(out / SERVER_CERT, server_cert),
            CLIENT_KEY: _write_key(out / CLIENT_KEY, client_key),
            CLIENT_CERT: _write_cert(out / CLIENT_CERT, client_cert)}


def _write_key(path: Path, key) -> str:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return _write_atomic(path, pem, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> str:
    return _write_atomic(path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _write_tokens(out: Path) -> dict[str, str]:
    return {name: _write_atomic(out / name, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
            for name in (TOKEN, ADMIN_TOKEN)}
