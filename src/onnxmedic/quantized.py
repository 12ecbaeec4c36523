"""Quantized PyTorch models (torch.ao eager ``quantize_dynamic``, eager ``prepare`` +
``convert``, FX ``prepare_fx`` + ``convert_fx``): an eager model's float twin (the arithmetic
its kernels compute, in ONNX ops: ``float_twin``), or a precise refusal before anything runs.

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

from onnxmedic._torch_compat import quantized_decomposed
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


def runs_quantized_kernels(model: Any) -> bool:
    """Whether ``model`` holds torch.ao quantized modules or quantized tensors, or its FX
    graph calls quantize/quantized ops (the model computes in PyTorch's quantized kernels)."""
    return isinstance(model, torch.nn.Module) and bool(
        _quantized_modules(model) or _fx_quantized_calls(model))


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
    """Fix: each constant weight's QuantizeLinear/DequantizeLinear gets a zero point of its own.

    torch.onnx writes one initializer for equal constants, so the weights of a PT2E model share
    one zero point (int8 0). ONNX Runtime 1.32's x86-64 graph optimizer with
    session.x64quantprecision=1 (isa.PRECISION_CONFIG) converts each int8 weight and its zero
    point to uint8 and fails to load such a file ("AddInitializedOrtValue Attempt to replace
    the existing tensor"): a file that is to be verified and deployed with the setting needs
    its own zero point per weight. The values are the same; only names change."""

    name = "weight zero points of their own"

    @staticmethod
    def _shared(graph: Any) -> list[tuple[list[Any], Any]]:
        """([the weight's Q/DQ nodes], zero point) for each weight whose zero point other
        nodes use too: a DequantizeLinear of an int8 initializer, or of a QuantizeLinear of a
        float initializer (ONNX Runtime folds that into an int8 initializer)."""
        out = []
        inits = graph.initializers
        for node in graph:
            if node.op_type != "DequantizeLinear" or len(node.inputs) < 3:
                continue
            x, zp = node.inputs[0], node.inputs[2]
            if x is None or zp is None or zp.name not in inits:
                continue
            group = [node]
            q = x.producer()
            if q is not None and q.op_type == "QuantizeLinear" and len(q.inputs) >= 3 \
                    and q.inputs[0] is not None and q.inputs[0].name in inits \
                    and q.inputs[2] is zp:
                group.append(q)
            elif x.name not in inits:
                continue  # an activation's
            if len(zp.uses()) > len(group):
                out.append((group, zp))
        return out

    def check(self, model: Any) -> str | None:
        """None when a weight's Q/DQ shares its zero point with other nodes."""
        if self._shared(model.graph):
            return None
        return "no weight's QuantizeLinear/DequantizeLinear shares its zero point"

    def apply(self, model: Any) -> int:
        """Give each such weight's Q/DQ a copy of its own (the last users keep the original);
        the count."""
        import onnx_ir as ir

        graph, n = model.graph, 0
        for group, zp in self._shared(graph):
            if len(zp.uses()) <= len(group):
                continue
            copy = ir.Value(name=f"{zp.name}_{group[0].name or n}", type=zp.type,
                            shape=zp.shape, const_value=zp.const_value)
            graph.register_initializer(copy)
            for node in group:
                node.replace_input_with(2, copy)
            n += 1
        return n


# -- float twins: what PyTorch's quantized kernels compute, in ops torch.onnx translates ---------
def _qdq(x: torch.Tensor, scale: float, zp: int, lo: int, hi: int,
         dtype: torch.dtype) -> torch.Tensor:
    """quantize + dequantize per tensor with quantized_decomposed ops (ONNX QDQ)."""
    ops = quantized_decomposed()
    q = ops.quantize_per_tensor.default(x, float(scale), int(zp), lo, hi, dtype)
    return ops.dequantize_per_tensor.default(q, float(scale), int(zp), lo, hi, dtype)


class _Weight(torch.nn.Module):
    """A quantized weight as QDQ: its integers (an int8 buffer, ONNX initializer) dequantized
    by quantized_decomposed ops (ONNX DequantizeLinear), per tensor or per channel."""

    def __init__(self, w: torch.Tensor, unsigned: bool = False) -> None:
        super().__init__()
        # unsigned: an int8 weight held as uint8 q + 128 with its zero point + 128 (the same
        # values). ONNX Runtime's x86-64 optimizer with session.x64quantprecision converts an
        # int8 weight to uint8 once per DequantizeLinear, and a weight whose DequantizeLinear
        # feeds several nodes (a recurrent weight at every time step) is duplicated per node
        # first: the second conversion fails to load ("Attempt to replace the existing
        # tensor"). A uint8 weight is not converted.
        shift = 128 if unsigned and w.dtype == torch.qint8 else 0
        self.register_buffer("q", (w.int_repr().to(torch.int16) + shift).to(
            torch.uint8) if shift else w.int_repr())
        signed = w.dtype == torch.qint8 and not shift
        self.lo, self.hi = (-128, 127) if signed else (0, 255)
        self.dtype = torch.int8 if signed else torch.uint8
        self.axis: int | None = None
        if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            self.axis = int(w.q_per_channel_axis())
            self.register_buffer("scale", w.q_per_channel_scales().float())
            self.register_buffer("zp", w.q_per_channel_zero_points().to(torch.int64) + shift)
        else:
            self.scale_value = float(w.q_scale())
            self.zp_value = int(w.q_zero_point()) + shift

    def forward(self) -> torch.Tensor:
        ops = quantized_decomposed()
        if self.axis is not None:
            return ops.dequantize_per_channel.default(self.q, self.scale, self.zp, self.axis,
                                                      self.lo, self.hi, self.dtype)
        return ops.dequantize_per_tensor.default(self.q, self.scale_value, self.zp_value,
                                                 self.lo, self.hi, self.dtype)


class _DynamicLinear(torch.nn.Module):
    """quantized::linear_dynamic (eager quantize_dynamic's Linear, fbgemm/x86) in float ops:
    the activation quantized per tensor to uint8 with the range PyTorch chooses for it
    (0..127: reduce_range; the zero point fbgemm's ChooseQuantizationParams nudges), times the
    dequantized int8 weight, plus the float bias. The integer products are exact in float32
    (|q| <= 255 x 128), so only the float sum's rounding differs from PyTorch's int32 one."""

    def __init__(self, mod: torch.nn.Module) -> None:
        super().__init__()
        self.weight = _Weight(mod.weight())
        b = mod.bias()
        self.bias = None if b is None else torch.nn.Parameter(b.detach().clone(), False)
        self.qmax = 127 if (mod.version is None or mod.version >= 4) else 255

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dynamic_linear(x, self.weight, self.bias, self.qmax)


def _dynamic_linear(x: torch.Tensor, w: _Weight, b: torch.Tensor | None, qmax: int
                    ) -> torch.Tensor:
    """quantized::linear_dynamic: x quantized per tensor (_dynamic_qdq) times the dequantized
    weight, plus the bias, as a 2-D product. An input of more dims is flattened to rows first:
    ONNX Runtime's graph optimizer (extended level) turns a DequantizeLinear feeding a MatMul
    into com.microsoft MatMulNBits, which by default (session.qdq_matmulnbits_accuracy_level
    4) quantizes the activation again to int8 per block: 1e-3 off PyTorch's run on a dynamic
    LSTM's input projection. A Gemm keeps the exact float product."""
    lead = x.shape[:-1]
    y = torch.nn.functional.linear(_dynamic_qdq(x, qmax).reshape(-1, x.shape[-1]), w(), b)
    return y.reshape(*lead, y.shape[-1])


def _dynamic_qdq(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """x quantized and dequantized per tensor to uint8 0..qmax with the scale and zero point
    fbgemm's dynamic quantization chooses (ChooseQuantizationParams: the range widened to hold
    0, the zero point taken from the end with the smaller error and rounded; x times the
    inverse scale rounded half to even), in float ops."""
    q = float(qmax)
    lo = torch.clamp(x.min(), max=0.0)
    hi = torch.clamp(x.max(), min=0.0)
    scale = (hi - lo) / q
    scale = torch.where(scale == 0, torch.full_like(scale, 0.1), scale)
    zp_lo, zp_hi = -lo / scale, q - hi / scale
    err_lo, err_hi = torch.abs(lo / scale), q + torch.abs(hi / scale)
    zp = torch.clamp(torch.round(torch.where(err_lo < err_hi, zp_lo, zp_hi)), 0.0, q)
    xq = torch.clamp(torch.round(x * (1.0 / scale)) + zp, 0.0, q)
    return (xq - zp) * scale


class _DynamicRNN(torch.nn.Module):
    """quantize_dynamic's LSTM / GRU (quantized::quantized_lstm / quantized_gru, fbgemm/x86)
    in float ops, as ATen's CPU loop computes it: per layer and direction, the input sequence's
    projection is one dynamic Linear over all time steps at once (the activation quantized
    per tensor over the whole sequence), then at each time step the hidden state is quantized
    on its own for the recurrent Linear, and the gates are float (sigmoid/tanh). The time loop
    is unrolled at the example's sequence length."""

    def __init__(self, mod: torch.nn.Module) -> None:
        super().__init__()
        self.mode = "LSTM" if type(mod).__name__ == "LSTM" else "GRU"
        self.layers, self.hidden = int(mod.num_layers), int(mod.hidden_size)
        self.dirs = 2 if mod.bidirectional else 1
        self.batch_first = bool(mod.batch_first)
        cells = torch.nn.ModuleList()
        for i, packed in enumerate(mod._all_weight_values):
            state = packed.param.__getstate__()[0]
            lin_ih, lin_hh = state[4][0].__getstate__()[0], state[4][1].__getstate__()[0]
            reduce_range = bool(state[3][0]) if state[3] else False
            cell = torch.nn.Module()
            cell.w_ih, cell.w_hh = _Weight(lin_ih[0], True), _Weight(lin_hh[0], True)
            for name, b in (("b_ih", lin_ih[1]), ("b_hh", lin_hh[1])):
                cell.register_buffer(name, None if b is None else b.detach().float().clone())
            cell.qmax = 127 if reduce_range else 255
            cells.append(cell)
        self.cells = cells

    def _step(self, cell: torch.nn.Module, xw: torch.Tensor, h: torch.Tensor,
              c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        hw = _dynamic_linear(h, cell.w_hh, cell.b_hh, cell.qmax)
        if self.mode == "LSTM":
            i, f, g, o = (hw + xw).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c
        xr, xz, xn = xw.chunk(3, 1)
        hr, hz, hn = hw.chunk(3, 1)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + hn * torch.sigmoid(xr + hr))
        return (h - n) * z + n, None

    def forward(self, x: torch.Tensor, hx: Any = None) -> Any:
        if self.batch_first:
            x = x.transpose(0, 1)
        n = self.layers * self.dirs
        zeros = x.new_zeros(n, x.shape[1], self.hidden)
        if self.mode == "LSTM":
            h0, c0 = (zeros, zeros) if hx is None else hx
        else:
            h0, c0 = (zeros if hx is None else hx), None
        hs, cs = [], []
        for layer in range(self.layers):
            outs = []
            for d in range(self.dirs):
                k = layer * self.dirs + d
                cell = self.cells[k]
                xw = _dynamic_linear(x, cell.w_ih, cell.b_ih, cell.qmax)  # all steps at once
                h, c = h0[k], None if c0 is None else c0[k]
                steps = range(x.shape[0] - 1, -1, -1) if d else range(x.shape[0])
                ys: list[torch.Tensor] = []
                for t in steps:
                    h, c = self._step(cell, xw[t], h, c)
                    ys.append(h)
                outs.append(torch.stack(ys[::-1] if d else ys))
                hs.append(h)
                cs.append(c)
            x = torch.cat(outs, 2) if self.dirs > 1 else outs[0]
        y = x.transpose(0, 1) if self.batch_first else x
        if self.mode == "LSTM":
            return y, (torch.stack(hs), torch.stack(cs))
        return y, torch.stack(hs)


class _StaticQuantize(torch.nn.Module):
    """A QuantStub's Quantize: QDQ with its scale and zero point."""

    def __init__(self, mod: torch.nn.Module) -> None:
        super().__init__()
        self.scale, self.zp = float(mod.scale), int(mod.zero_point)
        self.dtype = mod.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.qint8:
            return _qdq(x, self.scale, self.zp, -128, 127, torch.int8)
        return _qdq(x, self.scale, self.zp, 0, 255, torch.uint8)


class _StaticOp(torch.nn.Module):
    """Eager static Conv2d / ConvReLU2d / Linear / LinearReLU (quantized::conv2d...): the float
    op on the dequantized input and weight, then QDQ with the module's output scale and
    zero point (uint8)."""

    def __init__(self, mod: torch.nn.Module) -> None:
        super().__init__()
        self.weight = _Weight(mod.weight())
        b = mod.bias()
        self.bias = None if b is None else torch.nn.Parameter(b.detach().clone(), False)
        self.relu = "ReLU" in type(mod).__name__
        self.scale, self.zp = float(mod.scale), int(mod.zero_point)
        self.conv = None
        if hasattr(mod, "stride"):
            self.conv = dict(stride=mod.stride, padding=mod.padding, dilation=mod.dilation,
                             groups=mod.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight()
        y = (torch.nn.functional.conv2d(x, w, self.bias, **self.conv) if self.conv is not None
             else torch.nn.functional.linear(x, w, self.bias))
        if self.relu:
            y = torch.relu(y)
        return _qdq(y, self.scale, self.zp, 0, 255, torch.uint8)


class _Identity(torch.nn.Module):
    """DeQuantize: the twin's tensors are float (dequantized) already."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _twin_of(mod: torch.nn.Module) -> torch.nn.Module | None:
    name, package = type(mod).__name__, type(mod).__module__
    if package.startswith(("torch.ao.nn.quantized.dynamic", "torch.nn.quantized.dynamic")):
        if name == "Linear" and mod._packed_params.dtype == torch.qint8:
            return _DynamicLinear(mod)
        if name in ("LSTM", "GRU") and mod.dtype == torch.qint8:
            return _DynamicRNN(mod)
        return None
    if name == "Quantize":
        return _StaticQuantize(mod)
    if name == "DeQuantize":
        return _Identity()
    if name in ("Conv2d", "ConvReLU2d", "Linear", "LinearReLU") and \
            getattr(mod, "padding_mode", "zeros") == "zeros":
        return _StaticOp(mod)
    return None


# ops that PyTorch computes on a quantized tensor's integers exactly as on its dequantized
# values (the same scale and zero point out): they may stand between quantized modules in an
# FX graph and stay as they are in its twin
_EXACT_FUNCTIONS = (torch.flatten, torch.reshape, torch.relu, torch.nn.functional.relu,
                    torch.nn.functional.max_pool2d, torch.transpose, torch.permute)
_EXACT_METHODS = ("flatten", "reshape", "view", "relu", "permute", "transpose", "contiguous")
_EXACT_MODULES = (torch.nn.ReLU, torch.nn.MaxPool2d, torch.nn.Flatten, torch.nn.Identity)


def _fx_twin(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """The float twin of an FX-quantized GraphModule (prepare_fx + convert_fx): each
    ``torch.quantize_per_tensor`` call becomes QDQ with its scale and zero point, each
    ``dequantize`` an identity, each quantized module becomes its twin (_twin_of); None when a
    quantized tensor meets anything else (``torch.ops.quantized.add``, a float op that
    requantizes, such as sigmoid: OM211 stands)."""
    import copy
    import types

    from torch.fx.graph_module import _get_attr

    graph = copy.deepcopy(gm.graph)
    root: dict[str, Any] = {}
    quantized: set[torch.fx.Node] = set()

    def value(a: Any) -> Any:
        return _get_attr(gm, a.target) if isinstance(a, torch.fx.Node) else a

    for node in list(graph.nodes):
        on_q = any(a in quantized for a in node.all_input_nodes)
        if node.op == "get_attr":
            root[node.target] = _get_attr(gm, node.target)
        elif node.op == "call_module":
            mod = gm.get_submodule(node.target)
            twin = _twin_of(mod) if _is_quantized_module(mod) else mod
            if twin is None or (twin is mod and on_q and not isinstance(mod, _EXACT_MODULES)):
                return None
            root[node.target] = twin
            if twin is not mod and type(mod).__name__ != "DeQuantize" or on_q:
                quantized.add(node)
        elif node.op == "call_function" and node.target is torch.quantize_per_tensor:
            x, scale, zp, dtype = [*node.args, *node.kwargs.values()][:4]
            name = f"onnxmedic_quantize_{len(root)}"
            root[name] = _StaticQuantize(types.SimpleNamespace(
                scale=float(value(scale)), zero_point=int(value(zp)), dtype=value(dtype)))
            with graph.inserting_before(node):
                new = graph.call_module(name, (x,))
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            quantized.add(new)
        elif node.op == "call_method" and node.target == "dequantize":
            name = f"onnxmedic_dequantize_{len(root)}"  # float from here on, in both models
            root[name] = _Identity()
            with graph.inserting_before(node):
                new = graph.call_module(name, (node.args[0],))
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        elif on_q:
            if node.target in _EXACT_FUNCTIONS or node.target in _EXACT_METHODS:
                quantized.add(node)
            else:
                return None
    twin = torch.fx.GraphModule(root, graph)
    twin.graph.eliminate_dead_code()  # the scales' and zero points' get_attr
    twin.recompile()
    return twin


def float_twin(model: Any) -> torch.nn.Module | None:
    """A copy of an eager torch.ao quantized model whose quantized modules are replaced by
    float ops (QDQ) that compute what their kernels compute - exported in its place and
    verified against the quantized model's own run - or None when one has no twin
    (QFunctional, an FX graph's quantized add, a float16 dynamic LSTM...: OM211 stands) or
    the model is not quantized. An FX-quantized model's twin is its graph rewritten
    (_fx_twin)."""
    import copy

    if not isinstance(model, torch.nn.Module):
        return None
    if isinstance(model, torch.fx.GraphModule) and _fx_quantized_calls(model):
        return _fx_twin(model)
    if _fx_quantized_calls(model):
        return None
    found: list[tuple[str, torch.nn.Module]] = []
    for path, mod in model.named_modules():  # the outermost quantized modules
        if _is_quantized_module(mod) and not any(path.startswith(p + ".") for p, _ in found):
            found.append((path, mod))
    if not found or any(t.is_quantized for t in [*model.buffers(), *model.parameters()]):
        return None
    twins = {path: _twin_of(mod) for path, mod in found}
    if any(t is None for t in twins.values()):
        return None
    twin = copy.copy(model)
    twin._modules = dict(model._modules)  # a shallow copy: the user's model is not touched
    for path, new in sorted(twins.items(), key=lambda kv: kv[0].count(".")):
        parent = twin
        *head, last = path.split(".")
        for part in head:  # copy each parent on the way down once
            child = copy.copy(parent._modules[part])
            child._modules = dict(child._modules)
            parent._modules[part] = child
            parent = child
        parent._modules[last] = new
    return twin


def twin_finding(model: torch.nn.Module) -> Finding:
    """OM620: an eager or FX torch.ao quantized model exported through its float twin."""
    from onnxmedic.findings import info

    kernels = _quantized_modules(model)
    for op, at in _fx_quantized_calls(model).items():
        kernels.setdefault(op, []).extend(at)
    where = [f"{op}: {listed(w, 4)}" for op, w in kernels.items()]
    mode = "FX" if isinstance(model, torch.fx.GraphModule) else "eager"
    return info(
        "OM620", STAGE, f"the model is quantized with torch.ao ({mode}); PyTorch's quantized "
        f"kernels ({listed(where, 6)}) are exported as the integer arithmetic they compute, "
        "in ONNX ops: dynamic Linear as the activation's uint8 quantization (PyTorch's range "
        "and zero point) in float ops times the DequantizeLinear of the int8 weight; a "
        "dynamic LSTM/GRU as that at each time step of its recurrence (unrolled at the "
        "example's sequence length), with float gates; static modules as QDQ around the "
        "float op. The file is verified against the quantized "
        "model's own run, within one quantization step of a DequantizeLinear output.",
        details={"kernels": kernels},
        suggestion="Nothing to do. The dynamic Linear, LSTM and GRU compute in float32 "
        "(exact integer "
        "products), not with ONNX Runtime's int8 kernels; for int8 speed in ONNX Runtime "
        "export the float model with `--optimize --precision int8`.")
