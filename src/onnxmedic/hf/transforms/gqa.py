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
packed into one (:func:`pack_qkv`), as the GenAI model builder packs them. The cos / sin caches are computed from the graph's own rotary frequencies (the
initializer ``*inv_freq``) for positions ``0 .. max_positions - 1``.

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
import onnx
from onnx import helper, numpy_helper

logger = logging.getLogger(__name__)

MS = "com.microsoft"


def _producers(graph: Any) -> dict[str, Any]:
    return {o: n for n in graph.node for o in n.output}


def _walk_back(name: str, prod: dict[str, Any], match: Any, limit: int = 24) -> Any:
    """Breadth-first from the value ``name`` up through its producers (at most ``limit``
    nodes): the first node for which ``match(node)`` is true, or None."""
    seen, queue = set(), deque([name])
    while queue and len(seen) < limit:
        cur = queue.popleft()
        node = prod.get(cur)
        if node is None or cur in seen:
            continue
        seen.add(cur)
        if match(node):
            return node
        queue.extend(i for i in node.input if i)
    return None


def _heads_split(name: str, prod: dict[str, Any], limit: int = 24) -> str | None:
    """Walking back from ``name``, the input of the first ``Reshape`` that feeds a
    ``Transpose(perm=[0, 2, 1, 3])``: the projection before its heads were split."""
    def split(node: Any) -> bool:
        if node.op_type != "Transpose" or list(_attr(node, "perm") or []) != [0, 2, 1, 3]:
            return False
        src = prod.get(node.input[0])
        return src is not None and src.op_type == "Reshape"

    node = _walk_back(name, prod, split, limit)
    return None if node is None else prod[node.input[0]].input[0]


def _attr(node: Any, name: str) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def _present_concat(name: str, prod: dict[str, Any], outputs: set[str], kind: str,
                    limit: int = 24) -> Any:
    """The Concat producing a ``present.{i}.{kind}`` output, walking back from ``name``."""
    return _walk_back(name, prod, lambda node: node.op_type == "Concat"
                      and node.output[0] in outputs and node.output[0].endswith(f".{kind}"),
                      limit)


def rotary_caches(graph: Any, max_positions: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(cos, sin) caches ``[max_positions, head_size / 2]`` from the graph's one
    ``*inv_freq`` initializer; None when there is not exactly one."""
    freqs = [i for i in graph.initializer if i.name.endswith("inv_freq")]
    if len(freqs) != 1:
        return None
    inv = numpy_helper.to_array(freqs[0]).astype(np.float64).ravel()
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _mask_inputs(graph: Any) -> list[Any]:
    """seqlens_k (int32 [batch]: the attention mask's sum - 1) and total_sequence_length
    (int32 scalar: the mask's length), as the GenAI model builder computes them."""
    mk = helper.make_node
    return [
        numpy_helper.from_array(np.asarray([1], np.int64), "gqa/axes1"),
        numpy_helper.from_array(np.asarray(1, np.int64), "gqa/one"),
        mk("ReduceSum", ["attention_mask", "gqa/axes1"], ["gqa/mask_sum"], keepdims=0),
        mk("Sub", ["gqa/mask_sum", "gqa/one"], ["gqa/seqlens_k64"]),
        mk("Cast", ["gqa/seqlens_k64"], ["gqa/seqlens_k"], to=onnx.TensorProto.INT32),
        mk("Shape", ["attention_mask"], ["gqa/mask_shape"], start=1, end=2),
        mk("Squeeze", ["gqa/mask_shape"], ["gqa/total64"]),
        mk("Cast", ["gqa/total64"], ["gqa/total"], to=onnx.TensorProto.INT32),
    ]


def to_gqa(proto: onnx.ModelProto, max_positions: int) -> int:
    """Rewrite each layer's MultiHeadAttention + KV Concats into GroupQueryAttention (see the
    module docstring); returns the number of layers rewritten (0: the graph is unchanged)."""
    g = proto.graph
    prod = _producers(g)
    outputs = {o.name for o in g.output}
    inputs = {i.name: i for i in g.input}
    caches = rotary_caches(g, max_positions)
    if caches is None or "attention_mask" not in inputs:
        return 0
    plans = []
    for node in g.node:
        if node.op_type != "MultiHeadAttention" or len(node.input) < 3:
            continue
        kc = _present_concat(node.input[1], prod, outputs, "key")
        vc = _present_concat(node.input[2], prod, outputs, "value")
        if kc is None or vc is None or kc.input[0] not in inputs or vc.input[0] not in inputs:
            continue
        q, k, v = (_heads_split(node.input[0], prod), _heads_split(kc.input[1], prod),
                   _heads_split(vc.input[1], prod))
        if None in (q, k, v):
            continue
        plans.append((node, kc, vc, q, k, v))
    if not plans:
        return 0
    dims = inputs[plans[0][1].input[0]].type.tensor_type.shape.dim
    kv_heads = dims[1].dim_value
    cos, sin = caches
    g.initializer.extend([numpy_helper.from_array(cos, "gqa/cos_cache"),
                          numpy_helper.from_array(sin, "gqa/sin_cache")])
    new_nodes = _mask_inputs(g)
    g.initializer.extend(n for n in new_nodes if isinstance(n, onnx.TensorProto))
    drop = set()
    for mha, kc, vc, q, k, v in plans:
        attrs = {"num_heads": _attr(mha, "num_heads"), "kv_num_heads": kv_heads,
                 "do_rotary": 1, "rotary_interleaved": 0}
        if _attr(mha, "scale"):
            attrs["scale"] = _attr(mha, "scale")
        packed = pack_qkv(g, (q, k, v), f"gqa/{mha.name}/qkv", new_nodes)
        if packed is not None:
            q, k, v = packed, "", ""
        new_nodes.append(helper.make_node(
            "GroupQueryAttention", [q, k, v, kc.input[0], vc.input[0], "gqa/seqlens_k",
                                    "gqa/total", "gqa/cos_cache", "gqa/sin_cache"],
            [mha.output[0], kc.output[0], vc.output[0]], name=f"gqa/{mha.name}", domain=MS,
            **attrs))
        drop.update(id(n) for n in (mha, kc, vc))
    kept = [n for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(kept + [n for n in new_nodes if isinstance(n, onnx.NodeProto)])
    drop_row_guards(g, {p[0].output[0] for p in plans})
    head_size = dims[3].dim_value
    drop_head_reshapes(g, {p[0].output[0]: _attr(p[0], "num_heads") * head_size
                           for p in plans})
    _toposort(g)
    remove_dead(g)
    if not any(o.domain == MS for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS, 1))
    return len(plans)


def _projection(name: str, prod: dict[str, Any], inits: dict[str, Any]
                ) -> tuple[str, Any, Any] | None:
    """(x, W, b or None) when ``name`` is ``MatMul(x, W)`` or ``Add(MatMul(x, W), b)`` with
    constant W (2-D) and b."""
    node, bias = prod.get(name), None
    if node is not None and node.op_type == "Add":
        consts = [i for i in node.input if i in inits]
        others = [i for i in node.input if i not in inits]
        if len(consts) != 1 or len(others) != 1:
            return None
        bias, node = inits[consts[0]], prod.get(others[0])
    if node is None or node.op_type != "MatMul" or node.input[1] not in inits \
            or len(inits[node.input[1]].dims) != 2:
        return None
    return node.input[0], inits[node.input[1]], bias


def pack_qkv(graph: Any, names: tuple[str, str, str], prefix: str, new_nodes: list[Any]
             ) -> str | None:
    """The query, key and value projections of one input as one MatMul (+ Add) over the
    concatenated weights, as the GenAI model builder packs them (GroupQueryAttention takes
    the packed projection with no separate key and value); appends the nodes and
    initializers to ``new_nodes`` / ``graph`` and returns the packed output, or None when the
    three are not constant projections of the same input."""
    prod = _producers(graph)
    inits = {i.name: i for i in graph.initializer}
    parts = [_projection(n, prod, inits) for n in names]
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1 \
            or len({p[2] is None for p in parts}) != 1:
        return None
    w = np.concatenate([numpy_helper.to_array(p[1]) for p in parts], axis=1)
    graph.initializer.append(numpy_helper.from_array(w, f"{prefix}.weight"))
    new_nodes.append(helper.make_node("MatMul", [parts[0][0], f"{prefix}.weight"],
                                      [f"{prefix}.mm"], name=f"{prefix}/MatMul"))
    if parts[0][2] is None:
        return f"{prefix}.mm"
    b = np.concatenate([numpy_helper.to_array(p[2]).ravel() for p in parts])
    graph.initializer.append(numpy_helper.from_array(b, f"{prefix}.bias"))
    new_nodes.append(helper.make_node("Add", [f"{prefix}.mm", f"{prefix}.bias"], [prefix],
                                      name=f"{prefix}/Add"))
    return prefix


def drop_row_guards(graph: Any, attention_outputs: set[str]) -> int:
    """Remove ``Where(row fully masked, 0, attention)`` after each attention output (the
    export's guard for rows with no visible key, which give zeros in PyTorch): the causal
    mask GroupQueryAttention applies leaves every real token a key, and the guard's mask,
    computed from the past's length, would tie the graph to a growing past (GenAI's shared
    buffer is max_length long). Only padded positions could differ. Returns the number
    removed."""
    zeros = {i.name for i in graph.initializer
             if int(np.prod(i.dims)) == 1 and not numpy_helper.to_array(i).any()}
    prod = _producers(graph)

    def after_attention(name: str) -> bool:  # through the heads' Reshape / Transpose
        for _ in range(4):
            if name in attention_outputs:
                return True
            node = prod.get(name)
            if node is None or node.op_type not in ("Reshape", "Transpose"):
                return False
            name = node.input[0]
        return False

    rename = {n.output[0]: n.input[2] for n in graph.node if n.op_type == "Where"
              and n.input[1] in zeros and after_attention(n.input[2])}
    return rewire(graph, rename, drop=True)


def _head_reshapes_end(name: str, hidden: int, users: dict[str, list[Any]],
                       inits: dict[str, Any], prod: dict[str, Any]) -> Any:
    """The last node of ``Reshape(name, [0, 0, heads, -1])`` -> ``Transpose`` -> ``Transpose``
    (the two perms composing to the identity) -> ``Reshape(.., [b, s, hidden])`` after an
    attention output ``name`` (batch, seq, ``hidden``), each the only reader of the one before;
    None when the chain is not that."""
    chain, cur = [], name
    for op in ("Reshape", "Transpose", "Transpose", "Reshape"):
        readers = users.get(cur, [])
        if len(readers) != 1 or readers[0].op_type != op or readers[0].input[0] != cur:
            return None
        chain.append(readers[0])
        cur = readers[0].output[0]
    first, t1, t2, last = chain
    split = (numpy_helper.to_array(inits[first.input[1]]).tolist()
             if first.input[1] in inits else None)
    p1, p2 = list(_attr(t1, "perm") or []), list(_attr(t2, "perm") or [])
    if split is None or len(split) != 4 or split[:2] != [0, 0] or len(p1) != 4 \
            or sorted(p2) != [0, 1, 2, 3] or [p1[i] for i in p2] != [0, 1, 2, 3]:
        return None
    return last if _restores_hidden(last.input[1], hidden, inits, prod) else None


def _restores_hidden(shape: str, hidden: int, inits: dict[str, Any], prod: dict[str, Any]
                     ) -> bool:
    """True when the Reshape target ``shape`` is ``[0, 0, hidden or -1]``, or the Concat of
    two computed dims and a constant ``hidden`` or -1 (the export's ``view(batch, seq, -1)``;
    the fused package's verification against PyTorch catches any other reading)."""
    if shape in inits:
        dims = numpy_helper.to_array(inits[shape]).tolist()
        return len(dims) == 3 and dims[:2] == [0, 0] and dims[2] in (-1, hidden)
    node = prod.get(shape)
    if node is None or node.op_type != "Concat" or len(node.input) != 3:
        return False
    last = node.input[2]
    return last in inits and numpy_helper.to_array(inits[last]).ravel().tolist() in (
        [hidden], [-1])


def drop_head_reshapes(graph: Any, attention_outputs: dict[str, int]) -> int:
    """Remove the heads' ``Reshape`` -> ``Transpose`` -> ``Transpose`` -> ``Reshape`` after each
    attention output (the export's transposes from and back to (batch, seq, heads, head_size)
    around the attention it computed; GroupQueryAttention already writes (batch, seq,
    hidden)): the readers of the chain's end read the attention output. ``attention_outputs``:
    each output's hidden size (heads x head_size). ONNX Runtime cancels
    the transposes, not the two Reshapes (a kernel each per layer and step). Returns the
    number of chains removed."""
    inits = {i.name: i for i in graph.initializer}
    users: dict[str, list[Any]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    outputs, prod = {o.name for o in graph.output}, _producers(graph)
    rename = {}
    for name, hidden in attention_outputs.items():
        end = _head_reshapes_end(name, hidden, users, inits, prod)
        if end is not None and end.output[0] not in outputs:
            rename[end.output[0]] = name
    return rewire(graph, rename)


def rewire(graph: Any, rename: dict[str, str], *, drop: bool = False) -> int:
    """Make every node read ``rename[x]`` where it read ``x`` (with ``drop``, the nodes that
    wrote the renamed values are removed first); returns the number of values renamed."""
    if drop and rename:
        keep = [n for n in graph.node if n.output[0] not in rename]
        del graph.node[:]
        graph.node.extend(keep)
    for n in graph.node:
        n.input[:] = [rename.get(i, i) for i in n.input]
    return len(rename)


def _toposort(graph: Any) -> None:
    ready = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, order = list(graph.node), []
    while pending:
        rest = []
        for n in pending:
            if all(i in ready for i in n.input):
                order.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):  # a cycle or a missing input: leave the rest in order
            order += rest
            break
        pending = rest
    del graph.node[:]
    graph.node.extend(order)


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
