"""Per-layer int8 sensitivity: which MatMul/Gemm the budget needs kept float32.

The search on the whole model (:func:`float_gains`, dynamic and weight-only int8): after the
all-layers int8 file failed the budget, :func:`switchable` writes one file in which each layer
the quantizer changed runs as int8 or float32 by a bool input (``Where(switch[i], float32,
int8)``), so trying a set of float32 layers is one run per search set, not a quantization and
a verification. It ranks the layers by what keeping each alone float32 buys the worst output
cosine, and predicts the fewest of them that reach the budget; candidates._int8_with_sensitivity
builds and verifies that count. A layer's own error can mislead both ways: an outlier that
wrecks a layer whose output hardly matters, or a small error that the rest of the model
amplifies (the ~110M Llama step of bench/optimize/optimize.py, weight-only int8: ranked by their own
errors, 11 layers had to stay float32; ranked on the whole model, 3).

The layers' own errors (:func:`layer_errors`; the fallback where no layer can be switched):
``onnxruntime.quantization.quantize_dynamic`` (MatMulConstBOnly, the default) quantizes each
MatMul/Gemm whose B is a weight: B to int8, symmetric, one scale per tensor (max |w| / 127), and
at run time the activation A to uint8, asymmetric, one scale per tensor over the range
[min(0, min A), max(0, max A)] (DynamicQuantizeLinear). :func:`layer_errors` runs the float32
graph once with every such A exposed (on each verification feed, in the pass child), computes
that layer's output with both operands quantized exactly so, and scores the layer by the
relative error of its own output, ``||A'B' - AB|| / ||AB||`` (worst over the feeds).

The other int8 candidates are scored by their own scheme (``scheme`` of :func:`layer_errors`,
the options of their quantize step): ``per_channel`` (quantize_dynamic with one weight scale
per output column), and ``block_size`` (MatMulNBits: weights int8 symmetric, one scale per
``block_size`` weights of a column along K; with ``accuracy_level`` 4 the kernel quantizes A
to int8 symmetric per row and per block of the same size, otherwise A stays float32). Static
int8 (QDQ) scores each layer by the error it adds in the QDQ graph (:func:`static_errors`).
"""

from __future__ import annotations

import tempfile
import time
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


def _quant_weight(w: np.ndarray, qmax: int = 127) -> np.ndarray:
    """int8 symmetric per tensor (|q| <= ``qmax``: 64 with reduce_range), dequantized."""
    scale = float(np.abs(w).max()) / qmax
    if scale == 0:
        return w
    return (np.clip(np.rint(w / scale), -qmax, qmax) * scale).astype(np.float32)


def _quant_blocks(x: np.ndarray, block: int, axis: int, qmax: int = 127) -> np.ndarray:
    """int8 symmetric with one scale (max |x| / ``qmax``) per ``block`` consecutive values
    along ``axis`` (the last block may be short), dequantized."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = x.shape[-1]
    pad = (-n) % block
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, block)
    scale = np.abs(xp).max(-1, keepdims=True) / float(qmax)
    safe = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.rint(xp / safe), -qmax, qmax) * scale
    return np.moveaxis(q.reshape(*x.shape[:-1], -1)[..., :n], -1, axis).astype(np.float32)


def quantized_operands(a: np.ndarray, w: np.ndarray, scheme: dict[str, Any] | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``a`` (M, K) and ``w`` (K, N) as the int8 scheme sees them (see the module doc;
    quantize_dynamic's weights are 7-bit, |q| <= 64, with ``reduce_range``: the portable
    default of passes.quantize_int8)."""
    scheme = scheme or {}
    if "block_size" in scheme:
        block = int(scheme["block_size"])
        qa = _quant_blocks(a, block, axis=1) if scheme.get("accuracy_level") == 4 else a
        return qa, _quant_blocks(w, block, axis=0)
    qmax = 64 if scheme.get("reduce_range") else 127
    if scheme.get("per_channel"):
        return _quant_act(a), _quant_blocks(w, w.shape[0], axis=0, qmax=qmax)
    return _quant_act(a), _quant_weight(w, qmax)


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
    files.save_feeds), each layer quantized as ``scheme`` says. ``dst`` is not written."""
    import onnx
    from onnx import numpy_helper

    from onnxmedic.optimize.files import load_feeds
    from onnxmedic.optimize.fp16 import session_exposing, value_chunks

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

    from onnxmedic.optimize.files import has_external_data, load_feeds
    from onnxmedic.optimize.passes import STATIC_OPS, feed_reader, quantize_static_int8

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


# -- the search on the whole model: one file with every layer switchable ------------------------

SWITCH = "onnxmedic_float32_layers"  # the switchable file's bool input: True keeps a layer float32
SEARCH_SETS = 8  # at most this many search sets are run per try


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of ``a`` and ``b`` flattened (float64); two zero vectors agree."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a @ b / (na * nb))


def worst_cosine(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """The worst per-output cosine of ``got`` against ``want`` as the reduced-precision budget
    scores it (candidates.judge_reduced): 0 for another shape, for an integer output that
    differs, and for non-finite values where ``want`` has finite ones."""
    worst = 1.0
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return 0.0
        if not np.issubdtype(w.dtype, np.floating):
            worst = min(worst, 1.0 if np.array_equal(g, w) else 0.0)
        elif (~np.isfinite(g) & np.isfinite(w)).any():
            return 0.0
        else:
            worst = min(worst, cosine(w, g))
    return worst


def exclusion_cap(layers: int, max_excluded: int | None = None) -> int:
    """How many layers the search may keep float32: ``max_excluded``, by default a quarter of
    ``layers`` (at least 4); never all of them (then nothing would be quantized)."""
    cap = max_excluded if max_excluded is not None else max(4, layers // 4)
    return max(0, min(cap, layers - 1))


def next_count(k: int, limit: int) -> int | None:
    """The search's next count of float32 layers after ``k`` failed: 1, 2, 4, 8 ..., the last
    try at ``limit`` itself (doubling past it would skip it); None when ``k`` was the limit."""
    if k >= limit:
        return None
    return min(limit, 2 * k if k else 1)


def switchable(src: str, quantized: str, dst: str) -> list[str]:
    """Write ``dst``: the int8 file ``quantized`` (``src`` with every layer quantized) with each
    layer it changed made switchable back to ``src``'s float32 node. A bool input
    :data:`SWITCH` (one entry per layer) picks each layer's output: ``Where(SWITCH[i], float32,
    int8)``. A layer is a MatMul/Gemm of ``src`` whose output ``quantized`` computes with
    another node (ONNX Runtime's quantizers keep a layer's output name) and whose inputs are
    there before it (or are ``src``'s weights, which come along - renamed where ``quantized``
    holds another tensor by that name). Returns the layers (``src``'s node names) in the order
    of the switch's entries."""
    import copy

    import onnx
    from onnx import TensorProto, helper

    fgraph = onnx.load(src).graph
    model = onnx.load(quantized)
    graph = model.graph
    layers_at = {n.output[0]: n for n in fgraph.node
                 if n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx") and n.name}
    floats = {t.name: t for t in fgraph.initializer}
    held = {t.name: t for t in graph.initializer}
    known = {*held, *(i.name for i in graph.input)}
    layers: list[str] = []
    nodes = []
    for q in graph.node:
        nodes.append(q)
        f = layers_at.get(q.output[0]) if q.output else None
        if f is None or (q.name == f.name and q.op_type == f.op_type) or not all(
                not i or i in known or i in floats for i in f.input):
            known.update(q.output)
            continue
        i, out = len(layers), q.output[0]
        layers.append(f.name)
        keep = copy.deepcopy(f)
        keep.name, keep.output[0] = f"{f.name}__float32", f"{out}__float32"
        q.output[0] = f"{out}__int8"
        for j, name in enumerate(keep.input):
            if name not in floats or _same_tensor(held.get(name), floats[name]):
                continue  # an activation, or a weight the int8 file holds as it is
            if name in held:  # another tensor by that name in the int8 file
                keep.input[j] = f"{name}__float32"
            if keep.input[j] not in held:  # one copy: append() would copy it again
                held[keep.input[j]] = weight = graph.initializer.add()
                weight.CopyFrom(floats[name])
                weight.name = keep.input[j]
        index = helper.make_tensor(f"{SWITCH}_{i}_index", TensorProto.INT64, [], [i])
        graph.initializer.append(index)
        nodes += [keep, helper.make_node("Gather", [SWITCH, index.name], [f"{SWITCH}_{i}"],
                                         name=f"{SWITCH}_{i}_gather"),
                  helper.make_node("Where", [f"{SWITCH}_{i}", keep.output[0], q.output[0]], [out],
                                   name=f"{SWITCH}_{i}_where")]
        known.update([*q.output, out])
    del graph.node[:]
    graph.node.extend(nodes)
    graph.input.append(helper.make_tensor_value_info(SWITCH, TensorProto.BOOL, [len(layers)]))
    onnx.save(model, dst, save_as_external_data=True, location=Path(dst).name + ".data")
    return layers


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether initializers ``a`` and ``b`` (either may be None) hold the same tensor."""
    return a is not None and b is not None and a.SerializeToString() == b.SerializeToString()


class _Switched:
    """A session of a :func:`switchable` file: the worst cosine over the search sets with a set
    of layers float32, against the file with every layer float32 (``src`` itself)."""

    def __init__(self, path: str, layers: int, feeds: list[dict[str, np.ndarray]]) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.layers, self.feeds = layers, feeds
        self.runs = 0
        self.want = [self.outputs(range(layers), f) for f in feeds]

    def outputs(self, keep: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        switch = np.zeros(self.layers, dtype=bool)
        switch[list(keep)] = True
        self.runs += 1
        return self.session.run(None, {**feed, SWITCH: switch})

    def worst(self, keep: Any, sets: list[int] | None = None) -> float:
        """The worst cosine over the search sets ``sets`` (all by default)."""
        return min(worst_cosine(self.outputs(keep, self.feeds[s]), self.want[s])
                   for s in (range(len(self.feeds)) if sets is None else sets))


def float_gains(src: str, dst: str, feeds: str, quantized: str, cosine: float,
                max_excluded: int | None = None, seconds: float = 300.0) -> dict[str, Any]:
    """A pass-pipeline step (runs in the pass child): rank the layers by what keeping each alone
    float32 buys the whole model, and predict how many of them the budget needs.

    ``quantized`` is ``src`` with every layer quantized (the search's first, failed try). One
    :func:`switchable` file runs each layer as int8 or float32 by an input, so a try is one
    run per search set (the ``feeds`` .npz, at most :data:`SEARCH_SETS`), not a quantization.
    A layer's score (``errors``) is the worst output cosine with it alone float32 less that of
    every layer int8, on the search set where every layer int8 does worst (the hardest set).
    Then 1, 2, 4 ... of the ranked layers (up to :func:`exclusion_cap`) are kept float32 until
    the worst cosine over every search set reaches ``cosine``, and the gap to the last count
    that failed is halved down to one layer: ``predicted`` is the fewest that reach it (None:
    not within ``cap`` or ``seconds``), ``curve`` each count tried with its worst cosine (0:
    every layer int8, worst over the search sets). The reference is ``src``'s own outputs (the
    file with every layer float32), so the search sets need no PyTorch outputs. The search
    stops at ``seconds`` (``stopped``; layers left unscored rank last). ``dst`` is not
    written.

    candidates passes the verification sets, those the budget is judged on. Sets apart from
    them (the calibration sets) were tried first: on a model whose error moves
    non-monotonically with the layers kept float32 (torchcde's CDE, per-channel dynamic int8:
    0 -> 0.9942, 1 -> 0.9851, 4 -> 0.9985, 6 -> 0.9973, 8 -> 0.9991 there) the count they
    predicted failed verification (0.99651)."""
    from onnxmedic.optimize.files import load_feeds

    del dst
    deadline = time.monotonic() + seconds
    with tempfile.TemporaryDirectory(prefix="onnxmedic-switch-") as tmp:
        path = str(Path(tmp) / "switch.onnx")
        layers = switchable(src, quantized, path)
        if not layers:
            return {"errors": {}, "predicted": None, "curve": [], "cap": 0, "stopped": False,
                    "seconds": 0.0, "runs": 0}
        run = _Switched(path, len(layers), load_feeds(feeds)[:SEARCH_SETS])
        every = [run.worst((), [s]) for s in range(len(run.feeds))]
        hardest = int(np.argmin(every))
        gains: dict[int, float] = {}
        for i in range(len(layers)):
            if time.monotonic() > deadline:
                break
            gains[i] = run.worst((i,), [hardest]) - every[hardest]
        order = sorted(gains, key=lambda i: -gains[i]) + [i for i in range(len(layers))
                                                          if i not in gains]
        cap = exclusion_cap(len(layers), max_excluded)
        predicted, curve = fewest_float32(run, order, cosine, cap, deadline)
        del run.session
    stopped = len(gains) < len(layers) or (predicted is None and (not curve or curve[-1][0] < cap))
    return {"errors": {layers[i]: g for i, g in gains.items()}, "predicted": predicted,
            "curve": [[0, min(every)], *curve], "cap": cap, "stopped": stopped,
            "seconds": seconds - (deadline - time.monotonic()), "runs": run.runs}


def fewest_float32(run: _Switched, order: list[int], cosine: float, cap: int, deadline: float
            ) -> tuple[int | None, list[list[float]]]:
    """The fewest of ``order``'s first layers kept float32 whose worst cosine reaches
    ``cosine``: doubling up to ``cap``, then halving the gap to the last count that failed.
    Returns it (None: none within ``cap`` or before ``deadline``) and each count tried."""
    tried: dict[int, float] = {}
    failed, passed, k = 0, None, 0
    while (k := next_count(k, cap)) is not None and time.monotonic() < deadline:
        tried[k] = run.worst(order[:k])
        if tried[k] >= cosine:
            passed = k
            break
        failed = k
    while passed is not None and passed - failed > 1 and time.monotonic() < deadline:
        mid = (failed + passed) // 2
        tried[mid] = run.worst(order[:mid])
        failed, passed = (failed, mid) if tried[mid] >= cosine else (mid, passed)
    return passed, [[k, c] for k, c in sorted(tried.items())]
