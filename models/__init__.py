"""CTR-DNN, DeepFM and Word2Vec: forward, hand-written backward and predict over numpy arrays.

Models see arrays, never servers: the worker pulls the batch's unique keys as ``emb`` and passes a
sparse index (``rows``, ``segments``) describing where each key occurrence goes; see
:mod:`models._kernels` for the layout and :meth:`CTRModelBase.forward_backward` for the call.
"""
from __future__ import annotations

from typing import Any

from ._base import CTRModelBase, StepResult
from .ctr_dnn import CTRDNN
from .deepfm import DeepFM
from .errors import ModelConfigError, ModelInputError
from .optim import SGD, Adam

MODEL_KINDS: dict[str, type[CTRModelBase]] = {"ctr_dnn": CTRDNN, "deepfm": DeepFM}


def build_model(kind: str, **kwargs: Any) -> CTRModelBase:
    """Construct a CTR model by name.

    Parameters
    ----------
    kind : str
        ``"ctr_dnn"`` or ``"deepfm"``.
    **kwargs
        Constructor arguments (``num_slots``, ``dim``, ``dense_dim``, ``hidden``, ``seed``,
        ``dtype``).

    Returns
    -------
    CTRDNN or DeepFM

    Raises
    ------
    ModelConfigError
        On an unknown ``kind``, an unknown keyword or a bad value.
    """
    cls = MODEL_KINDS.get(kind)
    if cls is None:
        raise ModelConfigError(f"kind: expected one of {sorted(MODEL_KINDS)}, got {kind!r}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ModelConfigError(f"{kind}: {e}") from None


__all__ = ["CTRDNN", "DeepFM", "StepResult", "CTRModelBase", "build_model", "MODEL_KINDS",
           "Adam", "SGD", "ModelConfigError", "ModelInputError"]
