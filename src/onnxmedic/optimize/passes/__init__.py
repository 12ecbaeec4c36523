"""Pass pipelines for ``onnxmedic.optimize``: each step is a function ``step(in_path, out_path,
**options) -> dict`` that writes a new ONNX file and returns what it did (fused-op counts, node
counts). Steps are named ``"module:function"`` so that a pipeline can run in a child process
(see :func:`run_pipeline`): a step that crashes or hangs becomes a rejected variant."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.optimize._child import run_request
from onnxmedic.optimize.files import (
    has_external_data,
    load_feeds,
    load_ir,
    node_subgraphs,
    op_count_diff,
    op_counts,
    save_ir,
    save_proto,
)
from onnxmedic.optimize.pass_infra import PassResult, Sequential, StepPass
from onnxmedic.optimize.slim import onnxslim_pass  # noqa: F401 - the step "passes:onnxslim_pass"

logger = logging.getLogger(__name__)

DEFAULT_PASS_TIMEOUT = 600.0


def onnxscript_optimize(src: str, dst: str) -> dict[str, Any]:
    """onnxscript.optimizer.optimize: constant folding, common-subexpression and dead-code
    elimination, function inlining. Standard ONNX ops only (portable to every runtime)."""
    import onnxscript.optimizer

    before = op_counts(src)
    model = load_ir(src)
    onnxscript.optimizer.optimize(model)
    save_ir(model, dst)
    return op_count_diff(before, op_counts(dst))


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
    onnxscript.optimizer.optimize(model)
    with contextlib.ExitStack() as stack:
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


def ort_offline(src: str, dst: str, level: str = "basic") -> dict[str, Any]:
    """ONNX Runtime's own graph optimizer, saved to a file (SessionOptions.optimized_model_filepath).
    ``basic`` is portable (standard ops only); ``extended``/``all`` emit provider-specific
    (com.microsoft, layout-specific) ops and are only valid for the provider they were made on."""
    import onnxruntime as ort

    before = op_counts(src)
    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    so.optimized_model_filepath = dst
    if has_external_data(src):  # torch.onnx.export's default: weights next to dst, not src's
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    Path(dst).name + ".data")
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return op_count_diff(before, op_counts(dst))


def quantize_int8(src: str, dst: str, nodes_to_exclude: list[str] | None = None,
                  per_channel: bool = False, reduce_range: bool = True) -> dict[str, Any]:
    """onnxruntime.quantization.quantize_dynamic: int8 weights of MatMul/Gemm (one scale per
    tensor, or per output channel with ``per_channel``), activations quantized at run time, one
    scale per tensor (CPU). ``nodes_to_exclude`` stay float32. ``reduce_range`` (the portable
    default, isa.py): 7-bit weights, which ONNX Runtime's u8s8 kernels do not saturate on any
    x86-64 CPU; False (``--target cpu:avx512-vnni``, ...): full 8-bit weights."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    before = op_counts(src)
    with tempfile.TemporaryDirectory(prefix="onnxmedic-q-") as tmp:
        pre = str(Path(tmp) / "pre.onnx")
        try:  # shape inference helps the quantizer; not required
            from onnxruntime.quantization.shape_inference import quant_pre_process

            quant_pre_process(src, pre, skip_optimization=True, skip_symbolic_shape=True)
        except Exception as e:  # noqa: BLE001 - the raw model still quantizes
            logger.debug("quant_pre_process failed: %s", e)
            pre = src
        import onnx

        layers = [n.name for n in onnx.load(pre, load_external_data=False).graph.node
                  if n.op_type in ("MatMul", "Gemm") and n.name]
        quantize_dynamic(pre, dst, weight_type=QuantType.QInt8, per_channel=per_channel,
                         reduce_range=reduce_range, op_types_to_quantize=["MatMul", "Gemm"],
                         # the quantizer splits a Gemm into <name>_MatMul + <name>_Add first
                         nodes_to_exclude=[m for n in nodes_to_exclude or []
                                           for m in (n, f"{n}_MatMul")])
    info = op_count_diff(before, op_counts(dst))
    info["excluded"] = list(nodes_to_exclude or [])
    info["layers"] = layers  # the quantizable layers, named as nodes_to_exclude expects
    info["reduce_range"] = reduce_range
    return info


# the model types ONNX Runtime's transformers optimizer knows by name (its MODEL_TYPES, read
# without importing it into the exporting process). Not "phi": that optimizer unrolls the
# local function torch's first dynamo exporter wrote per Phi-2 decoder layer and raises where
# there is none (ORT 1.32: "TypeError: 'method' object is not iterable" in preprocess_onnx on
# every torch 2.13 export); phi goes with the decoders below.
ORT_MODEL_TYPES = ("bart", "bert", "clip", "conformer", "gpt2", "gpt_neox", "qwen3", "sam2",
                   "swin", "t5", "unet", "vae", "vit")
# for the rest, the type optimum's exporter picks for the architecture (decoders as gpt2,
# seq2seq as bart, vision transformers as vit, other encoders as bert)
ORT_TYPE_FAMILIES = {
    "gpt2": ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gemma", "gemma2", "phi",
             "phi3", "falcon", "gptj", "gpt_neo", "gpt_bigcode", "bloom", "codegen", "granite",
             "olmo", "opt", "stablelm", "starcoder2", "smollm3"),
    "bart": ("whisper", "marian", "mbart", "m2m_100", "pegasus", "blenderbot", "mt5", "plbart"),
    "vit": ("segformer", "deit", "beit", "dinov2", "pix2struct", "vit_mae", "yolos"),
}


_HEADS = ("num_attention_heads", "n_head", "encoder_attention_heads", "num_heads")


def ort_model_type(model: Any) -> str | None:
    """The ``model_type`` to give ONNX Runtime's transformers optimizer for ``model``: from the
    transformers config of the model or of the first submodule that has one (a wrapper such
    as ``LastHidden(m)``). None for a model with no transformers config, or one without
    attention heads (the optimizer's fusions target transformer blocks)."""
    import torch

    mods = model.modules() if isinstance(model, torch.nn.Module) else [model]
    for m in mods:
        cfg = getattr(m, "config", None)
        name = getattr(cfg, "model_type", None)
        if isinstance(name, str) and name:
            if name in ORT_MODEL_TYPES:
                return name
            for family, names in ORT_TYPE_FAMILIES.items():
                if name in names:
                    return family
            # other encoders with attention as bert; a CNN (resnet, convnext, regnet: no
            # attention heads) has nothing for the optimizer to fuse (seen on a GPU: a wasted
            # candidate for ResNet-50)
            return "bert" if any(hasattr(cfg, a) for a in _HEADS) else None
    return None


def ort_transformers(src: str, dst: str, model_type: str = "bert") -> dict[str, Any]:
    """ONNX Runtime's transformers optimizer (``onnxruntime.transformers.optimizer``), Python
    fusions only (``opt_level=0``: ONNX Runtime's own session optimizations still run when the
    file is loaded): Attention, SkipLayerNormalization, BiasGelu, ... for ``model_type``'s
    patterns. Emits ``com.microsoft`` ops: ONNX Runtime only."""
    from onnxruntime.transformers.optimizer import optimize_model

    before = op_counts(src)
    model = optimize_model(src, model_type=model_type, opt_level=0)
    model.save_model_to_file(dst, use_external_data_format=has_external_data(src))
    info = op_count_diff(before, op_counts(dst))
    stats = getattr(model, "get_fused_operator_statistics", dict)() or {}
    info["fusions"] = {k: int(v) for k, v in stats.items() if v}
    return info


def quantize_weight_only(src: str, dst: str, nodes_to_exclude: list[str] | None = None,
                         bits: int = 8, block_size: int = 32, accuracy_level: int = 4,
                         symmetric: bool = True) -> dict[str, Any]:
    """Weight-only block-wise quantization with ONNX Runtime's own tool
    (``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``): every MatMul
    with a constant 2-D weight becomes ``com.microsoft.MatMulNBits`` with ``bits``-bit weights,
    one scale per ``block_size`` consecutive weights of a column (along K). No activation is
    quantized ahead of time; ``accuracy_level`` 4 lets the CPU kernel quantize A to int8 per
    block of the same ``block_size`` at run time (int8 dot products), 0 dequantizes the weights
    and computes in float32. A Gemm (alpha = beta = 1, no transA) is first split into MatMul +
    Add by the quantizer's own ``ONNXModel.replace_gemm_with_matmul`` (named ``<name>_MatMul``,
    which ``nodes_to_exclude`` also covers). ONNX Runtime only (a contrib op)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from onnxruntime.quantization.onnx_model import ONNXModel

    before = op_counts(src)
    model = ONNXModel(onnx.load(src))
    model.replace_gemm_with_matmul()
    layers = [n.name for n in model.graph().node if n.op_type == "MatMul" and n.name]
    quantizer = MatMulNBitsQuantizer(
        model.model, bits=bits, block_size=block_size, is_symmetric=symmetric,
        accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",),
        nodes_to_exclude=[m for n in nodes_to_exclude or [] for m in (n, f"{n}_MatMul")])
    quantizer.process()
    save_proto(quantizer.model.model, dst)
    info = op_count_diff(before, op_counts(dst))
    info["excluded"] = list(nodes_to_exclude or [])
    info["layers"] = layers
    return info


def feed_reader(feeds: list[dict[str, Any]]) -> Any:
    """ONNX Runtime's ``CalibrationDataReader`` over ``feeds`` (its quantizer and debugging
    tools read inputs so)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(feeds)

        def get_next(self) -> Any:  # a feed, None when done
            return next(self.left, None)

    return Reader()


STATIC_OPS = ("Conv", "MatMul", "Gemm")  # the layers static int8 quantizes and ranks


def with_producers(graph: Any, names: list[str]) -> list[str]:
    """``names`` and the layers (STATIC_OPS) whose outputs they read, through a Relu or Clip:
    ONNX Runtime's QDQ quantizer quantizes a value where either side of it is quantized (a
    Conv's output, with the Relu after it folded in), so a layer reads its input in float32
    only when the layer producing it is left float32 too."""
    producer = {o: n for n in graph.node for o in n.output}
    by_name = {n.name: n for n in graph.node if n.name}
    out = list(names)
    for name in names:
        for value in by_name[name].input if name in by_name else []:
            p = producer.get(value)
            while p is not None and p.op_type in ("Relu", "Clip"):
                p = producer.get(p.input[0])
            if p is not None and p.op_type in STATIC_OPS and p.name and p.name not in out:
                out.append(p.name)
    return out


def quantize_static_int8(src: str, dst: str, calibration: str,
                         nodes_to_exclude: list[str] | None = None,
                         per_channel: bool = True, reduce_range: bool = True
                         ) -> dict[str, Any]:
    """Static int8 in the QDQ format with ONNX Runtime's own quantizer
    (``onnxruntime.quantization.quantize_static``): weights int8 symmetric (one scale per output
    channel with ``per_channel``), activations uint8 with ranges fixed ahead of time - the
    min/max each tensor reaches over the ``calibration`` feeds (a ``files.save_feeds`` .npz).
    ONNX Runtime runs the QuantizeLinear/DequantizeLinear pairs around a Conv as one int8
    QLinearConv (likewise MatMul, Add, pooling): the int8 lever for convolutions, which
    quantize_dynamic turns into ConvInteger with run-time activation ranges - slower than
    float32 on the CPU (ResNet-50: 0.27x). ``nodes_to_exclude`` stay float32. Standard ONNX ops
    (portable), the accuracy depends on how well the calibration feeds cover the real inputs.
    ``reduce_range``: 7-bit weights (as :func:`quantize_int8`; int8 activations would not
    help: ONNX Runtime's x86 kernels shift them to uint8 and saturate alike)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )


    feeds = load_feeds(calibration)
    before = op_counts(src)
    graph = onnx.load(src, load_external_data=False).graph
    layers = [n.name for n in graph.node if n.op_type in STATIC_OPS and n.name]
    excluded = with_producers(graph, list(nodes_to_exclude or []))

    def run(op_types: list[str] | None) -> None:
        quantize_static(src, dst, feed_reader(feeds), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=op_types, per_channel=per_channel,
                        reduce_range=reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax, nodes_to_exclude=excluded,
                        use_external_data_format=has_external_data(src),
                        calibration_providers=["CPUExecutionProvider"])

    op_types = "every op type ONNX Runtime quantizes"
    try:
        run(None)
    except ValueError as e:  # e.g. "Quantization parameter shared mode is not supported for
        # weight yet": a constant shared by several normalisations (diffusers' VAE)
        logger.info("quantize_static on every op type failed (%s); layers only", e)
        run(list(STATIC_OPS))
        op_types = f"{', '.join(STATIC_OPS)} only (every op type: {str(e)[:120]})"
    info = op_count_diff(before, op_counts(dst))
    info["op_types"] = op_types
    info["excluded"] = excluded
    info["layers"] = layers
    info["calibration_sets"] = len(feeds)
    info["reduce_range"] = reduce_range
    return info


def is_convolutional(path: str | os.PathLike[str]) -> bool:
    """Whether convolutions make up the graph's layers (at least as many Conv nodes as
    MatMul/Gemm ones: ResNet, not a ViT or Whisper with a convolutional stem), where static
    int8 is the candidate that can pay (:func:`quantize_static_int8`)."""
    counts = op_counts(path)
    return counts["Conv"] > 0 and counts["Conv"] >= counts["MatMul"] + counts["Gemm"]


STATIC_STEP = ":quantize_static_int8"
QUANTIZE_STEPS = (":quantize_int8", ":quantize_weight_only", STATIC_STEP)


def is_static(steps: Iterable[str]) -> bool:
    """Whether the step specs ``steps`` ("module:function") quantize statically (QDQ,
    calibrated activation ranges)."""
    return any(s.endswith(STATIC_STEP) for s in steps)


def precision_error(precision: str, target: str, flags: bool = False) -> str | None:
    """Why ``precision`` cannot be built for ``target`` (None when it can): int8 is CPU-only.
    Worded with the CLI's flags (``flags``) or the API's arguments."""
    if precision != "int8" or target.partition(":")[0] == "cpu":  # cpu:<isa> too
        return None
    p, t, q = ("--precision ", "--target ", str) if flags else ("precision=", "target=", repr)
    return (f"{p}{q('int8')} is for {t}{q('cpu')} (ONNX Runtime's dynamic and weight-only int8 "
            f"kernels run on the CPU); use {p}{q('fp16')} for {t}{q(target)}")


def calibration_error(precision: str, optimize: bool = True, flags: bool = False) -> str | None:
    """Why calibration sets cannot be used (None when they can): they are static int8's, so
    for ``optimize`` at precision int8 only. Worded with the CLI's flags (``flags``) or the
    API's arguments."""
    if optimize and precision == "int8":
        return None
    if flags:
        return ("--calibration is for --optimize --precision int8" if not optimize else
                f"--calibration is for --precision int8 (static int8's activation ranges), "
                f"not {precision}")
    need, got = "precision='int8'", f"precision={precision!r}"
    if not optimize:
        need, got = f"optimize=True, {need}", f"optimize={optimize}, {got}"
    return f"calibration sets are for {need} (static int8), not {got}"


@dataclass
class Pipeline:
    """A named candidate: steps run in order, each ``(module:function, options)``."""

    name: str
    steps: list[tuple[str, dict[str, Any]]]
    precision: str = "fp32"
    portable: bool = True  # standard ONNX ops only
    note: str = ""
    options: dict[str, Any] = field(default_factory=dict)


_HERE = __name__
# the children's script: it imports this module without onnxmedic's package (torch), which
# cost each pass child 1.9 s here
CHILD = Path(__file__).resolve().parent / "_child.py"


def default_pipelines(target: str = "cpu", precision: str = "fp32",
                      model_type: str | None = None, convolutional: bool = False,
                      isa: str | None = None) -> list[Pipeline]:
    """The candidates for ``target`` and ``precision`` (the plain export is always the baseline);
    ``model_type`` (:func:`ort_model_type`) adds ONNX Runtime's transformers optimizer;
    ``convolutional`` (:func:`is_convolutional`) adds static int8 at precision int8, with
    settings for the instruction set ``isa`` (None: portable, see onnxmedic/isa.py). GPU
    targets drop the CPU-only saved levels; tensorrt keeps the portable pipelines only
    (``com.microsoft`` ops would leave TensorRT for the CUDA provider)."""
    out = [
        Pipeline("onnxscript-optimize", [(f"{_HERE}:onnxscript_optimize", {})],
                 note="constant folding, CSE, dead code"),
        Pipeline("ort-fusions", [(f"{_HERE}:ort_fusions", {})], portable=False,
                 note="onnxscript ORT fusions (com.microsoft ops)"),
        Pipeline("ort-offline-basic", [(f"{_HERE}:ort_offline", {"level": "basic"})],
                 note="ONNX Runtime basic level, saved (portable)"),
    ]
    # a peer's float32 recipe, so a candidate: chosen wherever it beats the plain export beyond
    # noise (CPU, ORT 1.32, 2 threads: 0.99-1.03x on BERT-base and GPT-2, within noise)
    out.append(Pipeline("onnxslim", [(f"{_HERE}:onnxslim_pass", {})],
                        note="onnxslim (folding, MatMul+Add -> Gemm, redundant shape ops; "
                        "portable)"))
    if target == "cpu":
        out += [Pipeline("ort-fusions-attention",
                         [(f"{_HERE}:ort_fusions", {"norm_fusions": False})], portable=False,
                         note="onnxscript ORT fusions without the skip-norm and bias-GELU ones "
                         "(slower on ONNX Runtime's CPU kernels)"),
                Pipeline("ort-offline-extended",
                         [(f"{_HERE}:ort_offline", {"level": "extended"})], portable=False,
                         note="ONNX Runtime extended level, saved: CPU provider only")]
    if model_type:
        out.append(Pipeline(f"ort-transformers-{model_type}",
                            [(f"{_HERE}:ort_transformers", {"model_type": model_type})],
                            portable=False, note="ONNX Runtime's transformers optimizer "
                            f"(model_type {model_type!r}, fusions only)"))
    if precision == "fp16":
        fp16 = "onnxmedic.optimize.fp16:float16"
        out += [Pipeline("fp16", [(f"{_HERE}:onnxscript_optimize", {}), (fp16, {})],
                         precision="fp16", note="onnxscript optimizer + float16 (float32 I/O, "
                         "measured block list)"),
                Pipeline("ort-fusions-fp16", [(f"{_HERE}:ort_fusions", {}), (fp16, {})],
                         precision="fp16", portable=False,
                         note="onnxscript ORT fusions + float16 (measured block list)")]
        if model_type and target != "cpu":  # the recipe optimum's -O4 and ORT's docs give GPUs
            out.append(Pipeline(
                f"ort-transformers-{model_type}-fp16",
                [(f"{_HERE}:ort_transformers", {"model_type": model_type}), (fp16, {})],
                precision="fp16", portable=False,
                note=f"ONNX Runtime's transformers optimizer ({model_type!r}) + float16 "
                "(measured block list)"))
    if target == "tensorrt":  # TensorRT fuses on its own and takes standard ONNX ops only
        out = [p for p in out if p.portable]
    if precision == "int8":
        out += _int8_pipelines(convolutional, isa)
    return out


def _int8_pipelines(convolutional: bool, isa: str | None = None) -> list[Pipeline]:
    """The int8 candidates (CPU): dynamic per tensor and per channel, dynamic behind the
    attention fusions, weight-only MatMulNBits; static QDQ for convolutional graphs. The
    quantize steps' defaults are portable (7-bit weights); an ``isa`` whose u8s8 kernels do
    not saturate gets full 8-bit weights. MatMulNBits saturates nowhere (signed int8 both
    sides), so it is the same for every ``isa``."""
    from onnxmedic.isa import reduce_range

    full = {} if reduce_range(isa) else {"reduce_range": False}
    opt = (f"{_HERE}:onnxscript_optimize", {})
    out = [
        Pipeline("int8-dynamic", [opt, (f"{_HERE}:quantize_int8", dict(full))],
                 precision="int8",
                 note="onnxscript optimizer + quantize_dynamic (MatMul/Gemm int8, one "
                 "weight scale per tensor)"),
        Pipeline("int8-dynamic-per-channel",
                 [opt, (f"{_HERE}:quantize_int8", {"per_channel": True, **full})],
                 precision="int8",
                 note="onnxscript optimizer + quantize_dynamic per_channel (one weight "
                 "scale per output channel)"),
        Pipeline("int8-dynamic-fused",
                 [(f"{_HERE}:ort_fusions", {"norm_fusions": False}),
                  (f"{_HERE}:quantize_int8", {"per_channel": True, **full})],
                 precision="int8", portable=False,
                 note="onnxscript ORT attention fusions (no skip-norm/bias-GELU) + "
                 "quantize_dynamic per channel: the attention that int8 leaves float32 "
                 "runs fused"),
        Pipeline("int8-weight-only",
                 [opt, (f"{_HERE}:quantize_weight_only",
                        {"bits": 8, "block_size": 32, "accuracy_level": 4})],
                 precision="int8", portable=False,
                 note="onnxscript optimizer + MatMulNBits 8-bit weights, blocks of 32, "
                 "int8 compute (accuracy_level 4; com.microsoft op)"),
    ]
    if convolutional:
        out.append(Pipeline(
            "int8-static",
            [opt, (f"{_HERE}:quantize_static_int8", {"per_channel": True, **full})],
            precision="int8", note="onnxscript optimizer + quantize_static, QDQ (Conv, "
            "MatMul, ... int8; weights per channel; activation ranges calibrated on input "
            "sets apart from the verification sets)"))
    return out


@dataclass
class PipelineRun:
    """How a pipeline ran in the pass child: ``ok``, each step's info (``{"step": spec, ...}``,
    the steps that ended), the ``error`` (""), and whether the file written differs from the
    source (``modified``: pass_infra.Sequential; False where it failed or wrote no model)."""

    ok: bool
    steps: list[dict[str, Any]]
    error: str = ""
    modified: bool = False


def run_passes(pipe: Pipeline, src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
               timeout: float = DEFAULT_PASS_TIMEOUT, writes: bool = True) -> PipelineRun:
    """Run ``pipe`` on ``src`` in a child process, writing ``dst`` (``writes=False``: measuring
    steps, which write no model). A crash, a hang past ``timeout`` or an exception is
    ``ok=False`` with the reason. The child works in a scratch directory, removed after it:
    some tools dump files into the current one (ONNX Runtime's symbolic shape inference, when
    incomplete)."""
    request = {"src": str(Path(src).absolute()), "dst": str(Path(dst).absolute()),
               "steps": pipe.steps, "writes": writes}
    with tempfile.TemporaryDirectory(prefix="onnxmedic-pass-") as tmp:
        work = Path(tmp) / "cwd"
        work.mkdir()
        run = run_request(f"{_HERE}:run_child", request, tmp, cwd=work, timeout=timeout)
    if run.timed_out:
        return PipelineRun(False, [], f"the pass did not finish within {timeout:g} s and was "
                                      "killed")
    if run.result is None:
        how = (f"signal {-run.returncode}" if run.returncode < 0
               else f"exit code {run.returncode}")
        return PipelineRun(False, [], f"the pass crashed ({how}): "
                                      f"{' '.join(run.stderr_tail)[:300]}")
    return PipelineRun(run.result["ok"], run.result["steps"], run.result.get("error", ""),
                       run.result.get("modified", False))


def run_pipeline(pipe: Pipeline, src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                 timeout: float = DEFAULT_PASS_TIMEOUT) -> tuple[bool, list[dict[str, Any]], str]:
    """:func:`run_passes` as (ok, per-step info, error)."""
    run = run_passes(pipe, src, dst, timeout=timeout)
    return run.ok, run.steps, run.error


def run_child(req_path: str, res_path: str) -> None:
    """The pass child (run by _child.py): the request's steps, one after another, as passes
    (pass_infra.StepPass in a pass_infra.Sequential)."""
    req = json.loads(Path(req_path).read_text())
    writes = req.get("writes", True)
    infos: list[dict[str, Any]] = []

    def ended(p: StepPass, result: PassResult) -> None:
        infos.append({"step": p.spec, **result.info})

    try:
        with tempfile.TemporaryDirectory(prefix="onnxmedic-step-") as tmp:
            steps = [StepPass(spec, opts, writes=writes) for spec, opts in req["steps"]]
            done = Sequential(*steps, scratch=Path(tmp), on_pass=ended)(req["src"], req["dst"])
        out = {"ok": True, "steps": infos, "modified": done.modified}
    except Exception as e:  # noqa: BLE001 - reported as a rejected variant
        spec = req["steps"][len(infos)][0] if len(infos) < len(req["steps"]) else ""
        out = {"ok": False, "steps": infos, "error": step_error(spec, e)}
    Path(res_path).write_text(json.dumps(out))


def step_error(spec: str, e: BaseException) -> str:
    """What a failed step says: the exception, the step, and where it was raised (the last
    frame, its path from the installed package or the outermost import root) - "TypeError:
    'method' object is not iterable (in onnxmedic.optimize.passes:ort_transformers, raised
    at onnxruntime/transformers/onnx_model_phi.py:450 in preprocess_onnx)"."""
    import traceback

    where = ""
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        f = frames[-1]
        path = os.path.abspath(f.filename)
        roots = sorted({os.path.abspath(p) for p in sys.path if p}, key=len)
        root = next((r for r in roots if path.startswith(r + os.sep)), None)
        path = (path[len(root) + 1:] if root else path).replace(os.sep, "/")
        for packages in ("/site-packages/", "/dist-packages/"):  # an installed package
            path = path.rsplit(packages, 1)[-1]
        where = f", raised at {path}:{f.lineno} in {f.name}"
    step = f" (in {spec}{where})" if spec else ""
    return f"{type(e).__name__}: {str(e)[:400]}{step}"
