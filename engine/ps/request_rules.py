"""Rules about what a request may carry that the server and its clients share: which requests need the
admin token (``admin_reason``), how long a request id may be (``MAX_REQUEST_ID_CHARS``) and how a
client's string is cut when an error echoes it (``clip``). A push's arrays: ``codec.push_arrays``."""
from __future__ import annotations

from . import ps_pb2 as pb

__all__ = ["MAX_REQUEST_ID_CHARS", "admin_reason", "clip"]


#: the longest request id a server accepts (``{name}@{incarnation}:{seq}``: a few dozen characters)
MAX_REQUEST_ID_CHARS = 256


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (saying how long it was): a client's string echoed in an error
    message or kept for ``Health``. A 20 KB request id echoed whole made the error's metadata too large
    (RESOURCE_EXHAUSTED, which clients retry as an overload)."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def admin_reason(method: str, req) -> str | None:
    """Why a request of a method outside ``ADMIN_METHODS`` still needs the admin token, or None: the one
    rule both sides use (the server's ``AuthInterceptor`` refuses it with the worker token, the client's
    transport sends the admin token with it). ``req``: the message (a ``codec.Wire``'s or a parsed one)."""
    if getattr(req, "error", None) is not None:
        return None
    if method == "Fence":
        return "Fence: emptying every table (clear)" if req.clear else None
    if method == "Clock":       # it decides which rows the next expiry pass deletes, as Shrink does
        return "Clock: moving the data clock" if req.advance_to else None
    if method != "Dense":
        return None
    if req.op == pb.DENSE_INIT and req.force:
        return f"Dense: a forced re-initialisation of table {clip(req.table)!r}"
    if req.op == pb.DENSE_STATE_SET:
        return f"Dense: setting the optimizer state of table {clip(req.table)!r}"
    return None
