"""Path confinement of admin operations: a server saves and loads only below ``checkpoint.root``.

A client names the checkpoint directory of a ``Save`` or ``Load``; the server uses it only when it lies
strictly below the configured root, with the root's scheme and the root's bucket or namenode (so the
server never writes with its storage credentials to a place the client chose), no ``.`` or ``..``
component, no query or fragment (which could carry storage options), and, for local paths, no symbolic
link that leads out of the root.
"""
from __future__ import annotations

import os
import posixpath
from urllib.parse import urlsplit

__all__ = ["OutsideRootError", "confine"]


class OutsideRootError(PermissionError):
    """A client-given location is not below the checkpoint root; the message names the root."""


def _split(uri: str) -> tuple[str, str, str, str, str]:
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or len(scheme) == 1:       # local path (a drive letter is no scheme)
        path = parts.path if scheme == "file" else uri
        return "file", parts.netloc if scheme == "file" else "", path, parts.query if scheme else "", \
            parts.fragment if scheme else ""
    return scheme, parts.netloc, parts.path, parts.query, parts.fragment


def confine(uri: str, root: str | None) -> str:
    """``uri`` when it names a location strictly below ``root``, else raise.

    Parameters
    ----------
    uri : str
        What the client sent (a checkpoint directory: ``s3://b/ckpt/job/20240101/0100-base``, ``/abs``).
    root : str or None
        ``checkpoint.root`` of the server's config; None: unconfined (an in-process server built by a
        library user); "": nothing is allowed.

    Raises
    ------
    OutsideRootError
        The location is outside the root, uses ``..``, another scheme, bucket or namenode, a query, or
        (local) leaves the root through a symbolic link; or ``root`` is empty.
    """
    if root is None:
        return uri
    if not root:
        raise OutsideRootError("this server saves and loads nothing: its checkpoint.root is empty")
    where = f"checkpoint.root {root!r}"
    if not isinstance(uri, str) or not uri or "\x00" in uri or "\\" in uri:
        raise OutsideRootError(f"{uri!r} is not a location below {where}")
    scheme, netloc, path, query, fragment = _split(uri)
    r_scheme, r_netloc, r_path, _, _ = _split(root)
    if query or fragment:
        raise OutsideRootError(f"{uri!r}: a location with a query or fragment is refused; only paths below "
                               f"{where} are allowed")
    if (scheme, netloc.lower()) != (r_scheme, r_netloc.lower()):
        raise OutsideRootError(f"{uri!r} is not below {where}: another scheme, bucket or namenode")
    if any(c in (".", "..") for c in path.split("/")):
        raise OutsideRootError(f"{uri!r}: '.' and '..' are refused; only paths below {where} are allowed")
    if scheme == "file":
        base = os.path.realpath(os.path.abspath(r_path))
        full = os.path.realpath(os.path.abspath(os.path.expanduser(path) if path.startswith("~") else path))
        if not full.startswith(base.rstrip("/") + "/"):
            raise OutsideRootError(f"{uri!r} is not below {where}")
        return uri
    base = "/" + r_path.strip("/")
    full = posixpath.normpath("/" + path.strip("/"))
    if not full.startswith(base.rstrip("/") + "/"):
        raise OutsideRootError(f"{uri!r} is not below {where}")
    return uri
