"""Shape metadata repairs on the exported graph."""

from __future__ import annotations

import onnx_ir as ir


def static_dim_params(model: ir.Model) -> list[str]:
    """Dims that torch.onnx left as a symbolic name that is just a number (``dim_param: "4"``,
    seen when torch.export.Dim.AUTO specialised a dim): ONNX Runtime would treat them as free
    symbols, so a graph input could accept any size there. Make them static. Returns the
    labels of the values changed."""
    changed = []
    graph = model.graph
    values = list(graph.inputs) + list(graph.outputs) + [
        o for n in graph.all_nodes() for o in n.outputs]
    for v in values:
        if v.shape is None:
            continue
        dims = list(v.shape.dims)
        new = [int(d.value) if isinstance(d, ir.SymbolicDim) and d.value is not None
               and str(d.value).isdigit() else d for d in dims]
        if new != dims:
            v.shape = ir.Shape(new)
            changed.append(v.name or "?")
    return changed
