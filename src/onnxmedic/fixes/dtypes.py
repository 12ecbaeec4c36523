"""Dtypes that fit the target runtime.

ONNX Runtime answers "Could not find an implementation for Gemm(13)" at load time for an
op/dtype pair it has no kernel for (bfloat16 Gemm on CPU is the common one), and it refuses
nodes whose inputs bind one type variable to two types (int64 and float in one Add). This module
finds every such node at once from ONNX Runtime's own kernel registrations
(``onnxruntime.capi._pybind_state.get_all_opkernel_def``, asked in a child process: the table
of the installed build, not a copy of its documentation) and the ONNX schemas, and repairs them with casts:

- ``upcast``: each offending node runs in float32 between casts (PyTorch's own rounding of every
  intermediate to the low dtype is kept, so results stay close to PyTorch); a node binding one
  type variable to an integer and a float casts the integer to the float, one binding it to two
  signed integers (``Max`` of int32 and int64) widens the narrower, as PyTorch promotes;
- ``boundary``: the whole graph computes in float32, with casts only at the graph's inputs and
  outputs (fewest casts, fastest; intermediates are more precise than PyTorch's);
- ``keep``: nothing is changed; the gaps are reported.

float16 nodes without a CPU kernel are a soft gap: ONNX Runtime inserts float32 casts around them
itself (InsertCastTransformer), so they load and run; ``boundary`` still removes them.

A CPU-only onnxruntime registers no CUDA kernels; for ``--target cuda`` the table then comes from
``data/cuda_kernels.json``, parsed by tools/gen_cuda_kernels.py from the CUDAExecutionProvider
section of ONNX Runtime's generated docs/OperatorKernels.md (the commit is in the file's
``source``). That is a copy of a documentation page, so it can lag the onnxruntime-gpu release the
model will run on.

``--target tensorrt`` (ONNX Runtime's TensorrtExecutionProvider, which hands what TensorRT's ONNX
parser takes to TensorRT and leaves the rest to CUDA, then CPU) is checked against
``data/tensorrt_ops.json``, ONNX-TensorRT's operator support matrix (ops, types, restrictions;
tools/gen_trt_ops.py, the source in the file): TensorRT has no registry to query. A node it does
not take is a ``trt-fallback`` gap (the graph is split into several TensorRT engines with CUDA
nodes between them); below that, the CUDA table decides as for ``--target cuda``.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir

from onnxmedic.onnxfile import skeleton

logger = logging.getLogger(__name__)

POLICIES = ("keep", "upcast", "boundary")
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
             "tensorrt": "TensorrtExecutionProvider"}
LOW_FLOATS = {"tensor(bfloat16)", "tensor(float16)"}
_LOW_IR = {ir.DataType.BFLOAT16, ir.DataType.FLOAT16}
_FLOAT_RANK = ["tensor(double)", "tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
# signed integers, widest first: an all-integer clash is widened as torch promotes
_INT_RANK = {"tensor(int64)": ir.DataType.INT64, "tensor(int32)": ir.DataType.INT32,
             "tensor(int16)": ir.DataType.INT16, "tensor(int8)": ir.DataType.INT8}


@dataclass(frozen=True)
class KernelGap:
    """A node ONNX Runtime has no kernel for on the provider, as typed in the model."""

    node: str
    op: str
    domain: str
    since_version: int
    types: dict[str, str]  # type variable -> bound type, e.g. {"T": "tensor(bfloat16)"}
    # "no-kernel" (load fails), "soft" (ORT inserts casts), "mixed" (T bound twice),
    # "cpu-fallback" (no kernel on the GPU provider: ONNX Runtime runs the node on the CPU),
    # "trt-fallback" (TensorRT's parser does not take it: it runs on CUDA between engines)
    kind: str
    detail: str = ""
    clashing: tuple[str, ...] = ()  # for "mixed": the two types bound to one variable
    lower_opset: int | None = None  # "no-kernel" only at this op version: this opset runs it

    def describe(self) -> str:
        ts = ", ".join(f"{k}={v[7:-1] if v.startswith('tensor(') else v}"
                       for k, v in sorted(self.types.items()))
        return f"{self.op} '{self.node}' ({ts}){': ' + self.detail if self.detail else ''}"


@dataclass
class FixReport:
    policy: str
    fixed: list[KernelGap] = field(default_factory=list)
    not_fixed: list[tuple[KernelGap, str]] = field(default_factory=list)  # gap, reason
    casts_added: int = 0


KernelTable = dict[tuple[str, str], list[tuple[int, int, dict[str, set[str]]]]]
# kernel tables shipped with onnxmedic for providers a CPU-only onnxruntime does not register
_SHIPPED_TABLES = {"CUDAExecutionProvider": "cuda_kernels.json"}


# Runs in a child process: onnxruntime-gpu's get_all_opkernel_def loads every provider library
# it was built with, and segfaults (onnxruntime-gpu 1.31.1, seen on an H100 machine) when the
# TensorRT provider's libnvinfer is missing -- the usual onnxruntime-gpu install without TensorRT.
KERNEL_QUERY = """
import json, sys
from onnxruntime.capi import _pybind_state as C
json.dump([[k.provider, k.domain, k.op_name, list(k.version_range),
            {c: sorted(v) for c, v in k.type_constraints.items()}]
           for k in C.get_all_opkernel_def()], sys.stdout)
"""


Kernels = list[tuple[str, str, str, tuple[int, int], dict[str, set[str]]]]

# the query started ahead by prefetch_kernels, until registered_kernels takes its answer
_PREFETCH: list[Future[Kernels]] = []
_PREFETCH_LOCK = threading.Lock()


def prefetch_kernels() -> None:
    """Start asking onnxruntime for its kernels (registered_kernels) in a background thread,
    unless they are known or being asked already: the child process takes about half a
    second, which then runs while the model is run and captured (export's plan stage starts
    it; the default opset and the dtype fixes read the answer)."""
    with _PREFETCH_LOCK:
        if _PREFETCH or registered_kernels.cache_info().currsize:
            return
        fut: Future[Kernels] = Future()
        _PREFETCH.append(fut)

    def ask() -> None:
        try:
            fut.set_result(query_kernels())
        except BaseException as e:  # handed to the reader, who sees what a direct call would
            fut.set_exception(e)

    threading.Thread(target=ask, name="onnxmedic-kernel-query", daemon=True).start()


@functools.lru_cache(maxsize=1)
def registered_kernels() -> Kernels:
    """(provider, domain, op, (since lo, hi), {type var: types}) for every kernel the installed
    onnxruntime registers, asked in a child process (see KERNEL_QUERY); [] when the query is missing
    or the child fails (logged). Asked once per process; the answer of a query
    :func:`prefetch_kernels` started is waited for rather than asked again."""
    with _PREFETCH_LOCK:
        started = _PREFETCH.pop() if _PREFETCH else None
    if started is not None:
        return started.result()
    return query_kernels()


def query_kernels() -> Kernels:
    """The installed onnxruntime's kernels, asked now in a child process (uncached: see
    :func:`registered_kernels`); [] when the child fails, which is logged. A child, because the
    query segfaults in some onnxruntime-gpu builds."""
    import subprocess
    import sys

    try:
        p = subprocess.run([sys.executable, "-c", KERNEL_QUERY], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not ask onnxruntime for its kernels: %s", e)
        return []
    if p.returncode != 0:
        import re

        lines = [ln for ln in (re.sub(r"\x1b\[[0-9;]*m", "", ln).strip()
                               for ln in (p.stderr or "").splitlines()) if ln]
        how = (f"killed by signal {-p.returncode}" if p.returncode < 0
               else f"exit {p.returncode}")
        logger.warning("asking onnxruntime for its kernels failed (%s)%s; using the tables "
                       "onnxmedic ships", how, f": {lines[-1][:300]}" if lines else "")
        return []
    try:
        rows = json.loads(p.stdout)
    except ValueError:
        return []
    return [(prov, dom, op, (int(rng[0]), int(rng[1])), {c: set(v) for c, v in cons.items()})
            for prov, dom, op, rng, cons in rows]


@functools.lru_cache(maxsize=4)
def kernel_table(provider: str) -> KernelTable | None:
    """(domain, op) -> [(since lo, since hi, {type var: allowed types})] registered by the
    installed onnxruntime for ``provider``. When this build registers none for it (CUDA on a
    CPU-only onnxruntime), the table shipped in ``data/`` for that provider (see the module
    docstring); None when there is neither."""
    table: KernelTable = {}
    for prov, domain, op, (lo, hi), cons in registered_kernels():
        if prov != provider:
            continue
        table.setdefault((_domain(domain), op), []).append((lo, hi, cons))
    return table or shipped_kernel_table(provider)


@functools.lru_cache(maxsize=2)
def shipped_kernel_table(provider: str) -> KernelTable | None:
    """The kernel table onnxmedic ships for ``provider`` (same form as :func:`kernel_table`),
    or None when it ships none."""
    name = _SHIPPED_TABLES.get(provider)
    if name is None:
        return None
    res = importlib.resources.files("onnxmedic.fixes") / "data" / name
    doc = json.loads(res.read_text(encoding="utf-8"))
    if doc.get("provider") != provider:
        raise ValueError(f"{name} is a table for {doc.get('provider')}, not {provider}")
    table: KernelTable = {}
    for k in doc["kernels"]:
        lo, hi = k["since"]
        table.setdefault((k["domain"], k["op"]), []).append(
            (lo, hi, {c: set(v) for c, v in k["types"].items()}))
    logger.debug("kernel table for %s from %s (%s)", provider, name, doc.get("source"))
    return table or None


def _type_str(tp: onnx.TypeProto) -> str | None:
    if tp.HasField("tensor_type") and tp.tensor_type.elem_type:
        return f"tensor({onnx.helper.tensor_dtype_to_string(tp.tensor_type.elem_type)[len('TensorProto.'):].lower()})"
    return None


def _value_types(model: onnx.ModelProto) -> dict[str, str]:
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model), data_prop=False)
    except Exception:  # a model the checker rejected: work with what is declared
        inferred = model
    g = inferred.graph
    types: dict[str, str] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        t = _type_str(vi.type)
        if t:
            types[vi.name] = t
    for init in g.initializer:
        types[init.name] = _type_str(onnx.helper.make_tensor_type_proto(init.data_type, None)) or ""
    for node in g.node:  # Constant nodes: shape inference may not list their outputs
        if node.op_type == "Constant" and node.output[0] not in types:
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = _type_str(
                        onnx.helper.make_tensor_type_proto(a.t.data_type, None)) or ""
    return types


def _bind(schema: Any, node: onnx.NodeProto,
          types: dict[str, str]) -> tuple[dict[str, str], str, tuple[str, ...]]:
    """Type variable -> bound type for ``node``, and the first conflict (text, both types)."""
    bound: dict[str, str] = {}
    conflict = ""
    clashing: tuple[str, ...] = ()

    def visit(params: Any, names: Any, check: bool = True) -> None:
        nonlocal conflict, clashing
        for i, name in enumerate(names):
            if not name or name not in types:
                continue
            p = params[min(i, len(params) - 1)] if params else None
            if p is None or (i >= len(params) and
                             p.option != onnx.defs.OpSchema.FormalParameterOption.Variadic):
                continue
            tv = p.type_str
            if tv.startswith(("tensor(", "seq(", "optional(")):
                continue
            t = types[name]
            if check and tv in bound and bound[tv] != t and not conflict:
                conflict = f"{tv} is both {bound[tv][7:-1]} and {t[7:-1]}"
                clashing = (bound[tv], t)
            bound.setdefault(tv, t)

    visit(schema.inputs, node.input)
    visit(schema.outputs, node.output, check=False)  # declared outputs may be the victims
    return bound, conflict, clashing


def _domain(domain: str) -> str:
    """ai.onnx spelled as ONNX Runtime's tables and onnx.defs spell it: the empty string."""
    return "" if domain in ("", "ai.onnx") else domain


_OPEN = 2**31 - 1  # a kernel registered without an end version


def version_matches(lo: int, hi: int, since: int) -> bool:
    """ONNX Runtime's own rule (KernelRegistry::VerifyKernelDef): a kernel without an end
    version serves only the schema version it starts at (RandomUniformLike's kernel from
    version 1 does not serve RandomUniformLike-22); a versioned one serves its range."""
    return lo == since or (lo < since <= hi and hi != _OPEN)


def _has_kernel(kernels: list[tuple[int, int, dict[str, set[str]]]], since: int,
                bound: dict[str, str]) -> bool:
    return any(version_matches(lo, hi, since) and
               all(c not in bound or bound[c] in allowed for c, allowed in cons.items())
               for lo, hi, cons in kernels)


def _older_kernel(kernels: list[tuple[int, int, dict[str, set[str]]]], since: int,
                  bound: dict[str, str]) -> int | None:
    """The newest schema version below ``since`` with a kernel for these types, if any: a
    lower opset would run the node."""
    return max((lo for lo, _, cons in kernels if lo < since and
                all(c not in bound or bound[c] in allowed for c, allowed in cons.items())),
               default=None)


@functools.lru_cache(maxsize=1)
def tensorrt_table() -> dict[str, Any]:
    """ONNX-TensorRT's support matrix: {"source", "tensorrt", "opset": [lo, hi], "ops": {op:
    {"supported", "types", "restrictions"}}} (see the module docstring)."""
    res = importlib.resources.files("onnxmedic.fixes") / "data" / "tensorrt_ops.json"
    return json.loads(res.read_text(encoding="utf-8"))


def _tensorrt_reason(node: onnx.NodeProto, types: dict[str, str]) -> str:
    """Why TensorRT's parser does not take ``node`` as typed ("" when it does). The matrix lists
    each op's data types: the type of the first input (the data operand) is checked, and every
    other floating-point operand; integer operands after the first are indices, axes, shapes
    and sizes, which the parser takes as int32/int64 whatever the row lists. Cast/CastLike are
    checked on their output type too."""
    row = tensorrt_table()["ops"].get(node.op_type)
    if row is None or not row["supported"]:
        return "not in ONNX-TensorRT's supported operators"
    allowed = set(row["types"])
    checked: list[str] = []
    for i, name in enumerate(node.input):
        t = types.get(name)
        if not name or t is None:
            continue
        if i == 0 or t in _FLOAT_RANK:
            checked.append(t)
    if node.op_type in ("Cast", "CastLike") and node.output and node.output[0] in types:
        checked.append(types[node.output[0]])
    bad = sorted({t for t in checked if t not in allowed})
    if not bad:
        return ""
    names = ", ".join(t[7:-1] for t in bad)
    extra = " (TensorRT casts double down to float, clamping, where it takes it at all)" \
        if "tensor(double)" in bad else ""
    return f"ONNX-TensorRT takes {node.op_type} for {', '.join(t[7:-1] for t in row['types'])}, " \
           f"not {names}{extra}"


def _tensorrt_gaps(model: onnx.ModelProto) -> list[KernelGap]:
    cuda = {g.node: g for g in kernel_gaps(model, "cuda") or []}
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    types = _value_types(model)
    gaps: list[KernelGap] = []
    for node in model.graph.node:
        name = node.name or node.output[0]
        dom = _domain(node.domain)
        below = cuda.get(name)
        if below is not None and below.kind == "mixed":
            gaps.append(below)  # invalid on every provider
            continue
        if dom != "":
            reason = f"{node.domain} ops are not TensorRT's (ONNX Runtime runs them on CUDA)"
            schema = None
        else:
            try:
                schema = onnx.defs.get_schema(node.op_type, opsets.get(dom, 1), dom)
            except Exception:
                continue  # an unknown op is the checker's business
            reason = _tensorrt_reason(node, types)
        if not reason:
            continue
        if below is not None:  # not TensorRT's, and no CUDA kernel either
            gaps.append(KernelGap(below.node, below.op, below.domain, below.since_version,
                                  below.types, below.kind, reason, below.clashing))
        else:
            bound = _bind(schema, node, types)[0] if schema is not None else {}
            gaps.append(KernelGap(name, node.op_type, dom,
                                  schema.since_version if schema is not None else 0, bound,
                                  "trt-fallback", reason))
    return gaps


def tensorrt_partitions(model: onnx.ModelProto, gaps: list[KernelGap]) -> int:
    """How many TensorRT engines the graph splits into: connected groups of the top-level nodes
    TensorRT takes (nodes joined by a value one produces and the other consumes)."""
    away = {g.node for g in gaps}
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer: dict[str, int] = {}
    for i, node in enumerate(model.graph.node):
        if (node.name or (node.output[0] if node.output else "")) in away:
            continue
        parent[i] = i
        for v in node.output:
            producer[v] = i
        for v in node.input:
            j = producer.get(v)
            if j is not None:
                parent[find(i)] = find(j)
    return len({find(i) for i in parent})


def kernel_gaps(model: onnx.ModelProto, target: str = "cpu") -> list[KernelGap] | None:
    """Every top-level node of ``model`` that ONNX Runtime cannot run as typed on ``target``
    (None when the installed onnxruntime has no kernel table for it)."""
    if target == "tensorrt":
        return _tensorrt_gaps(model)
    table = kernel_table(PROVIDERS.get(target, target))
    if table is None:
        return None
    # on a GPU provider a node without a kernel there runs on the CPU (slower), not a failure
    cpu_table = kernel_table(PROVIDERS["cpu"]) if target != "cpu" else None
    opsets = {_domain(o.domain): o.version
              for o in model.opset_import}
    local = {(f.domain, f.name) for f in model.functions}
    types = _value_types(model)
    gaps: list[KernelGap] = []
    tainted: set[str] = set()  # values downstream of mixed types: unknowable until repaired
    for node in model.graph.node:
        dom = _domain(node.domain)
        if tainted.intersection(node.input):
            tainted.update(node.output)
            continue
        if (node.domain, node.op_type) in local or dom not in ("", "com.microsoft"):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opsets.get(dom, 1), dom)
        except Exception:
            continue  # an unknown op is the checker's business
        bound, conflict, clashing = _bind(schema, node, types)
        name = node.name or node.output[0]
        if conflict:
            tainted.update(node.output)
            gaps.append(KernelGap(name, node.op_type, dom, schema.since_version, bound, "mixed",
                                  conflict, clashing))
            continue
        kernels = table.get((dom, node.op_type))
        if kernels is None:
            if cpu_table is not None and _has_kernel(cpu_table.get((dom, node.op_type)) or [],
                                                     schema.since_version, bound):
                gaps.append(KernelGap(name, node.op_type, dom, schema.since_version, bound,
                                      "cpu-fallback", f"no {target} kernel for {node.op_type} "
                                      "at all"))
            continue  # no kernel at all: a function op ONNX Runtime expands, or not ours to judge
        if _has_kernel(kernels, schema.since_version, bound):
            continue
        if cpu_table is not None and _has_kernel(cpu_table.get((dom, node.op_type)) or [],
                                                 schema.since_version, bound):
            gaps.append(KernelGap(name, node.op_type, dom, schema.since_version, bound,
                                  "cpu-fallback"))
            continue
        low = {t for t in bound.values() if t in LOW_FLOATS}
        as_float = {c: ("tensor(float)" if t in LOW_FLOATS else t) for c, t in bound.items()}
        soft = (low == {"tensor(float16)"} and target == "cpu"
                and _has_kernel(kernels, schema.since_version, as_float))
        older = None if soft else _older_kernel(kernels, schema.since_version, bound)
        gaps.append(KernelGap(name, node.op_type, dom, schema.since_version, bound,
                              "soft" if soft else "no-kernel",
                              lower_opset=None if older is None else schema.since_version - 1))
    return gaps


def _cast(value: ir.Value, to: ir.DataType, name: str) -> ir.Node:
    node = ir.node("Cast", [value], {"to": to}, name=name)
    out = node.outputs[0]
    out.name = name + "_out"
    out.dtype = to
    out.shape = value.shape
    return node


def _unique(base: str, taken: set[str]) -> str:
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def _upcast_node(graph: ir.Graph, node: ir.Node, taken: set[str],
                 int_to: ir.DataType | None = None) -> int:
    """Run ``node`` in float32: cast its low-float inputs to float32 and its low-float outputs
    back. With ``int_to`` (mixed int/float inputs) its integer inputs are cast to that float
    type instead, as PyTorch's type promotion would. Returns the number of casts added."""
    added = 0
    for i, v in enumerate(list(node.inputs)):
        if v is None or v.dtype is None:
            continue
        if int_to is not None:
            if v.dtype.is_floating_point() or v.dtype == ir.DataType.BOOL:
                continue
            to = int_to
        elif v.dtype in _LOW_IR:
            to = ir.DataType.FLOAT
        else:
            continue
        c = _cast(v, to, _unique(f"{node.name}_in{i}_{to.name.lower()}", taken))
        graph.insert_before(node, c)
        node.replace_input_with(i, c.outputs[0])
        added += 1
    if int_to is not None:
        for o in node.outputs:
            if o.dtype is not None and not o.dtype.is_floating_point() and \
                    o.dtype != ir.DataType.BOOL:
                o.dtype = int_to
        return added
    for o in node.outputs:
        if o.dtype not in _LOW_IR:
            continue
        orig, name = o.dtype, o.name
        uses = list(o.uses())
        c = _cast(o, orig, _unique(f"{node.name}_out_back", taken))
        back = c.outputs[0]
        for user, idx in uses:
            user.replace_input_with(idx, back)
        for k, out in enumerate(graph.outputs):
            if out is o:
                graph.outputs[k] = back
        o.name, back.name = _unique(f"{name}_f32", taken), name
        o.dtype = ir.DataType.FLOAT
        graph.insert_after(node, c)
        added += 1
    return added


def _widen_ints(graph: ir.Graph, node: ir.Node, clashing: set[ir.DataType],
               wide: ir.DataType, taken: set[str]) -> int:
    """An all-integer node whose type variable is bound to two integer types (``Max`` of an
    int32 and an int64): its inputs of the narrower clashing type cast to ``wide`` and its
    outputs of that type declared ``wide``, as PyTorch promotes. Returns the casts added."""
    added = 0
    for i, v in enumerate(list(node.inputs)):
        if v is None or v.dtype not in clashing or v.dtype == wide:
            continue
        c = _cast(v, wide, _unique(f"{node.name}_in{i}_{wide.name.lower()}", taken))
        graph.insert_before(node, c)
        node.replace_input_with(i, c.outputs[0])
        added += 1
    for o in node.outputs:
        if o.dtype in clashing:
            o.dtype = wide
    return added


def _boundary(graph: ir.Graph, taken: set[str]) -> int:
    """Compute the whole graph in float32: initializers, constants, casts to a low float and
    every low-float value become float32; graph inputs and outputs keep their dtypes."""
    added = 0
    for v in list(graph.initializers.values()):
        if v.dtype in _LOW_IR and v.const_value is not None:
            arr = v.const_value.numpy().astype("float32")
            v.const_value = ir.tensor(arr, name=v.name)
            v.dtype = ir.DataType.FLOAT
    for node in graph.all_nodes():
        if node.op_type == "Cast" and node.attributes.get("to") is not None and \
                node.attributes["to"].as_int() in (int(t) for t in _LOW_IR):
            node.attributes["to"] = ir.AttrInt64("to", int(ir.DataType.FLOAT))
        for a in list(node.attributes.values()):
            if a.type == ir.AttributeType.TENSOR and a.value.dtype in _LOW_IR:
                node.attributes[a.name] = ir.AttrTensor(
                    a.name, ir.tensor(a.value.numpy().astype("float32"), name=a.value.name))
            elif a.type == ir.AttributeType.INT and a.name in ("dtype", "to") and \
                    a.as_int() in (int(t) for t in _LOW_IR):
                node.attributes[a.name] = ir.AttrInt64(a.name, int(ir.DataType.FLOAT))
        for o in node.outputs:
            if o.dtype in _LOW_IR:
                o.dtype = ir.DataType.FLOAT
    for node in list(graph):  # casts to the low float are now float->float: drop them
        if node.op_type == "Cast" and node.inputs[0] is not None and \
                node.inputs[0].dtype == node.outputs[0].dtype == ir.DataType.FLOAT and \
                not node.outputs[0].is_graph_output():
            node.outputs[0].replace_all_uses_with(node.inputs[0])
            graph.remove(node, safe=True)
    for i, inp in enumerate(list(graph.inputs)):
        if inp.dtype in _LOW_IR:
            uses = list(inp.uses())
            c = _cast(inp, ir.DataType.FLOAT, _unique(f"{inp.name}_f32", taken))
            if graph.num_nodes():
                graph.insert_before(graph.node(0), c)
            else:
                graph.append(c)
            for user, idx in uses:
                user.replace_input_with(idx, c.outputs[0])
            added += 1
    return added


def _boundary_outputs(graph: ir.Graph, want: dict[str, ir.DataType], taken: set[str]) -> int:
    added = 0
    for k, out in enumerate(list(graph.outputs)):
        orig = want.get(out.name)
        if orig is None or out.dtype == orig:
            continue
        name = out.name
        c = _cast(out, orig, _unique(f"{name}_back", taken))
        graph.append(c)
        out.name = _unique(f"{name}_f32", taken)
        c.outputs[0].name = name
        graph.outputs[k] = c.outputs[0]
        added += 1
    return added


def apply_policy(model: ir.Model, gaps: list[KernelGap], policy: str) -> FixReport:
    """Repair ``gaps`` in ``model`` (changed in place) according to ``policy`` (see the module
    docstring); soft gaps are repaired only by ``boundary``."""
    if policy not in POLICIES:
        raise ValueError(f"dtype policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    report = FixReport(policy)
    if policy == "keep":
        report.not_fixed = [(g, "dtype policy 'keep'") for g in gaps]
        return report
    report.not_fixed = [(g, "ONNX Runtime runs it on the CPU" if g.kind == "cpu-fallback" else
                         "ONNX Runtime runs it on CUDA, outside TensorRT") for g in gaps
                        if g.kind in ("cpu-fallback", "trt-fallback")]
    gaps = [g for g in gaps if g.kind not in ("cpu-fallback", "trt-fallback")]
    if policy == "upcast":
        report.not_fixed += [(g, "ONNX Runtime inserts casts itself") for g in gaps
                             if g.kind == "soft"]
        gaps = [g for g in gaps if g.kind != "soft"]
    if not gaps:
        return report
    graph = model.graph
    taken = {v.name for n in graph.all_nodes() for v in n.outputs if v.name}
    taken |= {v.name for v in graph.inputs if v.name} | set(graph.initializers)
    by_name = {n.name: n for n in graph if n.name}
    by_output = {n.outputs[0].name: n for n in graph if n.outputs}
    if policy == "boundary" and any(g.kind != "mixed" for g in gaps):
        want = {o.name: o.dtype for o in graph.outputs}
        report.casts_added += _boundary(graph, taken)
        report.casts_added += _boundary_outputs(graph, want, taken)
        report.fixed.extend(g for g in gaps if g.kind != "mixed")
        gaps = [g for g in gaps if g.kind == "mixed"]
    for g in gaps:
        node = by_name.get(g.node) or by_output.get(g.node)
        if node is None:
            report.not_fixed.append((g, "node not found"))
            continue
        floats = {t for t in (*g.types.values(), *g.clashing) if t in _FLOAT_RANK}
        if g.kind == "mixed" and not floats:
            if set(g.clashing) <= set(_INT_RANK):  # int32 and int64: widen, as torch does
                wide = next(v for t, v in _INT_RANK.items() if t in g.clashing)
                report.casts_added += _widen_ints(graph, node, {
                    _INT_RANK[t] for t in g.clashing}, wide, taken)
                report.fixed.append(g)
            else:
                report.not_fixed.append((g, "no floating-point input to cast the integers "
                                         "to, nor signed integers to widen"))
            continue
        if g.kind != "mixed" and not floats & LOW_FLOATS:
            report.not_fixed.append((g, "no bfloat16/float16 value to compute in float32"))
            continue
        int_to = None
        if g.kind == "mixed":  # the widest float among the inputs, as torch promotes
            widest = next(t for t in _FLOAT_RANK if t in floats)
            int_to = {"tensor(double)": ir.DataType.DOUBLE, "tensor(float)": ir.DataType.FLOAT,
                      "tensor(float16)": ir.DataType.FLOAT16,
                      "tensor(bfloat16)": ir.DataType.BFLOAT16}[widest]
        report.casts_added += _upcast_node(graph, node, taken, int_to)
        report.fixed.append(g)
    graph.sort()
    return report


@dataclass
class DtypeRepair:
    """A fix: the nodes without a kernel on ``target`` as typed (checked on the ONNX model
    proto), repaired per ``policy`` in the onnx_ir model (``apply``)."""

    target: str
    policy: str
    name: str = "dtype repair"
    gaps: list[KernelGap] = field(default_factory=list)

    def check(self, model: onnx.ModelProto) -> str | None:
        gaps = kernel_gaps(model, self.target)
        if gaps is None:  # the runtime stage still loads the model there and reports it
            return f"this onnxruntime has no kernel table for {self.target}"
        if not gaps:
            return f"every node has a {self.target} kernel as typed"
        self.gaps = gaps
        return None

    def apply(self, model: ir.Model) -> FixReport:
        return apply_policy(model, self.gaps, self.policy)
