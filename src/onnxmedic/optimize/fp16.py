"""float16 candidates: ONNX Runtime's converter with float32 I/O kept and an automatic block list.

The conversion is ``onnxruntime.transformers.float16.convert_float_to_float16(model,
keep_io_types=True, node_block_list=..., op_block_list=DEFAULT_OP_BLOCK_LIST)``. What goes in the
node block list is measured, not guessed: every float32 value of the graph (node outputs, graph
inputs, initializers) is read on the verification inputs, in a child process, and

- a value with ``|x| > 65504`` (float16's largest finite value) overflows to inf in float16;
- a value with at least ``UNDERFLOW_MASS`` of its magnitude (sum of ``|x|``) in nonzero elements
  below ``2**-14`` (float16's smallest normal) loses that part to subnormal rounding or to zero;
  a few tiny elements in a large tensor (a softmax's far tail) carry no weight and do not count.

The node that computes such a value and every node that reads it stay float32 (the converter
puts Casts around them), so the value never exists in float16. The result is judged by the
reduced-precision budget like int8 (``candidates.judge_reduced``). Where it fails, the second
rule (:func:`amplifiers`) ranks the nodes by the error they add in float16 - measured, value by
value, against the float32 graph - and the candidates search keeps the top ones float32.

Targets: float16 is a GPU precision (CUDA/TensorRT have float16 kernels for nearly every op). On
the CPU provider ONNX Runtime runs the ops it has no float16 kernel for in float32 behind
inserted Casts, so a float16 file usually runs *slower* on cpu; there the candidate is still
built and verified, and rejected as slower (or as refused, where ONNX Runtime cannot load it).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.optimize.files import (  # noqa: F401 - save_feeds: importable here too
    load_feeds,
    node_subgraphs,
    op_count_diff,
    op_counts,
    save_feeds,
    save_proto,
)

logger = logging.getLogger(__name__)

FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # 6.1035e-05, float16's smallest normal
UNDERFLOW_MASS = 0.01  # share of a value's sum(|x|) below FP16_TINY that blocks it
# |x| from which an element is a fill value, not a computed one: an attention mask's
# torch.finfo(torch.float32).min (-3.4e38) or -1e9, a masked_fill's "minus infinity"
FILL_MIN = 1e8
CHUNK_BYTES = 256 * 1024**2  # exposed values per measuring session (as in verify/localize.py)


def name_nodes(src: str, dst: str) -> dict[str, Any]:
    """Give every unnamed top-level node a unique name (the converter's block list is by name)."""
    import onnx


    proto = onnx.load(src)
    taken = {n.name for n in proto.graph.node if n.name}
    named = 0
    for i, n in enumerate(proto.graph.node):
        if not n.name:
            name = f"onnxmedic_{n.op_type}_{i}"
            while name in taken:
                name += "_"
            n.name = name
            taken.add(name)
            named += 1
    save_proto(proto, dst)
    return {"named": named}


def value_stats(a: np.ndarray) -> list[float]:
    """[max |x| over finite elements, share of the sum|x| of the non-fill elements (|x| <
    FILL_MIN) in 0 < |x| < FP16_TINY, count of such elements, nonzero count, max |x| over the
    finite non-fill elements]."""
    x = np.abs(a[np.isfinite(a)].astype(np.float64, copy=False))
    if x.size == 0:
        return [0.0, 0.0, 0, 0, 0.0]
    nz = x > 0
    tiny = nz & (x < FP16_TINY)
    body = x[x < FILL_MIN]
    total = float(body.sum())
    return [float(x.max()), float(x[tiny].sum() / total) if total else 0.0, int(tiny.sum()),
            int(nz.sum()), float(body.max()) if body.size else 0.0]


def _merge(old: list[float] | None, new: list[float]) -> list[float]:
    if old is None:
        return new
    return [max(o, n) for o, n in zip(old, new)]


def _nbytes(vi: Any) -> int:
    """Bytes of a value from its declared shape (4 per element; symbolic dims count 1024)."""
    n = 4
    for d in vi.type.tensor_type.shape.dim:
        n *= d.dim_value if d.HasField("dim_value") else 1024
    return n


def value_chunks(proto: Any, names: list[str], chunk_bytes: int) -> list[list[str]]:
    """``names`` split so that each run exposes about ``chunk_bytes`` of values at most (sizes
    from the graph's value_info; values without one count 1 MiB)."""
    sizes = {vi.name: _nbytes(vi) for vi in proto.graph.value_info}
    out: list[list[str]] = [[]]
    total = 0
    for name in names:
        size = sizes.get(name, 1 << 20)
        if out[-1] and total + size > chunk_bytes:
            out.append([])
            total = 0
        out[-1].append(name)
        total += size
    return out


def range_stats(src: str, dst: str, feeds: str, chunk_bytes: int = CHUNK_BYTES
                ) -> dict[str, Any]:
    """A pass-pipeline step (runs in the pass child process): run ``src`` with its top-level
    node outputs exposed - about ``chunk_bytes`` of them per session, each session run on
    every feed of the ``feeds`` .npz - and return, per float32 value (node outputs, graph
    inputs, initializers), the worst :func:`value_stats` over the feeds. ``dst`` is not written."""
    import onnx
    from onnx import numpy_helper

    del dst
    proto = onnx.load(src)
    values: dict[str, list[float]] = {}
    for init in proto.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT:
            values[init.name] = value_stats(numpy_helper.to_array(init))
    feed_list = load_feeds(feeds)
    for feed in feed_list:
        for k, a in feed.items():
            if a.dtype == np.float32:
                values[k] = _merge(values.get(k), value_stats(a))
    graph_outputs = [o.name for o in proto.graph.output]
    exposed = list(dict.fromkeys(o for n in proto.graph.node for o in n.output
                                 if o and o not in graph_outputs))
    with tempfile.TemporaryDirectory(prefix="onnxmedic-fp16-") as tmp:
        for chunk in value_chunks(proto, exposed, chunk_bytes):
            sess = session_exposing(proto, chunk, tmp)
            for feed in feed_list:
                for name, a in zip(graph_outputs + chunk, sess.run(None, feed)):
                    if isinstance(a, np.ndarray) and a.dtype == np.float32:
                        values[name] = _merge(values.get(name), value_stats(a))
            del sess
    return {"values": values}


def session_exposing(proto: Any, names: list[str], tmp: str,
                     providers: list[Any] | None = None) -> Any:
    """A session of ``proto`` (CPU unless ``providers``; its nodes as they are: no graph
    optimization) with the values ``names`` as extra graph outputs, untyped - ONNX Runtime
    infers their types, the com.microsoft ops' included. ``proto``'s outputs are restored;
    over 2 GiB it goes through a file with external data in ``tmp``."""
    import onnx
    import onnxruntime as ort

    kept = len(proto.graph.output)
    for o in names:
        proto.graph.output.add().name = o
    try:
        try:
            model: Any = proto.SerializeToString()
        except ValueError:  # over 2 GiB
            model = str(Path(tmp) / "m.onnx")
            Path(model + ".data").unlink(missing_ok=True)
            onnx.save(proto, model, save_as_external_data=True, location="m.onnx.data")
    finally:
        del proto.graph.output[kept:]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the nodes as is
    return ort.InferenceSession(model, so, providers=providers or ["CPUExecutionProvider"])


def value_problem(stats: list[float], saturate: bool = False) -> str:
    """Why a value cannot live in float16 ("" when it can). ``saturate``: a value whose only
    elements beyond float16's range are fill values (:func:`fill_problem`) can - they
    saturate (the converter clips such constants to +-65504; computed ones become +-inf),
    which leaves a mask a mask."""
    mx, tiny_share, tiny, nonzero = stats[:4]
    if mx > FP16_MAX and not (saturate and fill_problem(stats)):
        return f"reaches |x| = {mx:.4g} > {FP16_MAX:g} (float16 overflows to inf)"
    if tiny_share >= UNDERFLOW_MASS:
        return (f"{tiny_share:.1%} of its magnitude is in {int(tiny)} of {int(nonzero)} nonzero "
                f"values below {FP16_TINY:.4g} (float16 underflows)")
    return ""


def fill_problem(stats: list[float]) -> str:
    """Where a value's elements beyond float16's range are all fill values (|x| >= FILL_MIN)
    and the others fit: the words for it ("" otherwise)."""
    mx, body = stats[0], stats[4] if len(stats) > 4 else stats[0]
    if mx > FP16_MAX >= body:
        return (f"reaches |x| = {mx:.4g} only in fill values (|x| >= {FILL_MIN:g}; its other "
                f"elements within {body:.4g})")
    return ""


def divisor_problem(stats: list[float]) -> str:
    """Why a value cannot be a float16 divisor ("" when it can): a nonzero value below
    FP16_TINY is subnormal or 0 in float16, and the quotient overflows or is inf - one such
    element is enough, however little of the value's magnitude it carries (value_problem's
    rule): ``torch.clamp(n, min=1e-9)`` under a mean over a mask that is empty for some row,
    as in sentence-transformers' mean pooling."""
    tiny, nonzero = int(stats[2]), int(stats[3])
    return (f"has {tiny} of its {nonzero} nonzero values below {FP16_TINY:.4g} (subnormal or 0 "
            "in float16: the quotient overflows)") if tiny else ""


def block_list(model_path: str | Path, values: dict[str, list[float]], saturate: bool = False
               ) -> dict[str, str]:
    """Node name -> why it stays float32: the producer and every consumer of each value that
    :func:`value_problem` refuses (graph inputs and initializers have consumers only), and
    the producer and the dividing consumers of a divisor :func:`divisor_problem` refuses.
    ``saturate``: values whose overflow is only fill values (:func:`saturated`) do not block."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    producer: dict[str, str] = {}
    consumers: dict[str, list[tuple[str, bool]]] = {}  # value -> [(node, divides by it)]
    for n in graph.node:
        for o in n.output:
            producer[o] = n.name
        for k, i in enumerate(n.input):
            divides = (n.op_type == "Div" and k == 1) or n.op_type == "Reciprocal"
            consumers.setdefault(i, []).append((n.name, divides))
    blocked: dict[str, str] = {}
    for value, st in values.items():
        users = consumers.get(value, [])
        if why := value_problem(st, saturate):
            made, read = f"computes {value}, which {why}", f"reads {value}, which {why}"
        elif any(d for _, d in users) and (why := divisor_problem(st)):
            made, read = (f"computes {value}, a divisor that {why}",
                          f"divides by {value}, which {why}")
            users = [(c, d) for c, d in users if d]  # its other readers are fine in float16
        else:
            continue
        if value in producer:
            blocked.setdefault(producer[value], made)
        for c, _ in users:
            blocked.setdefault(c, read)
    return blocked


def saturated(values: dict[str, list[float]]) -> dict[str, str]:
    """Value -> :func:`fill_problem`'s words, for each value that blocks its nodes only for its
    fill values: what ``block_list(..., saturate=True)`` leaves in float16 that the strict
    list keeps float32."""
    return {v: fill_problem(st) for v, st in values.items()
            if value_problem(st) and not value_problem(st, saturate=True)}


_ELEM_TYPES = {"tensor(float)": 1, "tensor(uint8)": 2, "tensor(int8)": 3, "tensor(uint16)": 4,
               "tensor(int16)": 5, "tensor(int32)": 6, "tensor(int64)": 7, "tensor(string)": 8,
               "tensor(bool)": 9, "tensor(float16)": 10, "tensor(double)": 11,
               "tensor(uint32)": 12, "tensor(uint64)": 13, "tensor(bfloat16)": 16}


def _typed(model: Any) -> tuple[Any, bool]:
    """The model with element types for every top-level value read (shapes left out), which the
    converter needs to put Casts around blocked nodes: from ONNX Runtime's symbolic shape
    inference, which knows the com.microsoft fused ops that ONNX's own inference leaves
    untyped; where it fails or leaves values untyped (it raises on values it cannot shape,
    e.g. behind a ReduceMax with axes as an input), from ONNX Runtime itself
    (:func:`ort_types`). Returns (model, True), or (model, False) when neither could type it
    (the converter then runs ONNX's inference)."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        typed = SymbolicShapeInference.infer_shapes(model, auto_merge=True,
                                                    guess_output_rank=False)
    except Exception as e:  # noqa: BLE001 - ONNX Runtime types the rest below
        logger.info("symbolic shape inference failed (%s); typing with ONNX Runtime", e)
        typed = None
    g = model.graph
    known = {vi.name for vi in g.value_info} | {v.name for v in g.output} | {
        v.name for v in g.input}
    for vi in typed.graph.value_info if typed is not None else []:
        if vi.name and vi.name not in known and vi.type.tensor_type.elem_type:
            v = onnx.ValueInfoProto()
            v.CopyFrom(vi)
            v.type.tensor_type.ClearField("shape")
            g.value_info.append(v)
            known.add(vi.name)
    read = _referenced(g, set())  # an unread output (SkipLayerNormalization's float mean) is
    missing = list(dict.fromkeys(o for n in g.node for o in n.output  # best left untyped
                                 if o and o not in known and o in read))
    if not missing:
        return model, True
    try:
        types = ort_types(model, missing)
    except Exception as e:  # noqa: BLE001 - the converter runs ONNX's inference
        logger.info("ONNX Runtime could not type the graph (%s); using ONNX's inference", e)
        return model, False
    for name, elem in types.items():
        g.value_info.append(onnx.helper.make_tensor_value_info(name, elem, None))
    return model, True


def ort_types(model: Any, names: list[str]) -> dict[str, int]:
    """Element type (TensorProto enum) of each top-level value in ``names``, as ONNX Runtime
    types it when it loads ``model`` (nothing runs); sequences and maps are left out."""
    wanted = set(names)
    with tempfile.TemporaryDirectory(prefix="onnxmedic-fp16-") as tmp:
        sess = session_exposing(model, names, tmp)
        return {o.name: _ELEM_TYPES[o.type] for o in sess.get_outputs()
                if o.name in wanted and o.type in _ELEM_TYPES}


def _referenced(graph: Any, into: set[str]) -> set[str]:
    """Every value name read by a node of ``graph`` or of its subgraphs, and its outputs."""

    into.update(o.name for o in graph.output)
    for n in graph.node:
        into.update(n.input)
        for g in node_subgraphs(n):
            _referenced(g, into)
    return into


def drop_round_trips(model: Any) -> int:
    """Where the converter put a float32 -> float16 -> float32 pair of Casts between two
    float32 nodes (it casts every blocked node's output to float16 and back, even when the next
    node is blocked too), the second Cast becomes an Identity of the float32 value: the value
    then never passes through float16 (the point of blocking it). Only Cast(to=FLOAT) of a
    Cast(to=FLOAT16) of a FLOAT value is touched - never a model's own casts between other
    types. Returns how many were bypassed; Casts left unused are removed."""
    import itertools

    from onnx import TensorProto

    g = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in itertools.chain(g.input, g.value_info, g.output)}
    types.update({t.name: t.data_type for t in g.initializer})

    def to(n: Any) -> int:
        return next((a.i for a in n.attribute if a.name == "to"), -1)

    producer = {o: n for n in g.node for o in n.output}
    bypassed = 0
    for n in g.node:
        if n.op_type != "Cast" or to(n) != TensorProto.FLOAT:
            continue
        p = producer.get(n.input[0])
        if (p is not None and p.op_type == "Cast" and to(p) == TensorProto.FLOAT16
                and types.get(p.input[0]) == TensorProto.FLOAT):
            n.op_type = "Identity"
            del n.attribute[:]
            n.input[0] = p.input[0]
            bypassed += 1
    used = _referenced(g, set())
    keep = [n for n in g.node if not (n.op_type == "Cast" and not any(o in used for o in n.output))]
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(keep)
    return bypassed


def route_initializer_outputs(graph: Any, top: bool = True) -> int:
    """Where a subgraph (an If branch, a Loop body) returns one of its own float initializers
    as it is (EmbeddingBag's empty-bag branch returns a zeros row), put an Identity between
    them: ONNX Runtime's converter turns every float subgraph output to float16 but converts
    an initializer only where a node reads it, so the branch declared float16 and returned
    float32 and ONNX Runtime refused the file ("Mismatched tensor element type"). Returns how
    many outputs were routed, in ``graph``'s subgraphs at every depth."""
    import onnx
    from onnx import TensorProto


    routed = 0
    if not top:
        floats = {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}
        for out in graph.output:
            if out.name in floats:
                name = f"{out.name}_routed"
                graph.node.append(onnx.helper.make_node("Identity", [out.name], [name],
                                                        name=f"{name}_identity"))
                out.name = name
                routed += 1
    for n in graph.node:
        for g in node_subgraphs(n):
            routed += route_initializer_outputs(g, top=False)
    return routed


def float16(src: str, dst: str, node_block_list: list[str] | None = None,
            op_block_list: list[str] | None = None) -> dict[str, Any]:
    """onnxruntime.transformers.float16.convert_float_to_float16 with float32 inputs and outputs
    kept; ``node_block_list`` nodes (and ``op_block_list`` op types, default ONNX Runtime's
    DEFAULT_OP_BLOCK_LIST) stay float32 behind Casts, and a value passed between two of them
    stays float32 (:func:`drop_round_trips`). Types come from ONNX Runtime's symbolic shape
    inference where it succeeds (fused com.microsoft ops), as in its OnnxModel wrapper."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16


    before = op_counts(src)
    model, typed = _typed(onnx.load(src))
    routed = route_initializer_outputs(model.graph)
    model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=typed,
                                     node_block_list=list(node_block_list or []),
                                     op_block_list=(DEFAULT_OP_BLOCK_LIST if op_block_list is None
                                                    else op_block_list))
    bypassed = drop_round_trips(model)
    doubled = drop_duplicate_nodes(model)
    save_proto(model, dst)
    info = op_count_diff(before, op_counts(dst))
    info["blocked"] = list(node_block_list or [])
    info["round_trips_bypassed"] = bypassed
    if routed:
        info["routed_initializer_outputs"] = routed
    if doubled:
        info["duplicate_casts_dropped"] = doubled
    return info


def drop_duplicate_nodes(model: Any) -> int:
    """Drop each top-level node that repeats an earlier one exactly (name, inputs, outputs,
    attributes), and each repeated value_info. The converter of onnxruntime-gpu 1.31.1 (its
    CPU wheel's is newer) puts one float16 -> float32 Cast before every blocked node that
    reads a float16 value, all of the same name and output: two blocked nodes reading one
    value (an Add and a Sub of one constant) made a file ONNX Runtime refuses ("two nodes with
    same node name"). Returns how many nodes were dropped."""
    g = model.graph
    seen: set[bytes] = set()
    keep = []
    for n in g.node:
        key = n.SerializeToString(deterministic=True)
        if key not in seen:
            seen.add(key)
            keep.append(n)
    dropped = len(g.node) - len(keep)
    if dropped:
        del g.node[:]
        g.node.extend(keep)
    names: set[str] = set()
    infos = [vi for vi in g.value_info if not (vi.name in names or names.add(vi.name))]
    if len(infos) != len(g.value_info):
        del g.value_info[:]
        g.value_info.extend(infos)
    return dropped


# -- float16 error amplification: the block list's second rule (issue 17) --------------------
# The first rule keeps float32 the values float16 cannot hold. A value it can hold still loses
# 2**-11 of its magnitude, and a node can turn that into a large error: (h + 1000) - 1000 in
# float16 keeps h to about 0.25 (cosine 0.975 on ONNX Runtime's CUDA provider). Where a float16
# candidate fails its budget, every value of the float16 file is compared with the float32
# graph's on the verification sets, each node is ranked by the error it adds (its output's
# relative error less its inputs'), and the candidates search keeps the top ones float32.
ADDED_MIN = 1e-3  # relative error a node must add to be ranked
AMPLIFIERS_MAX = 8  # ranked nodes returned (the search tries 1, 2, 4, 8 of them)
AMPLITUDE_RATIO = 16.0  # an upstream value this many times the amplifier's output RMS is
# what it cancels (float16 keeps it to 2**-11 of that magnitude): its producer stays float32
UPSTREAM_MAX = 16  # nodes kept float32 with one amplifier at most
ERR_CAP = 1e3  # relative error of a value that is inf/nan or of another shape in float16


def relative_error(a: Any, ref: Any) -> float:
    """Relative normwise error of ``a`` against ``ref`` over the elements finite in ``ref``
    (ERR_CAP where they cannot be compared, or ``a`` is not finite where ``ref`` is, or not
    the same inf or nan where ``ref`` is not finite: a guarded division's inf is the model's
    own)."""
    if not isinstance(a, np.ndarray) or not isinstance(ref, np.ndarray) or a.shape != ref.shape:
        return ERR_CAP
    x, r = a.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    fin = np.isfinite(r)
    if not fin.all():
        same = (x[~fin] == r[~fin]) | (np.isnan(x[~fin]) & np.isnan(r[~fin]))
        if not same.all():
            return ERR_CAP
        x, r = x[fin], r[fin]
    if not np.isfinite(x).all():
        return ERR_CAP
    denom = float(np.linalg.norm(r))
    err = float(np.linalg.norm(x - r))
    return min(ERR_CAP, err / denom) if denom > 0 else (0.0 if err == 0 else ERR_CAP)


def _rms(a: np.ndarray) -> float:
    """Root mean square of the finite elements (0 for none)."""
    x = a[np.isfinite(a)].astype(np.float64)
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def _providers(names: list[str] | None) -> list[Any]:
    """ONNX Runtime providers for a measuring session: CUDA computes float32 without TF32
    (as the sandbox verifies); providers this ONNX Runtime lacks are left out."""
    import onnxruntime as ort

    from onnxmedic._sandbox_worker import TF32_OFF

    have = set(ort.get_available_providers())
    return [(p, dict(TF32_OFF)) if p == "CUDAExecutionProvider" else p
            for p in (names or []) if p in have] or ["CPUExecutionProvider"]


def value_errors(p32: Any, p16: Any, feeds: list[dict[str, np.ndarray]],
                 providers: list[str] | None = None, chunk_bytes: int = CHUNK_BYTES
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """(relative error of each float16 value of the model ``p16`` against float32 ``p32``'s,
    worst over the feeds; RMS of each float32 value of ``p32``, largest over the feeds), for
    the top-level float node outputs both graphs compute under one name (the converter keeps
    them)."""
    made16 = {o for n in p16.graph.node for o in n.output}
    outs = [o.name for o in p32.graph.output]
    names = list(dict.fromkeys(o for n in p32.graph.node for o in n.output
                               if o and o in made16 and o not in outs))
    errs: dict[str, float] = {}
    rms: dict[str, float] = {}
    prov = _providers(providers)
    with tempfile.TemporaryDirectory(prefix="onnxmedic-fp16-") as tmp:
        for chunk in value_chunks(p32, names, chunk_bytes // 2):
            s32 = session_exposing(p32, chunk, tmp, prov)
            s16 = session_exposing(p16, chunk, tmp, prov)
            for feed in feeds:
                ref = s32.run(None, feed)
                got = s16.run(None, feed)
                for name, r, a in zip(outs + chunk, ref, got):
                    if isinstance(r, np.ndarray) and r.dtype == np.float32:
                        errs[name] = max(errs.get(name, 0.0), relative_error(a, r))
                        rms[name] = max(rms.get(name, 0.0), _rms(r))
            del s32, s16
    return errs, rms


def _upstream(node: Any, producer: dict[str, Any], rms: dict[str, float],
              out_rms: float) -> list[str]:
    """``node`` and the nodes it reads from, then further up only through values of at least
    AMPLITUDE_RATIO times ``out_rms`` (what the node cancels): these stay float32 with it."""
    keep, stack = [node.name], [(node, True)]
    while stack and len(keep) < UPSTREAM_MAX:
        n, first = stack.pop()
        for i in n.input:
            p = producer.get(i)
            if p is None or p.name in keep or p.op_type == "Constant":
                continue
            if first or rms.get(i, 0.0) >= AMPLITUDE_RATIO * out_rms:
                keep.append(p.name)
                stack.append((p, False))
    return keep[:UPSTREAM_MAX]


def amplifiers(src: str, dst: str, feeds: str, float16: str,
               providers: list[str] | None = None, chunk_bytes: int = CHUNK_BYTES
               ) -> dict[str, Any]:
    """A pass-pipeline step (runs in the pass child; ``dst`` is not written): the nodes of
    ``src`` (float32, named) that add most error in ``float16`` (its float16 file that failed
    the budget), run on ``providers`` on the ``feeds`` .npz. Returns ``ranked``: up to
    AMPLIFIERS_MAX entries, largest added error first, each ``{"node", "added", "output_err",
    "input_err", "keep"}`` - ``keep`` the node with what it reads from (:func:`_upstream`)."""
    import time

    import onnx

    del dst
    t0 = time.monotonic()
    p32 = onnx.load(src)
    errs, rms = value_errors(p32, onnx.load(float16), load_feeds(feeds), providers, chunk_bytes)
    graph = p32.graph
    producer = {o: n for n in graph.node for o in n.output}
    ranked = []
    for n in graph.node:
        outs = [errs[o] for o in n.output if o in errs]
        if not outs:
            continue
        e_in = max((errs.get(i, 0.0) for i in n.input if i), default=0.0)
        if max(outs) - e_in >= ADDED_MIN:
            ranked.append((max(outs) - e_in, max(outs), e_in, n))
    ranked.sort(key=lambda r: -r[0])
    return {"ranked": [{"node": n.name, "added": added, "output_err": e_out, "input_err": e_in,
                        "keep": _upstream(n, producer, rms,
                                          max((rms.get(o, 0.0) for o in n.output), default=0.0))}
                       for added, e_out, e_in, n in ranked[:AMPLIFIERS_MAX]],
            "measured": len(errs), "seconds": round(time.monotonic() - t0, 2)}
