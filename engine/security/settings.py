"""The ``security`` config section, read by every role (servers, workers, the launcher)::

    security:
      tls:                        # server certificate and key; with ca: mutual TLS
        cert: /etc/engine/server.pem
        key: /etc/engine/server.key
        ca: /etc/engine/ca.pem    # servers require client certificates signed by it; clients verify
        client_cert: /etc/engine/client.pem   # a client's own certificate (default: cert / key)
        client_key: /etc/engine/client.key
      token_file: /etc/engine/token            # or token_env: NAME of an environment variable
      admin_token_file: /etc/engine/admin_token  # or admin_token_env; Save, Load, Shrink, Stop, forced init
      token_overlap_s: 300        # after a token file changes, the old token is accepted this long
      reload_interval_s: 5        # how often certificate, key and token files are checked for changes
      insecure: false             # true: a server may listen off loopback without TLS and a token

``engine certs OUT --hosts a,b`` writes every file (``engine.security.certs``). Nothing is needed on
loopback; off loopback a server refuses to start without TLS and a token unless ``insecure: true``
(``engine.security.listen``).
"""
from __future__ import annotations

from dataclasses import field
from typing import Annotated

from pydantic import Field

from ..config_base import MAX_SECONDS, Nested, section
from ..errors import ConfigError

__all__ = ["TlsConfig", "SecurityConfig"]


@section
class TlsConfig:
    """Certificate files (PEM). ``cert``/``key``: the server's; ``ca``: the cluster's CA (with it the
    servers require client certificates it signed, and clients verify the servers by it);
    ``client_cert``/``client_key``: what a client presents (default: ``cert``/``key``)."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    client_cert: str = ""
    client_key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("security.tls: cert and key must be given together")
        if bool(self.client_cert) != bool(self.client_key):
            raise ConfigError("security.tls: client_cert and client_key must be given together")
        if self.client_cert and not self.ca:
            raise ConfigError("security.tls.client_cert: a client certificate needs security.tls.ca "
                              "(the servers' trust anchor)")

    @property
    def enabled(self) -> bool:
        """Whether TLS is on (a server certificate or a CA to verify servers by is given)."""
        return bool(self.cert or self.ca)


@section
class SecurityConfig:
    """See the module docstring. ``token_overlap_s`` and ``reload_interval_s`` are seconds."""

    tls: Annotated[TlsConfig, Nested] = field(default_factory=TlsConfig)
    token_env: str = ""
    token_file: str = ""
    admin_token_env: str = ""
    admin_token_file: str = ""
    token_overlap_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = 300.0
    reload_interval_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 5.0
    insecure: bool = False

    def __post_init__(self) -> None:
        for kind in ("token", "admin_token"):
            if getattr(self, f"{kind}_env") and getattr(self, f"{kind}_file"):
                raise ConfigError(f"security: give {kind}_env or {kind}_file, not both")
        if self.has_admin_token and not self.has_token:
            raise ConfigError("security.admin_token_*: an admin token needs a worker token too "
                              "(security.token_file or security.token_env)")

    @property
    def has_token(self) -> bool:
        return bool(self.token_env or self.token_file)

    @property
    def has_admin_token(self) -> bool:
        return bool(self.admin_token_env or self.admin_token_file)
