"""A tied decoder's embedding read from its 4-bit LM head (issue 40), as the GenAI model
builder stores it.

Where the checkpoint ties the token embedding to the LM head (``tie_word_embeddings``), the
export has one float32 table ``E`` (vocab, hidden) read twice: by the embedding's
``Gather(E, input_ids)`` and, transposed, by the head's MatMul. Once the head is 4-bit
``MatMulNBits`` (weights ``(vocab, blocks, block_size / 2)`` uint8, scales ``(vocab,
blocks)``: one row of blocks per token), the embedding can read those same bytes with ONNX
Runtime's ``GatherBlockQuantized`` (``gather_axis`` 0, ``quantize_axis`` 1, no zero points:
MatMulNBits' default of 8) through a ``Reshape`` to (vocab, blocks * block_size / 2), and the
float32 table goes: at Qwen2.5-0.5B's shape 519 MiB of 822. The embedding then returns each
token's row as the head's 4-bit weights represent it, which the int4 task budget judges like
every other change. Asymmetric (zero points), 8-bit or untied heads are left as they are.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from onnx import helper, numpy_helper

logger = logging.getLogger(__name__)



def tied_embedding(graph: Any, head: str | None) -> tuple[str, str] | None:
    """(the embedding Gather's output, the head's output) when the graph's ``Gather(E, ids)``
    (axis 0, ``E`` a constant (vocab, hidden)) reads the transpose of the constant weight of
    the MatMul named ``head`` (the LM head after int4.fold_weight_transposes); None when
    nothing is tied so."""
    node = next((n for n in graph.node if n.name == head and n.op_type == "MatMul"), None)
    if node is None:
        return None
    inits = {i.name: i for i in graph.initializer}
    w = inits.get(node.input[1])
    if w is None or len(w.dims) != 2:
        return None
    for g in graph.node:
        axis = next((a.i for a in g.attribute if a.name == "axis"), 0)
        e = inits.get(g.input[0]) if g.op_type == "Gather" and g.domain in ("", "ai.onnx") \
            else None
        if e is None or axis != 0 or list(e.dims) != list(w.dims)[::-1]:
            continue
        if g.input[0] == node.input[1] or np.array_equal(
                numpy_helper.to_array(e), numpy_helper.to_array(w).T):
            return g.output[0], node.output[0]
    return None


def share_with_head(graph: Any, gather: str, head_output: str) -> dict[str, Any] | None:
    """Replace the embedding Gather writing ``gather`` by ``GatherBlockQuantized`` over the
    4-bit weights and scales of the MatMulNBits writing ``head_output`` (see the module
    docstring); the float32 table is removed when nothing else reads it. Returns what was
    done, or None (graph unchanged) when the head is not a symmetric 4-bit MatMulNBits."""
    prod = {o: n for n in graph.node for o in n.output}
    head = prod.get(head_output)
    g = prod.get(gather)
    if g is None or g.op_type != "Gather" or head is None or head.op_type != "MatMulNBits" \
            or any(head.input[3:]):  # zero points, g_idx or a bias
        return None
    attrs = {a.name: a.i for a in head.attribute}
    inits = {i.name: i for i in graph.initializer}
    q, s = inits.get(head.input[1]), inits.get(head.input[2])
    if attrs.get("bits") != 4 or q is None or s is None or len(q.dims) != 3:
        return None
    n, blocks, blob = q.dims
    if list(s.dims) == [n * blocks]:  # MatMulNBits takes either shape; GatherBlockQuantized
        # needs the table's rank
        s.dims[:] = [n, blocks]
    if list(s.dims) != [n, blocks]:
        return None
    base = f"{g.name or gather}/int4"
    shape = numpy_helper.from_array(np.asarray([n, blocks * blob], np.int64), f"{base}/shape")
    out = g.output[0]
    padded = blocks * attrs["block_size"] != attrs["K"]
    nodes = [helper.make_node("Reshape", [q.name, shape.name], [f"{base}/table"],
                              name=f"{base}/Reshape"),
             helper.make_node("GatherBlockQuantized", [f"{base}/table", g.input[1], s.name],
                              [f"{base}/rows" if padded else out],
                              name=f"{base}/GatherBlockQuantized", domain="com.microsoft", bits=4,
                              block_size=attrs["block_size"], gather_axis=0, quantize_axis=1)]
    new_inits = [shape]
    if padded:  # the head pads K to whole blocks: slice the padding off each row
        for name, v in (("starts", 0), ("ends", attrs["K"]), ("axes", -1)):
            new_inits.append(numpy_helper.from_array(np.asarray([v], np.int64),
                                                     f"{base}/{name}"))
        nodes.append(helper.make_node("Slice", [f"{base}/rows", f"{base}/starts",
                                                f"{base}/ends", f"{base}/axes"], [out],
                                      name=f"{base}/Slice"))
    table = g.input[0]
    at = list(graph.node).index(g)
    graph.node.remove(g)
    for k, node in enumerate(nodes):
        graph.node.insert(at + k, node)
    graph.initializer.extend(new_inits)
    freed = 0
    if not any(table in m.input for m in graph.node) and table in inits:
        freed = len(inits[table].raw_data) or int(np.prod(inits[table].dims)) * 4
        graph.initializer.remove(inits[table])
    logger.info("embedding %s reads the 4-bit LM head (%d bytes of float32 table freed)",
                gather, freed)
    return {"embedding": "int4 (shared with the LM head)", "freed_bytes": freed}
