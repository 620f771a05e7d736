"""``connect``: a PS client configured from an engine config (client settings, the servers' message
limit, TLS and tokens), for every role that talks to the servers: workers, the launcher, the
checkpoint coordinator."""
from __future__ import annotations

from .config import EngineConfig


def connect(cfg: EngineConfig, endpoints, *, name: str, admin: bool, **overrides):
    """A ``PSClient`` for ``endpoints`` with the config's client settings, message limit and security.
    ``admin``: this role holds the admin token (the launcher, the checkpoint coordinator: worker rank 0);
    the other workers never read it. ``overrides``: PSClient arguments that differ (``timeout_s``...).

    Raises
    ------
    ConfigError
        A security file or variable cannot be read (``engine.security.credentials``).
    """
    from .ps.client import PSClient
    from .security.credentials import client_security

    c = cfg.client
    kwargs = dict(timeout_s=c.timeout_s, retries=c.retries, backoff_s=c.backoff_s, max_backoff_s=c.max_backoff_s,
                  threads=c.threads, name=name, max_message_bytes=cfg.server.max_message_bytes,
                  dead_after_s=c.dead_after_s)
    kwargs.update(overrides)
    if not isinstance(endpoints, (list, tuple)):      # a Transport: it carries its own security
        return PSClient(endpoints, **kwargs)
    return PSClient(list(endpoints), security=client_security(cfg.security, admin=admin), **kwargs)
