"""Typed errors raised by the models package.

Both are ``ValueError`` subclasses, so callers that only care about "bad value" can catch
``ValueError``; the engine catches the specific type to name the failing part.
"""
from __future__ import annotations


class ModelConfigError(ValueError):
    """A model was constructed with a bad hyper-parameter (``hidden``, ``dim``, ...).

    The message names the argument: ``"dim: expected an int > 0, got 0"``.
    """


class ModelInputError(ValueError):
    """An array passed to ``forward_backward``/``predict``/an optimizer has the wrong shape, dtype
    or values.

    The message names the argument: ``"emb: expected float32[u, 11], got float64[7, 11]"``.
    """
