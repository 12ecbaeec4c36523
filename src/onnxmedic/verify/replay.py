"""The FX program an ONNX file was translated from, rebuilt from the file itself.

torch.onnx leaves on each ONNX node the FX node it translates (``pkg.torch.onnx.fx_node``:
``%add : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%x, %y),
kwargs = {})``), its stack trace and module scopes. That is the decomposed program torch.onnx
translated, node names included, which is all localisation needs: rebuilt here as an FX graph
that runs with the nn.Module's own parameters, it replaces a capture with torch.export (about
6 ms per op: 13 s of a 2,000-op model) by parsing (microseconds per op).

Nodes the ONNX optimizer removed (identities, folded constants, split outputs) carry no ONNX
node; onnxmedic export records them in the model's metadata (``RECORD``, see
``record_removed_nodes``). The rebuild is refused (``NotReplayable``: capture as before) where
the file does not describe the whole program: no metadata, a removed node others still read
and no record of it, an argument that does not parse against the op's schema, an op outside
ATen, a placeholder that is neither an ONNX input nor a parameter or buffer of the model. Its
faithfulness is also checked by the caller: the rebuilt program's outputs must match the eager
model's (see ``localize``), else capture takes over.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from onnxmedic._locate import location_from_onnx_node
from onnxmedic.findings import Location

FX_NODE = "pkg.torch.onnx.fx_node"
# model metadata onnxmedic export adds: the FX nodes no ONNX node names (the optimizer removed
# them: identities, folded constants, multi-output ops and their getitems), printed like
# FX_NODE one per line, zlib-compressed, base64
RECORD = "pkg.onnxmedic.fx_nodes"
_NODE_RE = re.compile(r"^%(\w+) : .*?= call_function\[target=(.+?)\]"
                      r"\(args = (.*), kwargs = (.*)\)$", re.S)
_INT_RE = re.compile(r"-?\d+")
_SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
# ONNX element type -> torch dtype (the types ONNX Runtime's CPU provider computes in)
_DTYPES = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32,
           7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64,
           14: torch.complex64, 15: torch.complex128, 16: torch.bfloat16}


class NotReplayable(Exception):
    """The ONNX file does not describe its FX program completely."""


@dataclass
class Ref:
    """``%name`` in an FX node's printed arguments."""

    name: str


class _GraphHolder(torch.nn.Module):
    """What torch.fx.Interpreter needs of a GraphModule: ``graph``. A GraphModule would
    generate and compile Python code for the graph (0.2 ms a node) that is never run."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        super().__init__()
        self.graph = graph


@dataclass
class Replay:
    """An FX program rebuilt from an ONNX file, with the values of its placeholders."""

    graph_module: torch.nn.Module  # has .graph, as torch.fx.Interpreter wants
    flat_inputs: list[Any]
    state_dict: dict[str, torch.Tensor]  # parameters and buffers by ONNX initializer name
    outputs: list[str]  # FX nodes returned, in the ONNX graph's output order
    onnx_nodes: dict[str, Any] = field(default_factory=dict)  # FX name -> first ONNX node

    def location(self, name: str) -> Location | None:
        """The user's line (and module path) torch.onnx recorded for FX node ``name``."""
        node = self.onnx_nodes.get(name)
        return location_from_onnx_node(node) if node is not None else None


def parse_printed(text: str) -> Any:
    """The printed ``args``/``kwargs`` as nested lists, tuples and dicts of raw atoms (str) and
    ``Ref``s. FX prints strings unquoted, so an atom is kept as text until the schema says what
    it is."""
    pos = 0

    def parse() -> Any:
        nonlocal pos
        while pos < len(text) and text[pos] == " ":
            pos += 1
        if pos >= len(text):
            raise NotReplayable("truncated arguments")
        c = text[pos]
        if c in "([{":
            close = {"(": ")", "[": "]", "{": "}"}[c]
            pos += 1
            items: list[Any] = []
            keys: list[str] = []
            while True:
                while pos < len(text) and text[pos] == " ":
                    pos += 1
                if pos < len(text) and text[pos] == close:
                    pos += 1
                    break
                if c == "{":
                    m = re.compile(r"(\w+): ").match(text, pos)
                    if not m:
                        raise NotReplayable(f"bad kwargs {text!r}")
                    keys.append(m.group(1))
                    pos = m.end()
                items.append(parse())
                while pos < len(text) and text[pos] == " ":
                    pos += 1
                if pos < len(text) and text[pos] == ",":
                    pos += 1
                elif pos >= len(text) or text[pos] != close:
                    raise NotReplayable(f"bad arguments {text!r}")
            if c == "{":
                return dict(zip(keys, items))
            return tuple(items) if c == "(" else list(items)
        end = pos
        while end < len(text) and text[end] not in ",)]}":
            end += 1
        atom = text[pos:end].strip()
        pos = end
        if atom.startswith("...[total_len"):
            raise NotReplayable("a list printed truncated")
        return Ref(atom[1:]) if atom.startswith("%") else atom

    value = parse()
    if text[pos:].strip():
        raise NotReplayable(f"trailing text in {text!r}")
    return value


def _base(typ: str) -> str:
    """'Optional[int]', 'int?' -> 'int'."""
    while True:
        m = re.fullmatch(r"Optional\[(.*)\]", typ)
        if m:
            typ = m.group(1)
        elif typ.endswith("?"):
            typ = typ[:-1]
        else:
            return typ


def _elem(typ: str) -> str:
    """The element type of a list type: 'List[int]', 'int[]', 'SymInt[2]?' -> 'int' ..."""
    typ = _base(typ)
    m = re.fullmatch(r"List\[(.*)\]", typ) or re.fullmatch(r"(.*)\[\d*\]", typ)
    return m.group(1) if m else typ


def _atom(tok: str, typ: str) -> Any:
    """One printed atom as the schema type ``typ`` wants it."""
    if tok == "None":
        return None
    base = _base(typ)
    if base == "str":
        return tok
    if tok.startswith("torch."):  # a dtype, layout or memory format (int in JIT schemas)
        v = getattr(torch, tok[len("torch."):], None)
        if not isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            raise NotReplayable(f"{tok!r} as {typ}")
        return v
    if base in ("ScalarType", "Layout", "MemoryFormat"):
        raise NotReplayable(f"{tok!r} is not a {base}")
    if base == "Device":
        return torch.device(tok)
    if tok in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[tok]
    if tok in ("True", "False"):
        return tok == "True"
    if _INT_RE.fullmatch(tok):
        return int(tok)
    try:
        return float(tok)  # 0.5, 1e-05
    except ValueError:
        pass
    try:
        v = ast.literal_eval(tok)  # complex
    except (ValueError, SyntaxError) as e:
        raise NotReplayable(f"{tok!r} as {typ}") from e
    if not isinstance(v, (bool, int, float, complex)):
        raise NotReplayable(f"{tok!r} as {typ}")
    return v


def coerce_printed(value: Any, typ: str) -> Any:
    """Printed ``value`` (from ``parse_printed``) as schema type ``typ``: refs stay refs."""
    if isinstance(value, Ref):
        return value
    if isinstance(value, (list, tuple)):
        elem = _elem(typ)
        return [coerce_printed(v, elem) for v in value]
    if isinstance(value, dict):
        raise NotReplayable("a dict argument")
    return _atom(value, typ)


def replay_target(text: str) -> Any:
    """The callable an FX node's printed target names: ``operator.getitem`` or an ATen
    overload (``torch.ops.aten.add.Tensor``); any other is refused (NotReplayable)."""
    if text in ("operator.getitem", "<built-in function getitem>"):
        return operator.getitem
    # ATen only: the file is not trusted like the model's code is, and these ops run in this
    # process (pure computations; other namespaces hold profiler, I/O and custom ops)
    m = re.fullmatch(r"torch\.ops\.(aten)\.(\w+)\.(\w+)", text)
    if not m:
        raise NotReplayable(f"target {text}")
    try:
        op = getattr(getattr(getattr(torch.ops, m.group(1)), m.group(2)), m.group(3))
    except (AttributeError, RuntimeError) as e:
        raise NotReplayable(f"target {text}") from e
    if not isinstance(op, torch._ops.OpOverload):
        raise NotReplayable(f"target {text}")
    return op


def typed_arguments(target: Any, args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` as :func:`parse_printed` read them, coerced to ``target``'s schema
    types (NotReplayable for an argument the schema does not have)."""
    if target is operator.getitem:
        if len(args) != 2 or not isinstance(args[0], Ref):
            raise NotReplayable("getitem")
        return (args[0], _atom(args[1], "int")), {}
    schema = target._schema.arguments
    positional = [a for a in schema if not a.kwarg_only]
    if len(args) > len(positional):
        raise NotReplayable(f"{target}: too many arguments")
    by_name = {a.name: a for a in schema}
    out_args = tuple(coerce_printed(v, str(a.type)) for v, a in zip(args, positional))
    out_kwargs = {}
    for k, v in kwargs.items():
        if k not in by_name:
            raise NotReplayable(f"{target}: no argument {k}")
        out_kwargs[k] = coerce_printed(v, str(by_name[k].type))
    return out_args, out_kwargs


def _refs(value: Any) -> list[str]:
    if isinstance(value, Ref):
        return [value.name]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v)]
    return []


def _placeholder_name(prefix: str, fqn: str) -> str:
    """The name torch.export gives a lifted parameter or buffer (placeholder_naming_pass):
    prefix + the path without a leading 'self_', other characters as '_', lower case."""
    if fqn.startswith("self_"):
        fqn = fqn[len("self_"):]
    return prefix + re.sub(r"[^a-zA-Z0-9]", "_", fqn).lower()


def _state_names(model: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Placeholder name (as torch.export lifts it, see ``_placeholder_name``) -> (dotted
    path, tensor). A name two paths collapse to is left out (ambiguous)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    clash: set[str] = set()
    for prefix, items in (("p_", model.named_parameters(remove_duplicate=False)),
                          ("b_", model.named_buffers(remove_duplicate=False))):
        for fqn, t in items:
            name = _placeholder_name(prefix, fqn)
            if name in out and out[name][1] is not t:
                clash.add(name)
            out[name] = (fqn, t)
    for name in clash:
        del out[name]
    return out


def _meta_val(shape: Any, elem_type: int, sizes: dict[str, int], big: int
              ) -> torch.Tensor | None:
    """A meta tensor of an ONNX value's type: its size sizes the chunks. A symbolic dim is
    the size the inputs give it, else ``big`` (the largest input dim): too large a guess
    only makes chunks smaller."""
    dtype = _DTYPES.get(elem_type)
    if dtype is None:
        return None
    dims = [d.dim_value if d.HasField("dim_value") else sizes.get(d.dim_param, big)
            for d in shape.dim] if shape else []
    return torch.empty(dims, dtype=dtype, device="meta")


def _input_sizes(proto: Any, feeds: dict[str, np.ndarray]) -> tuple[dict[str, int], int]:
    """dim_param -> size in ``feeds``, and the largest dim of any input."""
    sizes: dict[str, int] = {}
    for vi in proto.graph.input:
        if vi.name in feeds and vi.type.HasField("tensor_type"):
            shape = np.shape(feeds[vi.name])
            for d, n in zip(vi.type.tensor_type.shape.dim, shape):
                if d.dim_param:
                    sizes[d.dim_param] = int(n)
    big = max((int(n) for v in feeds.values() for n in np.shape(v)), default=1)
    return sizes, big


def _fx_name(text: str) -> str | None:
    m = re.match(r"%(\w+) : ", text)
    return m.group(1) if m else None


def record_removed_nodes(onnx_program: Any) -> int:
    """Add to ``onnx_program``'s model metadata (``RECORD``) the FX nodes of the program it
    was translated from that no ONNX node carries any more, so that localisation can rebuild
    the whole program from the file. Returns how many were recorded (a few percent of the
    nodes: the rest are in the nodes' own metadata)."""
    import base64
    import zlib

    program = getattr(onnx_program, "exported_program", None)
    if program is None:
        return 0
    present = set()
    for node in onnx_program.model.graph:
        text = node.metadata_props.get(FX_NODE)
        if text:
            present.add(_fx_name(text))
    lines = [n.format_node() for n in program.graph.nodes
             if n.op == "call_function" and n.name not in present]
    lines = [ln for ln in lines if ln]
    if lines:
        onnx_program.model.metadata_props[RECORD] = base64.b64encode(
            zlib.compress("\n".join(lines).encode(), 6)).decode("ascii")
    return len(lines)


def _recorded(proto: Any) -> dict[str, str]:
    """FX name -> printed node, from the RECORD model metadata."""
    import base64
    import binascii
    import zlib

    text = next((p.value for p in proto.metadata_props if p.key == RECORD), None)
    if not text:
        return {}
    try:
        lines = zlib.decompress(base64.b64decode(text)).decode().split("\n")
    except (binascii.Error, zlib.error, UnicodeDecodeError) as e:
        raise NotReplayable(f"{RECORD} does not decode") from e
    return {name: ln for ln in lines if (name := _fx_name(ln))}


def _parse(text: str) -> tuple[str, tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    m = _NODE_RE.match(text)
    if not m:
        raise NotReplayable(f"FX node not parsed: {text[:100]}")
    target = replay_target(m.group(2))
    args = parse_printed(m.group(3))
    kwargs = parse_printed(m.group(4))
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise NotReplayable(f"FX node {m.group(1)}: arguments not parsed")
    return m.group(1), (target, *typed_arguments(target, args, kwargs))


# The rebuilt ops run in this process (not the sandbox): a size argument no real model of the
# file could need (over 2**31 elements) is refused, and capture takes over.
MAX_ELEMENTS = 2**31


def _check_sizes(name: str, value: Any) -> None:
    """Refuse int lists (sizes, shapes) whose element count exceeds MAX_ELEMENTS (lone ints are
    slice bounds as often, INT64_MAX for "to the end")."""
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        n = 1
        for v in value:
            n *= max(abs(v), 1)
        if n > MAX_ELEMENTS:
            raise NotReplayable(f"{name}: a size of {n} elements in the file's metadata")
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_sizes(name, v)
    elif isinstance(value, dict):
        for v in value.values():
            _check_sizes(name, v)


def _file_specs(proto: Any) -> tuple[dict[str, tuple[Any, Any, Any]], list[str], dict[str, Any]]:
    """From ``proto``'s node metadata: each FX node's (target, args, kwargs) by name, the
    names in file order, and the first ONNX node recording each."""
    specs: dict[str, tuple[Any, Any, Any]] = {}  # FX name -> (target, args, kwargs)
    order: list[str] = []
    first_onnx: dict[str, Any] = {}
    for n in proto.graph.node:
        text = next((p.value for p in n.metadata_props if p.key == FX_NODE), None)
        if text is None:
            continue
        name = _fx_name(text)
        if name is None or name in specs:
            continue
        specs[name] = _parse(text)[1]
        order.append(name)
        first_onnx[name] = n
    return specs, order, first_onnx


class _GraphBuilder:
    """Builds the FX graph from the file's node specs: placeholders for the feeds, the
    model's parameters and buffers and the folded initializers, a call_function node per
    spec, each created after the nodes it reads."""

    def __init__(self, proto: Any, model: torch.nn.Module, feeds: dict[str, np.ndarray],
                 specs: dict[str, tuple[Any, Any, Any]]) -> None:
        self.specs, self.feeds = specs, feeds
        self.recorded = _recorded(proto)
        self.inits = {i.name: i for i in proto.graph.initializer}
        self.state = _state_names(model)
        self.sizes, self.big = _input_sizes(proto, feeds)
        self.types = {}
        for vi in list(proto.graph.value_info) + list(proto.graph.output):
            if vi.type.HasField("tensor_type"):
                t = vi.type.tensor_type
                self.types[vi.name] = (t.shape if t.HasField("shape") else None, t.elem_type)
        self.graph = torch.fx.Graph()
        self.env: dict[str, torch.fx.Node] = {}
        self.flat: list[Any] = []
        self.state_dict: dict[str, torch.Tensor] = {}

    def placeholder(self, name: str, value: Any) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        self.flat.append(value)
        self.env[name] = node
        return node

    def make(self, name: str) -> None:
        """Create ``name``'s node; every name it reads is in ``env`` already."""
        if name in self.specs:
            target, args, kwargs = self.specs[name]
            _check_sizes(name, (args, kwargs))
            node = self.graph.create_node("call_function", target, self.bind(args),
                                          self.bind(kwargs), name=name)
            if node.name != name:
                raise NotReplayable(f"FX node name {name} taken")
            if name in self.types:
                val = _meta_val(*self.types[name], self.sizes, self.big)
                if val is not None:
                    node.meta["val"] = val
            self.env[name] = node
        elif name in self.feeds:
            self.placeholder(name, torch.from_numpy(np.array(self.feeds[name], copy=True)))
        elif name in self.state:
            fqn, t = self.state[name]
            self.state_dict[fqn] = t
            self.placeholder(name, t)
        elif name in self.inits:  # a constant the optimizer folded into an initializer
            from onnx import numpy_helper

            self.placeholder(name, torch.from_numpy(
                numpy_helper.to_array(self.inits[name]).copy()))
        else:
            raise NotReplayable(f"{name}: read by the program, not in the ONNX file")

    def resolve(self, root: str) -> None:
        """Create ``root`` after everything it reads, depth first with an explicit stack (a
        file's graph may be deeper than Python's recursion allows); a cycle is refused."""
        specs, env = self.specs, self.env
        stack: list[tuple[str, bool]] = [(root, False)]
        busy: set[str] = set()
        while stack:
            name, ready = stack.pop()
            if name in env:
                continue
            if ready:
                busy.discard(name)
                self.make(name)
                continue
            if name in busy:
                raise NotReplayable(f"{name}: the file's FX nodes read each other in a cycle")
            if name not in specs and name in self.recorded:
                specs[name] = _parse(self.recorded[name])[1]
            stack.append((name, True))
            if name in specs:
                busy.add(name)
                for r in reversed(_refs(specs[name][1:])):
                    if r not in env:
                        if r in busy:
                            raise NotReplayable(f"{r}: the file's FX nodes read each other "
                                                "in a cycle")
                        stack.append((r, False))

    def bind(self, value: Any) -> Any:
        """``value`` with each ``Ref`` replaced by the FX node it names."""
        if isinstance(value, Ref):
            return self.env[value.name]
        if isinstance(value, tuple):
            return tuple(self.bind(v) for v in value)
        if isinstance(value, list):
            return [self.bind(v) for v in value]
        if isinstance(value, dict):
            return {k: self.bind(v) for k, v in value.items()}
        return value


def replay_program(proto: Any, model: torch.nn.Module, feeds: dict[str, np.ndarray]
                   ) -> Replay:
    """Rebuild the FX program from ``proto``'s node metadata, parameters and buffers from
    ``model``, user inputs from ``feeds`` (the ONNX inputs). Raises ``NotReplayable``."""
    specs, order, first_onnx = _file_specs(proto)
    if not specs:
        raise NotReplayable("no torch.onnx node metadata")
    b = _GraphBuilder(proto, model, feeds, specs)
    for name in order:
        b.resolve(name)
    outputs = [o.name for o in proto.graph.output]
    for o in outputs:
        if o in specs or o in b.recorded:
            b.resolve(o)
        if o not in b.env or b.env[o].op != "call_function":
            raise NotReplayable(f"output {o} is not an FX node of the file")
    b.graph.output(tuple(b.env[o] for o in outputs))
    return Replay(_GraphHolder(b.graph), b.flat, b.state_dict, outputs, first_onnx)
