"""Faults injected into an ONNX model, to show that verification catches real miscompiles
(bench/accuracy/verify_calibration.py and the tests): each returns a changed copy, or None where the
model has nothing of that kind.

- ``scale_weight(m, delta)``: the largest float initializer's elements multiplied by
  (1 + delta) or (1 - delta), signs drawn at random (a uniform scale would vanish behind a
  normalisation that follows - LayerNorm, weight norm - and test nothing)
- ``drop_bias(m)``: the bias of the first Conv / Gemm with one, or the first 1-D initializer
  added to an activation, set to zero
- ``change_epsilon(m)``: the first normalisation's epsilon times 1000 (at least 1e-2)
- ``swap_activation(m)``: the first Relu/Gelu/Tanh/Sigmoid/Erf/Softplus computed as another
- ``change_softmax_axis(m)``: the first Softmax over another axis of size > 1
- ``add_to_sub(m)``: the last Add of two computed float values (a residual sum) turned into
  Sub

Faults in a detector's outputs (a set of rows, verify/detections.py), by graph output name:

- ``shift_first_row(m, output, delta)``: the output's first row plus ``delta`` (a moved box,
  a wrong label)
- ``drop_first_row(m, outputs)``: the first row of each of ``outputs`` removed (a dropped
  detection)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

_NORMS = ("LayerNormalization", "BatchNormalization", "InstanceNormalization",
          "GroupNormalization", "SimplifiedLayerNormalization", "RMSNormalization")
_ACTS = {"Relu": "Sigmoid", "Gelu": "Relu", "Tanh": "Sigmoid", "Sigmoid": "Tanh",
         "Erf": "Tanh", "Softplus": "Relu"}


def _copy(m: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    return out


def _float_inits(m: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in m.graph.initializer
            if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                               onnx.TensorProto.FLOAT16)]


def _replace(m: onnx.ModelProto, t: onnx.TensorProto, value: np.ndarray) -> None:
    t.CopyFrom(numpy_helper.from_array(value.astype(numpy_helper.to_array(t).dtype), t.name))


def scale_weight(m: onnx.ModelProto, delta: float) -> onnx.ModelProto | None:
    inits = [t for t in _float_inits(m) if len(t.dims) >= 2]
    if not inits:
        return None
    out = _copy(m)
    t = max((x for x in out.graph.initializer if x.name in {i.name for i in inits}),
            key=lambda x: int(np.prod(x.dims)))
    w = numpy_helper.to_array(t).astype(np.float64)
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=w.shape)
    _replace(out, t, w * (1 + delta * signs))
    return out


def drop_bias(m: onnx.ModelProto) -> onnx.ModelProto | None:
    out = _copy(m)
    inits = {t.name: t for t in _float_inits(out)}
    for n in out.graph.node:
        cand = (n.input[2] if n.op_type in ("Conv", "Gemm") and len(n.input) > 2 else
                next((i for i in n.input if i in inits and len(inits[i].dims) == 1
                      and int(np.prod(inits[i].dims)) > 1), None)
                if n.op_type == "Add" else None)
        if cand and cand in inits and np.any(numpy_helper.to_array(inits[cand]) != 0):
            _replace(out, inits[cand], np.zeros_like(numpy_helper.to_array(inits[cand])))
            return out
    return None


def change_epsilon(m: onnx.ModelProto) -> onnx.ModelProto | None:
    out = _copy(m)
    for n in out.graph.node:
        if n.op_type in _NORMS:
            eps = next((a for a in n.attribute if a.name == "epsilon"), None)
            if eps is None:
                n.attribute.append(onnx.helper.make_attribute("epsilon", 1e-2))
            else:
                eps.f = max(eps.f * 1000, 1e-2)
            return out
    return None


def swap_activation(m: onnx.ModelProto) -> onnx.ModelProto | None:
    out = _copy(m)
    for n in out.graph.node:
        if n.op_type in _ACTS and n.domain in ("", "ai.onnx"):
            n.op_type = _ACTS[n.op_type]
            del n.attribute[:]
            return out
    return None


def _shapes(m: onnx.ModelProto) -> dict[str, list[int | None]]:
    from onnxmedic.onnxfile import skeleton

    inferred = onnx.shape_inference.infer_shapes(skeleton(m), data_prop=True)
    out = {}
    for v in list(inferred.graph.value_info) + list(inferred.graph.input) + list(
            inferred.graph.output):
        if v.type.HasField("tensor_type"):
            out[v.name] = [d.dim_value if d.HasField("dim_value") else None
                           for d in v.type.tensor_type.shape.dim]
    return out


def _float_values(m: onnx.ModelProto) -> set[str]:
    from onnxmedic.onnxfile import skeleton

    inferred = onnx.shape_inference.infer_shapes(skeleton(m))
    kinds = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
             onnx.TensorProto.BFLOAT16)
    return {v.name for v in list(inferred.graph.value_info) + list(inferred.graph.output)
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in kinds}


def change_softmax_axis(m: onnx.ModelProto) -> onnx.ModelProto | None:
    out = _copy(m)
    shapes = _shapes(out)
    for n in out.graph.node:
        if n.op_type not in ("Softmax", "LogSoftmax"):
            continue
        dims = shapes.get(n.input[0])
        if not dims:
            continue
        axis_attr = next((a for a in n.attribute if a.name == "axis"), None)
        axis = (axis_attr.i if axis_attr is not None else -1) % len(dims)
        other = next((k for k in reversed(range(len(dims)))
                      if k != axis and (dims[k] is None or dims[k] > 1)), None)
        if other is None:
            continue
        if axis_attr is None:
            n.attribute.append(onnx.helper.make_attribute("axis", other))
        else:
            axis_attr.i = other
        return out
    return None


def _live(m: onnx.ModelProto) -> set[str]:
    """The values the graph's outputs depend on (top-level graph)."""
    producer = {o: n for n in m.graph.node for o in n.output}
    live: set[str] = set()
    todo = [o.name for o in m.graph.output]
    while todo:
        v = todo.pop()
        if v in live:
            continue
        live.add(v)
        if v in producer:
            todo.extend(i for i in producer[v].input if i)
    return live


def add_to_sub(m: onnx.ModelProto) -> onnx.ModelProto | None:
    """The last Add of two computed float values that the outputs depend on: in a network
    with skip connections, a residual sum (the first such Add of an attention model adds an
    all-zero mask, an Add of sizes or on a path the outputs do not use changes nothing)."""
    out = _copy(m)
    consts = {t.name for t in out.graph.initializer} | {
        o for n in out.graph.node if n.op_type == "Constant" for o in n.output}
    floats = _float_values(out)
    live = _live(out)
    for n in reversed(out.graph.node):
        if (n.op_type == "Add" and not any(i in consts for i in n.input)
                and n.output[0] in live and n.output[0] in floats):
            n.op_type = "Sub"
            return out
    return None


def _rows_rewired(m: onnx.ModelProto, outputs: list[str], tag: str
                  ) -> tuple[onnx.ModelProto, dict[str, str]] | None:
    """A copy of ``m`` whose graph outputs ``outputs`` are computed under new names (returned,
    by output) so that nodes appended to the copy can produce the outputs from them."""
    names = {o.name for o in m.graph.output}
    if not outputs or any(o not in names for o in outputs):
        return None
    out = _copy(m)
    inner = {o: f"{o}_{tag}_in" for o in outputs}
    for node in out.graph.node:
        node.input[:] = [inner.get(i, i) for i in node.input]
        node.output[:] = [inner.get(o, o) for o in node.output]
    return out, inner


def _slice_rows(x: str, start: int, end: int, name: str) -> list[onnx.NodeProto]:
    """Nodes computing ``name = x[start:end]`` along the first axis."""
    from onnx import helper

    consts = [helper.make_node("Constant", [], [f"{name}_{k}"], value_ints=[v])
              for k, v in (("s", start), ("e", end), ("a", 0))]
    return [*consts, helper.make_node("Slice", [x, f"{name}_s", f"{name}_e", f"{name}_a"],
                                      [name])]


def shift_first_row(m: onnx.ModelProto, output: str, delta: float) -> onnx.ModelProto | None:
    """``output``'s first row plus ``delta`` (in its dtype): a box moved, a label changed."""
    from onnx import helper

    wired = _rows_rewired(m, [output], "shift")
    if wired is None:
        return None
    out, inner = wired
    elem = next(o.type.tensor_type.elem_type for o in m.graph.output if o.name == output)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    x = inner[output]
    nodes = [*_slice_rows(x, 0, 1, f"{x}_head"), *_slice_rows(x, 1, 1 << 62, f"{x}_tail"),
             helper.make_node("Constant", [], [f"{x}_delta"],
                              value=numpy_helper.from_array(np.array(delta, dtype))),
             helper.make_node("Add", [f"{x}_head", f"{x}_delta"], [f"{x}_moved"]),
             helper.make_node("Concat", [f"{x}_moved", f"{x}_tail"], [output], axis=0)]
    out.graph.node.extend(nodes)
    return out


def drop_first_row(m: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto | None:
    """The first row of each of ``outputs`` removed: a detection dropped from its set."""
    wired = _rows_rewired(m, outputs, "drop")
    if wired is None:
        return None
    out, inner = wired
    for o in outputs:
        out.graph.node.extend(_slice_rows(inner[o], 1, 1 << 62, o))
    return out


STRUCTURAL: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto | None]] = {
    "bias dropped": drop_bias, "epsilon changed": change_epsilon,
    "activation swapped": swap_activation, "softmax axis changed": change_softmax_axis,
    "Add -> Sub": add_to_sub,
}


def trained_like(model, args: tuple = ()):
    """Random weights as initialised leave biases, norm shifts and running statistics at 0/1
    and layer scales at 1e-6, which trained models never have (and a dropped bias or a weight
    behind a 1e-6 layer scale would change nothing): draw them, in place; returns the model
    in eval mode. For calibrating and testing verification on models built from configs.

    With example ``args``, batch norms' running statistics are then measured on them (one
    forward pass with only the batch norms in training mode), as training leaves them: drawn
    at random they can shrink a deep CNN's activations to nothing, so its output no longer
    depends on the input (MobileViT's did: every injected fault was invisible)."""
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("bias") or name.endswith("running_mean"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)
            elif name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif "layer_scale" in name:  # ConvNeXt initialises them to 1e-6
                t.copy_(torch.rand(t.shape, generator=g) * 0.9 + 0.1)
    model.eval()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats]
    if args and norms:
        saved = [m.momentum for m in norms]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average: one pass sets the batch's statistics
            m.train()
        try:
            with torch.no_grad():
                model(*args)
        finally:
            for m, mom in zip(norms, saved):
                m.momentum = mom
                m.eval()
    return model
