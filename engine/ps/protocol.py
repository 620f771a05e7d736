"""The PS protocol version: every role of a job speaks the same one, or is refused when it connects.

A rolling upgrade (new servers, old workers, or the reverse) met fields the other side does not know:
proto3 reads a field its sender did not write as 0 or empty, and an old coordinator's delta, which
names no parent, was refused by a new server mid-job ("delta parent mismatch", after the first base),
while a new coordinator's parent check silently did nothing on an old server. So the version is checked
where the two sides meet:

* a client sends ``engine-protocol: <PROTOCOL_VERSION>`` in the metadata of every call
  (``transport.GrpcTransport``), and a server refuses any other request than ``Health``, ``Stats`` and
  ``Stop`` whose version is not its own (FAILED_PRECONDITION, applying nothing; ``grpc_service``);
  an engine from before this check sends none;
* a server's ``Health`` answer carries ``"protocol": PROTOCOL_VERSION``, and a client refuses a server
  whose answer has another version, or none, before its first data request (``PSClient.info``,
  ``PSClient.health``: ``ProtocolVersionError`` naming the server, its endpoint and both versions).

``Health`` and ``Stats`` stay open to every version (``engine status``, a launcher's liveness watch, an
old client's wait for the servers); ``Stop`` too (the admin token guards it).

Bump ``PROTOCOL_VERSION`` whenever a request or reply gains a field whose absence would be read
wrongly, a method changes meaning or a new method becomes necessary to a job. In-process transports
(tests, warm-up) run one version by construction and are not checked.

Versions: 1 is every engine before the check (2026-11-30; they send no version and their ``Health`` has
no ``protocol``); 2 adds it (the requests of ``ps.proto`` as of 2026-11-30: Fence, Clock, Save's
``parent``, Load's ``chain_end``, Shrink's ``generation``).
"""
from __future__ import annotations

from ..errors import ProtocolVersionError

__all__ = ["PROTOCOL_VERSION", "METADATA_KEY", "UNCHECKED", "metadata", "refusal", "check_servers"]

PROTOCOL_VERSION = 2
#: gRPC metadata key (lower case, as gRPC requires) of the sender's protocol version
METADATA_KEY = "engine-protocol"
#: methods every version may call: monitoring, and Stop
UNCHECKED = frozenset({"Health", "Stats", "Stop"})
_UPGRADE = ("every server and worker of a job must run the same engine version: stop the job at a "
            "checkpoint, upgrade every role, then start it again with --resume")


def metadata() -> tuple[str, str]:
    """The (key, value) a client adds to the metadata of every call."""
    return METADATA_KEY, str(PROTOCOL_VERSION)


def _named(version) -> str:
    return (f"protocol {version}" if version is not None
            else "no protocol version (an engine from before protocol versions: protocol 1)")


def refusal(method: str, invocation_metadata) -> str | None:
    """Why a server refuses a call (None: it does not).

    Parameters
    ----------
    method : str
        The called method (``Pull``, ...); ``UNCHECKED`` ones are never refused.
    invocation_metadata : iterable of (key, value)
        The call's metadata (``grpc.ServicerContext.invocation_metadata()``).
    """
    if method in UNCHECKED:
        return None
    sent = None
    for key, value in invocation_metadata or ():
        if key == METADATA_KEY:
            sent = value
            break
    if sent == str(PROTOCOL_VERSION):
        return None
    return (f"protocol version mismatch: the client speaks {_named(sent)}, this server speaks protocol "
            f"{PROTOCOL_VERSION}; {method} refused, nothing was applied: {_UPGRADE}")


def check_servers(healths: list[dict], endpoints: list[str]) -> None:
    """Refuse servers of another protocol version (``Health`` answers, one per server in rank order).

    Raises
    ------
    engine.errors.ProtocolVersionError
        Naming the first such server, its endpoint, its version (or that it has none) and this one's.
    """
    for s, h in enumerate(healths):
        theirs = h.get("protocol")
        if theirs != PROTOCOL_VERSION:
            ep = endpoints[s] if s < len(endpoints) else "?"
            raise ProtocolVersionError(f"protocol version mismatch: server {s} ({ep}) speaks {_named(theirs)}, this "
                                f"client speaks protocol {PROTOCOL_VERSION}: {_UPGRADE}")
