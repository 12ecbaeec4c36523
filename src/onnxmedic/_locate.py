"""Find the user's line: in a traceback, in an FX node's stack trace, in ONNX node metadata."""

from __future__ import annotations

import linecache
import re
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from onnxmedic.findings import Location

PKG_DIR = str(Path(__file__).resolve().parent).replace("\\", "/") + "/"
_LIB_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", PKG_DIR)
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def is_user_file(path: str) -> bool:
    p = path.replace("\\", "/")
    if p.startswith("<"):
        return False
    return not any(m in p for m in _LIB_MARKERS)


def location_from_frame(frame: traceback.FrameSummary) -> Location:
    """A traceback frame as a Location (its source line stripped)."""
    return Location(file=frame.filename, line=frame.lineno, function=frame.name,
                    code=(frame.line or "").strip() or None)


def location_from_traceback(tb: TracebackType | None) -> Location | None:
    """The innermost frame of the user's own code in a traceback."""
    best = None
    for frame in traceback.extract_tb(tb):
        if is_user_file(frame.filename):
            best = frame
    return None if best is None else location_from_frame(best)


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """The exception, then what it was raised from or while handling (``__cause__``, else
    ``__context__``), each once: the chain a traceback prints, innermost last."""
    chain: list[BaseException] = []
    e = exc
    while e is not None and not any(e is x for x in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def location_from_exception(exc: BaseException) -> Location | None:
    """Search the exception, its causes and its message for the user's line."""
    for e in exception_chain(exc):
        loc = location_from_traceback(e.__traceback__)
        if loc is not None:
            return loc
    return location_from_stack_text(str(exc))


def location_from_stack_text(text: str | None, module_path: str | None = None) -> Location | None:
    """The innermost user frame in a formatted stack ('File "x.py", line 3, in forward')."""
    if not text:
        return Location(module_path=module_path) if module_path else None
    frames = [(f, int(n), fn) for f, n, fn in _FRAME_RE.findall(text)]
    user = [fr for fr in frames if is_user_file(fr[0])]
    if not user:
        return Location(module_path=module_path) if module_path else None
    f, n, fn = user[-1]
    code = linecache.getline(f, n).strip() or None
    return Location(file=f, line=n, function=fn, module_path=module_path, code=code)


def module_path_from_node_meta(meta: dict[str, Any]) -> str | None:
    """'encoder.layer.3.attention' from an FX node's nn_module_stack."""
    stack = meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"L\['self'\]\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")
    return path or None


def location_from_node(node: Any) -> Location | None:
    meta = getattr(node, "meta", {}) or {}
    return location_from_stack_text(meta.get("stack_trace"), module_path_from_node_meta(meta))


def snippet(loc: Location | None, context: int = 3) -> list[tuple[int, str, bool]]:
    """Source lines around a location: (line number, text, is_the_line)."""
    if loc is None or not loc.file or not loc.line:
        return []
    lines = []
    for n in range(max(1, loc.line - context), loc.line + context + 1):
        text = linecache.getline(loc.file, n)
        if not text and n > loc.line:
            break
        lines.append((n, text.rstrip("\n"), n == loc.line))
    return lines


def location_from_onnx_node(node: Any) -> Location | None:
    """The user's line from the metadata torch.onnx leaves on each ONNX node."""
    meta = {p.key: p.value for p in getattr(node, "metadata_props", [])}
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    module_path = None
    if scopes:
        try:
            import ast

            parts = [str(s) for s in ast.literal_eval(scopes) if s][:-1]
            # torch.onnx writes each scope as the full path ('blocks.0', 'blocks.0.inner');
            # relative names ('blocks.0', 'inner') are joined
            if all(b.startswith(a + ".") for a, b in zip(parts, parts[1:])):
                module_path = parts[-1] if parts else None
            else:
                module_path = ".".join(parts) or None
        except (ValueError, SyntaxError):
            module_path = None
    return location_from_stack_text(meta.get("pkg.torch.onnx.stack_trace"), module_path)


_ORT_NODE_RE = re.compile(r"Name:'([^']*)'|node with name '([^']*)'")


def onnx_node_in_error(model: Any, message: str) -> Any:
    """The ONNX node an ONNX Runtime error message names ("... node. Name:'node_view'", or
    "... for Gemm(13) node with name 'node_linear'")."""
    m = _ORT_NODE_RE.search(message or "")
    if not m or model is None:
        return None
    name = m.group(1) if m.group(1) is not None else m.group(2)
    return next((n for n in model.graph.node if n.name == name), None)


def _value_type(vi: Any) -> str:
    t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    if t is None or not t.elem_type:
        return "?"
    import onnx

    dt = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type != 16 else \
        "bfloat16"
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in t.shape.dim] if t.HasField("shape") else ["..."]
    return f"{dt}[{', '.join(dims)}]"


def onnx_neighbourhood(model: Any, node: Any, limit: int = 6) -> dict[str, Any]:
    """The node, the producers of its inputs and the consumers of its outputs, with the values'
    types: enough of the graph around a failing node to see where its inputs come from."""
    g = model.graph
    types: dict[str, str] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        types[vi.name] = _value_type(vi)
    for init in g.initializer:
        types.setdefault(init.name, f"initializer[{', '.join(map(str, init.dims))}]")
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def label(n: Any) -> str:
        return f"{n.op_type} {n.name!r}"

    inputs = [{"value": v, "type": types.get(v, "?"),
               "from": label(producer[v]) if v in producer else
               ("graph input" if any(i.name == v for i in g.input) else "initializer")}
              for v in node.input if v]
    outputs = [{"value": v, "type": types.get(v, "?"),
                "to": [label(c) for c in consumers.get(v, [])[:limit]]
                + (["graph output"] if any(o.name == v for o in g.output) else [])}
               for v in node.output if v]
    return {"node": label(node), "inputs": inputs[:limit * 2], "outputs": outputs[:limit]}


def attribute_writes(module: Any, name: str) -> list[Location]:
    """The lines of ``module``'s class (and its bases outside torch) that write ``self.<name>``
    outside ``__init__``: an assignment (``self.n = ...``, ``self.n += ...``), an indexed one
    (``self.cache[:n] = ...``) or an in-place method (``self.cache.copy_(...)``). Found in the
    source, without running anything; [] when the source cannot be read."""
    import inspect

    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(?:\[[^\n]*\]\s*)?"
                         rf"(?:[-+*/%&|^@]|//|\*\*|<<|>>)?=(?!=)|\bself\.{re.escape(name)}"
                         rf"\.[a-z]\w*_\(")
    found: list[Location] = []
    for cls in type(module).__mro__:
        if cls.__module__.startswith(("torch.", "builtins")) or cls is object:
            continue
        try:
            lines, start = inspect.getsourcelines(cls)
            file = inspect.getsourcefile(cls)
        except (OSError, TypeError):
            continue
        function = None
        for i, text in enumerate(lines):
            m = re.match(r"\s*(?:async\s+)?def\s+(\w+)", text)
            if m:
                function = m.group(1)
            if function != "__init__" and pattern.search(text):  # the calls', not construction
                found.append(Location(file=file, line=start + i, function=function,
                                      code=text.strip()))
    return found
