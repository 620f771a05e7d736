"""The dense part of CTR-DNN / DeepFM as an ONNX model (built with the ``onnx`` helper API).

The embedding lookup stays outside the graph (serving systems do it in their own key-value store from
the bundle's embedding files); the graph takes what comes after the sum pooling.

Inputs (``S`` = num_slots, ``w`` = sparse_width, ``D`` = dense_dim, ``B`` dynamic)::

    pooled : float32[B, S*w]   pooled[b, s*w + c] = sum over the keys k of example b in slot s of
                               row(k)[c]; slot order = model.json input.slots; an empty slot or an
                               unknown key contributes zeros. For CTR-DNN w = dim; for DeepFM
                               w = dim + 1 and column 0 of each slot block is the first-order weight
                               (``Bundle.pooled`` computes exactly this).
    dense  : float32[B, D]     dense features (absent when D = 0)

Output::

    prob   : float32[B]        click probability = sigmoid(logit)

Graph: CTR-DNN ``x = concat(pooled, dense) → (MatMul, Add, Relu)* → MatMul, Add → Sigmoid``; DeepFM
reshapes ``pooled`` to ``[B, S, w]``, sums column 0 over slots (first order), feeds columns 1..dim to
the same tower and to the FM term ``0.5 * sum_d((sum_s v)^2 - sum_s v^2)``, and adds
``dense @ linear.weight + linear.bias``.
"""
from __future__ import annotations

import numpy as np

from .errors import ExportError

__all__ = ["build_onnx", "export_onnx", "ONNX_FILE", "OPSET"]

ONNX_FILE = "model.onnx"
OPSET = 17


def build_onnx(model):
    """ONNX ``ModelProto`` of ``model``'s dense part with its current dense parameters.

    Parameters
    ----------
    model : models.CTRDNN or models.DeepFM

    Returns
    -------
    onnx.ModelProto
        Checked with ``onnx.checker``.

    Raises
    ------
    ExportError
        ``onnx`` is not installed, or the model kind is not supported.
    """
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        raise ExportError("--format onnx needs the onnx package: pip install onnx") from None
    S, w, D, dim = model.num_slots, model.sparse_width, model.dense_dim, model.dim
    p = {k: np.asarray(v, np.float32) for k, v in model.dense_views().items()}
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    inputs = [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["B", S * w])]
    if D:
        inputs.append(helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["B", D]))
    flat = const("shape_flat", np.array([-1], np.int64))
    if model.kind == "ctr_dnn":
        emb = "pooled"
    elif model.kind == "deepfm":
        p3 = node("Reshape", ["pooled", const("shape_bsw", np.array([-1, S, w], np.int64))], "pooled3")
        ax2 = const("axis2", np.array([2], np.int64))
        first = node("Slice", [p3, const("c0", np.array([0], np.int64)), const("c1", np.array([1], np.int64)),
                               ax2], "first")
        v = node("Slice", [p3, const("c1b", np.array([1], np.int64)), const("cw", np.array([w], np.int64)),
                           ax2], "v")
        emb = node("Reshape", [v, const("shape_bsd", np.array([-1, S * dim], np.int64))], "v_flat")
    else:
        raise ExportError(f"onnx export: model kind {model.kind!r} not supported (ctr_dnn, deepfm)")
    h = node("Concat", [emb, "dense"], "x0", axis=1) if D else emb
    for i in range(len(model.hidden)):
        h = node("MatMul", [h, const(f"fc{i}.weight", p[f"fc{i}.weight"])], f"fc{i}.mm")
        h = node("Add", [h, const(f"fc{i}.bias", p[f"fc{i}.bias"])], f"fc{i}.add")
        h = node("Relu", [h], f"fc{i}.relu")
    z = node("MatMul", [h, const("out.weight", p["out.weight"])], "out.mm")
    z = node("Add", [z, const("out.bias", p["out.bias"])], "out.add")
    logit = node("Reshape", [z, flat], "tower_logit")
    if model.kind == "deepfm":
        ax1 = const("axis1", np.array([1], np.int64))
        first_sum = node("ReduceSum", [first, const("axes12", np.array([1, 2], np.int64))], "first_sum",
                         keepdims=0)
        sum_v = node("ReduceSum", [v, ax1], "sum_v", keepdims=0)
        sq_sum = node("Mul", [sum_v, sum_v], "sq_of_sum")
        v2 = node("Mul", [v, v], "v_sq")
        sum_sq = node("ReduceSum", [v2, ax1], "sum_of_sq", keepdims=0)
        diff = node("Sub", [sq_sum, sum_sq], "fm_diff")
        fm = node("ReduceSum", [diff, ax1], "fm_sum", keepdims=0)
        fm = node("Mul", [fm, const("half", np.array(0.5, np.float32))], "fm")
        logit = node("Add", [logit, fm], "logit_fm")
        logit = node("Add", [logit, first_sum], "logit_first")
        if D:
            lin = node("MatMul", ["dense", const("linear.weight", p["linear.weight"].reshape(D, 1))], "lin")
            lin = node("Reshape", [lin, flat], "lin_flat")
            logit = node("Add", [logit, lin], "logit_lin")
        logit = node("Add", [logit, const("linear.bias", p["linear.bias"])], "logit")
    node("Sigmoid", [logit], "prob")
    graph = helper.make_graph(nodes, f"{model.kind}_dense", inputs,
                              [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["B"])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="sparse-engine")
    proto.ir_version = min(proto.ir_version, 9)  # loadable by onnxruntime builds of the last two years
    onnx.checker.check_model(proto)
    return proto


def export_onnx(source, out_uri: str, **bundle_options) -> dict:
    """A bundle (:func:`~engine.export.bundle.export_bundle`, same options) with ``model.onnx`` inside:
    the dense part built from the source's model description and dense parameters.

    Returns
    -------
    dict
        The ``model.json`` written (``extra_files`` lists ``model.onnx``).
    """
    from .bundle import _build
    from .base import check_description
    desc = check_description(source.model_description())
    model = _build(desc)
    dense = np.asarray(source.dense())
    if dense.shape != (model.dense_size,):
        raise ExportError(f"dense: expected float32[{model.dense_size}], got {dense.dtype}{list(dense.shape)}")
    model.set_dense(dense.astype(np.float32, copy=False))
    data = build_onnx(model).SerializeToString()
    extra = dict(bundle_options.pop("extra_files", None) or {})
    extra[ONNX_FILE] = data
    from .bundle import export_bundle
    return export_bundle(source, out_uri, extra_files=extra, **bundle_options)
