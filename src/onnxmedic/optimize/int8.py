"""Per-layer int8 sensitivity, measured once: which MatMul/Gemm loses most to quantization.

``onnxruntime.quantization.quantize_dynamic`` (MatMulConstBOnly, the default) quantizes each
MatMul/Gemm whose B is a weight: B to int8, symmetric, one scale per tensor (max |w| / 127), and
at run time the activation A to uint8, asymmetric, one scale per tensor over the range
[min(0, min A), max(0, max A)] (DynamicQuantizeLinear). :func:`layer_errors` runs the float32
graph once with every such A exposed (on each verification feed, in the pass child), computes
that layer's output with both operands quantized exactly so, and scores the layer by the
relative error of its own output, ``||A'B' - AB|| / ||AB||`` (worst over the feeds). An
outlier weight or activation that flattens the per-tensor scale shows up here at once, where a
leave-one-out search would need one quantize-and-verify per layer. The ranking orders the
layers kept in float32 (``candidates._int8_with_sensitivity``); the budget is still judged on
the whole model's outputs.

The other int8 candidates are scored by their own scheme (``scheme`` of :func:`layer_errors`,
the options of their quantize step): ``per_channel`` (quantize_dynamic with one weight scale
per output column), and ``block_size`` (MatMulNBits: weights int8 symmetric, one scale per
``block_size`` weights of a column along K; with ``accuracy_level`` 4 the kernel quantizes A
to int8 symmetric per row and per block of the same size, otherwise A stays float32).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_BYTES = 256 * 1024**2


def _quant_act(a: np.ndarray) -> np.ndarray:
    """DynamicQuantizeLinear then dequantize (uint8, asymmetric, per tensor)."""
    lo, hi = min(0.0, float(a.min())), max(0.0, float(a.max()))
    scale = (hi - lo) / 255.0
    if scale == 0:
        return a
    zp = np.clip(np.rint(-lo / scale), 0, 255)
    q = np.clip(np.rint(a / scale) + zp, 0, 255)
    return ((q - zp) * scale).astype(np.float32)


def _quant_weight(w: np.ndarray) -> np.ndarray:
    """int8 symmetric per tensor, dequantized."""
    scale = float(np.abs(w).max()) / 127.0
    if scale == 0:
        return w
    return (np.clip(np.rint(w / scale), -127, 127) * scale).astype(np.float32)


def _quant_blocks(x: np.ndarray, block: int, axis: int) -> np.ndarray:
    """int8 symmetric with one scale (max |x| / 127) per ``block`` consecutive values along
    ``axis`` (the last block may be short), dequantized."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = x.shape[-1]
    pad = (-n) % block
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, block)
    scale = np.abs(xp).max(-1, keepdims=True) / 127.0
    safe = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.rint(xp / safe), -127, 127) * scale
    return np.moveaxis(q.reshape(*x.shape[:-1], -1)[..., :n], -1, axis).astype(np.float32)


def quantized_operands(a: np.ndarray, w: np.ndarray, scheme: dict[str, Any] | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``a`` (M, K) and ``w`` (K, N) as the int8 scheme sees them (see the module doc)."""
    scheme = scheme or {}
    if "block_size" in scheme:
        block = int(scheme["block_size"])
        qa = _quant_blocks(a, block, axis=1) if scheme.get("accuracy_level") == 4 else a
        return qa, _quant_blocks(w, block, axis=0)
    if scheme.get("per_channel"):
        return _quant_act(a), _quant_blocks(w, w.shape[0], axis=0)
    return _quant_act(a), _quant_weight(w)


def layer_error(a: np.ndarray, w: np.ndarray, scheme: dict[str, Any] | None = None) -> float:
    """Relative error of ``a @ w`` with both quantized as the scheme does (default:
    quantize_dynamic, per tensor)."""
    a64 = a.astype(np.float64)
    exact = a64 @ w.astype(np.float64)
    qa, qw = quantized_operands(a, w, scheme)
    approx = qa.astype(np.float64) @ qw.astype(np.float64)
    norm = float(np.linalg.norm(exact))
    return float(np.linalg.norm(approx - exact) / norm) if norm else 0.0


def layer_errors(src: str, dst: str, feeds: str, chunk_bytes: int = CHUNK_BYTES,
                 scheme: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pass-pipeline step (runs in the pass child): {"errors": {node name: score}} for each
    named MatMul/Gemm with a weight B, worst over the feeds of the ``feeds`` .npz (see
    fp16.save_feeds), each layer quantized as ``scheme`` says. ``dst`` is not written."""
    import onnx
    from onnx import numpy_helper

    from onnxmedic.optimize.fp16 import load_feeds, session_exposing, value_chunks

    del dst
    proto = onnx.load(src)
    inits = {t.name: t for t in proto.graph.initializer}
    layers: list[tuple[str, str, np.ndarray]] = []  # name, activation, weight as (K, N)
    for n in proto.graph.node:
        if n.op_type not in ("MatMul", "Gemm") or not n.name or len(n.input) < 2:
            continue
        if n.input[1] not in inits or n.input[0] in inits:
            continue
        w = numpy_helper.to_array(inits[n.input[1]])
        if w.dtype != np.float32 or w.ndim != 2:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "Gemm" and (attrs.get("transA") or attrs.get("alpha", 1.0) != 1.0):
            continue
        if n.op_type == "Gemm" and attrs.get("transB"):
            w = w.T
        layers.append((n.name, n.input[0], w))
    feed_list = load_feeds(feeds)
    graph_inputs = {i.name for i in proto.graph.input}
    exposed = list(dict.fromkeys(a for _, a, _ in layers if a not in graph_inputs))
    errors: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="onnxmedic-int8-") as tmp:
        for chunk in value_chunks(proto, exposed, chunk_bytes) if exposed else [[]]:
            sess = session_exposing(proto, chunk, tmp)
            wanted = set(chunk)
            for feed in feed_list:
                got = dict(zip(chunk, sess.run(chunk, feed))) if chunk else {}
                got.update({k: v for k, v in feed.items() if k in graph_inputs})
                for name, act, w in layers:
                    if act in got and (act in wanted or act in graph_inputs):
                        a = np.asarray(got[act], np.float32)
                        if a.shape[-1] == w.shape[0]:
                            e = layer_error(a.reshape(-1, w.shape[0]), w, scheme)
                            errors[name] = max(errors.get(name, 0.0), e)
            del sess
    return {"errors": errors}


def _relative(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """Worst ``||got - want|| / ||want||`` over the feeds (0 where ``want`` is zero)."""
    worst = 0.0
    for g, w in zip(got, want):
        w64 = np.asarray(w, np.float64)
        norm = float(np.linalg.norm(w64))
        if norm and g.shape == w.shape:
            worst = max(worst, float(np.linalg.norm(np.asarray(g, np.float64) - w64)) / norm)
    return worst


def _quantized_source(name: str, producer: dict[str, Any]) -> str | None:
    """The float value a QDQ input reads: ``t`` for ``DequantizeLinear(QuantizeLinear(t))``,
    ``name`` itself where it is not quantized, None for a quantized weight (a
    DequantizeLinear of an initializer)."""
    dq = producer.get(name)
    if dq is None or dq.op_type != "DequantizeLinear":
        return name
    q = producer.get(dq.input[0])
    return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else None


def static_errors(src: str, dst: str, feeds: str, calibration: str,
                  per_channel: bool = True, quantized: str | None = None) -> dict[str, Any]:
    """A pass-pipeline step (runs in the pass child): {"errors": {node name: score}} for each
    layer static int8 quantizes (passes.STATIC_OPS). ``src`` is quantized as
    passes.quantize_static_int8 does (``calibration``: its .npz) - or ``quantized`` is that
    QDQ file already (the search's all-layers attempt, not built twice) - then the float and the QDQ
    graph run on the ``feeds`` .npz with every float value exposed (ONNX Runtime's own
    ``qdq_loss_debug`` tools: ``modify_model_output_intermediate_tensors``,
    ``collect_activations``). A layer's score is the error it adds: the relative error of its
    output in the QDQ graph against the float graph, less the worst relative error of the float
    values it reads (their own quantization is the layer's, the error they carry is not). Where
    the quantizer drops a Relu (the uint8 QuantizeLinear after it clamps at zero) the value is
    compared clamped. ``dst`` is not written."""
    import onnx
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations,
        modify_model_output_intermediate_tensors,
    )

    from onnxmedic.optimize.fp16 import load_feeds
    from onnxmedic.optimize.passes import (
        STATIC_OPS,
        feed_reader,
        has_external_data,
        quantize_static_int8,
    )

    del dst
    feed_list = load_feeds(feeds)
    external = has_external_data(src)
    float_graph = onnx.load(src, load_external_data=False).graph
    layers = {n.name for n in float_graph.node if n.op_type in STATIC_OPS and n.name}
    relus = {n.output[0] for n in float_graph.node if n.op_type == "Relu"}
    with tempfile.TemporaryDirectory(prefix="onnxmedic-qdq-") as tmp:
        qdq = quantized or str(Path(tmp) / "qdq.onnx")
        if not quantized:
            quantize_static_int8(src, qdq, calibration, per_channel=per_channel)
        values = []
        # the values a layer reads and writes only: in the QDQ graph those of the layers and
        # the QuantizeLinear inputs, in the float graph also the Relu/Clip outputs (the name a
        # layer's output takes where the quantizer folds the activation in)
        for name, path, ops in (("float", src, [*STATIC_OPS, "Relu", "Clip"]),
                                ("qdq", qdq, [*STATIC_OPS, "QuantizeLinear"])):
            aug = str(Path(tmp) / f"{name}-exposed.onnx")
            modify_model_output_intermediate_tensors(path, aug, op_types_for_saving=ops,
                                                     save_as_external_data=external)
            values.append(collect_activations(aug, feed_reader(feed_list)))
        floats, quantized = values
        graph = onnx.load(qdq, load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}

    def err(name: str) -> float:
        if name not in floats or name not in quantized:
            return 0.0
        got = quantized[name]
        made = producer.get(name)
        if name in relus and (made is None or made.op_type != "Relu"):
            # the quantizer dropped the Relu: the uint8 QuantizeLinear after it clamps at 0
            got = [np.maximum(g, 0) for g in got]
        return _relative(got, floats[name])

    errors: dict[str, float] = {}
    for n in graph.node:
        if n.name not in layers or not n.output:
            continue
        reads = [t for t in (_quantized_source(i, producer) for i in n.input if i) if t]
        errors[n.name] = err(n.output[0]) - max((err(t) for t in reads), default=0.0)
    return {"errors": errors}
