"""Check a translation against PyTorch: export one op call, run it in ONNX Runtime, compare.

Used by the op-test tables (tests/ops) and the OpInfo coverage harness (bench/). Runs ONNX
Runtime in-process for speed: these are onnxmedic's own tests, not untrusted models.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
import torch.utils._pytree as pytree

from onnxmedic._tensors import flatten_tensors, to_numpy
from onnxmedic.ops._registry import REGISTRY, TranslationRegistry
from onnxmedic.verify.compare import OutputComparison, compare_outputs


class _CallOp(torch.nn.Module):
    """forward(*tensors) rebuilds the call's arguments and calls ``fn``."""

    def __init__(self, fn: Callable[..., Any], spec: Any, consts: list[Any], slots: list[int]):
        super().__init__()
        self.fn = fn
        self.spec = spec
        self.consts = consts
        self.slots = slots

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.consts)
        for slot, t in zip(self.slots, tensors):
            leaves[slot] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)


def wrap_call(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A module whose forward calls ``fn(*args, **kwargs)`` with the tensors as inputs."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = tuple(leaves[i] for i in slots)
    consts = [None if i in slots else leaf for i, leaf in enumerate(leaves)]
    return _CallOp(fn, spec, consts, slots), tensors


def export_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    registry: TranslationRegistry | None = REGISTRY,
    opset: int | None = None,
) -> tuple[onnx.ModelProto, tuple[torch.Tensor, ...]]:
    """Export ``fn(*args, **kwargs)``; ``registry=None`` exports with plain torch.onnx."""
    from onnxmedic.translate import onnx_export

    if registry is not None:
        registry.load_builtin()  # before capture: a family may make an op traceable
    module, tensors = wrap_call(fn, args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, tensors, strict=False)
    program = onnx_export(ep, tensors, None, registry=registry, opset=opset)
    return program.model_proto, tensors


def run_onnx(model: onnx.ModelProto, tensors: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    """Run in-process in ONNX Runtime (CPU) with the model's inputs fed in order."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(
        model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    from onnxmedic._sandbox_worker import _from_ortvalue, _to_ortvalue

    names = [i.name for i in sess.get_inputs()]
    feeds = {n: _to_ortvalue(ort, np, to_numpy(t)) for n, t in zip(names, tensors)}
    return [_from_ortvalue(np, v) for v in sess.run_with_ort_values(None, feeds)]


@dataclass
class OpCheck:
    """The result of checking one call: where it failed, or the comparison per output."""

    stage: str  # "passed", "eager", "export", "runtime", "compare"
    error: str = ""
    comparisons: list[OutputComparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.stage == "passed"

    @property
    def max_abs(self) -> float:
        return max((c.max_abs for c in self.comparisons), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((c.max_rel for c in self.comparisons), default=0.0)


def check_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    tolerance: tuple[float, float] | None = None,
    registry: TranslationRegistry | None = REGISTRY,
    opset: int | None = None,
) -> OpCheck:
    """Export, run and compare one call. Never raises for a failure of the translation."""
    try:
        with torch.no_grad():
            expected = flatten_tensors(fn(*args, **(kwargs or {})))
    except Exception as e:
        return OpCheck("eager", f"{type(e).__name__}: {e}")
    try:
        model, tensors = export_call(fn, args, kwargs, registry=registry, opset=opset)
    except Exception as e:
        return OpCheck("export", _short(e))
    try:
        actual = run_onnx(model, tensors)
    except Exception as e:
        return OpCheck("runtime", _short(e))
    comps = compare_outputs(
        [f"out{i}" for i in range(len(expected))], [to_numpy(t) for t in expected], actual,
        tolerance=tolerance,
    )
    if all(c.ok for c in comps):
        return OpCheck("passed", comparisons=comps)
    bad = next(c for c in comps if not c.ok)
    return OpCheck(
        "compare",
        f"{bad.name}: {bad.reason}; max abs {bad.max_abs:.3g}, max rel {bad.max_rel:.3g}",
        comps,
    )


def _short(e: BaseException) -> str:
    """The innermost useful line of an exporter error."""
    text = f"{type(e).__name__}: {e}"
    for line in str(e).splitlines():
        if "No ONNX function found" in line or "DispatchError" in line:
            return line.strip()[:500]
    cause = e.__cause__
    while cause is not None and cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is not None:
        text = f"{type(cause).__name__}: {cause}"
    return text.strip().splitlines()[0][:500] if text.strip() else type(e).__name__
