"""What one export carries from stage to stage: the request (ExportOptions) and what the stages
have made so far (ExportContext). Stages read and fill it; pipeline.py runs them in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic import borrow
from onnxmedic.inputs import Inputs
from onnxmedic.result import ExportResult


@dataclass
class ExportOptions:
    """export()'s options, checked by api.export."""

    f: Any = None
    dynamic_shapes: Any = None
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
    on_stage: Any = None  # called with each stage's name as it starts (progress display)


@dataclass
class ExportContext:
    """One export in progress."""

    result: ExportResult
    model: Any
    given_args: tuple[Any, ...]  # pristine copies of the example inputs (never run)
    given_kwargs: dict[str, Any]
    opts: ExportOptions
    worker: Any = None  # sandbox.Worker started ahead (imports ONNX Runtime during capture)
    ahead: Any = None  # verify.ahead.Ahead: the input sets' outputs computed during translation
    state: Any = None  # borrow.State: the model as export found it (put back at the end)
    expected: list[np.ndarray] | None = None  # the example's outputs in PyTorch (preflight)
    opset: int | None = None  # the opset to export (fixes.opset.plan_opset, resolve_opset)
    opset_bound: str = "asked for"  # what set it
    opset_lowered_from: int | None = None  # the default opset, when kernels lowered it (OM325)
    program: Any = None  # the captured ExportedProgram
    str_dims: Any = None  # string dims to rename the ONNX axes to
    requested_dims: Any = None  # the dynamic shapes asked for ("auto"/dynamic_axes completed)
    branch_probe: bool = False  # capture specialised a data-dependent branch
    mask_probe: bool = False  # capture took a branch through a boolean mask (capture.masked)
    # (input dim, guard, stack) of the capture's guards that divide an input dim (``//``, Mod)
    size_guards: list[Any] = field(default_factory=list)
    auto_dims: bool = False  # dynamic_shapes="auto"
    onnx_program: Any = None  # torch.onnx.ONNXProgram
    tmp_dir: Path | None = None  # the model is saved here until it is published
    onnx_path: Path | None = None
    verified: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

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
