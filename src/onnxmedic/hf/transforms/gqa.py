"""MultiHeadAttention with its KV cache -> ONNX Runtime's GroupQueryAttention, on a generation
package's decoder after onnxscript's fusions (hf/transforms/fuse_decoder.py).

After the fusions each layer's attention is ``MultiHeadAttention(q, k, v, mask)`` over
``q`` = the rotated query, ``k`` / ``v`` = the KV heads repeated to every query head after
``present.{i}.key = Concat(past_key_values.{i}.key, rotated new keys)`` (and the values').
GroupQueryAttention does all of it in one op: the new tokens' projections in
``(batch, seq, heads * head_size)``, the past, the rotary embedding from a cos / sin cache
(``do_rotary``; positions from ``seqlens_k``, the attention mask's sum - 1), the causal mask,
the grouped heads, and the present, which ONNX Runtime can write in place of the past
(``past_present_share_buffer`` in genai_config.json). So for each such layer the projections
are found by walking back from the MHA's query and from the two Concats to the
``Transpose(perm 0, 2, 1, 3)`` of a ``Reshape`` (the heads split), and the layer becomes one
GroupQueryAttention writing the MHA's output and the two presents; what fed only the old path
is removed. Where the three projections are constant MatMuls (+ bias) of one input they are
packed into one (:func:`pack_qkv`), as the GenAI model builder packs them. The cos / sin
caches are computed from the graph's own rotary frequencies (the initializer ``*inv_freq``)
for positions ``0 .. max_positions - 1``.

Only what the rewrite can see is checked here (one frequency initializer, the head counts from
the past's shape); the fused package is then verified against PyTorch like any candidate, so a
layout this rewrite gets wrong (partial rotary, interleaved rotary, a sliding window, scaled
cos / sin) is rejected there with its figure, not written.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np
import onnx_ir as ir

logger = logging.getLogger(__name__)

MS = "com.microsoft"


def _walk_back(value: ir.Value | None, match: Any, limit: int = 24) -> ir.Node | None:
    """Breadth-first from ``value`` up through its producers (at most ``limit`` values): the
    first node for which ``match(node)`` is true, or None."""
    seen, queue = set(), deque([value])
    while queue and len(seen) < limit:
        cur = queue.popleft()
        node = cur.producer() if cur is not None else None
        if node is None or cur in seen:
            continue
        seen.add(cur)
        if match(node):
            return node
        queue.extend(i for i in node.inputs if i is not None)
    return None


def _heads_split(value: ir.Value) -> ir.Value | None:
    """Walking back from ``value``, the input of the first ``Reshape`` that feeds a
    ``Transpose(perm=[0, 2, 1, 3])``: the projection before its heads were split."""
    def split(node: ir.Node) -> bool:
        if node.op_type != "Transpose" or _perm(node) != [0, 2, 1, 3]:
            return False
        src = node.inputs[0].producer()
        return src is not None and src.op_type == "Reshape"

    node = _walk_back(value, split)
    return None if node is None else node.inputs[0].producer().inputs[0]


def _perm(node: ir.Node) -> list[int]:
    return list(node.attributes.get_ints("perm", None) or [])


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The array of an initializer ``value``; None for anything else."""
    return value.const_value.numpy() if value is not None and value.is_initializer() else None


def _present_concat(value: ir.Value, kind: str) -> ir.Node | None:
    """The Concat producing a ``present.{i}.{kind}`` output, walking back from ``value``."""
    return _walk_back(value, lambda node: node.op_type == "Concat"
                      and node.outputs[0].is_graph_output()
                      and node.outputs[0].name.endswith(f".{kind}"))


def rotary_caches(graph: ir.Graph, max_positions: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(cos, sin) caches ``[max_positions, head_size / 2]`` from the graph's one
    ``*inv_freq`` initializer; None when there is not exactly one."""
    freqs = [v for name, v in graph.initializers.items() if name.endswith("inv_freq")]
    if len(freqs) != 1:
        return None
    inv = freqs[0].const_value.numpy().astype(np.float64).ravel()
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def to_gqa(model: ir.Model, max_positions: int) -> int:
    """Rewrite each layer's MultiHeadAttention + KV Concats into GroupQueryAttention (see the
    module docstring); returns the number of layers rewritten (0: the graph is unchanged)."""
    g = model.graph
    mask = next((i for i in g.inputs if i.name == "attention_mask"), None)
    caches = rotary_caches(g, max_positions)
    if caches is None or mask is None:
        return 0
    plans = []
    for node in g:
        if node.op_type != "MultiHeadAttention" or len(node.inputs) < 3:
            continue
        kc, vc = _present_concat(node.inputs[1], "key"), _present_concat(node.inputs[2], "value")
        if kc is None or vc is None or not kc.inputs[0].is_graph_input() \
                or not vc.inputs[0].is_graph_input():
            continue
        qkv = [_heads_split(v) for v in (node.inputs[0], kc.inputs[1], vc.inputs[1])]
        if None not in qkv:
            plans.append((node, kc, vc, *qkv))
    if not plans:
        return 0
    # the past key's (batch, kv heads, past, head size); a symbolic dim reads as 0
    kv_heads, head_size = (d if isinstance(d, int) else 0
                           for d in (plans[0][1].inputs[0].shape[i] for i in (1, 3)))
    tape = ir.tape.Tape()
    cos, sin = (tape.initializer(ir.tensor(c, name=f"gqa/{n}_cache"))
                for c, n in zip(caches, ("cos", "sin")))
    # seqlens_k (int32 [batch]: the attention mask's sum - 1) and total_sequence_length (int32
    # scalar: the mask's length), as the GenAI model builder computes them
    one = tape.initializer(ir.tensor(np.asarray(1, np.int64), name="gqa/one"))
    axes = tape.initializer(ir.tensor(np.asarray([1], np.int64), name="gqa/axes1"))
    mask_sum = tape.op("ReduceSum", [mask, axes], {"keepdims": 0})
    seqlens_k = tape.op("Cast", [tape.op("Sub", [mask_sum, one])], {"to": ir.DataType.INT32})
    length = tape.op("Squeeze", [tape.op("Shape", [mask], {"start": 1, "end": 2})])
    total = tape.op("Cast", [length], {"to": ir.DataType.INT32})
    attention = {}
    for mha, kc, vc, q, k, v in plans:
        attrs = {"num_heads": mha.attributes.get_int("num_heads"), "kv_num_heads": kv_heads,
                 "do_rotary": 1, "rotary_interleaved": 0}
        if mha.attributes.get_float("scale", None):
            attrs["scale"] = mha.attributes.get_float("scale")
        packed = pack_qkv((q, k, v), f"gqa/{mha.name}/qkv", tape)
        if packed is not None:
            q, k, v = packed, None, None
        olds = [mha.outputs[0], kc.outputs[0], vc.outputs[0]]
        news = tape.op_multi_out("GroupQueryAttention", [
            q, k, v, kc.inputs[0], vc.inputs[0], seqlens_k, total, cos, sin], attrs,
            num_outputs=3, domain=MS, name=f"gqa/{mha.name}")
        ir.convenience.replace_all_uses_with(olds, news, replace_graph_outputs=True)
        for old, new in zip(olds, news):  # the outputs it takes over, names and types
            new.name, new.type, new.shape = old.name, old.type, old.shape
        attention[news[0]] = attrs["num_heads"] * head_size  # its hidden size
    for i, value in enumerate(o for n in tape.nodes for o in n.outputs):
        value.name = value.name or f"gqa/v{i}"  # ours: never a name the graph holds
    for init in tape.initializers:
        g.register_initializer(init)
    g.extend(tape.nodes)
    drop_row_guards(g, set(attention))
    # the heads' Reshape -> Transpose -> Transpose -> Reshape after each attention output (the
    # export's transposes from and back to (batch, seq, heads, head_size) around the attention
    # it computed; GroupQueryAttention writes (batch, seq, hidden) already) go: the chain's
    # readers read the attention output. (ONNX Runtime cancels the transposes, not the two
    # Reshapes: a kernel each per layer and step.)
    for value, hidden in attention.items():
        end = _head_reshapes_end(value, hidden)
        if end is not None and not end.outputs[0].is_graph_output():
            ir.convenience.replace_all_uses_with(end.outputs[0], value)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    g.sort()
    model.opset_imports.setdefault(MS, 1)
    return len(plans)


def _projection(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value | None] | None:
    """(x, W, b or None) when ``value`` is ``MatMul(x, W)`` or ``Add(MatMul(x, W), b)`` with
    constant W (2-D) and b."""
    node, bias = value.producer(), None
    if node is not None and node.op_type == "Add":
        consts = [i for i in node.inputs if const_array(i) is not None]
        others = [i for i in node.inputs if const_array(i) is None]
        if len(consts) != 1 or len(others) != 1:
            return None
        bias, node = consts[0], others[0].producer()
    if node is None or node.op_type != "MatMul" or const_array(node.inputs[1]) is None \
            or const_array(node.inputs[1]).ndim != 2:
        return None
    return node.inputs[0], node.inputs[1], bias


def pack_qkv(values: tuple[ir.Value, ir.Value, ir.Value], prefix: str, tape: ir.tape.Tape
             ) -> ir.Value | None:
    """The query, key and value projections of one input as one MatMul (+ Add) over the
    concatenated weights, as the GenAI model builder packs them (GroupQueryAttention takes
    the packed projection with no separate key and value); records the nodes and
    initializers on ``tape`` and returns the packed output, or None when the three are not
    constant projections of the same input."""
    parts = [_projection(v) for v in values]
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1 \
            or len({p[2] is None for p in parts}) != 1:
        return None
    w = np.concatenate([const_array(p[1]) for p in parts], axis=1)
    out = tape.op("MatMul", [parts[0][0], tape.initializer(ir.tensor(w, name=f"{prefix}.weight"))],
                  name=f"{prefix}/MatMul")
    if parts[0][2] is None:
        return out
    b = np.concatenate([const_array(p[2]).ravel() for p in parts])
    return tape.op("Add", [out, tape.initializer(ir.tensor(b, name=f"{prefix}.bias"))],
                   name=f"{prefix}/Add")


def drop_row_guards(graph: ir.Graph, attention_outputs: set[ir.Value]) -> None:
    """Remove ``Where(row fully masked, 0, attention)`` after each attention output (the
    export's guard for rows with no visible key, which give zeros in PyTorch): the causal
    mask GroupQueryAttention applies leaves every real token a key, and the guard's mask,
    computed from the past's length, would tie the graph to a growing past (GenAI's shared
    buffer is max_length long). Only padded positions could differ."""
    def after_attention(value: ir.Value) -> bool:  # through the heads' Reshape / Transpose
        for _ in range(4):
            if value in attention_outputs:
                return True
            node = value.producer()
            if node is None or node.op_type not in ("Reshape", "Transpose"):
                return False
            value = node.inputs[0]
        return False

    guards = [n for n in graph if n.op_type == "Where"
              and (zero := const_array(n.inputs[1])) is not None
              and zero.size == 1 and not zero.any() and after_attention(n.inputs[2])]
    for n in guards:
        ir.convenience.replace_all_uses_with(n.outputs[0], n.inputs[2])
    graph.remove(guards, safe=True)


def _head_reshapes_end(value: ir.Value, hidden: int) -> ir.Node | None:
    """The last node of ``Reshape(value, [0, 0, heads, -1])`` -> ``Transpose`` -> ``Transpose``
    (the two perms composing to the identity) -> ``Reshape(.., [b, s, hidden])`` after an
    attention output ``value`` (batch, seq, ``hidden``), each the only reader of the one
    before; None when the chain is not that."""
    chain, cur = [], value
    for op in ("Reshape", "Transpose", "Transpose", "Reshape"):
        uses = list(cur.uses())
        if len(uses) != 1 or uses[0].node.op_type != op or uses[0].idx != 0:
            return None
        chain.append(uses[0].node)
        cur = uses[0].node.outputs[0]
    first, t1, t2, last = chain
    split = const_array(first.inputs[1])
    split = None if split is None else split.tolist()
    p1, p2 = _perm(t1), _perm(t2)
    if split is None or len(split) != 4 or split[:2] != [0, 0] or len(p1) != 4 \
            or sorted(p2) != [0, 1, 2, 3] or [p1[i] for i in p2] != [0, 1, 2, 3]:
        return None
    return last if _restores_hidden(last.inputs[1], hidden) else None


def _restores_hidden(shape: ir.Value, hidden: int) -> bool:
    """True when the Reshape target ``shape`` is ``[0, 0, hidden or -1]``, or the Concat of
    two computed dims and a constant ``hidden`` or -1 (the export's ``view(batch, seq, -1)``;
    the fused package's verification against PyTorch catches any other reading)."""
    if (dims := const_array(shape)) is not None:
        dims = dims.tolist()
        return len(dims) == 3 and dims[:2] == [0, 0] and dims[2] in (-1, hidden)
    node = shape.producer()
    if node is None or node.op_type != "Concat" or len(node.inputs) != 3:
        return False
    last = const_array(node.inputs[2])
    return last is not None and last.ravel().tolist() in ([hidden], [-1])


def remove_dead(graph: Any) -> int:
    """Remove nodes (and initializers) nothing reads (a subgraph of an If or Loop reads names
    of the outer graph too); returns the nodes removed."""
    needed = {o.name for o in graph.output}
    keep = []
    for n in reversed(list(graph.node)):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(n.input)
            needed.update(i for a in n.attribute for m in a.g.node for i in m.input)
    removed = len(graph.node) - len(keep)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    # deleted in place: extending the field with the kept ones would copy every weight
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name not in needed:
            del graph.initializer[i]
    return removed
