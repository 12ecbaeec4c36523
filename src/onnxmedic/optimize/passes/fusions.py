"""The ONNX Runtime fusion pass (the "ort-fusions" candidates): onnxscript's ORT fusions, and the
mends of what onnxscript and onnx-ir get wrong on the way (sequence types, GPT-2's flattened
attention, FusedMatMul's batch transposes). Its step is named
``onnxmedic.optimize.passes:ort_fusions``; its test is tests/optimize/passes/test_fusions.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from onnxmedic.optimize.files import load_ir, node_subgraphs, op_count_diff, op_counts, save_ir
from onnxmedic.rewrite_speed import sibling_slices

# onnxscript's fusions that ONNX Runtime's CPU kernels run slower than the ops they replace
# (ORT 1.32, 2 threads: SkipLayerNormalization 4-7x Add + LayerNormalization at 128x768 and
# 1500x512, SkipSimplifiedLayerNormalization 2.7x, BiasGelu up to 1.2x Add + Gelu)
SKIP_NORM_FUSIONS = ("fuse_skip_layer_normalization", "fuse_skip_rms_normalization",
                     "fuse_bias_gelu")


def ort_fusions(src: str, dst: str, norm_fusions: bool = True) -> dict[str, Any]:
    """onnxscript.rewriter.ort_fusions.optimize_for_ort after the onnxscript optimizer:
    attention/MHA/GQA/SDPA, (Skip)LayerNorm/RMSNorm, rotary embedding, bias-GELU, fused MatMul.
    Emits ``com.microsoft`` ops: ONNX Runtime only. ``norm_fusions=False`` leaves out the
    residual-add norm and bias-GELU fusions (:data:`SKIP_NORM_FUSIONS`), keeping attention,
    rotary, RMSNorm and GELU: the CPU variant."""
    from unittest import mock

    import onnxscript.optimizer
    from onnxscript.rewriter.ort_fusions import _core, optimize_for_ort

    before = op_counts(src)
    model = load_ir(src)
    with contextlib.ExitStack() as stack:
        # the same graphs, sooner: the optimizer runs here and twice in fuse_xformers
        stack.enter_context(sibling_slices())
        onnxscript.optimizer.optimize(model)
        # fuse_xformers calls each fusion by its module-level name; patch.object raises
        # AttributeError if onnxscript renames one, which rejects the variant with that reason
        for name in () if norm_fusions else SKIP_NORM_FUSIONS:
            stack.enter_context(mock.patch.object(_core, name, lambda *a, **k: 0))
        stack.enter_context(keeping_sequence_types())
        model, counts = optimize_for_ort(model)
    restored = restore_flattened_attention(model)
    unbatched = unbatch_fused_matmul(model)
    save_ir(model, dst)
    info = op_count_diff(before, op_counts(dst))
    info["fusions"] = {k: int(v) for k, v in counts.items() if v}
    if restored:
        info["restored_reshapes"] = restored
    if unbatched:
        info["unbatched_fused_matmuls"] = unbatched
    return info


@contextlib.contextmanager
def keeping_sequence_types() -> Iterator[None]:
    """Mend onnx-ir 1.1's ShapeInferencePass (which onnxscript's ORT fusions run) while it is
    active: its merge copies an inferred value's ``dtype`` only, so a value ONNX infers as a
    sequence of float tensors, and which carried no type before (a Loop body's carried
    sequence: EmbeddingBag's), becomes a float *tensor* - ONNX Runtime then refuses the file
    ("Loop ... Type mismatch"). Inferred non-tensor types (sequence, optional, map) are set
    whole after the library's merge. Where onnx-ir no longer has the merge, nothing is patched."""
    from unittest import mock

    import onnx_ir as ir
    from onnx_ir.convenience import create_value_mapping
    from onnx_ir.passes.common import shape_inference

    merge = getattr(shape_inference, "_merge_func", None)
    if merge is None:
        yield
        return

    def merged(model: Any, inferred_proto: Any) -> bool:
        modified = bool(merge(model, inferred_proto))
        if not _has_non_tensor_values(inferred_proto.graph):
            return modified  # the common case: nothing to mend, no second deserialization
        inferred = ir.serde.deserialize_model(inferred_proto)
        for graph, inferred_graph in zip(model.graphs(), inferred.graphs()):
            types = {k: v.type for k, v in create_value_mapping(inferred_graph).items()}
            for name, value in create_value_mapping(graph).items():
                kind = types.get(name)
                if kind is not None and not isinstance(kind, ir.TensorType) and value.type != kind:
                    value.type = kind
                    modified = True
        return modified

    with mock.patch.object(shape_inference, "_merge_func", merged):
        yield


def _has_non_tensor_values(graph: Any) -> bool:
    """Whether a GraphProto, or one of its subgraphs, types a value other than as a tensor."""
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.type.WhichOneof("value") not in (None, "tensor_type"):
            return True
    return any(_has_non_tensor_values(g) for n in graph.node for g in node_subgraphs(n))


def restore_flattened_attention(model: Any) -> int:
    """Mend onnxscript 0.7's MultiHeadAttention fusion where it replaces a Reshape to
    ``(B*S, D)`` (GPT-2's Conv1D flattens before its Gemm) with the fused node, whose output is
    ``(B, S, D)``: the value keeps its 2-D shape, the Gemm reading it gets rank 3 and ONNX
    Runtime refuses the file. The Reshape is put back behind the fused node (to ``(-1, D)``,
    ``D`` the value's own last dim). Returns how many were restored."""
    import numpy as np
    import onnx_ir as ir
    from onnx_ir.convenience import replace_all_uses_with

    restored = 0
    for node in list(model.graph):
        if node.domain != "com.microsoft" or node.op_type not in ("MultiHeadAttention",
                                                                   "Attention"):
            continue
        out = node.outputs[0]
        if out.shape is None or len(out.shape) != 2 or not isinstance(out.shape[1], int):
            continue
        name = out.name
        out.name = f"{name}_BSD"  # the fused node's (B, S, D); the flat value keeps the name
        shape = ir.Value(name=f"{name}_flat_shape",
                         const_value=ir.tensor(np.array([-1, out.shape[1]], np.int64)))
        model.graph.register_initializer(shape)
        flat = ir.Value(name=name, shape=out.shape, type=out.type)
        replace_all_uses_with(out, flat, replace_graph_outputs=True)
        model.graph.insert_after(node, ir.Node("", "Reshape", [out, shape], outputs=[flat],
                                               name=f"{node.name}_restored_reshape"))
        out.shape = None
        restored += 1
    return restored


def unbatch_fused_matmul(model: Any) -> int:
    """Mend onnxscript 0.7's FusedMatMul rules where they fold a batch transpose
    (``Transpose(perm=[1, ..., N-2, 0, N-1])``) into ``transBatchA``/``transBatchB`` although
    the other input's rank differs (nn.Transformer's ``(S, B, D)`` input against a 2-D weight):
    ONNX Runtime's kernel needs both inputs of the same rank >= 3 then, and fails at run time.
    The Transpose is put back in front and the flag cleared (``transA``/``transB`` flip the last
    two dims after it, as the flag's definition does). Returns how many inputs were mended."""
    import onnx_ir as ir

    def rank(v: Any) -> int | None:
        return None if v is None or v.shape is None else len(v.shape)

    mended = 0
    for node in list(model.graph):
        if node.domain != "com.microsoft" or node.op_type != "FusedMatMul":
            continue
        ranks = [rank(node.inputs[0]), rank(node.inputs[1])]
        if ranks[0] is not None and ranks[0] == ranks[1] and ranks[0] >= 3:
            continue  # what the kernel supports
        for i, flag in enumerate(("transBatchA", "transBatchB")):
            n = ranks[i]
            if not node.attributes.get_int(flag, 0) or n is None:
                continue
            if n >= 3:  # at rank 2 the batch transpose is the identity
                t = ir.Node("", "Transpose", [node.inputs[i]],
                            attributes=[ir.AttrInt64s("perm", [*range(1, n - 1), 0, n - 1])],
                            name=f"{node.name}_{flag}_transpose")
                model.graph.insert_before(node, t)
                node.replace_input_with(i, t.outputs[0])
            node.attributes[flag] = ir.AttrInt64(flag, 0)
            mended += 1
    return mended
