"""Quantized PyTorch models (torch.ao eager ``quantize_dynamic``, eager ``prepare`` +
``convert``, FX ``prepare_fx`` + ``convert_fx``): a precise refusal before anything runs.

Such a model runs PyTorch's own quantized kernels (``quantized::linear_dynamic``,
``quantized::conv2d``...) on QUInt8/QInt8 tensors and packed weights held in TorchScript
objects. torch.export cannot trace them (fake tensors have no quantized kernels, and the packed
weights are opaque objects), torch.onnx has no translation for them, and the quantized tensor
types have no ONNX Runtime feed. Before this check such a model ended in an internal error
(OM009, "unsupported ScalarType QUInt8") or a misleading capture finding; now each quantized
op is named with the modules that use it and the two ways around it: export the float model
and quantize in ONNX Runtime (``--optimize --precision int8``, which verifies the int8 file),
or dequantize the module. Models quantized with PT2E (``prepare_pt2e``/``convert_pt2e``) are
not refused here: they hold float tensors and ``quantized_decomposed`` quantize/dequantize
ops, which torch.onnx translates to QuantizeLinear/DequantizeLinear (QDQ form).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from onnxmedic.findings import Finding, error, listed

logger = logging.getLogger(__name__)

STAGE = "preflight"
# the module trees of PyTorch's quantized (integer-kernel) modules; reference modules (float
# weights with quantize/dequantize around them) and FloatFunctional (float) are not among them
_QUANTIZED_PACKAGES = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized",
                       "torch.ao.nn.qat.dynamic", "torch.nn.quantized",
                       "torch.nn.intrinsic.quantized", "torch.ao.nn.quantizable")
_FLOAT_CLASSES = ("FloatFunctional",)
_SPECIAL_OPS = {"Quantize": "aten::quantize_per_tensor", "DeQuantize": "aten::dequantize",
                "QFunctional": "quantized::add / quantized::mul / quantized::cat"}
_FX_FUNCTIONS = {torch.quantize_per_tensor: "aten::quantize_per_tensor",
                 torch.quantize_per_channel: "aten::quantize_per_channel",
                 torch.quantize_per_tensor_dynamic: "aten::quantize_per_tensor_dynamic"}

SUGGESTION = (
    "Export the float model instead - the one you quantized, before quantize_dynamic / "
    "convert / convert_fx (or dequantize this module: replace it by its float counterpart, "
    "e.g. torch.nn.Linear with the dequantized weight) - and quantize in ONNX Runtime: "
    "`onnxmedic export MODEL --optimize --precision int8` (API: export(model, args, f, "
    "optimize=True, precision='int8'); static int8 with --calibration), which verifies the "
    "int8 file against the float model. Or quantize with PT2E (torchao's prepare_pt2e / "
    "convert_pt2e), whose quantize/dequantize ops export as ONNX QDQ.")


def _is_quantized_module(mod: torch.nn.Module) -> bool:
    cls = type(mod)
    return (cls.__module__.startswith(_QUANTIZED_PACKAGES) and cls.__name__ not in _FLOAT_CLASSES
            and ".reference" not in cls.__module__)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name.replace("ReLU", "Relu")).lower()


def kernel_of(mod: torch.nn.Module) -> str:
    """The quantized kernel a quantized module runs: ``quantized::linear_dynamic`` for a
    dynamic Linear, ``quantized::conv2d_relu`` for a ConvReLU2d."""
    cls = type(mod)
    if cls.__name__ in _SPECIAL_OPS:
        return _SPECIAL_OPS[cls.__name__]
    dynamic = ".dynamic" in cls.__module__
    return f"quantized::{_snake(cls.__name__)}{'_dynamic' if dynamic else ''}"


def _quantized_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """kernel -> ['path (Class)', ...] of the model's quantized modules (outermost only) and of
    quantized tensors it holds as buffers or parameters."""
    out: dict[str, list[str]] = {}
    inside: list[str] = []
    for path, mod in model.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue
        cls = type(mod)
        if _is_quantized_module(mod):
            inside.append(path)
            out.setdefault(kernel_of(mod), []).append(
                f"{path or '<root>'} ({cls.__module__}.{cls.__name__})")
            continue
        for name, t in [*mod._buffers.items(), *mod._parameters.items()]:
            if isinstance(t, torch.Tensor) and t.is_quantized:
                out.setdefault(f"quantized tensor ({t.dtype})", []).append(
                    f"{path + '.' if path else ''}{name} (held by {cls.__name__})")
    return out


def _fx_quantized_calls(model: torch.nn.Module) -> dict[str, list[str]]:
    """kernel -> ['graph node NAME', ...] of an FX GraphModule's quantize calls and quantized
    ops (convert_fx writes ``torch.quantize_per_tensor`` and ``torch.ops.quantized.*`` into
    the graph)."""
    graph = getattr(model, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return {}
    out: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        name = _FX_FUNCTIONS.get(target)
        text = str(target)
        if name is None and text.startswith("quantized.") or text.startswith("quantized::"):
            name = "quantized::" + text.split(".", 1)[-1].split("::", 1)[-1].split(".")[0]
        if name is not None:
            out.setdefault(name, []).append(f"graph node {node.name}")
    return out


def _quantized_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    flat, _ = torch.utils._pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    out = []
    for path, leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.is_quantized:
            where = ("args" if path[0].idx == 0 else "kwargs") + torch.utils._pytree.keystr(
                path[1:])
            out.append(f"{where} ({leaf.dtype}, {leaf.qscheme()})")
    return out


def quantized_findings(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> list[Finding]:
    """OM211 for each quantized kernel the model runs (the modules or graph nodes that run
    it), OM212 for quantized input tensors; [] for a float model (and a PT2E one)."""
    found: list[Finding] = []
    if isinstance(model, torch.nn.Module):
        kernels = _quantized_modules(model)
        for op, where in _fx_quantized_calls(model).items():
            kernels.setdefault(op, []).extend(where)
        for op, where in kernels.items():
            found.append(error(
                "OM211", STAGE,
                f"the model is quantized with torch.ao: {listed(where, 6)} "
                f"run{'s' if len(where) == 1 else ''} PyTorch's quantized kernel {op} on "
                "QUInt8/QInt8 tensors. That op has no ONNX form in "
                "torch.onnx (and torch.export cannot trace PyTorch's quantized kernels), so "
                "this model cannot be exported as it is.",
                op=op, suggestion=SUGGESTION,
                details={"op": op, "modules": where}))
    bad_inputs = _quantized_inputs(args, kwargs)
    if bad_inputs:
        found.append(error(
            "OM212", STAGE,
            f"example input(s) {listed(bad_inputs, 6)} are quantized tensors: ONNX Runtime "
            "has no quantized tensor type to feed (an ONNX QDQ model takes float or plain "
            "uint8/int8 inputs), and torch.export cannot trace quantized tensors.",
            suggestion="Pass the float tensor (`x.dequantize()`) and quantize inside the "
            "model (a QuantStub / torch.quantize_per_tensor first), or pass "
            "`x.int_repr()` (uint8/int8) with its scale and zero point as inputs.",
            details={"inputs": bad_inputs}))
    return found


def quantized_outputs_finding(outputs: list[Any]) -> Finding | None:
    """OM211 for a model whose outputs are quantized tensors though none of its modules is
    a torch.ao quantized one (forward() calls ``torch.quantize_per_tensor`` itself); None
    when no output is quantized."""
    bad = [f"output {i} ({t.dtype})" for i, t in enumerate(outputs)
           if isinstance(t, torch.Tensor) and t.is_quantized]
    if not bad:
        return None
    return error(
        "OM211", STAGE,
        f"forward() returns quantized tensors: {listed(bad, 6)}. A quantized tensor "
        "(torch.quantize_per_tensor and PyTorch's quantized kernels) has no ONNX form in "
        "torch.onnx and no ONNX Runtime type.",
        op="aten::quantize_per_tensor", suggestion="Return `y.dequantize()` (or "
        "`y.int_repr()` with its scale and zero point), or use the quantized_decomposed "
        "ops (PT2E form), which export as ONNX QDQ. " + SUGGESTION,
        details={"outputs": bad})


class WeightZeroPoints:
    """Fix: each DequantizeLinear of a constant int8 weight gets a zero point of its own.

    torch.onnx writes one initializer for equal constants, so the weights of a PT2E model share
    one zero point (int8 0). ONNX Runtime 1.32's x86-64 graph optimizer with
    session.x64quantprecision=1 (isa.PRECISION_CONFIG) converts each int8 weight and its zero
    point to uint8 and fails to load such a file ("AddInitializedOrtValue Attempt to replace
    the existing tensor"): a file that is to be verified and deployed with the setting needs
    its own zero point per weight. The values are the same; only names change."""

    name = "weight zero points of their own"

    @staticmethod
    def _shared(graph: Any) -> list[tuple[Any, Any]]:
        out = []
        inits = graph.initializers
        for node in graph:
            if node.op_type != "DequantizeLinear" or len(node.inputs) < 3:
                continue
            w, zp = node.inputs[0], node.inputs[2]
            if (w is None or zp is None or w.name not in inits or zp.name not in inits
                    or w.const_value is None or str(w.const_value.dtype) != "INT8"):
                continue
            if len(zp.uses()) > 1:
                out.append((node, zp))
        return out

    def check(self, model: Any) -> str | None:
        """None when a constant int8 weight's DequantizeLinear shares its zero point."""
        if self._shared(model.graph):
            return None
        return "no int8 weight's DequantizeLinear shares its zero point"

    def apply(self, model: Any) -> int:
        """Give each such DequantizeLinear (beyond the first user) its own copy; the count."""
        import onnx_ir as ir

        graph, n = model.graph, 0
        for node, zp in self._shared(graph):
            if len(zp.uses()) < 2:  # the last user keeps the original
                continue
            copy = ir.Value(name=f"{zp.name}_{node.name or n}", type=zp.type, shape=zp.shape,
                            const_value=zp.const_value)
            graph.register_initializer(copy)
            node.replace_input_with(2, copy)
            n += 1
        return n
