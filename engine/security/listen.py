"""The listener rule: a role listens off loopback only when secured, or when told it may be open.

Loopback (``127.0.0.0/8``, ``::1``, ``localhost``, or a name that resolves only to those) needs
nothing. Any other address (``0.0.0.0`` included) needs TLS (``security.tls.cert``/``key``), a worker
token and an admin token (``security.token_*``, ``security.admin_token_*``), unless
``security.insecure: true``, which is logged as a warning when the listener starts.
"""
from __future__ import annotations

import ipaddress
import logging
import socket

from ..errors import ConfigError
from .settings import SecurityConfig

__all__ = ["is_loopback", "check_listen"]

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) reaches only this machine's loopback interface. A name is
    resolved; one that does not resolve, or resolves to any other address, is not loopback."""
    h = host.strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_listen(host: str, security: SecurityConfig, *, what: str = "server", key: str = "cluster.host") -> None:
    """Allow a listener on ``host`` or raise.

    Raises
    ------
    ConfigError
        ``host`` is not loopback and TLS, the worker token or the admin token is missing while
        ``security.insecure`` is false; the message names the keys to set (exit code 2 at the CLI).
    """
    if is_loopback(host):
        return
    missing = []
    if not security.tls.cert:
        missing.append("security.tls.cert and security.tls.key")
    if not security.has_token:
        missing.append("security.token_file (or token_env)")
    if not security.has_admin_token:
        missing.append("security.admin_token_file (or admin_token_env)")
    if not missing:
        return
    if security.insecure:
        log.warning("%s listens on %s WITHOUT %s (security.insecure: true): anyone who reaches the port can "
                    "read and change the tables, stop the server and make it save or load checkpoints",
                    what, host, ", ".join(missing))
        return
    raise ConfigError(f"{what}: refusing to listen on the non-loopback address {host!r} ({key}) without "
                      f"{', '.join(missing)}: run 'engine certs OUT --hosts NAMES' and set them, or set "
                      f"security.insecure: true to accept an open port")
