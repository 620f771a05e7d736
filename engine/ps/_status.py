"""How a failed PS call surfaces: the gRPC status code of a ``RemoteError`` mapped to the engine's typed
errors (``PSClient`` raises them; see ``engine.errors``)."""
from __future__ import annotations

from ..errors import (
    AccessDeniedError,
    CheckpointStorageError,
    DeltaParentError,
    GenerationChangedError,
    MessageTooLargeError,
    PSTimeoutError,
    RemoteError,
    RequestRejectedError,
    RestoreMismatchError,
    ShardUnavailableError,
)
from . import codec

_REJECTED = {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ALREADY_EXISTS", "OUT_OF_RANGE",
             "UNIMPLEMENTED"}
_DENIED = {"UNAUTHENTICATED", "PERMISSION_DENIED"}


def too_large(details: str) -> bool:
    """gRPC's own RESOURCE_EXHAUSTED for a message over a size limit ("Sent/Received message larger
    than max (N vs. M)"), as opposed to an overloaded server (retried)."""
    return "larger than max" in details


def too_large_error(e: RemoteError, method: str, server: int) -> MessageTooLargeError:
    side = "request" if "Sent" in e.message else "message"
    return MessageTooLargeError(e.code, f"{method} to server {server}: the {side} is over a gRPC message "
                                f"size limit (gRPC: {e.message}); the limit is the max_message_bytes of "
                                f"both ends (the servers' server.max_message_bytes, default "
                                f"{codec.MAX_MESSAGE_BYTES} bytes); not retried", e.endpoint)


def typed(e: RemoteError, attempts: int) -> RemoteError:
    if e.code == "ABORTED" and "generation mismatch" in e.message:
        return GenerationChangedError(e.code, e.message, e.endpoint)
    if e.code == "FAILED_PRECONDITION" and DeltaParentError.MARKER in e.message:
        return DeltaParentError(e.code, e.message, e.endpoint)
    if e.code == "FAILED_PRECONDITION" and RestoreMismatchError.MARKER in e.message:
        return RestoreMismatchError(e.code, e.message, e.endpoint)
    if e.code == "FAILED_PRECONDITION" and CheckpointStorageError.MARKER in e.message:
        return CheckpointStorageError(e.code, e.message, e.endpoint)
    if e.code in _DENIED:
        return AccessDeniedError(e.code, e.message, e.endpoint)
    if e.code in _REJECTED:
        return RequestRejectedError(e.code, e.message, e.endpoint)
    if e.code == "UNAVAILABLE":
        return ShardUnavailableError(e.code, f"{e.message} (after {attempts + 1} attempts)", e.endpoint)
    if e.code == "DEADLINE_EXCEEDED":
        return PSTimeoutError(e.code, e.message, e.endpoint)
    return e
