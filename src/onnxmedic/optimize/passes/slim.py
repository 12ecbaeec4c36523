"""The onnxslim pass (the "onnxslim" candidate): onnxslim.slim with the shapes its own
inference writes left out. Its step is named ``onnxmedic.optimize.passes:onnxslim_pass`` (as
it was before it had a file of its own), and tests/optimize/passes/test_slim.py tests it."""

from __future__ import annotations

from typing import Any

from onnxmedic.optimize.files import op_count_diff, op_counts, save_proto


def onnxslim_pass(src: str, dst: str) -> dict[str, Any]:
    """onnxslim.slim: constant folding, dead code, redundant Reshape/Cast/Transpose chains and
    its pattern fusions (Conv+BN, Gelu, Pad+Conv ...) - standard ONNX ops only (portable).
    The shapes onnxslim's own inference writes are left out (:func:`drop_slim_shapes`)."""
    import onnx
    import onnxslim

    before = op_counts(src)
    source = onnx.load(src)
    declared = {o.name: onnx.TypeProto.FromString(o.type.SerializeToString())
                for o in source.graph.output}  # before slim, which may edit ``source``
    slim = onnxslim.slim(source)
    dropped = drop_slim_shapes(slim, declared)
    save_proto(slim, dst)
    info = op_count_diff(before, op_counts(dst))
    info["shapes_dropped"] = dropped
    return info


def drop_slim_shapes(proto: Any, declared: dict[str, Any]) -> int:
    """Clear the shapes of ``proto``'s intermediate values (element types kept) and give its
    outputs the source graph's ``declared`` types (TypeProto by output name): onnxslim's own
    symbolic inference writes dims that equate sizes which differ at other input sizes
    (julius' FFT filter: an rfft's last dim named like the padded signal's, not half of it),
    and ONNX Runtime's memory planner trusts them ("Shape mismatch attempting to re-use
    buffer" at every size but the example's). ONNX Runtime infers the shapes itself. Returns
    how many shapes were cleared."""
    cleared = 0
    for vi in proto.graph.value_info:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            vi.type.tensor_type.ClearField("shape")
            cleared += 1
    for out in proto.graph.output:
        if out.name in declared:
            out.type.CopyFrom(declared[out.name])
    return cleared
