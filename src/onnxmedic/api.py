"""The public API: export(), verify(), doctor(), run(), reduce(), localize() and sweep().

Each entry point checks its arguments, builds the result (and, for export, the context), runs
the stages - which live in the modules named after them (see pipeline.py) - and writes the
report. The CLI is a thin shell over these.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onnxmedic import borrow, sandbox
from onnxmedic.context import ExportContext, ExportOptions, OptimizeRequest
from onnxmedic.doctor import doctor_stages, run_stages
from onnxmedic.findings import info, listed
from onnxmedic.fixes.opset import parse_ort_version
from onnxmedic.inputs import Inputs, dynamic_names_problem
from onnxmedic.onnxfile import load_checked, opset_of
from onnxmedic.optimize.passes import calibration_error, precision_error, unused_precision
from onnxmedic.pipeline import run_export
from onnxmedic.reduction import reduce_stages
from onnxmedic.report import write_report
from onnxmedic.report.files import report_path_problem
from onnxmedic.report.repro import write_repro
from onnxmedic.result import (
    STAGES,
    ExportResult,
    RunResult,
    VerifyResult,
    stages_of,
)
from onnxmedic.stages.verify import verify_file
from onnxmedic.sweep import SweepResult, ZooCase, sweep  # sweep(): a zoo, in worker processes

TARGETS = ("cpu", "cuda", "tensorrt")
DTYPE_POLICIES = ("keep", "upcast", "boundary")

__all__ = ["STAGES", "TARGETS", "ExportResult", "RunResult", "SweepResult", "VerifyResult",
           "ZooCase", "doctor", "export", "localize", "reduce", "run", "sweep", "verify"]


def _check_args(model: Any, args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not isinstance(model, (torch.nn.Module, torch.export.ExportedProgram)):
        raise TypeError(f"onnxmedic.export: model must be a torch.nn.Module or an "
                        f"ExportedProgram, not {type(model).__name__}")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise TypeError(f"onnxmedic.export: args must be a tuple of example inputs, e.g. (x,), "
                        f"not {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise TypeError(f"onnxmedic.export: kwargs must be a dict, not {type(kwargs).__name__}")
    return args, kwargs


def _check_choice(fn: str, what: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"onnxmedic.{fn}: {what} must be one of {', '.join(choices)}, not "
                         f"{value!r}")


def _base_target(target: Any) -> str:
    """export's ``target`` without an instruction set (``"cpu:avx2"`` -> ``"cpu"``; the
    instruction set picks optimize's int8 settings, onnxmedic/isa.py); ValueError for a
    target or instruction set it does not take."""
    from onnxmedic.isa import ISAS, split_target

    try:
        base, _ = split_target(target) if isinstance(target, str) else (target, None)
    except ValueError:
        base = None
    if base not in TARGETS:
        raise ValueError(f"onnxmedic.export: target must be one of {', '.join(TARGETS)} "
                         f"(or cpu:{', cpu:'.join(ISAS)}), not {target!r}")
    return base


def _report_problem(result: ExportResult, report: str | os.PathLike[str] | None) -> bool:
    """Fail fast when the report cannot be written where asked (nothing else runs)."""
    if report is None:
        return False
    bad = report_path_problem(report)
    if bad is not None:
        result.findings.append(bad)
        result.ok = False
    return bad is not None


def _check_repro(fn: str, repro: Any, model_spec: str | None) -> None:
    if repro is not None and not model_spec:
        raise ValueError(f"onnxmedic.{fn}: repro= needs model_spec= (the 'file.py:Attr' or "
                         "'package.module:attr' the script loads the model from)")


def _write_repro(result: ExportResult, folder: str | os.PathLike[str], model_spec: Any,
                 args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any],
                 onnx_path: Any = None) -> None:
    """A standalone repro script for a failed export or verify (see report/repro.py)."""
    result.repro = str(write_repro(folder, result, model_spec, args, kwargs, options=options,
                                   onnx_path=onnx_path))


def _finish(result: ExportResult, report: str | os.PathLike[str] | None) -> ExportResult:
    if report is not None:
        write_report(result, report)
    return result



def _optimize_request(optimize: bool, precision: str, target: str,
                      accuracy: str | float | None, cuda_graph: bool | str,
                      calibration: Any = None) -> OptimizeRequest | None:
    """export()'s optimize options, checked before anything runs (ValueError); None without
    ``optimize``."""
    _check_choice("export", "precision", precision, ("fp32", "fp16", "int8"))
    if calibration is not None and (bad := calibration_error(precision, optimize)):
        raise ValueError(f"onnxmedic.export: {bad}")
    if bad := unused_precision(precision, optimize):
        raise ValueError(f"onnxmedic.export: {bad}")
    if not optimize:
        return None
    from onnxmedic.optimize import parse_accuracy
    from onnxmedic.optimize.graphs import graph_mode

    try:
        if bad := precision_error(precision, target):
            raise ValueError(bad)
        parse_accuracy(accuracy)
        mode = graph_mode(cuda_graph)
    except ValueError as e:
        raise ValueError(f"onnxmedic.export: {e}") from None
    return OptimizeRequest(precision=precision, target=target, accuracy=accuracy,
                           cuda_graph=mode, calibration=calibration)


def _export_in_eval(result: ExportResult, model: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any], opts: ExportOptions) -> None:
    """Run the export stages (optimize too, where asked for) with the model in eval mode; each
    submodule's own training flag is restored afterwards, whatever happens."""
    was_training = isinstance(model, torch.nn.Module) and model.training
    # each submodule's own flag, restored exactly below (not model.train(True))
    modes = borrow.module_modes(model) if was_training else []
    state = borrow.record_state(model) if isinstance(model, torch.nn.Module) else None
    try:
        with result.guard():
            if was_training:
                borrow.to_eval(model)
                result.findings.append(info(
                    "OM011", "preflight", "the model was in training mode; it is exported and "
                    "verified in eval mode (call model.eval() first to silence this)."))
            # the sandbox child imports ONNX Runtime while capture and translation run
            worker = sandbox.worker() if opts.verify else None
            try:
                run_export(ExportContext(result, model, args, kwargs, opts, worker=worker,
                                         state=state))
            finally:
                if worker is not None:
                    worker.close()
    finally:
        if was_training:
            borrow.restore_modes(modes)
        if state is not None:
            _put_back(result, state)


def _put_back(result: ExportResult, state: borrow.State) -> None:
    """The buffers and attributes the model wrote while export ran it, put back; parameters it
    wrote in place named (OM012)."""
    restored, written = borrow.restore_state(state)
    if restored or written:
        parts = []
        if restored:
            parts.append("buffers and attributes put back as they were before export: "
                         + listed(restored, 6))
        if written:
            parts.append("parameters the model wrote in place (left as written, as a plain call "
                         "would leave them): " + listed(written, 6))
        result.findings.append(info(
            "OM012", "preflight", "running the model during export changed its state; "
            + "; ".join(parts) + ".", details={"buffers": restored, "parameters": written}))


def export(
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...] = (),
    f: str | os.PathLike[str] | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    target: str = "cpu",
    opset: int | None = None,
    verify: bool = True,
    report: str | os.PathLike[str] | None = None,
    keep_unverified: bool = False,
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    tolerance: tuple[float, float] | None = None,
    explain: bool = False,
    model_spec: str | None = None,
    input_specs: list[str] | None = None,
    dtype_policy: str = "upcast",
    ort_version: str | None = None,
    localize: bool = True,
    repro: str | os.PathLike[str] | None = None,
    on_stage: Callable[[str], None] | None = None,
    optimize: bool = False,
    precision: str = "fp32",
    accuracy: str | float | None = None,
    cuda_graph: bool | str = True,
    calibration: Any = None,
) -> ExportResult:
    """Export ``model`` to ONNX, verify it in an isolated ONNX Runtime, and report.

    With ``optimize`` (and ``f``), the verified file is replaced by the fastest candidate
    variant at ``precision`` (fp32, int8, or fp16 for GPU targets) that verifies too, reduced
    precision within ``accuracy`` (e.g. ``"cosine=0.9995"``; default 0.999), with
    ``cuda_graph`` and ``calibration`` (static int8's input sets) as in
    :func:`onnxmedic.optimize.optimize`; see :mod:`onnxmedic.optimize`.

    When the outputs differ from PyTorch (OM601) and ``localize`` is on, the first divergent
    node is localised (OM610); this costs nothing when the model verifies.

    Problems of the model become findings in the returned :class:`ExportResult` (``ok`` is True
    only when the model was exported *and* verified). With ``f``, the file is written atomically
    and only when verified (or when ``keep_unverified``); an existing file is never replaced by
    an unverified model. ``report`` writes a .json or .html report, whatever the outcome.
    ``dtype_policy`` (upcast, boundary or keep) says how nodes without a kernel on ``target``
    for their dtype (bfloat16 Gemm on CPU) are repaired; see :mod:`onnxmedic.fixes.dtypes`.
    ``repro``: a folder; when the export fails, a standalone repro script is written there
    (``result.repro``; needs ``model_spec``, the spec the script loads the model from).
    ``on_stage``: called with each stage's name as it starts (the CLI's progress display).
    """
    args, kwargs = _check_args(model, args, kwargs)
    _check_repro("export", repro, model_spec)
    named, target = target, _base_target(target)  # "cpu:avx2": the int8 settings' ISA
    _check_choice("export", "dtype_policy", dtype_policy, DTYPE_POLICIES)
    optimizing = _optimize_request(optimize, precision, named, accuracy, cuda_graph,
                                   calibration)
    if bad := dynamic_names_problem(model, dynamic_shapes, args, kwargs):
        raise ValueError(f"onnxmedic.export: {bad}")
    opts = ExportOptions(f=f, dynamic_shapes=dynamic_shapes, target=target, opset=opset,
                         verify=verify, keep_unverified=keep_unverified, timeout=timeout,
                         tolerance=tolerance, explain=explain, dtype_policy=dtype_policy,
                         ort_version=parse_ort_version(ort_version, "export"),
                         localize=localize, on_stage=on_stage, optimize=optimizing)
    result = ExportResult(command="export", model=model_spec or type(model).__name__,
                          inputs=list(input_specs or []))
    if _report_problem(result, report):
        return result
    _export_in_eval(result, model, args, kwargs, opts)
    if repro is not None and not result.ok:
        _write_repro(result, repro, model_spec, args, kwargs, {
            "dynamic_shapes": dynamic_shapes, "target": target, "opset": opset,
            "timeout": timeout, "tolerance": tolerance, "dtype_policy": dtype_policy,
            "ort_version": ort_version})
    return _finish(result, report)


def verify(
    onnx_path: str | os.PathLike[str],
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...] = (),
    *,
    kwargs: dict[str, Any] | None = None,
    report: str | os.PathLike[str] | None = None,
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    tolerance: tuple[float, float] | None = None,
    model_spec: str | None = None,
    input_specs: list[str] | None = None,
    localize: bool = False,
    repro: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Compare an existing ONNX file with the PyTorch model on the example inputs and further
    seeded input sets, with ONNX Runtime in the sandbox.

    ``localize``: also compare every intermediate value the ONNX file shares (by name) with the
    model's torch.export program, and name the first divergent node (OM610) and the nodes that
    grow the error most (``result.localization``). ``repro``: as for export()."""
    args, kwargs = _check_args(model, args, kwargs)
    _check_repro("verify", repro, model_spec)
    result = ExportResult(command="verify", path=str(onnx_path),
                          model=model_spec or type(model).__name__,
                          inputs=list(input_specs or []),
                          stages=stages_of(*(s for s in STAGES
                                             if s not in ("capture", "translate", "write"))))
    if _report_problem(result, report):
        return result
    with result.guard():
        with result.stage("check", conclude=False) as st:
            proto, bad = load_checked(onnx_path, stage="check")
            if proto is None:
                st.fail(*bad)
                return _finish(result, report)
        result.onnx_model = proto
        result.opset = opset_of(proto)
        # localisation's worker starts now too: it imports ONNX Runtime while the model is
        # verified, not after (rebuilding the program takes less than that)
        loc_worker = sandbox.worker() if localize else None
        try:
            with sandbox.worker() as worker:
                # a copy: the caller's inputs are borrowed (each run copies it again)
                verify_file(result, proto, Path(onnx_path), model,
                            Inputs(*borrow.copy_inputs((args, kwargs))),
                            timeout, tolerance, worker, localize, loc_worker)
        finally:
            if loc_worker is not None:
                loc_worker.close()
    if repro is not None and not result.ok:
        _write_repro(result, repro, model_spec, args, kwargs,
                     {"timeout": timeout, "tolerance": tolerance}, onnx_path=onnx_path)
    return _finish(result, report)


def doctor(
    onnx_path: str | os.PathLike[str],
    *,
    target: str = "cpu",
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    smoke_test: bool = True,
    report: str | os.PathLike[str] | None = None,
    ort_version: str | None = None,
) -> ExportResult:
    """Lint an ONNX file for a target runtime, without PyTorch: external data, opset against
    the runtime, unused initializers, dynamic dims, shape information, ops and dtypes without
    kernels, and a load-and-run smoke test with random inputs in the sandbox. ``ort_version``
    also checks opset and IR version against that ONNX Runtime release."""
    ort = parse_ort_version(ort_version, "doctor")
    _check_choice("doctor", "target", target, TARGETS)
    result = ExportResult(command="doctor", path=str(onnx_path), model=str(onnx_path),
                          stages=stages_of("load", "check", "lint", "runtime"))
    if _report_problem(result, report):
        return result
    with result.guard():
        doctor_stages(result, Path(onnx_path), target, timeout, smoke_test, ort)
    result.ok = not result.errors
    return _finish(result, report)


def run(
    onnx_path: str | os.PathLike[str],
    feeds: dict[str, np.ndarray] | list[np.ndarray],
    *,
    cast: str = "no",
    target: str = "cpu",
    timeout: float = sandbox.DEFAULT_TIMEOUT,
) -> RunResult:
    """Safe inference: check ``feeds`` against the model's input contract (names, dtypes,
    ranks, fixed dims), cast when ``cast`` is "safe" (lossless only) or "all", then run in the
    sandbox with a timeout."""
    if cast not in ("no", "safe", "all"):
        raise ValueError(f"onnxmedic.run: cast must be 'no', 'safe' or 'all', not {cast!r}")
    result = RunResult(command="run", path=str(onnx_path), model=str(onnx_path),
                       stages=stages_of("load", "inputs", "runtime"))
    with result.guard():
        run_stages(result, onnx_path, feeds, cast, target, timeout)
    return result


def reduce(
    onnx_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    until: str = "crash",
    timeout: float = 30.0,
    feeds: dict[str, np.ndarray] | str | os.PathLike[str] | None = None,
    reference: dict[str, np.ndarray] | str | os.PathLike[str] | None = None,
    tolerance: tuple[float, float] | None = None,
    max_runs: int = 200,
    seed: int = 0,
    report: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Shrink a failing ONNX model to a minimal subgraph that still fails, and write it to
    ``out`` with its inputs (``out``'s stem + .inputs.npz) and a standalone repro script
    (stem + .repro.py).

    ``until``: "crash" (ONNX Runtime dies), "hang" (does not finish within ``timeout``),
    "mismatch" (outputs differ from ``reference``: expected values by ONNX value name, a dict
    or .npz; by default onnx's ReferenceEvaluator), or a shell command containing ``{model}``
    (and optionally ``{inputs}``, an .npz of the feeds) that exits non-zero while the failure
    is there. ``feeds``: the model's inputs (dict or .npz); random ones by default. Every
    candidate runs in the sandbox (or as the command) with ``timeout``; at most ``max_runs``.
    ``report``: a .json or .html report of the reduction, whatever the outcome.
    """
    result = ExportResult(command="reduce", path=None, model=str(onnx_path),
                          stages=stages_of("load", "reduce", "write"))
    if _report_problem(result, report):
        return result
    with result.guard():
        reduce_stages(result, onnx_path, out, until=until, timeout=timeout, feeds=feeds,
                      reference=reference, tolerance=tolerance, max_runs=max_runs, seed=seed)
    return _finish(result, report)


def localize(
    onnx_path: str | os.PathLike[str],
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...] = (),
    *,
    kwargs: dict[str, Any] | None = None,
    report: str | os.PathLike[str] | None = None,
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    tolerance: tuple[float, float] | None = None,
) -> ExportResult:
    """verify() with localisation: ``result.localization`` holds the first node whose value in
    ONNX Runtime leaves tolerance (also finding OM610) and the top nodes by error growth."""
    return verify(onnx_path, model, args, kwargs=kwargs, report=report, timeout=timeout,
                  tolerance=tolerance, localize=True)
