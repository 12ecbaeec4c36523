"""What one export carries from stage to stage: the request (ExportOptions) and what the stages
have made so far (ExportContext). Stages read and fill it; pipeline.py runs them in order."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch

from onnxmedic import borrow, sandbox
from onnxmedic.findings import Finding
from onnxmedic.inputs import Inputs
from onnxmedic.result import ExportResult

# torch.export's dynamic_shapes (a dict by argument name, or a tuple/list by position), or the
# string forms export() takes ("auto"; dims named by strings)
DynamicShapes: TypeAlias = "dict[str, Any] | tuple[Any, ...] | list[Any] | str"


@dataclass(frozen=True)
class OptimizeRequest:
    """``export(..., optimize=True)``'s options for the optimize stage, checked by api.export
    (see onnxmedic.optimize.optimize)."""

    precision: str = "fp32"
    target: str = "cpu"  # as given: "cpu:avx2" names the int8 settings' instruction set
    accuracy: str | float | None = None
    cuda_graph: str = "auto"  # optimize.graphs.GRAPH_MODES
    calibration: Any = None  # input sets for static int8 (optimize's calibration=)


@dataclass(frozen=True)
class Rerun:
    """A stage's request to run the pipeline again from the earlier stage ``start`` (one it
    declares in its ``Stage.reruns``), and the finding that says why. The driver, not the
    stage, replaces what the stages run again had found."""

    start: str
    finding: Finding


@dataclass
class ExportOptions:
    """export()'s options, checked by api.export."""

    f: str | os.PathLike[str] | None = None
    dynamic_shapes: DynamicShapes | None = None
    target: str = "cpu"
    opset: int | None = None
    verify: bool = True
    keep_unverified: bool = False
    timeout: float = 120.0
    tolerance: tuple[float, float] | None = None
    explain: bool = False
    dtype_policy: str = "upcast"
    ort_version: tuple[int, int] | None = None
    localize: bool = True
    # called with each stage's name as it starts (progress display)
    on_stage: Callable[[str], None] | None = None
    optimize: OptimizeRequest | None = None  # the optional optimize stage, when asked for


@dataclass
class ExportContext:
    """One export in progress."""

    result: ExportResult
    model: torch.nn.Module | torch.export.ExportedProgram
    given_args: tuple[Any, ...]  # pristine copies of the example inputs (never run)
    given_kwargs: dict[str, Any]
    opts: ExportOptions
    # started ahead: it imports ONNX Runtime during capture
    worker: sandbox.Runner | None = None
    state: borrow.State | None = None  # the model as export found it (put back at the end)
    expected: list[np.ndarray] | None = None  # the example's outputs in PyTorch (preflight)
    opset: int | None = None  # the opset to export (stages.plan.plan_opset, fixes.opset.resolve_opset)
    opset_bound: str = "asked for"  # what set it
    opset_lowered_from: int | None = None  # the default opset, when kernels lowered it (OM325)
    program: torch.export.ExportedProgram | None = None  # what capture made
    str_dims: DynamicShapes | None = None  # string dims to rename the ONNX axes to
    # the dynamic shapes asked for ("auto"/dynamic_axes completed)
    requested_dims: DynamicShapes | None = None
    branch_probe: bool = False  # capture specialised a data-dependent branch
    mask_probe: bool = False  # capture took a branch through a boolean mask (capture.masked)
    # (input dim, guard, stack) of the capture's guards that divide an input dim (``//``, Mod)
    size_guards: list[tuple[str, str, list[Any]]] = field(default_factory=list)
    auto_dims: bool = False  # dynamic_shapes="auto"
    onnx_program: torch.onnx.ONNXProgram | None = None
    tmp_dir: Path | None = None  # the model is saved here until it is published
    onnx_path: Path | None = None
    verified: bool = False
    rerun: Rerun | None = None  # set by a stage that asks to run earlier stages again
    # capture on fake weights: the model's real tensors by name, bound in at translation
    real_weights: dict[str, torch.Tensor] | None = None
    # an eager torch.ao quantized model: capture takes its float twin (quantized.float_twin),
    # and the file is judged against this, the quantized model's own run
    judged_against: torch.nn.Module | None = None

    @property
    def args(self) -> tuple[Any, ...]:
        """A fresh copy of the positional example inputs: each run of the model gets its own
        (a model that writes an input changes only its copy; see borrow.copy_inputs)."""
        return borrow.copy_inputs(self.given_args)

    @property
    def kwargs(self) -> dict[str, Any]:
        """A fresh copy of the keyword example inputs (see ``args``)."""
        return borrow.copy_inputs(self.given_kwargs)

    @property
    def example(self) -> Inputs:
        """A fresh copy of the example inputs (see ``args``)."""
        args, kwargs = borrow.copy_inputs((self.given_args, self.given_kwargs))
        return Inputs(args, kwargs)

    @property
    def dest(self) -> Path | None:
        return Path(self.opts.f) if self.opts.f is not None else None

    @property
    def name(self) -> str:
        return self.dest.name if self.dest is not None else "model.onnx"
